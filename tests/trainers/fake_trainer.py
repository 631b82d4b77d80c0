"""A stand-in trainer for tune.py tests: the trainer command line (key=value, trainer.output_dir),
config.yaml and metrics.jsonl like the real ones, with ``eval/score`` at step s equal to
``s * (10 - |x - 7|)`` (best at x = 7), ``seconds_per_step`` apart. With ``worker=1`` it starts a
child in a session of its own, as torchrun starts its workers, writes its pid to ``worker.pid``
and stops it at a normal end."""

import json
import subprocess
import sys
import time
from pathlib import Path

from rl2gem.procs import exit_when_stdin_closes

exit_when_stdin_closes()  # as the trainers' launch() does: a trial ends with its tuner
args = dict(a.split("=", 1) for a in sys.argv[1:])
out = Path(args["trainer.output_dir"])
out.mkdir(parents=True, exist_ok=True)
(out / "config.yaml").write_text("".join(f"{k}: {v}\n" for k, v in args.items() if not k.startswith("trainer.")))
worker = None
if args.get("worker") == "1":
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    (out / "worker.pid").write_text(str(worker.pid))
x, steps, pause = float(args["x"]), int(args.get("steps", 5)), float(args.get("seconds_per_step", 0.1))
with open(out / "metrics.jsonl", "a") as f:
    for step in range(1, steps + 1):
        time.sleep(pause)
        f.write(json.dumps({"step": step, "train/loss": 1.0 / step}) + "\n")
        f.write(json.dumps({"step": step, "eval/score": step * (10 - abs(x - 7))}) + "\n")
        f.flush()
if worker is not None:
    worker.kill()
    worker.wait()
