"""Random request streams through the embedded engine, for tests on the CPU
(``tests/rollout/test_engine_random_streams.py``) and on CUDA (``tests/test_gpu.py``), and the
guard of what must not happen while a decode round is queued (``decode_overlap``)."""

from __future__ import annotations

import asyncio
import copy
import random

import numpy as np
import torch
from tiny import tiny_family_model

from rl2gem.rollout import EmbeddedEngine
from rl2gem.rollout.engines.base import seeded_uniforms
from rl2gem.rollout.engines.cuda_graphs import DecodeGraphs
from rl2gem.rollout.engines.embedded import _KVStore

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
        logits = model(torch.tensor([prompt + tokens], device=model.device)).logits[0, -1].double().cpu()
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


def check_scenario(seed: int, sides: list[dict], guard: tuple[list, list, dict], device="cpu") -> dict[str, float]:
    """Run scenario ``seed`` on the windowed engine and on each of ``sides``; assert equal answers,
    and that nothing was captured, dropped or re-allocated while a round was queued (``guard``:
    :func:`guard_queued_rounds`'s lists: on CUDA the queued round would read freed memory);
    ``device``: where the model and the engines run. -> the sides' summed ``admissions_behind`` and ``decode_rounds_ahead``."""
    uncollected, violations, turns = guard
    sc = scenario(seed)
    model = tiny_family_model(sc["kind"], vocab_size=VOCAB, max_position_embeddings=512).to(device)
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


def guard_queued_rounds(monkeypatch) -> tuple[list, list, dict]:
    """Record what must not happen while a launched round is uncollected (on CUDA, maybe still
    running): a step built (captured), the graphs dropped, the store re-allocated, or two
    consecutive launches of one step using one staging set. -> (the uncollected launches, the
    violations, each step's last set: clear it between engines)."""
    uncollected, violations, turns = [], [], {}
    original_launch, original_collect = DecodeGraphs.launch_sample, DecodeGraphs.collect
    original_build, original_reset, original_reserve = DecodeGraphs._build, DecodeGraphs.reset, _KVStore.reserve

    def launch(self, *args, **kwargs):
        launched = original_launch(self, *args, **kwargs)
        step, _, _, turn = launched
        if turns.get(id(step), (None, 1 - turn))[1] == turn:
            violations.append("a step's consecutive launches used one set")
        turns[id(step)] = step, turn  # the step held: a step built after a reset gets another id
        uncollected.append(launched)
        return launched

    def collect(launched):
        uncollected.remove(launched)
        return original_collect(launched)

    def guarded(name, work):
        def call(self, *args, **kwargs):
            if uncollected:
                violations.append(name)
            return work(self, *args, **kwargs)

        return call

    def reserve(self, *args, **kwargs):
        before = self.capacity
        original_reserve(self, *args, **kwargs)
        # the store the graphs read (the prefill's own store, read by no graph, may grow)
        if uncollected and self.capacity != before and self.on_reallocate is not None:
            violations.append("reallocated")

    monkeypatch.setattr(DecodeGraphs, "launch_sample", launch)
    monkeypatch.setattr(DecodeGraphs, "collect", staticmethod(collect))
    monkeypatch.setattr(DecodeGraphs, "_build", guarded("built", original_build))
    monkeypatch.setattr(DecodeGraphs, "reset", guarded("reset", original_reset))
    monkeypatch.setattr(_KVStore, "reserve", reserve)
    return uncollected, violations, turns
