"""The lean prefill/decode forward equals transformers' full forward, for each supported family."""

from __future__ import annotations

import asyncio
import collections
import copy
import os
import time
import weakref

import pytest
import torch
from helpers import lean_bf16_errors
from tiny import tiny_family_model as build
from torch.utils._python_dispatch import TorchDispatchMode

from rl2gem.openmp import release_thread_team
from rl2gem.rollout import EmbeddedEngine
from rl2gem.rollout.engines import lean_decoder
from rl2gem.rollout.engines.embedded import _KVStore
from rl2gem.rollout.engines.lean_decoder import LLAMA_NORMS, LeanDecoder, _norm, _rope, _rope_, unsupported_reason


def new_store(model, rows: int, columns: int) -> _KVStore:
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    store = _KVStore(c.num_hidden_layers, c.num_key_value_heads, head_dim, torch.float32, "cpu")
    store.reserve(rows, 0, columns)
    store.lo = store.hi = 0
    store.slots = rows
    return store


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral", "llama-linear", "llama-dynamic"])
@torch.no_grad()
def test_prefill_and_decode_logits_equal_the_full_forward(kind):
    """Also with a scaled rotary embedding: linear (read from the table) and dynamic (computed by
    the module each step: its frequencies depend on the longest position)."""
    model = build(kind)
    assert unsupported_reason(model, 512) is None
    decoder = LeanDecoder(model, chunk_rows=2, vocab_chunk=100)  # several head slices, several row chunks
    assert (decoder.rotation_table(torch.float32, torch.device("cpu")) is None) == (kind == "llama-dynamic")
    generator = torch.Generator().manual_seed(1)
    prompt_lengths = [3, 4, 20, 22]
    steps = 5
    sequences = [torch.randint(0, 256, (n + steps,), generator=generator).tolist() for n in prompt_lengths]
    reference = [model(input_ids=torch.tensor([s])).logits[0] for s in sequences]  # [len, V]

    store = new_store(model, len(sequences), 64)
    end = max(prompt_lengths)
    for row, n in enumerate(prompt_lengths):
        store.mask[row, end - n : end] = True
    logits = decoder.prefill(
        store, [(row, s[:n], 0) for row, (s, n) in enumerate(zip(sequences, prompt_lengths, strict=True))], end
    )
    expected = torch.stack([ref[n - 1] for ref, n in zip(reference, prompt_lengths, strict=True)])
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    store.hi = end

    spans = list(prompt_lengths)
    assert len(decoder.plan_chunks([s + 1 for s in spans])) == 2  # the short rows skip the long rows' columns
    for t in range(steps):
        store.reserve(store.slots, 0, 1)
        store.mask[:, store.hi] = True
        tokens = torch.tensor([s[n + t] for s, n in zip(sequences, prompt_lengths, strict=True)])
        positions = torch.tensor([n + t for n in prompt_lengths])
        logits = decoder.decode(store, tokens, positions, [s + 1 for s in spans])
        store.hi += 1
        spans = [s + 1 for s in spans]
        expected = torch.stack([ref[n + t] for ref, n in zip(reference, prompt_lengths, strict=True)])
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)

    # a cached prefix (row 3's first 10 tokens, taken from the store) extended by the rest of its prompt
    cached, row = 10, 3
    columns = store.mask[row].nonzero().flatten()[:cached]
    second = new_store(model, 1, 64)
    width = prompt_lengths[row]
    second.mask[0, :width] = True
    for layer in range(model.config.num_hidden_layers):
        second.keys[layer][0, :, :cached] = store.keys[layer][row][:, columns]
        second.values[layer][0, :, :cached] = store.values[layer][row][:, columns]
    logits = decoder.prefill(second, [(0, sequences[row][cached:width], cached)], width)
    torch.testing.assert_close(logits[0], reference[row][width - 1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("attention", ["fused", "eager in blocks"])  # the CPU's, and CUDA's in 7-query blocks
@pytest.mark.parametrize("scores", [1, 1 << 26])  # one request per group; groups as planned
@torch.no_grad()
def test_one_prefill_of_requests_with_and_without_cached_prefixes_equals_the_full_forward(
    scores, attention, monkeypatch
):
    """Six requests in one prefill call, three extending a cached prefix (one with a masked hole
    between its prefix and its new tokens), of 1 to 19 new tokens: each request's logits after its
    last token, and the keys it wrote, equal the full forward of its whole sequence; with torch's
    fused attention (the CPU's) and with the eager scores in blocks of queries (CUDA's)."""
    if attention != "fused":
        original = LeanDecoder._attend_prefill
        monkeypatch.setattr(lean_decoder, "ATTENTION_BLOCK_SCORES", 7 * 4 * 64)  # 7 queries of 64 keys, 4 heads
        monkeypatch.setattr(LeanDecoder, "_attend_prefill", lambda self, *a: original(self, *a, fused=False))
    model = build("llama")
    decoder = LeanDecoder(model, prefill_scores=scores, prefill_padding=2.0)
    generator = torch.Generator().manual_seed(4)
    lengths = [12, 25, 7, 19, 30, 9]
    cached = [0, 10, 0, 18, 11, 0]  # tokens already in the store
    sequences = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in lengths]
    end, store = 40, new_store(model, 6, 64)
    for row, (sequence, n, c) in enumerate(zip(sequences, lengths, cached, strict=True)):
        new = n - c
        if c:  # the prefix's keys and values from a forward of the prefix alone, one column of hole for row 4
            hole = 1 if row == 4 else 0
            start = end - new - hole - c
            prefix = new_store(model, 1, 64)
            prefix.mask[0, :c] = True
            decoder.prefill(prefix, [(0, sequence[:c], 0)], c)
            for layer in range(model.config.num_hidden_layers):
                store.keys[layer][row, :, start : start + c] = prefix.keys[layer][0, :, :c]
                store.values[layer][row, :, start : start + c] = prefix.values[layer][0, :, :c]
            store.mask[row, start : start + c] = True
        store.mask[row, end - new : end] = True
    requests = [(row, s[c:], c) for row, (s, c) in enumerate(zip(sequences, cached, strict=True))]
    logits = decoder.prefill(store, requests, end)
    for row, sequence in enumerate(sequences):
        reference = model(input_ids=torch.tensor([sequence]), use_cache=True)
        torch.testing.assert_close(logits[row], reference.logits[0, -1], atol=1e-4, rtol=1e-4)
        new = lengths[row] - cached[row]
        keys = reference.past_key_values.layers[0].keys[0, :, -new:]  # [kv_heads, new, d]
        torch.testing.assert_close(store.keys[0][row, :, end - new : end], keys, atol=1e-4, rtol=1e-4)
    queries = [n - c for n, c in zip(lengths, cached, strict=True)]
    widths = [n + (row == 4) for row, n in enumerate(lengths)]  # row 4 also reads its hole
    expected = [[i] for i in (4, 1, 0, 5, 2, 3)] if scores == 1 else [[4, 1, 0, 5], [2], [3]]
    assert decoder.plan_prefill_groups(queries, widths) == expected


@torch.no_grad()
def test_a_position_past_the_rotary_table_is_refused_in_prefill():
    """The table covers ``max_positions``; a prefill reaching past it raises (it would read the
    last entry's rotation), one within it equals the full forward; a dynamic rotary embedding
    (no table) is computed at any position."""
    model = build("llama")
    decoder = LeanDecoder(model, max_positions=16)
    sequence = list(range(1, 21))
    store = new_store(model, 1, 32)
    store.mask[0, :20] = True
    with pytest.raises(ValueError, match="position 19 is past the rotary table's 16"):
        decoder.prefill(store, [(0, sequence, 0)], 20)
    logits = decoder.prefill(store, [(0, sequence[:16], 0)], 16)
    expected = model(input_ids=torch.tensor([sequence[:16]])).logits[0, -1]
    torch.testing.assert_close(logits[0], expected, atol=1e-4, rtol=1e-4)
    dynamic = build("llama-dynamic")
    logits = LeanDecoder(dynamic, max_positions=16).prefill(store, [(0, sequence, 0)], 20)
    torch.testing.assert_close(
        logits[0], dynamic(input_ids=torch.tensor([sequence])).logits[0, -1], atol=1e-4, rtol=1e-4
    )


def test_plan_prefill_groups_by_hand():
    assert LeanDecoder(build("llama")).prefill_padding == 1.0  # on the CPU: equal lengths only
    decoder = LeanDecoder(build("llama"), prefill_padding=2.0)  # 4 heads
    # longest first; a request joins while the padded scores stay within twice the group's own
    assert decoder.plan_prefill_groups([3, 4, 20, 22], [3, 4, 20, 22]) == [[3, 2, 1], [0]]
    assert decoder.plan_prefill_groups([5, 5, 5], [50, 48, 60]) == [[2, 0, 1]]
    exact = LeanDecoder(build("llama"), prefill_padding=1.0)
    assert exact.plan_prefill_groups([5, 5, 3, 5], [9, 9, 3, 8]) == [[0, 1], [3], [2]]  # no padding at all
    decoder.prefill_scores = 4 * 2 * 5 * 60  # room for two of them
    assert decoder.plan_prefill_groups([5, 5, 5], [50, 48, 60]) == [[2, 0], [1]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_norms_and_rotary_embedding_equal_the_models_own_bit_for_bit(dtype):
    """The fewer-kernel RMSNorm (torch's ``rms_norm``, then the weight) and rotary embedding (a roll
    and a sign-flipped sin) give exactly what the model's modules and transformers'
    ``apply_rotary_pos_emb`` give, in float32 and bf16, for Llama's norms and Qwen3's per-head
    query and key norms (their weights away from 1, so the weight counts)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    generator = torch.Generator().manual_seed(5)
    for kind in ("llama", "qwen3"):
        model = build(kind).to(dtype)
        layer = model.model.layers[0]
        hidden = torch.randn(7, model.config.hidden_size, generator=generator).to(dtype) * 3
        norms = [(layer.input_layernorm, hidden), (layer.post_attention_layernorm, hidden), (model.model.norm, hidden)]
        decoder = LeanDecoder(model)
        if kind == "qwen3":  # over each head of the queries and keys
            heads = torch.randn(7, decoder.num_heads, decoder.head_dim, generator=generator).to(dtype)
            norms += [(layer.self_attn.q_norm, heads), (layer.self_attn.k_norm, heads[:, : decoder.kv_heads])]
        for module, x in norms:
            assert type(module).__name__ in LLAMA_NORMS
            assert torch.equal(_norm(module, x), module(x))
        positions = torch.tensor([0, 3, 9, 100, 511, 2, 7])
        _, cos, signed_sin = decoder._embed(torch.arange(7), positions)
        assert decoder._rotations.table is not None  # read from the table
        full_cos, full_sin = model.model.rotary_emb(hidden, positions[None])
        query = torch.randn(1, decoder.num_heads, 7, decoder.head_dim, generator=generator).to(dtype)
        key = torch.randn(1, decoder.kv_heads, 7, decoder.head_dim, generator=generator).to(dtype)
        expected_query, expected_key = apply_rotary_pos_emb(query, key, full_cos, full_sin)
        assert torch.equal(_rope(query[0].transpose(0, 1), cos, signed_sin), expected_query[0].transpose(0, 1))
        assert torch.equal(_rope(key[0].transpose(0, 1), cos, signed_sin), expected_key[0].transpose(0, 1))
        # the fused path: queries and keys rotated together, in place in one buffer (strided views)
        fused = torch.cat([query[0].transpose(0, 1), key[0].transpose(0, 1), key[0].transpose(0, 1)], dim=1)
        _rope_(fused, decoder.num_heads + decoder.kv_heads, cos, signed_sin)
        assert torch.equal(fused[:, : decoder.num_heads], expected_query[0].transpose(0, 1))
        assert torch.equal(
            fused[:, decoder.num_heads : decoder.num_heads + decoder.kv_heads], expected_key[0].transpose(0, 1)
        )
        assert torch.equal(fused[:, decoder.num_heads + decoder.kv_heads :], key[0].transpose(0, 1))  # values untouched


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_lean_bf16_logits_are_as_close_to_float32_as_transformers_own(kind):
    """In bf16 (CUDA's dtype) the lean prefill and decode stray from the float32 logits no more
    than twice as far as transformers' own bf16 forward does (tests/test_gpu.py runs the same on
    CUDA); a wrong sign or scale anywhere gives differences the size of the logits."""
    heads = {"head_dim": 32} if kind == "qwen3" else {}
    model = build(kind, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8, **heads)
    lean, own = lean_bf16_errors(model, torch.device("cpu"))
    assert 0 < lean <= 2 * own, (lean, own)


@torch.no_grad()
def test_fused_projections_share_the_models_parameters_and_fall_back_when_one_is_replaced():
    """The q/k/v and gate/up projections run as one GEMM each over views of the model's own
    parameters: a weight copied in place (a weight update) is what the fused GEMM reads, a
    parameter replaced (or given other data) makes that layer run its modules one by one; both
    equal the model's own forward."""
    model = build("qwen2", num_hidden_layers=3)  # q/k/v biases fused too
    decoder = LeanDecoder(model)
    attention, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    fused = decoder._qkv[1]
    assert fused is not None and decoder._gate_up[1] is not None
    assert attention.k_proj.weight.untyped_storage().data_ptr() == fused.held.weight.untyped_storage().data_ptr()
    assert attention.v_proj.bias.untyped_storage().data_ptr() == fused.held.bias.untyped_storage().data_ptr()
    sequence = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(6)).tolist()

    def check():
        store = new_store(model, 1, 16)
        store.mask[0, :12] = True
        logits = decoder.prefill(store, [(0, sequence, 0)], 12)
        torch.testing.assert_close(
            logits[0], model(input_ids=torch.tensor([sequence])).logits[0, -1], atol=1e-4, rtol=1e-4
        )

    check()
    attention.k_proj.weight.copy_(torch.randn_like(attention.k_proj.weight))  # in place: still fused
    check()
    assert decoder._qkv[1] is fused
    attention.v_proj.weight.data = attention.v_proj.weight.data * 2  # replaced data: this layer unfused
    mlp.gate_proj.weight = torch.nn.Parameter(mlp.gate_proj.weight * -1)
    check()
    assert decoder._qkv[1] is None and decoder._gate_up[1] is None and decoder._qkv[0] is not None
    # a replaced attention, MLP or whole layer unfuses it too (the new modules' weights are read)
    layers = model.model.layers
    layers[0].mlp = copy.deepcopy(layers[0].mlp).apply(lambda m: [p.mul_(-1.3) for p in m.parameters(recurse=False)])
    check()
    layers[2] = copy.deepcopy(layers[2]).apply(lambda m: [p.mul_(-1.3) for p in m.parameters(recurse=False)])
    check()
    assert decoder._gate_up[0] is None and decoder._qkv[0] is not None and decoder._qkv[2] is None


class _Operations(TorchDispatchMode):
    """Counts the ATen operations run under it, by name."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@torch.no_grad()
def test_a_fused_decode_step_rotates_and_stores_keys_together(kind):
    """With fused projections a decode step rotates each layer's queries and keys with one roll
    and writes its keys and values to the store with one ``index_copy_`` (Qwen3's per-head norms
    keep queries and keys apart: two of each); the cos and sin come from the table (no cos or sin
    operation). Equality with the windowed decode is tests/rollout/test_cuda_graphs.py's."""
    layers = 3
    model = build(kind, num_hidden_layers=layers)
    decoder = LeanDecoder(model)
    store = new_store(model, 4, 16)
    store.mask[:, :5] = True
    ones = torch.ones(4, dtype=torch.long)
    assert decoder.rotation_table(torch.float32, torch.device("cpu")) is not None  # built once, before
    with _Operations() as operations:
        logits = decoder.decode_all_columns(
            store.keys, store.values, store.mask, ones, 5 * ones, torch.tensor([5]), store.pairs
        )
    per_layer = 2 if kind == "qwen3" else 1
    assert operations.counts["aten.roll"] == operations.counts["aten.index_copy_"] == per_layer * layers
    assert operations.counts["aten.cos"] == operations.counts["aten.sin"] == 0
    assert (
        torch.isfinite(logits).all() and store.keys[0][:, :, 5].abs().sum() > 0 < store.values[2][:, :, 5].abs().sum()
    )


class _Doubled(torch.nn.Linear):
    """A layer the lean path must call as a module (an adapter's or a quantized layer's stand-in):
    reading its weight directly would drop what its forward adds."""

    def forward(self, x):
        return 2 * super().forward(x)


@torch.no_grad()
def test_projections_that_are_not_plain_linears_run_as_modules():
    """o_proj and down_proj of another Linear class: the lean prefill and decode call them, equal to
    the model's own forward (the residual is added by the GEMM only for plain bias-free Linears)."""
    model = build("llama")
    for layer in model.model.layers:
        for parent, name in ((layer.self_attn, "o_proj"), (layer.mlp, "down_proj")):
            old = getattr(parent, name)
            doubled = _Doubled(old.in_features, old.out_features, bias=False)
            doubled.weight.copy_(old.weight)
            setattr(parent, name, doubled)
    decoder = LeanDecoder(model)
    sequence = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(2)).tolist()
    reference = model(input_ids=torch.tensor([sequence])).logits[0]
    store = new_store(model, 1, 16)
    store.mask[0, :8] = True
    logits = decoder.prefill(store, [(0, sequence[:8], 0)], 8)
    torch.testing.assert_close(logits[0], reference[7], atol=1e-4, rtol=1e-4)
    store.hi = 8
    store.mask[0, 8] = True
    logits = decoder.decode(store, torch.tensor([sequence[8]]), torch.tensor([8]), [9])
    torch.testing.assert_close(logits[0], reference[8], atol=1e-4, rtol=1e-4)


