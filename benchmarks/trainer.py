"""Trainer throughput: rl2gem's PPO trainer vs TRL's GRPOTrainer, side by side in one run.

Same model (SmolLM2-135M-Instruct, fp32), same prompts (reasoning-gym ``basic_arithmetic``,
2 terms of 1-2 digits, "Answer with just the number."), same reward (the last number in the
reply equals the answer), group size 4, same number of prompts per step, same maximum new
tokens, one optimizer step per generation batch, Dr. GRPO advantages on both sides.

- rl2gem: ``torchrun --nproc_per_node=2 trainers/ppo.py`` (two ranks, one thread each, FSDP2 over
  gloo, the embedded continuous-batching engine).
- TRL: ``GRPOTrainer`` in one process with two threads (``bf16=False``: TRL's default bf16
  autocast runs about 8x slower on this CPU; ``gradient_checkpointing=False``, as ours: TRL turns
  it on by default, which recomputes every layer's forward in the backward), generation with
  ``model.generate``.

``--packings flat,tree`` runs our trainer once per packing (``actor.packing``: a flat row, or each
group's prefix tree with the shared prompt computed once); TRL has no such option.
``--lora R`` adds both sides with LoRA adapters of rank R (alpha 2R, every linear layer but the LM
head; ours ``actor.lora.*``, TRL ``peft_config``) after the full fine-tuning rows.

The first step of each side is a warm-up and is not counted. MFU counts 2N FLOPs per generated
or scored token and 6N per trained token (``rl2gem.training.metrics.train_flops`` on both sides;
neither side scores old log-probs in a pass of its own here) against ``--peak`` (the measured fp32
matmul peak of the machine's two cores; each of our two ranks gets half).
Mean response length (tokens) is printed for both sides, so that the episodes/s ratio can be read
against the work per episode. Peak memory is the resident set size: the largest over our two ranks
(each holds its shard, the optimizer states of its shard and the embedded engine's full copy), and
TRL's one process (each TRL run is a fresh child process, so its peak is its own).
Prints a Markdown table. ``--quick`` is a smoke run (tiny sizes).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"
TASK = dict(
    task="basic_arithmetic",
    min_terms=2,
    max_terms=2,
    min_digits=1,
    max_digits=2,
    operators=["+", "-"],
    allow_negation=False,
    allow_parentheses=False,
    answer="last_number",
)


def _mean(values) -> float:
    """The mean of the values that are not None (a step whose groups dynamic filtering all dropped
    logs no episode means); NaN when there are none."""
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else float("nan")


def ours(
    steps: int,
    prompts: int,
    group: int,
    max_new: int,
    out: Path,
    model: str = MODEL,
    lora: int = 0,
    packing: str = "flat",
    extra: list[str] | None = None,
    peak: float = 1.52e11,
) -> dict[str, float]:
    """Run the trainer for ``steps + 1`` steps (``extra``: more ``key=value`` overrides); seconds
    per step after the first, and the seconds of each phase of a step."""
    args = [f"env_kwargs.{k}={json.dumps(v) if isinstance(v, list) else v}" for k, v in TASK.items()]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(ROOT / "trainers" / "ppo.py"),
        "env=rl2/ReasoningGym-v0",
        f"actor.model={model}",
        *args,
        f"rollout.prompts_per_rollout={prompts}",
        f"rollout.responses_per_prompt={group}",
        f"rollout.max_new_tokens={max_new}",
        "rollout.temperature=1.0",
        "actor.lr=1e-6",
        "adv.estimator=drgrpo",
        f"trainer.total_steps={steps + 1}",
        "trainer.eval_at_start=false",
        "trainer.eval_n=2",
        "trainer.progress=false",
        f"trainer.output_dir={out}",
        f"actor.packing={packing}",
        f"trainer.peak_flops={peak / 2}",  # per rank: the two ranks share the machine's peak
        *([f"actor.lora.rank={lora}", f"actor.lora.alpha={2 * lora}"] if lora else []),
        *(extra or []),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode:
        raise RuntimeError(r.stdout[-2000:] + r.stderr[-4000:])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [x for x in rows if "time/step" in x][1:]
    sec = sum(x["time/step"] for x in rows) / len(rows)
    return {
        "seconds_per_step": sec,
        "episodes_per_second": prompts * group / sec,
        "mfu": sum(x["perf/mfu"] for x in rows) / len(rows),
        "reward": _mean(x.get("rollout/reward") for x in rows),
        "response_tokens": _mean(x.get("rollout/response_length") for x in rows),
        "peak_mib": max(x.get(f"memory/{phase}_peak_mib", 0.0) for x in rows for phase in PHASES),
        "phases": {phase: sum(x.get(f"time/{phase}", 0.0) for x in rows) / len(rows) for phase in TIMED},
    }


PHASES = ("rollout", "score", "update", "weight_sync")
TIMED = ("rollout", "old_logprobs", "update", "weight_sync")  # ``time/<phase>`` in our metrics


def trl_in_child(*args, **kw) -> dict[str, float]:
    """:func:`trl` in a fresh process (its own peak memory); the child's result."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(trl, *args, **kw).result()


