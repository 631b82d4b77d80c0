"""Prefix-tree packing against flat packing: tokens computed and forward/backward time, side by side.

The sequences are real rollout samples of SmolLM2-135M-Instruct (fp32, the embedded engine,
temperature 1.0): ``--prompts`` GRPO groups of ``--group`` samples on GSM8K (one turn, a short
prompt) and on SearchQA (multi-turn: searches answered with 3 passages, so prompts grow with
every turn). Each side plans the same samples into micro-batches of at most ``--max-tokens``
tokens (flat: :func:`rl2gem.parallel.packing.plan`; tree: :func:`~rl2gem.parallel.packing.plan_tree`)
and runs what a PPO step runs per micro-batch: a no-grad forward for the old log-probs, then a
forward and backward of a loss on the log-probs. The first row attends over the whole packed row
(SDPA with the ``[N, N]`` mask); the others run SDPA per block of queries over the keys they see
(each sequence, or a run of tree tokens over its ancestors: :mod:`rl2gem.parallel.block_attention`,
what the trainers' models use). The last row
runs the tree with the LM head only at the positions that predict an action token
(``token_logprobs(..., needed=masks)``, what the PPO trainer does): prompt and env tokens get no
logits. The rows' log-probs at the action tokens are
compared (the largest difference is printed: equal up to float rounding). Times are the best of
``--repeats``.

Prints a Markdown table per env; ``--quick`` is a smoke run (tiny sizes).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import time

import torch

import rl2gem
from rl2gem.models import load_model, resolve_model
from rl2gem.parallel.block_attention import enable_block_attention
from rl2gem.parallel.packing import tree_size
from rl2gem.rollout import EmbeddedEngine, Rollout, RolloutConfig
from rl2gem.training import plan_micro_batches, token_logprobs
from rl2gem.training.samples import samples_from_batch

ENVS = {
    "GSM8K": ("rl2/GSM8K-v0", {}, 1),
    "SearchQA": ("rl2/SearchQA-v0", {"topk": 3, "max_turns": 3}, 3),
}


def rollout_sequences(model, tokenizer, env: str, kwargs: dict, prompts: int, group: int, max_new: int):
    """Token ids and action masks of the training sequences of ``prompts`` groups of ``group`` episodes."""

    async def run():
        engine = EmbeddedEngine(model, tokenizer, seed=0)
        config = RolloutConfig(
            responses_per_prompt=group, max_new_tokens=max_new, max_length=4096, temperature=1.0, seed=1
        )
        rollout = Rollout(engine, tokenizer, env, config, env_kwargs=rl2gem.standard_kwargs(env, kwargs))
        batch = await rollout.collect(prompts)
        await rollout.close()
        await engine.close()
        return batch

    samples = samples_from_batch(asyncio.run(run()), "drgrpo")
    return [s.ids for s in samples], [s.mask for s in samples]


def step_time(model, sequences, max_tokens: int, tree: bool, repeats: int, masks=None):
    """Best-of-``repeats`` seconds of a no-grad forward then a forward+backward over the plan's
    micro-batches (``masks``: log-probs of the action tokens only); the tokens computed, the
    micro-batch count, and the log-probs (flat order)."""
    lengths = [len(s) for s in sequences]
    plan = plan_micro_batches(lengths, 0, 1, max_tokens, sequences=sequences if tree else None)
    computed = sum(
        tree_size([sequences[i] for i in mb.indices]) if tree else sum(lengths[i] for i in mb.indices) for mb in plan
    )
    best, logprobs = float("inf"), {}
    device = torch.device("cpu")
    for _ in range(repeats):
        start = time.perf_counter()
        for mb in plan:
            part = [sequences[i] for i in mb.indices]
            needed = None if masks is None else [masks[i] for i in mb.indices]
            with torch.no_grad():
                old = token_logprobs(model, part, device, tree=tree, needed=needed)[0]
            new = token_logprobs(model, part, device, tree=tree, needed=needed)[0]
            (new - old).exp().sum().backward()
            for i, chunk in zip(mb.indices, old.split([lengths[i] for i in mb.indices]), strict=True):
                logprobs[i] = chunk
        model.zero_grad(set_to_none=True)
        best = min(best, time.perf_counter() - start)
    return best, computed, len(plan), torch.cat([logprobs[i] for i in range(len(sequences))])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=4, help="GRPO groups")
    ap.add_argument("--group", type=int, default=8, help="samples per prompt")
    ap.add_argument("--max-new", type=int, default=64, help="new tokens per turn")
    ap.add_argument("--max-tokens", type=int, default=2048, help="tokens per micro-batch (flat or tree)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--envs", default="GSM8K,SearchQA")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.group, args.max_new, args.repeats, args.max_tokens = 2, 2, 8, 1, 512
    torch.manual_seed(0)
    model, tokenizer = load_model(resolve_model(args.model), dtype=torch.float32)
    model.train()
    blocked = copy.deepcopy(model)
    enable_block_attention(blocked)
    for name in args.envs.split(","):
        env, kwargs, turns = ENVS[name]
        sequences, masks = rollout_sequences(model, tokenizer, env, kwargs, args.prompts, args.group, args.max_new)
        flat_tokens = sum(len(s) for s in sequences)
        action = torch.tensor([bool(x) for m in masks for x in m])
        sides = {
            "flat, SDPA over the whole row": (model, False, None),
            "flat": (blocked, False, None),
            "prefix tree": (blocked, True, None),
            "prefix tree, head at action tokens": (blocked, True, masks),
        }
        rows = {
            label: step_time(side, sequences, args.max_tokens, tree, args.repeats, needed)
            for label, (side, tree, needed) in sides.items()
        }
        first = next(iter(rows.values()))
        difference = max(float((row[3] - first[3])[action].abs().max()) for row in rows.values())
        print(
            f"# {name} ({env}, up to {turns} turn(s)): {args.prompts} prompts x {args.group} samples, "
            f"{len(sequences)} sequences, {flat_tokens} tokens "
            f"({int(action.sum())} action tokens), max_new_tokens {args.max_new}, micro-batches of at most "
            f"{args.max_tokens} tokens; largest log-prob difference at action tokens {difference:.1e}\n"
        )
        print("| packing | tokens computed | micro-batches | seconds (old forward + forward/backward) | speed-up |")
        print("|---|---:|---:|---:|---:|")
        for label, (seconds, computed, batches, _) in rows.items():
            print(f"| {label} | {computed} | {batches} | {seconds:.2f} | {first[0] / seconds:.2f}x |")
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
