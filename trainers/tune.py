"""Hyperparameter search with optuna over any trainer config key; every trial is a real trainer run.

    python -m rl2gem.trainers.tune config=tune_arithmetic               # a study file in trainers/config/
    python -m rl2gem.trainers.tune trainer=ppo 'base=[config=arithmetic]' \\
        'space={actor.lr: {type: float, low: 1e-6, high: 1e-4, log: true}}' n_trials=8

Defaults: ``trainers/config/tune.yaml``. Each trial samples a value for every key of ``space``
(``float``/``int`` with ``low``, ``high``, optional ``log`` and ``step``; ``categorical`` with
``choices``; a ``grid`` list for the grid sampler), runs ``torchrun trainers/<trainer>.py`` with
``base`` + the sampled ``key=value`` arguments + ``trainer.output_dir=<output_dir>/trial-<n>`` as a
subprocess (``enqueue`` lists settings tried first, e.g. the defaults as a baseline), and follows
that run's ``metrics.jsonl``: each logged ``metric`` value is reported to optuna at its step, so the
median pruner can stop a trial that is behind the earlier trials at the same step (the run's
processes are killed; the trial counts as pruned). The trial's value is the last logged ``metric``
(the final evaluation). Samplers: TPE (Bergstra et al. 2011; the default), random, grid. The study
lives in SQLite (``storage``): run the same command again after a crash and it continues, re-running
the trials the crash interrupted with the same values.

Each trial's checkpoints are deleted when it ends unless ``keep_checkpoints`` (``best.yaml`` is the
recipe to train the best setting again). Written to ``output_dir``: ``results.md`` (one row per trial: number, state, value, seconds,
parameters), ``best.yaml`` (the best trial's full config with ``trainer.output_dir`` set to
``<output_dir>/best``: a recipe, ``trainers/<trainer>.py config=<output_dir>/best.yaml``), and
optuna's optimisation-history and parameter-importance plots as PNG.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from unittest import mock

import optuna
import psutil
from omegaconf import OmegaConf

from rl2gem.config import ConfigError, command_line_config, load_config
from rl2gem.parallel.fsdp import ranks_per_node
from rl2gem.procs import EXIT_ON_STDIN_EOF, run_main
from rl2gem.training.trainer import check_common_keys

CONFIG = Path(__file__).with_name("config") / "tune.yaml"
TRAINERS = ("ppo", "sft", "rm", "dpo")
SAMPLERS = ("tpe", "random", "grid")
HEARTBEAT_SECONDS = 2
#: Failed trials in a row after which the study stops (exit code 1): a bad ``base``, a metric no
#: run logs or a trainer that always crashes would fail every trial, and failures do not count
#: towards ``n_trials``.
FAILURES_IN_A_ROW = 3


#: The fields of each parameter type of ``space``.
SPEC_FIELDS = {
    "float": {"type", "low", "high", "log", "step", "grid"},
    "int": {"type", "low", "high", "log", "step", "grid"},
    "categorical": {"type", "choices"},
}


def distributions(space) -> dict[str, optuna.distributions.BaseDistribution]:
    """optuna distributions of a ``space`` mapping (config key -> spec).

    Raises:
        rl2gem.config.ConfigError: an unknown type or a spec missing its fields, naming the key.
    """
    out = {}
    for key, spec in dict(space).items():
        spec = dict(spec)
        kind = spec.get("type")
        unknown = sorted(set(spec) - SPEC_FIELDS.get(kind, set(spec)))
        if unknown:  # a typo ("logg: true") searched on a linear scale without a word
            raise ConfigError(
                f"space.{key}: {unknown} are not fields of a {kind} parameter ({sorted(SPEC_FIELDS[kind])})"
            )
        if kind == "int" and not isinstance(spec.get("step", 1), int):
            raise ConfigError(f"space.{key}: an int parameter's step must be an integer, got {spec['step']!r}")
        if kind == "categorical" and not all(
            isinstance(c, (str, int, float, bool, type(None))) for c in spec.get("choices", [])
        ):
            raise ConfigError(
                f"space.{key}: categorical choices must be numbers, strings, booleans or null (optuna's), "
                f"got {OmegaConf.to_container(spec['choices']) if OmegaConf.is_config(spec['choices']) else spec['choices']}"
            )
        try:
            if kind == "float":
                out[key] = optuna.distributions.FloatDistribution(
                    float(spec["low"]), float(spec["high"]), log=bool(spec.get("log", False)), step=spec.get("step")
                )
            elif kind == "int":
                out[key] = optuna.distributions.IntDistribution(
                    int(spec["low"]), int(spec["high"]), log=bool(spec.get("log", False)), step=int(spec.get("step", 1))
                )
            elif kind == "categorical":
                out[key] = optuna.distributions.CategoricalDistribution(list(spec["choices"]))
            else:
                raise ConfigError(f"space.{key}: type must be float, int or categorical, got {kind!r}")
        except KeyError as e:
            raise ConfigError(f"space.{key}: a {kind} parameter needs {e.args[0]!r}") from None
        except ConfigError:
            raise
        except ValueError as e:
            raise ConfigError(f"space.{key}: {e}") from None
    if not out:
        raise ConfigError("space is empty: give at least one config key to search")
    return out


def make_sampler(cfg, trials_before: int = 0) -> optuna.samplers.BaseSampler:
    """The ``sampler`` of ``cfg``, seeded with ``seed + trials_before`` (a resumed study must not
    replay the random draws of its first session).

    Raises:
        rl2gem.config.ConfigError: unknown sampler, or a grid parameter with no finite set of values.
    """
    if cfg.sampler == "tpe":
        return optuna.samplers.TPESampler(seed=cfg.seed + trials_before)
    if cfg.sampler == "random":
        return optuna.samplers.RandomSampler(seed=cfg.seed + trials_before)
    if cfg.sampler == "grid":
        grid = {}
        for key, spec in dict(cfg.space).items():
            values = spec.get("grid") or (spec.get("choices") if spec.get("type") == "categorical" else None)
            if not values:
                raise ConfigError(f"space.{key}: the grid sampler needs a grid: [values] (or a categorical parameter)")
            grid[key] = list(values)
        return optuna.samplers.GridSampler(grid, seed=cfg.seed + trials_before)
    raise ConfigError(f"sampler={cfg.sampler!r} is not one of {list(SAMPLERS)}")


def check_config(cfg) -> None:
    """Raises :class:`rl2gem.config.ConfigError` for values that cannot work, naming the key."""
    distributions(cfg.space)
    make_sampler(cfg)
    if cfg.direction not in ("maximize", "minimize"):
        raise ConfigError(f"direction={cfg.direction!r} must be maximize or minimize")
    if cfg.pruner not in ("median", "none"):
        raise ConfigError(f"pruner={cfg.pruner!r} must be median or none")
    if int(cfg.n_trials) < 1:
        raise ConfigError(f"n_trials={cfg.n_trials} must be >= 1")
    if str(cfg.nproc_per_node) != "0":
        try:
            ranks_per_node(cfg.nproc_per_node)
        except ValueError as error:
            raise ConfigError(f"nproc_per_node: {error} (or 0: plain python)") from None
    space = distributions(cfg.space)
    for i, params in enumerate(cfg.enqueue):
        unknown = set(params) - set(cfg.space)
        if unknown:
            raise ConfigError(f"enqueue[{i}]: {sorted(unknown)} not in space (keys: {sorted(cfg.space)})")
        for key, value in params.items():
            if not _contains(space[key], value):
                raise ConfigError(f"enqueue[{i}]: {key}={value!r} is outside space.{key} ({space[key]})")
    script(cfg)
    check_trials(cfg)


def _contains(dist: optuna.distributions.BaseDistribution, value) -> bool:
    """Whether ``value`` is one of ``dist``'s: a choice, or a number within its range (a value that
    is no number is left to the trainer's own check, which names the type it expects)."""
    if isinstance(dist, optuna.distributions.CategoricalDistribution):
        return value in dist.choices
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return True
    return dist.low <= value <= dist.high


