"""Attention over a packed row, one block of queries at a time, each over only the keys it sees.

A packed micro-batch (:func:`rl2gem.parallel.packing.packed_attention_mask`: sequences one after
another) or a prefix-tree row (:func:`~rl2gem.parallel.packing.tree_attention_mask`: each token
sees its ancestors) has a sparse mask. Where no varlen kernel reads the boundaries from
``position_ids`` (flash-attn on GPU), transformers' SDPA path gets the whole ``[N, N]`` mask and
computes every query-key pair, masked or not. Here the row's queries are cut into blocks: a run of
queries where each sees what the one before saw plus itself (a sequence, or a tree node's tokens
with the first child's) is one block, and it reads only the keys its last query sees (its
ancestors in a tree), gathered; neighbouring blocks are merged while that costs fewer than
``merge_pairs`` extra query-key pairs. The outputs are SDPA's over the whole row (each query sees
exactly the keys it saw). A tree whose groups all share a system prompt has no independent blocks,
yet each group's tokens read only the prompt and their own branch.

:func:`enable_block_attention` registers the function in transformers' attention interface
(``"rl2_blocks"``) and switches a model to it; :func:`rl2gem.parallel.fsdp.load_sharded` does so
for every trainer's model whose attention is SDPA.
"""

from __future__ import annotations

import torch

__all__ = ["BLOCK_ATTENTION", "attention_blocks", "enable_block_attention", "switch_attention"]

#: The name under which the block attention is registered in transformers' attention interface.
BLOCK_ATTENTION = "rl2_blocks"


def attention_blocks(mask: torch.Tensor, merge_pairs: int = 4096) -> list[tuple[int, int, torch.Tensor]]:
    """``[(start, end, keys)]``: consecutive query ranges covering ``0..N`` and the key columns
    (sorted int64 ``[K]``) each range reads.

    Args:
        mask: ``[..., N, N]`` additive (0 where a query sees a key) or boolean (True where it
            does); the first matrix of the leading dimensions is read.
        merge_pairs: neighbouring blocks are merged when the merged block computes at most this
            many query-key pairs more than the two apart (each SDPA call has a fixed cost).

    Returns:
        Every query ``q`` of a range sees only keys in its ``keys`` (on ``mask``'s device). One
        range over all ``N`` keys when some query sees no key at all (SDPA's output for such a
        row depends on every key).
    """
    n = mask.shape[-1]
    if n == 0:
        return []
    matrix = mask.reshape(-1, n, n)[0]
    allowed = matrix if matrix.dtype == torch.bool else matrix == 0
    device = mask.device
    if not bool(allowed.any(-1).all()):
        return [(0, n, torch.arange(n, device=device))]
    # query p continues p - 1's block when it sees exactly what p - 1 saw, plus itself
    columns = torch.arange(1, n, device=device)
    continues = torch.zeros(n, dtype=torch.bool, device=device)
    for first in range(1, n, 1024):  # in row chunks: the difference matrix is [rows, N]
        rows = columns[first - 1 : first - 1 + 1024]
        differs = allowed[rows] != allowed[rows - 1]
        pairs = torch.arange(len(rows), device=device)
        continues[rows] = (differs.sum(-1) == 1) & differs[pairs, rows] & allowed[rows, rows]
    starts = [0, *torch.nonzero(~continues[1:]).flatten().add(1).tolist()]
    blocks = [(a, b, torch.nonzero(allowed[b - 1]).flatten()) for a, b in zip(starts, [*starts[1:], n], strict=True)]
    merged = [blocks[0]]
    for a, b, keys in blocks[1:]:
        a0, _, keys0 = merged[-1]
        union = torch.unique(torch.cat([keys0, keys]))  # sorted
        if (b - a0) * len(union) <= (a - a0) * len(keys0) + (b - a) * len(keys) + merge_pairs:
            merged[-1] = (a0, b, union)
        else:
            merged.append((a, b, keys))
    return merged


def _attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' attention-function signature (``query`` ``[B, H, N, d]``): SDPA per block of
    :func:`attention_blocks` over its keys when ``attention_mask`` is a square 4-D mask of one row,
    else SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    square = attention_mask is not None and attention_mask.dim() == 4 and query.shape[2] == key.shape[2]
    if not square or query.shape[0] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    plan = getattr(attention_mask, "rl2_blocks", None)
    if plan is None:  # once per mask tensor: every layer gets the same one
        plan = []
        for a, b, keys in attention_blocks(attention_mask):
            contiguous = int(keys[-1] - keys[0]) + 1 == len(keys)
            columns = slice(int(keys[0]), int(keys[-1]) + 1) if contiguous else keys
            # a contiguous copy: cuDNN's SDPA fails on a strided view of the row's mask (misaligned address)
            plan.append((a, b, columns, attention_mask[..., a:b, :][..., columns].contiguous()))
        attention_mask.rl2_blocks = plan
    if len(plan) == 1 and plan[0][1] - plan[0][0] == key.shape[2] and isinstance(plan[0][2], slice):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    parts = []
    for a, b, columns, block_mask in plan:
        if isinstance(columns, slice):
            block_key, block_value = key[:, :, columns], value[:, :, columns]
        else:
            block_key, block_value = key.index_select(2, columns), value.index_select(2, columns)
        parts.append(sdpa_attention_forward(module, query[:, :, a:b], block_key, block_value, block_mask, **kwargs)[0])
    return torch.cat(parts, dim=1), None  # [B, N, H, d], as SDPA's


def enable_block_attention(model) -> bool:
    """Switch ``model`` (and its sub-configs) from SDPA to :data:`BLOCK_ATTENTION`, registering it
    in transformers' attention interface (once). Returns False and changes nothing when the
    model's attention is not SDPA (flash-attention 2 reads the boundaries itself; eager stays
    eager; ring attention has its own layout)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    AttentionInterface.register(BLOCK_ATTENTION, _attention)
    AttentionMaskInterface.register(BLOCK_ATTENTION, sdpa_mask)
    switch_attention(model, BLOCK_ATTENTION)
    return True


def switch_attention(model, name: str) -> None:
    """Set ``_attn_implementation`` of ``model``'s config and of every sub-module's config to
    ``name`` (a function registered in transformers' attention interface)."""
    model.config._attn_implementation = name
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            config._attn_implementation = name
