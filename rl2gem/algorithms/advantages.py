"""Advantage estimators over token-level batches.

Every estimator takes per-token tensors of one batch of sequences:

* ``rewards``: float32 ``[B, T]``, the reward of each turn on the last token
  of its action (what :class:`rl2gem.rollout.tito.Sequence` records), 0 elsewhere;
* ``action_mask``: ``[B, T]`` (bool or 0/1), 1 on tokens the policy generated;
* ``group``: int64 ``[B]``, sequences with the same id were sampled from the
  same initial state (a GRPO group);

and returns float32 advantages ``[B, T]``, zero outside the action mask.
Env tokens (prompt, env replies) never get an advantage; in multi-turn
sequences the estimators that look ahead (returns-to-go, GAE) step from one
action token to the next action token, skipping env tokens.

Raises ``ValueError`` on mismatched shapes.
"""

from __future__ import annotations

import torch

__all__ = ["ESTIMATORS", "compute_advantages", "gae", "grpo", "drgrpo", "rloo", "reinforce_pp", "rebn", "returns_to_go"]


def _check(rewards: torch.Tensor, action_mask: torch.Tensor, group: torch.Tensor | None = None):
    if rewards.dim() != 2 or rewards.shape != action_mask.shape:
        raise ValueError(
            f"rewards {tuple(rewards.shape)} and action_mask {tuple(action_mask.shape)} must both be [B, T]"
        )
    if group is not None and group.shape != (rewards.shape[0],):
        raise ValueError(f"group must be [B] = [{rewards.shape[0]}], got {tuple(group.shape)}")
    return rewards.float(), action_mask.bool()


def _group_stats(scores: torch.Tensor, group: torch.Tensor):
    """Per-sequence group mean, unbiased std and size of ``scores`` [B]."""
    _, inv, counts = torch.unique(group, return_inverse=True, return_counts=True)
    n = counts.to(scores.dtype)
    s = torch.zeros_like(n).index_add_(0, inv, scores)
    mean = s / n
    dev = torch.zeros_like(n).index_add_(0, inv, (scores - mean[inv]) ** 2)
    std = torch.sqrt(dev / (n - 1).clamp(min=1))
    return mean[inv], std[inv], n[inv]


