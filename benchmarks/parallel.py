"""What each parallel dim buys: FSDP vs ZigZag sequence parallelism vs tensor parallelism.

The same random-initialised Llama (the SmolLM2 family's shapes scaled down: 8 heads, 4 key/value
heads, vocabulary 49152) trains one forward and backward of a packed policy-gradient-style loss
(mean per-token log-prob) over the same global batch of ``batch`` sequences of length ``L``,
under four layouts run side by side:

* ``1 rank``: one process;
* ``fsdp 2``: two ranks, FSDP2, each rank one half of the sequences;
* ``sp 2``: two ranks, ZigZag ring attention, each rank half of every sequence's tokens;
* ``tp 2``: two ranks, tensor parallel (heads and MLP split, logits sharded over the vocabulary).

Per layout and length: tokens/s (global batch tokens per second of forward+backward, median of
``--repeats`` after a warm-up) and per-rank activation memory (on CPU: the bytes autograd saves
for the backward, counted by ``torch.autograd.graph.saved_tensors_hooks``, largest rank; on CUDA:
``max_memory_allocated``). Then the longest single sequence (lengths growing by 1.25x) whose
per-rank activation memory stays under ``--cap-mib``. Ratios are against ``fsdp 2`` (same ranks, same data).

The CPU ring attention is the pure-PyTorch twin (dense blocks, no kernel fusion), so on CPU the
``sp`` column shows memory, not speed; on CUDA with ``ring_flash_attn`` installed the flash kernels run.

Usage: ``python benchmarks/parallel.py [--quick] [--lengths 256,512,1024] [--cap-mib 256]``.
Workers: ``torchrun --nproc_per_node=N benchmarks/parallel.py --worker MODEL_DIR OUT.json key=value ...``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from rl2gem.procs import run_main

ROOT = Path(__file__).resolve().parents[1]
GROWTH = 1.25  # the longest-sequence search multiplies the length by this
LAYOUTS = [("1 rank", 1, {}), ("fsdp 2", 2, {}), ("sp 2", 2, {"sp_size": 2}), ("tp 2", 2, {"tp_size": 2})]


def make_model(folder: Path, quick: bool) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=128 if quick else 256,
        intermediate_size=344 if quick else 688,
        num_hidden_layers=2 if quick else 4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=65536,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(folder)


class SavedBytes:
    """Bytes of the distinct tensor storages autograd saves for the backward inside the block,
    parameters (and views of them) excluded: the activations."""

    def __init__(self):
        self.seen: set[int] = set()
        self.bytes = 0

    def pack(self, tensor):
        from torch.distributed.tensor import DTensor

        base = tensor._base if tensor._base is not None else tensor
        if isinstance(base, torch.nn.Parameter):
            return tensor
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        try:
            storage = local.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
        except RuntimeError:  # a wrapper without storage (an in-flight collective's result)
            key, size = id(local), local.numel() * local.element_size()
        if key not in self.seen:
            self.seen.add(key)
            self.bytes += size
        return tensor

    def __enter__(self):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)


def worker(model_dir: str, out: str, *options: str) -> None:
    """A torchrun rank: measures each of ``layouts`` (names of :data:`LAYOUTS`, all of this world
    size) in turn; rank 0 writes ``{name: {"rows", "longest"}}`` to ``out``."""
    import torch.distributed as dist

    from rl2gem.parallel.fsdp import init_distributed

    opts = dict(o.split("=", 1) for o in options)
    rank, world, device = init_distributed()
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    results = {}
    for name in opts["layouts"].split(","):  # one launch measures every layout of this world size
        extra = next(extra for layout, _, extra in LAYOUTS if layout == name)
        results[name] = measure_layout(model_dir, device, {**opts, **{k: str(v) for k, v in extra.items()}})
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def measure_layout(model_dir: str, device: torch.device, opts: dict[str, str]) -> dict:
    """One layout's rows (tokens/s and activation MiB per length) and longest single sequence."""
    import torch.distributed as dist

    from rl2gem.parallel.fsdp import load_sharded
    from rl2gem.parallel.mesh import build_mesh
    from rl2gem.training import plan_micro_batches, token_logprobs

    mesh = build_mesh(1, int(opts.get("tp_size", 1)), int(opts.get("sp_size", 1)))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = load_sharded(
        model_dir, mesh.data_mesh, device=device, dtype=dtype, tp_mesh=mesh.tp_mesh, sp_group=mesh.sp_group
    )
    batch, repeats, cap = int(opts["batch"]), int(opts["repeats"]), float(opts["cap_mib"]) * 2**20
    generator = torch.Generator().manual_seed(0)

    def step(length: int, backward: bool = True, count: int = batch) -> int:
        """One forward (+ backward) of this rank's share of ``count`` sequences; returns the
        activation bytes."""
        seqs = [torch.randint(3, 49000, (length,), generator=generator).tolist() for _ in range(count)]
        plan = plan_micro_batches([length] * count, mesh.dp_rank, mesh.dp_size, mesh.micro_batch_tokens(10**9))
        used = 0
        for mb in plan:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            with SavedBytes() as saved:
                logprobs, _ = token_logprobs(model, [seqs[i] for i in mb.indices], device)
            loss = -logprobs.mean() * mb.scale
            if device.type == "cuda":
                used = max(used, torch.cuda.max_memory_allocated())
            else:
                used = max(used, saved.bytes)
            if backward:
                loss.backward()
            del loss, logprobs
        model.zero_grad(set_to_none=True)
        return used

    rows = []
    for length in [int(n) for n in opts["lengths"].split(",")]:
        step(length)
        times, used = [], 0
        for _ in range(repeats):
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            used = max(used, step(length))
            if device.type == "cuda":
                torch.cuda.synchronize()
            dist.barrier()
            times.append(time.perf_counter() - start)
        peak = torch.tensor(float(used))
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        rows.append(
            {"length": length, "tokens_per_s": batch * length / statistics.median(times), "mib": float(peak) / 2**20}
        )
    longest, length = 0, int(opts["search_from"])
    while length <= int(opts["search_to"]):  # one sequence: what a single long rollout needs
        peak = torch.tensor(float(step(length, backward=False, count=1)))
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        if float(peak) > cap:
            break
        longest, length = length, max(length + 64, int(length * GROWTH) // 64 * 64)
        if float(peak) * length / longest > cap:  # activations grow at least linearly: the next cannot fit
            break
    return {"rows": rows, "longest": longest}


def run_layouts(model_dir: Path, nproc: int, names: list[str], args, out: Path) -> dict:
    """Measure the layouts ``names`` (each of ``nproc`` ranks) in one torchrun launch."""
    options = {
        "batch": args.batch,
        "repeats": args.repeats,
        "lengths": args.lengths,
        "cap_mib": args.cap_mib,
        "search_from": args.search_from,
        "search_to": args.search_to,
        "layouts": ",".join(names),
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(Path(__file__).resolve()),
        "--worker",
        str(model_dir),
        str(out),
        *[f"{k}={v}" for k, v in options.items()],
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc))}
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    parser.add_argument("--lengths", default=None, help="comma-separated sequence lengths")
    parser.add_argument("--batch", type=int, default=2, help="sequences in the global batch")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--cap-mib", type=float, default=None, help="per-rank activation memory cap")
    parser.add_argument("--search-from", type=int, default=None)
    parser.add_argument("--search-to", type=int, default=None)
    parser.add_argument(
        "--layouts", default=None, help="comma-separated subset of: " + ", ".join(n for n, _, _ in LAYOUTS)
    )
    parser.add_argument("--worker", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_main(lambda: worker(*args.worker))  # a torchrun rank
    args.lengths = args.lengths or ("64,128" if args.quick else "256,512,1024")
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.cap_mib = args.cap_mib or (40 if args.quick else 256)
    args.search_from = args.search_from or (64 if args.quick else 512)
    args.search_to = args.search_to or (1024 if args.quick else 8192)
    wanted = set(args.layouts.split(",")) if args.layouts else {n for n, _, _ in LAYOUTS}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        make_model(model_dir, args.quick)
        for nproc in sorted({nproc for _, nproc, _ in LAYOUTS}):
            names = [name for name, size, _ in LAYOUTS if size == nproc and name in wanted]
            if names:
                results |= run_layouts(model_dir, nproc, names, args, Path(tmp) / f"{nproc}.json")
    device = "CUDA" if torch.cuda.is_available() else "CPU (gloo, fp32)"
    memory = "max allocated" if torch.cuda.is_available() else "saved for backward"
    print(f"\n{device}, global batch {args.batch} sequences, forward + backward\n")
    base = results.get("fsdp 2")
    print(
        f"| layout | length | tokens/s | activation MiB per rank ({memory}) | tokens/s vs fsdp 2 | memory vs fsdp 2 |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name, result in results.items():
        for i, row in enumerate(result["rows"]):
            speed = f"{row['tokens_per_s'] / base['rows'][i]['tokens_per_s']:.2f}x" if base else "-"
            mem = f"{row['mib'] / base['rows'][i]['mib']:.2f}x" if base else "-"
            print(f"| {name} | {row['length']} | {row['tokens_per_s']:.0f} | {row['mib']:.1f} | {speed} | {mem} |")
    print(
        f"\nLongest single sequence (from {args.search_from}, x{GROWTH}) whose activations fit {args.cap_mib:g} MiB per rank:\n"
    )
    print("| layout | longest sequence | vs fsdp 2 |")
    print("|---|---:|---:|")
    for name, result in results.items():
        ratio = f"{result['longest'] / base['longest']:.2f}x" if base and base["longest"] else "-"
        print(f"| {name} | {result['longest']} | {ratio} |")


if __name__ == "__main__":
    main()
