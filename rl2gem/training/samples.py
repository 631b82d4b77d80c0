"""Training samples: one sequence with its loss mask and, for RL, what the PPO loss needs.

SFT and preference trainers fill ``ids`` and ``mask``; RL trainers get their samples from a
rollout batch (:func:`samples_from_batch`), with advantages from an outcome estimator or, with a
critic, from GAE or an off-policy estimator over packed values (:func:`apply_critic_estimator`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import torch

from rl2gem.algorithms import (
    CRITIC_ESTIMATORS,
    OFF_POLICY_ESTIMATORS,
    action_turns,
    compute_advantages,
    kl_estimate,
    turn_rloo,
)
from rl2gem.devices import to_device
from rl2gem.rewards.objectives import FILTERED_REWARD, apply_objectives
from rl2gem.rollout.rollout import reward_metrics

__all__ = [
    "OUTCOME_ESTIMATORS",
    "Sample",
    "apply_critic_estimator",
    "packed_field",
    "samples_from_batch",
    "shape_rewards",
    "subtract_kl_from_rewards",
]

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
        returns: per-token returns, the critic's targets (critic estimators).
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


def packed_field(samples: Sequence[Sample], field: str, device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The per-token lists ``field`` of ``samples`` concatenated: the packed row, shape
    ``(sum of lengths,)``, ``dtype`` on ``device`` (copied from pinned memory: a step's host data
    never waits for the device, :func:`rl2gem.training.forward.to_device`)."""
    return to_device(torch.tensor([x for s in samples for x in getattr(s, field)], dtype=dtype), torch.device(device))


def shape_rewards(
    batch,
    reward_model=None,
    mode: str = "replace",
    combine: str | None = None,
    weights: Mapping[str, float] | None = None,
    reference: Mapping[str, float] | None = None,
    transform: Callable[..., float] | None = None,
) -> dict[str, float]:
    """Turn a rollout batch's env rewards into the rewards trained on, in place: a reward model's
    score (:meth:`rl2gem.training.RewardModel.apply`, ``mode`` replace or add), then the reward
    objectives and ``transform`` (:func:`rl2gem.rewards.objectives.apply_objectives`).

    Returns:
        the metrics to add to ``batch.metrics``: the reward model's and the component means and,
        when anything changed the rewards, ``rollout/reward`` & co. recomputed
        (:func:`rl2gem.rollout.reward_metrics`) with the env's own mean kept as ``rollout/env_reward``.
    """
    metrics = {}
    if reward_model is not None:  # a value the filter kept predates the model's score: computed again
        for episode in batch.episodes:
            episode.info.pop(FILTERED_REWARD, None)
        metrics = reward_model.apply(batch, mode)
    metrics.update(apply_objectives(batch, combine, weights, reference, transform))
    if reward_model is not None or combine is not None or transform is not None:
        if "rollout/reward" in batch.metrics:  # absent when no group was kept
            metrics["rollout/env_reward"] = batch.metrics["rollout/reward"]
        metrics.update(reward_metrics(batch.groups))
    return metrics


def samples_from_batch(batch, estimator: str, gamma: float = 1.0, lam: float = 1.0) -> list[Sample]:
    """The samples of a rollout batch (:class:`rl2gem.rollout.RolloutBatch`, complete groups).

    With an outcome estimator (:data:`OUTCOME_ESTIMATORS`) every sequence of an episode is scored
    by the episode's return on its last action token; other estimators see the env's per-turn
    rewards; ``turn_rloo`` (:func:`rl2gem.algorithms.turn_rloo`) numbers an episode's turns
    across all its sequences (a context split or segment carries the episode's later turns), so
    each turn's return-to-go includes the rewards of the turns after it. Critic estimators (``gae``, ``vtrace``, ...) leave ``advantages`` as None: they need
    the critic's values (:func:`apply_critic_estimator`).

    Raises:
        ValueError: unknown estimator (from :func:`rl2gem.algorithms.compute_advantages`).
    """
    if estimator == "turn_rloo":
        return _turn_samples(batch, gamma)
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
    if estimator in CRITIC_ESTIMATORS:
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


