"""Direct Preference Optimization (DPO, Rafailov et al. 2023) and IPO on preference pairs.

    torchrun --nproc_per_node=2 trainers/dpo.py data.train=pairs.jsonl dpo.beta=0.1
    torchrun --nproc_per_node=2 trainers/dpo.py config=arithmetic_dpo

Data: as ``trainers/rm.py`` (:func:`rl2gem.data.load_preferences`; ``python -m rl2gem.collect
pairs=true`` writes pairs from any env with a verifiable reward). The sequence log-prob of a
response is the sum of its assistant tokens' log-probs (the prompt's tokens do not count); chosen
and rejected of a pair are packed into the same micro-batch.

Reference log-probs come from the data when every row has ``ref_chosen_logps`` and
``ref_rejected_logps`` and ``ref.model`` is not set; otherwise a frozen reference worker
(``ref.model``, default ``actor.model``) computes them once per pair, the first time the pair is in a batch (the
reference never changes, so later epochs reuse them). Loss
(:func:`rl2gem.algorithms.dpo_loss`): ``dpo.loss_type=sigmoid`` (DPO, with
``dpo.label_smoothing`` for conservative DPO) or ``ipo``, averaged over ``data.batch_size``
pairs. Metrics under TRL's names: ``rewards/chosen``, ``rewards/rejected`` (the implicit rewards
``beta * (log pi - log pi_ref)``), ``rewards/accuracies``, ``rewards/margins``,
``logps/chosen``, ``logps/rejected``, and ``train/loss``; on ``data.test`` the same under
``eval/``; with ``trainer.eval_env`` the env evaluation of the SFT and PPO trainers.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from rl2gem.algorithms import DPO_LOSS_TYPES, dpo_loss
from rl2gem.config import ConfigError
from rl2gem.data import load_preferences
from rl2gem.devices import to_device
from rl2gem.parallel.packing import plan_pair_micro_batches
from rl2gem.procs import run_main
from rl2gem.training.forward import (
    check_actor,
    check_attention,
    check_packing,
    sequence_sums,
    token_logprobs,
)
from rl2gem.training.metrics import Averager
from rl2gem.training.offline import PAIRS_HELP, OfflineTrainer, check_data_config
from rl2gem.training.pairs import PairSample, pair_sequences, tokenize_pairs
from rl2gem.training.trainer import launch
from rl2gem.training.worker import Worker

CONFIG = Path(__file__).with_name("config") / "dpo.yaml"


def check_config(cfg) -> None:
    """Raises :class:`rl2gem.config.ConfigError` for values that cannot work."""
    check_data_config(cfg, PAIRS_HELP)
    check_packing(cfg.actor)
    check_attention(cfg.actor)
    check_actor(cfg.actor)
    d = cfg.dpo
    if d.loss_type not in DPO_LOSS_TYPES:
        raise ConfigError(f"dpo.loss_type={d.loss_type!r} is not one of {list(DPO_LOSS_TYPES)}")
    if d.beta <= 0:
        raise ConfigError(f"dpo.beta must be > 0, got {d.beta}")
    if not 0.0 <= d.label_smoothing < 0.5 or (d.loss_type == "ipo" and d.label_smoothing):
        raise ConfigError(f"dpo.label_smoothing must be in [0, 0.5) and 0 for ipo, got {d.label_smoothing}")


def response_logps(model, samples, device, tree: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence log-probs ``[S]`` (summed over each sample's mask) of packed ``samples`` and their
    response token counts ``[S]``; ``tree``: packed as a prefix tree (each pair's prompt once)."""
    logprobs, _ = token_logprobs(model, [s.ids for s in samples], device, tree=tree)
    counts = to_device(torch.tensor([float(sum(s.mask)) for s in samples]), logprobs.device)
    return sequence_sums(logprobs, [len(s) for s in samples], [s.mask for s in samples]), counts


