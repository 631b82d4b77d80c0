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

from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from rl2gem.algorithms import LOSS_AGGREGATIONS, packed_loss_weights
from rl2gem.config import ConfigError
from rl2gem.data import load_conversations
from rl2gem.devices import to_device
from rl2gem.parallel.packing import plan_micro_batches
from rl2gem.procs import run_main
from rl2gem.rollout.tito import ChatRenderer
from rl2gem.training.forward import check_actor, check_attention, token_logprobs
from rl2gem.training.offline import OfflineTrainer, check_data_config
from rl2gem.training.samples import Sample, packed_field, warn_cut
from rl2gem.training.trainer import launch

CONFIG = Path(__file__).with_name("config") / "sft.yaml"


def check_config(cfg) -> None:
    """Raises :class:`rl2gem.config.ConfigError` for values that cannot work."""
    check_data_config(
        cfg, "a JSON/JSONL/CSV/Parquet/Arrow file or a dataset name (python -m rl2gem.collect writes one from any env)"
    )
    check_attention(cfg.actor)
    check_actor(cfg.actor)
    if cfg.actor.loss_agg not in LOSS_AGGREGATIONS:
        raise ConfigError(f"actor.loss_agg={cfg.actor.loss_agg!r} is not one of {list(LOSS_AGGREGATIONS)}")


def tokenize(renderer: ChatRenderer, conversations, max_length: int) -> list[Sample]:
    """One :class:`Sample` per conversation (ids and assistant-token mask), cut to ``max_length``;
    conversations left without an assistant token are dropped."""
    samples, cut = [], 0
    for messages in conversations:
        seq = renderer.conversation(messages)
        cut += len(seq.input_ids) > max_length
        ids, mask = seq.input_ids[:max_length], seq.action_mask[:max_length]
        if any(mask):
            samples.append(Sample(ids, mask))
    warn_cut("conversations", len(conversations), cut, len(conversations) - len(samples), max_length)
    return samples


class SFTTrainer(OfflineTrainer):
    """See the module docstring. ``cfg`` is the merged OmegaConf config."""

    name, unit = "sft", "conversations"
    report_keys = ("train/loss", "eval/loss", "eval/reward", "eval/em", "eval/searches")

    def load_items(self, source, split: str) -> list[Sample]:
        return tokenize(self.renderer, load_conversations(source, split), self.cfg.data.max_length)

    def batch_loss(self, samples: Sequence[Sample], train: bool) -> tuple[dict[str, float], int]:
        """The NLL of ``samples``' masked tokens, weighted by ``actor.loss_agg`` over all of them
        (``train/loss``, summed over ranks), and this rank's tokens."""
        a = self.cfg.actor
        totals = {"num_tokens": float(sum(sum(s.mask) for s in samples)), "num_sequences": float(len(samples))}
        total_loss, tokens = torch.zeros((), dtype=torch.float64, device=self.device), 0
        for mb in plan_micro_batches(
            [len(s) for s in samples],
            self.mesh.dp_rank,
            self.mesh.dp_size,
            self.max_length.micro_batch_tokens,
        ):
            part = [samples[i] for i in mb.indices]
            with torch.set_grad_enabled(train):
                logprobs, _ = token_logprobs(self.actor.model, [s.ids for s in part], self.device)
                mask = packed_field(part, "mask", self.device, torch.bool)
                weights = to_device(
                    mb.scale
                    * packed_loss_weights(
                        [s.mask for s in part], a.loss_agg, float(self.cfg.data.max_length), **totals
                    ),
                    self.device,
                )
                loss = -(logprobs * weights * mask).sum()
                if train:
                    (loss * self.mesh.dp_size).backward()  # FSDP averages gradients over data-parallel ranks
            total_loss += loss.detach().double()  # on the device: no wait per micro-batch
            tokens += sum(len(s) for s in part) if not mb.placeholder else 0
        total_loss = total_loss.cpu()
        dist.all_reduce(total_loss)  # the data-parallel shares, each held by sp_size * tp_size ranks
        return {"train/loss": float(total_loss) / (self.mesh.sp_size * self.mesh.tp_size)}, tokens


def main(argv: list[str] | None = None) -> int:
    return launch(SFTTrainer, CONFIG, check_config, argv)


if __name__ == "__main__":
    run_main(main)
