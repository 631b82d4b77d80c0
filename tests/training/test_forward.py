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


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_packed_logprobs_equal_one_sequence_at_a_time(temperature):
    """A packed row gives each sequence the log-probs (and entropies) it gets alone (reference:
    a plain forward with log_softmax/gather per sequence), at a temperature and without one."""
    model = tiny_model().float()
    with torch.no_grad():  # undo tiny_model's sharpening so the entropies are far from 0
        model.model.embed_tokens.weight.div_(40.0)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (6, 11, 4)]
    logprobs, entropies = token_logprobs(model, seqs, torch.device("cpu"), temperature=temperature, entropy="metric")
    assert logprobs.shape == entropies.shape == (21,)
    start = 0
    for s in seqs:
        with torch.no_grad():
            logits = model(torch.tensor([s])).logits[0] / temperature
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


def test_prefix_tree_by_hand():
    from rl2gem.parallel.packing import tree_attention_mask, tree_batch, tree_size, visibility_mask

    seqs = [[1, 2, 3], [1, 2, 4], [5], [1, 2, 3, 6]]
    tree = tree_batch(seqs)
    # nodes depth-first, children in first-seen order: 1, 2, 3, 6, 4, 5
    assert tree["input_ids"].tolist() == [[1, 2, 3, 6, 4, 5]]
    assert tree["position_ids"].tolist() == [[0, 1, 2, 3, 2, 0]]
    assert tree["parents"].tolist() == [-1, 0, 1, 2, 1, -1]
    assert tree["until"].tolist() == [4, 4, 3, 3, 4, 5]  # each node's subtree ends there
    assert tree["node_of"].tolist() == [0, 1, 2, 0, 1, 4, 5, 0, 1, 2, 3]
    assert tree_size(seqs) == 6 and tree_size([[7, 8], [7, 8]]) == 2
    expected = [  # each node sees itself and its ancestors
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ]
    assert (tree_attention_mask(tree["parents"])[0, 0] == 0).int().tolist() == expected
    assert visibility_mask(tree["until"], None)[0, 0].int().tolist() == expected
    additive = visibility_mask(tree["until"], torch.bfloat16)[0, 0]
    assert additive.dtype == torch.bfloat16 and (additive == 0).int().tolist() == expected


def grouped_sequences(seed=0):
    """Two GRPO-like groups (a shared prompt, four continuations each, two of which share a first
    turn) and one sequence of its own."""
    g = torch.Generator().manual_seed(seed)

    def rand(n):
        return torch.randint(3, 1000, (n,), generator=g).tolist()

    seqs = []
    for _ in range(2):
        prompt, turn = rand(12), rand(5)
        seqs += [prompt + rand(6), prompt + turn + rand(4), prompt + turn + rand(7), prompt + rand(3)]
    return [*seqs, rand(9)]


