"""ZigZag ring attention: sequence (context) parallelism for packed variable-length batches.

A packed micro-batch of sequences is spread over the ``sp`` ranks of a sequence-parallel group
ZigZag-style (Zhu's ring-flash-attention; Liu et al. 2023, "Ring Attention with Blockwise
Transformers"): each sequence is padded to a multiple of ``2 * sp`` tokens and cut into ``2 * sp``
equal chunks, and rank ``r`` holds chunks ``r`` and ``2 * sp - 1 - r``, so every rank gets the
same number of tokens and about the same causal attention work (an early chunk with little
context and a late one with much). Position ids are those of the tokens in their sequence, so
rotary embeddings are unchanged. Padding tokens sit after a sequence's last real token: causal
attention never lets a real token see them and their outputs are dropped.

Attention over the ring: each rank keeps its queries; the keys and values of all ranks pass
around the ring (rank ``r`` sends to ``r + 1`` and receives from ``r - 1``, ``sp - 1`` times), and
each block's partial result is merged with the running one by log-sum-exp, which gives exact
softmax attention. Two implementations:

* :func:`ring_attention`: pure PyTorch, on any device and backend (gloo on CPU), the block mask
  built from each token's sequence id and position, with its own backward (flash-attention
  style: the probabilities are recomputed block by block while the keys and values go round the
  ring again, their gradients travelling with them back to their rank);
* on CUDA, when the ``ring_flash_attn`` package is installed (``pip install rl2gem[gpu]``), its
  ``zigzag_ring_flash_attn_varlen_func`` (same layout, flash-attn kernels).

The model side is transformers' attention interface: :func:`enable_ring_attention` registers
``"rl2_ring"`` and switches a model to it, and :func:`ring_context` gives the attention function
the layout of the current forward. No model code is copied.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import warnings
from collections.abc import Sequence

import torch
import torch.distributed as dist

from rl2gem.devices import to_device
from rl2gem.models import not_full_causal_attention
from rl2gem.parallel.block_attention import switch_attention

__all__ = [
    "ZigZagLayout",
    "zigzag_layout",
    "ring_attention",
    "ring_context",
    "enable_ring_attention",
    "gather_sequence_parallel",
    "RING_ATTENTION",
]

#: The name under which the ring attention is registered in transformers' attention interface.
RING_ATTENTION = "rl2_ring"


@dataclasses.dataclass
class ZigZagLayout:
    """Where each token of a packed row goes on the ``sp`` ranks.

    Attributes:
        sp_size: ranks of the sequence-parallel group.
        padded_lengths: each sequence's length rounded up to a multiple of ``2 * sp_size``.
        order: int64 ``[sp_size, n_local]``: for each rank, the indices into the padded row
            (sequences concatenated at their padded lengths) of the tokens it holds, in local order.
        source: int64 ``[n_padded]``: for each padded position, the index of its token in the
            unpadded packed row, or -1 for a padding token.
        positions: int64 ``[n_padded]``: each padded token's position in its sequence.
        sequence_ids: int64 ``[n_padded]``: each padded token's sequence index.
    """

    sp_size: int
    padded_lengths: list[int]
    order: torch.Tensor
    source: torch.Tensor
    positions: torch.Tensor
    sequence_ids: torch.Tensor
    #: what the attention of every layer reads, built once per layout (host decisions, device copies)
    _cache: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    def device_tokens(self, rank: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank ``rank``'s tokens' sequence ids and positions (int64 ``[n_local]`` each) on
        ``device``, copied once per layout (every layer and block reuses them)."""
        key = ("tokens", rank, str(device))
        if key not in self._cache:
            self._cache[key] = tuple(
                to_device(self.local(values, rank), torch.device(device))
                for values in (self.sequence_ids, self.positions)
            )
        return self._cache[key]

    def blocks_meet(self, rank: int, source: int) -> bool:
        """Whether any query of rank ``rank`` attends to a key of rank ``source`` (decided on the
        host from the layout, so the ring skips an empty block without reading the device)."""
        key = ("meet", rank, source)
        if key not in self._cache:
            sequences = len(self.padded_lengths)
            latest_query = torch.full((sequences,), -1, dtype=torch.long).scatter_reduce(
                0, self.local(self.sequence_ids, rank), self.local(self.positions, rank), "amax"
            )
            earliest_key = torch.full((sequences,), 1 << 62, dtype=torch.long).scatter_reduce(
                0, self.local(self.sequence_ids, source), self.local(self.positions, source), "amin"
            )
            self._cache[key] = bool((earliest_key <= latest_query).any())
        return self._cache[key]

    @property
    def n_local(self) -> int:
        """Tokens per rank (the same on every rank)."""
        return int(self.order.shape[1])

    def local(self, padded: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s entries of a per-padded-token tensor ``[n_padded, ...]``: ``[n_local, ...]``."""
        return padded[self.order[rank].to(padded.device)]

    def pad(self, packed: torch.Tensor, fill: int | float = 0) -> torch.Tensor:
        """A per-token tensor of the unpadded row ``[N, ...]`` laid out on the padded row
        ``[n_padded, ...]`` (``fill`` at padding)."""
        source = self.source.to(packed.device)
        out = torch.full((len(source), *packed.shape[1:]), fill, dtype=packed.dtype, device=packed.device)
        real = source >= 0
        out[real] = packed[source[real]]
        return out

    def unshard(self, gathered: torch.Tensor) -> torch.Tensor:
        """Per-rank outputs stacked ``[sp_size, n_local, ...]`` back into the unpadded packed row
        ``[N, ...]`` (differentiable)."""
        order = self.order.to(gathered.device).reshape(-1)
        flat = gathered.reshape(-1, *gathered.shape[2:])
        padded = torch.empty_like(flat).index_copy(0, order, flat)
        return padded[(self.source >= 0).to(gathered.device)]


def zigzag_layout(lengths: Sequence[int], sp_size: int) -> ZigZagLayout:
    """The ZigZag layout of a packed row of sequences of ``lengths`` over ``sp_size`` ranks.

    Raises:
        ValueError: ``sp_size < 1`` or a sequence of length < 1.
    """
    if sp_size < 1:
        raise ValueError(f"sp_size must be >= 1, got {sp_size}")
    if any(int(n) < 1 for n in lengths):
        raise ValueError(f"every sequence needs at least one token, got lengths {list(lengths)}")
    chunks = 2 * sp_size
    padded_lengths = [-(-int(n) // chunks) * chunks for n in lengths]
    per_rank: list[list[torch.Tensor]] = [[] for _ in range(sp_size)]
    sources, positions, sequence_ids = [], [], []
    padded_start = start = 0
    for index, (length, padded) in enumerate(zip(lengths, padded_lengths, strict=True)):
        chunk = padded // chunks
        for rank in range(sp_size):
            for c in (rank, chunks - 1 - rank):
                per_rank[rank].append(torch.arange(padded_start + c * chunk, padded_start + (c + 1) * chunk))
        position = torch.arange(padded)
        sources.append(torch.where(position < length, start + position, torch.full_like(position, -1)))
        positions.append(position)
        sequence_ids.append(torch.full((padded,), index))
        padded_start += padded
        start += int(length)
    return ZigZagLayout(
        sp_size=sp_size,
        padded_lengths=padded_lengths,
        order=torch.stack([torch.cat(parts) for parts in per_rank]),
        source=torch.cat(sources),
        positions=torch.cat(positions),
        sequence_ids=torch.cat(sequence_ids),
    )


# ---------------------------------------------------------------------------------- communication
def _group_peers(group) -> tuple[int, int, int, int]:
    """``(rank in group, size, global rank of the next, global rank of the previous)``."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    return rank, size, dist.get_global_rank(group, (rank + 1) % size), dist.get_global_rank(group, (rank - 1) % size)


def _exchange(tensor: torch.Tensor, send_to: int, receive_from: int, group) -> torch.Tensor:
    received = torch.empty_like(tensor)
    ops = [
        dist.P2POp(dist.isend, tensor.contiguous(), send_to, group),
        dist.P2POp(dist.irecv, received, receive_from, group),
    ]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return received


class _GatherSequenceParallel(torch.autograd.Function):
    """All-gather ``[n, ...]`` from each rank into ``[size, n, ...]``. Every rank then computes the
    same loss from the gathered tensor; the backward sums the ranks' gradients and keeps this
    rank's slice, so the parameters' gradients summed over the group are those of one rank that
    ran the whole sequence, times the group size (the group is part of the FSDP data mesh, whose
    gradient average divides it out)."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


def gather_sequence_parallel(local: torch.Tensor, layout: ZigZagLayout, group) -> torch.Tensor:
    """Per-token outputs of this rank ``[n_local, ...]`` gathered over the group and put back in
    the unpadded packed order ``[N, ...]`` (differentiable; see :class:`_GatherSequenceParallel`)."""
    return layout.unshard(_GatherSequenceParallel.apply(local, group))


# ---------------------------------------------------------------------------------- attention
def ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: ZigZagLayout,
    group,
    scaling: float | None = None,
) -> torch.Tensor:
    """Exact causal attention of packed sequences split over a sequence-parallel group.

    Args:
        query: ``[1, H, n_local, D]`` this rank's queries (any float dtype).
        key, value: ``[1, H_kv, n_local, D]`` (``H`` a multiple of ``H_kv``: grouped-query attention).
        layout: the :class:`ZigZagLayout` of the micro-batch (the same on every rank).
        group: the sequence-parallel process group (``sp_size`` ranks, this rank's index in it
            is its place in ``layout``).
        scaling: the softmax scale (default ``D ** -0.5``).

    Returns:
        ``[1, n_local, H, D]`` in ``query``'s dtype (transformers' attention-function layout).

    A query attends to a key when both belong to the same sequence and the key's position is not
    after the query's. Scores and the log-sum-exp merge run in float32. Like flash attention, the
    forward keeps only the output and the log-sum-exp per query, and the backward recomputes each
    block's probabilities while the keys and values go round the ring a second time, carrying
    their gradients home: one ``[H, n_local, n_local]`` block lives at a time.
    """
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    return _RingAttention.apply(query, key, value, layout, group, scale).transpose(1, 2)


def _block_mask(layout: ZigZagLayout, rank: int, source: int, device) -> torch.Tensor | None:
    """``[n_local, n_local]`` bool on ``device``: may rank ``rank``'s query attend to rank
    ``source``'s key; None when none may (:meth:`ZigZagLayout.blocks_meet`)."""
    if not layout.blocks_meet(rank, source):
        return None
    sequence_q, position_q = layout.device_tokens(rank, device)
    sequence_k, position_k = layout.device_tokens(source, device)
    return (sequence_q[:, None] == sequence_k[None, :]) & (position_k[None, :] <= position_q[:, None])


