"""Random request streams through the embedded engine: with the fixed-shape decode step (eager on
the CPU), one to four steps per round, with and without ``decode_overlap`` (rounds queued one
ahead, requests admitted behind a queued round), against the windowed engine that samples on the
host. Each scenario draws requests (GRPO siblings, shared prefixes, second turns through the
prefix cache, stop tokens, streams, top-k, prompt log-probs, staggered arrivals), engine limits
(rows, prefill and cache budgets, a short context, a small prefix cache) and disturbances while
they run (an in-place pause, an abort, a cache flush, a memory release), then a weight update.
Nothing may build (capture) a step, drop the graphs or re-allocate the KV store while a round is
queued: on CUDA that round would read freed memory, which on the CPU, where a launch runs to its
end, no answer shows.

Every answer must equal the reference's: tokens, finish reasons, log-probabilities. The one
allowed difference is a sampled token whose seeded uniform falls within 1e-5 of the boundary
between two tokens of the cumulative distribution, checked by teacher forcing on the model: the
two engines' float32 logits differ by ~1e-6 (columns read in another order), which can move such
a boundary past the uniform; such a row is compared up to that token. Before this file, 450
scenarios of the same kind (3,150 engine runs) differed from the reference only that way, twice;
the soak's 150 scenarios (`-m soak`, about 3 minutes) not at all, and queued nothing unsafe.
The four scenarios run in CI (about 4 s) catch each of seven mutations of the overlap's
bookkeeping: a joined row's seeded count, a stopped row's tokens not dropped, joined rows' tokens
out of order, a stopped row's overrun, a request admitted behind a round whatever the store's
room, a round queued before its step is built, or without room in the store."""

from __future__ import annotations

import asyncio
import copy
import random

import numpy as np
import pytest
import torch
from test_cuda_graphs import guard_queued_rounds
from test_lean_decoder import build

from rl2gem.rollout import EmbeddedEngine
from rl2gem.rollout.engines.base import seeded_uniforms

VOCAB = 256  # a small vocabulary: stop tokens are met, and the random model's sampling is cheap
SIDES = [{"decode_graphs": True, "decode_steps": s, "decode_overlap": o} for s in (1, 3, 4) for o in (False, True)]
NEAR_TIE = 1e-5


def scenario(seed: int) -> dict:
    """One random scenario: requests, engine limits, disturbances."""
    rng = random.Random(seed)
    stops = rng.sample(range(VOCAB), rng.choice([0, 4, 12]))
    shared = [rng.sample(range(VOCAB), rng.randint(2, 60)) for _ in range(4)]
    requests = []
    for i in range(rng.randint(4, 22)):
        kind = rng.random()
        if kind < 0.3 and requests:  # a GRPO sibling
            prompt = list(rng.choice(requests)["prompt"])
        elif kind < 0.55:  # a shared system prompt, then the request's own tokens
            prompt = rng.choice(shared)[: rng.randint(1, 60)] + [
                rng.randrange(VOCAB) for _ in range(rng.randint(0, 20))
            ]
        else:
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 90))]
        params = {
            "temperature": rng.choice([0.0, 1.0, 8.0]),
            "max_new_tokens": rng.randint(1, 40),
            "sampling_seed": 1000 * seed + i,
            "ignore_eos": True,
        }
        if stops and rng.random() < 0.8:
            params["stop_token_ids"] = rng.sample(stops, rng.randint(1, len(stops)))
        if rng.random() < 0.06:
            params["top_k"] = rng.randint(2, 20)
        second = {
            "extra": [rng.randrange(VOCAB) for _ in range(rng.randint(1, 8))],
            "max_new_tokens": rng.randint(1, 30),
        }
        requests.append(
            {
                "prompt": prompt,
                "params": params,
                "delay": rng.choice([0, 0, 0, 0.001, 0.005, 0.02]),
                "stream": rng.random() < 0.15,
                "logprob_start_len": 0 if rng.random() < 0.05 else -1,
                "second": second if rng.random() < 0.6 else None,
            }
        )
    disturbances = ["pause", "abort", "flush", "release"]
    return {
        "requests": requests,
        "engine": {
            "max_batch_size": rng.choice([2, 3, 4, 6, 8, 16]),
            "prefix_cache_tokens": rng.choice([64, 512, 1 << 15]),
            "max_cached_tokens": rng.choice([1 << 17, 600, 1500]),
            "max_prefill_tokens": rng.choice([4096, 128, 300]),
            "context_length": rng.choice([None, None, 120, 200]),
            "kept_kv_bytes": rng.choice([None, 0]),
        },
        "disturb": [
            (rng.choice(disturbances), rng.choice([0, 0.002, 0.01, 0.03]), rng.randrange(len(requests)))
            for _ in range(rng.randint(0, 3))
        ],
        "update": rng.random() < 0.5,
        "kind": rng.choice(["llama", "llama", "qwen3"]),
    }