def test_tree_packing_gives_the_flat_logprobs_entropies_values_and_gradients():
    """Prefix-tree packing against flat packing (the reference): the same per-token log-probs,
    entropies, critic values and parameter gradients of a weighted loss, on fewer tokens."""
    from transformers import LlamaForTokenClassification

    from rl2gem.parallel.packing import tree_size
    from rl2gem.training import token_values

    model = tiny_model().float()
    with torch.no_grad():
        model.model.embed_tokens.weight.div_(40.0)
    seqs = grouped_sequences()
    assert tree_size(seqs) < 0.7 * sum(len(s) for s in seqs)
    weights = torch.linspace(-1.0, 2.0, sum(len(s) for s in seqs))
    results = {}
    for tree in (False, True):
        model.zero_grad()
        logprobs, entropies = token_logprobs(
            model, seqs, torch.device("cpu"), temperature=0.8, entropy="grad", tree=tree
        )
        ((logprobs * weights).sum() + 0.1 * entropies.sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results[tree] = (logprobs.detach(), entropies.detach(), grads)
    (flat_lp, flat_ent, flat_grads), (tree_lp, tree_ent, tree_grads) = results[False], results[True]
    torch.testing.assert_close(tree_lp, flat_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tree_ent, flat_ent, atol=1e-5, rtol=1e-5)
    for name, grad in flat_grads.items():  # equal up to fp32 summation order (shared prefixes sum earlier)
        assert float((tree_grads[name] - grad).abs().max()) <= 1e-5 * float(grad.abs().max()) + 1e-8, name

    critic = LlamaForTokenClassification(model.config.__class__(**{**model.config.to_dict(), "num_labels": 1})).eval()
    with torch.no_grad():
        flat_values = token_values(critic, seqs, torch.device("cpu"))
        tree_values = token_values(critic, seqs, torch.device("cpu"), tree=True)
    torch.testing.assert_close(tree_values, flat_values, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tree", [False, True])
def test_needed_tokens_only_give_the_same_logprobs_and_gradients_with_fewer_head_rows(tree):
    """``needed`` (the action masks): the needed tokens' log-probs, entropies and the gradient of a
    loss on them equal the full forward's; other tokens get 0; the LM head sees only the rows that
    predict a needed token (counted with a forward hook), not every position."""
    model = tiny_model().float()
    with torch.no_grad():
        model.model.embed_tokens.weight.div_(40.0)
    seqs = grouped_sequences()
    g = torch.Generator().manual_seed(3)
    # env-like masks: the first 12 tokens (a prompt) are never actions; the rest at random
    needed = [[0] * 12 + torch.randint(0, 2, (len(s) - 12,), generator=g).tolist() for s in seqs[:-1]]
    needed.append([0] + [1] * (len(seqs[-1]) - 1))
    mask = torch.tensor([bool(x) for row in needed for x in row])
    weights = torch.linspace(-1.0, 2.0, mask.numel())
    head_rows = []
    hook = model.lm_head.register_forward_hook(lambda _m, inputs, _out: head_rows.append(inputs[0].shape[-2]))
    results = {}
    for keep in (None, needed):
        model.zero_grad()
        head_rows.clear()
        lp, ent = token_logprobs(
            model, seqs, torch.device("cpu"), temperature=0.8, entropy="grad", tree=tree, needed=keep
        )
        ((lp * weights * mask).sum() + 0.1 * (ent * mask).sum()).backward()
        results[keep is None] = (lp.detach(), ent.detach(), {n: q.grad.clone() for n, q in model.named_parameters()})
        results[keep is None] += (head_rows[0],)
    hook.remove()
    (all_lp, all_ent, all_grads, all_rows), (lp, ent, grads, rows) = results[True], results[False]
    torch.testing.assert_close(lp[mask], all_lp[mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent[mask], all_ent[mask], atol=1e-5, rtol=1e-5)
    assert lp[~mask].abs().max() == 0 and ent[~mask].abs().max() == 0
    for name, grad in all_grads.items():
        assert float((grads[name] - grad).abs().max()) <= 1e-5 * float(grad.abs().max()) + 1e-8, name
    assert rows <= int(mask.sum()) < all_rows  # one head row per needed token at most (tree: shared rows once)


def test_needed_is_ignored_by_a_model_without_logits_to_keep():
    """A model whose forward has no ``logits_to_keep`` computes every position; the values agree."""
    from rl2gem.training.forward import takes_logits_to_keep

    model = tiny_model().float()
    assert takes_logits_to_keep(model)

    class Plain(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, position_ids=None, attention_mask=None, use_cache=False):
            return self.inner(
                input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, use_cache=use_cache
            )

    plain = Plain(model)
    assert not takes_logits_to_keep(plain)
    seqs = [[5, 6, 7, 8], [9, 10, 11]]
    needed = [[0, 0, 1, 1], [0, 1, 0]]
    with torch.no_grad():
        full = token_logprobs(model, seqs, torch.device("cpu"))[0]
        got = token_logprobs(plain, seqs, torch.device("cpu"), needed=needed)[0]
    torch.testing.assert_close(got, full)  # every position computed: needed had no effect
    with pytest.raises(ValueError, match="entries"):
        token_logprobs(model, seqs, torch.device("cpu"), needed=[[1, 1]])


def test_tree_plan_keeps_shared_prefixes_together_within_the_token_budget():
    from rl2gem.parallel.packing import tree_size

    seqs = grouped_sequences() + grouped_sequences(seed=1)
    lengths = [len(s) for s in seqs]
    budget = 64
    plans = [plan_micro_batches(lengths, rank, 2, budget, sequences=seqs) for rank in range(2)]
    assert len({len(p) for p in plans}) == 1
    real = sorted(i for p in plans for mb in p if not mb.placeholder for i in mb.indices)
    assert real == list(range(len(seqs)))
    for p in plans:
        for mb in p:
            if not mb.placeholder:
                assert tree_size([seqs[i] for i in mb.indices]) <= budget
    # a group (4 sequences from one prompt, about 75 tokens flat, under 64 as a tree) is never split
    for first in (0, 4, 9, 13):
        homes = {
            (r, j) for r, p in enumerate(plans) for j, mb in enumerate(p) for i in mb.indices if first <= i < first + 4
        }
        assert len(homes) == 1, (first, plans)
    flat_batches = sum(len(p) for p in (plan_micro_batches(lengths, r, 2, budget) for r in range(2)))
    assert sum(len(p) for p in plans) < flat_batches


def test_tree_plan_splits_groups_sharing_a_system_prompt_over_the_ranks():
    """Groups under one system prompt form one tree that fits a micro-batch; minimising the tree
    tokens alone would give it all to one rank. The plan balances the ranks instead (consecutive
    spans of the sorted sequences): the larger rank's tree is within one continuation of the best
    split of the sequences over two ranks (brute force over all splits)."""
    import itertools

    from rl2gem.parallel.packing import tree_size

    g = torch.Generator().manual_seed(3)

    def rand(n):
        return torch.randint(3, 1000, (n,), generator=g).tolist()

    system = rand(10)
    seqs = []
    for _ in range(3):
        prompt = system + rand(6)
        seqs += [prompt + rand(int(n)) for n in torch.randint(3, 9, (3,), generator=g)]
    lengths = [len(s) for s in seqs]
    plans = [plan_micro_batches(lengths, rank, 2, 4096, sequences=seqs) for rank in range(2)]
    assert [len(p) for p in plans] == [1, 1] and not any(mb.placeholder for p in plans for mb in p)
    assert sorted(plans[0][0].indices + plans[1][0].indices) == list(range(len(seqs)))
    largest = max(tree_size([seqs[i] for i in p[0].indices]) for p in plans)
    best = min(
        max(
            tree_size([seqs[i] for i in range(len(seqs)) if side[i]]),
            tree_size([seqs[i] for i in range(len(seqs)) if not side[i]]),
        )
        for side in itertools.product([0, 1], repeat=len(seqs))
    )
    assert best <= largest <= best + 8 and largest < tree_size(seqs)  # continuations have 3-8 tokens


def test_flash_attention_gets_the_rows_sequence_boundaries_from_the_host():
    """flash-attn reads a packed row's boundaries; without them transformers infers them from
    ``position_ids`` in every layer (a read of the device each time). They are passed as the
    keyword arguments its flash path takes, equal to what it would infer."""
    import inspect
    import types

    from transformers.modeling_flash_attention_utils import (
        _flash_attention_forward,
        prepare_fa_kwargs_from_position_ids,
    )

    from rl2gem.parallel.attention import FLASH_ATTENTION
    from rl2gem.parallel.packing import packed_batch
    from rl2gem.training.forward import _model_inputs

    row = packed_batch([[5, 6, 7], [8, 9], [10, 11, 12, 13, 14]])
    flash = types.SimpleNamespace(config=types.SimpleNamespace(_attn_implementation=FLASH_ATTENTION))
    kwargs = _model_inputs(flash, row, torch.device("cpu"))
    (cu_q, cu_k), (longest_q, longest_k) = prepare_fa_kwargs_from_position_ids(row["position_ids"])
    assert kwargs["cu_seq_lens_q"].tolist() == kwargs["cu_seq_lens_k"].tolist() == cu_q.tolist() == cu_k.tolist()
    assert kwargs["cu_seq_lens_q"].dtype == torch.int32
    assert kwargs["max_length_q"] == kwargs["max_length_k"] == int(longest_q) == int(longest_k) == 5
    assert type(kwargs["max_length_q"]) is int  # a Python int: flash-attn reads no tensor for it
    assert "attention_mask" not in kwargs
    assert {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"} <= set(
        inspect.signature(_flash_attention_forward).parameters
    )
    sdpa = types.SimpleNamespace(
        config=types.SimpleNamespace(_attn_implementation="sdpa"), rl2_compute_dtype=torch.float32
    )
    assert "cu_seq_lens_q" not in _model_inputs(sdpa, row, torch.device("cpu"))
