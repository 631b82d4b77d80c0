"""Reward model (RM) training on preference pairs with the Bradley-Terry loss.

    torchrun --nproc_per_node=2 trainers/rm.py data.train=pairs.jsonl data.test=test_pairs.jsonl
    torchrun --nproc_per_node=2 trainers/rm.py config=arithmetic_rm

Data (:func:`rl2gem.data.load_preferences`, RL2's format): rows ``{"prompt" | "messages",
"chosen", "rejected"}``; ``python -m rl2gem.collect pairs=true`` writes them from any env with a
verifiable reward. Each side is tokenised as a rollout would (the chat template's prompt, then
the response), cut to ``data.max_length`` tokens; the two sequences of a pair are packed into the
same micro-batch.

The model is ``actor.model``'s backbone with a bias-free scalar head (zero at start) read at each
sequence's last non-padding token, as transformers' sequence classifiers pool
(:func:`rl2gem.training.forward.sequence_scores`). One step minimises the Bradley-Terry loss
``-log sigmoid(r_chosen - r_rejected)`` (:func:`rl2gem.algorithms.bradley_terry_loss`) averaged
over ``data.batch_size`` pairs. Metrics: ``rm/loss``, ``rm/accuracy`` (share of pairs with
``r_chosen > r_rejected``), ``rm/margin`` (mean ``r_chosen - r_rejected``), ``rm/chosen`` and
``rm/rejected`` (mean scores), and the same on ``data.test`` as ``eval/rm/*``.

Each checkpoint's ``hf/`` folder loads with ``AutoModelForSequenceClassification`` and gives the
training scores; :class:`rl2gem.training.RewardModel` scores episodes with it (PPO's
``reward.model``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from rl2gem.algorithms import bradley_terry_loss
from rl2gem.data import load_preferences
from rl2gem.parallel.packing import plan_pair_micro_batches
from rl2gem.procs import run_main
from rl2gem.training.forward import check_actor, check_attention, sequence_scores
from rl2gem.training.metrics import Averager
from rl2gem.training.offline import PAIRS_HELP, OfflineTrainer, check_data_config
from rl2gem.training.pairs import PairSample, pair_sequences, tokenize_pairs
from rl2gem.training.trainer import launch

CONFIG = Path(__file__).with_name("config") / "rm.yaml"


def check_config(cfg) -> None:
    """Raises :class:`rl2gem.config.ConfigError` for values that cannot work."""
    check_data_config(cfg, PAIRS_HELP)
    check_attention(cfg.actor)
    check_actor(cfg.actor)


class RMTrainer(OfflineTrainer):
    """See the module docstring. ``cfg`` is the merged OmegaConf config."""

    name, unit, head = "rm", "pairs", "reward"
    report_keys = ("rm/loss", "rm/accuracy", "eval/rm/loss", "eval/rm/accuracy", "eval/rm/margin")

    def load_items(self, source, split: str) -> list[PairSample]:
        return tokenize_pairs(self.renderer, load_preferences(source, split), self.cfg.data.max_length)

    def batch_loss(self, pairs: Sequence[PairSample], train: bool) -> tuple[dict[str, float], int]:
        """Bradley-Terry loss of ``pairs`` (mean over all of them) and their metrics."""
        averager, tokens = Averager(), 0
        for mb in plan_pair_micro_batches(
            [(pair.chosen.ids, pair.rejected.ids) for pair in pairs],
            self.mesh.dp_rank,
            self.mesh.dp_size,
            self.max_length.micro_batch_tokens,
        ):
            part = [pairs[i] for i in mb.indices]
            with torch.set_grad_enabled(train):
                scores = sequence_scores(self.actor.model, [s.ids for s in pair_sequences(part)], self.device)
                chosen, rejected = scores[0::2], scores[1::2]
                losses = bradley_terry_loss(chosen, rejected)
                if train:  # mean over the step's pairs; FSDP averages gradients over data-parallel ranks
                    (losses.sum() * (mb.scale * self.mesh.dp_size / len(pairs))).backward()
            margins = (chosen - rejected).detach()
            values = {
                "loss": losses.mean(),
                "accuracy": (margins > 0).float().mean(),
                "margin": margins.mean(),
                "chosen": chosen.mean(),
                "rejected": rejected.mean(),
            }
            averager.add(values, weight=len(part) * mb.scale)  # tensors: summed on the device
            tokens += sum(len(p) for p in part) if not mb.placeholder else 0
        return averager.means("rm/"), tokens


def main(argv: list[str] | None = None) -> int:
    return launch(RMTrainer, CONFIG, check_config, argv)


if __name__ == "__main__":
    run_main(main)
