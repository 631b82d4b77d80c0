"""Pairwise preference losses: Bradley-Terry for reward models, DPO and IPO for policies.

Inputs are per-pair float32 tensors ``[P]`` (one entry per (chosen, rejected) pair); the
functions return per-pair losses ``[P]`` so a trainer that splits its pairs over ranks and
micro-batches weights them itself (``sum(loss) / total_pairs``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["DPO_LOSS_TYPES", "bradley_terry_loss", "dpo_loss"]

DPO_LOSS_TYPES = ("sigmoid", "ipo")


def bradley_terry_loss(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor) -> torch.Tensor:
    """Bradley-Terry negative log-likelihood of preferring chosen over rejected (Bradley & Terry
    1952; reward modelling as in Ouyang et al. 2022): ``-log sigmoid(r_chosen - r_rejected)``.

    Args:
        chosen_scores, rejected_scores: scalar rewards ``[P]`` (float).

    Returns:
        per-pair losses ``[P]`` (float32 or the inputs' dtype), ``>= 0``; ``log 2`` at a tie.

    Raises:
        ValueError: shapes differ.
    """
    if chosen_scores.shape != rejected_scores.shape:
        raise ValueError(f"chosen {tuple(chosen_scores.shape)} and rejected {tuple(rejected_scores.shape)} differ")
    return -F.logsigmoid(chosen_scores - rejected_scores)


def dpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_tokens: torch.Tensor | None = None,
    rejected_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Direct Preference Optimization losses per pair.

    With the log-ratios ``h_c = log pi(y_c|x) - log pi_ref(y_c|x)`` and ``h_r`` likewise
    (sequence log-probabilities: sums over the response tokens):

    * ``sigmoid`` (Rafailov et al. 2023, "Direct Preference Optimization"):
      ``-(1 - eps) * log sigmoid(beta * (h_c - h_r)) - eps * log sigmoid(-beta * (h_c - h_r))``,
      ``eps = label_smoothing`` (conservative DPO, Mitchell 2023; 0 is plain DPO);
    * ``ipo`` (Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human
      Preferences", eq. 17): ``(h_c / n_c - h_r / n_r - 1 / (2 * beta))^2``, the log-ratios
      averaged over each response's ``n`` tokens as TRL does (``chosen_tokens`` /
      ``rejected_tokens``; without them the sums are used).

    Args:
        chosen_logps, rejected_logps: the policy's sequence log-probs ``[P]`` (nats).
        ref_chosen_logps, ref_rejected_logps: the reference policy's ``[P]``.
        beta: the KL strength (the inverse temperature of the implicit reward).
        loss_type: one of :data:`DPO_LOSS_TYPES`.
        label_smoothing: ``eps`` in ``[0, 0.5)`` (sigmoid only).
        chosen_tokens, rejected_tokens: response token counts ``[P]`` (IPO).

    Returns:
        ``(losses [P], chosen_rewards [P], rejected_rewards [P])``; the implicit rewards
        ``beta * h`` are detached (TRL's ``rewards/chosen`` / ``rewards/rejected``).

    Raises:
        ValueError: unknown ``loss_type``, ``beta <= 0``, label smoothing outside ``[0, 0.5)``
            or used with IPO.
    """
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {DPO_LOSS_TYPES}, got {loss_type!r}")
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if loss_type == "ipo" and label_smoothing:
        raise ValueError("label_smoothing applies to loss_type=sigmoid only")
    chosen_ratio = chosen_logps - ref_chosen_logps
    rejected_ratio = rejected_logps - ref_rejected_logps
    if loss_type == "sigmoid":
        margin = beta * (chosen_ratio - rejected_ratio)
        losses = -(1.0 - label_smoothing) * F.logsigmoid(margin) - label_smoothing * F.logsigmoid(-margin)
    else:
        chosen_avg = chosen_ratio / chosen_tokens.clamp(min=1) if chosen_tokens is not None else chosen_ratio
        rejected_avg = rejected_ratio / rejected_tokens.clamp(min=1) if rejected_tokens is not None else rejected_ratio
        losses = (chosen_avg - rejected_avg - 1.0 / (2.0 * beta)) ** 2
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
