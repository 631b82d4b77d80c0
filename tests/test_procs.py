import pathlib
import subprocess
import sys

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


def test_every_command_line_exits_without_the_final_collection():
    for path in COMMAND_LINES:
        text = (ROOT / path).read_text()
        main_block = text.split('\nif __name__ == "__main__":\n', 1)[1]
        assert main_block.strip() == "quick_exit_collection()\n    raise SystemExit(main())", path
