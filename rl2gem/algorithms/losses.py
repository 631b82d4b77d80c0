"""PPO-family losses over token-level batches.

Shapes: ``[B, T]`` float32 per-token tensors and an ``action_mask`` ``[B, T]``
(bool or 0/1); only action tokens enter a loss. Functions return a scalar
loss (float32, ``[]``) and a dict of float metrics.
"""

from __future__ import annotations

import torch

__all__ = [
    "LOSS_AGGREGATIONS",
    "KL_ESTIMATORS",
    "IS_MODES",
    "POLICY_LOSSES",
    "aggregate",
    "loss_weights",
    "packed_loss_weights",
    "kl_estimate",
    "importance_weights",
    "policy_loss",
    "value_loss",
    "entropy_from_logits",
]

LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm")
KL_ESTIMATORS = ("k1", "k2", "k3")
#: ``importance_weights``' modes: no correction, truncated (TIS) or masked (MIS) weights.
IS_MODES = ("none", "truncated", "masked")
#: ``policy_loss``'s surrogates: PPO's token ratio, GSPO's sequence ratio, CISPO's clipped weight.
POLICY_LOSSES = ("ppo", "gspo", "cispo")
#: |log-ratio| past which the PPO ratio and the k3 estimate stop following it (verl's 20)
LOG_RATIO_CLAMP = 20.0


def loss_weights(
    mask: torch.Tensor,
    mode: str = "token_mean",
    norm: float | None = None,
    *,
    num_tokens: float | None = None,
    num_sequences: float | None = None,
) -> torch.Tensor:
    """Per-token weights ``w`` ``[B, T]`` float32 with ``(loss * w).sum() == aggregate(loss, mask, mode, norm)``.

    The one implementation of every loss aggregation. A trainer that splits a global batch over
    ranks and micro-batches passes the *global* ``num_tokens`` (action tokens) and
    ``num_sequences``; the sum of its micro-batch losses then equals the aggregation over the whole
    batch. By default both come from ``mask`` itself (``aggregate``).

    * ``token_mean``: ``1 / num_tokens`` on every action token (DAPO);
    * ``seq_mean_token_sum``: ``1 / num_sequences``;
    * ``seq_mean_token_mean``: ``1 / (num_sequences * n_i)``, ``n_i`` the sequence's action tokens
      (the original GRPO);
    * ``seq_mean_token_sum_norm``: ``1 / (num_sequences * norm)``, ``norm`` a constant (default
      ``T``): Dr. GRPO (Liu et al. 2025), no length bias.

    Args:
        mask: action mask ``[B, T]`` (bool or 0/1); sequences without action tokens count in
            ``num_sequences`` (as zero in the sequence means).

    Raises:
        ValueError: unknown mode.
    """
    m = mask.float()
    tokens = float(num_tokens) if num_tokens is not None else float(m.sum())
    seqs = float(num_sequences) if num_sequences is not None else float(m.shape[0])
    if mode == "token_mean":
        per_seq = torch.full((m.shape[0],), 1.0 / max(tokens, 1.0), device=m.device)
    elif mode == "seq_mean_token_sum":
        per_seq = torch.full((m.shape[0],), 1.0 / max(seqs, 1.0), device=m.device)
    elif mode == "seq_mean_token_mean":
        per_seq = 1.0 / (max(seqs, 1.0) * m.sum(-1).clamp(min=1))
    elif mode == "seq_mean_token_sum_norm":
        per_seq = torch.full((m.shape[0],), 1.0 / (max(seqs, 1.0) * float(norm or m.shape[-1])), device=m.device)
    else:
        raise ValueError(f"unknown loss aggregation {mode!r}; choose from {LOSS_AGGREGATIONS}")
    return per_seq[:, None] * m


