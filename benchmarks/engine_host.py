"""The embedded engine's host work around the model: admission and the end of a decode wave.

On a GPU the engine's host work is time the device waits for (``benchmarks/gpu.py``'s "rest ms
per round": 4.3 ms per round at 256 rows on an H100, 2026-11-28). This measures, on whatever
device, the two phases whose host cost grows with the rows and the cached prefixes, with a model
so small that its compute is negligible (a random Llama 64 x 2, SmolLM2's vocabulary size):

- **admission**: requests whose prompts are looked up in the prefix cache (a GRPO-like batch:
  ``--groups`` prompts of ``--prompt`` tokens, each ``--group`` times) and prefilled, per row;
- **wave end**: the rows of a wave finishing together (their KV kept in the prefix cache,
  their answers settled), per row, and the tensor operations that finishing dispatches (each
  one a kernel launch or more on a GPU).

The batch runs twice on one engine: the first fills the prefix cache with the answers, the
second is measured (its lookups search a full cache). Run the script at two revisions to compare
them; ``--repeat`` alternates nothing, it repeats the measured batch.

Run: ``python benchmarks/engine_host.py`` (``--rows 256 --new 128``).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rl2gem.devices import OperationCounter
from rl2gem.rollout import EmbeddedEngine


def tiny_model(device: str) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device).eval()


def measure(args) -> dict[str, list[float]]:
    model = tiny_model(args.device)
    engine = EmbeddedEngine(
        model, max_batch_size=args.rows, prefix_cache_tokens=args.cache_tokens, max_prefill_tokens=1 << 20
    )
    rng = np.random.default_rng(0)
    groups = [rng.integers(10, 49000, args.prompt).tolist() for _ in range(args.rows // args.group)]
    prompts = [prompt for prompt in groups for _ in range(args.group)]
    params = {"max_new_tokens": args.new, "temperature": 1.0, "ignore_eos": True}
    wave_end: list[tuple[int, float, int]] = []  # (rows, seconds, operations)
    finish_rows = engine._finish_rows

    def timed_finish(finished):
        with OperationCounter() as ops:
            start = time.perf_counter()
            finish_rows(finished)
            wave_end.append((len(finished), time.perf_counter() - start, ops.count))

    engine._finish_rows = timed_finish

    async def batch():
        await engine.pause("in_place")  # every row queued, then admitted in one prefill
        tasks = [asyncio.ensure_future(engine.generate(p, params)) for p in prompts]
        while len(engine._waiting) < len(prompts):
            await asyncio.sleep(0.001)
        await engine.resume()
        await asyncio.gather(*tasks)
        return await engine.settled_stats()

    results = {"admit ms per row": [], "wave end ms per row": [], "wave end ops": [], "cached tokens per row": []}
    asyncio.run(batch())  # fills the prefix cache
    for _ in range(args.repeat):
        before = asyncio.run(engine.settled_stats())
        wave_end.clear()
        after = asyncio.run(batch())
        rows = len(prompts)
        results["admit ms per row"].append((after["time_admit_ms"] - before["time_admit_ms"]) / rows)
        last = max(wave_end, key=lambda item: item[0])
        results["wave end ms per row"].append(1000 * last[1] / last[0])
        results["wave end ops"].append(last[2])
        results["cached tokens per row"].append((after["cached_tokens"] - before["cached_tokens"]) / rows)
    asyncio.run(engine.close())
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--group", type=int, default=8, help="requests per prompt")
    parser.add_argument("--prompt", type=int, default=100, help="prompt tokens")
    parser.add_argument("--new", type=int, default=16, help="new tokens per row")
    parser.add_argument("--cache-tokens", type=int, default=1 << 15, help="the engine's prefix_cache_tokens")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    results = measure(args)
    print(f"rows {args.rows}, groups of {args.group}, prompts {args.prompt} tokens, {args.new} new, {args.device}")
    print("| figure | median | min | max |\n|---|---:|---:|---:|")
    for name, values in results.items():
        print(f"| {name} | {statistics.median(values):.3f} | {min(values):.3f} | {max(values):.3f} |")


if __name__ == "__main__":
    main()
