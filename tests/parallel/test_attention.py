"""Every attention kernel of a packed row against the sequences run one at a time, and its mask
built on the row's device."""

import copy

import pytest
import torch
from helpers import grouped, one_at_a_time
from omegaconf import OmegaConf
from tiny import tiny_model

from rl2gem.config import ConfigError
from rl2gem.parallel import attention as attention_module
from rl2gem.parallel.attention import (
    FLASH_ATTENTION,
    FLEX_ATTENTION,
    attention_mask,
    enable_attention,
    flex_block_mask,
    resolve_attention,
)
from rl2gem.parallel.packing import packed_batch, tree_attention_mask, tree_batch, visibility_mask
from rl2gem.training import token_logprobs
from rl2gem.training.forward import check_attention

CPU = torch.device("cpu")


def test_auto_resolves_by_device_and_packing(monkeypatch):
    assert resolve_attention("auto", "cpu") == "block"
    assert resolve_attention("auto", "cpu", tree=True) == "block"
    monkeypatch.setattr(attention_module, "flash_attn_available", lambda: True)
    assert resolve_attention("auto", "cuda") == "flash"
    assert resolve_attention("auto", "cuda", tree=True) == "flex"  # flash-attn cannot read a tree
    assert resolve_attention("flash", "cuda") == "flash"
    assert resolve_attention("auto", "cuda", dtype=torch.float32) == "flex"  # flash-attn: bf16/fp16 only
    with pytest.raises(ValueError, match="bfloat16 or float16 only"):
        resolve_attention("flash", "cuda", dtype=torch.float32)
    monkeypatch.setattr(attention_module, "flash_attn_available", lambda: False)
    assert resolve_attention("auto", "cuda") == "flex"
    for name in ("sdpa", "block"):
        assert resolve_attention(name, "cpu") == name
    assert resolve_attention("flex", "cuda") == "flex"
    with pytest.raises(ValueError, match="no FlexAttention backward on CPU"):
        resolve_attention("flex", "cpu")
    with pytest.raises(ValueError, match="prefix tree"):
        resolve_attention("flash", "cuda", tree=True)
    with pytest.raises(ValueError, match="flash-attn"):
        resolve_attention("flash", "cuda")
    with pytest.raises(ValueError, match="one of"):
        resolve_attention("xformers", "cpu")


def test_check_attention_names_the_key():
    def actor(**values):
        return OmegaConf.create({"attention": "auto", "packing": "flat", "sp_size": 1, **values})

    assert check_attention(actor(attention="block")) == "block"
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="actor.attention=flex trains on CUDA only"):
            check_attention(actor(attention="flex"))
    with pytest.raises(ConfigError, match=r"actor.attention='xformers' is not one of"):
        check_attention(actor(attention="xformers"))
    with pytest.raises(ConfigError, match="actor.attention=flash reads sequence boundaries, not a prefix tree"):
        check_attention(actor(attention="flash", packing="tree"))
    with pytest.raises(ConfigError, match="actor.sp_size"):
        check_attention(actor(attention="block", sp_size=2))


