"""Metric logging: stdout, JSON lines, wandb (offline by default), TensorBoard or MLflow (a local
SQLite store by default); a PNG of the curves.

Metric names follow the field: ``rollout/reward``, ``actor/pg_loss``,
``actor/kl``, ``perf/tokens_per_second``, ``time/rollout`` ...
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["Tracker", "flat_config", "plot_metrics"]

LOGGERS = ("stdout", "jsonl", "wandb", "tensorboard", "mlflow")
#: MLflow's limits: parameters and metrics per ``log_batch`` call, characters of a parameter's value
MLFLOW_BATCH, MLFLOW_METRICS, MLFLOW_PARAM_CHARS = 100, 1000, 6000
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
        loggers: subset of ``("stdout", "jsonl", "wandb", "tensorboard", "mlflow")``.
        output_dir: where ``metrics.jsonl`` / TensorBoard events / wandb files / the MLflow store go.
        config: the run's resolved config (stored by wandb; MLflow parameters, flattened to dotted keys).
        project: the wandb project and the MLflow experiment.
        resume: this run continues the one logged in ``output_dir`` (``trainer.resume``).

    MLflow: the tracking URI is ``MLFLOW_TRACKING_URI`` when set, else a SQLite store
    ``<output_dir>/mlflow.db`` with artifacts in ``<output_dir>/mlartifacts`` (MLflow 3 keeps its
    ``./mlruns`` file store in maintenance mode and refuses it by default; a SQLite file is its local
    store now). Browse with ``mlflow ui --backend-store-uri sqlite:///<output_dir>/mlflow.db``. The
    run id is kept in ``<output_dir>/mlflow_run_id``, so a resumed run logs into the same MLflow run
    (a re-logged step adds a point at that step; :func:`metrics_table` and plots read ``metrics.jsonl``).
    wandb's run id is kept in ``<output_dir>/wandb_run_id`` alike (``resume="allow"``). Without
    ``resume`` the run is a new one: ``metrics.jsonl`` is rewritten and new MLflow and wandb runs start.
    A resumed run drops the rows of ``metrics.jsonl`` after its checkpoint (:meth:`rewind`), so
    each step is logged there once.

    Raises:
        ValueError: unknown logger.
    """

    def __init__(
        self,
        loggers,
        output_dir: str | Path,
        config: Mapping[str, Any] | None = None,
        project: str = "rl2gem",
        resume: bool = True,
    ):
        bad = [x for x in loggers if x not in LOGGERS]
        if bad:
            raise ValueError(f"unknown logger {bad[0]!r}; choose from {LOGGERS}")
        self.loggers = list(loggers)
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        mode = "a" if resume else "w"  # a new run's metrics are its own
        self._jsonl = open(self.path, mode, encoding="utf-8") if "jsonl" in self.loggers else None  # noqa: SIM115 (closed by close())
        self.rows: list[dict[str, float]] = []  # this process's rows: the report's without jsonl
        self._wandb = None
        self._tb = None
        self._mlflow = None
        if "wandb" in self.loggers:
            import wandb

            os.environ.setdefault("WANDB_MODE", "offline")
            id_file = self.dir / "wandb_run_id"  # a resumed run goes on logging into its wandb run
            run_id = id_file.read_text().strip() if resume and id_file.exists() else uuid.uuid4().hex[:12]
            id_file.write_text(run_id + "\n")
            self._wandb = wandb.init(
                project=project, dir=str(self.dir), config=dict(config or {}), id=run_id, resume="allow"
            )
        if "tensorboard" in self.loggers:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.dir / "tensorboard"))
        if "mlflow" in self.loggers:
            self._mlflow = MlflowRun(self.dir, project, config, resume)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(float(v))}
        self.rows.append({"step": step, **clean})
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
        if self._mlflow is not None:
            self._mlflow.log(clean, step)

    def report(self, final: Mapping[str, float], checkpoint: str | Path | None, keys: tuple[str, ...]) -> Path:
        """End of a run: close the loggers, plot ``keys`` to ``curves.png``, print their table per
        step, the final evaluation and where the metrics, plot and checkpoint are (from
        ``metrics.jsonl``; without the ``jsonl`` logger, from this process's rows). Returns the plot."""
        jsonl = self._jsonl is not None
        self.close()
        source = self.path if jsonl else self.rows
        png = plot_metrics(source, self.dir / "curves.png", keys=keys)
        print("\n" + metrics_table(source, keys=keys))
        print("\nfinal eval: " + "  ".join(f"{k.split('/', 1)[-1]} {v:.3f}" for k, v in final.items()))
        saved = (
            "none (no step trained)"
            if checkpoint is None
            else f"{checkpoint} (Hugging Face export: {Path(checkpoint) / 'hf'})"
        )
        print(
            f"metrics: {self.path if jsonl else 'not kept (no jsonl logger)'}\nplot: {png}\ncheckpoint: {saved}",
            flush=True,
        )
        return png

    def rewind(self, step: int) -> None:
        """A resumed run restarts after checkpoint ``step``: the rows of ``metrics.jsonl`` past it
        (steps the killed run logged after its last checkpoint, which this run logs again) go."""
        if self._jsonl is None:
            return
        self._jsonl.close()
        lines = self.path.read_text(encoding="utf-8").splitlines()
        kept = [line for line in lines if line.strip() and int(json.loads(line)["step"]) <= step]
        temporary = self.path.with_suffix(".jsonl.tmp")
        temporary.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        temporary.replace(self.path)  # a crash here leaves the old file or the new one, whole
        self._jsonl = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())

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
        if self._mlflow is not None:
            self._mlflow.close()
            self._mlflow = None


