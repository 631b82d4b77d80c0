"""Fork server of the Python sandbox (run as ``python -I -S -B _sandbox_zygote.py key=value ...``).

The server starts the interpreter once, imports the standard modules model-written code
usually needs (and ``preload``), then serves requests from its parent on one connected
``SOCK_SEQPACKET`` socket (file descriptor ``control=``). It never runs user code: for each
request it forks a child, and only the child confines itself (its own session and process
group, new namespaces when ``namespaces=1``, resource limits, Landlock, seccomp, the audit hook,
all from :mod:`_sandbox_boot`) in a fresh working folder, then runs the code and exits.

Requests (parent to server), each one message:

* ``run <id>`` with three file descriptors: the child's stdin (the code, to its end), stdout
  and stderr. The child runs the code once, like :mod:`_sandbox_boot`'s ``main``.
* ``session <id>`` with one file descriptor: a ``SOCK_SEQPACKET`` socket over which the child
  serves calls in one persistent namespace (:func:`_sandbox_boot.serve_session`).
* ``kill <id>``: SIGKILL the child and its process group (if it is still running).

Replies (server to parent): ``ready <server pid>`` once; ``started <id> <pid>``; ``exit <id>
<status>`` (the exit code, negative for a signal) once the child is reaped, after its process
group was killed (nothing it started outlives it) and its working folder removed; ``failed <id>
<why>`` when no child could be forked. When the parent's end closes, the server kills every
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


class Server:
    """The request loop (see the module doc); one per process, single-threaded."""

    def __init__(self, cfg, control):
        self.cfg = cfg
        self.control = control
        self.pid = os.getpid()
        self.tmp = cfg.get("tmp") or "/tmp"
        self.children = {}  # pid -> (request id, working folder)
        self.pids = {}  # request id -> pid
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
        try:
            request = int(rest)
        except ValueError:
            request = None
        if verb in ("run", "session") and request is not None and len(fds) == (3 if verb == "run" else 1):
            self.fork(verb, request, fds)
        elif verb == "kill" and request in self.pids:
            self.kill(self.pids[request])
        for fd in fds:
            os.close(fd)

    def fork(self, kind, request, fds):
        folder = None
        try:
            folder = self.make_folder()
            pid = os.fork()
        except OSError as e:
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
            self.send(f"failed {request} {e}")
            return
        if pid == 0:
            try:
                self.child(kind, fds, folder)
            except BaseException as e:
                with contextlib.suppress(OSError):
                    os.write(2, f"sandbox: could not start the code: {e}\n".encode())
            os._exit(125)
        self.children[pid] = (request, folder)
        self.pids[request] = pid
        self.send(f"started {request} {pid}")

    def make_folder(self):
        while True:
            folder = os.path.join(self.tmp, "rl2gem-sandbox-" + os.urandom(6).hex())
            try:
                os.mkdir(folder, 0o700)
                return folder
            except FileExistsError:
                continue

    def child(self, kind, fds, folder):
        """In the forked child: cut every tie to the server, confine, run. Never returns."""
        os.setsid()  # its own process group, killed as a whole
        _, libc = boot._libc()
        boot._check(libc.prctl(boot._PR_SET_PDEATHSIG, 9, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
        if os.getppid() != self.pid:  # the server died before the line above
            os._exit(125)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        if kind == "run":
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
            keep = 3
        else:
            devnull = os.open(os.devnull, os.O_RDWR)
            for target in (0, 1, 2):
                os.dup2(devnull, target)
            os.dup2(fds[0], 3)
            keep = 4
        self.control.detach()  # the objects of the server go with closerange, not on collection
        os.closerange(keep, 1 << 20)
        os.chdir(folder)
        os.environ["HOME"] = os.environ["TMPDIR"] = folder
        if self.cfg.get("namespaces"):
            boot.enter_namespaces()
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