def check_trials(cfg) -> None:
    """A built-in trainer's own check (:func:`rl2gem.training.trainer.launch`'s) on ``base`` with
    each ``enqueue`` entry and with each end of every ``space`` range, before the study opens: a
    typo'd key or a bad value fails here in one line, not in every trial.

    Raises:
        rl2gem.config.ConfigError: naming ``base``, ``enqueue[i]`` or ``space``, and the trainer's message.
    """
    if cfg.trainer not in TRAINERS:
        return  # a script of the user's: its own command line
    module = importlib.import_module(f"rl2gem.trainers.{cfg.trainer}")
    points = [("space", point) for point in corner_points(cfg.space)]
    points += [(f"enqueue[{i}]", dict(params)) for i, params in enumerate(cfg.enqueue)]
    # the checks that read torchrun's WORLD_SIZE see the trials' (batches and mesh sizes divide it)
    world = 1 if str(cfg.nproc_per_node) == "0" else ranks_per_node(cfg.nproc_per_node)
    for where, point in points:
        overrides = [f"{key}={format_value(value)}" for key, value in point.items()]
        argv = [*map(str, cfg.base), *overrides, f"trainer.output_dir={Path(cfg.output_dir) / 'trial-check'}"]
        try:
            with mock.patch.dict(os.environ, {"WORLD_SIZE": str(world)}):
                trial = load_config(module.CONFIG, argv)
                check_common_keys(trial)
                module.check_config(trial)
        except ConfigError as error:
            raise ConfigError(f"{where} {' '.join(overrides)} (with base): {error}") from None


