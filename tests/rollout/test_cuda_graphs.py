"""The fixed-shape decode step that CUDA graphs capture (rl2gem.rollout.engines.cuda_graphs), run
eagerly on the CPU, warm-up included: equal to the windowed decode and to the engine without it.
The capture itself runs under ``pytest -m gpu`` (tests/test_gpu.py)."""

from __future__ import annotations

import asyncio
import copy
import gc
import itertools
import weakref

import pytest
import torch
from engine_streams import guard_queued_rounds
from helpers import admitted_together, three_rows_then_one
from test_lean_decoder import new_store
from tiny import tiny_family_model as build
from torch._dynamo.backends.debugging import aot_eager

from rl2gem.rollout import EmbeddedEngine
from rl2gem.rollout.engines.cuda_graphs import DecodeGraphs, row_bucket
from rl2gem.rollout.engines.embedded import _KVStore
from rl2gem.rollout.engines.lean_decoder import LeanDecoder


def test_row_bucket_by_hand():
    assert [row_bucket(n, 64) for n in (1, 2, 3, 5, 8, 9, 33, 64)] == [8, 8, 8, 8, 8, 16, 64, 64]
    assert row_bucket(5, 6) == 6  # never past the store's rows
    with pytest.raises(ValueError, match="do not fit"):
        row_bucket(7, 6)


@pytest.mark.parametrize("kind,backend", [("llama", None), ("qwen3", None), ("llama", "inductor")])
@torch.no_grad()
def test_all_column_step_equals_the_windowed_decode(kind, backend):
    """Five rows (bucket 8 in a store of 12 rows: the step reads views of fewer rows than the
    buffers hold) with staggered prompts, six steps: the logits and the keys written equal the
    windowed decode's, and the padding rows stay finite; also with the step compiled by Inductor
    (``EmbeddedEngine(decode_compile=True)``; C++ kernels on the CPU)."""
    model = build(kind)
    decoder = LeanDecoder(model, chunk_rows=2)
    generator = torch.Generator().manual_seed(3)
    lengths = [3, 9, 4, 17, 6]
    sequences = [torch.randint(0, 256, (n + 6,), generator=generator).tolist() for n in lengths]
    windowed, fixed = new_store(model, 12, 64), new_store(model, 12, 64)
    end = max(lengths)
    for store in (windowed, fixed):
        store.slots = len(lengths)
        for row, n in enumerate(lengths):
            store.mask[row, end - n : end] = True
        decoder.prefill(
            store, [(row, s[:n], 0) for row, (s, n) in enumerate(zip(sequences, lengths, strict=True))], end
        )
        store.hi = end
    graphs = DecodeGraphs(decoder, capture=False, compile_backend=backend)
    for step in range(6):
        tokens = [s[n + step] for s, n in zip(sequences, lengths, strict=True)]
        positions = [n + step for n in lengths]
        for store in (windowed, fixed):
            store.mask[: store.slots, store.hi] = True
        expected = decoder.decode(
            windowed, torch.tensor(tokens), torch.tensor(positions), [n + step + 1 for n in lengths]
        )
        got = graphs.decode(fixed, tokens, positions)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        for layer in range(model.config.num_hidden_layers):
            torch.testing.assert_close(
                fixed.keys[layer][:5, :, : fixed.hi + 1], windowed.keys[layer][:5, :, : windowed.hi + 1]
            )
            assert torch.isfinite(fixed.keys[layer][5:8, :, fixed.hi]).all()
        for store in (windowed, fixed):
            store.hi += 1
    assert list(graphs._steps) == [(8, 0)] and graphs.captures == 0


@torch.no_grad()
def test_one_compilation_serves_every_bucket_and_store_size():
    """A compiled step (dynamic shapes) reads views of all the store's rows or of fewer (a strided
    view), from stores whose rows equal ``head_dim`` (64) or their columns (96) or neither: one
    compilation for all, the
    logits equal to the windowed decode's. Dynamo would otherwise compile again for a view's other
    layout or for a guard that two equal sizes stay equal (tens of seconds each on a GPU).
    ``aot_eager``: dynamo's trace without Inductor's code generation."""
    model = build("llama", hidden_size=256)  # 4 heads of 64
    compiled = []

    def counting_backend(graph_module, example_inputs):
        if any(node.op == "call_function" for node in graph_module.graph.nodes):
            compiled.append(graph_module)
        return aot_eager(graph_module, example_inputs)

    torch._dynamo.reset()
    decoder = LeanDecoder(model)
    graphs = DecodeGraphs(decoder, capture=False, compile_backend=counting_backend)
    generator = torch.Generator().manual_seed(4)
    # buckets of 8 of 96 (as many rows as columns), of 64 and of 32, then 32 of 32
    for capacity, rows in [(96, 5), (64, 5), (32, 5), (32, 30)]:
        windowed, fixed = new_store(model, capacity, 64), new_store(model, capacity, 64)
        for pair_a, pair_b in zip(windowed.pairs, fixed.pairs, strict=True):
            pair_a.copy_(torch.randn(pair_a.shape, generator=generator))
            pair_b.copy_(pair_a)
        for store in (windowed, fixed):
            store.slots, store.hi = rows, 10
            store.mask[:rows, 5:11] = True
        tokens, positions = list(range(1, rows + 1)), [5] * rows
        expected = decoder.decode(windowed, torch.tensor(tokens), torch.tensor(positions), [6] * rows)
        torch.testing.assert_close(graphs.decode(fixed, tokens, positions), expected, atol=1e-5, rtol=1e-5)
    assert len(compiled) == 1


