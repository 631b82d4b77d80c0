"""What FSDP2 costs at one rank under mixed precision (bf16 compute, float32 master weights).

At one rank FSDP2 only casts the float32 masters to bf16 for the compute and the gradients back to
float32, but each unit adds hooks around its forward and backward. The trainers wrap the whole model
as one unit there (:func:`rl2gem.parallel.fsdp.shard_model`'s ``layer_units=False``); before, every
decoder layer was a unit too. This times a forward and backward of a random Llama, side by side and
alternated, for:

- pure bf16 weights without FSDP (``actor.master_dtype=bfloat16``: what mixed precision adds to);
- FSDP2 mixed precision with every decoder layer a unit (before);
- FSDP2 mixed precision with the root the only unit (now).

It also prints each side's peak memory in one forward and backward, in bytes per parameter above
what was allocated before it (the float32 gradients it leaves are 4 of them with FSDP): the
root unit holds the whole bf16 copy and the bf16 gradients until the backward ends, which
:func:`rl2gem.parallel.fsdp.root_unit_fits` counts as 4 bytes per parameter more than layer units.
On CUDA the allocator's peak; on the CPU the profiler's memory timeline (tensors torch allocates).

The default model is small (hidden 64, 16 layers, 8 tokens) so that the time is the host's: the
hooks, not the math. On CUDA, ``--hidden 2048 --layers 16 --tokens 16384 --vocab 49152`` shows what is left of it
in a real step (the device is synchronised once per side and round, not per iteration).

    python benchmarks/fsdp_one_rank.py [--hidden 64] [--layers 16] [--tokens 8] [--vocab 256] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from rl2gem.parallel.fsdp import shard_model
from rl2gem.procs import free_port, run_main

SIDES = ("pure bf16, no FSDP", "FSDP2 mixed precision, layer units (before)", "FSDP2 mixed precision, root unit (now)")


def build(side: str, config: LlamaConfig, mesh, device: torch.device) -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    if side == SIDES[0]:
        return model.to(device, torch.bfloat16)
    shard_model(model.to(device), mesh, param_dtype=torch.bfloat16, layer_units=side == SIDES[1])
    return model


def time_side(model, ids: torch.Tensor, iterations: int) -> float:
    """Milliseconds per forward and backward (the device synchronised at the end)."""
    for _ in range(2):  # warm-up: FSDP's lazy init, kernel selection
        model(input_ids=ids).logits.float().sum().backward()
    if ids.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iterations):
        model(input_ids=ids).logits.float().sum().backward()
    if ids.is_cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iterations * 1e3


def peak_bytes(model, ids: torch.Tensor) -> int:
    """Peak bytes allocated above the start during one forward and backward (gradients dropped
    first, as after an optimizer step)."""
    model.zero_grad(set_to_none=True)
    if ids.is_cuda:
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        model(input_ids=ids).logits.float().sum().backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action, MemoryProfile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        model(input_ids=ids).logits.float().sum().backward()
    live = peak = 0
    for _, action, _, size in MemoryProfile(prof.profiler.kineto_results).timeline:
        live += size if action == Action.CREATE else -size if action == Action.DESTROY else 0
        peak = max(peak, live)
    return peak


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=20)
    args = parser.parse_args(argv)
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        mesh = init_device_mesh(device.type, (1,))
        heads = max(4, args.hidden // 64)
        config = LlamaConfig(
            vocab_size=args.vocab,
            hidden_size=args.hidden,
            intermediate_size=args.hidden * 4,
            num_hidden_layers=args.layers,
            num_attention_heads=heads,
            num_key_value_heads=max(2, heads // 4),
        )
        ids = torch.randint(0, config.vocab_size, (1, args.tokens), device=device)
        times: dict[str, list[float]] = {side: [] for side in SIDES}
        peaks: dict[str, int] = {}
        for _ in range(args.rounds):
            for side in SIDES:
                model = build(side, config, mesh, device)
                times[side].append(time_side(model, ids, args.iterations))
                if side not in peaks:
                    peaks[side] = peak_bytes(model, ids)
                parameters = sum(p.numel() for p in model.parameters())
                del model
        name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
        print(f"{name}, torch {torch.__version__}: Llama {args.hidden} x {args.layers}, {args.tokens} tokens,")
        print(f"best of {args.rounds} alternated rounds of {args.iterations} forwards and backwards\n")
        base = min(times[SIDES[0]])
        print("| side | ms per forward and backward | over pure bf16, ms | peak bytes per parameter |")
        print("|---|---:|---:|---:|")
        for side in SIDES:
            best = min(times[side])
            print(f"| {side} | {best:.2f} | {best - base:+.2f} | {peaks[side] / parameters:.2f} |")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    run_main(main)
