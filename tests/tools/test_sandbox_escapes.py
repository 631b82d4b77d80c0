"""Escape attempts against the Python sandbox, judged by what happened on the host.

Every attack runs in each configuration this host offers: the isolation modes (namespaces
where the host allows them, and audit) with the kernel layers on, and each of those again
with the audit hook switched off, so the kernel layers alone must hold (the hook is a
friendly error layer, not the boundary). The assertions look at the host: the file that was
not created, the listener that got nothing, the signal that never arrived, the secret that
never reached the output. None of them reads the sandbox's own error messages.
"""

import asyncio
import functools
import os
import pathlib
import signal
import socket
import stat
import subprocess
import sys
import time

import pytest

from rl2gem.tools import PythonSession, SandboxConfig, run_python, sandbox_mode
from rl2gem.tools._sandbox_boot import _SYSCALLS, SECCOMP_DENIED

HOST = sandbox_mode()
KERNEL = HOST.seccomp and HOST.landlock > 0
CONFIGS = [
    pytest.param(isolation, hook, id=f"{isolation}-{'hook' if hook else 'kernel-only'}")
    for isolation in (["namespaces", "audit"] if HOST.namespaces else ["audit"])
    for hook in (True, False)
    if hook or KERNEL
]
# Bypasses the audit hook from Python: subprocess's own audit event is raised through the
# module's ``sys`` reference, and ``_posixsubprocess.fork_exec`` raises none.
NO_AUDIT = (
    "import subprocess, sys\n"
    "class _Sys:\n"
    "    def __getattr__(self, name):\n"
    "        return getattr(sys, name)\n"
    "    audit = staticmethod(lambda *args: None)\n"
    "subprocess.sys = _Sys()\n"
)


def attempt(*statements):
    """Code that tries each statement and goes on whatever happens."""
    blocks = []
    for statement in statements:
        body = "".join(f"    {line}\n" for line in statement.splitlines())
        blocks.append(f"try:\n{body}except BaseException as e:\n    print('refused', type(e).__name__)\n")
    return "".join(blocks)


#: How the code is run: forked by the fork server (the default), in a fresh interpreter, or as a
#: call in a persistent session.
RUNNERS = ["pool", "fresh", "session"]


async def _in_session(code, config):
    session = PythonSession(config)
    try:
        return await session.run(code)
    finally:
        await session.aclose()


def sandbox(code, isolation, hook, runner, **kw):
    config = SandboxConfig(
        isolation=isolation,
        audit_hook=hook,
        require=() if hook else ("landlock", "seccomp"),
        timeout_s=kw.pop("timeout_s", 20),
        pool_size=0 if runner == "fresh" else 1,
        **kw,
    )
    result = asyncio.run(_in_session(code, config) if runner == "session" else run_python(code, config))
    assert result.exit_code is not None, result  # it ran (a layer that failed to install stops the run)
    assert result.runner == runner, result
    return result


@pytest.fixture
def outside(tmp_path):
    """A host folder outside the sandbox, world-writable so that only the sandbox stands in the way,
    holding a victim file with known content, mode and times."""
    tmp_path.chmod(0o777)
    victim = tmp_path / "victim.txt"
    victim.write_text("original")
    victim.chmod(0o644)
    os.utime(victim, (1_000_000_000, 1_000_000_000))
    return tmp_path