def _mlflow_key(key: str) -> str:
    """A metric or parameter name MLflow accepts (letters, digits, ``_ - . / space``; others -> ``_``)."""
    return re.sub(r"[^\w\-./ ]", "_", key)


def flat_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config as ``{"dotted.key": text}`` (lists and mappings as JSON, others ``str``)."""
    out = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flat_config(value, f"{name}."))
        else:
            out[name] = json.dumps(value) if isinstance(value, (list, dict)) else str(value)
    return out


class MlflowRun:
    """One MLflow run of a :class:`Tracker`: when ``resume``, the run recorded in
    ``directory/mlflow_run_id`` if it is still in the store; else a new run in ``experiment`` with
    ``config`` as its parameters."""

    def __init__(self, directory: Path, experiment: str, config: Mapping[str, Any] | None, resume: bool = True):
        from mlflow.entities import Metric, Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self._metric = Metric
        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(directory / 'mlflow.db').resolve()}"
        self.client = MlflowClient(tracking_uri=uri)
        id_file = directory / "mlflow_run_id"
        if resume and id_file.exists():
            self.run_id = id_file.read_text().strip()
            try:
                self.client.update_run(self.run_id, status="RUNNING")
                return
            except MlflowException:  # the store was moved or deleted: start a new run
                pass
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = (
            found.experiment_id
            if found is not None
            else self.client.create_experiment(
                experiment, artifact_location=(directory / "mlartifacts").resolve().as_uri()
            )
        )
        self.run_id = self.client.create_run(experiment_id, run_name=directory.name).info.run_id
        params = [Param(_mlflow_key(k), v[:MLFLOW_PARAM_CHARS]) for k, v in flat_config(dict(config or {})).items()]
        for i in range(0, len(params), MLFLOW_BATCH):
            self.client.log_batch(self.run_id, params=params[i : i + MLFLOW_BATCH])
        id_file.write_text(self.run_id + "\n")

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        rows = [self._metric(_mlflow_key(k), v, now, step) for k, v in metrics.items()]
        for i in range(0, len(rows), MLFLOW_METRICS):
            self.client.log_batch(self.run_id, metrics=rows[i : i + MLFLOW_METRICS])

    def close(self) -> None:
        self.client.set_terminated(self.run_id, "FINISHED")


def metrics_by_step(jsonl: str | Path | Sequence[Mapping[str, float]]) -> dict[int, dict]:
    """The rows of a ``metrics.jsonl`` (or the rows themselves) merged per step: step -> {key:
    value}, where a key logged again for a step keeps its last value."""
    if isinstance(jsonl, (str, Path)):
        rows = [json.loads(line) for line in Path(jsonl).read_text().splitlines() if line.strip()]
    else:
        rows = list(jsonl)
    by_step: dict[int, dict] = {}
    for row in rows:
        by_step.setdefault(int(row["step"]), {}).update(row)
    return by_step


def plot_metrics(
    jsonl: str | Path | Sequence[Mapping[str, float]], out_png: str | Path, keys=("rollout/reward", "eval/success")
) -> Path:
    """Plot ``keys`` against step from a ``metrics.jsonl`` into a PNG (matplotlib, Agg backend; the
    last value logged for a step wins, so a resumed run's repeated steps plot once)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_step = metrics_by_step(jsonl)
    fig, ax = plt.subplots(figsize=(6, 4))
    for key in keys:
        pts = [(step, row[key]) for step, row in sorted(by_step.items()) if key in row]
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
    jsonl: str | Path | Sequence[Mapping[str, float]],
    keys=("rollout/reward", "rollout/response_length", "eval/success"),
    max_rows: int = 12,
) -> str:
    """A Markdown table of ``keys`` per step from a ``metrics.jsonl`` (the last value logged for a
    step wins, so a resumed run shows once). With more than ``max_rows`` steps, the steps with an
    evaluation are kept (and the first and last step), then others evenly spaced up to ``max_rows``."""
    by_step = metrics_by_step(jsonl)
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
