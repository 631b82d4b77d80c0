"""MCP both ways: an MCP server's tools in an rl2gem env (rl2gem.tools.MCPServerTools) and an env's
tools served over MCP (python -m rl2gem.envserver ENV_ID --mcp), checked with the mcp package's
own client and server."""

import asyncio
import copy
import pickle
import sys
import textwrap

import gymnasium as gym
import psutil
import pytest
import rl2gem.envs  # noqa: F401 - registers the built-in envs
from mcp import Client, StdioServerParameters

from rl2gem import envserver
from rl2gem.procs import ServiceProcess
from rl2gem.tools import MCPServerTools, SearchTool, ToolEnvWrapper

SERVER = textwrap.dedent(
    '''
    from mcp.server import MCPServer

    server = MCPServer("arithmetic")

    @server.tool()
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @server.tool()
    def divide(a: float, b: float) -> float:
        """Divide a by b."""
        return a / b

    server.run()
    '''
)


def children_running(script: str) -> list[psutil.Process]:
    """This process's live descendants whose command line names ``script``."""
    return [
        child
        for child in psutil.Process().children(recursive=True)
        if child.is_running() and child.status() != psutil.STATUS_ZOMBIE and script in " ".join(child.cmdline())
    ]


def test_an_mcp_servers_tools_are_called_from_an_env_and_from_any_event_loop(tmp_path):
    script = tmp_path / "arithmetic_server.py"
    script.write_text(SERVER)
    server = MCPServerTools([sys.executable, str(script)], timeout=60)
    with server:
        tools = {tool.name: tool for tool in server.tools()}
        assert set(tools) == {"add", "divide"} and tools["add"].description == "Add two integers."
        assert tools["add"].parameters["required"] == ["a", "b"]
        assert len(children_running(str(script))) == 1  # the SDK launched the server as a child
        env = ToolEnvWrapper(gym.make("rl2/GuessTheNumber-v0", difficulty="easy"), list(tools.values()))
        observation, info = env.reset(seed=0)
        assert '"name": "add"' in observation and {t["function"]["name"] for t in info["tools"]} == {"add", "divide"}
        observation, reward, terminated, truncated, info = env.step(
            '<tool_call>\n{"name": "add", "arguments": {"a": 20, "b": 22}}\n</tool_call>'
        )
        assert observation == "42" and info["role"] == "tool" and not (terminated or truncated)
        observation, *_ = env.step('<tool_call>{"name": "add", "arguments": {"a": "x", "b": 1}}</tool_call>')
        assert observation.startswith("Error: invalid arguments: add:")  # the schema, checked before the call
        # the server's error (a ZeroDivisionError in the tool) comes back as text, the episode goes on
        observation, *_ = env.step('<tool_call>{"name": "divide", "arguments": {"a": 1, "b": 0}}</tool_call>')
        assert observation == "Error executing tool divide"  # the SDK's message (it hides the exception)
        # the connection lives in its own thread: callers on other event loops share it
        assert asyncio.run(tools["divide"].call({"a": 1, "b": 4})) == "0.25"
        assert asyncio.run(tools["add"].call({"a": 1, "b": 2})) == "3"
    assert not children_running(str(script))  # closing the connection ended the server's process
    assert asyncio.run(tools["add"].call({"a": 2, "b": 2})) == "4"  # a call after close connects again
    assert len(children_running(str(script))) == 1
    server.close()
    assert not children_running(str(script))
    with pytest.raises(ConnectionError, match="MCP server"):
        MCPServerTools([sys.executable, "-c", "raise SystemExit(3)"], timeout=20).tools()


def test_a_pickled_env_with_mcp_tools_opens_its_own_connection_and_the_original_keeps_its_own(tmp_path):
    script = tmp_path / "arithmetic_server.py"
    script.write_text(SERVER)
    server = MCPServerTools([sys.executable, str(script)], timeout=60)
    env = ToolEnvWrapper(gym.make("rl2/GuessTheNumber-v0", difficulty="easy"), server.tools())
    env.reset(seed=0)
    add = '<tool_call>{"name": "add", "arguments": {"a": 20, "b": 22}}</tool_call>'
    assert env.step(add)[0] == "42"
    (ours,) = children_running(str(script))
    twin = pickle.loads(pickle.dumps(env))
    copied = twin.tools["add"].server
    assert copied is not server and copied._client is None and twin.tools["divide"].server is copied
    assert twin.step(add)[0] == "42"  # its own server process, started on first use
    (theirs,) = {child.pid for child in children_running(str(script))} - {ours.pid}
    kids, _, _ = twin.spawn(2)  # they share the copy's connection: closing one leaves it open
    kids[0].close()
    assert kids[1].step(add)[0] == "42" and {c.pid for c in children_running(str(script))} == {ours.pid, theirs}
    copy.copy(twin).close()  # a shallow copy shares it too
    assert {child.pid for child in children_running(str(script))} == {ours.pid, theirs}
    twin.close()  # the copy owns its connection: closing the env ends its server's process
    assert copied.owned and not server.owned
    assert [child.pid for child in children_running(str(script))] == [ours.pid]
    assert env.step(add)[0] == "42" and env._loop.loop.is_running()
    env.close()  # the connection its creator opened stays open
    assert [child.pid for child in children_running(str(script))] == [ours.pid]
    server.close()
    assert not children_running(str(script))