def victim_untouched(folder):
    victim = folder / "victim.txt"
    info = victim.stat()
    return (
        victim.read_text() == "original"
        and stat.S_IMODE(info.st_mode) == 0o644
        and int(info.st_mtime) == 1_000_000_000
        and info.st_nlink == 1
    )


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("isolation, hook", CONFIGS)
def test_process_creation_runs_nothing_on_the_host(isolation, hook, runner, outside):
    marks = [outside / f"ran{i}" for i in range(5)]
    code = NO_AUDIT + attempt(
        f"subprocess.run(['/usr/bin/touch', {str(marks[0])!r}])",
        f"subprocess.run('touch {marks[1]}', shell=True)",
        f"import os; assert os.system('touch {marks[2]}') == 0",
        f"import os; pid = os.fork(); (os.execv('/usr/bin/touch', ['touch', {str(marks[3])!r}]) if pid == 0 else os.waitpid(pid, 0))",
        f"import os; os.posix_spawn('/usr/bin/touch', ['touch', {str(marks[4])!r}], {{}})",
    )
    r = sandbox(code, isolation, hook, runner)
    time.sleep(0.2)
    assert [m.exists() for m in marks] == [False] * 5, r.stdout + r.stderr
    assert r.stdout.count("refused") == 5


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("isolation, hook", CONFIGS)
def test_writes_through_every_file_api_stay_inside(isolation, hook, runner, outside):
    o = str(outside)
    shm = f"/dev/shm/rl2gem-escape-{os.urandom(4).hex()}"
    code = "import os, stat\n" + attempt(
        f"open({o!r} + '/a.txt', 'w').write('x')",
        f"os.close(os.open({o!r} + '/b.txt', os.O_CREAT | os.O_WRONLY))",
        f"os.mkfifo({o!r} + '/fifo')",
        f"os.mknod({o!r} + '/node', 0o600 | stat.S_IFREG)",
        f"os.mkdir({o!r} + '/dir')",
        f"os.symlink({o!r} + '/c.txt', 'link'); open('link', 'w').write('x')",
        f"os.symlink('/etc', {o!r} + '/etc-link')",
        f"os.link({o!r} + '/victim.txt', 'hard'); open('hard', 'w').write('pwned')",
        f"open('inside', 'w').write('x'); os.rename('inside', {o!r} + '/renamed')",
        f"open('inside2', 'w').write('x'); os.replace('inside2', {o!r} + '/victim.txt')",
        f"fd = os.open({o!r} + '/victim.txt', os.O_RDONLY); open(f'/proc/self/fd/{{fd}}', 'w').write('pwned')",
        f"os.truncate({o!r} + '/victim.txt', 0)",
        f"os.chmod({o!r} + '/victim.txt', 0o777)",
        f"os.utime({o!r} + '/victim.txt', (0, 0))",
        f"os.setxattr({o!r} + '/victim.txt', 'user.pwned', b'1')",
        f"os.remove({o!r} + '/victim.txt')",
        f"open({shm!r}, 'w').write('x')",
    )
    r = sandbox(code, isolation, hook, runner)
    assert sorted(p.name for p in outside.iterdir()) == ["victim.txt"], r.stdout + r.stderr
    assert victim_untouched(outside)
    assert os.listxattr(outside / "victim.txt") == []
    assert not os.path.exists(shm)


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("isolation, hook", CONFIGS)
def test_no_connection_reaches_a_host_listener(isolation, hook, runner, tmp_path):
    tcp = socket.create_server(("127.0.0.1", 0))
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(str(tmp_path / "host.sock"))
    unix.listen(1)
    for s in (tcp, udp, unix):
        s.settimeout(0.5)
    tcp_port, udp_port = tcp.getsockname()[1], udp.getsockname()[1]
    code = "import _socket as s\n" + attempt(
        f"c = s.socket(s.AF_INET, s.SOCK_STREAM); c.settimeout(2); c.connect(('127.0.0.1', {tcp_port}))",
        f"s.socket(s.AF_INET, s.SOCK_DGRAM).sendto(b'leak', ('127.0.0.1', {udp_port}))",
        f"c = s.socket(s.AF_UNIX, s.SOCK_STREAM); c.connect({str(tmp_path / 'host.sock')!r})",
        f"s.socket(s.AF_INET, s.SOCK_RAW, 17).sendto(b'raw', ('127.0.0.1', {udp_port}))",
        "s.socket(17, s.SOCK_RAW, 0)",  # AF_PACKET
        "s.socket(16, s.SOCK_RAW, 0)",  # AF_NETLINK
    )
    try:
        r = sandbox(code, isolation, hook, runner)
        for listener in (tcp, unix):
            with pytest.raises(socket.timeout):
                listener.accept()
        with pytest.raises(socket.timeout):
            udp.recvfrom(1024)
        assert r.stdout.count("refused") == 6, r.stdout + r.stderr
    finally:
        for s in (tcp, udp, unix):
            s.close()


