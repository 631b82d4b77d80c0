"""Rollout benchmarks on SmolLM2-135M-Instruct (CPU, fp32), each ratio measured side by side in one run.

0. decode: decode steps alone at 16 and 64 rows, ``model.generate`` vs the embedded engine
   through ``model(...)`` and through its lean forward (tokens/s of the decode loop).
1. engine: the embedded continuous-batching engine (``--in-flight`` sequences in
   flight, 128 by default, the rest queued; also 64) vs ``model.generate`` static
   batching (batches of 16, 64 and ``--in-flight``) on the same 128 GSM8K prompts, same sampling (temperature 1, same
   max_new_tokens); generated tokens/second, counting each completion up to and
   including its EOS.
2. router: the same requests through sglang-router over 1 vs 2 embedded
   servers (``python -m rl2gem.serve``); with 2 cores, 1 server gets 2 torch
   threads and 2 servers get 1 each.
3. tokens: a multi-turn game rolled out once; tokens the trainer is fed with
   prefix merging (one sequence per episode) vs re-rendering every turn as a
   new sequence (prompt-so-far + action per turn).
4. partial: GSM8K with max_new_tokens 1024 (most answers take 100-300 tokens,
   the rambling ones run to the limit: a long tail); wall time of ``steps``
   rollout steps of ``groups`` groups with and without partial rollouts
   (partial: the step ends when its groups are done, stragglers carry over to
   the next step; the work still in flight after the last step is not counted
   as returned episodes, so the episodes/s column charges it to partial).

Run: ``python benchmarks/rollout.py`` (``--quick`` for a smoke run;
``--only engine,tokens`` to pick sections).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch

from rl2gem.models import load_model, resolve_model
from rl2gem.rollout import EmbeddedEngine, HTTPEngine, Rollout, RolloutConfig
from rl2gem.rollout.router import Router
from rl2gem.serving import launch

MODEL = "smollm2-135m-instruct"


def prompts_for(tokenizer, n: int) -> list[list[int]]:
    from rl2gem.envs.math import load_problems

    from rl2gem.rollout.tito import ChatRenderer

    r = ChatRenderer(tokenizer)
    out = [r.prompt_ids([{"role": "user", "content": p["question"]}]) for p in load_problems("gsm8k", "train")[:n]]
    return out


def count_until_eos(row: list[int], eos: int) -> int:
    return row.index(eos) + 1 if eos in row else len(row)


def sample_static(model, prompts: list[list[int]], eos: int, max_new: int, min_new: int = 0) -> torch.Tensor:
    """``model.generate`` on one left-padded batch, temperature 1, no top-k/top-p -> new tokens [n, <= max_new]."""
    width = max(map(len, prompts))
    ids = torch.tensor([[eos] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new,
            min_new_tokens=min_new,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            pad_token_id=eos,
            eos_token_id=eos,
        )
    return out[:, width:]


def static_generate(model, prompts, batch: int, max_new: int, eos: int, seed: int) -> tuple[int, float]:
    torch.manual_seed(seed)
    tokens, t0 = 0, time.perf_counter()
    for i in range(0, len(prompts), batch):
        out = sample_static(model, prompts[i : i + batch], eos, max_new)
        tokens += sum(count_until_eos(r, eos) for r in out.tolist())
    return tokens, time.perf_counter() - t0


async def engine_generate(engine, prompts, max_new: int) -> tuple[int, float]:
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(engine.generate(p, {"max_new_tokens": max_new, "temperature": 1.0}) for p in prompts))
    return sum(len(o.output_ids) for o in outs), time.perf_counter() - t0


def bench_engine(
    model, tokenizer, n: int, max_new: int, group: int = 1, in_flight: int = 128
) -> list[tuple[str, float, float]]:
    """Section 1: ``model.generate`` in static batches of 16, 64 and ``in_flight`` rows, then the
    engine with ``in_flight`` sequences in flight (``model(...)`` and lean forward) and, when
    ``in_flight`` is not 64, the lean forward with 64 in flight."""
    prompts = [p for p in prompts_for(tokenizer, n // group) for _ in range(group)]
    eos = tokenizer.eos_token_id
    rows = []
    for batch in sorted({16, min(64, n), in_flight}):
        tok, sec = static_generate(model, prompts, batch, max_new, eos, 0)
        rows.append((f"model.generate static batch {batch}", tok, sec))

    for lean, slots in sorted({(False, in_flight), (True, 64), (True, in_flight)}):

        async def run(lean=lean, slots=slots):
            eng = EmbeddedEngine(model, tokenizer, max_batch_size=slots, lean=lean)
            res = await engine_generate(eng, prompts, max_new)
            await eng.close()
            return res, eng.stats

        (tok, sec), stats = asyncio.run(run())
        forward = f"{'lean forward' if lean else 'model(...) forward'}, {slots} in flight"
        rows.append((f"rl2gem EmbeddedEngine, {forward}", tok, sec))
        print(
            f"- {forward}: prefill {stats['time_admit_ms'] / 1000:.1f} s for {stats['prefill_tokens']} tokens; "
            f"decode {stats['time_decode_ms'] / 1000:.1f} s for {stats['decode_steps']} steps at "
            f"{stats['decode_tokens'] / max(stats['decode_steps'], 1):.1f} rows on average "
            f"({1000 * stats['decode_tokens'] / max(stats['time_decode_ms'], 1):.1f} tok/s)"
        )
    print()
    return rows


def bench_decode(model, tokenizer, rows: int, steps: int) -> list[tuple[str, float, float]]:
    """Decode alone: ``rows`` GSM8K prompts, exactly ``steps`` new tokens each (EOS ignored).

    ``model.generate``: the time of ``steps + 1`` new tokens minus the time of 1 (its prefill and
    first token). Engine: its decode-loop time (forward, sampling, bookkeeping), from its counters.
    """
    prompts = prompts_for(tokenizer, rows)

    def generate(new: int) -> float:
        torch.manual_seed(0)
        t0 = time.perf_counter()
        sample_static(model, prompts, tokenizer.eos_token_id, new, min_new=new)
        return time.perf_counter() - t0

    out = [("`model.generate` (static batch)", rows * steps, generate(steps + 1) - generate(1))]
    for lean in (False, True):

        async def run(lean=lean):
            eng = EmbeddedEngine(model, tokenizer, max_batch_size=rows, lean=lean)
            params = {"max_new_tokens": steps + 1, "temperature": 1.0, "ignore_eos": True}
            await asyncio.gather(*(eng.generate(p, params) for p in prompts))
            await eng.close()
            return eng.stats

        stats = asyncio.run(run())
        forward = "lean forward" if lean else "model(...) forward"
        out.append((f"EmbeddedEngine, {forward}", stats["decode_tokens"], stats["time_decode_ms"] / 1000))
    return out


def bench_router(tokenizer, n: int, max_new: int, model: str = MODEL) -> list[tuple[str, float, float]]:
    prompts = prompts_for(tokenizer, n)
    rows = []
    for servers, threads in ((1, 2), (2, 1)):
        procs = [launch(model, threads=threads, seed=i) for i in range(servers)]
        try:
            with Router([p.url for p in procs], policy="round_robin") as router:

                async def run():
                    eng = HTTPEngine(router.url, workers=router.workers)
                    await engine_generate(eng, prompts[:2], 4)  # warm-up
                    res = await engine_generate(eng, prompts, max_new)
                    await eng.close()
                    return res

                tok, sec = asyncio.run(run())
        finally:
            for p in procs:
                p.stop()
        rows.append((f"{servers} server(s) x {threads} thread(s) behind sglang-router", tok, sec))
    return rows


def bench_tokens(model, tokenizer, groups: int, max_new: int) -> dict[str, float]:
    async def run():
        eng = EmbeddedEngine(model, tokenizer)
        cfg = RolloutConfig(responses_per_prompt=4, max_new_tokens=max_new, max_length=4096, seed=1)
        ro = Rollout(eng, tokenizer, "rl2/GuessTheNumber-v0", cfg)
        batch = await ro.collect(groups)
        await ro.close()
        await eng.close()
        return batch

    batch = asyncio.run(run())
    merged = rerender = 0
    for e in batch.episodes:
        for s in e.sequences:
            merged += len(s)
            # re-rendering each turn as its own sequence feeds the prefix again for every action
            i = 0
            while i < len(s):
                if s.action_mask[i]:
                    j = i
                    while j < len(s) and s.action_mask[j]:
                        j += 1
                    rerender += j  # prompt so far + this action
                    i = j
                else:
                    i += 1
    return {
        "episodes": len(batch.episodes),
        "turns": batch.metrics["rollout/turns"],
        "merged": merged,
        "rerender": rerender,
        "splits": batch.metrics["rollout/splits"],
    }


def bench_partial(model, tokenizer, steps: int, groups: int, max_new: int) -> list[tuple[str, list[float], int]]:
    rows = []
    for partial in (False, True):

        async def run(partial=partial):
            eng = EmbeddedEngine(model, tokenizer, seed=0)
            cfg = RolloutConfig(
                responses_per_prompt=4,
                max_new_tokens=max_new,
                partial_rollout=partial,
                partial_oversample=0.5 if partial else 0.0,
                max_staleness=2,
                seed=3,
            )
            ro = Rollout(eng, tokenizer, "rl2/GSM8K-v0", cfg)
            times, eps = [], 0
            for _ in range(steps):
                t0 = time.perf_counter()
                b = await ro.collect(groups)
                times.append(time.perf_counter() - t0)
                eps += len(b.episodes)
            await ro.close()
            await eng.close()
            return times, eps

        times, eps = asyncio.run(run())
        rows.append(("partial rollouts" if partial else "synchronous (wait for every episode)", times, eps))
    return rows


def throughput_table(what: str, ratio: str, rows: list[tuple[str, float, float]]) -> None:
    """Print ``(name, tokens, seconds)`` rows with tokens/s and the ratio to the first row."""
    base = rows[0][1] / rows[0][2]
    print(f"| {what} | tokens | seconds | tokens/s | {ratio} |\n|---|---:|---:|---:|---:|")
    for name, tok, sec in rows:
        print(f"| {name} | {tok} | {sec:.1f} | {tok / sec:.1f} | {tok / sec / base:.2f}x |")
    print()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    ap.add_argument("--only", default="decode,engine,router,tokens,partial")
    ap.add_argument("--model", default=MODEL, help="a model name or folder (the smoke test passes a tiny random one)")
    ap.add_argument(
        "--group", type=int, default=1, help="section 1: each prompt repeated this many times (a GRPO batch)"
    )
    ap.add_argument("--in-flight", type=int, default=128, help="section 1: the engine's max_batch_size")
    args = ap.parse_args(argv)
    only = set(args.only.split(","))
    q = args.quick
    model, tokenizer = load_model(resolve_model(args.model))
    print(f"# rollout benchmarks: {args.model}, CPU fp32, torch threads {torch.get_num_threads()}\n")
    if "decode" in only:
        rows_list, steps = ([4], 8) if q else ([16, 64], 128)
        for rows in rows_list:
            print(f"## 0. decode alone: {rows} GSM8K prompts, {steps} new tokens each, EOS ignored\n")
            throughput_table(f"decoder, {rows} rows", "vs model.generate", bench_decode(model, tokenizer, rows, steps))
    if "engine" in only:
        n, max_new = (8, 16) if q else (128, 256)
        shape = f"{n // args.group} GSM8K prompts x {args.group} samples" if args.group > 1 else f"{n} GSM8K prompts"
        print(f"## 1. generation throughput: {shape}, temperature 1, max_new_tokens {max_new}\n")
        rows = bench_engine(model, tokenizer, n, max_new, args.group, min(args.in_flight, n))
        throughput_table("engine", "vs static batch 16", rows)
    if "router" in only:
        n, max_new = (4, 8) if q else (64, 64)
        print(f"## 2. sglang-router (round_robin): {n} requests, max_new_tokens {max_new}\n")
        throughput_table("setup", "ratio", bench_router(tokenizer, n, max_new, args.model))
    if "tokens" in only:
        g, max_new = (1, 16) if q else (4, 64)
        r = bench_tokens(model, tokenizer, g, max_new)
        print(
            f"## 3. tokens fed to training, rl2/GuessTheNumber-v0, {r['episodes']} episodes, {r['turns']:.1f} turns on average\n"
        )
        print("| layout | tokens | ratio |\n|---|---:|---:|")
        print(f"| prefix merging (one sequence per episode, {r['splits']:.0f} splits) | {r['merged']} | 1.00x |")
        print(f"| re-render every turn as a new sequence | {r['rerender']} | {r['rerender'] / r['merged']:.2f}x |\n")
    if "partial" in only:
        steps, g, max_new = (2, 1, 16) if q else (4, 4, 1024)
        rows = bench_partial(model, tokenizer, steps, g, max_new)
        base = sum(rows[0][1])
        print(f"## 4. rollout wall time, rl2/GSM8K-v0, {steps} steps x {g} groups x 4, max_new_tokens {max_new}\n")
        print(
            "| mode | seconds per step (each) | total | median step | episodes/s | vs synchronous |\n|---|---|---:|---:|---:|---:|"
        )
        for name, times, eps in rows:
            each = ", ".join(f"{t:.1f}" for t in times)
            print(
                f"| {name} | {each} | {sum(times):.1f} | {statistics.median(times):.1f} | {eps / sum(times):.2f} | {base / sum(times):.2f}x |"
            )
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