@torch.no_grad()
def test_a_replaced_parameter_rebuilds_the_steps_without_walking_the_modules_each_step(monkeypatch):
    """The steps are tied to the model's modules and every parameter's storage, read from slots
    found once: a parameter replaced in its module, or given other data, a module replaced (new
    weights), or one wrapped with its own parameters kept (an adapter's way), builds the steps
    again and they compute with it (equal to the windowed decode), and a step reads no
    ``model.parameters()`` (a walk of every module, half the host time of a decode round on the
    CPU)."""
    model = build("llama")
    decoder = LeanDecoder(model)
    windowed, fixed = new_store(model, 8, 64), new_store(model, 8, 64)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    for store in (windowed, fixed):
        store.slots = 2
        store.mask[0, 2:5] = store.mask[1, 0:5] = True
        decoder.prefill(store, [(0, prompts[0], 0), (1, prompts[1], 0)], 5)
        store.hi = 5
    graphs = DecodeGraphs(decoder, capture=False)
    walks = []
    original = torch.nn.Module.named_modules
    monkeypatch.setattr(torch.nn.Module, "named_modules", lambda *a, **k: walks.append(1) or original(*a, **k))
    layer = model.model.layers[1]
    scaled_mlp = copy.deepcopy(layer.mlp).apply(lambda m: [p.mul_(-1.5) for p in m.parameters(recurse=False)])
    changes = [
        lambda: None,
        lambda: setattr(layer.mlp.up_proj, "weight", torch.nn.Parameter(layer.mlp.up_proj.weight * 3)),
        lambda: setattr(layer.self_attn.o_proj.weight, "data", layer.self_attn.o_proj.weight.data * -2),
        lambda: setattr(layer, "mlp", scaled_mlp),
        lambda: setattr(layer.self_attn, "o_proj", _Halved(layer.self_attn.o_proj)),
    ]
    built = []
    for step, change in enumerate(changes):
        change()
        for store in (windowed, fixed):
            store.mask[:2, store.hi] = True
        expected = decoder.decode(
            windowed, torch.tensor([3, 4]), torch.tensor([3 + step, 5 + step]), [4 + step, 6 + step]
        )
        walks.clear()
        got = graphs.decode(fixed, [3, 4], [3 + step, 5 + step])
        assert bool(walks) == (step >= 3)  # a module walk only where a module was replaced
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        built.append(graphs._steps[(8, 0)])  # 2 rows: the smallest bucket
        for store in (windowed, fixed):
            store.hi += 1
    assert all(a is not b for a, b in itertools.pairwise(built))  # each change built the step again


