"""Packed forwards: the step's sequences over data-parallel ranks and micro-batches, and the
per-token quantities every trainer computes from one packed row.

A micro-batch is one row of concatenated sequences (no padding) whose ``position_ids`` restart at
0 for every sequence: flash-attn's varlen kernels read the boundaries from them on GPU; other
attention gets a block-diagonal causal mask (:mod:`rl2gem.parallel.packing`).

Per-token outputs of a packed row of ``N`` tokens are float32 ``[N]`` aligned to the input
positions: entry ``t`` belongs to token ``t`` (its log-probability given the tokens before it),
and the first token of each sequence gets 0 (nothing predicts it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from rl2gem.algorithms import entropy_from_logits
from rl2gem.parallel.packing import packed_attention_mask, packed_batch, plan

__all__ = [
    "MicroBatch",
    "plan_micro_batches",
    "packed_inputs",
    "token_logprobs",
    "token_values",
    "sequence_scores",
    "score_positions",
    "sequence_ends",
    "sequence_sums",
]


@dataclasses.dataclass
class MicroBatch:
    """Indices of the sequences of one micro-batch on this rank.

    Attributes:
        indices: positions in the step's list of sequences.
        placeholder: True for a micro-batch a rank runs only to keep FSDP's collectives matched
            (it got fewer real micro-batches than another rank): it computes on the step's shortest
            sequence and its loss must be multiplied by 0 (:attr:`scale`).
    """

    indices: list[int]
    placeholder: bool = False

    @property
    def scale(self) -> float:
        """1.0 for a real micro-batch, 0.0 for a placeholder."""
        return 0.0 if self.placeholder else 1.0


def plan_micro_batches(
    lengths: Sequence[int], dp_rank: int, dp_size: int, max_tokens: int, attn_coef: float = 1.0 / 4096
) -> list[MicroBatch]:
    """This rank's micro-batches of a step (the same number on every data-parallel rank).

    Sequences are partitioned over ranks by Karmarkar-Karp on compute cost ``L + attn_coef * L^2``
    and packed into micro-batches of at most ``max(max_tokens, longest)`` tokens
    (:func:`rl2gem.parallel.packing.plan`). A rank with fewer micro-batches than the busiest rank
    gets placeholders (see :class:`MicroBatch`).

    Raises:
        ValueError: no sequences.
    """
    if not lengths:
        raise ValueError("plan_micro_batches needs at least one sequence")
    per_rank = plan(list(lengths), dp_size, max(int(max_tokens), max(lengths)), attn_coef)[dp_rank]
    shortest = min(range(len(lengths)), key=lambda i: lengths[i])
    return [MicroBatch(list(mb)) if mb else MicroBatch([shortest], placeholder=True) for mb in per_rank]


def packed_inputs(model, sequences: Sequence[Sequence[int]], device: torch.device) -> tuple[dict, dict]:
    """One packed row of ``sequences`` and the model's keyword arguments.

    Returns:
        ``(batch, kwargs)``: ``batch`` from :func:`rl2gem.parallel.packing.packed_batch`
        (``input_ids`` / ``position_ids`` ``[1, N]`` int64, ``cu_seqlens`` ``[S + 1]`` int32);
        ``kwargs`` for ``model(**kwargs)`` (a 4-D block-diagonal causal mask unless the model runs
        flash-attention 2 on GPU, which reads the boundaries from ``position_ids``).
    """
    batch = packed_batch([list(s) for s in sequences])
    kwargs = {
        "input_ids": batch["input_ids"].to(device),
        "position_ids": batch["position_ids"].to(device),
        "use_cache": False,
    }
    if not (device.type == "cuda" and getattr(model.config, "_attn_implementation", "") == "flash_attention_2"):
        dtype = next(model.parameters()).dtype
        kwargs["attention_mask"] = packed_attention_mask(batch["cu_seqlens"], dtype=dtype).to(device)
    return batch, kwargs


def _first_token(batch: dict, device: torch.device) -> torch.Tensor:
    return batch["position_ids"][0].to(device) == 0


def token_logprobs(
    model, sequences: Sequence[Sequence[int]], device: torch.device, *, temperature: float = 1.0, entropy: str = "none"
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probabilities (and entropies) of a packed micro-batch under a causal LM.

    Args:
        sequences: token id lists.
        temperature: the logits are divided by it (the sampling temperature of the rollout, so
            the log-probs are those of the distribution that sampled).
        entropy: ``"grad"`` (differentiable, for an entropy bonus), ``"metric"`` (detached) or
            ``"none"``.

    Returns:
        ``(logprobs [N] float32, entropies [N] float32 in nats or None)``; 0 at each sequence's
        first token.
    """
    batch, kwargs = packed_inputs(model, sequences, device)
    ids = kwargs["input_ids"]
    logits = model(**kwargs).logits[0].float() / temperature
    logprobs = torch.log_softmax(logits[:-1], -1).gather(1, ids[0, 1:, None]).squeeze(1)
    out = torch.cat([torch.zeros(1, device=logprobs.device), logprobs])
    first = _first_token(batch, device)
    out = torch.where(first, torch.zeros_like(out), out)
    entropies = None
    if entropy != "none":
        with torch.set_grad_enabled(entropy == "grad" and torch.is_grad_enabled()):
            source = logits[:-1] if entropy == "grad" else logits[:-1].detach()
            entropies = torch.cat([torch.zeros(1, device=logprobs.device), entropy_from_logits(source)])
            entropies = torch.where(first, torch.zeros_like(entropies), entropies)
    return out, entropies


