"""The outer loop and the command line that every trainer shares.

A trainer subclasses :class:`Trainer` and writes its own step (``train_step``: for PPO collect ->
score -> advantages -> update -> weight sync) and evaluation; :meth:`Trainer.fit` runs the steps
with resume, evaluation at the start / every ``trainer.eval_every`` steps / at the end,
checkpoints every ``trainer.save_every`` steps and at the end, logging (a step's metrics are
written before its checkpoint, so a run killed at any point and resumed has every step's row),
and the end-of-run report.
Peak memory per phase (:class:`~rl2gem.training.metrics.PeakMemory`: ``memory/eval_peak_mib`` and
the phases a ``train_step`` marks with ``self.memory.phase(name)``) is logged with each step.
:func:`launch` is the ``main`` of a torchrun entry point.
"""

from __future__ import annotations

import fcntl
import functools
import itertools
import os
import socket
import sys
import time
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
from omegaconf import OmegaConf
from tqdm.auto import tqdm

import rl2gem  # noqa: F401 (registers the rl2/ envs and loads plugins, for the env check)
from rl2gem.config import ConfigError, command_line_config, config_error_exit_code
from rl2gem.data import DataUnavailable, missing_data_files
from rl2gem.models import causal_lm_problem, model_problem
from rl2gem.parallel.fsdp import stop_with_the_launcher
from rl2gem.procs import exit_when_stdin_closes
from rl2gem.registry import env_config_problem, env_id_problem
from rl2gem.tracking import LOGGERS, Tracker, flat_config
from rl2gem.training.metrics import PeakMemory

__all__ = ["LOCK_FILE", "OutputDirInUse", "Trainer", "check_common_keys", "hold_output_dir", "launch"]