def packed_loss_weights(
    masks: list[list[int]],
    mode: str = "token_mean",
    norm: float | None = None,
    *,
    num_tokens: float,
    num_sequences: float,
) -> torch.Tensor:
    """:func:`loss_weights` for sequences packed into one row: ``[sum(len(m))]`` float32, the
    weights of each sequence (its action mask ``masks[i]``) one after another.

    Raises:
        ValueError: unknown mode, or ``seq_mean_token_sum_norm`` without ``norm``.
    """
    if mode == "seq_mean_token_sum_norm" and norm is None:
        raise ValueError("seq_mean_token_sum_norm needs norm (the constant token count, e.g. max_length)")
    if not masks:
        return torch.zeros(0)
    width = max(len(m) for m in masks)
    padded = torch.zeros(len(masks), width)
    for i, m in enumerate(masks):
        padded[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
    w = loss_weights(padded, mode, norm, num_tokens=num_tokens, num_sequences=num_sequences)
    return torch.cat([w[i, : len(m)] for i, m in enumerate(masks)])


def aggregate(
    loss: torch.Tensor, mask: torch.Tensor, mode: str = "token_mean", norm: float | None = None
) -> torch.Tensor:
    """Reduce a ``[B, T]`` per-token loss to a scalar (float32 ``[]``): ``(loss * w).sum()`` with
    ``w = loss_weights(mask, mode, norm)`` (see there for the modes and their sources).

    Raises:
        ValueError: unknown mode.
    """
    return (loss * loss_weights(mask, mode, norm).to(loss.device)).sum()


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman, "Approximating KL
    divergence", 2020): with ``d = logprobs - ref_logprobs``, ``k1 = d``, ``k2 = d**2 / 2``,
    ``k3 = exp(-d) - 1 + d`` (unbiased and non-negative). ``[B, T]``.

    Raises:
        ValueError: unknown estimator.
    """
    d = logprobs.float() - ref_logprobs.float()
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    if kind == "k3":  # exp(-d) - 1 without the cancellation at small d; d clamped as the ratio
        # is in policy_loss (a token the policy all but never samples: exp(-d) would be inf)
        d = d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return torch.expm1(-d) + d
    raise ValueError(f"unknown KL estimator {kind!r}; choose from {KL_ESTIMATORS}")


def importance_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "truncated",
    cap: float = 2.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Off-policy correction of tokens sampled by the rollout engine (another numeric stack, or an
    older policy version with partial rollouts) for the trainer's policy ``old_logprobs``.

    ``w = exp(old_logprobs - rollout_logprobs)``. ``truncated`` (TIS, Yao et al. 2025, "Your
    efficient RL framework secretly brings you off-policy RL training"): ``min(w, cap)``.
    ``masked`` (MIS): tokens with ``w`` outside ``[1 / cap, cap]`` leave the loss (weight 0),
    others keep ``w``. ``none``: all ones.

    Returns:
        ``(weights [B, T] float32, detached; new mask [B, T] bool)``.

    Raises:
        ValueError: unknown mode or ``cap <= 1``.
    """
    m = mask.bool()
    if mode == "none":
        return torch.ones_like(old_logprobs, dtype=torch.float32), m
    if cap <= 1:
        raise ValueError(f"importance sampling cap must be > 1, got {cap}")
    w = torch.exp((old_logprobs.float() - rollout_logprobs.float()).detach())
    if mode == "truncated":
        return torch.clamp(w, max=cap), m
    if mode == "masked":
        keep = m & (w <= cap) & (w >= 1.0 / cap)
        return torch.where(keep, w, torch.zeros_like(w)), keep
    raise ValueError(f"unknown importance sampling mode {mode!r}; choose from {IS_MODES}")


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    loss_agg: str = "token_mean",
    norm: float | None = None,
    is_weights: torch.Tensor | None = None,
    token_weights: torch.Tensor | None = None,
    kind: str = "ppo",
    sequence_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy-gradient surrogate of the PPO family, per action token, then aggregated.

    ``kind`` picks the surrogate (``ratio`` is ``pi / pi_old``, ``A`` the advantage):

    * ``ppo``: PPO's clipped surrogate (Schulman et al. 2017) ``max(-A * r, -A * clip(r, 1 -
      clip_low, 1 + clip_high))`` with the token's own ratio; asymmetric bounds are DAPO's
      clip-higher (Yu et al. 2025).
    * ``gspo``: GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): the same clipped
      surrogate with the *sequence's* ratio ``s = exp(mean of the log-ratios over its action
      tokens)`` in place of each token's, in its token form (each token's term has the value ``s``
      and the gradient ``s * grad log pi(token)``), which with a per-sequence advantage is GSPO and
      with per-token advantages GSPO-token. The paper's bounds are small (``clip_low=3e-4``,
      ``clip_high=4e-4``) and its mean is over sequences (``loss_agg="seq_mean_token_mean"``).
    * ``cispo``: CISPO (MiniMax-M1, 2025): ``-sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * log
      pi``: every token keeps a gradient, weighted by its clipped ratio (PPO's clip drops the
      gradient of a clipped token). Computed as ``-A * r * sg(clip(r) / r)``, which has that
      gradient and the value ``-A * clip(r)``, comparable with PPO's loss.

    Dual clip (Ye et al. 2020, ``ppo`` and ``gspo``): for negative advantages the loss is capped
    at ``-A * dual_clip``, ``dual_clip > 1``.

    Args:
        logprobs: current policy log-probs ``[B, T]`` (with grad).
        old_logprobs: log-probs when the batch was made ``[B, T]``.
        advantages: ``[B, T]``.
        mask: action mask ``[B, T]``.
        is_weights: optional off-policy weights from :func:`importance_weights`.
        token_weights: optional ``[B, T]`` per-token weights replacing ``loss_agg`` (a trainer that
            splits a batch into micro-batches passes weights normalised over the whole batch).
        kind: one of :data:`POLICY_LOSSES`.
        sequence_ids: ``gspo`` only: ``[B, T]`` integer ids (on the inputs' device) of the sequence
            each token belongs to (from 0, below ``B * T``), for rows that pack several sequences;
            default: each row is one.

    Returns:
        ``(loss, {"pg_loss", "clip_ratio", "dual_clip_ratio", "approx_kl"})``; the metrics are
        detached 0-d tensors on the loss's device (reading them is left to the caller: a read per
        micro-batch would wait for the device each time); ``approx_kl`` is the k3 estimate of
        KL(old || new) over action tokens; ``clip_ratio`` the share of action tokens whose ratio
        was clipped (``cispo``: whose weight was).

    Raises:
        ValueError: unknown ``kind``, ``dual_clip <= 1``, or ``dual_clip`` with ``cispo``.
    """
    if kind not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {kind!r}; choose from {POLICY_LOSSES}")
    if dual_clip is not None and (dual_clip <= 1 or kind == "cispo"):
        raise ValueError(f"dual_clip must be > 1 and is not a part of {kind}, got {dual_clip}")
    m = mask.bool()
    # clamped (as verl does): a token whose old log-prob is far below the current one would give
    # exp(100) = inf, and inf * 0 a NaN loss and gradient even when it is clipped or masked out
    log_ratio = (logprobs - old_logprobs.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if kind == "gspo":
        sequence_log_ratio = _sequence_mean(log_ratio.detach(), m, sequence_ids)
        log_ratio = (logprobs - logprobs.detach() + sequence_log_ratio).clamp(max=LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    adv = advantages.detach()
    bounded = torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    if kind == "cispo":
        pg = -adv * ratio * (bounded / ratio).detach()
        clipped = (bounded != ratio) & m
    else:
        pg1, pg2 = -adv * ratio, -adv * bounded
        pg = torch.maximum(pg1, pg2)
        clipped = (pg2 > pg1) & m
    dual = torch.zeros_like(m)
    if dual_clip is not None:
        cap = -adv * dual_clip
        dual = (adv < 0) & (pg > cap) & m
        pg = torch.where(adv < 0, torch.minimum(pg, cap), pg)
    if is_weights is not None:
        pg = pg * is_weights.detach()
    pg = torch.where(m, pg, torch.zeros_like(pg))  # off the action tokens nothing, not 0 * whatever
    if token_weights is not None:
        loss = (pg * token_weights * m).sum()
    else:
        loss = aggregate(pg, m, loss_agg, norm)
    n = m.sum().clamp(min=1)
    with torch.no_grad():
        metrics = {
            "pg_loss": loss.detach(),
            "clip_ratio": clipped.sum() / n,
            "dual_clip_ratio": dual.sum() / n,
            "approx_kl": (kl_estimate(old_logprobs, logprobs, "k3") * m).sum() / n,  # samples of old
        }
    return loss, metrics


def _sequence_mean(values: torch.Tensor, mask: torch.Tensor, sequence_ids: torch.Tensor | None) -> torch.Tensor:
    """Each token's sequence's mean of ``values`` over its masked tokens, ``[B, T]`` (0 for a
    sequence without any); a sequence is a row, or the tokens sharing a ``sequence_ids`` value."""
    if sequence_ids is None:
        sequence_ids = torch.arange(values.shape[0], device=values.device)[:, None].expand_as(values)
    ids = sequence_ids.reshape(-1).long()
    size = ids.numel()  # ids are below it (each sequence has a token): no read of the ids on the host
    weights = mask.reshape(-1).to(values.dtype)
    sums = torch.zeros(size, dtype=values.dtype, device=values.device).index_add_(0, ids, values.reshape(-1) * weights)
    counts = torch.zeros(size, dtype=values.dtype, device=values.device).index_add_(0, ids, weights)
    return (sums / counts.clamp(min=1))[ids].reshape(values.shape)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None = 0.2,
    loss_agg: str = "token_mean",
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss of PPO (Schulman et al. 2017; the clipping as in OpenAI baselines):
    ``0.5 * max((V - R)^2, (V_old + clip(V - V_old, -clip, +clip) - R)^2)`` per action token.

    Args:
        values / old_values / returns: float ``[B, T]``; ``returns`` from :func:`~rl2gem.algorithms.gae`.
        mask: ``[B, T]`` action mask.
        clip: value clip range (same units as the returns); None disables clipping.
        loss_agg: aggregation over tokens (:func:`aggregate`), unless ``token_weights``.
        token_weights: optional ``[B, T]`` per-token weights (global-batch aggregation of a trainer).

    Returns:
        ``(loss scalar, {"vf_loss", "vf_clip_ratio"})``, the metrics detached 0-d tensors on the
        loss's device (as :func:`policy_loss`'s).
    """
    err = (values - returns) ** 2
    if clip is not None:
        v_clip = old_values + torch.clamp(values - old_values, -clip, clip)
        err = torch.maximum(err, (v_clip - returns) ** 2)
    m = mask.bool()
    if token_weights is not None:
        loss = 0.5 * (err * token_weights * m).sum()
    else:
        loss = 0.5 * aggregate(err, m, loss_agg)
    n = m.sum().clamp(min=1)
    with torch.no_grad():
        clipped = ((values - old_values).abs() > (float("inf") if clip is None else clip)) & m
        return loss, {"vf_loss": loss.detach(), "vf_clip_ratio": clipped.sum() / n}


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax of finite ``logits`` ``[..., V]`` -> ``[...]`` (nats, float32).

    ``logsumexp - sum(softmax * logits)``: one ``[..., V]`` temporary besides the softmax, and
    finite gradients where a probability underflows to 0 (``-sum(p log p)`` would give ``0 * inf``
    there). A ``-inf`` logit gives NaN (``0 * -inf``); an LM head's logits are finite, and masking
    the vocabulary here would cost the trainer another ``[tokens, V]`` tensor.
    """
    logits = logits.float()
    logz = torch.logsumexp(logits, -1)
    return logz - (torch.softmax(logits, -1) * logits).sum(-1)
