"""The Python sandbox stops what model-written code must not do (in each isolation mode this host has)."""

import asyncio
import os
import socket
import tempfile
import time

import pytest
from helpers import lasting_sandbox_pids, sandbox_pids

from rl2gem.tools import PythonSession, PythonTool, SandboxConfig, run_python, sandbox_mode

ISOLATIONS = ["audit"] + (["namespaces"] if sandbox_mode().namespaces else [])
# each isolation mode through the fork server (the default) and through a fresh interpreter
MODES = [
    pytest.param({"isolation": isolation, "pool_size": pool}, id=f"{isolation}-{'pool' if pool else 'fresh'}")
    for isolation in ISOLATIONS
    for pool in (1, 0)
]


def run(code, **kw):
    return asyncio.run(run_python(code, SandboxConfig(**kw)))


async def run_by(runner: str, code: str, config: SandboxConfig):
    """``code`` run by the fork server (``pool``) or as one call of a persistent ``session``."""
    if runner == "pool":
        return await run_python(code, config)
    session = PythonSession(config)
    try:
        return await session.run(code)
    finally:
        await session.aclose()


@pytest.mark.parametrize("mode", MODES)
def test_runs_code_like_a_notebook_cell(mode):
    r = run("x = 6 * 7\nprint('x is', x)\nx + 1", **mode)
    assert r.ok and r.stdout == "x is 42\n43\n" and r.isolation == mode["isolation"]
    assert r.runner == ("pool" if mode["pool_size"] else "fresh")
    r = run("1/0", **mode)
    assert r.exit_code == 1 and "ZeroDivisionError" in r.stderr and "_sandbox_boot" not in r.stderr
    assert "SyntaxError" in run("def (", **mode).stderr


@pytest.mark.parametrize("mode", MODES)
def test_infinite_loop_is_killed_at_the_wall_clock_limit(mode):
    t0 = time.perf_counter()
    r = run("while True:\n    pass", timeout_s=1.5, cpu_s=30, **mode)
    assert r.timed_out and not r.ok and time.perf_counter() - t0 < 6
    assert "Timed out" in r.text()
    assert sandbox_pids() == []


@pytest.mark.parametrize("runner", ["pool", "session"])
def test_code_that_closes_its_output_is_stopped_at_the_time_limit(runner):
    """Code that closed stdout and stderr and ran on held a pool or session call 10 s, whatever
    timeout_s, and came back as not timed out."""
    code = "import os, time\nos.close(1)\nos.close(2)\ntime.sleep(30)"
    config = SandboxConfig(timeout_s=1.5, cpu_s=30, pool_size=1)

    t0 = time.perf_counter()
    r = asyncio.run(run_by(runner, code, config))
    assert r.timed_out and r.runner == runner and time.perf_counter() - t0 < 5, (r, time.perf_counter() - t0)


def test_cpu_time_limit_kills_a_busy_process_before_the_wall_clock():
    r = run("while True:\n    pass", timeout_s=30, cpu_s=1)
    assert not r.timed_out and not r.ok and r.elapsed_s < 10 and "CPU time limit exceeded" in r.text()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "code", ["x = bytearray(8 * 1024**3)", "xs = []\nwhile True:\n    xs.append(bytearray(50 * 1024**2))"]
)
def test_memory_bomb_hits_the_address_space_limit(mode, code):
    r = run(code, memory_mb=256, timeout_s=20, **mode)
    assert not r.ok and not r.timed_out and "MemoryError" in r.stderr


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "code",
    [
        "import os\nwhile True:\n    os.fork()",
        "import subprocess\nsubprocess.run(['sleep', '100'])",
        "import os\nos.system('sleep 100 &')",
        "import multiprocessing as mp\nps = [mp.Process(target=print) for _ in range(50)]\n[p.start() for p in ps]",
    ],
)
def test_fork_bomb_and_process_creation_are_refused(mode, code):
    r = run(code, timeout_s=5, **mode)
    assert not r.ok and not r.timed_out and "creating processes is disabled" in r.stderr
    assert lasting_sandbox_pids() == []


@pytest.mark.parametrize("mode", MODES)
def test_socket_connect_to_localhost_fails(mode):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    try:
        r = run(
            f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')",
            **mode,
        )
        assert "connected" not in r.stdout and "network access is disabled" in r.stderr
        with pytest.raises(socket.timeout):
            server.accept()
    finally:
        server.close()


@pytest.mark.skipif("namespaces" not in ISOLATIONS, reason="no unprivileged user namespaces on this host")
@pytest.mark.parametrize("pool_size", [1, 0])
def test_namespaces_mode_has_no_network_interface_but_loopback(pool_size):
    r = run("print(open('/proc/net/dev').read())", isolation="namespaces", pool_size=pool_size)
    interfaces = [ln.split(":")[0].strip() for ln in r.stdout.splitlines() if ":" in ln]
    assert r.ok and interfaces == ["lo"]
    # and its own PID namespace: it sees only itself and the namespace's init
    listing = "import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))"
    r = run(listing, isolation="namespaces", landlock=False, pool_size=pool_size)  # Landlock hides /proc's too
    assert r.ok and len(eval(r.stdout)) <= 2