class Trainer:
    """Base of the trainers. Subclasses set ``cfg``, ``rank``, ``step``, ``total_steps``, ``actor``
    (a :class:`~rl2gem.training.Worker`), ``tokenizer``, ``checkpointer`` and ``tracker`` (rank 0, or
    None: :meth:`open_tracker`), and implement :meth:`train_step` and :meth:`evaluate`.

    Attributes:
        name: shown on the progress bar.
        report_keys: the metrics of the end-of-run table and plot.
    """

    name = "trainer"
    report_keys: tuple[str, ...] = ()
    max_length = None  # a subclass's MaxLength (rl2gem.training.autosize): logged each step

    def open_tracker(self, output_dir: Path) -> Tracker | None:
        """On rank 0: create ``output_dir``, write the merged ``config.yaml`` there (a resumed run's
        earlier ``config.yaml``, where it differs, is kept as ``config.<n>.yaml``) and open the
        tracker of ``trainer.loggers``; None on the other ranks."""
        if self.rank != 0:
            return None
        output_dir.mkdir(parents=True, exist_ok=True)
        path, text = output_dir / "config.yaml", OmegaConf.to_yaml(self.cfg)
        if self.cfg.trainer.resume and path.exists() and _settings(OmegaConf.load(path)) != _settings(self.cfg):
            path.rename(next(p for n in itertools.count(1) if not (p := output_dir / f"config.{n}.yaml").exists()))
        path.write_text(text)
        config = OmegaConf.to_container(self.cfg, resolve=True)
        return Tracker(self.cfg.trainer.loggers, output_dir, config, resume=bool(self.cfg.trainer.resume))

    @functools.cached_property
    def memory(self) -> PeakMemory:
        """Peak memory of the phases of a step on ``self.device``."""
        return PeakMemory(self.device)

    def _evaluate(self) -> dict[str, float]:
        with self.memory.phase("eval"):
            return self.evaluate()

    def train_step(self) -> dict[str, float]:
        """One optimizer step (or rollout step); increments ``self.step``; returns its metrics."""
        raise NotImplementedError

    def evaluate(self) -> dict[str, float]:
        """Evaluation metrics (``eval/*``); a collective."""
        raise NotImplementedError

    def rank_state(self) -> dict[str, Any]:
        """This rank's state for checkpoints besides the models and the torch RNG."""
        return {}

    def restore(self, trainer_state: dict[str, Any], rank_state: dict[str, Any]) -> None:
        """Called after a checkpoint was loaded (models, optimizers, schedulers and step are back)."""

    def save(self, finished: bool = False) -> Path:
        """Checkpoint the current step (with a Hugging Face export of the actor); ``finished``: the
        run's last checkpoint, after its final evaluation (a resume then has nothing to do)."""
        return self.checkpointer.save(
            self.step,
            trainer_state={"trainer": self.name, "config": _settings(self.cfg), "finished": finished},
            rank_state=self.rank_state(),
            export=lambda path: self.actor.export_hf(path, self.tokenizer),
        )

    def load(self) -> bool:
        """Resume from the newest checkpoint; False when there is none.

        Raises:
            ValueError: the checkpoint is another trainer's (or another world size's).
        """
        restored = self.checkpointer.load(expected={"trainer": self.name})
        if restored is None:
            return False
        self.step = int(restored[0]["step"])
        self.finished = bool(restored[0].get("finished")) and self.step >= self.total_steps
        self.restore(*restored)
        self._warn_changed_config(restored[0].get("config"))
        return True

    def _warn_changed_config(self, saved: dict[str, str] | None) -> None:
        """On rank 0, name the keys whose values differ from the checkpoint's run (a changed seed or
        batch size skips or repeats rows; a changed schedule is applied from here on)."""
        if saved is None or self.rank != 0:
            return
        now = _settings(self.cfg)
        saved = {key: value for key, value in saved.items() if key != "trainer.resume"}
        changed = [key for key in sorted(saved.keys() | now.keys()) if saved.get(key) != now.get(key)]
        if changed:
            shown = ", ".join(
                f"{key}: {saved.get(key, '(unset)')} -> {now.get(key, '(unset)')}" for key in changed[:12]
            )
            more = f" and {len(changed) - 12} more" if len(changed) > 12 else ""
            print(
                f"warning: resuming step {self.step} with a changed config: {shown}{more}", file=sys.stderr, flush=True
            )

    def log(self, metrics: dict[str, float]) -> None:
        if self.tracker is not None and metrics:
            self.tracker.log(metrics, self.step)

    def fit(self) -> dict[str, float]:
        """Run to ``total_steps`` (see the module doc); returns the last step's and the final
        evaluation's metrics."""
        t = self.cfg.trainer
        if t.resume and self.load():
            if self.tracker is not None:
                self.tracker.rewind(self.step)  # the steps after the checkpoint are logged again
            if self.rank == 0:
                print(f"resumed from step {self.step}", flush=True)
            if self.finished:  # its final evaluation and checkpoint were written
                if self.rank == 0:
                    print(f"the run finished at step {self.step}: nothing left to do", flush=True)
                return {}
        if t.eval_at_start and self.step == 0 < self.total_steps:  # with no step the final one is it
            self.log({**self._evaluate(), **self.memory.metrics()})
        last: dict[str, float] = {}
        bar = tqdm(
            total=self.total_steps, initial=self.step, desc=self.name, disable=not (t.progress and self.rank == 0)
        )
        while self.step < self.total_steps:
            last = self.train_step()
            if self.max_length is not None:  # the length the step ran at, after any out-of-memory back-off
                last["actor/max_length_per_device"] = float(self.max_length.value)
            if t.eval_every and self.step % t.eval_every == 0 and self.step < self.total_steps:
                last.update(self._evaluate())
            last.update(self.memory.metrics())
            self.log(last)  # before the checkpoint: a run killed after it resumes past this step
            if t.save_every and self.step % t.save_every == 0:
                self.save()
            bar.update(1)
        bar.close()
        final = self._evaluate()
        final.update(self.memory.metrics())
        self.log(final)
        # no step trained (trainer.total_steps=0: an evaluation of the start): no copy of the start
        checkpoint = self.save(finished=True) if self.step > 0 else None
        if self.tracker is not None:
            self.tracker.report(final, checkpoint, keys=self.report_keys)
        return {**last, **final}

    def close(self) -> None:
        """Release engines and event loops."""


def _settings(cfg) -> dict[str, str]:
    """A run's config as ``{"dotted.key": text}`` without ``trainer.resume`` (a relaunch that
    resumes changes only that)."""
    flat = flat_config(OmegaConf.to_container(cfg, resolve=True))
    flat.pop("trainer.resume", None)
    return flat


