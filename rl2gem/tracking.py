"""Metric logging: stdout, JSON lines, wandb (offline by default) or TensorBoard; a PNG of the curves.

Metric names follow the field: ``rollout/reward``, ``actor/pg_loss``,
``actor/kl``, ``perf/tokens_per_second``, ``time/rollout`` ...
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["Tracker", "plot_metrics"]

LOGGERS = ("stdout", "jsonl", "wandb", "tensorboard")
#: what one stdout line shows (everything goes to the other loggers)
STDOUT_KEYS = (
    "rollout/reward",
    "rollout/response_length",
    "rollout/rm_score",
    "actor/pg_loss",
    "actor/kl",
    "actor/entropy",
    "actor/clip_ratio",
    "actor/grad_norm",
    "train/loss",
    "rm/loss",
    "rm/accuracy",
    "rewards/accuracies",
    "rewards/margins",
    "perf/tokens_per_second",
    "perf/mfu",
    "time/step",
    "eval/success",
    "eval/reward",
    "eval/em",
    "eval/searches",
    "eval/loss",
    "eval/rm/accuracy",
    "eval/rewards/accuracies",
)


class Tracker:
    """Fan-out of ``log(metrics, step)`` to the chosen loggers (only rank 0 should make one).

    Args:
        loggers: subset of ``("stdout", "jsonl", "wandb", "tensorboard")``.
        output_dir: where ``metrics.jsonl`` / TensorBoard events / wandb files go.
        config: the run's resolved config (stored by wandb).

    Raises:
        ValueError: unknown logger.
    """

    def __init__(
        self, loggers, output_dir: str | Path, config: Mapping[str, Any] | None = None, project: str = "rl2gem"
    ):
        bad = [x for x in loggers if x not in LOGGERS]
        if bad:
            raise ValueError(f"unknown logger {bad[0]!r}; choose from {LOGGERS}")
        self.loggers = list(loggers)
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        self._jsonl = open(self.path, "a", encoding="utf-8") if "jsonl" in self.loggers else None  # noqa: SIM115 (closed by close())
        self._wandb = None
        self._tb = None
        if "wandb" in self.loggers:
            import wandb

            os.environ.setdefault("WANDB_MODE", "offline")
            self._wandb = wandb.init(project=project, dir=str(self.dir), config=dict(config or {}))
        if "tensorboard" in self.loggers:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.dir / "tensorboard"))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(float(v))}
        if "stdout" in self.loggers:
            keys = [k for k in STDOUT_KEYS if k in clean] or [k for k in clean if not k.startswith("time/")][:12]
            shown = "  ".join(f"{k}={clean[k]:.4g}" for k in keys)
            print(f"step {step}: {shown}", file=sys.stdout, flush=True)
        if self._jsonl:
            self._jsonl.write(json.dumps({"step": step, **clean}) + "\n")
            self._jsonl.flush()
        if self._wandb is not None:
            self._wandb.log(clean, step=step)
        if self._tb is not None:
            for k, v in clean.items():
                self._tb.add_scalar(k, v, step)

    def report(self, final: Mapping[str, float], checkpoint: str | Path, keys: tuple[str, ...]) -> Path:
        """End of a run: close the loggers, plot ``keys`` to ``curves.png``, print their table per
        step, the final evaluation and where the metrics, plot and checkpoint are. Returns the plot."""
        self.close()
        png = plot_metrics(self.path, self.dir / "curves.png", keys=keys)
        checkpoint = Path(checkpoint)
        print("\n" + metrics_table(self.path, keys=keys))
        print("\nfinal eval: " + "  ".join(f"{k.split('/', 1)[-1]} {v:.3f}" for k, v in final.items()))
        print(
            f"metrics: {self.path}\nplot: {png}\ncheckpoint: {checkpoint} (Hugging Face export: {checkpoint / 'hf'})",
            flush=True,
        )
        return png

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
            self._jsonl = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def plot_metrics(jsonl: str | Path, out_png: str | Path, keys=("rollout/reward", "eval/success")) -> Path:
    """Plot ``keys`` against step from a ``metrics.jsonl`` into a PNG (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in Path(jsonl).read_text().splitlines() if line.strip()]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key in keys:
        pts = [(r["step"], r[key]) for r in rows if key in r]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label=key)
    ax.set_xlabel("step")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(out_png)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def metrics_table(
    jsonl: str | Path, keys=("rollout/reward", "rollout/response_length", "eval/success"), max_rows: int = 12
) -> str:
    """A Markdown table of ``keys`` per step from a ``metrics.jsonl`` (the last value logged for a
    step wins, so a resumed run shows once). With more than ``max_rows`` steps, the steps with an
    evaluation are kept (and the first and last step), then others evenly spaced up to ``max_rows``."""
    by_step: dict[int, dict] = {}
    for line in Path(jsonl).read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            by_step.setdefault(int(row["step"]), {}).update(row)
    steps = sorted(s for s, r in by_step.items() if any(k in r for k in keys))
    if len(steps) > max_rows:
        keep = {s for s in steps if any(k.startswith("eval/") and k in by_step[s] for k in keys)} | {
            steps[0],
            steps[-1],
        }
        spare = max_rows - len(keep)
        if spare > 0:
            rest = [s for s in steps if s not in keep]
            keep |= {rest[round(i * (len(rest) - 1) / max(spare - 1, 1))] for i in range(min(spare, len(rest)))}
        steps = sorted(keep)
    lines = ["| step | " + " | ".join(keys) + " |", "|---:|" + "---:|" * len(keys)]
    for s in steps:
        cells = [f"{by_step[s][k]:.3f}" if isinstance(by_step[s].get(k), (int, float)) else "" for k in keys]
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
