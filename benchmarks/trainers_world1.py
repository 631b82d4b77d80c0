"""Every trainer at world size 1 on one device: the bf16 path on a GPU (fp32 on CPU).

A random-initialised Llama (``--hidden``, ``--layers``; 16 heads, 8 key/value heads) with
SmolLM2's tokenizer (``--tokenizer``, a folder) runs ``trainers/sft.py``, ``rm.py``, ``dpo.py``
(hand-made arithmetic conversations and preference pairs) and ``ppo.py`` (``rl2/GuessTheNumber-v0``, multi-turn,
the embedded engine) for ``--steps`` steps each, ``actor.dtype=auto`` (bfloat16 on CUDA). Prints
seconds per step after the first (``time/step``) and the trained tokens per second the trainer
logs. Nothing is downloaded.

Usage: ``python benchmarks/trainers_world1.py --tokenizer DIR [--hidden 1024 --layers 8 --steps 4]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def make_model(folder: Path, tokenizer: str, hidden: int, layers: int) -> None:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(tokenizer)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)


def make_data(folder: Path) -> tuple[Path, Path]:
    rng = random.Random(0)
    conversations, pairs = [], []
    for _ in range(64):
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        question = f"What is {a} + {b}? Show the sum of the two numbers and explain the steps."
        answer = f"{a} plus {b}: add the ones, carry, then add the tens. The answer is {a + b}."
        conversations.append({"prompt": question, "response": answer})
        pairs.append({"prompt": question, "chosen": answer, "rejected": answer.replace(str(a + b), str(a + b + 1))})
    sft, prefs = folder / "sft.jsonl", folder / "pairs.jsonl"
    sft.write_text("".join(json.dumps(r) + "\n" for r in conversations))
    prefs.write_text("".join(json.dumps(r) + "\n" for r in pairs))
    return sft, prefs


def run(name: str, args: list[str], out: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", *args]
    cmd += [f"trainer.output_dir={out}", "trainer.progress=false", "trainer.eval_at_start=false"]
    start = time.perf_counter()
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if result.returncode:
        if os.environ.get("RL2GEM_BENCH_FAILURES"):  # the whole tail, for a machine you cannot log into
            with open(os.environ["RL2GEM_BENCH_FAILURES"], "a") as log:
                log.write(f"==== {name}: {' '.join(args)}\n{result.stdout[-3000:]}\n{result.stderr[-12000:]}\n")
        errors = [line for line in (result.stderr + result.stdout).splitlines() if "Error:" in line]
        return {"trainer": name, "error": (errors[0] if errors else result.stderr[-500:])[-400:]}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "time/step" in r]
    seconds = [r["time/step"] for r in steps][1:]
    tokens = [r["perf/tokens_per_second"] for r in steps if "perf/tokens_per_second" in r][1:]
    loss_keys = [k for k in steps[-1] if k.endswith("loss")] if steps else []
    return {
        "trainer": name,
        "wall_s": wall,
        "step_s": statistics.median(seconds) if seconds else None,
        "tokens_per_s": statistics.median(tokens) if tokens else None,
        "loss": {k: steps[-1][k] for k in loss_keys[:2]},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", required=True, help="a folder with SmolLM2's tokenizer")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = tmp / "model"
        make_model(model, args.tokenizer, args.hidden, args.layers)
        sft, pairs = make_data(tmp)
        common = [f"actor.model={model}", f"trainer.total_steps={args.steps}", "actor.dtype=auto"]
        jobs = {
            "sft": ["trainers/sft.py", f"data.train={sft}", "data.batch_size=16", *common],
            "rm": ["trainers/rm.py", f"data.train={pairs}", "data.batch_size=16", *common],
            "dpo": ["trainers/dpo.py", f"data.train={pairs}", "data.batch_size=16", *common],
            "ppo": [
                "trainers/ppo.py",
                "env=rl2/GuessTheNumber-v0",
                "rollout.prompts_per_rollout=16",
                "rollout.responses_per_prompt=4",
                "rollout.max_new_tokens=64",
                "trainer.eval_n=8",
                *common,
            ],
        }
        rows = [run(name, job, tmp / name) for name, job in jobs.items()]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"\n{device}, world 1, random Llama hidden {args.hidden} x {args.layers} layers, {args.steps} steps\n")
    print("| trainer | wall s | s/step (after the first) | trained tokens/s | last losses |")
    print("|---|---:|---:|---:|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['trainer']} | failed | | | {r['error'][-300:]!r} |")
            continue
        step = f"{r['step_s']:.2f}" if r["step_s"] else "-"
        tok = f"{r['tokens_per_s']:.0f}" if r["tokens_per_s"] else "-"
        losses = ", ".join(f"{k}={v:.4g}" for k, v in r["loss"].items())
        print(f"| {r['trainer']} | {r['wall_s']:.1f} | {step} | {tok} | {losses} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
