"""A Python sandbox for model-written code, and :class:`PythonTool` over it.

Each execution is a process of its own, at most ``max_concurrency`` at a time per
event loop (the event loop never blocks). The boundary is made of kernel
layers, each used when the host has it (:func:`sandbox_mode` says which) and
each enforced for the process and anything it could start:

===========================  ============================================================================
**landlock** (Linux >= 5.13) file system: read/write only in a fresh working folder (no device nodes
                             there), read-only in the interpreter's prefixes, ``/usr``, ``/lib*``, the
                             sandbox's own ``/proc/self`` and ``readable``; nothing else: not the
                             user's home, other temporary folders, other processes' ``/proc``
                             entries, or ``/dev`` except null/zero/urandom. Renames
                             and hard links across folders are refused (no link to an outside file).
                             ABI 4+: no TCP bind/connect; ABI 6+: no signals or abstract Unix
                             sockets outside the sandbox. Other processes cannot be traced.
**seccomp** (x86_64, arm64)  system calls refused with EPERM: ``socket`` (any family; ``socketpair``
                             stays), ``execve``, ``fork``/``vfork``/``clone`` of anything but a thread
                             or with new namespaces, ``ptrace``, ``process_vm_*``, ``pidfd_*``,
                             ``io_uring``, ``bpf``, ``userfaultfd``, ``perf_event_open``, keys,
                             modules, kexec, mounts, ``unshare``/``setns``, host clock and name, reboot,
                             file mode/owner/time/xattr changes, SysV IPC, ``memfd_create``, inotify
                             and fanotify; signals only to the sandbox's own pid, and no ``SIGIO``
                             owner (``F_SETOWN``, ``FIOSETOWN``) to carry one elsewhere.
                             A 32-bit or x32 system call kills the process.
**namespaces**               a new user, network (only a down loopback), PID (its own ``/proc``), IPC
                             and mount namespace, made by ``unshare`` where unprivileged user namespaces
                             are allowed; ``RLIMIT_NPROC`` = ``max_processes`` counts in it.
**audit hook** (PEP 578)     a Python-level guard installed last that turns the same refusals into
                             readable errors ("network access is disabled in the sandbox"). It is not
                             the boundary: native calls can bypass it, the kernel layers cannot be.
resource limits              wall clock ``timeout_s`` (then the process group is SIGKILLed), CPU
                             ``RLIMIT_CPU`` = ``cpu_s``, memory ``RLIMIT_AS`` = ``memory_mb``, file size
                             ``RLIMIT_FSIZE`` = ``max_file_mb``, 256 open files, no core dumps
environment and output       only ``PATH``, ``HOME``/``TMPDIR`` (the working folder), ``LANG`` and
                             single-thread BLAS settings; stdout and stderr each kept to
                             ``max_output_chars`` and a flood (over 1 MiB) stops the process
===========================  ============================================================================

**The warm pool** (``pool_size >= 1``, the default). A fork server (zygote,
``_sandbox_zygote.py``) per distinct config in this process has started the
interpreter once, imported the standard modules code usually needs and
``preload``, and built the seccomp program; it never runs user code. Each
execution is a child it forks: the child takes its own session and process
group, dies with the server, makes its own user, network, PID and mount
namespaces (``unshare(2)`` and a second fork, as ``unshare --fork`` does), sets the
resource limits, installs its own Landlock ruleset (its own working folder),
seccomp filter and audit hook, and only then reads and runs the code. When it
exits, the server kills its process group (nothing it started outlives the call),
reaps it and removes its folder; no state passes between executions. Where a
forked child cannot make the namespaces (``SandboxMode.fork_namespaces``),
executions that want them take the path without a pool: a fresh
``python -I -S -B`` under ``unshare`` (``pool_size=0`` always does). The children of
one server share the hash seed of ``str`` (``PYTHONHASHSEED``); ``random`` is reseeded
in each.

**Sessions** (:class:`PythonSession`, ``PythonTool(persistent=True)``): a child of
the same server, confined once the same way, that runs each call's code in one
namespace until it is closed (one per episode).

A layer asked for but not installable at run time stops the run before the
code starts (fail closed); ``SandboxConfig(require=(...))`` refuses to run at
all on a host without the named layers. What the boundary does not cover: the
CPU time and memory bandwidth of the host (shared), reads of the allowed
read-only paths, system calls newer than the filter's table (the filter allows
what it does not name), and kernel bugs.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import dataclasses
import functools
import os
import shutil
import signal
import site
import socket
import subprocess
import sys
import tempfile
import time
import warnings
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rl2gem.tools._fork_server import Child, ForkServer, ForkServerError, fork_server

__all__ = [
    "ForkServerError",
    "PythonSession",
    "PythonTool",
    "SandboxConfig",
    "SandboxMode",
    "SandboxResult",
    "run_python",
    "sandbox_mode",
    "warm_up",
]

#: Output (bytes per stream) after which a process is stopped early.
_FLOOD_BYTES = 1 << 20
_BOOT = str(Path(__file__).with_name("_sandbox_boot.py"))
_ZYGOTE = str(Path(__file__).with_name("_sandbox_zygote.py"))
_UNSHARE = ["--user", "--map-root-user", "--net", "--ipc", "--pid", "--fork", "--mount-proc", "--kill-child"]
#: Every layer, in the order they are installed around the code.
LAYERS = ("namespaces", "landlock", "seccomp", "audit_hook")
#: Read-only for the code, beside the interpreter's own prefixes (missing ones are skipped).
SYSTEM_READABLE = (
    "/usr",
    "/lib",
    "/lib64",
    "/lib32",
    "/bin",
    "/etc/ld.so.cache",
    "/etc/localtime",
    "/sys/devices/system/cpu",
    # /proc: only the sandbox's own entries (``/proc/self`` resolves to them) and host-wide facts;
    # Landlock does not hide another process's environ or maps, this list does.
    "/proc/self",
    "/proc/cpuinfo",
    "/proc/meminfo",
    "/proc/stat",
    "/proc/sys/kernel/random",
)


@functools.cache
def _unshare() -> str | None:
    return shutil.which("unshare")


@dataclasses.dataclass(frozen=True)
class SandboxMode:
    """What this host offers the sandbox (see the module doc for each layer).

    Attributes:
        namespaces: ``unshare`` can make unprivileged user, network, IPC, PID and mount namespaces.
        seccomp: a seccomp-bpf filter could be installed (x86_64 or arm64 Linux).
        landlock: the kernel's Landlock ABI version, ``0`` when it has none.
        fork_namespaces: a child of the fork server can make the same namespaces itself (the
            unshare(2) system call, uid/gid maps, its own ``/proc``). Without it, executions that
            want namespaces take the path without a pool (a fresh interpreter under ``unshare``).
        missing: for each unavailable layer, why (the error the probe got); ``"fork_namespaces"``
            too, when namespaces work but not from a forked child.
    """

    namespaces: bool
    seccomp: bool
    landlock: int
    fork_namespaces: bool = False
    missing: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def isolation(self) -> str:
        """``"namespaces"`` where available, else ``"audit"`` (what ``isolation="auto"`` picks)."""
        return "namespaces" if self.namespaces else "audit"

    def has(self, layer: str) -> bool:
        """Whether ``layer`` (one of :data:`LAYERS`) can be used here."""
        return {"namespaces": self.namespaces, "seccomp": self.seccomp, "landlock": self.landlock > 0}.get(layer, True)

    @property
    def layers(self) -> tuple[str, ...]:
        """The layers available here, in :data:`LAYERS` order."""
        return tuple(layer for layer in LAYERS if self.has(layer))

    def pooled(self, layers: tuple[str, ...]) -> bool:
        """Whether the fork server can give a child ``layers`` (else the fresh-interpreter path)."""
        return "namespaces" not in layers or self.fork_namespaces

    def __str__(self) -> str:
        names = [f"landlock (ABI {self.landlock})" if layer == "landlock" else layer for layer in self.layers]
        pool = "fork server: every layer" if self.pooled(self.layers) else "fork server: without namespaces"
        missing = "; ".join(f"no {layer}: {why}" for layer, why in self.missing.items())
        return ", ".join(names) + f"; {pool}" + (f" ({missing})" if missing else "")


#: The host's layers, once a probe finished (a probe that timed out is not kept: the next run probes again).
_PROBED: list[SandboxMode] = []


def sandbox_mode() -> SandboxMode:
    """Probe (once per process) which sandbox layers this host offers; see :class:`SandboxMode`.
    A probe that timed out (a loaded host) counts the layers it did not see as missing for this
    call only, with a warning, and the next call probes again."""
    if _PROBED:
        return _PROBED[0]
    mode, finished = _probe()
    if finished:
        _PROBED.append(mode)
    else:
        warnings.warn(f"the sandbox's probe of the host timed out; this run has {mode}", RuntimeWarning, stacklevel=2)
    return mode


def _probe() -> tuple[SandboxMode, bool]:
    """:func:`sandbox_mode`'s probe: ``(mode, finished)``, ``finished`` False when a probe timed out."""
    missing, finished = {}, True
    namespaces = False
    exe = _unshare()
    if exe is None:
        missing["namespaces"] = "no unshare program on PATH"
    else:
        try:
            r = subprocess.run([exe, *_UNSHARE, sys.executable, "-I", "-c", "pass"], capture_output=True, timeout=30)
            namespaces = r.returncode == 0
            if not namespaces:
                missing["namespaces"] = r.stderr.decode(errors="replace").strip() or f"unshare exited {r.returncode}"
        except (OSError, subprocess.SubprocessError) as e:
            missing["namespaces"] = str(e)
            finished = finished and not isinstance(e, subprocess.TimeoutExpired)
    found = {}
    with tempfile.TemporaryDirectory(prefix="rl2gem-sandbox-probe-") as folder:
        try:
            r = subprocess.run(
                [sys.executable, "-I", "-B", _BOOT, "probe=1", f"userns={int(namespaces)}", "landlock=1", "seccomp=1"],
                capture_output=True,
                timeout=30,
                cwd=folder,
                text=True,
            )
            for line in r.stdout.splitlines():
                key, _, rest = line.partition("=")
                value, _, why = rest.partition(" ")
                found[key] = int(value)
                if not int(value):
                    missing[key] = why
        except (OSError, subprocess.SubprocessError, ValueError) as e:
            missing.setdefault("seccomp", str(e))
            finished = finished and not isinstance(e, subprocess.TimeoutExpired)
    for layer in ("landlock", "seccomp"):
        if not found.get(layer):
            missing.setdefault(layer, "the probe could not install it")
    fork_namespaces = namespaces and bool(found.get("userns"))
    why = missing.pop("userns", "the probe could not make them in a forked child")
    if namespaces and not fork_namespaces:
        missing["fork_namespaces"] = why
    mode = SandboxMode(namespaces, bool(found.get("seccomp")), found.get("landlock", 0), fork_namespaces, missing)
    return mode, finished


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
    """Limits of one execution (see the module doc).

    Attributes:
        timeout_s: wall-clock limit, seconds.
        cpu_s: CPU-time limit, seconds (default: ``ceil(timeout_s)``).
        memory_mb: address-space limit, MiB.
        max_file_mb: largest file the code may write, MiB.
        max_output_chars: characters of stdout (and of stderr) returned.
        max_processes: processes allowed in the sandbox's PID namespace (namespaces mode only).
        isolation: ``"auto"`` (namespaces when available), ``"namespaces"`` (error if not
            available) or ``"audit"`` (no namespaces; the other layers still apply).
        seccomp, landlock: use that kernel layer where the host has it (turn off only to
            measure or to debug a layer).
        audit_hook: install the audit hook (friendly errors); turn off only to test that the
            kernel layers hold without it.
        require: layers (:data:`LAYERS`) without which :func:`run_python` refuses to run,
            e.g. ``("landlock", "seccomp")`` for a production rollout.
        readable: more paths (folders or files) the code may read, beside
            :data:`SYSTEM_READABLE` and the interpreter's prefixes.
        preload: modules imported before the limits and the audit hook (faster, and
            lets e.g. ``numpy`` load its native parts), e.g. ``("numpy",)``. A module that
            starts threads when imported cannot be preloaded under Landlock (which binds one
            thread): the run then stops before the code starts.
        max_concurrency: executions at once per event loop (further calls wait).
        pool_size: fork servers kept per distinct config in this process (see "The warm pool" in
            the module doc); ``0``: no pool, a fresh interpreter per execution.
        prefork: children each fork server keeps forked ahead, namespaces made, waiting for the
            next executions (their start is then off the critical path); ``0``: fork on request.
        session_cpu_s: CPU seconds a persistent session (:class:`PythonSession`) may use in all
            (default ``max(60, 10 * cpu_s)``); ``cpu_s`` still bounds each call.
    """

    timeout_s: float = 10.0
    cpu_s: int | None = None
    memory_mb: int = 1024
    max_file_mb: int = 16
    max_output_chars: int = 4096
    max_processes: int = 16
    isolation: str = "auto"
    preload: tuple[str, ...] = ()
    max_concurrency: int = 16
    seccomp: bool = True
    landlock: bool = True
    audit_hook: bool = True
    require: tuple[str, ...] = ()
    readable: tuple[str, ...] = ()
    pool_size: int = 1
    prefork: int = 2
    session_cpu_s: int | None = None

    def __post_init__(self):
        if self.isolation not in ("auto", "namespaces", "audit"):
            raise ValueError(f"isolation must be 'auto', 'namespaces' or 'audit', got {self.isolation!r}")
        unknown = [layer for layer in self.require if layer not in LAYERS]
        if unknown:
            raise ValueError(f"require names unknown layers {unknown}; the layers are {list(LAYERS)}")
        switched_off = {"seccomp": not self.seccomp, "landlock": not self.landlock, "audit_hook": not self.audit_hook}
        switched_off["namespaces"] = self.isolation == "audit"
        contradicted = [layer for layer in self.require if switched_off[layer]]
        if contradicted:
            raise ValueError(f"require={list(self.require)} names layers this config switches off: {contradicted}")
        if any("\n" in path for path in self.readable):
            raise ValueError("readable paths cannot contain a newline")
        if self.timeout_s <= 0 or self.memory_mb < 32 or self.max_output_chars < 1 or self.max_concurrency < 1:
            raise ValueError(
                "timeout_s > 0, memory_mb >= 32, max_output_chars >= 1 and max_concurrency >= 1 are required"
            )
        if self.pool_size < 0 or self.prefork < 0:
            raise ValueError(f"pool_size and prefork must be >= 0, got {self.pool_size} and {self.prefork}")

    @property
    def cpu_limit_s(self) -> int:
        """The CPU-time limit per execution, seconds (``cpu_s``, else ``timeout_s`` rounded up)."""
        return self.cpu_s or max(1, int(-(-self.timeout_s // 1)))


@dataclasses.dataclass
class SandboxResult:
    """What one execution did.

    Attributes:
        stdout, stderr: the captured text (cut to ``max_output_chars``).
        exit_code: the process's exit status (negative: killed by that signal; ``None``: not started).
        timed_out: the wall-clock limit was hit and the process group killed.
        truncated: some output was cut.
        output_exceeded: the code flooded its output (see the module doc) and was stopped.
        elapsed_s: wall-clock seconds from start to exit.
        isolation: ``"namespaces"`` or ``"audit"``.
        layers: the layers that confined this run (:data:`LAYERS` names).
        runner: ``"fresh"`` (a new interpreter), ``"pool"`` (forked by a fork server) or
            ``"session"`` (a call in a :class:`PythonSession`).
        notes: lines for the model after the output (e.g. that a session was restarted).
    """

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    truncated: bool
    elapsed_s: float
    isolation: str
    output_exceeded: bool = False
    layers: tuple[str, ...] = ()
    runner: str = "fresh"
    notes: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def text(self) -> str:
        """The result as the model sees it: stdout, then stderr, then a status line when it failed."""
        parts = [self.stdout.rstrip("\n")] if self.stdout.strip() else []
        if self.stderr.strip():
            parts.append(self.stderr.rstrip("\n"))
        if self.output_exceeded:
            parts.append("[Stopped: the code printed far more than the output limit]")
        elif self.timed_out:
            parts.append(f"[Timed out: the code was stopped after {self.elapsed_s:.1f} s]")
        elif self.exit_code is not None and self.exit_code < 0:
            name = (
                signal.Signals(-self.exit_code).name
                if -self.exit_code in signal.valid_signals()
                else str(-self.exit_code)
            )
            parts.append(f"[The process was killed by {name}]")
        if self.truncated and not self.output_exceeded:
            parts.append("[Output truncated]")
        parts.extend(f"[{note}]" for note in self.notes)
        return "\n".join(parts) if parts else "[No output. Use print() to see values.]"


_semaphores: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[int, asyncio.Semaphore]] = (
    weakref.WeakKeyDictionary()
)


def _semaphore(limit: int) -> asyncio.Semaphore:
    per_loop = _semaphores.setdefault(asyncio.get_running_loop(), {})
    sem = per_loop.get(limit)
    if sem is None:
        sem = per_loop[limit] = asyncio.Semaphore(limit)
    return sem


def _child_env(workdir: str) -> dict[str, str]:
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        "PYTHONIOENCODING": "utf-8",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


class _Capture:
    """What a reader kept of one stream (at most ``cap`` bytes: its first, or with ``tail`` its
    last, where an error's traceback ends) and how much it saw."""

    def __init__(self, cap: int, tail: bool = False):
        self.cap, self.tail, self.kept, self.total = cap, tail, bytearray(), 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        if self.tail:
            self.kept = (self.kept + chunk)[-self.cap :]
            if self.total > len(self.kept):  # cut at the front: no half of a UTF-8 character first
                while self.kept and self.kept[0] & 0xC0 == 0x80:
                    del self.kept[0]
        elif len(self.kept) < self.cap:
            self.kept += chunk[: self.cap - len(self.kept)]

    @property
    def cut(self) -> bool:
        return self.total > len(self.kept)


async def _read_capped(stream: asyncio.StreamReader, capture: _Capture, overflow: asyncio.Event) -> None:
    while True:
        chunk = await stream.read(65536)
        if not chunk:
            break
        capture.add(chunk)
        if capture.total > max(_FLOOD_BYTES, 64 * capture.cap):
            # Signal the flood, but keep draining (and dropping) until EOF: a reader that
            # stopped would leave asyncio's pipe transport paused, so it would never see
            # EOF and ``proc.wait()`` (which waits for the pipes too) would never return.
            overflow.set()


def _layers(cfg: SandboxConfig, host: SandboxMode) -> tuple[str, ...]:
    """The layers a run with ``cfg`` gets on ``host``; RuntimeError when a required one is missing."""
    required = set(cfg.require) | ({"namespaces"} if cfg.isolation == "namespaces" else set())
    lacking = [layer for layer in LAYERS if layer in required and not host.has(layer)]
    if lacking:
        why = "; ".join(f"{layer}: {host.missing.get(layer, 'not available')}" for layer in lacking)
        raise RuntimeError(f"the sandbox config requires {', '.join(lacking)}, which this host lacks ({why})")
    wanted = {
        "namespaces": cfg.isolation != "audit",
        "landlock": cfg.landlock,
        "seccomp": cfg.seccomp,
        "audit_hook": cfg.audit_hook,
    }
    return tuple(layer for layer in LAYERS if wanted[layer] and host.has(layer))


@functools.cache
def _site_packages() -> tuple[str, ...]:
    """This interpreter's site-packages folders (the sandbox starts with ``-S`` and adds them itself)."""
    return tuple(path for path in site.getsitepackages() if os.path.isdir(path))


def _readable(cfg: SandboxConfig) -> list[str]:
    """Paths the code may read under Landlock: the interpreter's prefixes, the system's, ``cfg.readable``."""
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    paths = [*sorted(prefixes), *_site_packages(), *SYSTEM_READABLE, *cfg.readable]
    # /proc/self is resolved in the sandbox (it is its own process there), the rest here
    resolved = [path if path.startswith("/proc/self") else os.path.abspath(path) for path in paths]
    return [path for path in dict.fromkeys(resolved) if os.path.exists(path)]


def _boot_args(cfg: SandboxConfig, layers: tuple[str, ...], *, session: bool = False) -> list[str]:
    """The ``key=value`` arguments of the boot script (and, with ``session``, of the fork server,
    whose sessions get ``cpu_hard_s``; its one-shot children keep ``cpu_s + 1``) for ``cfg``."""
    namespaces = "namespaces" in layers
    limits = {
        "cpu_s": cfg.cpu_limit_s,
        "cpu_hard_s": (cfg.session_cpu_s or max(60, 10 * cfg.cpu_limit_s)) if session else None,
        "memory_bytes": cfg.memory_mb * 2**20,
        "file_bytes": cfg.max_file_mb * 2**20,
        "max_processes": cfg.max_processes if namespaces else None,
        "landlock": int("landlock" in layers),
        "seccomp": int("seccomp" in layers),
        "audit": int("audit_hook" in layers),
    }
    args = [f"{k}={'' if v is None else int(v)}" for k, v in limits.items()] + ["preload=" + ",".join(cfg.preload)]
    if "landlock" in layers:
        args.append("read=" + "\n".join(_readable(cfg)))
    args.append("site=" + "\n".join(_site_packages()))
    return args


async def _host_layers(cfg: SandboxConfig) -> tuple[SandboxMode, tuple[str, ...]]:
    if not _PROBED:  # the probe starts processes: not on the loop
        host = await asyncio.to_thread(sandbox_mode)
    else:
        host = sandbox_mode()
    return host, _layers(cfg, host)


def _server(cfg: SandboxConfig, layers: tuple[str, ...]) -> ForkServer:
    """The fork server for ``cfg`` (namespaces, when ``layers`` has them, are made per child)."""
    args = _boot_args(cfg, layers, session=True)
    args += [f"namespaces={int('namespaces' in layers)}", f"prefork={cfg.prefork}", f"tmp={tempfile.gettempdir()}"]
    argv = [sys.executable, "-I", "-S", "-B", _ZYGOTE, *args]
    return fork_server(argv, _child_env(tempfile.gettempdir()), tempfile.gettempdir(), cfg.pool_size or 1)


async def warm_up(config: SandboxConfig | None = None) -> None:
    """Start the fork servers of ``config`` now, rather than at its first execution (about 50-100 ms
    each). Raises :class:`RuntimeError` as :func:`run_python` does, and when the server cannot start."""
    cfg = config or SandboxConfig()
    host, layers = await _host_layers(cfg)
    if cfg.pool_size and host.pooled(layers):
        for _ in range(cfg.pool_size):
            server = _server(cfg, layers)
            if not server.ready:
                await asyncio.to_thread(server.start)


async def _pipe_streams(
    read_fds: Sequence[int], write_fd: int
) -> tuple[asyncio.StreamWriter, list[asyncio.StreamReader], list[asyncio.BaseTransport]]:
    """Event-loop streams over pipe ends of this process (the transports own and close them)."""
    loop = asyncio.get_running_loop()
    readers, transports = [], []
    for fd in read_fds:
        reader = asyncio.StreamReader(limit=2**20)
        transport, _ = await loop.connect_read_pipe(
            lambda reader=reader: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", 0)
        )
        readers.append(reader)
        transports.append(transport)
    transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, os.fdopen(write_fd, "wb", 0))
    transports.append(transport)
    return asyncio.StreamWriter(transport, protocol, None, loop), readers, transports


async def _hand_over(send) -> tuple[Any, tuple[asyncio.StreamWriter, list[asyncio.StreamReader], list]]:
    """Make one execution's stdin, stdout and stderr pipes, give the child's ends to ``await send(fds)``
    (which passes them on; they are closed here after it), and keep ours as event-loop streams.
    Returns what ``send`` returned and :func:`_pipe_streams`' result."""
    (stdin_read, stdin_write), (out_read, out_write), (err_read, err_write) = os.pipe(), os.pipe(), os.pipe()
    try:
        sent = await send((stdin_read, out_write, err_write))
    except BaseException:
        for fd in (stdin_write, out_read, err_read):
            os.close(fd)
        raise
    finally:
        for fd in (stdin_read, out_write, err_write):
            os.close(fd)
    return sent, await _pipe_streams((out_read, err_read), stdin_write)


async def _exchange(
    code: str,
    stdin: asyncio.StreamWriter,
    stdout: asyncio.StreamReader,
    stderr: asyncio.StreamReader,
    cfg: SandboxConfig,
    kill,
    answered: asyncio.Future | None = None,
) -> tuple[bytes, bytes, bool, bool, bool]:
    """Write ``code`` to the process and read its output until both streams end, within ``cfg.timeout_s``
    (``kill()`` on a timeout or a flood). A session's ``answered`` (its ``done`` reply) also ends the
    wait: what it printed is in the pipes by then, and a process it started may hold them open, so
    the rest is read for at most 0.25 s. Returns stdout, stderr, whether output was cut, whether it
    flooded, whether it timed out."""
    overflow = asyncio.Event()
    captures = _Capture(cfg.max_output_chars * 4), _Capture(cfg.max_output_chars * 4, tail=True)

    async def feed() -> None:
        try:
            stdin.write(code.encode("utf-8", "replace"))
            await stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            pass
        finally:
            stdin.close()

    async def gather() -> None:
        await feed()
        await asyncio.gather(_read_capped(stdout, captures[0], overflow), _read_capped(stderr, captures[1], overflow))

    io = asyncio.ensure_future(gather())
    stopper = asyncio.ensure_future(overflow.wait())
    waiting = {io, stopper} | ({answered} if answered is not None else set())
    try:
        done, _ = await asyncio.wait(waiting, timeout=cfg.timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
    grace = 0.25 if answered is not None and answered in done and not overflow.is_set() else 5.0
    if io not in done and grace > 1:
        kill()
    try:
        await asyncio.wait_for(io, grace)
    except (asyncio.TimeoutError, asyncio.CancelledError):
        io.cancel()
    out, err = captures
    return bytes(out.kept), bytes(err.kept), overflow.is_set() or out.cut or err.cut, overflow.is_set(), not done


def _result(
    out: bytes, err: bytes, cut: bool, flood: bool, timed_out: bool, exit_code, start: float, cfg, layers, **kw
):
    stdout, stderr = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
    mode = "namespaces" if "namespaces" in layers else "audit"
    if mode == "namespaces":  # unshare's own complaints about how its child ended
        stderr = "".join(ln for ln in stderr.splitlines(keepends=True) if not ln.startswith("unshare: "))
    cap = cfg.max_output_chars
    if len(stdout) > cap:
        stdout, cut = stdout[:cap], True
    if len(stderr) > cap:
        stderr, cut = stderr[-cap:], True
    elapsed = time.perf_counter() - start
    return SandboxResult(stdout, stderr, exit_code, timed_out, cut, elapsed, mode, flood, layers, **kw)


async def run_python(code: str, config: SandboxConfig | None = None) -> SandboxResult:
    """Run ``code`` in the sandbox (see the module doc) and return what it did.

    Never raises for anything the code does; waits for a free slot of the
    per-loop pool first. Forked by a fork server when ``config.pool_size > 0`` and
    the host can give a forked child every layer asked for, else a fresh interpreter.

    Args:
        code: Python source; a final expression's ``repr`` is printed, like a notebook cell.
        config: limits (default :class:`SandboxConfig()`).

    Raises:
        RuntimeError: a layer in ``config.require`` (or namespaces, for ``isolation="namespaces"``)
            that this host lacks; the message says why it is missing. :class:`ForkServerError`
            (a RuntimeError) when the fork server cannot start.
    """
    cfg = config or SandboxConfig()
    host, layers = await _host_layers(cfg)
    async with _semaphore(cfg.max_concurrency):
        if cfg.pool_size and host.pooled(layers):
            return await _run_pooled(code, cfg, layers)
        return await _run_fresh(code, cfg, layers)


async def _run_pooled(code: str, cfg: SandboxConfig, layers: tuple[str, ...]) -> SandboxResult:
    """One execution forked by the fork server (see the module doc)."""
    server = _server(cfg, layers)
    start = time.perf_counter()
    child, (stdin, (stdout, stderr), transports) = await _hand_over(lambda fds: server.spawn("run", fds))
    try:
        out, err, cut, flood, timed_out = await _exchange(code, stdin, stdout, stderr, cfg, child.kill)
        exit_code, overran = await _exit_status(child, kill=False, wait=_time_left(cfg, start))
        timed_out = timed_out or overran
    except BaseException:
        child.kill()
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(child.exited), 5.0)
        raise
    finally:
        for transport in transports:
            transport.close()
    notes = () if exit_code is not None else (_SERVER_STOPPED,)
    return _result(out, err, cut, flood, timed_out, exit_code, start, cfg, layers, runner="pool", notes=notes)


_SERVER_STOPPED = "The sandbox's fork server stopped during this run; the next run starts a new one"


#: Seconds past ``timeout_s`` a process that closed its output is given to end (or a session to answer).
_GRACE_S = 1.0


def _time_left(cfg: SandboxConfig, start: float) -> float:
    """What remains of ``cfg.timeout_s`` since ``start`` (``time.perf_counter()``), plus the grace."""
    return max(0.0, cfg.timeout_s - (time.perf_counter() - start)) + _GRACE_S


async def _exit_status(child: Child, *, kill: bool, wait: float = 10.0) -> tuple[int | None, bool]:
    """``(exit status, stopped)``: the child's status (``kill`` it first; or after ``wait`` seconds of
    waiting for it to end, when ``stopped`` is True: it closed its output and ran on), or ``None``
    when its fork server stopped before reporting it."""
    try:
        if kill:
            child.kill()
        try:
            return await asyncio.wait_for(asyncio.shield(child.exited), wait), False
        except asyncio.TimeoutError:  # it closed its output but does not end: stop it
            child.kill()
            return await asyncio.wait_for(asyncio.shield(child.exited), 10.0), True
    except ForkServerError:
        return None, False


async def _run_fresh(code: str, cfg: SandboxConfig, layers: tuple[str, ...]) -> SandboxResult:
    """One execution in a fresh interpreter (under ``unshare`` in namespaces mode)."""
    argv = [sys.executable, "-I", "-S", "-B", _BOOT, *_boot_args(cfg, layers)]
    if "namespaces" in layers:
        argv = [_unshare() or "unshare", *_UNSHARE, *argv]
    workdir = tempfile.mkdtemp(prefix="rl2gem-sandbox-")
    start = time.perf_counter()
    proc = None
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=workdir,
            env=_child_env(workdir),
            start_new_session=True,  # its own process group, killed as a whole
        )
        output = await _exchange(code, proc.stdin, proc.stdout, proc.stderr, cfg, lambda: _kill_group(proc.pid))
        transport = getattr(proc, "_transport", None)
        try:
            exit_code = await asyncio.wait_for(proc.wait(), 5.0)
        except asyncio.TimeoutError:  # a pipe still held open: drop the pipes, keep the status
            _kill_group(proc.pid)
            if transport is not None:
                transport.close()
            exit_code = await asyncio.wait_for(proc.wait(), 5.0)
        _kill_group(proc.pid)  # anything the code left behind in its group
        if transport is not None:  # release the pipes now, not when the loop is gone
            transport.close()
        return _result(*output, exit_code, start, cfg, layers)
    except BaseException:
        if proc is not None and proc.returncode is None:
            _kill_group(proc.pid)
            await asyncio.shield(proc.wait())
        raise
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _how_it_ended(result: SandboxResult) -> str:
    if result.output_exceeded:
        return "its output flooded"
    if result.timed_out:
        return "a call timed out"
    code = result.exit_code
    if code is None:
        return "its fork server stopped"
    if code < 0 and -code in signal.valid_signals():
        return f"killed by {signal.Signals(-code).name}"
    return f"it exited with status {code}"