@pytest.mark.parametrize("mode", MODES)
def test_writes_stay_in_a_fresh_working_folder_that_is_removed(mode, tmp_path):
    target = tmp_path / "escape.txt"
    code = (
        f"import os, shutil\nprint(os.getcwd())\nopen('inside.txt', 'w').write('ok')\nprint(open('inside.txt').read())\n"
        f"for f in (lambda: open({str(target)!r}, 'w'), lambda: os.mkdir({str(tmp_path / 'd')!r}),\n"
        f"          lambda: os.rename('inside.txt', {str(target)!r}), lambda: os.remove({str(tmp_path)!r})):\n"
        f"    try:\n        f()\n        print('escaped')\n    except PermissionError as e:\n        print('refused')\n"
    )
    r = run(code, **mode)
    lines = r.stdout.split()
    assert r.ok and lines[1:] == ["ok", "refused", "refused", "refused", "refused"], r.stdout + r.stderr
    workdir = lines[0]
    assert workdir.startswith(tempfile.gettempdir()) and not os.path.exists(workdir)
    assert not target.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("mode", MODES)
def test_parent_environment_is_not_visible(mode, monkeypatch):
    monkeypatch.setenv("RL2GEM_TEST_SECRET", "s3cr3t-value")
    code = (
        "import os\nprint(sorted(os.environ))\nprint(os.environ.get('RL2GEM_TEST_SECRET'))\n"
        "try:\n    print(open(f'/proc/{os.getppid()}/environ', 'rb').read())\nexcept Exception as e:\n    print(type(e).__name__)\n"
        f"try:\n    print(open('/proc/{os.getpid()}/environ', 'rb').read())\nexcept Exception as e:\n    print(type(e).__name__)\n"
    )
    r = run(code, **mode)
    assert r.ok and "s3cr3t" not in r.stdout + r.stderr
    assert "None" in r.stdout.splitlines()[1]


def test_output_is_truncated():
    r = run("print('a' * 10000)", max_output_chars=100)
    assert r.ok and r.truncated and len(r.stdout) == 100 and "[Output truncated]" in r.text()


@pytest.mark.parametrize("runner", ["pool", "session"])
def test_an_error_after_much_stderr_keeps_its_last_line(runner):
    """stderr kept its first 4 x max_output_chars bytes and showed their tail: after 8 KB of warnings
    the exception's own line never reached the model."""
    code = "import sys\nfor i in range(100):\n    print('warning', i, 'é' * 40, file=sys.stderr)\nraise ValueError('THE_REAL_ERROR')"
    config = SandboxConfig(max_output_chars=200, pool_size=1)

    r = asyncio.run(run_by(runner, code, config))
    assert r.truncated and r.stderr.rstrip().endswith("ValueError: THE_REAL_ERROR"), r.stderr[-300:]
    assert "\ufffd" not in r.stderr and len(r.stderr) <= 200


@pytest.mark.parametrize("mode", MODES)
def test_a_flood_is_stopped_every_time(mode):
    # Regression: stopping the read at the flood left the pipe paused, and about one run in four
    # then waited forever for the process's pipes to close. Twelve floods in a row, each bounded.
    async def main():
        cfg = SandboxConfig(max_output_chars=100, timeout_s=20, **mode)
        out = []
        for _ in range(12):
            t0 = time.perf_counter()
            r = await asyncio.wait_for(run_python("while True:\n    print('x' * 1000)", cfg), 15)
            out.append((r, time.perf_counter() - t0))
        return out

    for r, seconds in asyncio.run(main()):
        assert r.output_exceeded and not r.timed_out and r.exit_code == -9 and len(r.stdout) == 100
        assert seconds < 5


def test_fifty_concurrent_executions_finish_without_leaks(tmp_path, monkeypatch):
    # the working folders go to a folder of this test's own (a fork server of its own, too): the
    # other test worker's sandboxes come and go in the system's temporary folder meanwhile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    before = {p for p in os.listdir(tempfile.gettempdir()) if p.startswith("rl2gem-sandbox-")}
    code = "import sys\nprint(sum(range(int(sys.argv[0] == '<code>') * 1000)))"

    async def main():
        cfg = SandboxConfig(max_concurrency=16, timeout_s=30)
        return await asyncio.gather(*(run_python(code, cfg) for _ in range(50)))

    results = asyncio.run(main())
    assert [r.stdout for r in results] == ["499500\n"] * 50 and all(r.ok for r in results)
    after = {p for p in os.listdir(tempfile.gettempdir()) if p.startswith("rl2gem-sandbox-")}
    # a sandboxed process that just finished can still be listed on a loaded machine (not a leak)
    assert before == set() and after == set() and lasting_sandbox_pids() == []


def test_cancelled_execution_kills_its_process():
    async def main():
        task = asyncio.ensure_future(run_python("import time\ntime.sleep(60)", SandboxConfig(timeout_s=60)))
        await asyncio.sleep(1.0)
        assert sandbox_pids() != []
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert sandbox_pids() == []


def test_python_tool_text():
    tool = PythonTool(SandboxConfig(timeout_s=5))
    assert asyncio.run(tool.call({"code": "print(2**10)"})) == "1024"
    assert asyncio.run(tool.call({"code": "x = 1"})).startswith("[No output")
    with pytest.raises(ValueError):
        SandboxConfig(isolation="docker")
