"""Child-side start-up of the Python sandbox (run as ``python -I -B _sandbox_boot.py key=value ...``).

Reads the user code from stdin, then, before running it: sets resource limits,
installs an audit hook (PEP 578) that refuses network sockets, process
creation, ctypes, signals to other processes, writes outside the working
folder and reads of other processes' ``/proc`` entries, and finally executes
the code like a notebook cell (the value of a final expression is printed).

This file imports only the standard library and must stay importable on its own.
"""

import contextlib
import os
import resource
import sys

_BLOCKED_EVENTS = {
    "socket.__new__": "network access is disabled in the sandbox",
    "socket.connect": "network access is disabled in the sandbox",
    "socket.bind": "network access is disabled in the sandbox",
    "socket.getaddrinfo": "network access is disabled in the sandbox",
    "os.fork": "creating processes is disabled in the sandbox",
    "os.forkpty": "creating processes is disabled in the sandbox",
    "os.system": "creating processes is disabled in the sandbox",
    "os.exec": "creating processes is disabled in the sandbox",
    "os.posix_spawn": "creating processes is disabled in the sandbox",
    "os.spawn": "creating processes is disabled in the sandbox",
    "subprocess.Popen": "creating processes is disabled in the sandbox",
    "ctypes.dlsym": "loading native libraries with ctypes is disabled in the sandbox",
    "ctypes.dlsym/handle": "loading native libraries with ctypes is disabled in the sandbox",
    "os.kill": "sending signals is disabled in the sandbox",
    "os.killpg": "sending signals is disabled in the sandbox",
    "sys.addaudithook": "audit hooks cannot be changed in the sandbox",
}
# ``import ctypes`` stays possible (sympy imports its type names; the import opens the
# main program's handle); opening other libraries and looking up any symbol are refused.
_PRELOAD = ()
_WRITE_EVENTS = {
    "os.remove",
    "os.rmdir",
    "os.mkdir",
    "os.rename",
    "os.symlink",
    "os.link",
    "os.chmod",
    "os.chown",
    "os.truncate",
    "os.utime",
    "shutil.rmtree",
    "shutil.copyfile",
    "shutil.move",
    "os.chflags",
    "os.lchflags",
}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def _install(workdir):
    workdir = os.path.realpath(workdir)
    my_pid = str(os.getpid())
    realpath, fspath, sep = os.path.realpath, os.fspath, os.sep

    def inside(path):
        try:
            p = realpath(fspath(path))
        except Exception:
            return False
        return p == workdir or p.startswith(workdir + sep) or p == "/dev/null"

    def other_proc(path):
        try:
            p = fspath(path)
            if isinstance(p, bytes):
                p = p.decode("utf-8", "replace")
            p = realpath(p)
        except Exception:
            return False
        parts = p.split(sep)
        return len(parts) > 2 and parts[1] == "proc" and parts[2].isdigit() and parts[2] != my_pid

    def hook(event, args):
        reason = _BLOCKED_EVENTS.get(event)
        if reason is not None:
            raise PermissionError(reason)
        if event == "ctypes.dlopen" and args and args[0] is not None:
            raise PermissionError("loading native libraries with ctypes is disabled in the sandbox")
        if event == "open":
            path, mode, flags = (list(args) + [None, None, None])[:3]
            if isinstance(path, int) or path is None:
                return
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & _WRITE_FLAGS
            )
            if writing and not inside(path):
                raise PermissionError(f"writing outside the sandbox's working folder is disabled: {path!r}")
            if other_proc(path):
                raise PermissionError("reading other processes' /proc entries is disabled in the sandbox")
        elif event in _WRITE_EVENTS:
            for a in args[:2]:
                if isinstance(a, (str, bytes, os.PathLike)) and not inside(a):
                    raise PermissionError(f"changing files outside the sandbox's working folder is disabled: {a!r}")
        elif event in ("os.listdir", "os.scandir") and args and other_proc(args[0] if args[0] is not None else "."):
            raise PermissionError("reading other processes' /proc entries is disabled in the sandbox")

    sys.addaudithook(hook)


def _limits(cfg):
    def setl(which, value):
        if value is None:
            return
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(which, (value, value))

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if cfg.get("cpu_s"):
        import signal

        def on_xcpu(signum, frame):  # soft limit: say why, then exit (the hard limit SIGKILLs 1 s later)
            os.write(2, b"\nCPU time limit exceeded\n")
            os._exit(128 + signal.SIGXCPU)

        signal.signal(signal.SIGXCPU, on_xcpu)
        cpu = int(cfg["cpu_s"])
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    if cfg.get("memory_bytes"):
        setl(resource.RLIMIT_AS, int(cfg["memory_bytes"]))
    if cfg.get("file_bytes"):
        setl(resource.RLIMIT_FSIZE, int(cfg["file_bytes"]))
    if cfg.get("max_processes"):  # counted per user namespace: only set where the sandbox has its own
        setl(resource.RLIMIT_NPROC, int(cfg["max_processes"]))
    setl(resource.RLIMIT_NOFILE, 256)


def _run(code):
    import _ast  # the C module: the ``ast`` package's import would add milliseconds per run

    try:
        tree = compile(code, "<code>", "exec", _ast.PyCF_ONLY_AST)
    except (SyntaxError, ValueError):
        import traceback

        traceback.print_exc(limit=0)
        return 1
    last = None
    if tree.body and isinstance(tree.body[-1], _ast.Expr):
        last = _ast.Expression(tree.body.pop().value)
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(tree, "<code>", "exec"), namespace)
        if last is not None:
            value = eval(compile(last, "<code>", "eval"), namespace)
            if value is not None:
                print(repr(value))
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except MemoryError:
        sys.stderr.write("MemoryError: the sandbox's memory limit was exceeded\n")
        return 1
    except BaseException:
        import traceback

        etype, value, tb = sys.exc_info()
        # Leave out this file's frames: the model only needs its own code's traceback.
        while tb is not None and tb.tb_frame.f_code.co_filename != "<code>":
            tb = tb.tb_next
        te = traceback.TracebackException(etype, value, tb)
        te.stack = traceback.StackSummary.from_list([f for f in te.stack if f.filename != __file__])
        sys.stderr.write("".join(te.format()))
        return 1
    return 0


def main():
    cfg = {}
    for arg in sys.argv[1:]:  # key=value pairs: ints, or comma-separated module names for preload
        key, _, value = arg.partition("=")
        cfg[key] = tuple(v for v in value.split(",") if v) if key == "preload" else (int(value) if value else None)
    code = sys.stdin.read()
    sys.stdin.close()
    sys.stdin = open(os.devnull)  # noqa: SIM115 (stdin for the rest of the process)
    for name in (*_PRELOAD, *cfg.get("preload", ())):  # modules imported before the limits (e.g. numpy)
        with contextlib.suppress(Exception):
            __import__(name)
    _limits(cfg)
    _install(os.getcwd())
    sys.argv = ["<code>"]
    sys.path = [p for p in sys.path if p and os.path.realpath(p) != os.path.dirname(os.path.realpath(__file__))]
    rc = _run(code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc if isinstance(rc, int) else 1)


if __name__ == "__main__":
    main()
