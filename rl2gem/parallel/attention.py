"""Which attention kernel a packed row runs, and the mask it reads, built on the row's device.

A packed row (sequences one after another, or a prefix tree in depth-first order) is described by
one vector, ``until`` ``[N]`` int64: key ``k`` is seen by the queries ``k..until[k]`` (the end of
its sequence, or of its subtree; :func:`rl2gem.parallel.packing.visibility_mask`). Each kernel
reads it in its own form:

================  ===========================================================================
``actor.attention``  what runs
================  ===========================================================================
``flex``          PyTorch FlexAttention (``torch.nn.attention.flex_attention``) through
                  transformers' ``flex_attention`` integration, over a ``BlockMask`` built on
                  the device from ``until`` tile by tile (:func:`flex_block_mask`): only the
                  tiles that hold a visible pair are computed, flat rows and trees alike. Compiled (Triton) on
                  CUDA; a training device must be CUDA (PyTorch has no FlexAttention backward
                  on CPU; :func:`enable_attention` still runs it eagerly on CPU, forward only,
                  for tests). The row is padded to a multiple of :data:`FLEX_BLOCK` tokens
                  that see only themselves (dropped after attention): the H200 run found no
                  Inductor flex configuration for a float32 row shorter than one block, and
                  whole blocks give the compiler fewer shapes.
``flash``         flash-attn's varlen kernels (transformers' ``flash_attention_2``, the ``[gpu]``
                  extra), which read the sequence boundaries from ``position_ids``: flat rows on
                  CUDA only (a tree is not a set of sequences).
``sdpa``          ``torch.nn.functional.scaled_dot_product_attention`` over the whole ``[N, N]``
                  additive mask.
``block``         SDPA per block of queries over only the keys it sees
                  (:mod:`rl2gem.parallel.block_attention`): the CPU path.
``auto``          ``flash`` on CUDA for flat bf16/fp16 rows when flash-attn imports, else ``flex`` on
                  CUDA; ``block`` elsewhere.
================  ===========================================================================

Every path gives the log-probs, entropies and gradients of SDPA over the whole row (tests in
``tests/parallel/test_attention.py``; on CUDA under ``pytest -m gpu``).
"""

from __future__ import annotations

import functools
import importlib.util
import types

import torch

from rl2gem.parallel.block_attention import BLOCK_ATTENTION, enable_block_attention, switch_attention
from rl2gem.parallel.packing import visibility_mask

__all__ = [
    "ATTENTIONS",
    "FLEX_ATTENTION",
    "FLEX_BLOCK",
    "IMPLEMENTATIONS",
    "attention_mask",
    "enable_attention",
    "flex_block_mask",
    "flash_attn_available",
    "resolve_attention",
]

#: ``actor.attention``: the kernels a packed row can run (see the module docstring).
ATTENTIONS = ("auto", "flex", "flash", "sdpa", "block")

#: The name under which the FlexAttention wrapper is registered in transformers' attention interface.
FLEX_ATTENTION = "rl2_flex"

#: The name under which transformers' flash-attn forward is registered for rl2gem: no mask function
#: goes with it, so transformers builds no mask and does not look for packed sequences in
#: ``position_ids`` (a read of the device per forward); the kernel gets the row's boundaries. No
#: "flash" in it: transformers takes any such name for a flash-attn kernel to load (a model built
#: from the config, as ``Worker.export_hf`` does, failed to find one).
FLASH_ATTENTION = "rl2_varlen"

#: FlexAttention's block size: the rows it reads are padded to a multiple of it.
FLEX_BLOCK = 128

#: transformers' ``_attn_implementation`` for each resolved ``actor.attention``.
IMPLEMENTATIONS = {"flex": FLEX_ATTENTION, "flash": FLASH_ATTENTION, "sdpa": "sdpa", "block": BLOCK_ATTENTION}


@functools.cache
def flash_attn_available() -> bool:
    """Whether flash-attn 2 (the ``[gpu]`` extra) imports with its CUDA kernels (a build made for
    another torch is installed but fails to import)."""
    if importlib.util.find_spec("flash_attn") is None:
        return False
    try:
        import flash_attn_2_cuda  # noqa: F401
    except Exception:  # an ABI mismatch surfaces as ImportError or OSError
        return False
    return True