class DPOTrainer(OfflineTrainer):
    """See the module docstring. ``cfg`` is the merged OmegaConf config."""

    name, unit = "dpo", "pairs"
    report_keys = ("train/loss", "rewards/accuracies", "rewards/margins", "eval/rewards/accuracies", "eval/success")

    def __init__(self, cfg):
        super().__init__(cfg)
        self.tree = check_packing(cfg.actor)
        given = all(p.ref_chosen_logps is not None for p in self.train + self.test)
        needs_reference = cfg.ref.model is not None or not given  # a ref.model given is the reference
        if needs_reference:  # one source for every pair: the data's from another model are not mixed in
            for pair in self.train + self.test:
                pair.ref_chosen_logps = pair.ref_rejected_logps = None
        self.reference = (
            Worker(cfg.actor, self.mesh, self.device, model=cfg.ref.model or cfg.actor.model, trainable=False)
            if needs_reference
            else None
        )
        self.reference_tokens = 0
        if self.rank == 0:
            source = f"the frozen model {cfg.ref.model or cfg.actor.model}" if needs_reference else "the data"
            if cfg.ref.model is not None and given:
                source += " (ref.model; the rows' ref_chosen_logps and ref_rejected_logps are not used)"
            print(f"dpo: reference log-probs from {source}", flush=True)

    def load_items(self, source, split: str) -> list[PairSample]:
        return tokenize_pairs(self.renderer, load_preferences(source, split), self.cfg.data.max_length)

    @torch.no_grad()
    def fill_reference(self, part: Sequence[PairSample]) -> int:
        """Reference log-probs of the pairs of micro-batch ``part`` that have none. A collective:
        when any rank lacks some, every rank runs the reference on its own part (FSDP's
        collectives must match) and fills in what it lacked. Returns the tokens this rank ran."""
        need = torch.tensor([float(any(p.ref_chosen_logps is None for p in part))])
        dist.all_reduce(need, op=dist.ReduceOp.MAX)
        if not need.item():
            return 0
        logps, _ = response_logps(self.reference.model, pair_sequences(part), self.device, tree=self.tree)
        for pair, chosen, rejected in zip(part, logps[0::2].tolist(), logps[1::2].tolist(), strict=True):
            if pair.ref_chosen_logps is None:
                pair.ref_chosen_logps, pair.ref_rejected_logps = chosen, rejected
        return sum(len(p) for p in part)

    def batch_loss(self, pairs: Sequence[PairSample], train: bool) -> tuple[dict[str, float], int]:
        """DPO / IPO loss of ``pairs`` (mean over all of them) and TRL's metrics."""
        d, averager, tokens = self.cfg.dpo, Averager(), 0
        self.reference_tokens = 0
        for mb in plan_pair_micro_batches(
            [(pair.chosen.ids, pair.rejected.ids) for pair in pairs],
            self.mesh.dp_rank,
            self.mesh.dp_size,
            self.max_length.micro_batch_tokens,
            tree=self.tree,
        ):
            part = [pairs[i] for i in mb.indices]
            if self.reference is not None:
                ran = self.fill_reference(part)
                self.reference_tokens += ran if not mb.placeholder else 0  # as the policy's tokens below
            with torch.set_grad_enabled(train):
                logps, counts = response_logps(self.actor.model, pair_sequences(part), self.device, tree=self.tree)
                reference = torch.tensor(
                    [[p.ref_chosen_logps, p.ref_rejected_logps] for p in part], device=logps.device
                ).reshape(-1)
                losses, chosen_rewards, rejected_rewards = dpo_loss(
                    logps[0::2],
                    logps[1::2],
                    reference[0::2],
                    reference[1::2],
                    beta=float(d.beta),
                    loss_type=d.loss_type,
                    label_smoothing=float(d.label_smoothing),
                    chosen_tokens=counts[0::2],
                    rejected_tokens=counts[1::2],
                )
                if train:  # mean over the step's pairs; FSDP averages gradients over data-parallel ranks
                    (losses.sum() * (mb.scale * self.mesh.dp_size / len(pairs))).backward()
            values = {
                "train/loss": losses.mean(),
                "rewards/chosen": chosen_rewards.mean(),
                "rewards/rejected": rejected_rewards.mean(),
                "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
                "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
                "logps/chosen": logps[0::2].detach().mean(),
                "logps/rejected": logps[1::2].detach().mean(),
            }
            averager.add(values, weight=len(part) * mb.scale)  # tensors: summed on the device
            tokens += sum(len(p) for p in part) if not mb.placeholder else 0
        return averager.means(), tokens

    def forward_tokens(self, items, tokens: int) -> int:
        return self.reference_tokens


def main(argv: list[str] | None = None) -> int:
    return launch(DPOTrainer, CONFIG, check_config, argv)


if __name__ == "__main__":
    run_main(main)
