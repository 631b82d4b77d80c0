"""A Python sandbox for model-written code, and :class:`PythonTool` over it.

Each execution is a fresh ``python -I -S -B`` process started with
``asyncio.create_subprocess_exec`` (the event loop never blocks), at most
``max_concurrency`` at a time per event loop. The boundary is made of kernel
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
                             file mode/owner/time/xattr changes; signals only to the sandbox's own pid.
                             A 32-bit or x32 system call kills the process.
**namespaces**               a new user, network (only a down loopback), PID (its own ``/proc``) and
                             mount namespace, made by ``unshare`` where unprivileged user namespaces
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

A layer asked for but not installable at run time stops the run before the
code starts (fail closed); ``SandboxConfig(require=(...))`` refuses to run at
all on a host without the named layers. What the boundary does not cover: the
CPU time and memory bandwidth of the host (shared), reads of the allowed
read-only paths, system calls newer than the filter's table (the filter allows
what it does not name), and kernel bugs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import os
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any

__all__ = ["SandboxConfig", "SandboxMode", "SandboxResult", "run_python", "sandbox_mode", "PythonTool"]

#: Output (bytes per stream) after which a process is stopped early.
_FLOOD_BYTES = 1 << 20
_BOOT = str(Path(__file__).with_name("_sandbox_boot.py"))
_UNSHARE = ["--user", "--map-root-user", "--net", "--pid", "--fork", "--mount-proc", "--kill-child"]
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
        namespaces: ``unshare`` can make unprivileged user, network, PID and mount namespaces.
        seccomp: a seccomp-bpf filter could be installed (x86_64 or arm64 Linux).
        landlock: the kernel's Landlock ABI version, ``0`` when it has none.
        missing: for each unavailable layer, why (the error the probe got).
    """

    namespaces: bool
    seccomp: bool
    landlock: int
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

    def __str__(self) -> str:
        names = [f"landlock (ABI {self.landlock})" if layer == "landlock" else layer for layer in self.layers]
        missing = "; ".join(f"no {layer}: {why}" for layer, why in self.missing.items())
        return ", ".join(names) + (f" ({missing})" if missing else "")


