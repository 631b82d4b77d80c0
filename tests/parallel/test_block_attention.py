"""Attention per block of queries over its keys against SDPA over the whole row."""

import copy

import pytest
import torch
from helpers import grouped
from tiny import tiny_model

from rl2gem.parallel.block_attention import BLOCK_ATTENTION, attention_blocks, enable_block_attention
from rl2gem.parallel.packing import packed_attention_mask, tree_attention_mask, tree_batch
from rl2gem.training import token_logprobs


def blocks_by_hand(mask, merge_pairs=0):
    return [(a, b, keys.tolist()) for a, b, keys in attention_blocks(mask, merge_pairs)]


def test_blocks_of_packed_and_tree_masks_by_hand():
    cu = torch.tensor([0, 3, 5, 9], dtype=torch.int32)
    assert blocks_by_hand(packed_attention_mask(cu)) == [(0, 3, [0, 1, 2]), (3, 5, [3, 4]), (5, 9, [5, 6, 7, 8])]
    # merged when the merged block costs at most merge_pairs more query-key pairs: 25 <= 13 + 12
    assert blocks_by_hand(packed_attention_mask(cu), 12)[:1] == [(0, 5, [0, 1, 2, 3, 4])]
    # two groups sharing a prompt each ([1, 2] and [7]) and one sequence of its own ([5, 6]): each
    # branch after the first reads its ancestors and itself, not its elder sibling
    tree = tree_batch([[1, 2, 3], [1, 2, 4], [7, 8], [7, 9], [5, 6]])
    assert tree["parents"].tolist() == [-1, 0, 1, 1, -1, 4, 4, -1, 7]
    assert blocks_by_hand(tree_attention_mask(tree["parents"])) == [
        (0, 3, [0, 1, 2]),
        (3, 4, [0, 1, 3]),
        (4, 6, [4, 5]),
        (6, 7, [4, 6]),
        (7, 9, [7, 8]),
    ]
    # a key after the query (not causal) is read where it is seen
    allowed = torch.eye(4, dtype=torch.bool)
    allowed[0, 3] = True
    assert blocks_by_hand(allowed) == [(0, 1, [0, 3]), (1, 2, [1]), (2, 3, [2]), (3, 4, [3])]
    blind = torch.eye(4, dtype=torch.bool)
    blind[2, 2] = False  # a row that sees nothing: SDPA's output there depends on every key
    assert blocks_by_hand(blind) == [(0, 4, [0, 1, 2, 3])]
    assert attention_blocks(torch.zeros(0, 0, dtype=torch.bool)) == []


@pytest.mark.parametrize("tree,system", [(False, 0), (True, 0), (True, 6)])
def test_block_attention_gives_the_whole_row_logprobs_and_gradients(tree, system):
    """A model switched to block attention returns the log-probs and gradients of SDPA over the
    whole row: flat packing, prefix trees, and a tree whose groups all share a system prompt."""
    reference = tiny_model().float()
    with torch.no_grad():
        reference.model.embed_tokens.weight.div_(40.0)
    blocked = copy.deepcopy(reference)
    assert enable_block_attention(blocked) and blocked.config._attn_implementation == BLOCK_ATTENTION
    assert not enable_block_attention(blocked)  # already switched: not SDPA any more
    seqs = grouped(system=system)
    results = []
    for model in (reference, blocked):
        model.zero_grad()
        lp, ent = token_logprobs(model, seqs, torch.device("cpu"), entropy="grad", tree=tree)
        (lp.sum() + 0.1 * ent.sum()).backward()
        results.append((lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (lp_ref, ent_ref, grads_ref), (lp, ent, grads) = results
    torch.testing.assert_close(lp, lp_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ent_ref, atol=1e-5, rtol=1e-5)
    for name, grad in grads_ref.items():
        assert float((grads[name] - grad).abs().max()) <= 1e-5 * float(grad.abs().max()) + 1e-8, name


def test_block_attention_calls_sdpa_per_block_over_its_keys(monkeypatch):
    """The row is not attended as a whole: each SDPA call sees one block's queries (three packed
    sequences too long to merge), and in a tree under a shared system prompt each call reads
    fewer keys than the row has."""
    import transformers.integrations.sdpa_attention as sdpa

    model = tiny_model().float()
    enable_block_attention(model)
    calls = []
    original = sdpa.sdpa_attention_forward

    def spy(module, query, key, *args, **kwargs):
        calls.append((query.shape[2], key.shape[2]))
        return original(module, query, key, *args, **kwargs)

    monkeypatch.setattr(sdpa, "sdpa_attention_forward", spy)
    layers = model.config.num_hidden_layers
    with torch.no_grad():
        token_logprobs(model, [list(range(5, 85)), list(range(5, 75)), list(range(5, 95))], torch.device("cpu"))
    assert calls == [(80, 80), (70, 70), (90, 90)] * layers
    calls.clear()
    system = list(range(500, 540))
    seqs = [system + [600 + g] * 30 + [700 + 40 * g + i] * 30 for g in range(3) for i in range(2)]
    with torch.no_grad():
        token_logprobs(model, seqs, torch.device("cpu"), tree=True)
    row = 40 + 3 * 30 + 6 * 30
    assert len(calls) > layers and all(keys < row for _, keys in calls)


def test_block_masks_are_contiguous_copies():
    """Each block's mask is a contiguous tensor, not a strided view of the row's mask (cuDNN's
    SDPA fails on the view with a misaligned address; issue 36)."""
    from rl2gem.parallel.block_attention import _attention

    model = tiny_model().float()
    enable_block_attention(model)
    mask = packed_attention_mask(torch.tensor([0, 70, 150, 240], dtype=torch.int32))
    query, key = torch.randn(1, 4, 240, 16), torch.randn(1, 2, 240, 16)  # 4 heads over 2 key-value heads
    module = model.model.layers[0].self_attn
    output, _ = _attention(module, query, key, key, mask, dropout=0.0, scaling=0.25)
    assert output.shape == (1, 240, 4, 16) and len(mask.rl2_blocks) == 3
    assert all(block_mask.is_contiguous() for *_, block_mask in mask.rl2_blocks)
