"""Training samples: one sequence with its loss mask and, for RL, what the PPO loss needs.

SFT and preference trainers fill ``ids`` and ``mask``; RL trainers get their samples from a
rollout batch (:func:`samples_from_batch`), with advantages from an outcome estimator or, with a
critic, from GAE or an off-policy estimator over packed values (:func:`apply_critic_estimator`).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Hashable, Mapping, Sequence

import torch

from rl2gem.algorithms import (
    CRITIC_ESTIMATORS,
    OFF_POLICY_ESTIMATORS,
    action_turns,
    compute_advantages,
    kl_estimate,
)
from rl2gem.devices import to_device
from rl2gem.rewards.objectives import FILTERED_REWARD, Overlong, apply_objectives
from rl2gem.rollout.rollout import reward_metrics

__all__ = [
    "OUTCOME_ESTIMATORS",
    "Sample",
    "apply_critic_estimator",
    "packed_field",
    "episode_samples",
    "episode_rows",
    "estimate_advantages",
    "gathered_samples",
    "samples_from_batch",
    "shape_rewards",
    "without_cut_off",
    "warn_cut",
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
        group: the rollout group of its episode (RL; any hashable, unique in the step).
        episode: its episode (RL; None: a sequence on its own).
        sequence: its place among its episode's sequences (a context split or segment starts the next).
        cut_off: its episode has an action cut off at its token limit (RL; DAPO's overlong
            filtering, :func:`without_cut_off`, leaves it out of the step).
        summary: its last action is a managed context's summary, not a turn (RL; per-turn
            credit counts it in the turn it leads to: :func:`turn_ids`).
    """

    ids: list[int]
    mask: list[int]
    rollout_logprobs: list[float] | None = None
    advantages: list[float] | None = None
    rewards: list[float] | None = None
    versions: list[int] | None = None
    returns: list[float] | None = None
    group: Hashable = None
    episode: Hashable = None
    sequence: int = 0
    cut_off: bool = False
    summary: bool = False

    def __len__(self) -> int:
        return len(self.ids)


