"""Balanced packing: partition quality, micro-batch bounds, packed == unpacked log-probs."""

import itertools
import random

import pytest
import torch
from tiny import tiny_model

from rl2gem.parallel.packing import (
    karmarkar_karp,
    pack_micro_batches,
    packed_attention_mask,
    packed_batch,
    plan,
    plan_micro_batches,
    plan_minibatches,
    plan_tree,
    seq_cost,
    unpack,
)


def brute_force_best(costs, k):
    best = float("inf")
    for assign in itertools.product(range(k), repeat=len(costs)):
        sums = [0.0] * k
        for c, a in zip(costs, assign, strict=True):
            sums[a] += c
        best = min(best, max(sums))
    return best


@pytest.mark.parametrize("seed", range(5))
def test_karmarkar_karp_partitions_near_optimally(seed):
    rng = random.Random(seed)
    costs = [rng.randint(1, 100) for _ in range(9)]
    for k in (2, 3):
        parts = karmarkar_karp(costs, k)
        assert sorted(i for p in parts for i in p) == list(range(len(costs)))
        worst = max(sum(costs[i] for i in p) for p in parts)
        assert worst <= brute_force_best(costs, k) + max(costs) / 2  # near the optimum
        greedy = [0] * k  # LPT greedy as an independent baseline
        for c in sorted(costs, reverse=True):
            greedy[greedy.index(min(greedy))] += c
        assert worst <= max(greedy)


def test_known_partition_and_edge_cases():
    parts = karmarkar_karp([4, 5, 6, 7, 8], 2)  # KK's textbook example: differencing gives sums 16 / 14
    assert sorted(sum([4, 5, 6, 7, 8][i] for i in p) for p in parts) == [14, 16]
    assert karmarkar_karp([], 3) == [[], [], []]
    assert karmarkar_karp([5.0], 2) in ([[0], []], [[], [0]])
    with pytest.raises(ValueError):
        karmarkar_karp([1.0], 0)


def test_cost_grows_faster_than_length():
    assert seq_cost(4096) == pytest.approx(2 * 4096)
    assert seq_cost(2000) * 2 < seq_cost(4000)


def test_micro_batches_bounded_and_equal_count_across_ranks():
    rng = random.Random(0)
    lengths = [rng.randint(10, 500) for _ in range(37)]
    p = plan(lengths, world_size=2, max_tokens=1024)
    assert len(p) == 2 and len(p[0]) == len(p[1])
    seen = [i for rank in p for mb in rank for i in mb]
    assert sorted(seen) == list(range(37))
    assert all(sum(lengths[i] for i in mb) <= 1024 for rank in p for mb in rank)
    with pytest.raises(ValueError, match="max_length_per_device"):
        pack_micro_batches([2000], [0], 1024)


@pytest.mark.parametrize(
    "sequences, expected",
    [([[1, 2, 3]], [[[0]], [[]]]), ([[1, 2, 3], [1, 2, 3]], [[[0, 1]], [[]]])],
    ids=["fewer rows than ranks", "identical rows: one tree"],
)
def test_a_rank_past_the_prefix_trees_gets_an_empty_plan_as_in_the_flat_plan(sequences, expected):
    assert plan([3], world_size=2, max_tokens=10) == [[[0]], [[]]]
    assert plan_tree(sequences, world_size=2, max_tokens=10) == expected
    (placeholder,) = plan_micro_batches([4, 4], 1, 2, 64, sequences=[[5, 6, 7, 8]] * 2)  # GRPO: equal answers
    assert placeholder.placeholder and placeholder.indices == [0]  # rank 1 runs a pass it does not count


def test_packed_logprobs_equal_unpacked():
    model = tiny_model()
    seqs = [[1, 5, 9, 13, 17], [1, 200, 300], [1, 42, 43, 44, 45, 46, 47]]
    batch = packed_batch(seqs)
    assert batch["position_ids"].tolist()[0] == [0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 4, 5, 6]
    with torch.no_grad():
        ref = [model(torch.tensor([s])).logits[0] for s in seqs]
        mask = packed_attention_mask(batch["cu_seqlens"])
        out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], attention_mask=mask).logits
    for r, o in zip(ref, unpack(out, batch["cu_seqlens"]), strict=True):
        assert torch.allclose(r, o, atol=1e-4)


@pytest.mark.parametrize("tree", [False, True])
def test_each_minibatch_is_a_contiguous_part_planned_on_its_own(tree):
    """A budget that holds the whole step (``max_length_per_device=auto`` on a GPU) would give one
    micro-batch, so ``minibatches_per_update=4`` would take one optimizer step: each quarter of the
    step's sequences (in their order: not the longest ones together) is planned on its own over the
    ranks; every sequence is in exactly one real micro-batch, of its quarter."""
    rng = random.Random(0)
    prompt = [rng.randint(3, 50) for _ in range(20)]
    sequences = [prompt + [rng.randint(3, 50) for _ in range(rng.randint(60, 100))] for _ in range(16)]
    lengths = [len(s) for s in sequences]
    kwargs = {"sequences": sequences} if tree else {}
    seen = []
    for rank in range(2):
        assert len(plan_minibatches(lengths, rank, 2, 1 << 20, 1, **kwargs)) == 1
        planned = plan_minibatches(lengths, rank, 2, 1 << 20, 4, **kwargs)
        assert [mb.minibatch for mb in planned] == sorted(mb.minibatch for mb in planned)
        assert {mb.minibatch for mb in planned} == {0, 1, 2, 3}
        for mb in planned:
            assert all(4 * mb.minibatch <= i < 4 * mb.minibatch + 4 for i in mb.indices)
        seen += [i for mb in planned if not mb.placeholder for i in mb.indices]
    assert sorted(seen) == list(range(16))
    # fewer sequences than minibatches: one step per sequence; a budget of one sequence still plans
    assert [mb.minibatch for mb in plan_minibatches([5, 6, 7], 0, 1, 1 << 20, 4)] == [0, 1, 2]
    assert [mb.indices for mb in plan_minibatches([5, 6, 7, 8], 0, 1, 1, 2)] == [[1], [0], [3], [2]]
