"""The sandbox's fork server and persistent sessions, judged on the host.

The escape and limit tests (test_sandbox_escapes.py, test_sandbox.py) already run through the
fork server and sessions; these check what is particular to them: state that persists inside a
session and nowhere else, children that never outlive their call, a session that dies without
taking the server down, a server that does not grow, and the fallback where a forked child
cannot make namespaces.
"""

import asyncio
import functools
import os
import signal
import time

import pytest
from helpers import fork_servers, sandbox_pids

from rl2gem.core import Env
from rl2gem.tools import PythonSession, PythonTool, SandboxConfig, SandboxMode, ToolEnvWrapper, python, run_python
from rl2gem.tools._fork_server import close_fork_servers
from rl2gem.tools.python import sandbox_mode

HOST = sandbox_mode()
ISOLATIONS = ["audit"] + (["namespaces"] if HOST.namespaces else [])
KERNEL = HOST.seccomp and HOST.landlock > 0


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live (not zombie) process on the host."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def status(pid: int) -> dict[str, int]:
    """VmRSS (KiB) and the number of open file descriptors of ``pid``."""
    with open(f"/proc/{pid}/status") as fh:
        rss = next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:"))
    return {"rss_kib": rss, "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def our_servers() -> list[int]:
    return fork_servers(parent=os.getpid())


@pytest.fixture(autouse=True)
def fresh_servers():
    """Each test starts and ends without fork servers of this process."""
    close_fork_servers()
    yield
    close_fork_servers()


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_the_pool_is_the_default_and_sandbox_mode_says_what_it_can_do(isolation):
    async def main():
        return [
            await run_python("import random\nprint(random.random())", SandboxConfig(isolation=isolation))
            for _ in range(3)
        ]

    results = asyncio.run(main())
    assert [r.runner for r in results] == ["pool"] * 3 and all(r.ok for r in results)
    # a forked child must not inherit the server's random state
    assert len({r.stdout for r in results}) == 3
    assert "fork server: every layer" in str(HOST) or not HOST.fork_namespaces
    assert len(our_servers()) == 1


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_a_session_keeps_its_state_and_no_other_session_sees_it(isolation):
    secret = "s3cr3t-" + os.urandom(6).hex()

    async def main():
        first, second = (
            PythonSession(SandboxConfig(isolation=isolation)),
            PythonSession(SandboxConfig(isolation=isolation)),
        )
        try:
            a = await first.run(f"import os\nx = {secret!r}\nopen('notes.txt', 'w').write(x)\nprint(os.getcwd())")
            folder = a.stdout.strip()
            b = await first.run("print(x, open('notes.txt').read())")
            c = await second.run(
                "try:\n    print(x)\nexcept NameError:\n    print('no x')\n"
                f"try:\n    print(open({folder + '/notes.txt'!r}).read())\nexcept OSError as e:\n    print('refused', type(e).__name__)\n"
                "import gc\nprint(sum(1 for o in gc.get_objects() if isinstance(o, str) and o.startswith('s3cr3t')))"
            )
            return a, b, c, folder, first.pid, second.pid
        finally:
            await first.aclose()
            await second.aclose()

    a, b, c, folder, first_pid, second_pid = asyncio.run(main())
    assert a.ok and a.runner == "session" and b.ok and b.stdout == f"{secret} {secret}\n"
    assert (
        c.ok and secret not in c.stdout + c.stderr and c.stdout.splitlines()[:2] == ["no x", "refused PermissionError"]
    )
    assert first_pid != second_pid
    time.sleep(0.2)
    assert not os.path.exists(folder) and sandbox_pids() == []  # closed sessions: no process, no folder


@pytest.mark.skipif(not HOST.landlock, reason="the test forks with seccomp off and needs Landlock to stay safe")
@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_a_child_left_running_after_its_call_is_killed(isolation):
    """With seccomp and the hook off the code can fork; what it starts dies with its call."""
    code = "import os, time\npid = os.fork()\nif pid == 0:\n    time.sleep(60)\n    os._exit(0)\nprint(pid)"
    config = SandboxConfig(isolation=isolation, seccomp=False, audit_hook=False, max_processes=64)

    async def main():
        result = await run_python(code, config)
        session = PythonSession(config)
        in_session = await session.run(code)
        left = sandbox_pids()  # the session's child lives as long as the session
        await session.aclose()
        return result, in_session, left

    result, in_session, left = asyncio.run(main())
    assert result.ok and in_session.ok and int(result.stdout) > 0
    time.sleep(0.3)
    assert len(left) >= 2  # the session and the child it forked
    assert sandbox_pids() == []
    if isolation == "audit":  # its pid is a host pid
        assert not alive(int(result.stdout))


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_a_fork_bomb_and_a_thread_bomb_in_a_session_are_contained(isolation):
    fork_bomb = (
        "import os\ntry:\n    while True:\n        os.fork()\nexcept OSError as e:\n    print('refused', e.errno)"
    )
    thread_bomb = (
        "import threading, time\nn = 0\ntry:\n    while True:\n"
        "        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n        n += 1\n"
        "except (RuntimeError, MemoryError) as e:\n    print('stopped after', n)"
    )

    async def main():
        session = PythonSession(SandboxConfig(isolation=isolation, memory_mb=512, timeout_s=10))
        try:
            return [await session.run(code) for code in ("y = 5", fork_bomb, thread_bomb, "y + 1")]
        finally:
            await session.aclose()

    results = asyncio.run(main())
    assert not any(r.timed_out for r in results)
    assert results[1].stdout.startswith("refused") or "creating processes is disabled" in results[1].stderr
    assert results[2].stdout.startswith("stopped after")
    assert int(results[2].stdout.split()[-1]) < 1000
    assert results[3].stdout == "6\n"  # the session survived both
    time.sleep(0.3)
    assert sandbox_pids() == []  # no process of the session or of either bomb is left


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_memory_exhaustion_and_a_crash_end_only_their_session(isolation):
    async def main():
        config = SandboxConfig(isolation=isolation, memory_mb=256, timeout_s=20)
        session = PythonSession(config)
        try:
            out = [
                await session.run("x = 1"),
                await session.run("big = bytearray(2 * 1024**3)"),
                await session.run("x"),
            ]
            server = our_servers()
            out.append(await session.run("import ctypes\nctypes.string_at(0)"))  # a segmentation fault
            out.append(await session.run("print('x' in dir())"))
            out.append(await run_python("print('ok')", config))
            return out, server, our_servers()
        finally:
            await session.aclose()

    (made, memory, kept, crash, fresh, other), before, after = asyncio.run(main())
    assert made.ok and not memory.ok and "MemoryError" in memory.stderr and kept.stdout == "1\n"
    assert not crash.ok and "SIGSEGV" in crash.text() and "The Python session was stopped" in crash.text()
    assert fresh.stdout == "False\n" and "New Python session" in fresh.text() and "killed by SIGSEGV" in fresh.text()
    assert other.ok and before == after and len(after) >= 1  # the fork servers lived through it


def test_a_timeout_restarts_the_session_and_the_next_call_says_so():
    async def main():
        session = PythonSession(SandboxConfig(timeout_s=1.5, cpu_s=30))
        try:
            first = await session.run("x = 41")
            pid = session.pid
            slow = await session.run("while True:\n    pass")
            gone = not alive(pid)
            after = await session.run("print('x' in dir())\nx = 1\nx")
            return first, slow, gone, after
        finally:
            await session.aclose()

    first, slow, gone, after = asyncio.run(main())
    assert first.ok and slow.timed_out and "Timed out" in slow.text() and gone
    assert "The Python session was stopped" in slow.text()
    assert after.stdout == "False\n1\n" and "New Python session" in after.text() and "timed out" in after.text()


def test_the_cpu_limit_holds_per_call_in_a_session():
    async def main():
        session = PythonSession(SandboxConfig(timeout_s=30, cpu_s=1))
        try:
            quick = [await session.run("sum(range(10**6))") for _ in range(3)]
            busy = await session.run("while True:\n    pass")
            return quick, busy
        finally:
            await session.aclose()

    quick, busy = asyncio.run(main())
    assert all(r.ok for r in quick)  # short calls do not add up to the per-call limit
    assert not busy.ok and not busy.timed_out and busy.elapsed_s < 10 and "CPU time limit exceeded" in busy.text()


def run_many(count: int) -> tuple[int, dict, dict, int]:
    """``count`` executions (after 200 to warm up), 16 in flight, each output checked: the server's pid,
    its status before and after, and how many executions it served in all."""
    config = SandboxConfig(max_concurrency=16, timeout_s=30)

    async def batch(n):
        results = await asyncio.gather(*(run_python(f"print({i} * 2)", config) for i in range(n)))
        assert [r.stdout for r in results] == [f"{i * 2}\n" for i in range(n)]
        return n

    async def main():
        done = await batch(200)  # warm: the server's own caches and the kernel's
        server = our_servers()[0]
        before = status(server)
        for _ in range(count // 500):
            done += await batch(500)
        return server, before, status(server), done

    return asyncio.run(main())


def test_the_fork_server_does_not_grow_over_many_executions():
    server, before, after, done = run_many(1000)
    assert done == 1200 and our_servers() == [server]  # the same server did all of it
    assert after["fds"] == before["fds"] and after["rss_kib"] - before["rss_kib"] < 2048, (before, after)
    assert sandbox_pids() == []


@pytest.mark.soak
def test_the_fork_server_survives_ten_thousand_executions():
    server, before, after, done = run_many(10000)
    assert done == 10200 and our_servers() == [server]
    assert after["fds"] == before["fds"] and after["rss_kib"] - before["rss_kib"] < 2048, (before, after)
    assert sandbox_pids() == []


def test_a_killed_fork_server_is_replaced():
    async def main():
        first = await run_python("print(1)")
        (server,) = our_servers()
        running = asyncio.ensure_future(run_python("import time\ntime.sleep(20)"))
        await asyncio.sleep(0.5)
        os.kill(server, signal.SIGKILL)
        cut_short = await asyncio.wait_for(running, 10)  # its child dies with the server
        second = await run_python("print(2)")
        return first, server, cut_short, second

    first, server, cut_short, second = asyncio.run(main())
    assert first.stdout == "1\n" and second.stdout == "2\n" and second.runner == "pool"
    assert not cut_short.ok and cut_short.exit_code is None and "fork server stopped" in cut_short.text()
    assert not alive(server) and len(our_servers()) == 1 and our_servers() != [server]
    assert sandbox_pids() == []


def test_without_namespaces_in_a_forked_child_the_run_takes_the_fresh_path(monkeypatch):
    if not HOST.namespaces:
        pytest.skip("no namespaces here at all")
    host = SandboxMode(True, HOST.seccomp, HOST.landlock, False, {"fork_namespaces": "mount: permission denied"})
    monkeypatch.setattr(python, "sandbox_mode", functools.cache(lambda: host))
    assert "fork server: without namespaces" in str(host) and "mount: permission denied" in str(host)
    result = asyncio.run(run_python("print(1)", SandboxConfig(isolation="namespaces")))
    assert result.ok and result.runner == "fresh" and result.isolation == "namespaces"
    assert asyncio.run(run_python("print(1)", SandboxConfig(isolation="audit"))).runner == "pool"
    with pytest.raises(RuntimeError, match="needs the fork server"):
        asyncio.run(PythonSession(SandboxConfig(isolation="namespaces")).run("1"))


class Scratch(Env):
    """Ends when the agent says 'done'."""

    def __init__(self):
        super().__init__(max_turns=10)

    def _reset(self, options):
        return "Compute things.", {}

    def _step(self, action):
        return "", 0.0, "done" in action, False, {}


def python_call(code):
    import json

    return "<tool_call>" + json.dumps({"name": "python", "arguments": {"code": code}}) + "</tool_call>"


def test_the_tool_wrapper_gives_each_episode_its_own_session():
    tool = PythonTool(SandboxConfig(timeout_s=10), persistent=True)
    assert "persist between calls" in tool.description
    first, second = ToolEnvWrapper(Scratch(), [tool]), ToolEnvWrapper(Scratch(), [tool])
    first.reset()
    second.reset()
    assert first.step(python_call("x = 'first'\nx"))[0] == "'first'"
    assert second.step(python_call("x = 'second'\nx"))[0] == "'second'"
    assert first.step(python_call("x"))[0] == "'first'"  # each episode sees its own
    assert len(sandbox_pids()) >= 2
    first.step("done")  # the episode ends: its session goes
    first.reset()
    assert "NameError" in first.step(python_call("x"))[0]
    first.close()
    second.close()
    time.sleep(0.3)
    assert sandbox_pids() == []


def test_servers_of_configs_no_longer_used_are_stopped():
    from rl2gem.tools import _fork_server

    async def main():
        for timeout in range(1, _fork_server.MAX_CONFIGS + 4):  # each timeout: another config
            assert (await run_python("print(1)", SandboxConfig(timeout_s=timeout))).ok

    asyncio.run(main())
    time.sleep(0.3)
    assert len(our_servers()) == _fork_server.MAX_CONFIGS