def corner_points(space) -> list[dict]:
    """Every ``space`` key at its low end (first choice), then each at its high end (last choice)."""
    specs = {key: dict(spec) for key, spec in dict(space).items()}

    def end(spec, index):
        values = spec.get("grid") or spec.get("choices")
        return list(values)[index] if values else spec["high" if index else "low"]

    return [{key: end(spec, index) for key, spec in specs.items()} for index in (0, -1)]


def script(cfg) -> Path:
    """The trainer script a trial runs."""
    path = Path(__file__).with_name(f"{cfg.trainer}.py") if cfg.trainer in TRAINERS else Path(cfg.trainer)
    if not path.exists():
        raise ConfigError(f"trainer={cfg.trainer!r}: not one of {list(TRAINERS)} and no such script")
    return path


def trial_command(cfg, overrides: list[str]) -> list[str]:
    """The command line of one trial: torchrun (or plain python with ``nproc_per_node=0``)."""
    launcher = [sys.executable]
    if str(cfg.nproc_per_node) != "0":
        ranks = ranks_per_node(cfg.nproc_per_node)
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    return [*launcher, str(script(cfg)), *[str(a) for a in cfg.base], *overrides]


def suggest(trial: optuna.Trial, key: str, dist):
    """``trial``'s value for ``key`` from ``dist`` (one of :func:`distributions`)."""
    if isinstance(dist, optuna.distributions.FloatDistribution):
        return trial.suggest_float(key, dist.low, dist.high, log=dist.log, step=dist.step)
    if isinstance(dist, optuna.distributions.IntDistribution):
        return trial.suggest_int(key, dist.low, dist.high, log=dist.log, step=dist.step)
    return trial.suggest_categorical(key, dist.choices)


def grid_points(cfg) -> int | None:
    """The number of grid points with the grid sampler (None with the others)."""
    if cfg.sampler != "grid":
        return None
    count = 1
    for spec in dict(cfg.space).values():
        count *= len(spec.get("grid") or spec.get("choices"))
    return count