def check_common_keys(cfg, causal_actor: bool = True) -> None:
    """Checks every trainer's config gets before anything loads: the env ids (``env``,
    ``trainer.eval_env``; ``module:id`` imports ``module``) are registered, each model key names a
    built-in model, a folder or a hub id (the actor's and reference's not a classifier, unless
    ``causal_actor`` is False: the reward-model trainer starts from any backbone), every data file named in ``env_kwargs``,
    ``eval_env_kwargs`` and ``data`` exists, each env builds with its arguments (the training env
    with ``env_kwargs``, the evaluation env with its own merged in), counts are in range,
    ``trainer.loggers`` names loggers, and ``trainer.output_dir`` holds no run unless
    ``trainer.resume``.

    Raises:
        rl2gem.config.ConfigError: naming the key.
    """
    for key in ("env", "trainer.eval_env"):
        env = OmegaConf.select(cfg, key, default=None)
        if env and (problem := env_id_problem(env)):
            raise ConfigError(f"{key}: {problem}")
    for section in ("actor", "critic", "reference", "ref", "reward"):
        model = (cfg.get(section) or {}).get("model")
        if isinstance(model, str) and (problem := model_problem(model)):
            raise ConfigError(f"{section}.model: {problem}")
        causal = ("actor", "ref", "reference") if causal_actor else ("ref", "reference")
        if section in causal and isinstance(model, str) and (problem := causal_lm_problem(model)):
            raise ConfigError(f"{section}.model: {problem}")
    for section in ("env_kwargs", "eval_env_kwargs", "data", "trainer.eval_env_kwargs"):
        for key, path in missing_data_files(OmegaConf.select(cfg, section, default=None), section):
            raise ConfigError(f"{key}: no such data file {path!r}")
    for key, env, kwargs, split in _env_builds(cfg):
        if problem := env_config_problem(env, kwargs, split=split):
            raise ConfigError(f"{key}: {problem}")
    minimums = {
        ("rollout", "responses_per_prompt"): 1,
        ("trainer", "total_steps"): 0,
        ("trainer", "keep_checkpoints"): 0,
        ("trainer", "save_every"): 0,
        ("trainer", "eval_every"): 0,
    }
    for (section, key), low in minimums.items():
        value = (cfg.get(section) or {}).get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise ConfigError(f"{section}.{key}: expected an int >= {low}, got {value!r}")
        if isinstance(value, int) and value < low:
            raise ConfigError(f"{section}.{key}: must be >= {low}, got {value}")
    trainer = cfg.get("trainer") or {}
    loggers = trainer.get("loggers")
    if loggers is not None and (isinstance(loggers, str) or any(name not in LOGGERS for name in loggers)):
        raise ConfigError(f"trainer.loggers: expected a list of {list(LOGGERS)}, e.g. [stdout,jsonl], got {loggers}")
    latest = Path(str(trainer.get("output_dir") or ".")) / "latest"
    if not trainer.get("resume") and latest.exists():  # a new run would mix its metrics and checkpoints in
        raise ConfigError(
            f"trainer.output_dir: {latest.parent} holds a run (latest: {latest.read_text().strip()}); "
            "continue it with trainer.resume=true, or start this one in another trainer.output_dir"
        )


def _env_builds(cfg) -> list[tuple[str, str, dict, str | None]]:
    """``(key, env id, kwargs, split)`` of each env a run makes: the training env, the online
    trainers' evaluation env (``eval_env_kwargs`` over ``env_kwargs``), the offline trainers'."""

    def select(key: str) -> Any:
        value = OmegaConf.select(cfg, key, default=None)
        return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value

    builds = []
    split = select("trainer.eval_split")
    if env := select("env"):
        builds.append(("env_kwargs", env, select("env_kwargs") or {}, None))
        if select("eval_env_kwargs"):
            builds.append(("eval_env_kwargs", env, {**builds[0][2], **select("eval_env_kwargs")}, split))
    if eval_env := select("trainer.eval_env"):
        builds.append(("trainer.eval_env_kwargs", eval_env, select("trainer.eval_env_kwargs") or {}, split))
    return builds