def warn_cut(unit: str, total: int, cut: int, dropped: int, max_length: int) -> None:
    """Say, once, how many of ``total`` data rows were cut to ``data.max_length`` (their end not
    trained on) and how many dropped (nothing left to train on within it); silent when none."""
    if cut or dropped:
        warnings.warn(
            f"data.max_length={max_length}: {cut} of {total} {unit} cut to it (their end not trained on), "
            f"{dropped} dropped (no response token within it)",
            stacklevel=3,
        )


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
    overlong: Overlong | None = None,
) -> dict[str, float]:
    """Turn a rollout batch's env rewards into the rewards trained on, in place: a reward model's
    score (:meth:`rl2gem.training.RewardModel.apply`, ``mode`` replace or add), then the reward
    objectives and ``transform`` (:func:`rl2gem.rewards.objectives.apply_objectives`), then
    DAPO's soft overlong punishment (:meth:`rl2gem.rewards.objectives.Overlong.apply`).

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
    if overlong is not None and overlong.active:
        metrics.update(overlong.apply(batch.episodes))
    punished = overlong is not None and overlong.buffer > 0
    if reward_model is not None or combine is not None or transform is not None or punished:
        if "rollout/reward" in batch.metrics:  # absent when no group was kept
            metrics["rollout/env_reward"] = batch.metrics["rollout/reward"]
        metrics.update(reward_metrics(batch.groups))
    return metrics


def samples_from_batch(batch, estimator: str, gamma: float = 1.0, lam: float = 1.0) -> list[Sample]:
    """The samples of a rollout batch (:class:`rl2gem.rollout.RolloutBatch`, complete groups)
    with their advantages (:func:`episode_samples`, then :func:`estimate_advantages`)."""
    return estimate_advantages(episode_samples(batch, estimator), estimator, gamma, lam)


def episode_samples(batch, estimator: str) -> list[Sample]:
    """A rollout batch's sequences as samples, in order (groups, their episodes, their
    sequences), each with its group and episode (numbered in the batch) and its rewards: the
    env's per-turn rewards, or with an outcome estimator (:data:`OUTCOME_ESTIMATORS`) the
    episode's return once, on the last action token of its last sequence. Advantages are left to
    :func:`estimate_advantages` (after the ranks' samples are gathered, for statistics over the
    whole step)."""
    samples, episode_id = [], 0
    for g, episodes in enumerate(batch.groups):
        for episode in episodes:
            for k, s in enumerate(episode.sequences):
                rewards = list(s.rewards)
                if estimator in OUTCOME_ESTIMATORS:
                    rewards = [0.0] * len(rewards)
                    if k == len(episode.sequences) - 1:
                        last = max((i for i, m in enumerate(s.action_mask) if m), default=len(rewards) - 1)
                        rewards[last] = episode.reward
                sample = Sample(s.input_ids, s.action_mask, s.logprobs, None, rewards, s.versions)
                sample.group, sample.episode, sample.sequence = g, episode_id, k
                sample.cut_off = Overlong.cut_off(episode)
                sample.summary = getattr(s, "summary", False)  # (a partial rollout checkpointed before the field)
                samples.append(sample)
            episode_id += 1
    return samples


def estimate_advantages(
    samples: Sequence[Sample], estimator: str, gamma: float = 1.0, lam: float = 1.0
) -> list[Sample]:
    """Set the advantages of RL ``samples`` (:func:`episode_samples`'; every rank's, gathered)
    with a critic-free estimator; critic estimators (``gae``, ``vtrace``, ...) leave them None:
    they need the critic's values (:func:`apply_critic_estimator`).

    An episode's sequences (a context split or segment carries the episode's later turns) are one
    row of the estimator, their action tokens in order: an outcome estimator counts the episode
    once in its group's statistics and gives every sequence its advantage; returns-to-go
    (``reinforce_pp``, ``rebn``) and ``turn_rloo``'s turns run across them. Batch statistics
    (``reinforce_pp``'s and ``rebn``'s normalisation) are over every sample given.

    Returns:
        ``samples``, as a list.

    Raises:
        ValueError: unknown estimator (from :func:`rl2gem.algorithms.compute_advantages`).
    """
    samples = list(samples)
    if not samples or estimator in CRITIC_ESTIMATORS:
        return samples
    episodes = [[samples[i] for i in row] for row in episode_rows(samples)]
    groups: dict[Hashable, int] = {}
    group_ids = torch.tensor([groups.setdefault(row[0].group, len(groups)) for row in episodes])
    rewards = padded_rows([[r for s in row for r in s.rewards] for row in episodes])
    mask = padded_rows([[m for s in row for m in s.mask] for row in episodes]).bool()
    turns = {"turn_ids": turn_ids(episodes, mask.shape[1])} if estimator == "turn_rloo" else {}
    advantages, _ = compute_advantages(estimator, rewards, mask, group_ids, gamma=gamma, lam=lam, **turns)
    for e, row in enumerate(episodes):
        start = 0
        for sample in row:
            sample.advantages = advantages[e, start : start + len(sample)].tolist()
            start += len(sample)
    return samples


def turn_ids(episodes: Sequence[Sequence[Sample]], width: int) -> torch.Tensor:
    """The turn of each action token of each episode (its samples in order, one row each,
    ``width`` tokens): int64 ``[E, width]``, -1 off action tokens. Each run of action tokens is a
    turn, except a managed context's summary (:attr:`Sample.summary`), which joins the turn it
    leads to (the last one's when none follows): summarising neither takes a turn index, so that
    turn ``k`` is each episode's ``k``-th action, nor a discount step."""
    ids = torch.full((len(episodes), width), -1, dtype=torch.long)
    for e, row in enumerate(episodes):
        runs, start = [], 0  # (first token, end, is a summary) of each action run, in the row
        for sample in row:
            sample_runs = action_turns(torch.tensor([sample.mask]))[0]
            for k, (first, end) in enumerate(sample_runs):
                runs.append((start + first, start + end, sample.summary and k == len(sample_runs) - 1))
            start += len(sample)
        turn = 0
        for first, end, summary in runs:
            ids[e, first:end] = turn
            turn += not summary
        if runs and runs[-1][2] and turn > 0:  # a last summary, no turn after it: the last turn's
            ids[e, runs[-1][0] : runs[-1][1]] = turn - 1
    return ids


def episode_rows(samples: Sequence[Sample]) -> list[list[int]]:
    """The indices into ``samples`` of each episode's sequences, in the episode's order (by
    :attr:`Sample.sequence`), episodes in the order of their first sample; a sample without an
    episode is a row of its own."""
    rows: dict[Hashable, list[int]] = {}
    for index, sample in enumerate(samples):
        rows.setdefault(("sample", index) if sample.episode is None else sample.episode, []).append(index)
    return [sorted(row, key=lambda index: samples[index].sequence) for row in rows.values()]


def gathered_samples(
    parts: Sequence[Sequence[Sample]], estimator: str, gamma: float = 1.0, lam: float = 1.0
) -> list[Sample]:
    """Every rank's :func:`episode_samples` (``parts[rank]``, gathered) as one step: groups and
    episodes numbered per rank, advantages estimated over them all (:func:`estimate_advantages`;
    every rank computes the same)."""
    for rank, part in enumerate(parts):
        for sample in part:
            sample.group, sample.episode = (rank, sample.group), (rank, sample.episode)
    return estimate_advantages([sample for part in parts for sample in part], estimator, gamma, lam)


def without_cut_off(samples: Sequence[Sample]) -> tuple[list[Sample], float]:
    """DAPO's overlong filtering (:class:`rl2gem.rewards.objectives.Overlong`): the samples that
    are not :attr:`Sample.cut_off`, so that the losses (policy, KL, entropy, value), their token and
    sequence counts, and the forwards leave the others out. Call it once the critic-free advantages
    are estimated: a left-out episode's reward still counts in its group's baseline. An episode's
    samples share the flag, so an episode stays whole or goes.

    Returns:
        ``(the samples kept, in order; the share of ``samples`` left out)``, ``([], 0.0)`` for none.
    """
    kept = [sample for sample in samples if not sample.cut_off]
    return kept, (len(samples) - len(kept)) / max(len(samples), 1)


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
    for packed ``samples``; sets each sample's ``advantages`` and ``returns``. The sequences of
    an episode among ``samples`` (:func:`episode_rows`) are one row, in their order: the returns
    of its first run across the later ones (pass all of an episode's sequences in one call).

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
    # one batch [B, T] of episode rows (padding off the action mask: the estimators step over
    # action tokens only), one read of the device
    values, logprobs = values.detach().float().cpu().split(lengths), logprobs.detach().float().cpu().split(lengths)
    rows = episode_rows(samples)

    def joined(per_sample) -> torch.Tensor:
        return padded_rows([[x for index in row for x in per_sample(index)] for row in rows])

    rewards, mask = joined(lambda i: samples[i].rewards), joined(lambda i: samples[i].mask).bool()
    log_ratio = None
    if estimator in OFF_POLICY_ESTIMATORS:
        log_ratio = joined(lambda i: (logprobs[i] - torch.tensor(samples[i].rollout_logprobs)).tolist())
    advantages, returns = compute_advantages(
        estimator, rewards, mask, values=joined(lambda i: values[i].tolist()), gamma=gamma, lam=lam,
        log_ratio=log_ratio, **options,
    )  # fmt: skip
    for e, row in enumerate(rows):
        start = 0
        for index in row:
            end = start + lengths[index]
            samples[index].advantages = advantages[e, start:end].tolist()
            samples[index].returns = returns[e, start:end].tolist()
            start = end
    return torch.tensor([r for s in samples for r in s.returns], dtype=torch.float32).to(device)


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