class PythonSession:
    """One persistent sandboxed interpreter: globals, imports and files persist across :meth:`run`
    calls, like a notebook kernel; meant for one episode (close it with the episode).

    The process is forked by the fork server and confined once, with the same layers and limits as
    :func:`run_python`: ``timeout_s`` and ``cpu_s`` per call, ``memory_mb`` for the process,
    ``session_cpu_s`` of CPU in all. A call that times out, floods its output or ends the process
    kills the session; its result says so, and the next call starts a fresh session and says that
    variables from earlier calls are gone. Calls on one session run one at a time.

    A copy (``copy``, ``deepcopy``, ``pickle``) is allowed only while no process runs.

    Raises:
        RuntimeError: as :func:`run_python`; also when the config has ``pool_size=0`` or the host
            cannot give a forked child the layers asked for (sessions need the fork server).
        TypeError: a copy of a session whose process runs.
    """

    def __init__(self, config: SandboxConfig | None = None):
        self.config = config or SandboxConfig()
        self._socket: socket.socket | None = None
        self._child: Child | None = None
        self._lost: str | None = None  # why the previous session ended, for the next call's note
        self._lock: asyncio.Lock | None = None

    @property
    def pid(self) -> int | None:
        """The session process's pid on the host (``None`` before the first call)."""
        return self._child.pid if self._child is not None and not self._child.exited.done() else None

    def __getstate__(self) -> dict[str, Any]:
        """A session not started (or whose process ended) copies as a new one.

        Raises:
            TypeError: the session's process runs: its variables cannot be copied.
        """
        if self._child is not None and not self._child.exited.done():  # its pid may not be known yet
            raise TypeError(
                f"a PythonSession whose interpreter runs (pid {self._child.pid}) cannot be copied or pickled: its "
                "variables live in that process (copy the env before its first Python call, or use persistent=False)"
            )
        return {**self.__dict__, "_socket": None, "_child": None, "_lock": None}

    async def _open(self, layers: tuple[str, ...]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._child = await _server(self.config, layers).spawn("session", (theirs.fileno(),))
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.setblocking(False)
        self._socket = ours

    async def run(self, code: str) -> SandboxResult:
        """Run ``code`` in this session (a final expression's ``repr`` is printed)."""
        cfg = self.config
        host, layers = await _host_layers(cfg)
        if not cfg.pool_size or not host.pooled(layers):
            raise RuntimeError(
                "a Python session needs the fork server: pool_size >= 1 and a host that can give a forked "
                f"child every layer asked for ({host})"
            )
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock, _semaphore(cfg.max_concurrency):
            notes = []
            if self._child is None or self._child.exited.done():
                if self._lost is not None:
                    notes.append(f"New Python session: {self._lost}, so variables from earlier calls are gone")
                self.close()
                await self._open(layers)
            return await self._call(code, layers, tuple(notes))

    async def _call(self, code: str, layers: tuple[str, ...], notes: tuple[str, ...]) -> SandboxResult:
        assert self._socket is not None and self._child is not None
        loop, child, control = asyncio.get_running_loop(), self._child, self._socket

        async def send(fds: Sequence[int]) -> None:
            control.sendmsg([b"call"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])

        start = time.perf_counter()
        try:
            _, (stdin, (stdout, stderr), transports) = await _hand_over(send)
        except OSError:  # the session's socket is gone: it ended between two calls
            self.close()
            raise
        answered = asyncio.ensure_future(loop.sock_recv(control, 64))
        try:
            out, err, cut, flood, timed_out = await _exchange(
                code, stdin, stdout, stderr, self.config, child.kill, answered
            )
            try:
                wait = _time_left(self.config, start)
                reply = b"" if (timed_out or flood) else await asyncio.wait_for(asyncio.shield(answered), wait)
            except asyncio.TimeoutError:  # it closed its output and ran on past the time limit
                reply, timed_out = b"", True
            except OSError:
                reply = b""
            if reply.startswith(b"done ") and reply[5:].lstrip(b"-").isdigit():
                exit_code: int | None = int(reply[5:])
            else:  # the session ended (or lied): make sure, and take the status it ended with
                exit_code, _ = await _exit_status(child, kill=True)
        except BaseException:
            self.close()
            raise
        finally:
            answered.cancel()
            for transport in transports:
                transport.close()
        result = _result(out, err, cut, flood, timed_out, exit_code, start, self.config, layers, runner="session")
        result.notes = notes
        if child.exited.done() or reply[:5] != b"done ":
            self._lost = f"the previous one was stopped ({_how_it_ended(result)})"
            result.notes = (*notes, "The Python session was stopped: the next call starts a fresh one")
        return result

    def close(self) -> None:
        """End the session's process (safe to call twice; the next :meth:`run` starts a new one)."""
        child, control = self._child, self._socket
        self._child = self._socket = None
        if child is not None:
            with contextlib.suppress(RuntimeError):
                child.kill()
        if control is not None:
            control.close()

    async def aclose(self) -> None:
        """Coroutine twin of :meth:`close`."""
        self.close()


class PythonTool:
    """A :class:`rl2gem.tools.Tool` that runs Python code in the sandbox.

    Arguments: ``{"code": str}``. The result text is the printed output (the
    value of a final expression is printed too), the traceback of an error,
    and a status line when the code timed out or was killed.

    Args:
        config: sandbox limits (default: 10 s, 1 GiB, 4096 characters, auto isolation, the pool).
        name: the tool name the model calls (default ``"python"``).
        persistent: ``False``: each call is a fresh process (:func:`run_python`). ``True``:
            the calls of one episode share a :class:`PythonSession` (variables persist);
            :meth:`episode` gives each episode its own, which :class:`rl2gem.tools.ToolEnvWrapper`
            calls at every reset and closes when the episode ends.
    """

    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "Python code; use print() to show results."}},
        "required": ["code"],
        "additionalProperties": False,
    }

    def __init__(
        self,
        config: SandboxConfig | None = None,
        *,
        name: str = "python",
        instructions: str = "",
        persistent: bool = False,
    ):
        self.config = config or SandboxConfig()
        self.name = name
        self.instructions = instructions
        self.persistent = persistent
        self._session: PythonSession | None = None
        memory = (
            "Variables, imports and files persist between calls of this conversation."
            if persistent
            else "Variables do not persist between calls."
        )
        self.description = (
            f"Run Python 3 code in a {'persistent' if persistent else 'fresh'} sandboxed process and get what it "
            f"prints. No network, no files outside a temporary folder, limited time and memory. {memory}"
        )

    def episode(self) -> PythonTool:
        """The tool for one episode: ``self`` unless ``persistent``, else a copy with its own session."""
        if not self.persistent:
            return self
        return PythonTool(self.config, name=self.name, instructions=self.instructions, persistent=True)

    async def call(self, arguments: dict[str, Any]) -> str:
        code = str(arguments.get("code", ""))
        if not self.persistent:
            return (await run_python(code, self.config)).text()
        if self._session is None:
            self._session = PythonSession(self.config)
        return (await self._session.run(code)).text()

    def close(self) -> None:
        """End this tool's session, if it has one (safe to call twice)."""
        if self._session is not None:
            self._session.close()
            self._session = None

    async def aclose(self) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"PythonTool({self.config}, persistent={self.persistent})"