async def _list_and_call(server, calls):
    """The mcp package's own client: the listed tools and each call's (text, is_error)."""
    async with Client(server, read_timeout_seconds=60) as client:
        listed = {tool.name: tool for tool in (await client.list_tools()).tools}
        results = []
        for name, arguments in calls:
            result = await client.call_tool(name, arguments)
            results.append(("\n".join(block.text for block in result.content), result.is_error))
        return listed, results


async def _search_once(query):
    tool = SearchTool(topk=2)
    try:
        return await tool.call({"query": query})
    finally:
        await tool.aclose()  # releases the embedded retrieval service this process started


def test_envserver_mcp_serves_searchqa_search_over_stdio():
    command = StdioServerParameters(
        command=sys.executable, args=["-m", "rl2gem.envserver", "rl2/SearchQA-v0", "topk=2", "--mcp"]
    )
    calls = [("search", {"query": "Afghanistan"}), ("search", {"q": "Afghanistan"}), ("no_such_tool", {})]
    listed, results = asyncio.run(_list_and_call(command, calls))
    assert set(listed) == {"search"} and listed["search"].input_schema["required"] == ["query"]
    local = asyncio.run(_search_once("Afghanistan"))  # what the env's own search returns
    assert results[0] == (local, False) and "Afghanistan" in local and "Doc 2" in local and "Doc 3" not in local
    assert results[1][1] and "'query' is a required property" in results[1][0]
    assert results[2][1] and "unknown tool 'no_such_tool'" in results[2][0]


def test_envserver_mcp_serves_the_python_sandbox_over_streamable_http():
    command = [sys.executable, "-m", "rl2gem.envserver", "rl2/PythonMath-v0", "--mcp", "http"]
    service = ServiceProcess([*command, "--port", "0", "--exit-on-stdin-eof"], ready_prefix="RL2GEM_ENVSERVER_READY")
    try:
        assert service.url.endswith("/mcp")
        calls = [("python", {"code": "print(2**10)"}), ("python", {"code": "import sys; sys.exit(1/0)"})]
        listed, results = asyncio.run(_list_and_call(service.url, calls))
    finally:
        service.stop()
    assert service.proc.returncode is not None
    assert set(listed) == {"python"}
    assert results[0] == ("1024", False)
    assert "ZeroDivisionError" in results[1][0]  # the program's error is the tool's text, not a protocol error


def test_envserver_mcp_refuses_an_env_without_tools_in_one_line(capsys):
    assert envserver.main(["rl2/GuessTheNumber-v0", "--mcp"]) == 2
    assert capsys.readouterr().err == "config error: rl2/GuessTheNumber-v0 has no tools to serve over MCP\n"


def test_a_lost_connection_is_opened_again_and_a_slow_start_does_not_block_the_loop(tmp_path):
    """After the stdio server exited every later call failed with 'Connection closed' (the dead
    connection was kept), and a first call connected on the caller's event loop, holding every
    other coroutine up while the server started."""
    script = tmp_path / "dying_server.py"
    script.write_text(
        SERVER.replace("server = MCPServer", "import os, time\ntime.sleep(1.5)\nserver = MCPServer").replace(
            "server.run()",
            '@server.tool()\ndef die() -> int:\n    """Exit."""\n    os._exit(3)\n\nserver.run()',
        )
    )
    server = MCPServerTools([sys.executable, str(script)], timeout=60)

    async def main():
        gaps, stop = [], asyncio.Event()

        async def heartbeat():
            last = asyncio.get_running_loop().time()
            while not stop.is_set():
                await asyncio.sleep(0.05)
                now = asyncio.get_running_loop().time()
                gaps.append(now - last)
                last = now

        beat = asyncio.ensure_future(heartbeat())
        await asyncio.sleep(0.1)  # the heartbeat runs
        first = await server.call("add", {"a": 1, "b": 2})  # the server takes 1.5 s to start
        stop.set()
        await beat
        died = await server.call("die", {})
        again = await server.call("add", {"a": 2, "b": 3})
        return first, max(gaps), died, again

    try:
        first, longest_gap, died, again = asyncio.run(main())
    finally:
        server.close()
    assert first == "3" and longest_gap < 0.5, (first, longest_gap)
    assert died.startswith("Error") and again == "5", (died, again)
    assert children_running(str(script)) == []