def resolve_attention(
    requested: str, device: torch.device | str, tree: bool = False, dtype: torch.dtype = torch.bfloat16
) -> str:
    """The kernel ``actor.attention=requested`` runs on ``device``: one of ``flex``, ``flash``,
    ``sdpa``, ``block`` (``auto`` resolved as the module docstring says).

    Args:
        requested: one of :data:`ATTENTIONS`.
        device: the training device.
        tree: the rows are prefix trees (``actor.packing=tree``).
        dtype: the model's dtype (flash-attn runs bfloat16 and float16 only).

    Raises:
        ValueError: an unknown name; ``flex`` off CUDA; ``flash`` with a tree, off CUDA, without
            flash-attn, or in float32.
    """
    device = torch.device(device)
    if requested not in ATTENTIONS:
        raise ValueError(f"attention={requested!r} is not one of {list(ATTENTIONS)}")
    if requested == "auto":
        if device.type != "cuda":
            return "block"
        half = dtype in (torch.bfloat16, torch.float16)
        return "flash" if not tree and half and flash_attn_available() else "flex"
    if requested == "flex" and device.type != "cuda":
        raise ValueError("attention=flex trains on CUDA only (PyTorch has no FlexAttention backward on CPU): use block")
    if requested == "flash":
        if tree:
            raise ValueError("attention=flash reads sequence boundaries, not a prefix tree: use flex or auto")
        if device.type != "cuda" or not flash_attn_available():
            raise ValueError("attention=flash needs CUDA and the flash-attn package (pip install 'rl2gem[gpu]')")
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"attention=flash runs bfloat16 or float16 only, not {dtype}: use flex")
    return requested


def enable_attention(model, attention: str) -> None:
    """Switch ``model`` (and its sub-modules' configs) to the resolved ``attention`` (one of
    ``flex``, ``flash``, ``sdpa``, ``block``), registering rl2gem's functions in transformers'
    attention interface where needed. A model whose attention is not SDPA-compatible (eager) is
    switched too; ring attention sets its own (:mod:`rl2gem.parallel.ring_attention`).

    Raises:
        ValueError: an unknown name, or ``flash`` for a model transformers marks unsupported.
        ImportError: from flash-attn's import (its kernels load here).
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flex_attention_mask

    if attention not in IMPLEMENTATIONS:
        raise ValueError(f"attention must be one of {list(IMPLEMENTATIONS)}, got {attention!r}")
    if attention == "block":
        switch_attention(model, "sdpa")
        enable_block_attention(model)
    elif attention == "flex":
        AttentionInterface.register(FLEX_ATTENTION, _flex_attention)
        AttentionMaskInterface.register(FLEX_ATTENTION, flex_attention_mask)
        switch_attention(model, FLEX_ATTENTION)
    elif attention == "flash":
        from transformers.modeling_flash_attention_utils import lazy_import_flash_attention

        if getattr(model, "_supports_flash_attn", None) is False:
            raise ValueError(
                f"attention=flash (what auto picks on CUDA where flash-attn is installed): transformers' "
                f"{type(model).__name__} does not support flash-attn; use actor.attention=flex"
            )
        lazy_import_flash_attention("flash_attention_2")  # the kernels load now, not in a compiled layer
        AttentionInterface.register(FLASH_ATTENTION, _flash_attention)
        switch_attention(model, FLASH_ATTENTION)
    else:
        switch_attention(model, attention)


class _AsFlashAttention2:
    """An attention module as transformers' flash-attn forward reads it, its config naming the
    kernel (``flash_attention_2``: which functions transformers imports) instead of rl2gem's name."""

    config = types.SimpleNamespace(_attn_implementation="flash_attention_2")

    def __init__(self, module):
        self.module = module

    def __getattr__(self, name):
        return getattr(self.module, name)


def _flash_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' ``flash_attention_2`` forward (``query`` ``[B, H, N, d]``) over a packed row
    whose boundaries come as ``cu_seq_lens_q``/``_k`` and ``max_length_q``/``_k``
    (:func:`rl2gem.training.forward._model_inputs`); ``attention_mask`` is None."""
    from transformers.integrations.flash_attention import flash_attention_forward

    return flash_attention_forward(_AsFlashAttention2(module), query, key, value, attention_mask, **kwargs)


def _flex_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' ``flex_attention`` forward (``query`` ``[B, H, N, d]``, ``attention_mask`` a
    ``BlockMask`` over the row padded to a multiple of :data:`FLEX_BLOCK`, from
    :func:`attention_mask`), compiled on CUDA; on other devices eager, since compiling
    FlexAttention for the CPU takes tens of seconds per shape. ``query``, ``key`` and ``value`` are
    padded with zeros to the mask's length and the output ``[B, N, H, d]`` cut back to ``N``."""
    from transformers.integrations.flex_attention import flex_attention_forward

    length, padded = query.shape[-2], attention_mask.seq_lengths[0]
    if padded > length:
        query, key, value = (torch.nn.functional.pad(t, (0, 0, 0, padded - length)) for t in (query, key, value))
    if query.device.type == "cuda":
        output, weights = flex_attention_forward(module, query, key, value, attention_mask, **kwargs)
    else:
        with torch.compiler.set_stance("force_eager"):
            output, weights = flex_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return output[:, :length], weights


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, T]`` bool tiles -> each query tile's count of key tiles ``[1, 1, T]`` and their
    indices first ``[1, 1, T, T]`` (ascending), int32: a ``BlockMask``'s layout."""
    counts = tiles.sum(-1, dtype=torch.int32)
    indices = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return counts[None, None], indices[None, None].contiguous()


