"""A fork server for the ranks of the tests' torchrun jobs (:func:`helpers.torchrun`).

Every rank of a real ``torchrun`` job spends about 6 s of CPU importing torch, transformers and
rl2gem before it does anything, and the launcher 3 s more; the default suite runs about a hundred
such ranks on two cores. This process imports them once, then forks one child per rank, as
PyTorch's own ``MultiProcessTestCase`` forks its ranks from the test process. It never runs a
tensor operation itself, so no OpenMP thread pool exists to be broken by ``fork``.

Protocol (one JSON object per line): a request on stdin ``{"script", "args", "cwd", "env",
"stdout", "stderr"}`` is answered ``{"pid": N}`` on stdout once the child runs (in a session of its
own, stdin from /dev/null, stdout and stderr into the two files); ``{"exited": N, "code": C}``
follows when it ends (a signal ``S`` as ``-S``). End of stdin stops the server.
"""

import atexit
import gc
import json
import os
import runpy
import select
import sys

# What the ranks of the tests' jobs import: a child finds them loaded.
import reasoning_gym  # noqa: F401  (rl2/ReasoningGym-v0, rl2/Countdown-v0)
import rl2gem.envs
import torch
import torch.distributed.checkpoint
import torch.distributed.fsdp  # noqa: F401
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer  # noqa: F401

import rl2gem.training
import rl2gem.training.offline
import rl2gem.training.online  # noqa: F401


def _send(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send({"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def _start(request: dict) -> int:
    """Fork a child for ``request``; in the parent its pid, in the child 0 (it then runs the script)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for source, target in ((null, 0), (out, 1), (err, 2)):
        os.dup2(source, target)
        os.close(source)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    script = os.path.abspath(request["script"])
    sys.argv = [script, *request["args"]]
    sys.path[0] = os.path.dirname(script)  # as ``python script`` has it
    return 0


def serve() -> dict:
    """Answer requests until stdin closes (then exit); return only in a forked child, its request."""
    _send({"ready": os.getpid()})
    stdin = sys.stdin.fileno()
    pending = b""
    while True:
        readable, _, _ = select.select([stdin], [], [], 0.05)
        _reap()
        if not readable:
            continue
        chunk = os.read(stdin, 65536)
        if not chunk:
            raise SystemExit(0)
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            pid = _start(request)
            if pid == 0:
                return request
            _send({"pid": pid})


if __name__ == "__main__":
    atexit.register(gc.freeze)  # rl2gem.procs.quick_exit_collection, for the children too
    task = serve()
    runpy.run_path(sys.argv[0], run_name="__main__")  # the child: the rank's script; its exit is Python's
