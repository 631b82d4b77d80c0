"""The base of trainers that step over a fixed data set: SFT, reward models, DPO.

:class:`OfflineTrainer` does what they share: the process group and mesh, the tokenizer and chat
renderer, the train / test items (``data.train`` / ``data.test``, tokenised by the subclass), one
trained worker (``actor:``) with its checkpointer, the tracker, a fresh permutation of the items
per epoch (:func:`epoch_batch`), the optimizer step with its throughput and MFU metrics, the
held-out evaluation, and, for causal LMs, the env evaluation of ``trainer.eval_env`` (the same as
``python -m rl2gem.evaluate``). A subclass tokenises its rows (:meth:`~OfflineTrainer.load_items`)
and computes a batch's loss (:meth:`~OfflineTrainer.batch_loss`).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer

from rl2gem.config import ConfigError
from rl2gem.data import FILE_FORMATS
from rl2gem.models import resolve_model
from rl2gem.rollout import EmbeddedEngine, RolloutConfig
from rl2gem.rollout.tito import ChatRenderer, load_chat_template
from rl2gem.training.autosize import MaxLength
from rl2gem.training.checkpoint import Checkpointer
from rl2gem.training.evaluation import evaluate_env
from rl2gem.training.metrics import peak_flops_from_config, reduce_mean, throughput_metrics, train_flops
from rl2gem.training.trainer import Trainer
from rl2gem.training.worker import Worker, setup_distributed

__all__ = ["OfflineTrainer", "check_data_config", "epoch_batch", "PAIRS_HELP"]

#: What ``data.train`` holds for the preference trainers (their config errors say it).
PAIRS_HELP = (
    "preference pairs {prompt|messages, chosen, rejected} in a JSON/JSONL/CSV/Parquet/Arrow file or a dataset "
    "name (python -m rl2gem.collect pairs=true writes them)"
)


#: suffixes of files that are not a Hugging Face dataset name either (a missing one is a mistake)
OTHER_FILE_SUFFIXES = (".txt", ".tsv", ".xlsx", ".xls", ".gz", ".zip", ".yaml", ".yml", ".ndjson", ".md")
#: the splits a ``{split: file}`` mapping of ``data.train`` / ``data.test`` may name
DATA_SPLITS = ("train", "test", "validation")


def check_data_config(cfg, what: str) -> None:
    """The ``data`` section of an offline trainer: ``data.train`` is given (``what`` says what it
    holds), ``data.train`` and ``data.test`` are each a file, a dataset name or a ``{split: file}``
    mapping of :data:`DATA_SPLITS` (``data.train``'s with ``train``), a local path (one with a
    folder or an extension) exists and has a known format, ``data.batch_size >= 1`` and
    ``data.max_length >= 2``.

    Raises:
        ConfigError: naming the key.
    """
    if not cfg.data.train:
        raise ConfigError(f"data.train is required: {what}")
    for key in ("train", "test"):
        _check_data_source(f"data.{key}", OmegaConf.to_container(cfg.data, resolve=True).get(key), key)
    if cfg.data.batch_size < 1 or cfg.data.max_length < 2:
        raise ConfigError("data.batch_size must be >= 1 and data.max_length >= 2")


def _check_data_source(key: str, source: Any, split: str) -> None:
    if source is None:
        return
    if isinstance(source, Mapping):
        blank = [name for name, path in source.items() if not isinstance(path, str) or not path]
        if blank:
            raise ConfigError(
                f"{key}: no file for {blank} in {source} (write a space after each colon: "
                "{train: a.jsonl, test: b.jsonl})"
            )
        unknown = sorted(set(source) - set(DATA_SPLITS))
        if unknown or (split == "train" and "train" not in source):
            raise ConfigError(
                f"{key}: the splits of a {{split: file}} mapping are {list(DATA_SPLITS)}, with train; got {list(source)}"
            )
        for name, path in source.items():
            _check_data_source(f"{key}.{name}", path, name)
        return
    if not isinstance(source, str):
        raise ConfigError(f"{key}: expected a file, a dataset name or {{split: file}}, got {source!r}")
    path = Path(source).expanduser()
    suffix = path.suffix.lower()
    if path.is_file() and suffix not in FILE_FORMATS:
        raise ConfigError(f"{key}: {source!r} is not a file format rl2gem reads ({', '.join(sorted(FILE_FORMATS))})")
    # a Hugging Face name is "name" or "org/name": a missing path that cannot be one is a mistake
    a_path = suffix in FILE_FORMATS or suffix in OTHER_FILE_SUFFIXES or source.startswith((".", "/", "~"))
    if not path.exists() and (a_path or source.count("/") > 1):
        raise ConfigError(f"{key}: no such data file {source!r}")


def held_out(data) -> tuple[Any, str]:
    """``(source, split)`` of the held-out items: ``data.test``, else the ``test`` (or
    ``validation``) file of a ``{split: file}`` ``data.train``; ``(None, "test")`` without."""
    test, train = data.test, data.train
    if isinstance(test, Mapping) and test:
        return test, next((name for name in ("test", "validation") if name in test), "test")
    if test:
        return test, "test"
    if isinstance(train, Mapping):
        split = next((name for name in ("test", "validation") if name in train), None)
        if split is not None:
            return train, split
    return None, "test"


def epoch_batch(count: int, batch_size: int, seed: int, step: int) -> list[int]:
    """Indices of the items of optimizer step ``step`` (0-based) over ``count`` items: a fresh
    permutation per epoch drawn from ``seed`` and the epoch, cut into batches of ``batch_size``
    (the last of an epoch may be shorter), so a resumed run sees the same batches.

    Raises:
        ValueError: ``count`` or ``batch_size`` below 1.
    """
    if count < 1 or batch_size < 1:
        raise ValueError(f"count and batch_size must be >= 1, got {count} and {batch_size}")
    steps_per_epoch = math.ceil(count / batch_size)
    epoch, offset = divmod(step, steps_per_epoch)
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
    return order[offset * batch_size : (offset + 1) * batch_size].tolist()


class OfflineTrainer(Trainer):
    """See the module docstring. ``cfg`` is the merged OmegaConf config with ``seed``, ``data``
    (``train``, ``test``, ``batch_size``, ``max_length``), ``actor``, ``rollout`` (the chat
    template; the generation keys for ``trainer.eval_env``) and ``trainer`` sections.

    Class attributes:
        head: the actor's head (:class:`~rl2gem.training.Worker`: ``lm``, ``value`` or ``reward``).
        unit: what one item is, for messages ("conversations", "pairs").
    """

    head = "lm"
    unit = "items"

    def __init__(self, cfg):
        self.cfg, c = cfg, cfg
        self.rank, self.world, self.device, self.mesh = setup_distributed(c.seed, c.actor)
        self.out = Path(c.trainer.output_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(resolve_model(c.actor.model))
        self.chat_template = load_chat_template(c.rollout.chat_template)
        self.renderer = ChatRenderer(self.tokenizer, self.chat_template)
        self.train = self.load_items(c.data.train, "train")
        test_source, test_split = held_out(c.data)
        self.test = self.load_items(test_source, test_split) if test_source else []
        if not self.train:
            raise ConfigError(f"data.train={c.data.train}: no usable {self.unit} (see the trainer's docstring)")
        self.steps_per_epoch = math.ceil(len(self.train) / c.data.batch_size)
        steps = c.trainer.total_steps  # null: the epochs' steps; 0 is no step, as in PPO
        self.total_steps = int(c.trainer.epochs * self.steps_per_epoch if steps is None else steps)
        self.actor = Worker(c.actor, self.mesh, self.device, head=self.head, total_steps=self.total_steps)
        # auto off CUDA: 4096, what SFT, DPO and RM ran at on the CPU before auto was their default
        self.max_length = MaxLength(
            c.actor, [self.actor], self.mesh, self.device, self.out, cpu_length=4096, resume=bool(c.trainer.resume)
        )
        self.checkpointer = Checkpointer(self.out, {"actor": self.actor}, c.trainer.keep_checkpoints)
        self.peak_flops = peak_flops_from_config(c.trainer.peak_flops, self.device, self.actor.dtype)
        self.step, self.engine, self.loop = 0, None, asyncio.new_event_loop()
        self.tracker = self.open_tracker(self.out)
        if self.rank == 0:
            print(
                f"{self.name}: {len(self.train)} train / {len(self.test)} test {self.unit}, "
                f"{self.steps_per_epoch} steps per epoch, {self.total_steps} steps",
                flush=True,
            )

    # ------------------------------------------------------------------ what a subclass writes
    def load_items(self, source, split: str) -> list:
        """The tokenised items of ``source`` (``data.train`` / ``data.test``); each has ``len()``
        (its tokens, the compute cost the micro-batch planner balances)."""
        raise NotImplementedError

    def batch_loss(self, items: Sequence[Any], train: bool) -> tuple[dict[str, float], int]:
        """Forward (and backward when ``train``) ``items`` on every rank (a collective).

        Returns:
            ``(metrics, tokens)``: the batch's metrics over all ranks under their training names
            (``train/loss``, ``rm/accuracy``, ...; evaluation renames them, see :meth:`evaluate`)
            and the tokens this rank ran forward and backward (for MFU).
        """
        raise NotImplementedError

    def forward_tokens(self, items: Sequence[Any], tokens: int) -> int:
        """Forward-only tokens of a training step on this rank besides ``tokens`` (e.g. a
        reference model's), for MFU."""
        return 0

    # ------------------------------------------------------------------ shared
    def batch(self, step: int) -> list:
        """The items of optimizer step ``step`` (:func:`epoch_batch`)."""
        return [self.train[i] for i in epoch_batch(len(self.train), self.cfg.data.batch_size, self.cfg.seed, step)]

    def train_step(self) -> dict[str, float]:
        start = time.perf_counter()
        items = self.batch(self.step)
        with self.memory.phase("update"):
            metrics, tokens = self.max_length.run(
                lambda: self.batch_loss(items, train=True), longest=max(len(item) for item in items)
            )
            grad_norm = self.actor.step()
        self.step += 1
        seconds = time.perf_counter() - start
        # ``tokens``: this rank's data-parallel share, which each of its sp_size * tp_size model-parallel
        # ranks counts whole while computing only its part
        flops = train_flops(
            self.actor.num_parameters, train_tokens=tokens, forward_tokens=self.forward_tokens(items, tokens)
        ) / (self.mesh.sp_size * self.mesh.tp_size)
        metrics.update(
            {
                "train/sequences": float(len(items)),
                "actor/grad_norm": grad_norm,
                "actor/lr": self.actor.stepped_lr,
                "train/epoch": self.step / self.steps_per_epoch,
                **throughput_metrics(flops, sum(len(item) for item in items), seconds, self.peak_flops),
            }
        )
        return reduce_mean(metrics, ["time/step", "perf/tokens_per_second", "perf/mfu"])

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """The batch metrics on ``data.test`` (renamed ``eval/<name>``, ``train/`` dropped:
        ``train/loss`` -> ``eval/loss``, ``rm/accuracy`` -> ``eval/rm/accuracy``) and, with
        ``trainer.eval_env`` (causal LMs), the env evaluation (``eval/*``)."""
        c, out = self.cfg, {}
        if self.test:
            metrics, _ = self.batch_loss(self.test, train=False)
            out.update({"eval/" + name.removeprefix("train/"): value for name, value in metrics.items()})
        if c.trainer.get("eval_env") and self.head == "lm":
            out.update(self.evaluate_env())
        return out

    def evaluate_env(self) -> dict[str, float]:
        """Greedy (``rollout.temperature``) episodes of ``trainer.eval_env`` on its ``eval_split``
        with the current weights in an embedded engine (:func:`rl2gem.training.evaluate_env`)."""
        c = self.cfg
        state = self.actor.full_state_dict()
        if self.engine is None:
            model = (
                AutoModelForCausalLM.from_pretrained(resolve_model(c.actor.model), dtype=self.actor.dtype)
                .to(self.device)
                .eval()
            )
            self.engine = EmbeddedEngine(model, self.tokenizer, seed=c.seed * 1000 + self.rank)
        self.loop.run_until_complete(self.engine.update_weights(state, version=self.step))
        config = RolloutConfig.from_mapping(
            c.rollout, known=("chat_template",), responses_per_prompt=1, seed=c.trainer.eval_seed, progress=False
        )
        return evaluate_env(
            self.engine,
            self.tokenizer,
            c.trainer.eval_env,
            OmegaConf.to_container(c.trainer.eval_env_kwargs),
            c.trainer.eval_n,
            config,
            loop=self.loop,
            chat_template=self.chat_template,
            seed=c.trainer.eval_seed,
            split=c.trainer.eval_split,
        )

    def close(self) -> None:
        if self.engine is not None:
            self.loop.run_until_complete(self.engine.close())
        self.loop.close()