def format_value(value) -> str:
    """``value`` as a command-line override reads it back (None as null, booleans as true/false)."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    return json.dumps(value) if isinstance(value, str) and any(ch in value for ch in " ,[]{}:") else str(value)


def logged(path: Path, metric: str, seen: int) -> tuple[list[tuple[int, float]], int]:
    """New ``(step, value)`` rows of ``metric`` in a ``metrics.jsonl`` after its first ``seen`` lines."""
    if not path.exists():
        return [], seen
    lines = path.read_text().splitlines()
    complete = lines if path.read_text().endswith("\n") else lines[:-1]  # a line being written is read next time
    out = []
    for line in complete[seen:]:
        row = json.loads(line)
        if metric in row:
            out.append((int(row["step"]), float(row[metric])))
    return out, len(complete)


def stop(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """Stop a trial: torchrun and every process under it. torchrun starts its workers in sessions
    of their own, so killing its process group would leave them training; SIGTERM first (torchrun
    then stops its workers), and after ``grace`` seconds SIGKILL for whatever is left."""
    try:
        root = psutil.Process(proc.pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    for p in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.terminate()
    _, alive = psutil.wait_procs(tree, timeout=grace)
    alive += [c for c in _children_now(tree) if c not in alive]  # started while stopping
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _children_now(tree: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            out += p.children(recursive=True)
    return out


class Objective:
    """One trial: sample, run the trainer, report each logged metric value, prune or return the last."""

    def __init__(self, cfg, out: Path):
        self.cfg, self.out, self.space = cfg, out, distributions(cfg.space)

    def __call__(self, trial: optuna.Trial) -> float:
        params = {key: suggest(trial, key, dist) for key, dist in self.space.items()}
        run_dir = self.out / f"trial-{trial.number}"
        overrides = [f"{k}={format_value(v)}" for k, v in params.items()]
        overrides += [f"trainer.output_dir={run_dir}", "trainer.progress=false"]
        shutil.rmtree(run_dir, ignore_errors=True)  # a trial of this number in an earlier study: not this one's
        run_dir.mkdir(parents=True)
        start, seen, last = time.monotonic(), 0, None
        with open(run_dir / "trial.log", "w") as log:
            # its own session (a pruned trial stops whole), its stdin a pipe this process holds: the
            # trial ends when the tuner does, however (rl2gem.procs.exit_when_stdin_closes)
            proc = subprocess.Popen(
                trial_command(self.cfg, overrides), stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, env={**os.environ, EXIT_ON_STDIN_EOF: "1"},
            )  # fmt: skip
            try:
                while True:
                    exited = proc.poll() is not None
                    rows, seen = logged(run_dir / "metrics.jsonl", self.cfg.metric, seen)
                    for step, value in rows:
                        last = value
                        trial.report(value, step)
                        if not exited and trial.should_prune():  # a finished run is not pruned
                            stop(proc)
                            trial.set_user_attr("seconds", time.monotonic() - start)
                            raise optuna.TrialPruned(f"{self.cfg.metric}={value} at step {step}")
                    if exited:
                        break
                    if self.cfg.trial_timeout and time.monotonic() - start > float(self.cfg.trial_timeout):
                        stop(proc)
                        problem = f"trial {trial.number} ran past trial_timeout={self.cfg.trial_timeout} s"
                        trial.set_user_attr("error", problem)
                        raise RuntimeError(problem)
                    time.sleep(0.5)
            finally:
                if proc.poll() is None:
                    stop(proc)
                proc.stdin.close()
                if not self.cfg.keep_checkpoints:
                    for checkpoint in run_dir.glob("checkpoint-*"):
                        shutil.rmtree(checkpoint, ignore_errors=True)
                    (run_dir / "latest").unlink(missing_ok=True)  # it named a deleted checkpoint
        trial.set_user_attr("seconds", time.monotonic() - start)
        problem = None
        if proc.returncode != 0:
            problem = f"trial {trial.number} exited with {proc.returncode}; see {run_dir / 'trial.log'}"
        elif last is None:
            problem = f"trial {trial.number} logged no {self.cfg.metric!r}; see {run_dir / 'metrics.jsonl'}"
        if problem is not None:
            trial.set_user_attr("error", problem)
            raise RuntimeError(problem)
        return last


def open_study(cfg, out: Path) -> optuna.Study:
    """The study in ``storage`` (created or loaded). Each running trial beats a heartbeat; one a
    crash left running has a stale heartbeat, is marked failed when the study continues and is
    queued again with the same values (optuna's ``RetryHeartbeatStaleTrialCallback``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # heartbeats are "experimental"
        storage = optuna.storages.RDBStorage(
            cfg.storage or f"sqlite:///{(out / 'study.db').resolve()}",
            heartbeat_interval=HEARTBEAT_SECONDS,
            grace_period=2 * HEARTBEAT_SECONDS,
            heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=2),
        )
    pruner = (
        optuna.pruners.MedianPruner(
            n_startup_trials=int(cfg.pruner_startup_trials), n_warmup_steps=int(cfg.pruner_warmup_steps)
        )
        if cfg.pruner == "median"
        else optuna.pruners.NopPruner()
    )
    study = optuna.create_study(
        study_name=cfg.study_name,
        storage=storage,
        sampler=make_sampler(cfg),
        pruner=pruner,
        direction=cfg.direction,
        load_if_exists=True,
    )
    study.sampler = make_sampler(cfg, trials_before=len(study.trials))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)
    if not study.trials:  # a new study: the given points first (a resumed one already holds them)
        for params in cfg.enqueue:
            study.enqueue_trial(dict(params), skip_if_exists=True)
    return study


def finished(study: optuna.Study) -> int:
    states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    return len(study.get_trials(deepcopy=False, states=states))


