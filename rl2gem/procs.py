"""Child service processes: start, wait for a ready line, stop without orphans.

The retrieval service, the embedded engine server and the sglang-router are
all started the same way: a subprocess that prints ``<PREFIX> <url>`` on
stdout when it listens, and exits when its stdin closes (so a crashed parent
never leaves it running).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import gc
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import NoReturn

from aiohttp import web

__all__ = [
    "ServiceProcess",
    "EXIT_ON_STDIN_EOF",
    "exit_when",
    "exit_when_stdin_closes",
    "exit_without_finalization",
    "kill_services",
    "free_port",
    "quick_exit_collection",
    "run_main",
    "serve_app",
    "serve_asgi",
    "stop_on_stdin_eof",
]


def quick_exit_collection() -> None:
    """Make this process's interpreter shutdown skip the cyclic garbage collector's walk over every
    live object: at exit (after the ``atexit`` handlers registered later, such as the loggers'),
    :func:`gc.freeze` moves all objects to the permanent generation. Called by :func:`run_main` (for
    a command line that ends in an exception), never at import, so a user's own program keeps
    Python's usual shutdown.

    A process that imported torch and transformers spends 1.8-2.5 s of CPU in its final
    collections (a PPO rank on this project's 2-core host; 0.27 s with this), every trainer rank,
    evaluation and server. Objects are still freed by reference counting as modules are cleared;
    only garbage in reference cycles is left to the operating system, so files must be closed by
    their owners, as every writer of this project does (``with open``, explicit ``close``)."""
    atexit.register(gc.freeze)


def exit_without_finalization(code: int | None = 0) -> NoReturn:
    """End this process with exit status ``code`` (None: 0) the way Python's own exit does, minus
    the interpreter's finalization: the threading module's exit hooks run (thread pools stop) and
    the non-daemon threads are joined, the ``atexit`` handlers run
    (loggers, trackers, :func:`quick_exit_collection`), stdout and stderr are flushed, then
    :func:`os._exit`. Never returns. Data left in the buffer of a file object nobody closed is
    lost (every writer of this project closes its files).

    Why: the worker threads of a gloo process group destroy each finished collective's work
    object, which may hold the last reference to a tensor whose Python object must be released,
    which needs the GIL. When that happens while the interpreter finalizes (the main thread is
    clearing modules, and the groups are still referenced by device meshes, so
    ``destroy_process_group`` does not join their threads), the thread is made to exit inside a
    ``noexcept`` destructor and the process aborts: SIGABRT, "terminate called without an active
    exception", after the run's work was done and written (pytorch/pytorch#179291). A two-rank
    FSDP job on this project's loaded 2-core CI host ended so about once in 300 runs.
    """
    # what Python's exit runs first: the threading module's exit hooks (they stop idle thread-pool
    # workers, such as torch.compile's, which would otherwise wait forever) then the non-daemon
    # threads joined
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0 if code is None else code)


def run_main(main: Callable[[], int | None]) -> NoReturn:
    """Run a command line's ``main()`` and exit with what it returns (None: 0) through
    :func:`exit_without_finalization`. An exception (``SystemExit`` too: a usage error) takes
    Python's usual exit, with the final collection skipped (:func:`quick_exit_collection`)."""
    quick_exit_collection()
    exit_without_finalization(main())


#: The services this process started (:func:`kill_services`).
_STARTED: weakref.WeakSet = weakref.WeakSet()


def kill_services() -> None:
    """SIGKILL the process group of every :class:`ServiceProcess` this process started that is still
    running: what a process about to ``os._exit`` does, since its ``finally`` blocks and ``atexit``
    handlers will not stop them (each runs in a session of its own)."""
    for service in list(_STARTED):
        proc = getattr(service, "proc", None)
        if proc is not None and proc.poll() is None:
            service._signal(signal.SIGKILL)


class ServiceProcess:
    """A started service.

    Args:
        cmd: the command line.
        ready_prefix: the first stdout line starting with it carries the URL
            (``<prefix> <url>``); with ``url`` given, readiness is instead
            polled at ``<url><health_path>``.
        timeout: seconds to wait for readiness.
        url / health_path: see ``ready_prefix``.

    Raises:
        RuntimeError: the process exited or was not ready in time (the message
            has the tail of its output).
    """

    def __init__(
        self,
        cmd: list[str],
        *,
        ready_prefix: str | None = None,
        timeout: float = 120.0,
        url: str | None = None,
        health_path: str = "/health",
        env: dict[str, str] | None = None,
    ):
        self.cmd = cmd
        _STARTED.add(self)
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=True,
        )
        self.output: deque[str] = deque(maxlen=200)
        self.url = url
        found = threading.Event()

        def pump():
            for line in self.proc.stdout:
                self.output.append(line.rstrip("\n"))
                if ready_prefix and not found.is_set() and line.startswith(ready_prefix):
                    self.url = line.split()[1]
                    found.set()

        self._pump = threading.Thread(target=pump, daemon=True)
        self._pump.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if ready_prefix and found.wait(0.1):
                return
            if not ready_prefix and url and _healthy(url + health_path):
                return
            if not ready_prefix:
                time.sleep(0.1)
        tail = "\n".join(list(self.output)[-30:])
        self.kill()
        raise RuntimeError(f"{' '.join(cmd[:4])}... did not become ready (exit code {self.proc.poll()}):\n{tail}")

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        """Close stdin (graceful), then SIGTERM, then SIGKILL the process group."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=timeout / 2)
            except Exception:
                pass
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=timeout / 2)
        self.kill()

    def kill(self) -> None:
        """SIGKILL the whole process group (no orphans), then close its pipes once the output is read."""
        self._signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        self._pump.join(timeout=5)  # the group is gone: its output ends
        if not self._pump.is_alive():
            for stream in (self.proc.stdin, self.proc.stdout):
                with contextlib.suppress(OSError):
                    stream.close()

    def _signal(self, sig) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return r.status == 200
    except Exception:
        return False


#: Set to ``1`` by a parent that hands a child its stdin's pipe: :func:`exit_when_stdin_closes`
#: then ends the child (and what it started) once the parent is gone.
EXIT_ON_STDIN_EOF = "RL2GEM_EXIT_ON_STDIN_EOF"


def exit_when_stdin_closes() -> threading.Thread | None:
    """When :data:`EXIT_ON_STDIN_EOF` is ``1`` in the environment: a daemon thread reads stdin to its
    end, then kills the services this process started (:func:`kill_services`) and exits at once.
    Returns the thread (None without the variable).

    The tuner starts each trial in a session of its own (so that a pruned one stops whole) with its
    stdin a pipe it holds: when the tuner is killed, the pipe closes, and the trial (torchrun's ranks
    inherit the pipe) ends instead of training on beside the resumed study."""
    if os.environ.get(EXIT_ON_STDIN_EOF) != "1":
        return None

    def closed() -> str:
        with contextlib.suppress(OSError):
            while os.read(0, 65536):  # the descriptor, not sys.stdin: a read blocked on its buffer's
                pass  # lock aborts the interpreter's shutdown ("could not acquire lock for <stdin>")
        return f"pid {os.getpid()}: its parent's pipe closed; this process stops"

    return exit_when(closed, "rl2gem-stdin-watch")


def exit_when(wait: Callable[[], str], name: str) -> threading.Thread:
    """A daemon thread (``name``) that calls ``wait``; when it returns (the process must end: its
    parent is gone), says what it returned on stderr, kills the services this process started
    (:func:`kill_services`) and exits at once, as if killed. Returns the thread."""

    def watch() -> None:
        why = wait()
        print(why, file=sys.stderr, flush=True)
        kill_services()
        os._exit(1)

    watcher = threading.Thread(target=watch, name=name, daemon=True)
    watcher.start()
    return watcher


def stop_on_stdin_eof(stop: asyncio.Event) -> None:
    """Set ``stop`` (from a daemon thread) when this process's stdin closes."""
    loop = asyncio.get_running_loop()
    threading.Thread(target=lambda: (sys.stdin.read(), loop.call_soon_threadsafe(stop.set)), daemon=True).start()


async def serve_asgi(
    app, host: str, port: int, ready_prefix: str, path: str = "", exit_on_stdin_eof: bool = False
) -> None:
    """:func:`serve_app` for an ASGI application (uvicorn, the app's lifespan run): prints
    ``<ready_prefix> http://host:port<path>`` once it accepts connections."""
    import uvicorn

    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    serving = asyncio.create_task(server.serve(sockets=[listener]))
    while not server.started and not serving.done():
        await asyncio.sleep(0.02)
    print(f"{ready_prefix} http://{host}:{listener.getsockname()[1]}{path}", flush=True)
    if exit_on_stdin_eof:
        stop = asyncio.Event()
        stop_on_stdin_eof(stop)
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait([serving, stopper], return_when=asyncio.FIRST_COMPLETED)
        server.should_exit = True
        stopper.cancel()
    await serving


def app_runner(app) -> web.AppRunner:
    """The runner of rl2gem's aiohttp servers: no access log, and a handler cancelled when its
    client disconnects (aiohttp 3.9+ no longer does by default), so a request whose client left
    is aborted in the engine instead of generating to its end."""
    return web.AppRunner(app, access_log=None, handler_cancellation=True)


async def serve_app(app, host: str, port: int, ready_prefix: str, exit_on_stdin_eof: bool = False) -> None:
    """Serve the aiohttp application ``app`` on ``host:port`` (0: a free port), print
    ``<ready_prefix> http://host:port`` (the real port) once it listens (what
    :class:`ServiceProcess` waits for), and serve until cancelled, or until stdin closes with
    ``exit_on_stdin_eof``; then clean the application up."""
    runner = app_runner(app)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    print(f"{ready_prefix} http://{host}:{site._server.sockets[0].getsockname()[1]}", flush=True)
    stop = asyncio.Event()
    if exit_on_stdin_eof:
        stop_on_stdin_eof(stop)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
