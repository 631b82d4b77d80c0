"""Fork server of the Python sandbox (run as ``python -I -S -B _sandbox_zygote.py key=value ...``).

The server starts the interpreter once, imports the standard modules model-written code
usually needs (and ``preload``), then serves requests from its parent on one connected
``SOCK_SEQPACKET`` socket (file descriptor ``control=``). It never runs user code: for each
request it forks a child, and only the child confines itself (its own session and process
group, new namespaces when ``namespaces=1``, resource limits, Landlock, seccomp, the audit hook,
all from :mod:`_sandbox_boot`) in a fresh working folder, then runs the code and exits.

Requests (parent to server), each one message:

Children are forked ahead (``prefork=`` of them wait, their namespaces made, for the next
requests), so a request only hands its file descriptors and working folder to one of them.

* ``run <id>`` with three file descriptors: the child's stdin (the code, to its end), stdout
  and stderr. The child runs the code once, like :mod:`_sandbox_boot`'s ``main``.
* ``session <id>`` with one file descriptor: a ``SOCK_SEQPACKET`` socket over which the child
  serves calls in one persistent namespace (:func:`_sandbox_boot.serve_session`).
* ``kill <id>``: SIGKILL the child and its process group (if it is still running).

Replies (server to parent): ``ready <server pid>`` once; ``started <id> <pid>``; ``exit <id>
<status>`` (the exit code, negative for a signal) once the child is reaped, after its process
group was killed (nothing it started outlives it) and its working folder removed; ``failed <id>
<why>`` when no child could be forked. A child's process name says what it does:
``sandbox-waiting``, ``sandbox-run`` or ``sandbox-session``. When the parent's end closes, the server kills every
child and exits; each child dies with the server (``PR_SET_PDEATHSIG``).
"""

import contextlib
import gc
import os
import selectors
import shutil
import signal
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.realpath(__file__)))
import _sandbox_boot as boot

#: Imported once by the server, so a child's ``import`` of them costs nothing.
WARM_MODULES = (
    "_ast",
    "traceback",
    "math",
    "cmath",
    "re",
    "json",
    "itertools",
    "functools",
    "collections",
    "fractions",
    "decimal",
    "statistics",
    "random",
    "string",
    "heapq",
    "bisect",
    "datetime",
    "operator",
    "copy",
    "typing",
    "dataclasses",
    "ctypes",
)


def name(comm):
    """Set this process's name (``ps -o comm``, ``/proc/<pid>/comm``): what a child is doing."""
    _, libc = boot._libc()
    libc.prctl(15, comm, 0, 0, 0)  # PR_SET_NAME


