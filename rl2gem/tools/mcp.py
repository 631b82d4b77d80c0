"""Tools of an MCP server as rl2gem tools: :class:`MCPServerTools` and :class:`MCPTool`.

The Model Context Protocol (https://modelcontextprotocol.io) serves tools as JSON-RPC over
stdio (a command the client launches) or Streamable HTTP (a URL). The connection is the ``mcp``
package's own :class:`mcp.Client`, run in a thread of its own with its own event loop: its
transports are anyio context managers that must stay in the task that opened them, while an
rl2gem env calls tools from whichever loop steps it (the rollout's, a vector env's, the private
loop of a synchronous ``step``). :meth:`MCPTool.call` hands the call to that thread and awaits
the answer without blocking the caller's loop.

    with MCPServerTools(["python", "my_server.py"]) as server:         # stdio
        env = ToolEnvWrapper(gym.make("rl2/Math-v0"), server.tools())
    MCPServerTools("http://127.0.0.1:8000/mcp")                         # Streamable HTTP

Results come back as text for the model: the server's text content blocks joined, the
structured content as JSON where there is no text, other blocks named (``[image/png]``). A tool
error (``isError``), a timeout or a dropped connection is returned as ``Error: ...`` text: the
episode goes on, as with every rl2gem tool.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
from collections.abc import Sequence
from typing import Any

__all__ = ["MCPServerTools", "MCPTool", "call_result_text"]


def call_result_text(result: Any) -> str:
    """The model's text of an MCP ``CallToolResult``: text blocks joined by newlines, else its
    structured content as JSON, other blocks as ``[type]`` (``[image/png]``); with ``is_error``,
    ``Error: `` first unless the text already starts so."""
    parts = []
    for block in result.content:
        if getattr(block, "type", None) == "text":
            parts.append(block.text)
        else:
            parts.append(f"[{getattr(block, 'mime_type', None) or getattr(block, 'type', 'content')}]")
    text = "\n".join(parts)
    if not text.strip() and result.structured_content is not None:
        text = json.dumps(result.structured_content, ensure_ascii=False)
    return f"Error: {text}" if result.is_error and not text.lower().startswith("error") else text


class MCPTool:
    """One tool of an MCP server (a :class:`rl2gem.tools.Tool`), called through its
    :class:`MCPServerTools` connection.

    Attributes:
        name, description: as the server lists them.
        parameters: the tool's ``inputSchema`` (JSON schema of the arguments).
        instructions: ``""``.
    """

    instructions = ""

    def __init__(self, server: MCPServerTools, name: str, description: str, parameters: dict[str, Any]):
        self.server, self.name, self.description, self.parameters = server, name, description, parameters

    async def call(self, arguments: dict[str, Any]) -> str:
        return await self.server.call(self.name, arguments)

    async def aclose_copy(self) -> None:
        """Close the connection a copy made (:class:`MCPServerTools`' ``owned``): a copied
        :class:`~rl2gem.tools.ToolEnvWrapper` calls it when it closes; the connection its creator
        opened stays for the creator to close."""
        if self.server.owned:
            await asyncio.to_thread(self.server.close)

    def __repr__(self) -> str:
        return f"MCPTool({self.name!r} on {self.server.target})"


def _connection_lost(error: BaseException) -> bool:
    """Whether ``error`` says the connection to the server is gone (its process exited, its
    stream closed), not that a call failed."""
    if isinstance(error, (ConnectionError, BrokenPipeError, EOFError)):
        return True
    return "connection closed" in str(error).lower()


class MCPServerTools:
    """A connection to one MCP server, opened on first use, and its tools. A call after
    :meth:`close`, or after the connection was lost (a stdio server that exited), opens a new one.

    Args:
        server: a URL (``http://...``: Streamable HTTP), or a command and its arguments (a list of
            strings, or one string split on spaces: stdio, launched as a child process).
        env: environment variables of a stdio server (default: the MCP SDK's safe subset).
        timeout: seconds for connecting and for each call.

    A copy (``copy``, ``deepcopy``, ``pickle``) opens its own connection on first use (a stdio
    server: its own process), which it owns (``owned``): closing the copied env closes it (not the
    envs its ``spawn`` made, which share it); the original stays open until :meth:`close`.

    Raises:
        ValueError: an empty ``server``.
        ConnectionError: from :meth:`tools` when the server cannot be reached or started (the
            cause chained).
    """

    def __init__(self, server: str | Sequence[str], *, env: dict[str, str] | None = None, timeout: float = 30.0):
        if isinstance(server, str) and not server.startswith(("http://", "https://")):
            server = server.split()
        if not server:
            raise ValueError("server: a URL or a command is needed")
        self.target = server if isinstance(server, str) else " ".join(server)
        self._server, self._env, self.timeout = server, env, float(timeout)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: Any = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.owned = False

    def __getstate__(self) -> dict[str, Any]:
        """A copy has the same server and settings, and opens its own connection on first use."""
        return {"target": self.target, "_server": self._server, "_env": self._env, "timeout": self.timeout}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _loop=None, _client=None, _stop=None, _thread=None, _lock=threading.Lock())
        self.owned = True  # no one but the copied env holds it

    def _transport(self) -> Any:
        from mcp import StdioServerParameters

        if isinstance(self._server, str):
            return self._server
        return StdioServerParameters(command=self._server[0], args=list(self._server[1:]), env=self._env)

    async def _hold(self, ready: concurrent.futures.Future) -> None:
        """The connection's task, on the thread's loop: opens the client, then keeps it open until
        :meth:`close`."""
        from mcp import Client

        try:
            async with Client(self._transport(), read_timeout_seconds=self.timeout) as client:
                self._client, self._stop = client, asyncio.Event()
                ready.set_result(None)
                await self._stop.wait()
        except BaseException as error:
            if not ready.done():
                ready.set_exception(error)
        finally:
            self._client = None

    def connect(self) -> MCPServerTools:
        """Open the connection (once; later calls return at once).

        Raises:
            ConnectionError: the server cannot be reached or started within ``timeout``.
        """
        with self._lock:
            if self._client is not None:
                return self
            ready: concurrent.futures.Future = concurrent.futures.Future()
            loop = asyncio.new_event_loop()

            def run() -> None:
                asyncio.set_event_loop(loop)
                loop.run_until_complete(self._hold(ready))
                loop.close()

            thread = threading.Thread(target=run, name=f"mcp:{self.target}"[:60], daemon=True)
            thread.start()
            try:
                ready.result(timeout=self.timeout)
            except Exception as error:
                if not ready.done():  # timed out: stop the start under way (its server and thread)
                    loop.call_soon_threadsafe(lambda: [task.cancel() for task in asyncio.all_tasks(loop)])
                    thread.join(timeout=self.timeout)
                raise ConnectionError(f"MCP server {self.target}: {type(error).__name__}: {error}") from error
            self._loop, self._thread = loop, thread
        return self

    def _submit(self, function, *args) -> concurrent.futures.Future:
        """``function(*args)`` (a coroutine function) run on the connection's loop, connecting first."""
        self.connect()
        return asyncio.run_coroutine_threadsafe(function(*args), self._loop)

    def tools(self) -> list[MCPTool]:
        """The server's tools (``tools/list``, every page), connecting first.

        Raises:
            ConnectionError: as :meth:`connect`.
        """

        async def listing():
            tools, cursor = [], None
            while True:
                page = await self._client.list_tools(cursor=cursor)
                tools.extend(page.tools)
                cursor = page.next_cursor
                if not cursor:
                    return tools

        listed = self._submit(listing).result(timeout=self.timeout)
        return [MCPTool(self, t.name, t.description or "", dict(t.input_schema)) for t in listed]

    async def call(self, name: str, arguments: dict[str, Any]) -> str:
        """Call tool ``name`` (``tools/call``) from any event loop; its text (:func:`call_result_text`)
        or ``Error: ...`` (timeout, connection lost). A connection found lost (a stdio server that
        exited) is opened again and the call tried once more; connecting runs in a worker thread,
        not on the caller's loop. Never raises."""
        for attempt in range(2):
            try:
                if self._client is None:  # a first call, or after a close: the start waits off the loop
                    await asyncio.to_thread(self.connect)
                future = self._submit(self._client_call, name, arguments)
                result = await asyncio.wait_for(asyncio.wrap_future(future), self.timeout)
            except asyncio.TimeoutError:
                return f"Error: the MCP tool {name} did not answer within {self.timeout:g} s."
            except Exception as error:
                if attempt == 0 and _connection_lost(error):
                    await asyncio.to_thread(self.close)  # the next attempt opens a new connection
                    continue
                return f"Error: the MCP tool {name} failed: {type(error).__name__}: {error}"
            return call_result_text(result)
        raise AssertionError("unreachable")

    async def _client_call(self, name: str, arguments: dict[str, Any]):
        if self._client is None:
            raise ConnectionError("the connection is closed")
        return await self._client.call_tool(name, arguments)

    def close(self) -> None:
        """Close the connection (a stdio server's process ends with it); idempotent."""
        with self._lock:
            loop, thread, stop = self._loop, self._thread, self._stop
            self._loop = self._thread = self._stop = None
        if loop is not None and stop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(stop.set)
        if thread is not None:
            thread.join(timeout=self.timeout)

    def __enter__(self) -> MCPServerTools:
        return self.connect()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MCPServerTools({self.target!r})"
