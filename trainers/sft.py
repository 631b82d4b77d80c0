"""Supervised fine-tuning (SFT) on conversations, with the loss on assistant tokens only.

    torchrun --nproc_per_node=2 trainers/sft.py data.train=episodes.jsonl actor.model=smollm2-135m-instruct
    torchrun --nproc_per_node=2 trainers/sft.py config=searchqa_sft

Data (:func:`rl2gem.data.load_conversations`, RL2's formats): rows ``{"prompt", "response"}`` or
``{"messages": [...]}`` from JSON, JSONL, CSV, Parquet or Arrow files, or a Hugging Face dataset
name. ``python -m rl2gem.collect`` writes such files from any env. Each conversation becomes one
sequence exactly as a rollout would tokenise it (:meth:`rl2gem.rollout.tito.ChatRenderer.conversation`:
the chat template's prompt, each assistant turn's tokens and its stop token with loss mask 1, env
replies as template deltas with mask 0), cut to ``data.max_length`` tokens.

One step takes ``data.batch_size`` conversations (a fresh permutation each epoch, from ``seed``),
plans them over data-parallel ranks and packs micro-batches (:mod:`rl2gem.training`), and
minimises the negative log-likelihood of the masked tokens weighted by ``actor.loss_agg`` over the
whole batch. Evaluation: the held-out loss on ``data.test`` and, with ``trainer.eval_env``, the
same env evaluation as the PPO trainer. Checkpoints resume after a kill at any point; each holds a
Hugging Face export (``checkpoint-<step>/hf``) that ``trainers/ppo.py actor.model=...`` starts from.
"""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer

from rl2gem.algorithms import LOSS_AGGREGATIONS, packed_loss_weights
from rl2gem.config import ConfigError
from rl2gem.data import load_conversations
from rl2gem.models import resolve_model
from rl2gem.rollout import EmbeddedEngine, RolloutConfig
from rl2gem.rollout.tito import ChatRenderer, load_chat_template
from rl2gem.tracking import Tracker
from rl2gem.training.checkpoint import Checkpointer
from rl2gem.training.evaluation import evaluate_env
from rl2gem.training.forward import plan_micro_batches, token_logprobs
from rl2gem.training.metrics import peak_flops_from_config, reduce_mean, train_flops
from rl2gem.training.samples import Sample
from rl2gem.training.trainer import Trainer, launch
from rl2gem.training.worker import Worker, setup_distributed

CONFIG = Path(__file__).with_name("config") / "sft.yaml"


def check_config(cfg) -> None:
    """Raises :class:`rl2gem.config.ConfigError` for values that cannot work."""
    if not cfg.data.train:
        raise ConfigError(
            "data.train is required: a JSON/JSONL/CSV/Parquet/Arrow file or a dataset name "
            "(python -m rl2gem.collect writes one from any env)"
        )
    if cfg.actor.loss_agg not in LOSS_AGGREGATIONS:
        raise ConfigError(f"actor.loss_agg={cfg.actor.loss_agg!r} is not one of {list(LOSS_AGGREGATIONS)}")
    if cfg.data.batch_size < 1 or cfg.data.max_length < 2:
        raise ConfigError("data.batch_size must be >= 1 and data.max_length >= 2")


def tokenize(renderer: ChatRenderer, conversations, max_length: int) -> list[Sample]:
    """One :class:`Sample` per conversation (ids and assistant-token mask), cut to ``max_length``;
    conversations left without an assistant token are dropped."""
    samples = []
    for messages in conversations:
        seq = renderer.conversation(messages)
        ids, mask = seq.input_ids[:max_length], seq.action_mask[:max_length]
        if any(mask):
            samples.append(Sample(ids, mask))
    return samples


