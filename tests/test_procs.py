import pathlib
import signal
import subprocess
import sys

from rl2gem.procs import free_port

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: Every command line of the package, as ``python -m`` or ``torchrun`` runs it.
COMMAND_LINES = (
    "trainers/ppo.py",
    "trainers/sft.py",
    "trainers/rm.py",
    "trainers/dpo.py",
    "trainers/tune.py",
    "trainers/agentic.py",
    "rl2gem/evaluate.py",
    "rl2gem/collect.py",
    "rl2gem/serve.py",
    "rl2gem/envserver.py",
    "rl2gem/retrieval.py",
)

PROGRAM = """
import atexit, gc, sys
from rl2gem.procs import quick_exit_collection

class Cycle:
    def __init__(self):
        self.me = self

atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count() > 0, flush=True))  # runs last
{call}
cycles = [Cycle() for _ in range(1000)]
atexit.register(lambda: print("frozen before:", gc.get_freeze_count() > 0, flush=True))  # runs first
with open(sys.argv[1], "w") as f:
    f.write("written")
"""


def test_quick_exit_collection_freezes_after_the_later_exit_handlers(tmp_path):
    for call, frozen in (("quick_exit_collection()", "True"), ("", "False")):
        target = tmp_path / f"out{bool(call)}.txt"
        out = subprocess.run(
            [sys.executable, "-c", PROGRAM.format(call=call), str(target)],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
        assert out.splitlines() == ["frozen before: False", f"frozen at exit: {frozen}"], out
        assert target.read_text() == "written"


def test_every_command_line_exits_without_finalization():
    for path in COMMAND_LINES:
        text = (ROOT / path).read_text()
        main_block = text.split('\nif __name__ == "__main__":\n', 1)[1]
        assert main_block.strip() == "run_main(main)", path


EXITING = """
import atexit, os, sys, threading, time
from rl2gem.procs import exit_without_finalization

class Finalized:
    def __del__(self, write=os.write):  # the builtins are gone by then
        write(1, b" + module teardown")

KEPT = Finalized()  # released when the interpreter clears this module
atexit.register(lambda: open(sys.argv[1] + ".atexit", "w").close())

def late():
    time.sleep(0.3)
    with open(sys.argv[1] + ".thread", "w") as f:
        f.write("joined")

threading.Thread(target=late).start()
sys.stdout.write("buffered, not flushed")
exit_without_finalization(int(sys.argv[2]))
"""


def test_exit_without_finalization_runs_what_an_exit_runs_but_not_the_module_teardown(tmp_path):
    """The exit status, a non-daemon thread joined, an ``atexit`` handler run and buffered stdout
    written, as by Python's own exit; the module teardown (a global's ``__del__``) skipped."""
    stem = tmp_path / "mark"
    run = subprocess.run([sys.executable, "-c", EXITING, str(stem), "3"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 3 and run.stdout == "buffered, not flushed", (run.returncode, run.stdout, run.stderr)
    assert (tmp_path / "mark.thread").read_text() == "joined" and (tmp_path / "mark.atexit").exists()
    ordinary = EXITING.replace("exit_without_finalization(int(sys.argv[2]))", "sys.exit(int(sys.argv[2]))")
    run = subprocess.run([sys.executable, "-c", ordinary, str(stem), "0"], capture_output=True, text=True, timeout=60)
    assert (run.returncode, run.stdout) == (0, "buffered, not flushed + module teardown")  # the program's control


def test_exit_without_finalization_stops_an_idle_thread_pool():
    """A ``ThreadPoolExecutor`` never shut down (torch.compile's C++ compile pool is one) has idle
    workers waiting for work: Python's exit wakes them through the threading module's exit hooks
    before joining threads. Joining them without those hooks hung forever (a compiled trainer
    never exited)."""
    program = (
        "from concurrent.futures import ThreadPoolExecutor\n"
        "from rl2gem.procs import exit_without_finalization\n"
        "POOL = ThreadPoolExecutor(2)\n"
        "print(POOL.submit(lambda: 6 * 7).result(), end='')\n"
        "exit_without_finalization(4)\n"
    )
    run = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    assert (run.returncode, run.stdout) == (4, "42"), run.stderr


GLOO_AT_EXIT = """
import os, sys
import torch
import torch.distributed as dist
from rl2gem.procs import run_main

def main():
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    global KEPT
    KEPT = dist.group.WORLD  # as a device mesh keeps its groups: destroy_process_group leaves them alive
    for _ in range(60):  # collectives still queued on the group's worker threads when main returns
        dist.all_gather_into_tensor(torch.empty(2_000_000), torch.ones(2_000_000), async_op=True)
    dist.destroy_process_group()
    print("done", flush=True)

{end}
"""


def test_a_gloo_worker_finishing_at_exit_does_not_abort_a_finished_run():
    """pytorch/pytorch#179291: a gloo worker thread that releases a tensor while the interpreter
    finalizes aborts the process (SIGABRT) after its work was done; :func:`run_main` exits 0.
    The same program ending through Python's own exit is the control: it aborts."""
    statuses = {}
    for end in ("run_main(main)", "main()"):
        for _ in range(3):
            program = GLOO_AT_EXIT.replace("{end}", end)
            run = subprocess.run(
                [sys.executable, "-W", "ignore", "-c", program, str(free_port())],
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert run.stdout == "done\n", run.stderr[-2000:]
            statuses.setdefault(end, []).append(run.returncode)
    assert statuses["run_main(main)"] == [0, 0, 0], statuses
    assert -signal.SIGABRT in statuses["main()"], statuses