@pytest.mark.skipif(not KERNEL, reason="needs the kernel layers: the audit hook refuses ctypes before this")
@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("isolation", ["namespaces", "audit"] if HOST.namespaces else ["audit"])
def test_native_code_through_ctypes_meets_the_kernel_layers(isolation, runner, outside):
    o = str(outside)
    received = []
    previous = signal.signal(signal.SIGWINCH, lambda signum, frame: received.append(signum))
    code = "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n" + attempt(
        f"assert libc.system(b'touch {o}/native1') == 0",
        f"assert libc.open({o!r}.encode() + b'/native2', {os.O_CREAT | os.O_WRONLY}, 0o644) >= 0",
        f"assert libc.chmod({o!r}.encode() + b'/victim.txt', 0o777) == 0",
        "assert libc.socket(2, 1, 0) >= 0",  # AF_INET, SOCK_STREAM
        f"assert libc.kill({os.getpid()}, {int(signal.SIGWINCH)}) == 0",
    )
    try:
        r = sandbox(code, isolation, False, runner)
        time.sleep(0.3)
    finally:
        signal.signal(signal.SIGWINCH, previous)
    assert received == []
    assert sorted(p.name for p in outside.iterdir()) == ["victim.txt"] and victim_untouched(outside), r.stdout
    assert r.stdout.count("refused") == 5, r.stdout + r.stderr


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("isolation, hook", CONFIGS)
def test_signals_never_reach_host_processes(isolation, hook, runner):
    received = []
    previous = signal.signal(signal.SIGWINCH, lambda signum, frame: received.append(signum))
    me = os.getpid()
    try:
        code = "import os, signal\n" + attempt(
            f"os.kill({me}, signal.SIGWINCH)",
            "os.kill(os.getppid(), signal.SIGWINCH)",
            f"os.killpg(os.getpgid({me}), signal.SIGWINCH)",
            "os.kill(-1, signal.SIGWINCH)",  # every process the caller may signal
        )
        sandbox(code, isolation, hook, runner)
        time.sleep(0.3)
        assert received == []
    finally:
        signal.signal(signal.SIGWINCH, previous)


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("isolation, hook", CONFIGS)
def test_host_secrets_stay_out_of_the_output(isolation, hook, runner, tmp_path):
    """Another process's environment and memory, and files outside the readable paths."""
    secret = "s3cr3t-" + os.urandom(6).hex()
    holder = subprocess.Popen(["sleep", "30"], env={"HOLDER_SECRET": secret, "PATH": os.environ["PATH"]})
    secret_file = tmp_path / "secret.txt"
    secret_file.write_text(secret)
    try:
        deadline = time.monotonic() + 10  # until the holder has exec'd, its environ is empty
        while secret.encode() not in pathlib.Path(f"/proc/{holder.pid}/environ").read_bytes():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        code = attempt(
            f"print(open('/proc/{holder.pid}/environ', 'rb').read())",
            f"print(open('/proc/{os.getpid()}/environ', 'rb').read())",
            "import os; print(open(f'/proc/{os.getppid()}/environ', 'rb').read())",
            f"print(open({str(secret_file)!r}).read())",
            f"print(open('/proc/{holder.pid}/root' + {str(secret_file)!r}).read())",
            f"print(open('/proc/{holder.pid}/maps').read())",
        )
        r = sandbox(code, isolation, hook, runner)
        assert secret not in r.stdout + r.stderr
        assert r.stdout.count("refused") == 6, r.stdout + r.stderr
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("isolation, hook", CONFIGS)
def test_resource_bombs_end_within_the_limits(isolation, hook, runner):
    bombs = [
        attempt("import os\nwhile True:\n        os.fork()"),
        attempt(
            "import threading, time\nwhile True:\n        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()"
        ),
        attempt("open('big', 'wb').write(b'0' * (64 * 2**20))") + "import os\nprint(os.path.getsize('big'))",
    ]
    for code in bombs:
        t0 = time.perf_counter()
        r = sandbox(code, isolation, hook, runner, timeout_s=10, memory_mb=512)
        assert not r.timed_out and time.perf_counter() - t0 < 10, r.stderr
    assert int(r.stdout.split()[-1]) <= 16 * 2**20  # max_file_mb