class _Halved(torch.nn.Module):
    """A projection wrapped with its parameters kept (an adapter's way), its output halved."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x) / 2


@pytest.mark.parametrize(
    "decode_steps,decode_compile,decode_overlap",
    [(1, False, False), (4, False, False), (4, "aot_eager", False), (4, False, True), (1, False, True)],
)
def test_engine_with_the_fixed_shape_step_gives_the_same_tokens(
    tokenizer, monkeypatch, decode_steps, decode_compile, decode_overlap
):
    """Staggered requests over 1, 3, 5 and 6 running rows, a GRPO group, a second
    turn through the prefix cache, a store that re-allocates as generations grow, a weight update
    copied in place, a request that meets its stop token within a chunk of steps, a streamed
    request and a top-k request: the engine with ``decode_graphs=True`` (eager on the CPU),
    sampling on the device one or four steps per round trip, gives the greedy tokens and
    log-probabilities of the windowed engine, sampled tokens with the same seeds too, and the
    same cached prefixes, also with ``decode_overlap`` (each round launched before the last
    one's tokens are handed out). With ``decode_compile`` the step goes through ``torch.compile`` first
    (``aot_eager`` here: dynamo's whole-graph trace and its functionalised in-place writes to the
    store, without Inductor's code generation, which the next test runs)."""
    model = build("llama", vocab_size=tokenizer.vocab_size)
    update = {name: p.detach() * 1.01 for name, p in model.named_parameters() if name.endswith("mlp.up_proj.weight")}
    compiled = []  # the graphs dynamo hands the backend

    def counting_backend(graph_module, example_inputs):
        compiled.append(graph_module)
        return aot_eager(graph_module, example_inputs)

    async def run(decode_graphs: bool):
        local = build("llama", vocab_size=tokenizer.vocab_size)
        engine = EmbeddedEngine(
            local,
            max_batch_size=6,
            decode_graphs=decode_graphs,
            decode_steps=decode_steps,
            decode_compile=counting_backend if decode_graphs and decode_compile else False,
            decode_overlap=decode_overlap and decode_graphs,
        )
        greedy = {"temperature": 0.0, "max_new_tokens": 40, "ignore_eos": True}
        prompts = [list(range(10, 10 + n)) for n in (7, 19, 3, 30, 11, 11)]
        first = await asyncio.gather(
            *[engine.generate(p, {**greedy, "max_new_tokens": 9 + 6 * i}) for i, p in enumerate(prompts)]
        )
        second = await engine.generate(prompts[3] + first[3].output_ids + [40, 41], greedy)
        stop = first[2].output_ids[6]  # met within the second chunk of four steps, or earlier
        stopped = await engine.generate(prompts[2], {**greedy, "stop_token_ids": [stop]})
        resumed = await engine.generate(prompts[2] + stopped.output_ids + [50], {**greedy, "max_new_tokens": 5})
        streamed = [item async for item in engine.generate_stream(prompts[1], {**greedy, "max_new_tokens": 7})]
        await engine.update_weights(update)
        sampled = await asyncio.gather(
            *[
                engine.generate(p, {"temperature": 0.8, "max_new_tokens": 12, "sampling_seed": 5 + i})
                for i, p in enumerate(prompts[:3])
            ],
            engine.generate(prompts[4], {"temperature": 0.8, "top_k": 5, "max_new_tokens": 6, "sampling_seed": 1}),
        )
        await engine.close()
        assert stopped.finish_reason == {"type": "stop", "matched": stop}
        assert [token for token, _ in streamed[:-1]] == streamed[-1].output_ids
        outs = [*first, second, stopped, resumed, streamed[-1], *sampled]
        cached = [o.meta["cached_tokens"] for o in (second, resumed)]
        return [o.output_ids for o in outs], [o.output_logprobs for o in outs], cached, engine

    built, resets = [], []
    original_build, original_reset = DecodeGraphs._build, DecodeGraphs.reset
    monkeypatch.setattr(
        DecodeGraphs,
        "_build",
        lambda self, store, bucket, steps: built.append((bucket, steps)) or original_build(self, store, bucket, steps),
    )
    monkeypatch.setattr(DecodeGraphs, "reset", lambda self: resets.append(1) or original_reset(self))
    fixed_tokens, fixed_logprobs, fixed_cached, fixed_engine = asyncio.run(run(True))
    window_tokens, window_logprobs, window_cached, window_engine = asyncio.run(run(False))
    assert fixed_engine._graphs is not None and window_engine._graphs is None
    assert fixed_tokens == window_tokens
    for a, b in zip(fixed_logprobs, window_logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=1e-4)
    assert fixed_cached == window_cached and min(fixed_cached) > 0  # the stopped turn's prefix is exact
    # 1 to 6 rows pad to the smallest bucket (8) cut to the store's rows (at least 4, then 6; 5 when
    # the engine took the first five requests before the sixth arrived); budgets that end inside a
    # chunk (9, 15, 21... tokens) build no shorter chunk: one step per bucket (and the logits-only
    # step of the top-k request), each a capture per rollout on CUDA
    assert 6 in {bucket for bucket, _ in built} and {bucket for bucket, _ in built} <= {4, 5, 6}
    assert {steps for _, steps in built} == {0, decode_steps}
    assert len(resets) >= 3  # the store grew or was freed (weight update) and the steps were built again
    assert fixed_engine.stats["decode_graph_captures"] == 0  # nothing is captured off CUDA
    if decode_compile:  # the decode step and the sampling, each compiled once for every bucket and size
        computing = [g for g in compiled if any(node.op == "call_function" for node in g.graph.nodes)]
        assert len(computing) == 2 and fixed_engine.stats["decode_compile_failed"] == 0
        # the sampling's logits: rows dynamic, the vocabulary static; its cumulative sum the opaque
        # operator, not a scan for Inductor to generate (torch 2.11's failed on CUDA)
        (sampling,) = [g for g in computing if any(node.target == "argmax" for node in g.graph.nodes)]
        logits = next(n for n in sampling.graph.nodes if n.op == "placeholder" and n.name.startswith("l_logits"))
        rows, vocabulary = logits.meta["example_value"].shape
        assert isinstance(rows, torch.SymInt) and type(vocabulary) is int and vocabulary == tokenizer.vocab_size
        targets = [str(node.target) for node in sampling.graph.nodes]
        assert "rl2gem.cumulative_sum.default" in targets and not any("cumsum" in t for t in targets)
    # host round trips (how many steps each ran depends on when the engine thread admitted the
    # requests, so it is not compared between the two engines)
    fixed, window = fixed_engine.stats, window_engine.stats
    # with decode_overlap, most rounds were launched before the tokens of the one before were
    # handed out (not while requests waited to be admitted, nor for the top-k request's rows)
    assert (fixed["decode_rounds_ahead"] > 0.5 * fixed["decode_rounds"]) == decode_overlap
    assert window["decode_rounds"] == window["decode_steps"]
    if decode_steps == 1:
        assert fixed["decode_rounds"] == fixed["decode_steps"]
    else:
        assert fixed["decode_rounds"] < 0.4 * fixed["decode_steps"]


def test_an_overlapped_wave_runs_no_round_after_its_last(tokenizer):
    """Four rows with one budget stop in the same round: with ``decode_overlap`` nothing is
    launched after it, so the wave takes the rounds and decode tokens it takes without (the
    first rounds were launched ahead); the tokens are the same."""
    model = build("llama", vocab_size=tokenizer.vocab_size)

    async def run(overlap: bool):
        engine = EmbeddedEngine(copy.deepcopy(model), decode_graphs=True, decode_steps=4, decode_overlap=overlap)
        greedy = {"temperature": 0, "max_new_tokens": 13, "ignore_eos": True}
        outs = await admitted_together(engine, [engine.generate(list(range(10, 20 + i)), greedy) for i in range(4)])
        stats = await engine.settled_stats()
        await engine.close()
        return [o.output_ids for o in outs], stats

    (tokens, plain), (overlapped_tokens, overlapped) = asyncio.run(run(False)), asyncio.run(run(True))
    assert overlapped_tokens == tokens
    assert overlapped["decode_rounds"] == plain["decode_rounds"] == 3  # 12 tokens after the prefill's one
    assert overlapped["decode_tokens"] == plain["decode_tokens"] and overlapped["decode_rounds_ahead"] == 2


def test_a_queued_round_never_meets_a_capture_a_reset_or_a_reallocation(tokenizer, monkeypatch):
    """With ``decode_overlap`` a round is queued while the one before it is uncollected (on CUDA,
    maybe still running): nothing may build (capture) a step, drop the graphs or re-allocate the
    store meanwhile, or the running round's graph and memory would be freed under it, and two
    launches of one step in flight use their two staging sets in turn. Twelve rows finishing one
    by one (buckets 16, then 8: a step built mid-wave), then a longer wave (the store grows); the
    tokens equal the engine's without overlap."""
    model = build("llama", vocab_size=tokenizer.vocab_size)
    original_launch = DecodeGraphs.launch_sample
    uncollected, violations, turns = guard_queued_rounds(monkeypatch)

    async def run(overlap: bool):
        engine = EmbeddedEngine(copy.deepcopy(model), decode_graphs=True, decode_steps=4, decode_overlap=overlap)
        params = {"temperature": 0.8, "ignore_eos": True}
        first = await asyncio.gather(
            *(
                engine.generate(
                    list(range(10 + i, 20 + 2 * i)), {**params, "max_new_tokens": 6 + 5 * i, "sampling_seed": i}
                )
                for i in range(12)
            )
        )
        second = await asyncio.gather(
            *(
                engine.generate(list(range(30, 130 + i)), {**params, "max_new_tokens": 70, "sampling_seed": 20 + i})
                for i in range(3)
            )
        )
        stats = await engine.settled_stats()
        await engine.close()
        return [o.output_ids for o in (*first, *second)], stats

    plain, _ = asyncio.run(run(False))
    turns.clear()
    overlapped, stats = asyncio.run(run(True))
    assert overlapped == plain
    assert violations == [] and not uncollected
    assert stats["decode_rounds_ahead"] > 0.5 * stats["decode_rounds"] and stats["kv_allocations"] >= 2
    with pytest.raises(ValueError, match="the rows' tokens or the launch"):
        original_launch(None, None, None, [], [], [], None)  # neither the tokens nor their launch


def test_a_launch_behind_another_checks_its_token_sources_on_the_host():
    """Rows' sources index the previous launch's last tokens (4 rows) then the joined ones: an
    index out of range would be a device-side assert on CUDA, so it is a ValueError first."""
    last = torch.arange(8).view(2, 4)  # [steps, bucket]: the tokens at its last step are 4..7
    previous = (None, 4, (last, None), 0)
    joined = torch.tensor([40, 41])
    assert DecodeGraphs._token_sources(previous, 3, [2, -1, 0], joined) == ([2, 4, 0], joined)
    assert DecodeGraphs._token_sources(previous, 2, [3, 1], joined) == ([3, 1], None)  # none joined
    assert DecodeGraphs._token_sources(previous, 2, [-2, -1], joined)[0] == [5, 4]
    for sources, tokens, match in [
        (None, joined, "one source per running row"),
        ([0, 1], joined, "one source per running row"),
        ([0, -3, 1], joined, "need 3 joined tokens"),
        ([0, -1, 1], None, "need 1 joined tokens"),
        ([0, 4, 1], joined, "beyond the launch's 4 rows"),
    ]:
        with pytest.raises(ValueError, match=match):
            DecodeGraphs._token_sources(previous, 3, sources, tokens)


def test_requests_admitted_behind_a_queued_round_get_the_tokens_of_the_engine_without_overlap(tokenizer, monkeypatch):
    """Fourteen requests queued at once for four rows, budgets of 5 to 31 tokens, so rows finish
    while the next round is queued: with ``decode_overlap`` the waiting requests are prefilled
    behind it, and the round after takes their first tokens from their prefill and the others'
    from that round, both on the device. Among them a GRPO pair (one prefill), a prompt extending a
    running row's (its KV read from that row), then a second turn of every first-wave request
    while a long row runs (the prefix cache), and a prompt wider than the store (admitted only
    once the queued round is collected: the store grows). Sampled at temperature 8 with seeds, so wrong keys,
    a wrong input token or a wrong seeded count change the tokens: they and their
    log-probabilities equal the engine's without overlap, and nothing is captured, dropped or
    re-allocated while a round is queued."""
    model = build("llama", vocab_size=tokenizer.vocab_size)
    uncollected, violations, turns = guard_queued_rounds(monkeypatch)
    base = list(range(40, 70))

    async def run(overlap: bool):
        engine = EmbeddedEngine(
            copy.deepcopy(model), max_batch_size=4, decode_graphs=True, decode_steps=4, decode_overlap=overlap
        )
        params = {"temperature": 8.0, "ignore_eos": True}
        prompts = [list(range(10 + i, 22 + 3 * i)) for i in range(10)]
        prompts[5] = prompts[4]  # a GRPO pair
        prompts += [base, base + [7, 8, 9], base[:20] + [5, 6], list(range(100, 140))]
        budgets = [5 + (7 * i) % 27 for i in range(len(prompts))]
        budgets[10] = 31  # the row whose prompt the next two extend runs long
        first = await admitted_together(
            engine,
            [
                engine.generate(p, {**params, "max_new_tokens": n, "sampling_seed": i})
                for i, (p, n) in enumerate(zip(prompts, budgets, strict=True))
            ],
        )
        long = asyncio.ensure_future(
            engine.generate(list(range(200, 230)), {**params, "max_new_tokens": 60, "sampling_seed": 99})
        )
        order = []  # which of the wide and the long request finished first
        long.add_done_callback(lambda _: order.append("long"))
        second, wide = [], None
        for i, (p, o) in enumerate(zip(prompts, first, strict=True)):  # one by one, while the long row runs
            second.append(
                await engine.generate(
                    p + o.output_ids + [3, 4], {**params, "max_new_tokens": 9, "sampling_seed": 50 + i}
                )
            )
            if i == 0:  # a prompt wider than the store holds, while the long row runs
                wide = asyncio.ensure_future(
                    engine.generate(list(range(10, 250)), {**params, "max_new_tokens": 6, "sampling_seed": 77})
                )
                wide.add_done_callback(lambda _: order.append("wide"))
        outs = [*first, *second, await wide, await long]
        stats = await engine.settled_stats()
        await engine.close()
        assert order == ["wide", "long"]  # the wide prompt did not wait for the long row's end
        return [o.output_ids for o in outs], [o.output_logprobs for o in outs], stats

    plain_tokens, plain_logprobs, plain = asyncio.run(run(False))
    turns.clear()
    tokens, logprobs, stats = asyncio.run(run(True))
    assert tokens == plain_tokens
    for a, b in zip(logprobs, plain_logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=1e-4)
    assert violations == [] and not uncollected
    assert plain.get("admissions_behind", 0) == 0 and stats["admissions_behind"] >= 5
    assert stats["cached_tokens"] == plain["cached_tokens"] > 0


def test_an_error_in_a_prefill_behind_a_queued_round_fails_its_requests_and_the_engine_goes_on(tokenizer):
    """Out of memory in the prefill of a request admitted behind a queued round: that request and
    the rows running end with the engine error (none waits forever), and the engine then serves
    requests exactly as an engine that never failed."""
    model = build("llama", vocab_size=tokenizer.vocab_size)
    params = {"temperature": 8.0, "ignore_eos": True, "sampling_seed": 3}

    async def run(fail: bool):
        engine = EmbeddedEngine(
            copy.deepcopy(model), max_batch_size=2, decode_graphs=True, decode_steps=4, decode_overlap=True
        )
        prefill_rows, admit_behind, failures, behind = engine._prefill_rows, engine._admit_behind, [], []

        def failing(*args):
            if fail and behind and not failures:
                failures.append(1)
                raise RuntimeError("out of memory")
            return prefill_rows(*args)

        def admitting_behind():  # a round is queued
            behind.append(1)
            try:
                return admit_behind()
            finally:
                behind.pop()

        engine._prefill_rows, engine._admit_behind = failing, admitting_behind
        budgets = (30, 5, 12)  # the third waits for the second's row
        outs = await admitted_together(
            engine,
            [
                engine.generate(list(range(10 + i, 30 + i)), {**params, "max_new_tokens": n})
                for i, n in enumerate(budgets)
            ],
        )
        after = await engine.generate(list(range(50, 70)), {**params, "max_new_tokens": 9})
        await engine.close()
        return outs, after, failures

    outs, after, failures = asyncio.run(run(True))
    _, reference, _ = asyncio.run(run(False))
    assert failures == [1]
    assert outs[1].finish_reason["type"] == "length"  # finished before the failing admission
    for output in (outs[0], outs[2]):
        assert output.aborted and "engine error: RuntimeError: out of memory" in output.finish_reason["message"]
    assert after.output_ids == reference.output_ids and after.output_logprobs == reference.output_logprobs


@pytest.mark.parametrize("where", ["queued launch", "after a replay"])
def test_an_error_in_a_built_step_s_launch_fails_the_rows_and_keeps_the_graphs(tokenizer, monkeypatch, where):
    """Out of memory in the launch of a step already built (a queued round's token gather, or
    anything after a replay, whose steps masked their columns in): not a step CUDA cannot
    capture, so the graphs stay on (before, they were turned off for the engine's life). The
    running rows end with the engine error, the store goes with the columns the replay masked
    in, and the engine then serves requests with its graphs exactly as an engine that never
    failed."""
    model = build("llama", vocab_size=tokenizer.vocab_size)
    params = {"temperature": 8.0, "ignore_eos": True, "sampling_seed": 3}
    take_tokens, launch_sample, failures = DecodeGraphs._take_tokens.__func__, DecodeGraphs.launch_sample, []

    def fail_once():
        if not failures:
            failures.append(1)
            raise torch.OutOfMemoryError("out of memory (simulated)")

    def gathering(cls, *args):
        fail_once()
        return take_tokens(cls, *args)

    launches = []

    def launching(self, *args, **kwargs):
        launched = launch_sample(self, *args, **kwargs)
        launches.append(1)
        if len(launches) > 1:  # not the first launch, which built the step
            fail_once()
        return launched

    async def run(fail: bool):
        failures[:] = [] if fail else [0]
        engine = EmbeddedEngine(copy.deepcopy(model), decode_graphs=True, decode_steps=4, decode_overlap=True)
        return await three_rows_then_one(engine, params)

    if where == "queued launch":
        monkeypatch.setattr(DecodeGraphs, "_take_tokens", classmethod(gathering))
    else:
        monkeypatch.setattr(DecodeGraphs, "launch_sample", launching)
    outs, after, stats, graphs = asyncio.run(run(True))
    failed = list(failures)
    _, reference, _, _ = asyncio.run(run(False))
    assert failed == [1]
    for output in outs:
        assert output.aborted and "engine error: OutOfMemoryError" in output.finish_reason["message"]
    assert graphs is not None and stats.get("decode_graphs_failed", 0) == 0 and stats["decode_rounds"] > 0
    assert after.output_ids == reference.output_ids and after.output_logprobs == reference.output_logprobs


def test_a_prefill_behind_a_queued_round_reads_nothing_from_the_device(tokenizer, monkeypatch):
    """The CPU's stand-in for the GPU test's sync debug mode: while a request is admitted behind a
    queued round, its first tokens sampled included (the next round reads them on the device, the
    host after that round's launch), no tensor is read on the host (``tolist``,
    ``item``, ``cpu``, ``bool``, ``nonzero``), indexed with a Python list or built with
    ``torch.tensor(..., device=...)``; on CUDA each of those waits for the queued round (a list
    index and a pageable copy synchronise the stream). Copies of a prompt, prompts extending a
    running row's and cached turns are admitted behind; a top-k request and one asking for its
    prompt's log-probs wait for the round instead (their reads would wait), and every token equals
    the engine's without overlap."""
    model = build("llama", vocab_size=tokenizer.vocab_size)
    strict, reads = [], []

    def guarded(name, original):
        def call(*args, **kwargs):
            index = args[1] if name == "__getitem__" else None
            listed = any(isinstance(part, list) for part in (index if isinstance(index, tuple) else (index,)))
            if strict and (name not in ("__getitem__", "tensor") or listed or kwargs.get("device") is not None):
                reads.append(name)
            return original(*args, **kwargs)

        return call

    for name in ("tolist", "item", "cpu", "__bool__", "nonzero", "__getitem__"):
        monkeypatch.setattr(torch.Tensor, name, guarded(name, getattr(torch.Tensor, name)))
    monkeypatch.setattr(torch, "tensor", guarded("tensor", torch.tensor))

    async def run(overlap: bool):
        engine = EmbeddedEngine(
            copy.deepcopy(model), max_batch_size=4, decode_graphs=True, decode_steps=4, decode_overlap=overlap
        )
        admit_behind = engine._admit_behind

        def admitting_behind():  # its first tokens are read later, after the next round's launch
            strict.append(1)
            try:
                return admit_behind()
            finally:
                strict.pop()

        engine._admit_behind = admitting_behind
        params = {"temperature": 8.0, "ignore_eos": True}
        base = list(range(40, 70))
        prompts = [base, list(range(10, 30)), list(range(100, 125)), list(range(170, 190))]
        prompts += [base + [1, 2], base + [1, 2], base + [3], list(range(130, 150)), list(range(150, 170))]
        options = [{}] * len(prompts)
        options[7] = {"top_k": 5}  # the top-k request; the last asks for its prompt's log-probs
        budgets = [40, 8, 8, 20, 10, 10, 10, 10, 10]  # two rows end together: the copies join behind together
        outs = await admitted_together(
            engine,
            [
                engine.generate(
                    p,
                    {**params, **option, "max_new_tokens": budget, "sampling_seed": i},
                    logprob_start_len=0 if i == 8 else -1,
                )
                for i, (p, option, budget) in enumerate(zip(prompts, options, budgets, strict=True))
            ],
        )
        stats = await engine.settled_stats()
        await engine.close()
        return [o.output_ids for o in outs], [o.input_logprobs for o in outs], stats

    plain_tokens, plain_inputs, _ = asyncio.run(run(False))
    tokens, inputs, stats = asyncio.run(run(True))
    assert reads == [] and stats["admissions_behind"] >= 2  # the copies together, then the third turn
    assert tokens == plain_tokens and inputs == plain_inputs and inputs[8]


def test_a_prefill_behind_a_queued_round_counts_as_admission_not_decode(tokenizer):
    """A prefill behind a queued round runs inside the decode loop; its time goes to
    ``time_admit_ms`` and not also to ``time_decode_ms``: with each such prefill slowed by 0.2 s,
    the two times still sum to at most the batch's wall time."""
    import time

    model = build("llama", vocab_size=tokenizer.vocab_size)

    async def run():
        engine = EmbeddedEngine(
            copy.deepcopy(model), max_batch_size=2, decode_graphs=True, decode_steps=4, decode_overlap=True
        )
        admit = engine._admit

        def slow(behind=False):
            if behind:
                time.sleep(0.2)
            return admit(behind)

        engine._admit = slow
        greedy = {"temperature": 0.0, "ignore_eos": True}
        start = time.perf_counter()
        await admitted_together(
            engine,
            [
                engine.generate(list(range(10 + i, 30 + i)), {**greedy, "max_new_tokens": n})
                for i, n in enumerate((30, 6, 9))
            ],
        )
        wall = time.perf_counter() - start
        stats = await engine.settled_stats()
        await engine.close()
        return stats, wall

    stats, wall = asyncio.run(run())
    assert stats["admissions_behind"] >= 1 and stats["time_admit_ms"] >= 200
    assert stats["time_admit_ms"] + stats["time_decode_ms"] <= 1000 * wall


def test_a_request_queued_before_a_pause_is_not_admitted_behind_the_queued_round(tokenizer):
    """A request waits and ``pause("abort")`` is sent while a round is queued and the one before
    it is handed out: the pause comes first, as without overlap, so the request stays queued
    (not admitted behind the round and aborted with the running row) and decodes after resume."""
    import threading

    model = build("llama", vocab_size=tokenizer.vocab_size)

    async def run():
        engine = EmbeddedEngine(
            copy.deepcopy(model), max_batch_size=2, decode_graphs=True, decode_steps=4, decode_overlap=True
        )
        hand_out, blocked, go = engine._hand_out, threading.Event(), threading.Event()

        def held(*args):  # the second round's hand-out waits (the third is queued by then)
            if engine.stats["decode_rounds_ahead"] and not go.is_set():
                blocked.set()
                go.wait(30)
            return hand_out(*args)

        engine._hand_out = held
        greedy = {"temperature": 0.0, "ignore_eos": True}
        first = asyncio.ensure_future(engine.generate(list(range(10, 30)), {**greedy, "max_new_tokens": 200}))
        await asyncio.to_thread(blocked.wait, 30)
        second = asyncio.ensure_future(engine.generate(list(range(40, 60)), {**greedy, "max_new_tokens": 8}))
        while len(engine._waiting) < 1:
            await asyncio.sleep(0.005)
        pause = asyncio.ensure_future(engine.pause("abort"))
        while not engine._commands:
            await asyncio.sleep(0.005)
        go.set()
        await pause
        waiting = len(engine._waiting)
        await engine.resume()
        outs = await asyncio.gather(first, second)
        stats = await engine.settled_stats()
        await engine.close()
        return outs, waiting, stats

    (first, second), waiting, stats = asyncio.run(run())
    assert first.aborted and first.finish_reason["message"] == "paused"
    assert waiting == 1 and second.finish_reason["type"] == "length" and len(second.output_ids) == 8
    assert stats.get("admissions_behind", 0) == 0


def test_an_overlapped_round_clears_a_stopped_row_s_columns_in_its_own_slot(tokenizer, monkeypatch):
    """Four rows (budgets 30, 11, 7, 30), four steps a round, each round launched before the last
    one's hand-out: the 7-token row stops in round 2 and the last row moves into its slot; the
    11-token row stops in round 3, whose launch lists the rows in their old order, so its place
    in that list is not its slot (checked). The columns it gives back must be cleared in its own
    slot, not in the moved row's: every row's tokens equal the plain engine's."""
    model = build("llama", vocab_size=tokenizer.vocab_size)
    reordered = []  # decode rounds' hand-outs whose rows are not in slot order
    original = EmbeddedEngine._hand_out

    def hand_out(self, reqs, *args):
        reordered.append([id(r) for r in reqs] != [id(r) for r in self._running])
        return original(self, reqs, *args)

    monkeypatch.setattr(EmbeddedEngine, "_hand_out", hand_out)

    async def run(overlap: bool):
        engine = EmbeddedEngine(copy.deepcopy(model), decode_graphs=True, decode_steps=4, decode_overlap=overlap)
        greedy = {"temperature": 0, "ignore_eos": True}
        requests = [
            engine.generate(list(range(10 + i, 24 + 3 * i)), {**greedy, "max_new_tokens": n})
            for i, n in enumerate((30, 11, 7, 30))
        ]
        outs = await admitted_together(engine, requests)
        await engine.close()
        return [o.output_ids for o in outs]

    tokens = asyncio.run(run(False))
    reordered.clear()
    overlapped_tokens = asyncio.run(run(True))
    assert any(reordered)  # the case this test is about happened
    assert overlapped_tokens == tokens


def test_a_request_whose_event_loop_closed_does_not_stop_the_others(tokenizer):
    """A requester's event loop closes while its request runs (its ``asyncio.run`` ended): the
    request's answer goes nowhere, and the rows finishing in the same round, the windowed
    engine's tokens, still get theirs (an error settling one had left the others unsettled)."""
    import threading

    model = build("llama", vocab_size=tokenizer.vocab_size)
    greedy = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
    prompts = [list(range(10, 10 + n)) for n in (12, 8)]

    async def main(overlap: bool):
        engine = EmbeddedEngine(copy.deepcopy(model), decode_graphs=True, decode_steps=4, decode_overlap=overlap)
        await engine.pause("in_place")
        other = asyncio.new_event_loop()
        thread = threading.Thread(target=other.run_forever)
        thread.start()
        asyncio.run_coroutine_threadsafe(engine.generate(list(range(10, 40)), greedy), other)
        while len(engine._waiting) < 1:
            await asyncio.sleep(0.005)
        other.call_soon_threadsafe(other.stop)
        thread.join()
        other.close()
        tasks = [asyncio.ensure_future(engine.generate(p, greedy)) for p in prompts]
        while len(engine._waiting) < 3:
            await asyncio.sleep(0.005)
        await engine.resume()
        outs = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        await engine.close()
        return [o.output_ids for o in outs], [o.finish_reason["type"] for o in outs]

    async def alone():
        engine = EmbeddedEngine(copy.deepcopy(model))
        outs = [await engine.generate(p, greedy) for p in prompts]
        await engine.close()
        return [o.output_ids for o in outs]

    expected = asyncio.run(alone())
    for overlap in (False, True):
        assert asyncio.run(main(overlap)) == (expected, ["length", "length"])


def test_decode_graphs_need_the_lean_decoder():
    with pytest.raises(ValueError, match="lean decoder"):
        EmbeddedEngine(build("llama"), lean=False, decode_graphs=True)
    with pytest.raises(ValueError, match="decode_compile needs decode_graphs"):
        EmbeddedEngine(build("llama"), decode_graphs=False, decode_compile=True)
    engine = EmbeddedEngine(build("llama"))  # on the CPU the default is the windowed decode
    assert engine._graphs is None
    asyncio.run(engine.close())


def test_a_step_that_cannot_be_captured_falls_back_to_the_windowed_decode(tokenizer, monkeypatch):
    """A capture error (raised while a step is built) turns the graphs off with a warning; the
    request still gets the windowed engine's tokens."""
    model = build("llama", vocab_size=tokenizer.vocab_size)

    def fail(self, *args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    async def run(decode_graphs: bool):
        engine = EmbeddedEngine(model, decode_graphs=decode_graphs)
        out = await engine.generate(list(range(10, 30)), {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True})
        await engine.close()
        return out.output_ids, engine

    expected, _ = asyncio.run(run(False))
    monkeypatch.setattr(DecodeGraphs, "_warm_up_and_capture", fail)  # in the step's build
    with pytest.warns(UserWarning, match="decode_graphs turned off, the decode runs windowed: operation not permitted"):
        got, engine = asyncio.run(run(True))
    assert got == expected
    assert engine._graphs is None and engine.stats["decode_graphs_failed"] == 1


def test_a_step_that_fails_to_compile_goes_on_uncompiled(tokenizer):
    """A compile error (here a backend that raises, as Inductor can on a GPU it does not know)
    turns the compilation off with a warning, not the graphs: the request gets the windowed
    engine's tokens and the next steps go through the uncompiled graphs."""
    model = build("llama", vocab_size=tokenizer.vocab_size)

    def failing_backend(graph_module, example_inputs):
        raise RuntimeError("no compiler for this device")

    async def run(**options):
        engine = EmbeddedEngine(model, **options)
        greedy = {"temperature": 0.0, "max_new_tokens": 9, "ignore_eos": True}
        outs = [await engine.generate(list(range(10, 10 + n)), greedy) for n in (20, 7)]
        await engine.close()
        return [out.output_ids for out in outs], engine

    expected, _ = asyncio.run(run(decode_graphs=False))
    with pytest.warns(UserWarning, match="decode_compile turned off, the decode graphs go on uncompiled"):
        got, engine = asyncio.run(run(decode_graphs=True, decode_steps=4, decode_compile=failing_backend))
    assert got == expected
    assert engine._graphs is not None and engine._graphs.compile_backend is None
    assert engine.stats["decode_compile_failed"] == 1 and engine.stats["decode_graphs_failed"] == 0
    assert engine.stats["decode_rounds"] < engine.stats["decode_steps"]  # four steps per replay after it


def test_a_sampling_that_fails_to_compile_runs_eagerly_in_the_compiled_step(tokenizer):
    """A compile error in the sampling alone (as Inductor's scan over the vocabulary gave on the
    H100 with torch 2.11) leaves the decode step compiled and the sampling eager, with a warning:
    greedy and seeded tokens and log-probabilities equal the windowed engine's."""
    model = build("llama", vocab_size=tokenizer.vocab_size)
    compiled = []

    def backend(graph_module, example_inputs):
        if any(node.target == "argmax" for node in graph_module.graph.nodes):
            raise RuntimeError("no code for this reduction")
        compiled.append(graph_module)
        return aot_eager(graph_module, example_inputs)

    async def run(**options):
        engine = EmbeddedEngine(copy.deepcopy(model), **options)
        prompts = [list(range(10, 10 + n)) for n in (20, 7, 13)]
        outs = await asyncio.gather(
            *(engine.generate(p, {"temperature": 0.0, "max_new_tokens": 9, "ignore_eos": True}) for p in prompts),
            *(engine.generate(p, {"temperature": 0.8, "max_new_tokens": 9, "sampling_seed": 3}) for p in prompts),
        )
        await engine.close()
        return [o.output_ids for o in outs], [o.output_logprobs for o in outs], engine

    tokens, logprobs, _ = asyncio.run(run(decode_graphs=False))
    with pytest.warns(UserWarning, match="the sampling's compilation failed, it runs eagerly in the compiled step"):
        got_tokens, got_logprobs, engine = asyncio.run(run(decode_graphs=True, decode_steps=4, decode_compile=backend))
    assert got_tokens == tokens
    for a, b in zip(got_logprobs, logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=1e-4)
    assert engine.stats["decode_compile_failed"] == 0 and engine._graphs.compile_backend is backend
    assert isinstance(engine._graphs._sample_rows.error, torch._dynamo.exc.BackendCompilerFailed)
    assert len(compiled) == 1  # the decode step, once


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("steps", [0, 3])
def test_the_captured_steps_read_no_host_data(kind, steps):
    """What a CUDA graph captures must not read device data on the host (a synchronisation, which
    capture refuses) nor take a shape from it: on the meta device, which has no data, any such read
    raises. Both steps run there: the logits step (0) and three decode steps with their sampling."""
    model = build(kind).to("meta")
    decoder = LeanDecoder(model)
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    store = _KVStore(config.num_hidden_layers, config.num_key_value_heads, head_dim, torch.float32, "meta")
    store.reserve(8, 0, 32)
    store.slots, store.lo, store.hi = 5, 0, 10
    step = DecodeGraphs(decoder, capture=False)._build(store, 8, steps)
    outputs = step.run()
    assert all(t.device.type == "meta" for t in outputs)
    if steps:
        tokens, logprobs = outputs
        assert tokens.shape == logprobs.shape == (steps, 8) and tokens.dtype == torch.long
    else:
        assert outputs[0].shape == (8, config.vocab_size)


@torch.no_grad()
def test_building_a_step_leaves_the_mask_as_it_was():
    """Building a step warms it up (two runs, what precedes a capture on CUDA), which writes and
    masks in the columns its steps use; the mask must come back as it was, or the first replay
    attends to the warm-up's keys in the columns after its own (the engine tests at four steps
    fail without the restore). Keys and values outside those columns are untouched."""
    model = build("llama")
    store = new_store(model, 8, 64)
    store.slots, store.lo, store.hi = 5, 0, 10
    store.mask[:5, :10] = torch.rand(5, 10, generator=torch.Generator().manual_seed(0)) < 0.7
    mask, keys = store.mask.clone(), [k.clone() for k in store.keys]
    graphs = DecodeGraphs(LeanDecoder(model), capture=False)
    for steps in (0, 3):
        graphs._build(store, 8, steps)
        assert torch.equal(store.mask, mask)
        for before, after in zip(keys, store.keys, strict=True):
            assert torch.equal(before[:, :, :10], after[:, :, :10]) and torch.equal(before[:, :, 13:], after[:, :, 13:])
    assert graphs.capture_seconds > 0 and graphs.captures == 0


def test_a_warm_up_that_fails_midway_leaves_the_mask_as_it_was():
    """A warm-up run that fails after its first step (out of memory in the second step's sampling)
    has masked in the first step's column: the mask comes back as it was all the same, or the
    step built next (the uncompiled one, after a compiled step failed) would save and restore
    that column masked in, and its first replay would attend to the failed run's keys."""
    model = build("llama")
    store = new_store(model, 8, 64)
    store.slots, store.lo, store.hi = 5, 0, 10
    store.mask[:5, :10] = True
    mask = store.mask.clone()
    graphs = DecodeGraphs(LeanDecoder(model), capture=False)
    sample_rows, calls = graphs._sample_rows, []

    def failing(*args):
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("out of memory (simulated)")
        return sample_rows(*args)

    graphs._sample_rows = failing
    with pytest.raises(torch.OutOfMemoryError):
        graphs._build(store, 8, 3)
    assert len(calls) == 2 and torch.equal(store.mask, mask)


def test_a_store_reallocation_frees_the_old_buffers_the_steps_read():
    """The built steps hold views of the store's buffers; when the store grows they are dropped
    first, so the old buffers are freed before the new ones are allocated (otherwise the engine
    briefly holds both stores: out of memory on a GPU where either fits)."""
    model = build("llama")

    async def main():
        engine = EmbeddedEngine(model, decode_graphs=True, decode_steps=4)
        await engine.generate([5, 6, 7], {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True})
        store, steps = engine._store, len(engine._graphs._steps)
        old = weakref.ref(store.pairs[0])
        store.reserve(store.slots, 0, store.capacity[1] + 64)  # engine idle: grows the columns
        gc.collect()
        await engine.close()
        return steps, old, engine._graphs._steps

    built, old, after = asyncio.run(main())
    assert built > 0 and old() is None and after == {}


def test_four_steps_per_round_stop_at_the_context_and_length_limits(tokenizer):
    """Requests whose context or token budget ends inside a chunk of four steps: the chunk is cut
    to the context's end (no position past it), length limits drop the extra tokens; tokens,
    log-probs and finish reasons equal the windowed engine's."""
    model = build("llama", vocab_size=tokenizer.vocab_size)

    async def run(decode_graphs: bool):
        engine = EmbeddedEngine(model, context_length=48, decode_graphs=decode_graphs, decode_steps=4)
        greedy = {"temperature": 0.0, "ignore_eos": True}
        outs = await asyncio.gather(
            engine.generate(list(range(10, 41)), {**greedy, "max_new_tokens": 100}),  # the context ends first
            engine.generate(list(range(20, 26)), {**greedy, "max_new_tokens": 7}),  # 7 = one chunk and 3 of the next
            engine.generate(list(range(30, 33)), {**greedy, "max_new_tokens": 2}),
        )
        await engine.close()
        return outs, engine.stats

    fixed, fixed_stats = asyncio.run(run(True))
    window, _ = asyncio.run(run(False))
    for got, expected in zip(fixed, window, strict=True):
        assert got.output_ids == expected.output_ids and got.finish_reason == expected.finish_reason
        torch.testing.assert_close(torch.tensor(got.output_logprobs), torch.tensor(expected.output_logprobs))
    assert len(fixed[0].output_ids) == 48 - 31 and fixed[0].finish_reason["type"] == "length"
    assert [len(o.output_ids) for o in fixed[1:]] == [7, 2]
    assert fixed_stats["decode_rounds"] < fixed_stats["decode_steps"]


@pytest.mark.parametrize("kept_kv_bytes", [0, 1 << 30])
def test_rollouts_after_the_first_reuse_the_store_and_its_steps(tokenizer, monkeypatch, kept_kv_bytes):
    """Three rollouts of two-turn episodes, each followed by what a trainer does (release the
    memory, update the weights in place): with a store under ``kept_kv_bytes`` the buffers, the
    prefix cache's pool and the built steps survive, so the later rollouts allocate and build
    (capture, on CUDA) nothing; freed, each later rollout allocates each once, at the size the
    previous one needed. Tokens and log-probabilities equal those of a windowed engine built afresh
    with each rollout's weights (so no key cached under older weights is read)."""
    model = build("llama", vocab_size=tokenizer.vocab_size)
    updates = [
        {name: p.detach() * scale for name, p in model.named_parameters() if name.endswith("mlp.up_proj.weight")}
        for scale in (1.0, 1.02, 0.97)
    ]
    prompts = [list(range(10, 10 + n)) for n in (7, 19, 3, 30, 11)]
    params = {"temperature": 0.8, "max_new_tokens": 10, "ignore_eos": True}

    async def rollout(engine, seed: int):
        first = await asyncio.gather(
            *[engine.generate(p, {**params, "sampling_seed": seed + i}) for i, p in enumerate(prompts)]
        )
        turns = [p + o.output_ids + list(range(40, 65)) for p, o in zip(prompts, first, strict=True)]
        second = await asyncio.gather(
            *[engine.generate(t, {**params, "sampling_seed": seed + 10 + i}) for i, t in enumerate(turns)]
        )
        return [(o.output_ids, o.output_logprobs) for o in (*first, *second)]

    built = []
    original_build = DecodeGraphs._build
    monkeypatch.setattr(
        DecodeGraphs,
        "_build",
        lambda self, store, bucket, steps: built.append(bucket) or original_build(self, store, bucket, steps),
    )

    async def kept_engine():
        engine = EmbeddedEngine(
            build("llama", vocab_size=tokenizer.vocab_size),
            decode_graphs=True,
            decode_steps=4,
            kept_kv_bytes=kept_kv_bytes,
        )
        outs, allocations, builds, pools = [], [], [], []
        for index, update in enumerate(updates):
            await engine.update_weights(update)
            before = engine.stats["kv_allocations"], len(built), engine._prefix_cache.allocations
            outs.append(await rollout(engine, 100 * index))
            allocations.append(engine.stats["kv_allocations"] - before[0])
            builds.append(len(built) - before[1])
            pools.append((engine._prefix_cache.allocations - before[2], engine._prefix_cache.capacity))
            await engine.release_memory()
        await engine.close()
        return outs, allocations, builds, pools

    async def fresh_engine(update, seed):
        engine = EmbeddedEngine(build("llama", vocab_size=tokenizer.vocab_size))
        await engine.update_weights(update)
        out = await rollout(engine, seed)
        await engine.close()
        return out

    outs, allocations, builds, pools = asyncio.run(kept_engine())
    for index, update in enumerate(updates):
        expected = asyncio.run(fresh_engine(update, 100 * index))
        assert [tokens for tokens, _ in outs[index]] == [tokens for tokens, _ in expected]
        for (_, a), (_, b) in zip(outs[index], expected, strict=True):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=1e-4)
    assert allocations[0] >= 2 and builds[0] >= 2  # the second turn's longer window re-allocates
    assert pools[0][0] >= 2 and pools[1][1] == pools[2][1] == pools[0][1]  # the pool grew in the first
    if kept_kv_bytes:
        assert allocations[1:] == [0, 0] and builds[1:] == [0, 0]
        assert [count for count, _ in pools[1:]] == [0, 0]
    else:
        assert allocations[1:] == [1, 1] and all(count >= 1 for count in builds[1:])
        assert [count for count, _ in pools[1:]] == [1, 1]