class Server:
    """The request loop (see the module doc); one per process, single-threaded."""

    def __init__(self, cfg, control):
        self.cfg = cfg
        self.control = control
        self.pid, self.uid, self.gid = os.getpid(), os.getuid(), os.getgid()
        self.tmp = cfg.get("tmp") or "/tmp"
        self.prefork = cfg.get("prefork") or 0
        self.children = {}  # pid -> (request id, working folder); both None while it waits
        self.pids = {}  # request id -> pid
        self.waiting = []  # (pid, socket) of children forked ahead, waiting for a request
        self.wakeup_read, self.wakeup_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(self.wakeup_write)
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)
        self.selector = selectors.DefaultSelector()
        self.selector.register(control, selectors.EVENT_READ)
        self.selector.register(self.wakeup_read, selectors.EVENT_READ)

    def send(self, text):
        with contextlib.suppress(OSError):  # the parent is gone: the loop sees the end of the socket next
            self.control.send(text.encode())

    def serve(self):
        self.top_up()
        self.send(f"ready {self.pid}")
        while True:
            for key, _ in self.selector.select():
                if key.fileobj is self.control:
                    try:
                        message, fds, _, _ = socket.recv_fds(self.control, 256, 4)
                    except OSError:
                        message, fds = b"", []
                    if not message:
                        self.shutdown()
                    self.handle(message.decode(errors="replace"), fds)
                else:
                    while True:
                        try:
                            if not os.read(self.wakeup_read, 512):
                                break
                        except BlockingIOError:
                            break
            self.reap()

    def handle(self, message, fds):
        verb, _, rest = message.partition(" ")
        request = int(rest) if rest.isdigit() else None
        if verb in ("run", "session") and request is not None and len(fds) == (3 if verb == "run" else 1):
            self.start(verb, request, fds)
            self.top_up()
        elif verb == "kill" and request in self.pids:
            self.kill(self.pids[request])
        for fd in fds:
            os.close(fd)

    def start(self, kind, request, fds):
        """Hand the request to a waiting child (one forked now if none waits)."""
        folder = None
        try:
            folder = self.make_folder()
            while True:
                pid, channel = self.waiting.pop(0) if self.waiting else self.fork_waiting()
                try:
                    socket.send_fds(channel, [f"{kind} {folder}".encode()], fds)
                    break
                except OSError:  # it died while waiting: take the next one
                    continue
                finally:
                    channel.close()
        except OSError as e:
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
            self.send(f"failed {request} {e}")
            return
        self.children[pid] = (request, folder)
        self.pids[request] = pid
        self.send(f"started {request} {pid}")

    def top_up(self):
        while len(self.waiting) < self.prefork:
            try:
                self.waiting.append(self.fork_waiting())
            except OSError:
                return

    def fork_waiting(self):
        """Fork a child that cuts its ties to the server, makes its namespaces, then waits for a
        request on the returned socket. Raises OSError."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            pid = boot.fork_into_namespaces() if self.cfg.get("namespaces") else os.fork()
        except OSError:
            ours.close()
            theirs.close()
            raise
        if pid == 0:
            try:
                self.child(theirs)
            except BaseException as e:
                with contextlib.suppress(OSError):
                    os.write(2, f"sandbox: could not start the code: {e}\n".encode())
            os._exit(125)
        theirs.close()
        self.children[pid] = (None, None)
        return pid, ours

    def make_folder(self):
        while True:
            folder = os.path.join(self.tmp, "rl2gem-sandbox-" + os.urandom(6).hex())
            try:
                os.mkdir(folder, 0o700)
                return folder
            except FileExistsError:
                continue

    def child(self, channel):
        """In a forked child: cut every tie to the server, make the namespaces, wait for the request,
        confine, run. Never returns. A set-up error is reported once the request's stderr is here."""
        error = None
        try:
            if self.cfg.get("namespaces"):
                boot.inside_namespaces(self.uid, self.gid)
            os.setsid()  # its own process group, killed as a whole
            _, libc = boot._libc()
            boot._check(libc.prctl(boot._PR_SET_PDEATHSIG, 9, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
            if os.getppid() not in (self.pid, 0):  # the server died before the line above
                os._exit(125)  # (0: the parent is outside the child's PID namespace, so not dead)
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            devnull = os.open(os.devnull, os.O_RDWR)
            for target in (0, 1, 2):
                os.dup2(devnull, target)
            os.dup2(channel.detach(), 3)
            self.control.detach()  # the server's objects go with closerange, not on collection
            os.closerange(4, 1 << 20)
            name(b"sandbox-waiting")
        except Exception as e:
            error = e
        waiter = socket.socket(fileno=3)
        message, fds, _, _ = socket.recv_fds(waiter, 4096, 3)
        waiter.close()
        kind, _, folder = message.decode().partition(" ")
        if not message or len(fds) != (3 if kind == "run" else 1):
            os._exit(0)
        name(b"sandbox-" + kind.encode())
        for target, fd in enumerate(fds, start=0 if kind == "run" else 3):
            os.dup2(fd, target)
            os.close(fd)
        if error is not None:
            raise error
        os.chdir(folder)
        os.environ["HOME"] = os.environ["TMPDIR"] = folder
        if kind == "run":
            boot.execute(dict(self.cfg, cpu_hard_s=None), boot.read_code())
        boot.serve_session(self.cfg, socket.socket(fileno=3))

    def kill(self, pid):
        for kill in (os.killpg, os.kill):
            with contextlib.suppress(OSError):
                kill(pid, signal.SIGKILL)

    def reap(self):
        while self.children:
            try:  # peek first: the pid stays reserved (so its group can be killed) until reaped
                found = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return
            if found is None or found.si_pid == 0:
                return
            pid = found.si_pid
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)  # anything the child left running in its group
            _, status = os.waitpid(pid, 0)
            request, folder = self.children.pop(pid, (None, None))
            for entry in [entry for entry in self.waiting if entry[0] == pid]:
                self.waiting.remove(entry)
                entry[1].close()
            if request is None:
                continue
            self.pids.pop(request, None)
            shutil.rmtree(folder, ignore_errors=True)
            self.send(f"exit {request} {os.waitstatus_to_exitcode(status)}")

    def shutdown(self):
        for pid in list(self.children):
            self.kill(pid)
        for pid, (_, folder) in list(self.children.items()):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
        os._exit(0)


def main():
    cfg = boot.parse_args(sys.argv[1:])
    control = socket.socket(fileno=int(cfg["control"]))
    boot._site(cfg.get("site", ()))
    boot.preload((*WARM_MODULES, *cfg.get("preload", ())))
    boot._libc()  # ctypes and libc loaded once, before any fork
    if cfg.get("seccomp"):
        boot.seccomp_filter(os.uname().machine, 0)  # the pid-independent part, built once
    gc.collect()
    gc.freeze()  # a child's collections never walk (so never copy) the server's objects
    Server(cfg, control).serve()


if __name__ == "__main__":
    main()