def test_visibility_mask_matches_the_trees_ancestry():
    """``until`` (the end of each node's subtree, depth-first) gives the same mask as the parents'
    ancestry, for random trees; and the flat row's is block-diagonal causal."""
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        seqs = [torch.randint(0, 3, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()]
        seqs += [torch.randint(0, 3, (int(n),), generator=g).tolist() for n in torch.randint(1, 7, (5,), generator=g)]
        tree = tree_batch(seqs)
        expected = tree_attention_mask(tree["parents"])[0, 0] == 0
        assert torch.equal(visibility_mask(tree["until"], None)[0, 0], expected)
    flat = packed_batch([[5, 6, 7], [8, 9]])
    blocks = torch.block_diag(torch.ones(3, 3), torch.ones(2, 2)).bool().tril()
    assert torch.equal(visibility_mask(flat["until"], None)[0, 0], blocks)


@pytest.mark.parametrize("attention", ["flex", "sdpa", "block"])
@pytest.mark.parametrize("tree,system", [(False, 0), (True, 0), (True, 6)])
def test_each_kernel_gives_the_sequences_own_logprobs_and_gradients(attention, tree, system):
    """Packed rows (flat, prefix trees, a tree under one system prompt) through each kernel give
    the log-probs, entropies and gradients of the sequences run one at a time (FlexAttention has
    no backward on CPU: its gradients are checked under ``pytest -m gpu``)."""
    reference = tiny_model().float()
    with torch.no_grad():
        reference.model.embed_tokens.weight.div_(40.0)
    packed = copy.deepcopy(reference)
    enable_attention(packed, attention)
    seqs = grouped(system=system)
    differentiable = attention != "flex"
    with torch.set_grad_enabled(differentiable):
        lp_ref, ent_ref = one_at_a_time(reference, seqs)
        lp, ent = token_logprobs(packed, seqs, CPU, entropy="grad" if differentiable else "metric", tree=tree)
    torch.testing.assert_close(lp.detach(), lp_ref.detach(), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ent.detach(), ent_ref.detach(), atol=2e-5, rtol=1e-5)
    if not differentiable:
        return
    (lp_ref.sum() + 0.1 * ent_ref.sum()).backward()
    (lp.sum() + 0.1 * ent.sum()).backward()
    grads = dict(packed.named_parameters())
    for name, parameter in reference.named_parameters():
        difference = float((grads[name].grad - parameter.grad).abs().max())
        assert difference <= 1e-4 * float(parameter.grad.abs().max()) + 1e-7, name


def test_flex_reads_a_block_mask_that_skips_invisible_tiles():
    """The flex kernel gets a BlockMask (not a dense mask) whose tiles between two sequences that
    do not see each other are skipped."""
    from torch.nn.attention.flex_attention import BlockMask

    model = tiny_model().float()
    enable_attention(model, "flex")
    assert model.config._attn_implementation == FLEX_ATTENTION
    row = packed_batch([list(range(5, 5 + 200)), list(range(5, 5 + 300))])
    mask = attention_mask(model, row["until"])
    assert isinstance(mask, BlockMask) and mask.shape == (1, 1, 512, 512)  # padded to whole 128-token blocks
    dense = mask.to_dense()[0, 0].bool()  # [query tiles, key tiles] with any visible pair
    assert dense.tolist() == [[True, False, False, False], [True, True, False, False], [False, True, True, False]] + [
        [False, True, True, True]
    ]


def test_the_tile_block_mask_equals_create_block_mask():
    """:func:`flex_block_mask` (built per 128 x 128 tile) equals ``create_block_mask`` (which
    evaluates every query-key pair) on random flat rows and prefix trees of 1 to 700 tokens, in its
    partial and full tiles, both orders, and the dense pair mask it implies."""
    from torch.nn.attention.flex_attention import create_block_mask

    g = torch.Generator().manual_seed(7)
    # sequences that end on a tile's last or first position, then random ones
    edges = [[128, 128], [129, 127, 3], [127, 2, 255], [1, 127, 128, 1], [256, 1]]
    for case in range(30):
        count = int(torch.randint(1, 9, (1,), generator=g))
        lengths = edges[case // 2] if case < 2 * len(edges) else torch.randint(1, 160, (count,), generator=g).tolist()
        if case % 2:  # a prefix tree: sequences that share a prompt of their group's
            prompt = torch.randint(3, 9, (int(torch.randint(1, 90, (1,), generator=g)),), generator=g).tolist()
            seqs = [prompt + torch.randint(3, 9, (n,), generator=g).tolist() for n in lengths]
            until = tree_batch(seqs)["until"]
        else:
            until = packed_batch([torch.randint(3, 9, (n,), generator=g).tolist() for n in lengths])["until"]
        got = flex_block_mask(until)
        padded = got.seq_lengths[0]
        reach = torch.cat([until, torch.arange(len(until), padded)])
        expected = create_block_mask(
            lambda b, h, q, k, reach=reach: (k <= q) & (q <= reach[k]), None, None, padded, padded, device="cpu"
        )
        for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
            assert torch.equal(getattr(got, name), getattr(expected, name)), (case, name)
        for name, count_name in [
            (f"{prefix}{side}_indices", f"{prefix}{side}_num_blocks")
            for prefix in ("", "full_")
            for side in ("kv", "q")
        ]:
            for row, used in enumerate(getattr(expected, count_name)[0, 0].tolist()):
                assert torch.equal(getattr(got, name)[0, 0, row, :used], getattr(expected, name)[0, 0, row, :used])
        assert torch.equal(got.to_dense(), expected.to_dense())


def test_masks_are_built_where_the_row_is():
    """Every tensor the masks and a packed forward create follows the inputs' device: run with the
    default device set to meta, a tensor created without a device would be on meta and fail or
    show up there."""
    model = tiny_model().float()
    seqs = grouped(system=4)
    with torch.no_grad():
        expected = token_logprobs(model, seqs, CPU)[0]
    until = packed_batch(seqs)["until"]
    for attention in ("flex", "sdpa", "block"):
        enable_attention(model, attention)
        with torch.device("meta"), torch.no_grad():
            mask = attention_mask(model, until)
            assert (mask.kv_indices if attention == "flex" else mask).device == CPU
            for tree in (False, True):
                got = token_logprobs(model, seqs, CPU, tree=tree)[0]
                assert got.device == CPU
                torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


def _varlen_attention(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
    causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
    return_attn_probs=False,
):  # fmt: skip
    """flash-attn's ``flash_attn_varlen_func`` written with SDPA, sequence by sequence (``q``
    ``[total, heads, d]``, ``k``/``v`` ``[total, kv_heads, d]``): a stand-in for its CUDA kernel."""
    assert cu_seqlens_q.dtype == torch.int32 and isinstance(max_seqlen_q, int) and dropout_p == 0.0
    _varlen_attention.calls.append(cu_seqlens_q.tolist())
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    for start, end in zip(cu_seqlens_q[:-1].tolist(), cu_seqlens_q[1:].tolist(), strict=True):
        keys, values = (t[start:end].repeat_interleave(group, 1).transpose(0, 1) for t in (k, v))
        out[start:end] = torch.nn.functional.scaled_dot_product_attention(
            q[start:end].transpose(0, 1), keys, values, is_causal=causal, scale=softmax_scale
        ).transpose(0, 1)
    return out


def test_flash_gets_the_rows_boundaries_and_no_mask(monkeypatch):
    """``attention=flash`` through transformers' flash-attn forward, its kernel replaced by an SDPA
    stand-in (flash-attn has no CPU kernel): the sequences' own log-probs, one kernel call per
    layer with the row's boundaries, and no search for packed sequences in ``position_ids`` (a read
    of the device per forward on CUDA)."""
    import transformers.masking_utils as masking_utils
    import transformers.modeling_flash_attention_utils as flash_utils

    def kernels(implementation, *args, **kwargs):
        assert implementation == "flash_attention_2"
        return None, _varlen_attention, None, flash_utils._pad_input, flash_utils._unpad_input

    def no_search(*args, **kwargs):
        raise AssertionError("transformers looked for packed sequences in position_ids")

    reference, seqs = tiny_model(), grouped()
    with torch.no_grad():
        expected, _ = one_at_a_time(reference, seqs)
    monkeypatch.setattr(flash_utils, "_lazy_imports", kernels)
    monkeypatch.setattr(flash_utils, "_loaded_implementation", None)
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", no_search)
    _varlen_attention.calls = []
    model = copy.deepcopy(reference)
    enable_attention(model, "flash")
    with torch.no_grad():
        got, _ = token_logprobs(model, seqs, CPU)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    boundaries = packed_batch(seqs)["cu_seqlens"].tolist()
    assert _varlen_attention.calls == [boundaries] * reference.config.num_hidden_layers
    # a model built from the config, as a checkpoint's export does (a name with "flash" in it made
    # transformers look for a kernel of that name)
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_config(model.config).config._attn_implementation == FLASH_ATTENTION