def trl(
    steps: int, prompts: int, group: int, max_new: int, out: Path, peak: float, model_name: str = MODEL, lora: int = 0
) -> dict[str, float]:
    """TRL GRPOTrainer on the same prompts and reward; seconds per step after the first."""
    import resource

    import torch
    from datasets import Dataset
    from rl2gem.envs.reasoning_gym import last_number
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import rl2gem
    from rl2gem.models import load_model
    from rl2gem.training.metrics import train_flops

    torch.set_num_threads(2)
    env = rl2gem.make("rl2/ReasoningGym-v0", split="train", **TASK).unwrapped
    rows = []
    for i in range((steps + 1) * prompts):
        obs, _ = env.reset(options={"index": i})
        rows.append({"prompt": [{"role": "user", "content": obs}], "answer": str(env.item["answer"])})
    data = Dataset.from_list(rows)

    def reward(completions, answer, **_):
        return [float(last_number(c[-1]["content"]) == a) for c, a in zip(completions, answer, strict=True)]

    model, tokenizer = load_model(model_name, dtype=torch.float32)
    tokenizer.padding_side = "left"
    cfg = GRPOConfig(
        output_dir=str(out),
        max_steps=steps + 1,
        per_device_train_batch_size=prompts * group,
        num_generations=group,
        gradient_accumulation_steps=1,
        max_completion_length=max_new,
        temperature=1.0,
        learning_rate=1e-6,
        beta=0.0,
        loss_type="dr_grpo",
        scale_rewards="none",
        bf16=False,
        use_cpu=True,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        shuffle_dataset=False,
        seed=0,
        gradient_checkpointing=False,  # TRL's default is on; ours is off (actor.gradient_checkpointing)
    )
    stamps: list[float] = []
    tokens: list[int] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            stamps.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                tokens.append(logs["completions/mean_length"])

    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=lora, lora_alpha=2 * lora, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=cfg,
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[Clock()],
        peft_config=peft_config,
    )
    trainer.train()
    times = [b - a for a, b in itertools.pairwise(stamps)]
    sec = sum(times) / len(times)
    n = sum(p.numel() for p in model.parameters())
    prompt_ids = [
        tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False)
        for r in rows
    ]
    prompt_len = sum(map(len, prompt_ids)) / len(rows)
    completion = sum(tokens[1:]) / max(len(tokens[1:]), 1) if len(tokens) > 1 else max_new
    per_step = prompts * group * (prompt_len + completion)
    # generation and the update, as ours counts them: with one update per generation batch and
    # beta=0 TRL runs no old-log-prob nor reference pass (grpo_trainer: old_per_token_logps None)
    flops = train_flops(n, generated_tokens=prompts * group * completion, train_tokens=per_step)
    rewards = [x["reward"] for x in trainer.state.log_history if "reward" in x][1:]
    return {
        "seconds_per_step": sec,
        "episodes_per_second": prompts * group / sec,
        "mfu": flops / sec / peak,
        "reward": sum(rewards) / max(len(rewards), 1),
        "response_tokens": completion,
        "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # Linux: KiB
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    ap.add_argument("--steps", type=int, default=4, help="measured steps per side (after one warm-up step)")
    ap.add_argument("--prompts", type=int, default=8, help="prompts (GRPO groups) per step")
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--peak", type=float, default=1.52e11, help="fp32 matmul peak, FLOP/s")
    ap.add_argument("--only", default="rl2gem,trl")
    ap.add_argument("--model", default=MODEL, help="a model name or folder (the smoke test passes a tiny random one)")
    ap.add_argument("--lora", type=int, default=0, help="> 0: also both sides with LoRA adapters of this rank")
    ap.add_argument("--packings", default="flat,tree", help="our trainer's actor.packing values (LoRA: the last)")
    ap.add_argument("--ours-args", default="", help="more key=value overrides of our trainer, space-separated")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.prompts, args.max_new = 1, 2, 8
    only = set(args.only.split(","))
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        for lora in (0, args.lora) if args.lora else (0,):
            tag = f" + LoRA r={lora}" if lora else ""
            packings = args.packings.split(",")
            for packing in packings[-1:] if lora else packings:
                if "rl2gem" in only:
                    res[f"rl2gem PPO trainer (2 ranks, FSDP2, embedded engine, {packing} packing){tag}"] = ours(
                        args.steps, args.prompts, args.group, args.max_new, Path(tmp) / f"ours{lora}{packing}",
                        args.model, lora, packing, args.ours_args.split(), args.peak,
                    )  # fmt: skip
            if "trl" in only:
                res[f"TRL GRPOTrainer (1 process, 2 threads, bf16=False){tag}"] = trl_in_child(
                    args.steps, args.prompts, args.group, args.max_new, Path(tmp) / f"trl{lora}", args.peak,
                    args.model, lora,
                )  # fmt: skip
    print(
        f"# trainer throughput: {args.model} fp32, {args.prompts} prompts x {args.group} samples per step, "
        f"max_new_tokens {args.max_new}, {args.steps} measured steps\n"
    )
    base = next(iter(res.values()))["episodes_per_second"] if res else 1.0
    print(
        "| trainer | seconds/step | episodes/s | mean response tokens | MFU | mean reward "
        "| peak RSS MiB (ours: the largest of 2 ranks) "
        "| episodes/s vs first |\n|---|---:|---:|---:|---:|---:|---:|---:|"
    )
    for name, r in res.items():
        print(
            f"| {name} | {r['seconds_per_step']:.1f} | {r['episodes_per_second']:.2f} | {r['response_tokens']:.1f} "
            f"| {r['mfu']:.2f} | {r['reward']:.3f} | {r['peak_mib']:.0f} | {r['episodes_per_second'] / base:.2f}x |"
        )
    ours_rows = {name: r for name, r in res.items() if "phases" in r}
    if ours_rows:
        print("\nOur step by phase (seconds, mean of the measured steps):\n")
        print("| trainer | " + " | ".join(TIMED) + " | other |\n|---|" + "---:|" * (len(TIMED) + 1))
        for name, r in ours_rows.items():
            other = r["seconds_per_step"] - sum(r["phases"].values())
            print(f"| {name} | " + " | ".join(f"{r['phases'][k]:.2f}" for k in TIMED) + f" | {other:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
