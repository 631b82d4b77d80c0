"""Attention per independent block of a packed row against SDPA over the whole row."""

import copy

import pytest
import torch
from tiny import tiny_model

from rl2gem.parallel.block_attention import BLOCK_ATTENTION, enable_block_attention, independent_blocks
from rl2gem.parallel.packing import packed_attention_mask, tree_attention_mask, tree_batch
from rl2gem.training import token_logprobs


def test_blocks_of_packed_and_tree_masks_by_hand():
    cu = torch.tensor([0, 3, 5, 9], dtype=torch.int32)
    assert independent_blocks(packed_attention_mask(cu)) == [(0, 3), (3, 5), (5, 9)]
    # two groups sharing a prompt each ([1, 2] and [7]) and one sequence of its own ([5, 6])
    tree = tree_batch([[1, 2, 3], [1, 2, 4], [7, 8], [7, 9], [5, 6]])
    assert tree["parents"].tolist() == [-1, 0, 1, 1, -1, 4, 4, -1, 7]
    assert independent_blocks(tree_attention_mask(tree["parents"])) == [(0, 4), (4, 7), (7, 9)]
    # a key after the cut seen from before it (not causal) forbids the cut; so does a row that
    # sees nothing (it counts as seeing column 0)
    allowed = torch.eye(4, dtype=torch.bool)
    assert independent_blocks(allowed) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    allowed[0, 3] = True
    assert independent_blocks(allowed) == [(0, 4)]
    blind = torch.eye(4, dtype=torch.bool)
    blind[2, 2] = False
    assert independent_blocks(blind) == [(0, 3), (3, 4)]  # row 2 sees nothing: no cut before it
    assert independent_blocks(torch.zeros(0, 0, dtype=torch.bool)) == []


@pytest.mark.parametrize("tree", [False, True])
def test_block_attention_gives_the_whole_row_logprobs_and_gradients(tree):
    """A model switched to block attention returns the log-probs and gradients of SDPA over the
    whole row (flat packing and prefix trees), and reads the blocks once per mask."""
    reference = tiny_model().float()
    with torch.no_grad():
        reference.model.embed_tokens.weight.div_(40.0)
    blocked = copy.deepcopy(reference)
    assert enable_block_attention(blocked) and blocked.config._attn_implementation == BLOCK_ATTENTION
    assert not enable_block_attention(blocked)  # already switched: not SDPA any more
    g = torch.Generator().manual_seed(0)

    def rand(n):
        return torch.randint(3, 1000, (n,), generator=g).tolist()

    seqs = []
    for _ in range(3):
        prompt = rand(10)
        seqs += [prompt + rand(5), prompt + rand(7), prompt + rand(3)]
    seqs.append(rand(6))
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


def test_block_attention_calls_sdpa_once_per_block(monkeypatch):
    """The row is not attended as a whole: each SDPA call sees one block's queries."""
    import transformers.integrations.sdpa_attention as sdpa

    model = tiny_model().float()
    enable_block_attention(model)
    lengths = []
    original = sdpa.sdpa_attention_forward

    def spy(module, query, *args, **kwargs):
        lengths.append(query.shape[2])
        return original(module, query, *args, **kwargs)

    monkeypatch.setattr(sdpa, "sdpa_attention_forward", spy)
    with torch.no_grad():
        token_logprobs(model, [[5, 6, 7], [8, 9], [10, 11, 12, 13]], torch.device("cpu"))
    layers = model.config.num_hidden_layers
    assert lengths == [3, 2, 4] * layers