def _turn_samples(batch, gamma: float) -> list[Sample]:
    """:func:`samples_from_batch` for ``turn_rloo``: the turns of each episode are its sequences'
    action runs in order, each turn's reward the sum of its tokens' rewards."""
    episodes, group_ids, turns = [], [], []
    for g, group in enumerate(batch.groups):
        for episode in group:
            episodes.append(episode)
            group_ids.append(g)
            turns.append(
                [
                    (k, start, end)
                    for k, s in enumerate(episode.sequences)
                    for start, end in action_turns(torch.tensor([s.action_mask], dtype=torch.bool))[0]
                ]
            )
    if not episodes:
        return []
    width = max(len(t) for t in turns) or 1
    turn_rewards, turn_mask = torch.zeros(len(episodes), width), torch.zeros(len(episodes), width, dtype=torch.bool)
    for e, (episode, runs) in enumerate(zip(episodes, turns, strict=True)):
        for k, (index, start, end) in enumerate(runs):
            turn_rewards[e, k] = sum(episode.sequences[index].rewards[start:end])
            turn_mask[e, k] = True
    per_turn = turn_rloo(turn_rewards, turn_mask, torch.tensor(group_ids), gamma).tolist()
    samples = []
    for e, (episode, runs) in enumerate(zip(episodes, turns, strict=True)):
        advantages = [[0.0] * len(s) for s in episode.sequences]
        for k, (index, start, end) in enumerate(runs):
            advantages[index][start:end] = [per_turn[e][k]] * (end - start)
        samples += [
            Sample(s.input_ids, s.action_mask, s.logprobs, advantages[k], list(s.rewards), s.versions)
            for k, s in enumerate(episode.sequences)
        ]
    return samples


def apply_critic_estimator(
    samples: Sequence[Sample],
    values: torch.Tensor,
    logprobs: torch.Tensor,
    estimator: str = "gae",
    gamma: float = 1.0,
    lam: float = 1.0,
    **options,
) -> torch.Tensor:
    """A critic estimator (:data:`rl2gem.algorithms.CRITIC_ESTIMATORS`: GAE, V-trace, Retrace, ...)
    for packed ``samples``; sets each sample's ``advantages`` and ``returns``.

    Args:
        values: float32 ``[N]``, the critic's values of the packed samples
            (:func:`rl2gem.training.forward.token_values`).
        logprobs: float32 ``[N]``, the trained policy's log-probs before the update; off-policy
            estimators weight each action token by ``exp(logprobs - rollout_logprobs)``, the
            ratio against the policy version that sampled it.
        options: the estimator's own keywords (``rho_bar``, ``c_bar``, ``clip_ratio``, ``n_steps``,
            ``bootstrap_method``).

    Returns:
        The packed returns (critic targets) ``[N]`` float32 on ``values``' device.

    Raises:
        ValueError: unknown estimator or option (from :func:`rl2gem.algorithms.compute_advantages`).
    """
    device = values.device
    lengths = [len(s) for s in samples]
    # one batch [B, T] (padding off the action mask: the estimators step over action tokens only),
    # one read of the device
    values, logprobs = values.detach().float().cpu(), logprobs.detach().float().cpu()
    rewards, mask = padded_rows([s.rewards for s in samples]), padded_rows([s.mask for s in samples]).bool()
    log_ratio = None
    if estimator in OFF_POLICY_ESTIMATORS:
        rollout = torch.tensor([lp for s in samples for lp in s.rollout_logprobs], dtype=torch.float32)
        log_ratio = padded_rows((logprobs - rollout).split(lengths))
    advantages, returns = compute_advantages(
        estimator, rewards, mask, values=padded_rows(values.split(lengths)), gamma=gamma, lam=lam,
        log_ratio=log_ratio, **options,
    )  # fmt: skip
    for i, s in enumerate(samples):
        s.advantages, s.returns = advantages[i, : lengths[i]].tolist(), returns[i, : lengths[i]].tolist()
    return torch.cat([returns[i, :n] for i, n in enumerate(lengths)]).to(device)


def padded_rows(rows) -> torch.Tensor:
    """Rows of numbers (lists or 1-d tensors) of different lengths -> ``[len(rows), longest]``
    float32 on the CPU, zero past each row's end."""
    out = torch.zeros(len(rows), max((len(row) for row in rows), default=0))
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.as_tensor(row, dtype=torch.float32)
    return out


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
