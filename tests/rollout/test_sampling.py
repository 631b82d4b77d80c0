"""The engine's token sampling (rl2gem.rollout.engines.sampling) against a float64 inverse CDF
written out by hand, and its uniforms: seeded ones equal the scalar SplitMix64 function, unseeded
ones consume the generator the same way one step or several at a time."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rl2gem.rollout.engines.base import SamplingParams, seeded_uniform, seeded_uniforms
from rl2gem.rollout.engines.cuda_graphs import _sample_rows_opaque_scan
from rl2gem.rollout.engines.sampling import cumulative_sum, draw_uniforms, sample, sample_rows


def reference(logits: torch.Tensor, temperature: float, uniform: float, top_k: int = 0) -> tuple[int, float]:
    """One row in float64: the first token whose cumulative probability exceeds ``uniform``
    (after keeping the ``top_k`` most likely), or the argmax at temperature 0; the log-prob of
    ``log_softmax(logits / T)``."""
    scaled = logits.double() / (temperature or 1.0)
    logprobs = torch.log_softmax(scaled, -1)
    if temperature == 0:
        token = int(scaled.argmax())
    else:
        probs = logprobs.exp()
        if top_k > 0:
            probs = torch.where(probs >= probs.topk(top_k).values[-1], probs, torch.zeros_like(probs))
            probs /= probs.sum()
        token = int(torch.searchsorted(probs.cumsum(0), torch.tensor([uniform], dtype=torch.float64), right=True))
    return token, float(logprobs[token])


@pytest.mark.parametrize("way", ["eager", "opaque scan", "inductor"])
def test_sample_rows_follows_the_inverse_cdf_by_hand(way):
    """Eager, with the cumulative sum the opaque operator, and that compiled by Inductor (the
    engine's compiled sampling; C++ kernels on the CPU)."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=generator) * 3
    temperatures = [0.0, 1.0, 0.7, 0.0, 1.3, 0.5]
    uniforms = [0.0, 0.31, 0.77, 0.5, 0.999, 0.05]
    function = {
        "eager": sample_rows,
        "opaque scan": _sample_rows_opaque_scan,
        "inductor": torch.compile(_sample_rows_opaque_scan, backend="inductor", fullgraph=True, dynamic=True),
    }[way]
    tokens, logprobs = function(
        logits.clone(),
        torch.tensor([t or 1.0 for t in temperatures]),
        torch.tensor([t == 0 for t in temperatures]),
        torch.tensor(uniforms),
    )
    assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32
    for row, (temperature, uniform) in enumerate(zip(temperatures, uniforms, strict=True)):
        token, logprob = reference(logits[row], temperature, uniform)
        assert int(tokens[row]) == token
        assert float(logprobs[row]) == pytest.approx(logprob, abs=1e-5)


def test_the_opaque_cumulative_sum_is_a_registered_operator_equal_to_cumsum():
    """Its fake (meta) kernel, autograd registration and schema pass ``torch.library.opcheck``;
    values equal ``cumsum`` and the input is left as it was."""
    values = torch.rand(3, 7, generator=torch.Generator().manual_seed(1))
    before = values.clone()
    torch.testing.assert_close(cumulative_sum(values), before.cumsum(-1), rtol=0, atol=0)
    assert torch.equal(values, before)
    torch.library.opcheck(cumulative_sum, (values,))


def test_sample_keeps_top_k_rows_within_their_k_tokens():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 40, generator=generator) * 2
    params = [
        SamplingParams(temperature=1.0, top_k=3, sampling_seed=7),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.9, sampling_seed=8),
        SamplingParams(temperature=1.0, top_k=1, sampling_seed=9),
    ]
    counts = [2, 0, 5, 1]
    tokens, logprobs = sample(logits.clone(), params, torch.Generator(), counts)
    for row, p in enumerate(params):
        uniform = seeded_uniform(p.sampling_seed, counts[row]) if p.sampling_seed is not None else 0.0
        token, logprob = reference(logits[row], p.temperature, float(np.float32(uniform)), p.top_k)
        assert int(tokens[row]) == token
        assert float(logprobs[row]) == pytest.approx(logprob, abs=1e-5)  # of the unfiltered softmax
    assert int(tokens[3]) == int(logits[3].argmax())  # top-1 is greedy


def test_seeded_uniforms_equal_the_scalar_function():
    seeds = [0, 1, -5, 2**70 + 3, 12345678901234567]
    counts = np.arange(6)[:, None] + np.array([0, 3, 7, 1, 2])[None]
    got = seeded_uniforms(seeds, counts)
    expected = [[seeded_uniform(s, int(c)) for s, c in zip(seeds, row, strict=True)] for row in counts]
    assert got.dtype == np.float64 and got.tolist() == expected


def test_uniforms_of_several_steps_equal_one_step_at_a_time():
    """Four steps at once draw the generator's numbers in the order four single steps do; seeded
    rows take their k-th number after ``counts``; greedy rows get 0."""
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0), SamplingParams(sampling_seed=3)]
    counts = [4, 0, 10]
    together = draw_uniforms(params, counts, torch.Generator().manual_seed(5), steps=4)
    one_at_a_time, generator = [], torch.Generator().manual_seed(5)
    for k in range(4):
        one_at_a_time.append(draw_uniforms(params, [c + k for c in counts], generator)[0])
    assert together.shape == (4, 3) and together.dtype == np.float32
    np.testing.assert_array_equal(together, np.stack(one_at_a_time))
    assert (together[:, 1] == 0).all()
    np.testing.assert_array_equal(together[:, 2], np.float32([seeded_uniform(3, 10 + k) for k in range(4)]))


def test_a_seeded_uniform_that_rounds_to_one_stays_below_one():
    """Seed 12345's uniform number 23,310,158 is 0.99999998 in float64, 1.0 in float32; the
    inverse CDF at 1.0 runs past the last token, which the index clamp turned into the last
    vocabulary id whatever its probability. The drawn uniform is the largest float32 below 1 and
    the token sampled is the last one with any probability."""
    seed, count = 12345, 23_310_158
    assert np.float32(seeded_uniforms([seed], np.array([count]))[0]) == 1.0  # the case is real
    params = [SamplingParams(temperature=1.0, sampling_seed=seed)]
    uniforms = draw_uniforms(params, [count], torch.Generator().manual_seed(0))
    assert uniforms.dtype == np.float32 and uniforms[0, 0] == np.nextafter(np.float32(1), np.float32(0))
    logits = torch.zeros(1, 8)
    logits[0, 5:] = float("-inf")  # tokens 5-7 have no probability
    tokens, logprobs = sample(logits, params, torch.Generator().manual_seed(0), [count])
    assert tokens.tolist() == [4] and logprobs.item() == pytest.approx(np.log(1 / 5))