async def _one(engine, request: dict, prompt: list[int], params: dict, delay: float, rid: str | None = None):
    await asyncio.sleep(delay)
    if request["stream"]:
        items = [item async for item in engine.generate_stream(prompt, params, rid=rid)]
        assert [token for token, _ in items[:-1]] == items[-1].output_ids  # the stream's tokens are the answer's
        return items[-1]
    return await engine.generate(prompt, params, logprob_start_len=request["logprob_start_len"], rid=rid)


async def _disturb(engine, actions) -> None:
    for action, delay, target in actions:
        await asyncio.sleep(delay)
        if action == "pause":
            await engine.pause("in_place")
            await asyncio.sleep(0.005)
            await engine.resume()
        elif action == "abort":
            await engine.abort(f"r{target}")
        elif action == "flush":
            await engine.flush_cache()
        else:
            await engine.release_memory()


def _update(model) -> dict[str, torch.Tensor]:
    return {name: p.detach() * 1.01 for name, p in model.named_parameters() if name.endswith("mlp.up_proj.weight")}


async def _run(model, sc: dict, **options) -> tuple[list, dict]:
    """The scenario on one engine -> (``(answer or None (aborted, or no second turn), prompt,
    params, the weights were updated)`` per request: the first turns, the second turns, then six
    first turns again after a weight update (if any); the engine's stats)."""
    engine = EmbeddedEngine(copy.deepcopy(model), **sc["engine"], **options)
    requests, context = sc["requests"], sc["engine"]["context_length"]
    try:
        first = await asyncio.gather(
            *[_one(engine, r, r["prompt"], r["params"], r["delay"], f"r{i}") for i, r in enumerate(requests)],
            _disturb(engine, sc["disturb"]),
        )
        await engine.release_memory()
        first = [
            (None if o.aborted else o, r["prompt"], r["params"], False)
            for r, o in zip(requests, first[:-1], strict=True)
        ]
        second = []
        for r, (o, _, params, _) in zip(requests, first, strict=True):
            prompt = r["prompt"] + (o.output_ids if o else []) + (r["second"] or {}).get("extra", [])
            fits = context is None or len(prompt) < context
            if o is None or r["second"] is None or not fits:  # the same list on every engine
                second.append((asyncio.sleep(0), prompt, params))
                continue
            turn = {
                **params,
                "max_new_tokens": r["second"]["max_new_tokens"],
                "sampling_seed": params["sampling_seed"] + 7,
            }
            second.append((_one(engine, r, prompt, turn, 2 * r["delay"]), prompt, turn))
        answers = await asyncio.gather(*[work for work, _, _ in second])
        second = [(o, prompt, turn, False) for o, (_, prompt, turn) in zip(answers, second, strict=True)]
        if sc["update"]:
            await engine.update_weights(_update(model))
        third = await asyncio.gather(*[_one(engine, r, r["prompt"], r["params"], r["delay"]) for r in requests[:6]])
        third = [(o, r["prompt"], r["params"], sc["update"]) for r, o in zip(requests, third, strict=False)]
        stats = await engine.settled_stats()
    finally:
        await engine.close()
    return [*first, *second, *third], stats