@functools.cache
def sandbox_mode() -> SandboxMode:
    """Probe (once per process) which sandbox layers this host offers; see :class:`SandboxMode`."""
    missing = {}
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
    found = {}
    with tempfile.TemporaryDirectory(prefix="rl2gem-sandbox-probe-") as folder:
        try:
            r = subprocess.run(
                [sys.executable, "-I", "-B", _BOOT, "probe=1", "landlock=1", "seccomp=1"],
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
    for layer in ("landlock", "seccomp"):
        if not found.get(layer):
            missing.setdefault(layer, "the probe could not install it")
    return SandboxMode(namespaces, bool(found.get("seccomp")), found.get("landlock", 0), missing)


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


async def _read_capped(stream: asyncio.StreamReader, cap: int, overflow: asyncio.Event) -> tuple[bytes, bool]:
    kept, total = bytearray(), 0
    while True:
        chunk = await stream.read(65536)
        if not chunk:
            break
        total += len(chunk)
        if len(kept) < cap:
            kept += chunk[: cap - len(kept)]
        if total > max(_FLOOD_BYTES, 64 * cap):
            # Signal the flood, but keep draining (and dropping) until EOF: a reader that
            # stopped would leave asyncio's pipe transport paused, so it would never see
            # EOF and ``proc.wait()`` (which waits for the pipes too) would never return.
            overflow.set()
    return bytes(kept), total > len(kept)


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


async def run_python(code: str, config: SandboxConfig | None = None) -> SandboxResult:
    """Run ``code`` in the sandbox (see the module doc) and return what it did.

    Never raises for anything the code does; waits for a free slot of the
    per-loop pool first.

    Args:
        code: Python source; a final expression's ``repr`` is printed, like a notebook cell.
        config: limits (default :class:`SandboxConfig()`).

    Raises:
        RuntimeError: a layer in ``config.require`` (or namespaces, for ``isolation="namespaces"``)
            that this host lacks; the message says why it is missing.
    """
    cfg = config or SandboxConfig()
    if sandbox_mode.cache_info().currsize == 0:  # the one-time probe starts processes: not on the loop
        await asyncio.to_thread(sandbox_mode)
    host = sandbox_mode()
    layers = _layers(cfg, host)
    mode = "namespaces" if "namespaces" in layers else "audit"
    limits = {
        "cpu_s": cfg.cpu_s or max(1, int(-(-cfg.timeout_s // 1))),
        "memory_bytes": cfg.memory_mb * 2**20,
        "file_bytes": cfg.max_file_mb * 2**20,
        "max_processes": cfg.max_processes if mode == "namespaces" else None,
        "landlock": int("landlock" in layers),
        "seccomp": int("seccomp" in layers),
        "audit": int("audit_hook" in layers),
    }
    args = [f"{k}={'' if v is None else int(v)}" for k, v in limits.items()] + ["preload=" + ",".join(cfg.preload)]
    if "landlock" in layers:
        args.append("read=" + "\n".join(_readable(cfg)))
    args.append("site=" + "\n".join(_site_packages()))
    argv = [sys.executable, "-I", "-S", "-B", _BOOT, *args]
    if mode == "namespaces":
        argv = [_unshare() or "unshare", *_UNSHARE, *argv]
    cap = cfg.max_output_chars
    async with _semaphore(cfg.max_concurrency):
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
            overflow = asyncio.Event()

            async def feed() -> None:
                try:
                    proc.stdin.write(code.encode("utf-8", "replace"))
                    await proc.stdin.drain()
                except (BrokenPipeError, ConnectionResetError):
                    pass
                finally:
                    proc.stdin.close()

            async def gather():
                await feed()
                return await asyncio.gather(
                    _read_capped(proc.stdout, cap * 4, overflow), _read_capped(proc.stderr, cap * 4, overflow)
                )

            io = asyncio.ensure_future(gather())
            stopper = asyncio.ensure_future(overflow.wait())
            done, _ = await asyncio.wait({io, stopper}, timeout=cfg.timeout_s, return_when=asyncio.FIRST_COMPLETED)
            timed_out = not done
            if io not in done:
                _kill_group(proc.pid)
            stopper.cancel()
            try:
                (out, cut_out), (err, cut_err) = await asyncio.wait_for(io, 5.0)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                io.cancel()
                out, err, cut_out, cut_err = b"", b"", False, False
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
            elapsed = time.perf_counter() - start
            stdout, stderr = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
            if mode == "namespaces":  # unshare's own complaints about how its child ended
                stderr = "".join(ln for ln in stderr.splitlines(keepends=True) if not ln.startswith("unshare: "))
            truncated = overflow.is_set() or cut_out or cut_err
            if len(stdout) > cap:
                stdout, truncated = stdout[:cap], True
            if len(stderr) > cap:
                stderr, truncated = stderr[-cap:], True
            return SandboxResult(
                stdout, stderr, exit_code, timed_out, bool(truncated), elapsed, mode, overflow.is_set(), layers
            )
        except BaseException:
            if proc is not None and proc.returncode is None:
                _kill_group(proc.pid)
                await asyncio.shield(proc.wait())
            raise
        finally:
            shutil.rmtree(workdir, ignore_errors=True)


class PythonTool:
    """A :class:`rl2gem.tools.Tool` that runs Python code in the sandbox (:func:`run_python`).

    Arguments: ``{"code": str}``. The result text is the printed output (the
    value of a final expression is printed too), the traceback of an error,
    and a status line when the code timed out or was killed.

    Args:
        config: sandbox limits (default: 10 s, 1 GiB, 4096 characters, auto isolation).
        name: the tool name the model calls (default ``"python"``).
    """

    description = (
        "Run Python 3 code in a fresh sandboxed process and get what it prints. "
        "No network, no files outside a temporary folder, limited time and memory. "
        "Variables do not persist between calls."
    )
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "Python code; use print() to show results."}},
        "required": ["code"],
        "additionalProperties": False,
    }

    def __init__(self, config: SandboxConfig | None = None, *, name: str = "python", instructions: str = ""):
        self.config = config or SandboxConfig()
        self.name = name
        self.instructions = instructions

    async def call(self, arguments: dict[str, Any]) -> str:
        result = await run_python(str(arguments.get("code", "")), self.config)
        return result.text()

    def __repr__(self) -> str:
        return f"PythonTool({self.config})"