def _block_scores(query, key, allowed, groups: int, scale: float) -> torch.Tensor:
    """Float32 scores ``[1, H, n, m]``, disallowed pairs at the float32 minimum."""
    scores = torch.matmul(query.float(), key.repeat_interleave(groups, dim=1).float().transpose(-1, -2)) * scale
    return scores.masked_fill_(~allowed, torch.finfo(torch.float32).min)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, layout, group, scale):
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        _, _, following, preceding = _group_peers(group)
        groups = query.shape[1] // key.shape[1]
        blocks = torch.stack([key, value])
        out = lse = None
        for step in range(size):
            if step:
                blocks = _exchange(blocks, following, preceding, group)
            allowed = _block_mask(layout, rank, (rank - step) % size, query.device)
            if allowed is None:
                continue
            scores = _block_scores(query, blocks[0], allowed, groups, scale)
            block_lse = torch.logsumexp(scores, dim=-1)
            block_out = torch.matmul(
                torch.exp_(scores - block_lse[..., None]), blocks[1].repeat_interleave(groups, dim=1).float()
            )
            if out is None:
                out, lse = block_out, block_lse
            else:
                merged = torch.logaddexp(lse, block_lse)
                out = out * torch.exp(lse - merged)[..., None] + block_out * torch.exp(block_lse - merged)[..., None]
                lse = merged
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.layout, ctx.group, ctx.scale = layout, group, scale
        return out.to(query.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        layout, group, scale = ctx.layout, ctx.group, ctx.scale
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        _, _, following, preceding = _group_peers(group)
        heads, kv_heads = query.shape[1], key.shape[1]
        groups = heads // kv_heads
        grad_out = grad_out.float()
        delta = (grad_out * out).sum(-1, keepdim=True)  # [1, H, n, 1]
        grad_query = torch.zeros_like(query, dtype=torch.float32)
        blocks = torch.stack([key, value])
        grad_blocks = torch.zeros_like(blocks, dtype=torch.float32)  # travels with its block
        for step in range(size):
            if step:
                blocks = _exchange(blocks, following, preceding, group)
                grad_blocks = _exchange(grad_blocks, following, preceding, group)
            allowed = _block_mask(layout, rank, (rank - step) % size, query.device)
            if allowed is None:
                continue
            probs = torch.exp_(_block_scores(query, blocks[0], allowed, groups, scale) - lse[..., None])
            values = blocks[1].repeat_interleave(groups, dim=1).float()
            grad_values = torch.matmul(probs.transpose(-1, -2), grad_out)  # [1, H, m, D]
            grad_scores = probs.mul_(torch.matmul(grad_out, values.transpose(-1, -2)) - delta)
            keys = blocks[0].repeat_interleave(groups, dim=1).float()
            grad_query += torch.matmul(grad_scores, keys) * scale
            grad_keys = torch.matmul(grad_scores.transpose(-1, -2), query.float()) * scale
            length, dim = grad_keys.shape[-2:]
            grad_blocks[0] += grad_keys.view(1, kv_heads, groups, length, dim).sum(2)
            grad_blocks[1] += grad_values.view(1, kv_heads, groups, length, dim).sum(2)
        if size > 1:  # the block held now belongs to the next rank: send its gradients home
            grad_blocks = _exchange(grad_blocks, following, preceding, group)
        return (
            grad_query.to(query.dtype),
            grad_blocks[0].to(key.dtype),
            grad_blocks[1].to(value.dtype),
            None,
            None,
            None,
        )


def _flash_ring_attention(query, key, value, layout: ZigZagLayout, group, scaling):
    """``ring_flash_attn.zigzag_ring_flash_attn_varlen_func`` on this layout (CUDA)."""
    from ring_flash_attn import zigzag_ring_flash_attn_varlen_func

    key_name = ("cu_seqlens", str(query.device))
    if key_name not in layout._cache:  # once per layout, not per layer
        local_lengths = torch.tensor([0] + [n // layout.sp_size for n in layout.padded_lengths])
        layout._cache[key_name] = to_device(local_lengths.cumsum(0).to(torch.int32), query.device)
    cu_seqlens = layout._cache[key_name]
    out = zigzag_ring_flash_attn_varlen_func(
        query[0].transpose(0, 1),
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        cu_seqlens,
        max(layout.padded_lengths) // layout.sp_size,
        softmax_scale=scaling,
        causal=True,
        group=group,
    )
    return out[None]


_STATE = threading.local()


@contextlib.contextmanager
def ring_context(layout: ZigZagLayout, group):
    """The layout and group that ``"rl2_ring"`` attention uses inside this ``with`` block."""
    previous = getattr(_STATE, "current", None)
    _STATE.current = (layout, group)
    try:
        yield
    finally:
        _STATE.current = previous


def recompute_context():
    """``torch.utils.checkpoint``'s ``context_fn``: the forward's :func:`ring_context`, entered
    again where a checkpointed layer is recomputed (in the backward, outside the forward's ``with``
    block, and on CUDA on autograd's own thread)."""
    current = getattr(_STATE, "current", None)
    return contextlib.nullcontext(), (ring_context(*current) if current is not None else contextlib.nullcontext())


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function signature; ``attention_mask`` is ignored (the layout
    gives the mask)."""
    current = getattr(_STATE, "current", None)
    if current is None:
        raise RuntimeError(
            f"{RING_ATTENTION!r} attention ran outside rl2gem.parallel.ring_attention.ring_context "
            "(a sequence-parallel model must be called through rl2gem.training.forward)"
        )
    layout, group = current
    if query.is_cuda:
        if query.dtype in (torch.float16, torch.bfloat16) and _has_ring_flash_attn():
            return _flash_ring_attention(query, key, value, layout, group, scaling), None
        _warn_pure_pytorch_ring(query.dtype)
    return ring_attention(query, key, value, layout, group, scaling), None


@functools.cache
def _warn_pure_pytorch_ring(dtype: torch.dtype) -> None:
    """Once per dtype: CUDA runs the pure-PyTorch ring (float32 score blocks of ``heads x n_local^2``)."""
    reason = "ring_flash_attn or flash-attn does not import" if dtype in (torch.float16, torch.bfloat16) else dtype
    warnings.warn(
        f"sequence parallelism on CUDA runs the pure-PyTorch ring attention ({reason}): slower, and "
        "its float32 score blocks grow with the square of the tokens per rank",
        stacklevel=3,
    )


@functools.cache
def _has_ring_flash_attn() -> bool:
    """Whether ``ring_flash_attn`` and the flash-attn it calls both import (once per process)."""
    try:
        import flash_attn  # noqa: F401
        import ring_flash_attn  # noqa: F401
    except Exception:  # absent, or built against another torch / CUDA
        return False
    return True


def enable_ring_attention(model) -> None:
    """Register ``"rl2_ring"`` in transformers' attention interface (once) and switch ``model``
    (and its sub-configs) to it. The model must then run inside :func:`ring_context`."""
    from transformers import AttentionInterface

    reason = not_full_causal_attention(model.config)
    if reason is not None:
        raise ValueError(f"actor.sp_size > 1: ring attention does not support {reason}; use sp_size 1")
    AttentionInterface.register(RING_ATTENTION, _attention)
    switch_attention(model, RING_ATTENTION)