def flex_block_mask(until: torch.Tensor):
    """FlexAttention's ``BlockMask`` for the row ``until`` (``[N]`` int64 on the row's device),
    over ``P`` = ``N`` rounded up to :data:`FLEX_BLOCK` (each padding position sees itself).

    Built per tile, not per pair: ``create_block_mask`` evaluates the mask on all ``P x P`` pairs
    (gigabytes at the tens of thousands of tokens a GPU micro-batch holds). Keys ``k`` see the
    queries ``k..until[k]``; in depth-first order a subtree is contiguous, so for a query tile
    ``[q0, q1]`` and a key tile before it, some pair is visible iff the tile's largest ``until``
    reaches ``q0`` and every pair iff its smallest reaches ``q1``; a diagonal tile is partial
    (causal) and a tile after the diagonal empty. ``O((P / 128)^2)`` work on the device, no host
    read; equal to ``create_block_mask`` over the same ``mask_mod`` (tests/parallel/test_attention.py).
    """
    from torch.nn.attention.flex_attention import BlockMask

    n, device = len(until), until.device
    padded = -(-n // FLEX_BLOCK) * FLEX_BLOCK
    reach = torch.cat([until, torch.arange(n, padded, dtype=until.dtype, device=device)])

    def visible(batch, head, query, key):
        return (key <= query) & (query <= reach[key])

    tiles = padded // FLEX_BLOCK
    per_tile = reach.view(tiles, FLEX_BLOCK)
    first = torch.arange(tiles, device=device) * FLEX_BLOCK  # each query tile's first and last query
    before = torch.arange(tiles, device=device)[:, None] > torch.arange(tiles, device=device)[None, :]
    full = before & (per_tile.amin(1)[None, :] >= (first + FLEX_BLOCK - 1)[:, None])
    partial = (before & (per_tile.amax(1)[None, :] >= first[:, None]) & ~full) | torch.eye(
        tiles, dtype=torch.bool, device=device
    )
    # the lengths are the tiles' (padded x padded), which from_kv_blocks infers (no seq_lengths:
    # older PyTorch releases lack the argument)
    return BlockMask.from_kv_blocks(*_ordered(partial), *_ordered(full), BLOCK_SIZE=FLEX_BLOCK, mask_mod=visible)


def reads_sequence_boundaries(model) -> bool:
    """Whether ``model``'s attention is flash-attn's varlen kernel, which takes a packed row's
    sequence boundaries (``cu_seq_lens_q``/``_k`` and ``max_length_q``/``_k`` keyword arguments)
    instead of a mask: without them transformers infers them from ``position_ids`` in every layer,
    a read of the device each time."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None) == IMPLEMENTATIONS["flash"]


def attention_mask(model, until: torch.Tensor):
    """The ``attention_mask`` argument of ``model`` (switched by :func:`enable_attention`) for a
    row described by ``until`` (``[N]`` int64 on the model's device; see the module docstring).

    Returns:
        None for flash-attn (it reads the sequence boundaries: :func:`reads_sequence_boundaries`); a FlexAttention ``BlockMask`` over
        ``[1, 1, P, P]`` for ``flex``, ``P`` the row's length rounded up to a multiple of
        :data:`FLEX_BLOCK` (each padding position sees itself only); else an additive
        ``[1, 1, N, N]`` mask in the model's compute dtype. All on ``until``'s device, with no copy from
        the host.
    """
    if reads_sequence_boundaries(model):
        return None
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if implementation in (FLEX_ATTENTION, "flex_attention"):
        return flex_block_mask(until)
    dtype = getattr(model, "rl2_compute_dtype", None) or next(model.parameters()).dtype  # load_sharded's
    return visibility_mask(until, dtype if dtype.is_floating_point else torch.float32)