def _broadcast(score: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return score[:, None] * mask.float()


def grpo(rewards, action_mask, group, eps: float = 1e-6):
    """GRPO (Shao et al. 2024, DeepSeekMath): ``(R - mean_group) / (std_group + eps)`` on every action token.

    ``R`` is the sequence's total reward; std is the unbiased group std.
    """
    r, m = _check(rewards, action_mask, group)
    score = r.sum(-1)
    mean, std, _ = _group_stats(score, group)
    return _broadcast((score - mean) / (std + eps), m)


def drgrpo(rewards, action_mask, group):
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): ``R - mean_group``, no std division
    (pair it with a constant loss normaliser, ``loss_agg="seq_mean_token_sum_norm"``)."""
    r, m = _check(rewards, action_mask, group)
    score = r.sum(-1)
    mean, _, _ = _group_stats(score, group)
    return _broadcast(score - mean, m)


def rloo(rewards, action_mask, group):
    """RLOO (Ahmadian et al. 2024): ``R_i - mean_{j != i} R_j`` = ``n / (n - 1) * (R_i - mean_group)``.

    A group of one gets advantage 0.
    """
    r, m = _check(rewards, action_mask, group)
    score = r.sum(-1)
    mean, _, n = _group_stats(score, group)
    adv = torch.where(n > 1, n / (n - 1).clamp(min=1) * (score - mean), torch.zeros_like(score))
    return _broadcast(adv, m)


def returns_to_go(rewards, action_mask, gamma: float = 1.0):
    """Discounted sum of future rewards at each action token, discounting once per action *token*
    step over action tokens only (env tokens are skipped). ``[B, T]``."""
    r, m = _check(rewards, action_mask)
    out = torch.zeros_like(r)
    running = torch.zeros(r.shape[0], dtype=r.dtype)
    for t in range(r.shape[1] - 1, -1, -1):
        mt = m[:, t]
        running = torch.where(mt, r[:, t] + gamma * running, running)
        out[:, t] = torch.where(mt, running, torch.zeros_like(running))
    return out


def _batch_normalize(x: torch.Tensor, m: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    vals = x[m]
    if vals.numel() < 2:
        return torch.zeros_like(x)
    return torch.where(m, (x - vals.mean()) / (vals.std() + eps), torch.zeros_like(x))


def reinforce_pp(rewards, action_mask, group=None, gamma: float = 1.0, baseline: bool = True):
    """REINFORCE++ (Hu 2025): token returns-to-go, normalised over all action tokens of the batch.

    With ``baseline`` (REINFORCE++-baseline) the group mean of the sequence reward is subtracted
    from the rewards first (needs ``group``). A per-token KL penalty, when the KL is put in the
    reward, should already be in ``rewards``.
    """
    r, m = _check(rewards, action_mask, group)
    if baseline and group is not None:
        score = r.sum(-1)
        mean, _, _ = _group_stats(score, group)
        last = _last_action_token(m)
        r = r.clone()
        rows = torch.arange(r.shape[0])
        has = last >= 0
        r[rows[has], last[has]] -= mean[has]
    return _batch_normalize(returns_to_go(r, m, gamma), m)


def rebn(rewards, action_mask, group=None, gamma: float = 1.0):
    """ReBN, return batch normalisation (GEM, Liu et al. 2025, "GEM: A Gym for Agentic LLMs"):
    per-turn discounted returns (one discount per *turn*, so multi-turn credit does not
    vanish over long actions), normalised over all action tokens of the batch."""
    r, m = _check(rewards, action_mask, group)
    out = torch.zeros_like(r)
    for b in range(r.shape[0]):
        running = 0.0
        ends = []
        t = r.shape[1] - 1
        row_m = m[b]
        while t >= 0:
            if row_m[t]:
                end = t
                while t >= 0 and row_m[t]:
                    t -= 1
                ends.append((t + 1, end))
            else:
                t -= 1
        for start, end in ends:  # last turn first
            running = float(r[b, start : end + 1].sum()) + gamma * running
            out[b, start : end + 1] = running
    return _batch_normalize(out, m)


def _last_action_token(m: torch.Tensor) -> torch.Tensor:
    idx = torch.arange(m.shape[1]).expand_as(m)
    return torch.where(m, idx, torch.full_like(idx, -1)).max(-1).values


def gae(rewards, action_mask, values, gamma: float = 1.0, lam: float = 1.0):
    """Generalised Advantage Estimation (Schulman et al. 2016) over action tokens.

    ``values``: float32 ``[B, T]`` critic values. The TD step goes from one action token to the
    next action token of the same sequence (env tokens are skipped, so multi-turn episodes are one
    MDP); after the last action token the next value is 0.

    Returns:
        ``(advantages, returns)``, both ``[B, T]``; ``returns = advantages + values`` on action tokens.
    """
    r, m = _check(rewards, action_mask)
    if values.shape != r.shape:
        raise ValueError(f"values {tuple(values.shape)} must match rewards {tuple(r.shape)}")
    v = values.float()
    adv = torch.zeros_like(r)
    next_v = torch.zeros(r.shape[0], dtype=r.dtype)
    next_a = torch.zeros(r.shape[0], dtype=r.dtype)
    for t in range(r.shape[1] - 1, -1, -1):
        mt = m[:, t]
        delta = r[:, t] + gamma * next_v - v[:, t]
        a = delta + gamma * lam * next_a
        adv[:, t] = torch.where(mt, a, torch.zeros_like(a))
        next_v = torch.where(mt, v[:, t], next_v)
        next_a = torch.where(mt, a, next_a)
    returns = torch.where(m, adv + v, torch.zeros_like(v))
    return adv, returns


ESTIMATORS = ("gae", "grpo", "drgrpo", "rloo", "reinforce_pp", "rebn")


def compute_advantages(
    estimator: str, rewards, action_mask, group=None, values=None, gamma: float = 1.0, lam: float = 1.0
):
    """Dispatch by name (one of :data:`ESTIMATORS`). Returns ``(advantages, returns or None)``.

    Raises:
        ValueError: unknown estimator, or ``gae`` without ``values``, or a group estimator without ``group``.
    """
    if estimator not in ESTIMATORS:
        import difflib

        hint = difflib.get_close_matches(estimator, ESTIMATORS, n=1)
        raise ValueError(
            f"unknown advantage estimator {estimator!r}"
            + (f"; did you mean {hint[0]!r}?" if hint else f"; choose from {ESTIMATORS}")
        )
    if estimator == "gae":
        if values is None:
            raise ValueError("gae needs critic values")
        return gae(rewards, action_mask, values, gamma, lam)
    if estimator in ("grpo", "drgrpo", "rloo") and group is None:
        raise ValueError(f"{estimator} needs group ids")
    fn = {"grpo": grpo, "drgrpo": drgrpo, "rloo": rloo}.get(estimator)
    if fn is not None:
        return fn(rewards, action_mask, group), None
    if estimator == "reinforce_pp":
        return reinforce_pp(rewards, action_mask, group, gamma), None
    return rebn(rewards, action_mask, group, gamma), None
