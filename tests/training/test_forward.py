"""Packed forwards and the micro-batch planner."""

import pytest
import torch
from tiny import tiny_model

from rl2gem.training import MicroBatch, plan_micro_batches, sequence_ends, token_logprobs


def test_plan_covers_every_sequence_once_and_pads_with_placeholders():
    lengths = [30, 5, 7, 60, 8, 9, 40]
    plans = [plan_micro_batches(lengths, rank, 3, 64) for rank in range(3)]
    assert len({len(p) for p in plans}) == 1  # the same number of micro-batches on every rank
    real = sorted(i for p in plans for mb in p if not mb.placeholder for i in mb.indices)
    assert real == list(range(len(lengths)))
    for p in plans:
        for mb in p:
            assert sum(lengths[i] for i in mb.indices) <= 64
    one_rank = plan_micro_batches([10], 1, 2, 64)  # rank 1 gets no real sequence
    assert one_rank == [MicroBatch([0], placeholder=True)] and one_rank[0].scale == 0.0
    with pytest.raises(ValueError):
        plan_micro_batches([], 0, 1, 64)


def test_packed_logprobs_equal_one_sequence_at_a_time():
    """A packed row gives each sequence the log-probs (and entropies) it gets alone (reference:
    a plain forward with log_softmax/gather per sequence)."""
    model = tiny_model().float()
    with torch.no_grad():  # undo tiny_model's sharpening so the entropies are far from 0
        model.model.embed_tokens.weight.div_(40.0)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (6, 11, 4)]
    logprobs, entropies = token_logprobs(model, seqs, torch.device("cpu"), temperature=0.7, entropy="metric")
    assert logprobs.shape == entropies.shape == (21,)
    start = 0
    for s in seqs:
        with torch.no_grad():
            logits = model(torch.tensor([s])).logits[0] / 0.7
        ref = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(s[1:])[:, None]).squeeze(1)
        probs = torch.softmax(logits[:-1], -1)
        ref_entropy = -torch.special.xlogy(probs, probs).sum(-1)
        got = logprobs[start : start + len(s)]
        assert got[0].item() == 0.0 and entropies[start].item() == 0.0
        assert torch.allclose(got[1:], ref, atol=1e-4)
        assert torch.allclose(entropies[start + 1 : start + len(s)], ref_entropy, atol=1e-4)
        assert ref_entropy.min() > 1.0
        start += len(s)
    assert sequence_ends([6, 11, 4]) == [5, 16, 20]