class SFTTrainer(Trainer):
    """See the module docstring. ``cfg`` is the merged OmegaConf config."""

    name, report_keys = "sft", ("train/loss", "eval/loss", "eval/reward", "eval/em", "eval/searches")

    def __init__(self, cfg):
        check_config(cfg)
        self.cfg, c = cfg, cfg
        self.rank, self.world, self.device, self.mesh = setup_distributed(c.seed, c.actor)
        self.out = Path(c.trainer.output_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(resolve_model(c.actor.model))
        self.chat_template = load_chat_template(c.rollout.chat_template)
        renderer = ChatRenderer(self.tokenizer, self.chat_template)
        self.train = tokenize(renderer, load_conversations(c.data.train, "train"), c.data.max_length)
        self.test = (
            tokenize(renderer, load_conversations(c.data.test, "test"), c.data.max_length) if c.data.test else []
        )
        if not self.train:
            raise ConfigError(f"data.train={c.data.train}: no conversation with an assistant turn")
        self.steps_per_epoch = math.ceil(len(self.train) / c.data.batch_size)
        self.total_steps = int(c.trainer.total_steps or c.trainer.epochs * self.steps_per_epoch)
        self.actor = Worker(c.actor, self.mesh, self.device, total_steps=self.total_steps)
        self.checkpointer = Checkpointer(self.out, {"actor": self.actor})
        self.peak_flops = peak_flops_from_config(c.trainer.peak_flops, self.device, self.actor.dtype)
        self.step, self.engine, self.loop = 0, None, asyncio.new_event_loop()
        self.tracker = None
        if self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "config.yaml").write_text(OmegaConf.to_yaml(c))
            self.tracker = Tracker(c.trainer.loggers, self.out, OmegaConf.to_container(c, resolve=True))
            print(
                f"sft: {len(self.train)} train / {len(self.test)} test sequences, {self.steps_per_epoch} steps per epoch, "
                f"{self.total_steps} steps",
                flush=True,
            )

    def batch(self, step: int) -> list[Sample]:
        """The conversations of optimizer step ``step`` (0-based): a permutation of the training set
        per epoch, drawn from ``seed`` and the epoch, so a resumed run sees the same batches."""
        epoch, offset = divmod(step, self.steps_per_epoch)
        order = torch.randperm(
            len(self.train), generator=torch.Generator().manual_seed(self.cfg.seed * 100_003 + epoch)
        )
        size = self.cfg.data.batch_size
        return [self.train[i] for i in order[offset * size : (offset + 1) * size].tolist()]

    def nll(self, samples: list[Sample], train: bool) -> tuple[float, int]:
        """Forward (and backward when ``train``) the NLL of ``samples``' masked tokens, weighted by
        ``actor.loss_agg`` over all of them. Returns (the weighted loss over all ranks, this rank's
        tokens computed)."""
        a = self.cfg.actor
        totals = {"num_tokens": float(sum(sum(s.mask) for s in samples)), "num_sequences": float(len(samples))}
        total_loss, tokens = torch.zeros((), dtype=torch.float64), 0
        for mb in plan_micro_batches(
            [len(s) for s in samples], self.mesh.dp_rank, self.mesh.dp_size, a.max_length_per_device
        ):
            part = [samples[i] for i in mb.indices]
            with torch.set_grad_enabled(train):
                logprobs, _ = token_logprobs(self.actor.model, [s.ids for s in part], self.device)
                mask = torch.tensor([m for s in part for m in s.mask], dtype=torch.bool, device=self.device)
                weights = mb.scale * packed_loss_weights(
                    [s.mask for s in part], a.loss_agg, float(self.cfg.data.max_length), **totals
                ).to(self.device)
                loss = -(logprobs * weights * mask).sum()
                if train:
                    (loss * self.mesh.dp_size).backward()  # FSDP averages gradients over data-parallel ranks
            total_loss += float(loss.detach())
            tokens += sum(len(s) for s in part) if not mb.placeholder else 0
        dist.all_reduce(total_loss)
        return float(total_loss), tokens

    def train_step(self) -> dict[str, float]:
        start = time.perf_counter()
        samples = self.batch(self.step)
        loss, tokens = self.nll(samples, train=True)
        grad_norm = self.actor.step()
        self.step += 1
        seconds = time.perf_counter() - start
        metrics = {
            "train/loss": loss,
            "train/sequences": float(len(samples)),
            "actor/grad_norm": grad_norm,
            "actor/lr": self.actor.lr,
            "train/epoch": self.step / self.steps_per_epoch,
            "time/step": seconds,
            "perf/tokens_per_second": sum(len(s) for s in samples) / seconds,
            "perf/mfu": train_flops(self.actor.num_parameters, train_tokens=tokens) / seconds / self.peak_flops,
        }
        return reduce_mean(metrics, ["time/step", "perf/tokens_per_second", "perf/mfu"])

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out loss (``eval/loss``) and, with ``trainer.eval_env``, the env evaluation (``eval/*``)."""
        c, out = self.cfg, {}
        if self.test:
            out["eval/loss"] = self.nll(self.test, train=False)[0]
        if c.trainer.eval_env:
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
                c.rollout, responses_per_prompt=1, seed=c.trainer.eval_seed, progress=False
            )
            out.update(
                evaluate_env(
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
            )
        return out

    def close(self) -> None:
        if self.engine is not None:
            self.loop.run_until_complete(self.engine.close())
        self.loop.close()


def main(argv: list[str] | None = None) -> int:
    return launch(SFTTrainer, CONFIG, check_config, argv)


if __name__ == "__main__":
    raise SystemExit(main())
