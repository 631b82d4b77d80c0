"""A Python sandbox for model-written code, and :class:`PythonTool` over it.

Each execution is a fresh ``python -I -B`` process started with
``asyncio.create_subprocess_exec`` (the event loop never blocks), at most
``max_concurrency`` at a time per event loop. What confines it:

===========================  ============================================================================
wall clock                   ``timeout_s``; then the whole process group is SIGKILLed (no orphans)
CPU time                     ``RLIMIT_CPU`` = ``cpu_s`` (SIGXCPU, then SIGKILL one second later)
memory                       ``RLIMIT_AS`` = ``memory_mb`` (address space; a bomb gets ``MemoryError``)
file size                    ``RLIMIT_FSIZE`` = ``max_file_mb``
network                      **namespaces** mode: a new, empty network namespace (only a down
                             loopback), made by ``unshare --user --map-root-user --net --pid --fork
                             --mount-proc``; the child also gets its own PID namespace and ``/proc``,
                             so other processes (and their environments) are invisible, and
                             ``RLIMIT_NPROC`` caps the processes of that namespace. **audit** mode
                             (no unprivileged user namespaces on the host): only the audit hook below.
audit hook (both modes)      PEP 578 hook installed before the code runs: refuses socket creation
                             and connection, ``fork``/``exec``/``subprocess``/``posix_spawn``,
                             ``ctypes``, signals, writes/renames/deletes outside the working folder,
                             and other processes' ``/proc`` entries. An audit hook is a Python-level
                             guard: code that reaches native calls some other way can bypass it, which
                             is why namespaces mode is preferred where the kernel allows it.
working folder               a fresh temporary folder per execution, deleted afterwards
environment                  empty except ``PATH``, ``HOME``/``TMPDIR`` (the working folder), ``LANG``
                             and single-thread BLAS settings: nothing of the parent's variables
output                       stdout and stderr each kept to ``max_output_chars``; a process that
                             writes more than 1 MiB (or 256x the limit) to one stream is stopped early
===========================  ============================================================================

:func:`sandbox_mode` says which network isolation this host gives (checked once).
This is a resource and side-effect sandbox for RL rollouts of one's own
policy, not a boundary against a determined attacker (no seccomp filter, the
file system is readable).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any

__all__ = ["SandboxConfig", "SandboxResult", "run_python", "sandbox_mode", "PythonTool"]

#: Output (bytes per stream) after which a process is stopped early.
_FLOOD_BYTES = 1 << 20
_BOOT = str(Path(__file__).with_name("_sandbox_boot.py"))
_UNSHARE = ["--user", "--map-root-user", "--net", "--pid", "--fork", "--mount-proc", "--kill-child"]


@functools.cache
def _unshare() -> str | None:
    return shutil.which("unshare")


@functools.cache
def sandbox_mode() -> str:
    """``"namespaces"`` when ``unshare`` can make unprivileged user/net/pid namespaces here, else ``"audit"``."""
    exe = _unshare()
    if exe is None:
        return "audit"
    try:
        r = subprocess.run([exe, *_UNSHARE, sys.executable, "-I", "-c", "pass"], capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "audit"
    return "namespaces" if r.returncode == 0 else "audit"


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
            available) or ``"audit"``.
        preload: modules imported before the limits and the audit hook (faster, and
            lets e.g. ``numpy`` load its native parts), e.g. ``("numpy",)``.
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

    def __post_init__(self):
        if self.isolation not in ("auto", "namespaces", "audit"):
            raise ValueError(f"isolation must be 'auto', 'namespaces' or 'audit', got {self.isolation!r}")
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
    """

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    truncated: bool
    elapsed_s: float
    isolation: str
    output_exceeded: bool = False

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


async def run_python(code: str, config: SandboxConfig | None = None) -> SandboxResult:
    """Run ``code`` in the sandbox (see the module doc) and return what it did.

    Never raises for anything the code does; waits for a free slot of the
    per-loop pool first.

    Args:
        code: Python source; a final expression's ``repr`` is printed, like a notebook cell.
        config: limits (default :class:`SandboxConfig()`).

    Raises:
        RuntimeError: ``isolation="namespaces"`` on a host without user namespaces.
    """
    cfg = config or SandboxConfig()
    if sandbox_mode.cache_info().currsize == 0:  # the one-time probe starts a process: not on the loop
        await asyncio.to_thread(sandbox_mode)
    mode = sandbox_mode() if cfg.isolation == "auto" else cfg.isolation
    if cfg.isolation == "namespaces" and sandbox_mode() != "namespaces":
        raise RuntimeError(
            "isolation='namespaces' was asked for, but this host does not allow unprivileged user namespaces"
        )
    limits = {
        "cpu_s": cfg.cpu_s or max(1, int(-(-cfg.timeout_s // 1))),
        "memory_bytes": cfg.memory_mb * 2**20,
        "file_bytes": cfg.max_file_mb * 2**20,
        "max_processes": cfg.max_processes if mode == "namespaces" else None,
    }
    args = [f"{k}={'' if v is None else int(v)}" for k, v in limits.items()] + ["preload=" + ",".join(cfg.preload)]
    argv = [sys.executable, "-I", "-B", _BOOT, *args]
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
                stdout, stderr, exit_code, timed_out, bool(truncated), elapsed, mode, overflow.is_set()
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
