"""The parent's side of the sandbox's fork servers (:mod:`rl2gem.tools._sandbox_zygote`).

One :class:`ForkServer` is a started interpreter (the zygote) that forks sandboxed children on
request; :func:`fork_server` keeps up to ``size`` of them per distinct command line for the whole
process (any event loop, any thread may use them), starts them on first use, replaces one that
died, and forgets them in a forked child of this process (the child must not talk over the
parent's sockets). A reader thread per server turns the server's replies into results on the
event loop of the caller that asked.
"""

from __future__ import annotations

import array
import asyncio
import atexit
import contextlib
import itertools
import os
import select
import socket
import subprocess
import threading
from collections.abc import Sequence
from pathlib import Path

__all__ = ["Child", "ForkServer", "ForkServerError", "fork_server", "close_fork_servers"]

ZYGOTE = str(Path(__file__).with_name("_sandbox_zygote.py"))


class ForkServerError(RuntimeError):
    """The fork server could not start, or stopped, or could not fork a child."""


class Child:
    """One forked child: ``pid`` (once known), ``exited`` (a future of its exit status, negative
    for a signal, set once reaped; or :class:`ForkServerError`), and :meth:`kill`."""

    def __init__(self, server: ForkServer, request: int, loop: asyncio.AbstractEventLoop):
        self.server = server
        self.request = request
        self.loop = loop
        self.pid: int | None = None
        self.exited: asyncio.Future[int] = loop.create_future()

    def kill(self) -> None:
        """SIGKILL the child and its process group (through the server; safe to call twice)."""
        if not self.exited.done():
            self.server.send(f"kill {self.request}".encode())

    def _finish(self, value: int | BaseException) -> None:
        def settle() -> None:
            if self.exited.done():
                return
            if isinstance(value, BaseException):
                self.exited.set_exception(value)
                self.exited.exception()  # a result nobody waits for is not an "unretrieved" error
            else:
                self.exited.set_result(value)

        with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody is waiting
            self.loop.call_soon_threadsafe(settle)


