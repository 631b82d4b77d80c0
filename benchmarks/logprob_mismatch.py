"""How far apart two bf16 implementations of one model put the log-probs of the same tokens.

``actor.old_logprobs=auto`` (:mod:`rl2gem.training.old_logprobs`) reuses the engine's log-probs
only if their mismatch KL to the trainer's (the mean k3 over action tokens) is within
``actor.old_logprobs_max_kl``. This measures, on the CPU, the mismatch that bf16 alone causes:
the model's per-token log-probs of real text (GSM8K test questions with an answer, in the chat
template) under

- bf16, ``eager`` attention: scores rounded to bf16 before an fp32 softmax, as the embedded
  engine's lean decoder computes them (``LeanDecoder._attend``);
- bf16, ``sdpa``: the fused kernel keeps the scores in fp32;
- fp32, ``eager``: the control (it equals the reference up to float rounding);

each against fp32 ``sdpa``, and the two bf16 ones against each other (what an engine and a
trainer with different kernels would see). ``d`` is the difference of the two log-probs of each
token; k3 is ``exp(-d) - 1 + d`` (Schulman, "Approximating KL divergence", 2020).

Prints a Markdown table; ``--quick`` is a smoke run (two texts, 32 tokens).
"""

from __future__ import annotations

import argparse

import torch
from rl2gem.envs.math import load_problems
from transformers import AutoModelForCausalLM, AutoTokenizer

from rl2gem.algorithms.losses import kl_estimate
from rl2gem.models import resolve_model

#: (name, attention implementation, dtype) of the rows; the first is the reference.
VARIANTS = (
    ("fp32 sdpa", "sdpa", torch.float32),
    ("bf16 eager", "eager", torch.bfloat16),
    ("bf16 sdpa", "sdpa", torch.bfloat16),
    ("fp32 eager", "eager", torch.float32),
)
#: (row, column) pairs of the table.
PAIRS = (
    ("bf16 eager", "fp32 sdpa"),
    ("bf16 sdpa", "fp32 sdpa"),
    ("bf16 eager", "bf16 sdpa"),
    ("fp32 eager", "fp32 sdpa"),
)


def texts(tokenizer, count: int, tokens: int) -> list[torch.Tensor]:
    """Token ids [1, <= tokens] of ``count`` GSM8K test questions with their answer."""
    chats = [
        [
            {"role": "user", "content": problem["question"]},
            {"role": "assistant", "content": f"Let me think step by step. The answer is {problem['answer']}."},
        ]
        for problem in load_problems("gsm8k", "test")[:count]
    ]
    return [
        tokenizer(tokenizer.apply_chat_template(c, tokenize=False), return_tensors="pt").input_ids[:, :tokens]
        for c in chats
    ]


@torch.no_grad()
def token_logprobs(path: str, attention: str, dtype: torch.dtype, sequences: list[torch.Tensor]) -> torch.Tensor:
    """Log-probs [T] float32 of every sequence's tokens after its first, concatenated."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attention).eval()
    out = []
    for ids in sequences:
        logits = model(input_ids=ids).logits[0, :-1].float()
        out.append(torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None]).flatten())
    return torch.cat(out)


def mismatch(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    """Mean k3 (nats), mean and largest ``|d|`` of ``d = a - b``."""
    d = (a - b).abs()
    return {"k3": float(kl_estimate(a, b, "k3").mean()), "mean": float(d.mean()), "max": float(d.max())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a built-in name or a folder")
    parser.add_argument("--texts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128, help="tokens per text (at most)")
    parser.add_argument("--quick", action="store_true", help="two texts of 32 tokens")
    args = parser.parse_args()
    if args.quick:
        args.texts, args.tokens = 2, 32
    path = resolve_model(args.model)
    sequences = texts(AutoTokenizer.from_pretrained(path), args.texts, args.tokens)
    logprobs = {name: token_logprobs(path, attention, dtype, sequences) for name, attention, dtype in VARIANTS}
    count = sum(ids.shape[1] - 1 for ids in sequences)
    print(f"\n{args.model}, {len(sequences)} texts, {count} tokens, CPU\n")
    print("| log-probs | against | mismatch KL (mean k3, nats) | mean abs difference | largest abs difference |")
    print("|---|---|---:|---:|---:|")
    for row, column in PAIRS:
        m = mismatch(logprobs[row], logprobs[column])
        print(f"| {row} | {column} | {m['k3']:.2e} | {m['mean']:.2e} | {m['max']:.2e} |")


if __name__ == "__main__":
    main()