def _boundary_gap(model, prompt: list[int], tokens: list[int], params: dict) -> float:
    """How far the seeded uniform of the token after ``tokens`` lies from the nearest boundary of
    the cumulative distribution (float64, by teacher forcing), relative to its total."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, -1].double()
    cumulative = torch.softmax(logits / params["temperature"], -1).cumsum(0)
    uniform = float(seeded_uniforms([params["sampling_seed"]], np.array([len(tokens)]))[0])
    return (cumulative - uniform).abs().min().item()


def _assert_same_answers(model, answers: list, reference: list, where: str) -> None:
    updated = copy.deepcopy(model)
    updated.load_state_dict(_update(model), strict=False)
    for i, ((a, prompt, params, after), (b, _, _, _)) in enumerate(zip(answers, reference, strict=True)):
        if a is None or b is None or a.aborted or b.aborted:  # aborted on one engine (timing), or no turn
            continue
        length = len(a.output_ids)
        if a.output_ids != b.output_ids:
            k = next((j for j, (x, y) in enumerate(zip(a.output_ids, b.output_ids, strict=False)) if x != y), None)
            assert k is not None, f"{where}, answer {i}: one is a prefix of the other"
            gap = _boundary_gap(updated if after else model, prompt, a.output_ids[:k], params)
            assert params["temperature"] > 0 and gap < NEAR_TIE, f"{where}, answer {i}: tokens differ at {k}"
            length = k
        else:
            assert a.finish_reason == b.finish_reason, f"{where}, answer {i}"
        torch.testing.assert_close(
            torch.tensor(a.output_logprobs[:length]), torch.tensor(b.output_logprobs[:length]), atol=1e-4, rtol=1e-4
        )
        if a.input_logprobs is not None and b.input_logprobs is not None:
            first, second = (
                torch.tensor(x[1:] if x and x[0] is None else x) for x in (a.input_logprobs, b.input_logprobs)
            )
            torch.testing.assert_close(first, second, atol=1e-4, rtol=1e-4)


def check_scenario(seed: int, sides: list[dict], guard: tuple[list, list, dict]) -> dict[str, float]:
    """Run scenario ``seed`` on the windowed engine and on each of ``sides``; assert equal answers,
    and that nothing was captured, dropped or re-allocated while a round was queued (``guard``:
    :func:`~test_cuda_graphs.guard_queued_rounds`'s lists, which on CUDA would be a round
    reading freed memory). -> the sides' summed ``admissions_behind`` and ``decode_rounds_ahead``."""
    uncollected, violations, turns = guard
    sc = scenario(seed)
    model = build(sc["kind"], vocab_size=VOCAB, max_position_embeddings=512)
    reference, _ = asyncio.run(_run(model, sc, decode_graphs=False))
    counts = {"admissions_behind": 0, "decode_rounds_ahead": 0}
    for side in sides:
        turns.clear()
        answers, stats = asyncio.run(_run(model, sc, **side))
        _assert_same_answers(model, answers, reference, f"scenario {seed} {side}")
        assert violations == [] and not uncollected, f"scenario {seed} {side}"
        for key in counts:
            counts[key] += stats.get(key, 0)
    return counts


@pytest.mark.parametrize("seed", [4, 5, 10, 11])
def test_random_request_streams_get_the_windowed_engine_s_answers(seed, monkeypatch):
    """Three scenarios at four steps per round with and without overlap, and at one step with;
    each queues rounds ahead and admits requests behind them."""
    counts = check_scenario(seed, [SIDES[4], SIDES[5], SIDES[1]], guard_queued_rounds(monkeypatch))
    assert counts["admissions_behind"] > 0 and counts["decode_rounds_ahead"] > 0


@pytest.mark.soak
def test_many_random_request_streams_get_the_windowed_engine_s_answers(monkeypatch):
    """150 scenarios (about 8 minutes), every side."""
    guard = guard_queued_rounds(monkeypatch)
    counts = [check_scenario(seed, SIDES, guard) for seed in range(1000, 1150)]
    assert sum(c["admissions_behind"] for c in counts) > 1000