@pytest.mark.skipif(not KERNEL, reason="needs the kernel layers: the audit hook refuses ctypes before this")
@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("isolation", ["namespaces", "audit"] if HOST.namespaces else ["audit"])
def test_sysv_shared_memory_of_the_host_is_out_of_reach_and_none_is_left_behind(isolation, runner):
    """SysV IPC was shared with the host: a run read and deleted the host's private segment and left
    segments of its own behind (memory no limit counted, read by later runs)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmat.restype = ctypes.c_void_p
    host_key, new_key, secret = 0x524C3247, 0x524C3248, b"HOST-SHM-SECRET-7f3a"
    segment = libc.shmget(host_key, 4096, 0o1000 | 0o600)  # IPC_CREAT
    assert segment >= 0, os.strerror(ctypes.get_errno())
    address = libc.shmat(segment, None, 0)
    ctypes.memmove(address, secret, len(secret))
    libc.shmdt(ctypes.c_void_p(address))
    code = "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.shmat.restype = ctypes.c_void_p\n" + attempt(
        f"i = libc.shmget({host_key}, 0, 0)\nassert i >= 0\nprint(ctypes.string_at(libc.shmat(i, None, 0), 20))",
        f"i = libc.shmget({host_key}, 0, 0)\nassert i >= 0 and libc.shmctl(i, 0, None) == 0",  # IPC_RMID
        f"assert libc.shmget({new_key}, 1 << 20, 0o1600) >= 0",
    )
    try:
        r = sandbox(code, isolation, False, runner)
        keys = [int(line.split()[0]) for line in pathlib.Path("/proc/sysvipc/shm").read_text().splitlines()[1:]]
        assert secret.decode() not in r.stdout, r.stdout
        assert host_key in keys and new_key not in keys  # the host's is still there; none of the sandbox's
        assert r.stdout.count("refused") == 3, r.stdout + r.stderr
    finally:
        libc.shmctl(segment, 0, None)
        leaked = libc.shmget(new_key, 0, 0)
        if leaked >= 0:  # a failing run's segment: not left to the next run
            libc.shmctl(leaked, 0, None)


@pytest.mark.skipif(not HOST.seccomp, reason="seccomp is the layer under test")
@pytest.mark.parametrize("runner", ["pool", "fresh"])
def test_a_file_owner_does_not_carry_a_signal_to_the_host(runner):
    """F_SETOWN / FIOSETOWN make the kernel signal a pid the code names (SIGIO, or F_SETSIG's),
    past the kill() rule: on a host with neither namespaces nor Landlock's signal scoping (ABI < 6)
    the code killed host processes. Seccomp alone must refuse them (no namespaces, no Landlock)."""
    received = []
    previous = signal.signal(signal.SIGWINCH, lambda signum, frame: received.append(signum))
    me, sigwinch = os.getpid(), int(signal.SIGWINCH)
    code = "import fcntl, os, socket, struct\n" + attempt(
        f"r, w = os.pipe()\nfcntl.fcntl(r, fcntl.F_SETOWN, {me})\nfcntl.fcntl(r, 10, {sigwinch})\n"
        "fcntl.fcntl(r, fcntl.F_SETFL, fcntl.fcntl(r, fcntl.F_GETFL) | os.O_ASYNC)\nos.write(w, b'x')",
        f"a, b = socket.socketpair()\nfcntl.ioctl(a, 0x8901, struct.pack('i', {me}))\nfcntl.fcntl(a, 10, {sigwinch})\n"
        "fcntl.fcntl(a, fcntl.F_SETFL, fcntl.fcntl(a, fcntl.F_GETFL) | os.O_ASYNC)\nb.send(b'x')",
    )
    config = SandboxConfig(
        isolation="audit", audit_hook=False, landlock=False, require=("seccomp",), pool_size=int(runner == "pool")
    )
    try:
        r = asyncio.run(run_python(code, config))
        time.sleep(0.3)
    finally:
        signal.signal(signal.SIGWINCH, previous)
    assert received == [], r.stdout + r.stderr
    assert r.runner == runner and r.stdout.count("refused") == 2, r.stdout + r.stderr


def test_the_seccomp_tables_name_every_refused_call():
    for machine, (_, numbers) in _SYSCALLS.items():
        missing = [name for name in SECCOMP_DENIED if name not in numbers]
        # system calls that arm64 never had (its libc uses the *at variants, which are listed)
        legacy = {
            "fork",
            "vfork",
            "iopl",
            "ioperm",
            "uselib",
            "chmod",
            "chown",
            "lchown",
            "utime",
            "utimes",
            "futimesat",
            "inotify_init",
        }
        assert set(missing) <= (legacy if machine == "aarch64" else set()), (machine, missing)
        assert len(set(numbers.values())) == len(numbers), machine  # no number twice


def test_require_refuses_a_host_without_the_layer(monkeypatch):
    from rl2gem.tools import SandboxMode, python

    bare = SandboxMode(namespaces=False, seccomp=False, landlock=0, missing={"landlock": "kernel 5.4"})
    monkeypatch.setattr(python, "sandbox_mode", functools.cache(lambda: bare))
    with pytest.raises(RuntimeError, match=r"requires landlock.*kernel 5\.4"):
        asyncio.run(run_python("print(1)", SandboxConfig(require=("landlock",))))
    r = asyncio.run(run_python("print(1)", SandboxConfig()))  # without require it runs, and says how
    assert r.ok and r.layers == ("audit_hook",) and r.isolation == "audit"
    with pytest.raises(ValueError, match="switches off"):
        SandboxConfig(seccomp=False, require=("seccomp",))
    with pytest.raises(ValueError, match="unknown layers"):
        SandboxConfig(require=("docker",))


def test_a_probe_that_timed_out_is_not_kept(monkeypatch):
    """A probe that timed out on a loaded host counted Landlock and seccomp as missing for the
    process's life, silently (the sandbox then ran without them unless require= named them)."""
    from rl2gem.tools import python

    real_run = subprocess.run

    def slow(*args, **kw):
        raise subprocess.TimeoutExpired(args[0], kw.get("timeout"))

    monkeypatch.setattr(python, "_PROBED", [])
    monkeypatch.setattr(subprocess, "run", slow)
    with pytest.warns(RuntimeWarning, match="probe of the host timed out"):
        hurried = python.sandbox_mode()
    assert not hurried.seccomp and hurried.landlock == 0 and python._PROBED == []
    monkeypatch.setattr(subprocess, "run", real_run)
    assert python.sandbox_mode() == HOST and python._PROBED == [HOST]  # probed again, and kept


@pytest.mark.skipif(not KERNEL, reason="needs the kernel layers")
def test_results_name_the_layers_that_confined_them():
    r = asyncio.run(run_python("print(1)", SandboxConfig(require=("landlock", "seccomp"))))
    assert r.ok and {"landlock", "seccomp", "audit_hook"} <= set(r.layers)
    r = asyncio.run(run_python("print(1)", SandboxConfig(seccomp=False, isolation="audit")))
    assert r.layers == ("landlock", "audit_hook")


@pytest.mark.skipif(HOST.landlock == 0, reason="no Landlock here")
def test_a_layer_that_cannot_be_installed_stops_the_run(tmp_path):
    """Fail closed: a thread started before the boot makes Landlock refuse, so the code never runs."""
    from rl2gem.tools import python

    starter = (
        "import runpy, sys, threading, time\n"
        "threading.Thread(target=time.sleep, args=(5,), daemon=True).start()\n"
        f"sys.argv = [{python._BOOT!r}, 'landlock=1', 'read=/usr']\n"
        f"runpy.run_path({python._BOOT!r}, run_name='__main__')\n"
    )
    r = subprocess.run(
        [sys.executable, "-I", "-c", starter],
        input="open('ran', 'w').write('x')",
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 125 and not (tmp_path / "ran").exists(), r.stderr
