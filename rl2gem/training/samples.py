"""Training samples: one sequence with its loss mask and, for RL, what the PPO loss needs.

SFT and preference trainers fill ``ids`` and ``mask``; RL trainers get their samples from a
rollout batch (:func:`samples_from_batch`), with advantages from an outcome estimator or, with a
critic, from GAE over packed values (:func:`apply_gae`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from rl2gem.algorithms import compute_advantages, gae, kl_estimate

__all__ = ["Sample", "samples_from_batch", "apply_gae", "subtract_kl_from_rewards", "OUTCOME_ESTIMATORS"]

OUTCOME_ESTIMATORS = ("grpo", "drgrpo", "rloo")


@dataclasses.dataclass
class Sample:
    """One training sequence (python lists of length ``L``).

    Attributes:
        ids: token ids.
        mask: 1 on tokens the loss is taken on (action tokens; assistant tokens in SFT).
        rollout_logprobs: the rollout engine's log-prob of each action token (RL).
        advantages: per-token advantages (RL; None until computed).
        rewards: per-token rewards (RL).
        versions: policy version of each action token (RL).
        returns: per-token returns (GAE).
    """

    ids: list[int]
    mask: list[int]
    rollout_logprobs: list[float] | None = None
    advantages: list[float] | None = None
    rewards: list[float] | None = None
    versions: list[int] | None = None
    returns: list[float] | None = None

    def __len__(self) -> int:
        return len(self.ids)


def samples_from_batch(batch, estimator: str, gamma: float = 1.0, lam: float = 1.0) -> list[Sample]:
    """The samples of a rollout batch (:class:`rl2gem.rollout.RolloutBatch`, complete groups).

    With an outcome estimator (:data:`OUTCOME_ESTIMATORS`) every sequence of an episode is scored
    by the episode's return on its last action token; other estimators see the env's per-turn
    rewards. ``gae`` leaves ``advantages`` as None: they need the critic's values
    (:func:`apply_gae`).

    Raises:
        ValueError: unknown estimator (from :func:`rl2gem.algorithms.compute_advantages`).
    """
    sequences, rows, group_ids = [], [], []
    for g, episodes in enumerate(batch.groups):
        for episode in episodes:
            for s in episode.sequences:
                rewards = list(s.rewards)
                if estimator in OUTCOME_ESTIMATORS:
                    rewards = [0.0] * len(rewards)
                    last = max((i for i, m in enumerate(s.action_mask) if m), default=len(rewards) - 1)
                    rewards[last] = episode.reward
                sequences.append(s)
                rows.append(rewards)
                group_ids.append(g)
    if not sequences:
        return []
    samples = [
        Sample(s.input_ids, s.action_mask, s.logprobs, None, rows[i], s.versions) for i, s in enumerate(sequences)
    ]
    if estimator == "gae":
        return samples
    width = max(len(s) for s in sequences)
    rewards = torch.zeros(len(sequences), width)
    mask = torch.zeros(len(sequences), width, dtype=torch.bool)
    for i, (s, r) in enumerate(zip(sequences, rows, strict=True)):
        rewards[i, : len(r)] = torch.tensor(r)
        mask[i, : len(s)] = torch.tensor(s.action_mask, dtype=torch.bool)
    advantages, _ = compute_advantages(estimator, rewards, mask, torch.tensor(group_ids), gamma=gamma, lam=lam)
    for i, sample in enumerate(samples):
        sample.advantages = advantages[i, : len(sample)].tolist()
    return samples


def apply_gae(samples: Sequence[Sample], values: torch.Tensor, gamma: float, lam: float) -> torch.Tensor:
    """GAE (Schulman et al. 2016) for packed ``samples`` from their critic ``values`` ``[N]``
    (:func:`rl2gem.training.forward.token_values`): sets each sample's ``advantages`` and
    ``returns`` and returns the packed returns ``[N]`` float32 on ``values``' device."""
    returns, start = [], 0
    for s in samples:
        n = len(s)
        adv, ret = gae(
            torch.tensor([s.rewards]),
            torch.tensor([s.mask], dtype=torch.bool),
            values[None, start : start + n].detach().cpu(),
            gamma,
            lam,
        )
        s.advantages, s.returns = adv[0].tolist(), ret[0].tolist()
        returns.append(ret[0])
        start += n
    return torch.cat(returns).to(values.device)


def subtract_kl_from_rewards(
    samples: Sequence[Sample], logprobs: torch.Tensor, ref_logprobs: torch.Tensor, coef: float, estimator: str = "k3"
) -> None:
    """KL in the reward (InstructGPT, Ouyang et al. 2022): ``r_t -= coef * KL_t(pi || pi_ref)`` on
    each action token of packed ``samples``, with the per-token estimate ``estimator`` from the
    packed ``logprobs`` / ``ref_logprobs`` ``[N]``. Modifies ``sample.rewards`` in place."""
    kl = kl_estimate(logprobs, ref_logprobs, estimator).detach().cpu().tolist()
    start = 0
    for s in samples:
        n = len(s)
        s.rewards = [r - coef * k * m for r, k, m in zip(s.rewards, kl[start : start + n], s.mask, strict=True)]
        start += n