def token_values(critic, sequences: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """Per-token values of a packed micro-batch under a value-head model: float32 ``[N]`` where
    entry ``t`` is V(state before token ``t``), read from the hidden state at ``t - 1`` (0 at each
    sequence's first token), aligned like :func:`token_logprobs`."""
    batch, kwargs = packed_inputs(critic, sequences, device)
    values = critic(**kwargs).logits[0, :, 0].float()
    out = torch.cat([torch.zeros(1, device=values.device), values[:-1]])
    return torch.where(_first_token(batch, device), torch.zeros_like(out), out)


def score_positions(sequences: Sequence[Sequence[int]], pad_token_id: int | None) -> list[int]:
    """Where a sequence classifier reads each sequence's score in the packed row: the last token
    that is not ``pad_token_id`` (transformers' ``*ForSequenceClassification`` pooling, so an
    exported reward model scores a sequence as training did): the last token when
    ``pad_token_id`` is None, the first when every token is padding."""
    positions, start = [], 0
    for ids in sequences:
        last = len(ids) - 1
        if pad_token_id is not None:
            last = next((i for i in range(len(ids) - 1, -1, -1) if ids[i] != pad_token_id), 0)
        positions.append(start + last)
        start += len(ids)
    return positions


def sequence_scores(model, sequences: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """Scalar scores of a packed micro-batch under a reward model: float32 ``[S]``, the model's
    one-label output at :func:`score_positions` (``pad_token_id`` from the model's config);
    differentiable when grad is enabled.

    ``model`` is a token classifier with one label (the trained ``head="reward"`` worker) or a
    sequence classifier with one label (its Hugging Face export), whose per-token head outputs
    are read through a forward hook on ``model.score``.

    Raises:
        ValueError: a model without a one-label ``score`` head.
    """
    head = getattr(model, "score", None)
    if head is None or getattr(head, "out_features", None) != 1:
        raise ValueError(f"{type(model).__name__} has no one-label score head (a reward model)")
    captured = []
    handle = head.register_forward_hook(lambda module, args, output: captured.append(output))
    try:
        _, kwargs = packed_inputs(model, sequences, device)
        output = model(**kwargs).logits
    finally:
        handle.remove()
    per_token = (output if output.dim() == 3 else captured[-1])[0, :, 0].float()
    positions = torch.tensor(score_positions(sequences, model.config.pad_token_id), device=per_token.device)
    return per_token[positions]


def sequence_sums(values: torch.Tensor, lengths: Sequence[int], masks: Sequence[Sequence[int]]) -> torch.Tensor:
    """Per-sequence sums of packed per-token ``values`` ``[N]`` over each sequence's ``mask``:
    ``[S]`` in ``values``' dtype, differentiable (e.g. sequence log-probs of the response tokens)."""
    mask = torch.tensor([m for ms in masks for m in ms], dtype=values.dtype, device=values.device)
    owner = torch.repeat_interleave(
        torch.arange(len(lengths), device=values.device), torch.tensor(list(lengths), device=values.device)
    )
    return torch.zeros(len(lengths), dtype=values.dtype, device=values.device).index_add(0, owner, values * mask)


def sequence_ends(lengths: Sequence[int]) -> list[int]:
    """Positions of each sequence's last token in the packed row (``cumsum(lengths) - 1``)."""
    ends, total = [], 0
    for n in lengths:
        total += int(n)
        ends.append(total - 1)
    return ends