class ForkServer:
    """A zygote started with ``argv`` (``python -I -S -B _sandbox_zygote.py key=value ...``).

    Thread-safe. Raises :class:`ForkServerError` when it cannot start or has stopped.
    """

    def __init__(self, argv: Sequence[str], env: dict[str, str], cwd: str):
        self.argv, self.env, self.cwd = list(argv), env, cwd
        self.process: subprocess.Popen | None = None
        self.socket: socket.socket | None = None
        self.pid: int | None = None
        self.children: dict[int, Child] = {}
        self.dead = False
        self._requests = itertools.count(1)
        self._start_lock = threading.Lock()
        self._send_lock = threading.Lock()

    @property
    def ready(self) -> bool:
        return self.pid is not None and not self.dead

    def start(self, timeout_s: float = 60.0) -> None:
        """Start the zygote and wait for its ``ready`` (blocking; idempotent)."""
        with self._start_lock:
            if self.ready or self.dead:
                if self.dead:
                    raise ForkServerError("the sandbox's fork server has stopped")
                return
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                self.process = subprocess.Popen(
                    [*self.argv, f"control={theirs.fileno()}"],
                    pass_fds=[theirs.fileno()],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    env=self.env,
                    cwd=self.cwd,
                    start_new_session=True,
                )
            finally:
                theirs.close()
            ready, _, _ = select.select([ours], [], [], timeout_s)
            reply = ours.recv(256) if ready else b""
            if not reply.startswith(b"ready "):
                ours.close()
                self.process.kill()
                self.process.wait()
                self.dead = True
                raise ForkServerError(f"the sandbox's fork server did not start (exit {self.process.returncode})")
            self.socket = ours
            threading.Thread(target=self._read, name="rl2gem-fork-server", daemon=True).start()
            self.pid = int(reply.split()[1])

    def send(self, message: bytes, fds: Sequence[int] = ()) -> None:
        """Send one request (blocking only while the server's buffer is full)."""
        if self.socket is None or self.dead:
            raise ForkServerError("the sandbox's fork server has stopped")
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        try:
            with self._send_lock:
                self.socket.sendmsg([message], ancillary)
        except OSError as e:
            raise ForkServerError(f"the sandbox's fork server has stopped: {e}") from e

    async def spawn(self, kind: str, fds: Sequence[int]) -> Child:
        """Ask for a child: ``kind`` ``"run"`` (fds: stdin, stdout, stderr) or ``"session"`` (fds: its
        socket). The caller still owns (and closes) ``fds``. Raises :class:`ForkServerError`."""
        if not self.ready:
            await asyncio.to_thread(self.start)
        request = next(self._requests)
        child = self.children[request] = Child(self, request, asyncio.get_running_loop())
        try:
            self.send(f"{kind} {request}".encode(), fds)
        except ForkServerError:
            self.children.pop(request, None)
            raise
        return child

    def _read(self) -> None:
        """The reader thread: replies to results, until the server's end closes."""
        assert self.socket is not None
        while True:
            try:
                data = self.socket.recv(512)
            except OSError:
                data = b""
            if not data:
                break
            verb, _, rest = data.decode(errors="replace").partition(" ")
            request, _, value = rest.partition(" ")
            child = self.children.get(int(request)) if request.isdigit() else None
            if child is None:
                continue
            if verb == "started":
                child.pid = int(value)
            elif verb == "exit":
                del self.children[child.request]
                child._finish(int(value))
            elif verb == "failed":
                del self.children[child.request]
                child._finish(ForkServerError(f"the sandbox's fork server could not fork: {value}"))
        self.dead = True
        for request in list(self.children):
            child = self.children.pop(request, None)
            if child is not None:
                child._finish(ForkServerError("the sandbox's fork server stopped"))

    def close(self, wait: bool = True) -> None:
        """Stop the server: it kills its children and exits (with ``wait``, this waits up to 5 s for
        that, then SIGKILLs it; without, subprocess reaps it later)."""
        self.dead = True
        if self.socket is not None:
            with contextlib.suppress(OSError):  # shutdown wakes the reader thread
                self.socket.shutdown(socket.SHUT_RDWR)
            self.socket.close()
        if wait and self.process is not None and self.process.poll() is None:
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


_servers: dict[tuple[str, ...], list[ForkServer]] = {}  # most recently used last
_servers_lock = threading.Lock()
#: Distinct configs whose servers are kept; beyond that, the least recently used idle ones stop.
MAX_CONFIGS = 8


def fork_server(argv: Sequence[str], env: dict[str, str], cwd: str, size: int = 1) -> ForkServer:
    """The least busy of up to ``size`` fork servers for ``argv`` in this process (made, not yet
    started, when fewer are alive). Servers of more than :data:`MAX_CONFIGS` other command lines
    are stopped, least recently used first, when none of their children is running."""
    key = tuple(argv)
    with _servers_lock:
        alive = [server for server in _servers.pop(key, []) if not server.dead]
        if len(alive) < size:
            alive.append(ForkServer(argv, env, cwd))
        _servers[key] = alive
        idle = [k for k, group in _servers.items() if k != key and not any(s.children for s in group)]
        stopping = [server for k in idle[: max(0, len(_servers) - MAX_CONFIGS)] for server in _servers.pop(k)]
        chosen = min(alive, key=lambda server: (len(server.children), not server.ready))
    for server in stopping:
        server.close(wait=False)  # not on the caller's event loop: it exits on its own
    return chosen


def close_fork_servers() -> None:
    """Stop every fork server of this process (at exit, and for tests)."""
    with _servers_lock:
        servers = [server for group in _servers.values() for server in group]
        _servers.clear()
    for server in servers:
        server.close()


def _forget_in_child() -> None:
    """After ``os.fork()`` of this process: the parent's servers are not ours to use or to stop."""
    global _servers_lock
    _servers.clear()
    _servers_lock = threading.Lock()  # it may have been held by another thread at the fork


atexit.register(close_fork_servers)
os.register_at_fork(after_in_child=_forget_in_child)