def launch(
    trainer_cls: Callable[[Any], Trainer],
    config: str | Path,
    check: Callable[[Any], None],
    argv: list[str] | None = None,
) -> int:
    """The ``main`` of a trainer script: ``config`` defaults with ``config=<recipe>`` and ``key=value``
    overrides from ``argv`` (default ``sys.argv[1:]``), ``check`` for combinations that cannot work,
    then the trainer's :meth:`Trainer.fit`. Returns the exit code: 2 (with the message on stderr)
    for a config error (0 on the ranks other than 0, :func:`rl2gem.config.config_error_exit_code`),
    for a data file that does not fit the trainer (on every rank; ranks other than 0 name themselves)
    and for a ``trainer.output_dir`` another run holds."""

    def check_all(cfg) -> None:
        check_common_keys(cfg, causal_actor=getattr(trainer_cls, "head", "lm") == "lm")
        check(cfg)

    cfg = command_line_config(config, check_all, argv)
    if cfg is None:
        return config_error_exit_code()
    stop_with_the_launcher()
    exit_when_stdin_closes()  # a tuner's trial: ends with the tuner
    rank = int(os.environ.get("RANK", "0"))
    try:
        lock = hold_output_dir(Path(cfg.trainer.output_dir)) if rank == 0 else None
    except OutputDirInUse as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        try:
            trainer = trainer_cls(cfg)
        except DataUnavailable as error:  # rows that do not fit (an offline trainer reads them before any model)
            # on every rank that failed (one rank's missing file must stop the job, not leave the
            # others waiting in a collective): exit 2, rank 0 plainly, the others by name
            print(f"{f'rank {rank}: ' if rank else ''}data error: {error}", file=sys.stderr)
            return 2
        try:
            trainer.fit()
        finally:
            trainer.close()
    finally:
        if lock is not None:
            lock.close()  # the kernel drops the lock with the file (and with a killed process)
    # only after a fit that returned: a failed rank may have a collective queued that the others
    # never join, and NCCL's shutdown waits for it (pytorch#141510): a hang until the group's
    # timeout. Raising instead ends the process, and torchrun stops the other ranks.
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


class OutputDirInUse(RuntimeError):
    """Another run holds the lock of a ``trainer.output_dir`` (:func:`hold_output_dir`)."""


#: The file in ``trainer.output_dir`` whose lock a run holds while it writes the folder.
LOCK_FILE = ".lock"


def hold_output_dir(output_dir: Path, wait_seconds: float = 10.0):
    """Lock ``output_dir`` for this run (created if missing): an exclusive ``flock`` on
    ``output_dir/.lock``, which holds this process's pid. The lock lasts while the returned file is
    open; the kernel drops it when the process ends, however it ends.

    Two runs writing one folder interleave checkpoints and metrics (a resumed run started while
    the run it resumes still wrote). A lock still held after ``wait_seconds`` (a killed run's
    ranks take up to a second to stop: :func:`rl2gem.parallel.fsdp.stop_with_the_launcher`) is an error.

    A file system without ``flock`` (Lustre mounted ``noflock``, some NFS and FUSE mounts) gets a
    warning and no lock.

    Raises:
        OutputDirInUse: naming the folder and the process (``pid@host``) that holds it.
    """
    output_dir.mkdir(parents=True, exist_ok=True)
    handle = open(output_dir / LOCK_FILE, "a+")  # noqa: SIM115 (held for the run)
    deadline = time.monotonic() + wait_seconds
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                handle.seek(0)
                holder = handle.read().strip() or "unknown"
                handle.close()
                raise OutputDirInUse(
                    f"trainer.output_dir={output_dir} is being written by another run (pid {holder}); "
                    "stop it, or give this run another trainer.output_dir"
                ) from None
            time.sleep(0.2)
        except OSError as error:  # no flock on this file system
            warnings.warn(f"{output_dir}: runs writing this folder are not locked out ({error})", stacklevel=2)
            return handle
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}@{socket.gethostname()}\n")
    handle.flush()
    _HELD.add(handle)
    return handle


#: The lock files this process holds (:func:`hold_output_dir`).
_HELD: weakref.WeakSet = weakref.WeakSet()


def _close_held_in_child() -> None:
    """In a child forked without exec: close its copies of the held locks, which would otherwise
    keep a folder locked after this run ended (a copy's close does not unlock the parent's)."""
    for handle in list(_HELD):
        handle.close()


os.register_at_fork(after_in_child=_close_held_in_child)
