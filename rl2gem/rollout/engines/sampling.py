"""Token sampling of the embedded engine: one token per row from float32 logits, by inverse CDF.

Each sampled row draws one uniform ``u`` and takes the first token whose cumulative unnormalised
probability exceeds ``u`` times the row's total (``torch.multinomial`` costs ~40x more over a 49k
vocabulary on CPU). A greedy row (temperature 0) takes the argmax. The log-probability returned is
that of ``log_softmax(logits / T)`` (``T = 1`` for greedy rows), as
:class:`~rl2gem.rollout.engines.base.GenerateOutput` documents.

:func:`sample_rows` has no host data and no data-dependent shape, so a CUDA graph captures it
after a decode step (:mod:`rl2gem.rollout.engines.cuda_graphs`); :func:`sample` is the general
entry point (top-k / top-p rows too) that the engine calls eagerly, and :func:`draw_uniforms` the
one place uniforms come from: a request with a ``sampling_seed`` uses
:func:`~rl2gem.rollout.engines.base.seeded_uniforms` of its token count (the same uniforms in any
batch, so the same tokens up to the logits' float rounding: see ``seeded_uniform``), the others
the engine's generator.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from rl2gem.devices import to_device
from rl2gem.rollout.engines.base import SamplingParams, seeded_uniforms

__all__ = ["cumulative_sum", "draw_uniforms", "filtered", "sample", "sample_rows", "row_settings"]

_BELOW_ONE = np.nextafter(np.float32(1), np.float32(0))  # the largest float32 uniform


def filtered(params: SamplingParams) -> bool:
    """Whether a row samples from a top-k or top-p cut of the distribution (the host path of
    :func:`sample`; :func:`sample_rows` has none)."""
    return params.temperature != 0 and (params.top_k > 0 or params.top_p < 1.0)


def row_settings(params: Sequence[SamplingParams]) -> tuple[list[float], list[bool]]:
    """Per row: the divisor of the logits (its temperature, 1 for a greedy row) and whether it is
    greedy (temperature 0)."""
    greedy = [p.temperature == 0 for p in params]
    return [1.0 if g else float(p.temperature) for p, g in zip(params, greedy, strict=True)], greedy


def draw_uniforms(
    params: Sequence[SamplingParams], counts: Sequence[int], generator: torch.Generator, steps: int = 1
) -> np.ndarray:
    """Uniforms ``[steps, n]`` float32 in [0, 1) for ``steps`` successive tokens of ``n`` rows.

    ``counts[i]``: tokens row ``i``'s request has generated so far, so step ``k`` of a seeded row
    is its uniform number ``counts[i] + k``. Each step draws one uniform from ``generator`` per
    sampled row (seeded ones included, then overwritten), in row order, so ``steps`` steps at once
    consume the generator exactly as ``steps`` calls of one step do. Greedy rows get 0.
    """
    n = len(params)
    out = np.zeros((steps, n), dtype=np.float32)
    sampled = [i for i, p in enumerate(params) if p.temperature != 0]
    seeded = [i for i in sampled if params[i].sampling_seed is not None]
    for k in range(steps):
        if sampled:
            out[k, sampled] = torch.rand(len(sampled), generator=generator, dtype=torch.float32).numpy()
    if seeded:
        seeds = [params[i].sampling_seed for i in seeded]
        numbers = np.asarray([counts[i] for i in seeded], dtype=np.int64)[None] + np.arange(steps)[:, None]
        out[:, seeded] = seeded_uniforms(seeds, numbers)
    # a float64 uniform above 1 - 2**-25 rounds to 1.0 in float32 (1 in ~33M seeded draws): the
    # inverse CDF would then run past the last token; the largest float32 below 1 keeps [0, 1)
    return np.minimum(out, _BELOW_ONE, out=out)


@torch.library.custom_op("rl2gem::cumulative_sum", mutates_args=())
def cumulative_sum(values: torch.Tensor) -> torch.Tensor:
    """``values.cumsum(-1)`` (floating ``values``; a new contiguous tensor of the same shape,
    dtype and device) as an operator that ``torch.compile`` calls as ATen's kernel instead of
    generating its code: the compiled :func:`sample_rows` (``opaque_scan=True``) scans through it.
    Inductor of torch 2.11 splits a scan over the vocabulary across blocks for few rows, then
    fused it with the row's other reductions and per-row loads (the missing ``return False``
    after "Split scan cannot fuse with reductions" in ``SIMDScheduling.can_fuse``, fixed by
    2.13), and its code generation failed: ``TypeError: list indices must be integers or slices,
    not NoneType`` on the H100 (2026-11-28), reproduced on the CPU with torch 2.11's Triton code
    generation (``benchmarks/gpu_codegen.py``); split reductions off do not avoid it, since a
    scan splits regardless."""
    return values.cumsum(-1)


@cumulative_sum.register_fake
def _(values: torch.Tensor) -> torch.Tensor:
    return values.new_empty(values.shape)  # contiguous, as cumsum's result (floating input)


def _scale(logits: torch.Tensor, divisors: torch.Tensor):
    """-> ``logits / divisors`` (in place), its unnormalised probabilities and log-normaliser."""
    scaled = logits.div_(divisors[:, None])
    peak = scaled.amax(-1, keepdim=True)
    weights = (scaled - peak).exp_()  # unnormalised probabilities
    log_total = weights.sum(-1, keepdim=True).log_().add_(peak)  # logsumexp per row
    return scaled, weights, log_total


def _pick(scaled, weights, log_total, greedy, uniforms, any_greedy: bool, any_sampled: bool, opaque_scan: bool = False):
    """Argmax rows and inverse-CDF rows -> (tokens [n] int64, log-probabilities [n] float32)."""
    tokens = scaled.argmax(-1) if any_greedy else None
    if any_sampled:
        # weights are not read after this
        cumulative = cumulative_sum(weights) if opaque_scan else weights.cumsum_(-1)
        index = torch.searchsorted(cumulative, uniforms[:, None] * cumulative[:, -1:], right=True)
        index = index.clamp_(max=cumulative.shape[-1] - 1).flatten()
        tokens = index if tokens is None else torch.where(greedy, tokens, index)
    logprobs = scaled.gather(1, tokens[:, None]).sub_(log_total).flatten()
    return tokens, logprobs


def _filter(weights: torch.Tensor, params: Sequence[SamplingParams], rows: list[int]) -> None:
    """Zero, in place, the probabilities that top-k / top-p exclude in ``rows`` of ``weights``."""
    kept = weights[rows] / weights[rows].sum(-1, keepdim=True)
    sorted_probs, order = kept.sort(dim=-1, descending=True)
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    for j, i in enumerate(rows):
        if params[i].top_k > 0:
            keep[j, params[i].top_k :] = False
        if params[i].top_p < 1.0:
            mass_before = sorted_probs[j].cumsum(0) - sorted_probs[j]
            keep[j] &= mass_before < params[i].top_p
    sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
    weights[rows] = torch.zeros_like(kept).scatter_(1, order, sorted_probs)


def sample_rows(
    logits: torch.Tensor,
    divisors: torch.Tensor,
    greedy: torch.Tensor,
    uniforms: torch.Tensor,
    *,
    any_greedy: bool = True,
    any_sampled: bool = True,
    opaque_scan: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row with no host data (what a CUDA graph captures).

    Args:
        logits: ``[n, V]`` float32 (overwritten).
        divisors: ``[n]`` float32, each row's temperature (1 for greedy rows).
        greedy: ``[n]`` bool, rows that take the argmax.
        uniforms: ``[n]`` float32 in [0, 1), each sampled row's draw.
        any_greedy, any_sampled: host knowledge that lets an eager caller skip the argmax or the
            cumulative sum (a captured step keeps both).
        opaque_scan: the cumulative sum through :func:`cumulative_sum`, which ``torch.compile``
            does not generate code for (the compiled sampling's; same values).

    Returns:
        tokens ``[n]`` int64 and their log-probabilities ``[n]`` float32, on the logits' device.
    """
    return _pick(*_scale(logits, divisors), greedy, uniforms, any_greedy, any_sampled, opaque_scan)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generator: torch.Generator,
    counts: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row. ``logits`` ``[n, V]`` float32 (overwritten) -> (tokens ``[n]``
    int64, log-probabilities ``[n]`` float32), on the logits' device.

    ``params[i]``: row ``i``'s sampling parameters; ``counts[i]``: tokens its request has generated
    so far (see :func:`draw_uniforms`). Rows with top-k or top-p are sampled after zeroing the
    probabilities they exclude; the rest is :func:`sample_rows`.
    """
    counts = counts if counts is not None else [0] * len(params)
    divisors, greedy = row_settings(params)
    device = logits.device
    # the host's values through pinned memory: no wait for the device's queued work
    uniforms = to_device(torch.from_numpy(draw_uniforms(params, counts, generator)[0]), device)
    scaled, weights, log_total = _scale(logits, to_device(torch.tensor(divisors, dtype=logits.dtype), device))
    cut = [i for i, p in enumerate(params) if filtered(p)]
    if cut:
        _filter(weights, params, cut)
    greedy_rows = to_device(torch.tensor(greedy), device)
    return _pick(scaled, weights, log_total, greedy_rows, uniforms, any(greedy), not all(greedy))