class _OtherNorm(torch.nn.Module):
    def forward(self, x):
        return x * 2


def test_a_norm_of_another_kind_is_called_as_it_is():
    x = torch.randn(3, 4)
    assert torch.equal(_norm(_OtherNorm(), x), x * 2)


def test_plan_chunks_by_hand():
    decoder = LeanDecoder(build("llama"), chunk_rows=2)
    assert decoder.plan_chunks([30, 29, 5, 4]) == [(0, 2, 30), (2, 4, 5)]  # 70 columns read instead of 120
    assert decoder.plan_chunks([30, 29, 28, 27]) == [(0, 4, 30)]  # chunking would save too little


def test_unsupported_models_are_named():
    assert "sliding-window" in unsupported_reason(build("mistral", sliding_window=16), 512)
    assert unsupported_reason(build("mistral", sliding_window=1024), 512) is None  # never reached
    # Qwen2's layer types are what its modeling code runs: a window on the later layers is refused,
    # a window that use_sliding_window turns off is not (every layer full)
    windowed = build("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1)
    assert "layers of type ['sliding_attention']" in unsupported_reason(windowed, 512)
    assert unsupported_reason(build("qwen2", use_sliding_window=False, sliding_window=16), 512) is None
    # every Qwen2 layer full although use_sliding_window is set: no window runs
    every_layer_full = build("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=2)
    assert unsupported_reason(every_layer_full, 512) is None
    # Mistral's attention applies its window whatever layer types its config lists
    listed = build("mistral", sliding_window=16, layer_types=["full_attention"] * 2)
    assert "sliding-window attention" in unsupported_reason(listed, 512)


def test_lean_engine_equals_the_transformers_path(tokenizer):
    """Staggered requests, a GRPO group and a second turn through the prefix cache: the lean engine
    and ``lean=False`` (``model(...)`` over the same store) give the same greedy tokens and
    log-probabilities."""
    model = build("qwen2", vocab_size=tokenizer.vocab_size)

    async def run(lean: bool):
        engine = EmbeddedEngine(model, max_batch_size=4, lean=lean)
        assert (engine.lean_reason is None) == lean
        greedy = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
        prompts = [list(range(10, 10 + n)) for n in (7, 19, 3, 30, 11, 11)]
        first = await asyncio.gather(*[engine.generate(p, greedy) for p in prompts])
        second_turn = prompts[3] + first[3].output_ids + [40, 41, 42]
        second = await engine.generate(second_turn, greedy)
        await engine.close()
        assert second.meta["cached_tokens"] >= len(prompts[3])
        return [o.output_ids for o in first + [second]], [o.output_logprobs for o in first + [second]]

    lean_tokens, lean_logprobs = asyncio.run(run(True))
    plain_tokens, plain_logprobs = asyncio.run(run(False))
    assert lean_tokens == plain_tokens
    for a, b in zip(lean_logprobs, plain_logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=1e-4)


def test_kv_store_slides_inside_its_buffers_and_keeps_the_window():
    """Requests come and go: the window moves right one column per step and loses its left end,
    the running rows never have more than 15 tokens to go. The store allocates (rows doubled from
    none and capped at ``max_slots``, columns for 1.5 times the reachable span), re-allocates once
    as the window grows to its width, and from then on only slides."""
    store = _KVStore(2, 1, 4, torch.float32, "cpu", max_slots=3)
    steps, width, growth = 60, 10, 15
    store.reserve(2, 0, 1, growth=growth)
    capacity = store.capacity
    assert capacity == (3, growth + growth // 2)
    store.slots = 2
    slides, allocations = 0, []
    for t in range(steps):
        lo_before, buffer = store.lo, store.keys[0]
        store.reserve(2, 0, 1, growth=growth)
        if store.keys[0] is not buffer:
            allocations.append(t)
        else:
            slides += store.lo != lo_before
        for layer in range(2):
            store.keys[layer][:2, :, store.hi] = t
            store.values[layer][:2, :, store.hi] = -t
        store.mask[:2, store.hi] = True
        store.hi += 1
        if store.window > width:
            store.mask[:2, store.lo] = False
            store.lo += 1
        expected = torch.arange(t + 1 - store.window, t + 1, dtype=torch.float32)
        for layer in range(2):
            torch.testing.assert_close(store.keys[layer][1, 0, store.lo : store.hi, 0], expected)
            torch.testing.assert_close(store.values[layer][0, 0, store.lo : store.hi, 3], -expected)
        assert store.mask[:2, store.lo : store.hi].all() and int(store.mask[:2].sum()) == 2 * store.window
    assert len(allocations) == 1  # to (width + growth) * 1.5 columns, when the window first reached the end
    assert store.capacity == (3, (width + growth) * 3 // 2)
    assert slides >= 2
    with pytest.raises(ValueError, match="exceed"):
        store.reserve(4, 0, 1)


def test_kv_store_frees_each_old_layer_before_allocating_the_next(monkeypatch):
    """Growing the store copies it layer by layer, each old layer freed before the next new one
    is allocated (at most one layer more than the store at its peak, not two stores), and the
    window's keys and values come along."""
    store = _KVStore(4, 1, 2, torch.float32, "cpu")
    store.reserve(2, 0, 8)
    store.slots, store.lo, store.hi = 2, 0, 3
    for layer, pair in enumerate(store.pairs):
        pair[:, :2, :, :3] = layer + 1
    old = [weakref.ref(pair) for pair in store.pairs]
    alive, zeros = [], torch.zeros

    def counting_zeros(*args, **kwargs):
        if isinstance(args[0], tuple) and len(args[0]) == 5:  # a layer's [2, rows, kv_heads, columns, d]
            alive.append(sum(ref() is not None for ref in old))
        return zeros(*args, **kwargs)

    monkeypatch.setattr(torch, "zeros", counting_zeros)
    store.reserve(2, 0, 200)  # more columns than the buffers hold: allocated again
    assert alive == [4, 3, 2, 1]
    for layer in range(4):
        window = store.keys[layer][:2, :, store.lo : store.hi]
        assert (
            window.shape[-2] == 3
            and (window == layer + 1).all()
            and (store.values[layer][:2, :, store.lo : store.hi] == layer + 1).all()
        )


def test_kv_store_allocates_what_the_last_rollout_needed_at_once():
    """A rollout whose window grows turn by turn (a multi-turn episode) re-allocates the store as
    it grows; after a release the next such rollout allocates once, the most rows and columns the
    previous one needed plus a quarter of the columns. ``release(keep=True)`` empties the store
    and keeps its buffers (and a decode graph's views of them: ``on_reallocate`` is not called)."""
    store = _KVStore(2, 1, 4, torch.float32, "cpu", max_slots=8)
    allocations, invalidations = [], []
    store.on_allocate = lambda: allocations.append(store.capacity)
    store.on_reallocate = lambda: invalidations.append(1)

    def rollout() -> int:
        before = len(allocations)
        store.clear()
        for _turn in range(5):  # each turn: 6 rows decode 20 tokens on top of the window so far
            store.reserve(6, 0, 1, growth=20)
            store.slots = 6
            for _ in range(20):
                store.reserve(6, 0, 1)
                store.mask[:6, store.hi] = True
                store.hi += 1
        return len(allocations) - before

    assert rollout() >= 3
    needed_columns = 5 * 20  # the window at the last turn's first reserve, plus its 20 to go
    store.release()
    assert store.nbytes == 0 and store.sizes == (6, needed_columns)
    assert rollout() == 1
    assert allocations[-1] == (6, needed_columns + needed_columns // 4)
    buffers, invalidated = [t.data_ptr() for t in store.keys], len(invalidations)
    store.release(keep=True)
    assert store.slots == 0 and store.window == 0 and store.nbytes > 0
    assert rollout() == 0 and [t.data_ptr() for t in store.keys] == buffers
    assert len(invalidations) == invalidated
    store.release()
    assert store.nbytes == 0 and len(invalidations) == invalidated + 1


def test_release_thread_team_frees_the_callers_openmp_workers():
    if "OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("needs torch's OpenMP")

    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    saved = torch.get_num_threads()
    torch.set_num_threads(2)  # a team of 2 (the test workers of make test run with 1)
    try:
        torch.ones(1 << 22).add_(1)  # a parallel region: this thread now keeps a worker team
        before = threads()
        assert release_thread_team()
        deadline = time.monotonic() + 5
        while threads() >= before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert threads() < before  # the worker threads exited
        torch.ones(1 << 22).add_(1)  # and the next region starts a new team
        assert threads() >= before
    finally:
        torch.set_num_threads(saved)