def results_table(study: optuna.Study, metric: str) -> str:
    keys = sorted({k for t in study.trials for k in t.params})
    lines = [
        f"| trial | state | {metric} | seconds | " + " | ".join(keys) + " |",
        "|---:|---|---:|---:|" + "---|" * len(keys),
    ]
    for t in study.trials:
        value = f"{t.value:.4g}" if t.value is not None else ""
        if t.value is None and t.intermediate_values:
            step = max(t.intermediate_values)
            value = f"({t.intermediate_values[step]:.4g} at step {step})"
        seconds = t.user_attrs.get("seconds")
        cells = [format_value(t.params.get(k, "")) for k in keys]
        lines.append(
            f"| {t.number} | {t.state.name.lower()} | {value} | {'' if seconds is None else f'{seconds:.0f}'} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


def write_best(study: optuna.Study, out: Path) -> Path | None:
    """``best.yaml``: the best trial's merged config (its ``config.yaml``), writing to ``<out>/best``."""
    try:
        best = study.best_trial
    except ValueError:  # no complete trial
        return None
    config = OmegaConf.load(out / f"trial-{best.number}" / "config.yaml")
    OmegaConf.update(config, "trainer.output_dir", str(out / "best"), force_add=True)
    path = out / "best.yaml"
    path.write_text(
        f"# best of study {study.study_name!r}: trial {best.number}, value {best.value:.6g}\n"
        f"# parameters: {json.dumps(best.params)}\n" + OmegaConf.to_yaml(config)
    )
    return path


def write_plots(study: optuna.Study, out: Path) -> list[Path]:
    """optuna's optimisation history and (with 2+ complete trials and 2+ parameters' worth of
    variation) parameter importances, as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as plots

    written = []
    makers = {"history": plots.plot_optimization_history, "importances": plots.plot_param_importances}
    for name, make in makers.items():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # optuna marks its matplotlib plots experimental
                ax = make(study)
        except (ValueError, RuntimeError):  # too few complete trials for importances
            continue
        path = out / f"{name}.png"
        ax.figure.tight_layout()
        ax.figure.savefig(path, dpi=110)
        plt.close(ax.figure)
        written.append(path)
    return written


def claim_folder(out: Path, study_name: str) -> str | None:
    """Make ``out`` (created if missing) the folder of study ``study_name``, or say why not: it
    holds another study (its ``trial-<n>`` folders would be overwritten, and its ``best.yaml``
    would read this study's)."""
    out.mkdir(parents=True, exist_ok=True)
    marker = out / "study_name"
    if marker.exists() and (held := marker.read_text().strip()) != study_name:
        return f"output_dir={out} holds study {held!r}; give study {study_name!r} another output_dir"
    marker.write_text(f"{study_name}\n")
    return None


def main(argv: list[str] | None = None) -> int:
    cfg = command_line_config(CONFIG, check_config, argv)
    if cfg is None:
        return 2
    out = Path(cfg.output_dir)
    if problem := claim_folder(out, str(cfg.study_name)):
        print(f"config error: {problem}", file=sys.stderr)
        return 2
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = open_study(cfg, out)
    objective = Objective(cfg, out)
    start, failures = time.monotonic(), 0
    while finished(study) < int(cfg.n_trials):
        points = grid_points(cfg)
        if points is not None and finished(study) >= points:
            break  # every grid point tried
        done = {t.number for t in study.trials if t.state.is_finished()}
        study.optimize(objective, n_trials=1, catch=(RuntimeError,))
        # the trial that ran (the last in the study may be one queued by enqueue)
        t = next(t for t in reversed(study.trials) if t.state.is_finished() and t.number not in done)
        value = t.value if t.value is not None else t.intermediate_values.get(max(t.intermediate_values, default=0))
        print(f"trial {t.number}: {t.state.name.lower()} {cfg.metric}={value} {t.params}", flush=True)
        failures = failures + 1 if t.state == optuna.trial.TrialState.FAIL else 0
        if failures == FAILURES_IN_A_ROW:  # a failure that repeats would repeat without end
            print(
                f"stopped: {failures} trials in a row failed; the last: {t.user_attrs.get('error', '?')}",
                file=sys.stderr,
                flush=True,
            )
            return 1
    table = results_table(study, cfg.metric)
    (out / "results.md").write_text(table + "\n")
    print(table)
    best = write_best(study, out)
    plots = write_plots(study, out)
    print(f"\n{finished(study)} trials finished ({len(study.trials)} in the study) in {time.monotonic() - start:.0f} s")
    if best is not None:
        print(f"best: trial {study.best_trial.number}, {cfg.metric}={study.best_value:.6g}, {study.best_params}")
        print(f"recipe: {best}")
    for path in plots:
        print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    run_main(main)
