"""The trainers and the engine on one device, side by side with plain PyTorch in the same run.

On whatever CUDA device is present (else the CPU, with a small model, fp32) this builds
random-initialised Llamas with SmolLM2's tokenizer (``--models``, ``HIDDENxLAYERS``; 16 heads,
8 key/value heads) and prints, per model, in the order sft, dpo, rm, decode, mask (with the first
model only), ppo (the longest and least predictable last):

1. **sft**: SFT tokens/s and MFU of ``trainers/sft.py`` (world size 1, the real data path:
   tokenised conversations, the micro-batch planner, FSDP2, ``actor.attention`` and
   ``actor.compile`` as given by ``--ours``) against a plain PyTorch loop on the same rows in the
   same order (the rows padded into one batch, SDPA, AdamW, the same masked token-mean NLL), on
   ``mixed`` rows (lengths spread over 200-2000 tokens) and ``long`` rows (all about 1,500 tokens;
   both times ``--scale``, a quarter on CPU).
   The first two steps of each side are warm-up (compilation included) and are not counted.
   **dpo** and **rm**: the same for ``trainers/dpo.py`` and ``trainers/rm.py`` on preference
   pairs (each side half a row's length, so a pair is about a row), against plain loops with
   their losses: DPO's sigmoid loss at beta 0.1 against the frozen initial model (its sequence
   log-probs computed the first time a pair is seen, as the trainer does), and the
   Bradley-Terry loss of a zero-initialised scalar head at each sequence's last token.
2. **ppo**: ``trainers/ppo.py`` seconds per step by phase (rollout, and of it the engine's
   prefills, decode and graph captures; old log-probs, update, weight sync) on ``config=arithmetic`` and on ``rl2/GuessTheNumber-v0`` (16 x 4 episodes; ``--ppo-groups``,
   2 on CPU), and what ``actor.old_logprobs=auto`` measured in its first step (the engine's
   log-probs against the trainer's: mismatch KL and largest difference) and chose after it.
3. **decode**: the embedded engine's decode tokens/s at 64 and 256 rows (``--rows``; 128 new tokens
   each, ``--new-tokens``, EOS ignored) against a warm ``model.generate`` on the same prompts, and
   the share of the engine's wall time the GPU runs kernels, with the kernels per decode step and
   their device time (``torch.profiler``; CUDA only): a step ms per round well above the kernel
   ms is the device waiting between kernels, not the host. The
   engine as trainers build it, then variants: on CUDA one decode step per graph replay
   (``decode_steps=1``), the captured step compiled by Inductor first (``decode_compile=True``),
   then without graphs (``decode_graphs=False``); on
   the CPU with the fixed-shape steps, four per round trip, run eagerly.

4. **mask**: FlexAttention's block mask for one packed row of 16k and 64k tokens (CPU: 4k and
   16k), built per tile as the trainers do against ``create_block_mask`` (every query-key pair):
   seconds and the peak memory each build adds.

MFU is ``6 P`` FLOPs per trained token (``P``: the parameters a token multiplies, the LM head's
included and the input embedding's not) over the peak that :func:`rl2gem.training.metrics.peak_flops_from_config`
prints (the datasheet's for a known GPU; on CPU a matmul measured once in this process), the same
``P`` and peak for both sides. Prints Markdown tables with the device, torch and
transformers versions. Nothing is downloaded; ``--tokenizer`` defaults to the built-in SmolLM2's.

Usage: ``python benchmarks/gpu.py [--models 1024x8,2048x16] [--sections sft,dpo,rm,ppo,decode,mask] [--steps 6]``
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import psutil
import torch
import transformers
from rl2gem.trainers.sft import tokenize
from trainers_world1 import make_model, run

from rl2gem.data import load_conversations, load_preferences
from rl2gem.models import resolve_model
from rl2gem.rollout.engines.embedded import EmbeddedEngine
from rl2gem.rollout.tito import ChatRenderer
from rl2gem.training.metrics import peak_flops_from_config
from rl2gem.training.offline import epoch_batch
from rl2gem.training.pairs import tokenize_pairs

WORDS = [
    "the",
    "model",
    "reads",
    "each",
    "token",
    "of",
    "the",
    "row",
    "and",
    "the",
    "answer",
    "follows",
    "from",
    "the",
    "steps",
    "written",
    "before",
    "it",
    "so",
    "a",
    "careful",
    "reader",
    "checks",
    "every",
    "number",
    "twice",
    "while",
    "the",
    "trainer",
    "updates",
    "its",
    "weights",
    "again",
]
BATCH = 16  # rows per optimizer step
FAILED: list[str] = []  # the runs that failed (main exits non-zero)


def make_rows(folder: Path, kind: str, scale: float = 1.0, count: int = 64, pairs: bool = False) -> Path:
    """``count`` conversations whose rendered length is about ``200..2000`` tokens (``mixed``) or
    about 1,500 (``long``), times ``scale``, as JSONL; ``pairs``: preference pairs instead, each
    side (chosen, rejected: two different texts) half that long, so a pair is about a row."""
    rng = random.Random(0)
    rows = []

    def text(target: float) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(max(8, int(target / 1.05) - 30)))

    for _ in range(count):
        target = scale * (rng.randint(200, 2000) if kind == "mixed" else rng.randint(1450, 1550))
        if pairs:
            rows.append({"prompt": "Continue the text.", "chosen": text(target / 2), "rejected": text(target / 2)})
        else:
            rows.append({"prompt": "Continue the text.", "response": text(target)})
    path = folder / f"{kind}{'-pairs' if pairs else ''}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def padded(samples, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``samples`` right-padded into one batch: token ids, attention mask and labels (``-100`` off
    each sample's mask), ``[B, W]`` on ``device``."""
    width = max(len(s) for s in samples)
    ids = torch.tensor([s.ids + [0] * (width - len(s)) for s in samples], device=device)
    labels = [[t if m else -100 for t, m in zip(s.ids, s.mask, strict=True)] for s in samples]
    labels = torch.tensor([row + [-100] * (width - len(row)) for row in labels], device=device)
    attention = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in samples], device=device)
    return ids, attention, labels


def token_nll(model, samples, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token NLL ``[B, W - 1]`` float32 of the masked tokens (0 elsewhere) and the mask."""
    ids, attention, labels = padded(samples, device)
    logits = model(input_ids=ids, attention_mask=attention, use_cache=False).logits.float()
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:], reduction="none")
    return nll, labels[:, 1:] != -100


def plain_sft(model, batch, device, state) -> torch.Tensor:
    """The masked token-mean NLL (as ``trainers/sft.py``)."""
    nll, mask = token_nll(model, batch, device)
    return nll.sum() / mask.sum()


def plain_dpo(model, batch, device, state) -> torch.Tensor:
    """DPO's sigmoid loss at beta 0.1 against the frozen initial model, whose sequence log-probs
    are computed the first time a pair is in a batch (as ``trainers/dpo.py``)."""
    sides = [sample for pair in batch for sample in (pair.chosen, pair.rejected)]
    missing = [i for i, pair in enumerate(batch) if id(pair) not in state["reference"]]
    if missing:
        with torch.no_grad():
            nll, _ = token_nll(state["frozen"], [sides[j] for i in missing for j in (2 * i, 2 * i + 1)], device)
        for i, value in zip(missing, (-nll.sum(-1)).view(-1, 2), strict=True):
            state["reference"][id(batch[i])] = value
    reference = torch.stack([state["reference"][id(pair)] for pair in batch])  # [P, 2]
    logps = (-token_nll(model, sides, device)[0].sum(-1)).view(-1, 2)
    margin = (logps[:, 0] - reference[:, 0]) - (logps[:, 1] - reference[:, 1])
    return -torch.nn.functional.logsigmoid(0.1 * margin).mean()


def plain_rm(model, batch, device, state) -> torch.Tensor:
    """The Bradley-Terry loss of a bias-free scalar head (zero at start) on the backbone's last
    hidden state at each sequence's last token that is not the pad token (transformers' sequence
    classifier pooling, as ``trainers/rm.py``)."""
    sides = [sample for pair in batch for sample in (pair.chosen, pair.rejected)]
    ids, attention, _ = padded(sides, device)
    hidden = model.model(input_ids=ids, attention_mask=attention, use_cache=False).last_hidden_state
    pad = model.config.pad_token_id
    last = [max(i for i, token in enumerate(s.ids) if token != pad) for s in sides]
    last = torch.tensor(last, device=device)
    scores = model.score(hidden[torch.arange(len(sides), device=device), last]).float().view(-1, 2)
    return -torch.nn.functional.logsigmoid(scores[:, 0] - scores[:, 1]).mean()


PLAIN = {"sft": plain_sft, "dpo": plain_dpo, "rm": plain_rm}
LOSS_KEY = {"sft": "train/loss", "dpo": "train/loss", "rm": "rm/loss"}


def plain_items(trainer: str, tokenizer, data: Path) -> list:
    """The trainer's items from ``data`` through its own tokenisation."""
    renderer = ChatRenderer(tokenizer)
    if trainer == "sft":
        return tokenize(renderer, load_conversations(str(data), "train"), 2048)
    return tokenize_pairs(renderer, load_preferences(str(data), "train"), 2048)


def plain_model(trainer: str, model_dir: Path, device: torch.device, dtype: torch.dtype):
    """The model a plain loop trains (and its frozen reference for DPO): SDPA attention."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    options = {"dtype": dtype, "attn_implementation": "sdpa"}
    if trainer == "rm":
        model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, **options).to(device)
        torch.nn.init.zeros_(model.score.weight)
        return model, {}
    model = AutoModelForCausalLM.from_pretrained(model_dir, **options).to(device)
    if trainer == "dpo":
        frozen = AutoModelForCausalLM.from_pretrained(model_dir, **options).to(device).eval().requires_grad_(False)
        return model, {"frozen": frozen, "reference": {}}
    return model, {}


def matmul_parameters(model) -> int:
    """The parameters a token multiplies: all but the input embedding (a lookup), the LM head
    counted even when tied to it (a reward model has none)."""
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight.data_ptr() == embedding.data_ptr()
    return sum(p.numel() for p in model.parameters()) - embedding.numel() + (head.weight.numel() if tied else 0)


def plain_loop(trainer: str, model_dir: Path, data: Path, steps: int, peak: float) -> dict:
    """The padded baseline of ``trainer`` (sft, dpo or rm): the trainer's items (same tokens, same
    order), one padded batch per step, SDPA, AdamW, the trainer's loss. Returns trained tokens/s,
    MFU and the last loss."""
    from transformers import AutoTokenizer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    items = plain_items(trainer, AutoTokenizer.from_pretrained(model_dir), data)
    model, state = plain_model(trainer, model_dir, device, dtype)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)  # as actor.weight_decay
    parameters = matmul_parameters(model)
    times, tokens, loss = [], [], None
    for step in range(steps):
        batch = [items[i] for i in epoch_batch(len(items), BATCH, 0, step)]
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = PLAIN[trainer](model, batch, device, state)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = float(loss.detach())  # synchronises
        times.append(time.perf_counter() - start)
        tokens.append(sum(len(item) for item in batch))
    counted = slice(2, None) if steps > 2 else slice(None)
    rate = sum(tokens[counted]) / sum(times[counted])
    del model, optimizer, state
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"tokens_per_s": rate, "mfu": 6 * parameters * rate / peak, "loss": loss, "parameters": parameters}


def offline_section(
    trainer: str,
    model_dir: Path,
    tmp: Path,
    steps: int,
    ours: list[str],
    peak: float,
    scale: float,
    kinds: Sequence[str] = ("mixed", "long"),
) -> None:
    """``trainers/<trainer>.py`` (sft, dpo or rm) against its plain padded loop on each of
    ``kinds`` of rows (mixed lengths, equal long ones)."""
    print(f"| {trainer} rows | side | tokens/s | MFU | vs plain loop | last loss |")
    print("|---|---|---:|---:|---:|---:|")
    for kind in kinds:
        data = make_rows(tmp, kind, scale, pairs=trainer != "sft")
        baseline = plain_loop(trainer, model_dir, data, steps, peak)
        print(
            f"| {kind} | plain padded loop | {baseline['tokens_per_s']:.0f} | {baseline['mfu']:.1%} | 1.00x |"
            f" {baseline['loss']:.6g} |",
            flush=True,
        )
        for index, variant in enumerate(ours):
            args = [
                f"trainers/{trainer}.py",
                f"actor.model={model_dir}",
                f"data.train={data}",
                f"data.batch_size={BATCH}",
                "data.max_length=2048",
                "actor.max_length_per_device=32768",
                "actor.lr=1e-5",
                f"trainer.total_steps={steps}",
                *variant.split(),
            ]
            out = tmp / f"{trainer}-{kind}-{index}"
            result = run(trainer, args, out)
            if "error" in result:
                FAILED.append(f"{trainer} {kind} {variant}")
                print(
                    f"| {kind} | rl2gem {trainer} {variant or 'defaults'} | failed: {result['error'][-200:]!r} | | | |"
                )
                continue
            rows = [json.loads(line) for line in (out / "metrics.jsonl").open()]
            rated = [r for r in rows if "perf/tokens_per_second" in r]
            counted = rated[2:] or rated  # past the first two steps (compilation) when there are more
            if not counted:
                raise RuntimeError(f"{out / 'metrics.jsonl'} has no perf/tokens_per_second row")
            # total tokens over total time, as the plain loop's (a median of per-step rates is another measure)
            seconds = sum(r["time/step"] for r in counted)
            rate = sum(r["perf/tokens_per_second"] * r["time/step"] for r in counted) / seconds
            mfu = 6 * baseline["parameters"] * rate / peak  # the same model and peak as the plain loop's
            loss = counted[-1].get(LOSS_KEY[trainer], float("nan"))
            print(
                f"| {kind} | rl2gem {trainer} {variant or 'defaults'} | {rate:.0f} | {mfu:.1%} |"
                f" {rate / baseline['tokens_per_s']:.2f}x | {loss:.6g} |",
                flush=True,
            )


def ppo_section(model_dir: Path, tmp: Path, steps: int, groups: int) -> None:
    jobs = {
        "config=arithmetic": ["config=arithmetic"],
        f"rl2/GuessTheNumber-v0, {groups} x 4": [
            "env=rl2/GuessTheNumber-v0",
            f"rollout.prompts_per_rollout={groups}",
            "rollout.responses_per_prompt=4",
            "rollout.max_new_tokens=64",
        ],
    }
    phases = (
        "time/rollout", "engine/time_admit_s", "engine/time_decode_s", "engine/time_capture_s",
        "time/old_logprobs", "time/update", "time/weight_sync", "time/step", "perf/micro_batches",
    )  # fmt: skip
    print(
        "| run | rollout s | engine prefill s | engine decode s | graph capture s | old_logprobs s | update s"
        " | weight_sync s | step s | micro-batches"
        + " | step-1 mismatch KL | largest difference | steps on the engine's log-probs"
        + " | steps on the update's forward |"
    )  # fmt: skip
    print("|---|" + "---:|" * (len(phases) + 4))
    for name, extra in jobs.items():
        out = tmp / f"ppo-{len(name)}"
        args = ["trainers/ppo.py", f"actor.model={model_dir}", f"trainer.total_steps={steps}", "trainer.eval_n=8"]
        result = run("ppo", [*args, *extra], out)
        if "error" in result:
            FAILED.append(f"ppo {name}")
            print(f"| {name} | failed: {result['error'][-200:]!r} |")
            continue
        logged = [r for r in map(json.loads, (out / "metrics.jsonl").open()) if "time/step" in r]
        rows = logged[1:]
        cells = [f"{statistics.median(r.get(p, 0.0) for r in rows):.2f}" if rows else "-" for p in phases]
        # actor.old_logprobs=auto: the first step's check, and the steps that skipped the forward
        check = next((r for r in logged if "actor/old_logprob_mismatch_kl" in r), {})
        cells += [
            f"{check[k]:.2e}" if k in check else "-"
            for k in ("actor/old_logprob_mismatch_kl", "actor/old_logprob_max_diff")
        ]
        for source in ("actor/old_logprobs_from_rollout", "actor/old_logprobs_from_update"):
            cells.append(f"{sum(r.get(source, 0.0) for r in logged):.0f} of {len(logged)}")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


def mask_section(lengths: list[int]) -> None:
    """FlexAttention's ``BlockMask`` for one packed row of ~800-token sequences (a GuessTheNumber
    episode's length), built as ``actor.attention=flex`` builds it (per tile:
    :func:`rl2gem.parallel.attention.flex_block_mask`) and by ``create_block_mask`` over the same
    ``mask_mod`` (every query-key pair): seconds per build (median of 5, the device synchronised)
    and the peak memory a build adds (CUDA: the allocator's; CPU: the process's resident set)."""
    from torch.nn.attention.flex_attention import create_block_mask

    from rl2gem.parallel.attention import flex_block_mask
    from rl2gem.parallel.packing import packed_batch
    from rl2gem.training.metrics import MIB, PeakMemory

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print("| tokens | build | seconds | peak MiB added | vs create_block_mask (time) |")
    print("|---:|---|---:|---:|---:|")
    for length in lengths:
        lengths_of = [800] * (length // 800) + ([length % 800] if length % 800 else [])
        until = packed_batch([[5] * n for n in lengths_of])["until"].to(device)

        def per_pair(until=until):
            padded = -(-len(until) // 128) * 128
            reach = torch.cat([until, torch.arange(len(until), padded, device=device)])
            return create_block_mask(
                lambda b, h, q, k: (k <= q) & (q <= reach[k]), None, None, padded, padded, device=device
            )

        rows = []
        for name, build in (
            ("create_block_mask", per_pair),
            ("flex_block_mask (ours)", lambda u=until: flex_block_mask(u)),
        ):
            build()  # warm-up
            seconds = statistics.median(timed(build, device) for _ in range(5))
            gc.collect()
            memory = PeakMemory(device, interval=0.001, release_every=None)
            before = (
                torch.cuda.memory_allocated(device) if device.type == "cuda" else psutil.Process().memory_info().rss
            )
            with memory.phase("build"):
                build()
            added = (memory.peaks["build"] - before) / MIB
            rows.append((name, seconds, added))
        for name, seconds, added in rows:
            print(f"| {length} | {name} | {seconds:.4f} | {added:.0f} | {rows[0][1] / seconds:.1f}x |", flush=True)


def kernel_profile(work) -> tuple[float, int, float] | None:
    """``work()`` under ``torch.profiler`` -> (the share of its wall time in which CUDA kernels
    run, the kernels launched, their summed device seconds), or None off CUDA or when the profiler
    recorded no kernel. Kernels replayed from a CUDA graph count one by one."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        start = time.perf_counter()
        work()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    events = [e for e in profiler.key_averages() if e.device_type.name == "CUDA"]
    seconds = sum(e.device_time_total for e in events) / 1e6
    if seconds == 0:  # the profiler saw no kernel (CUPTI off after an earlier session): not measured
        print("(torch.profiler recorded no CUDA kernel: GPU busy not measured)", flush=True)
        return None
    return seconds / wall, sum(e.count for e in events), seconds


def timed(work, device: torch.device) -> float:
    """Wall seconds of ``work()``, the device synchronised before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    work()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def static_generate(model, prompts: list[list[int]], pad: int, new: int) -> None:
    """``model.generate`` on ``prompts`` left-padded into one batch, exactly ``new`` sampled tokens each."""
    device = next(model.parameters()).device
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    starts = torch.tensor([width - len(p) for p in prompts], device=device)
    mask = (torch.arange(width, device=device)[None] >= starts[:, None]).long()
    with torch.no_grad():
        model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=True, pad_token_id=pad
        )


def engine_decode(
    model, tokenizer, prompts: list[list[int]], new: int | list[int], rows: int | None = None, **options
) -> tuple[dict, dict, dict]:
    """The embedded engine (as the rollout uses it; ``options``: its ``decode_graphs`` and
    ``decode_steps``) on ``prompts``, ``new`` tokens each (or ``new[i]`` for prompt ``i``), at
    most ``rows`` in flight (default: all; the others queue, admitted as rows finish), three times
    on one engine: a warm-up (its graphs captured), a measured run and a profiled one. Returns the
    warm-up's and the measured run's counters (with ``wall_s``, the batch's wall seconds) and the
    profiled run's: ``busy`` (the GPU-busy share of its wall
    time), ``busy_unprofiled`` (its kernels' time, per decode step times the measured run's steps,
    over the measured run's wall time: the same prompts and lengths without the profiler's own
    cost per kernel), ``kernels`` and ``kernel_ms`` per decode step (prefill's few kernels
    included), empty off CUDA."""
    engine = EmbeddedEngine(model, tokenizer, max_batch_size=rows or len(prompts), **options)
    budgets = new if isinstance(new, list) else [new] * len(prompts)
    device = next(model.parameters()).device

    async def batch():
        await asyncio.gather(
            *(
                engine.generate(p, {"max_new_tokens": n, "temperature": 1.0, "ignore_eos": True})
                for p, n in zip(prompts, budgets, strict=True)
            )
        )

    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize()

    async def batch_and_stats() -> tuple[dict, float]:
        synchronize()
        start = time.perf_counter()
        await batch()
        synchronize()
        wall = time.perf_counter() - start
        return await engine.settled_stats(), wall  # the last round's times included

    warm, _ = asyncio.run(batch_and_stats())
    after, wall = asyncio.run(batch_and_stats())
    measured = {key: value - warm.get(key, 0) for key, value in after.items()} | {"wall_s": wall}
    profile = kernel_profile(lambda: asyncio.run(batch()))
    profiled = {}
    if profile is not None:
        steps = max(asyncio.run(engine.settled_stats())["decode_steps"] - after.get("decode_steps", 0), 1)
        busy, kernels, seconds = profile
        # the profiled run's kernel time scaled to the measured run's decode steps (equal unless
        # a round's steps differ), over the measured run's wall time
        unprofiled = seconds * measured.get("decode_steps", 0) / steps / wall
        profiled = {"busy": busy, "busy_unprofiled": unprofiled}
        profiled |= {"kernels": kernels / steps, "kernel_ms": 1000 * seconds / steps}
    asyncio.run(engine.close())
    return warm, measured, profiled


def engine_sides(device: torch.device) -> list[tuple[dict, str]]:
    """The engine's variants in the decode table: as trainers build it first (on CUDA: graphs,
    four steps per replay), then the pieces taken away one at a time."""
    if device.type == "cuda":
        return [
            ({}, "EmbeddedEngine"),
            ({"decode_steps": 1}, "EmbeddedEngine decode_steps=1"),
            ({"decode_compile": True}, "EmbeddedEngine decode_compile=True"),
            ({"decode_compile": True, "decode_steps": 1}, "EmbeddedEngine decode_compile=True decode_steps=1"),
            ({"decode_overlap": True}, "EmbeddedEngine decode_overlap=True"),
            (
                {"decode_overlap": True, "decode_compile": True},
                "EmbeddedEngine decode_overlap=True decode_compile=True",
            ),
            ({"decode_graphs": False}, "EmbeddedEngine decode_graphs=False"),
        ]
    return [({}, "EmbeddedEngine"), ({"decode_graphs": True, "decode_steps": 4}, "EmbeddedEngine decode_steps=4")]


def decode_section(model_dir: Path, row_counts: list[int], new_tokens: int, names: list[str] | None = None) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cuda":  # the profiler (GPU busy) must start before graphs are captured (pytorch#75504)
        try:
            from torch.profiler import _utils as profiler_utils

            profiler_utils._init_for_cuda_graphs()
        except Exception as error:  # a private helper: name it and go on
            print(f"(profiler not initialised for CUDA graphs: {error!r})", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    pad, rng = tokenizer.pad_token_id, random.Random(0)
    # the engine's second batch on the same engine (graphs captured by the first: "graphs captured")
    # per host round trip: the step (staging, graph replay or forward, waiting for its tokens) and
    # the rest of the round (the tokens handed to their requests and finished rows: "hand-out"; the
    # columns reserved, the scheduler)
    print(
        "| rows | side | decode tokens/s | vs model.generate | GPU busy | GPU busy, unprofiled wall | graphs captured "
        "| steps per round | step ms per round | rest ms per round | of it hand-out ms | kernels per step "
        "| kernel ms per step |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for rows in row_counts:
        prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(32, 96))] for _ in range(rows)]
        static_generate(model, prompts, pad, new_tokens)  # warm
        seconds = timed(lambda p=prompts: static_generate(model, p, pad, new_tokens + 1), device)
        seconds -= timed(lambda p=prompts: static_generate(model, p, pad, 1), device)  # its prefill
        baseline = rows * new_tokens / max(seconds, 1e-9)
        print(
            f"| {rows} | model.generate (warm, static batch) | {baseline:.0f} | 1.00x | - | - | - | - | - | - | - | - | - |"
        )
        known = [name for _, name in engine_sides(device)]
        if set(names or ()) - set(known):
            raise ValueError(f"--decode-sides: no side named {sorted(set(names) - set(known))} (the sides: {known})")
        for options, name in engine_sides(device):
            if names is not None and name not in names:
                continue
            warm, stats, profiled = engine_decode(model, tokenizer, prompts, new_tokens, **options)
            rate = stats["decode_tokens"] / max(stats["time_decode_ms"] / 1000, 1e-9)
            captured = f"{warm.get('decode_graph_captures', 0)} in {warm.get('time_capture_ms', 0) / 1000:.2f} s"
            busy_text = f"{profiled['busy']:.0%} | {profiled['busy_unprofiled']:.0%}" if profiled else "- | -"
            kernels = f"{profiled['kernels']:.0f} | {profiled['kernel_ms']:.3f}" if profiled else "- | -"
            if stats.get("decode_graph_captures"):  # graphs captured again after the warm-up: in the times
                captured += f", {stats['decode_graph_captures']} in the measured run"
            if warm.get("decode_graphs_failed") or stats.get("decode_graphs_failed"):
                name += " (graphs failed: windowed)"
                FAILED.append(f"decode graphs at {rows} rows")
            rounds = max(stats.get("decode_rounds", 0), 1)
            step_ms = stats.get("time_decode_forward_ms", 0) / rounds
            rest_ms = stats.get("time_decode_ms", 0) / rounds - step_ms
            handout_ms = stats.get("time_decode_handout_ms", 0) / rounds
            print(
                f"| {rows} | rl2gem {name} | {rate:.0f} | {rate / baseline:.2f}x | {busy_text} | {captured} "
                f"| {stats.get('decode_steps', 0) / rounds:.1f} | {step_ms:.2f} | {rest_ms:.2f} | {handout_ms:.2f} | {kernels} |",
                flush=True,
            )


def queue_section(model_dir: Path, row_counts: list[int], new_tokens: int, queued: int) -> None:
    """Continuous batching as a rollout drives it: ``queued`` x rows requests for rows in flight,
    budgets from half to one and a half ``new_tokens`` (rows finish apart, the queue's requests
    are admitted as they do), the engine as trainers build it against ``decode_overlap=True``
    (requests prefilled behind a queued round). Tokens per wall second, prefill included."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    rng = random.Random(1)
    base = {} if device.type == "cuda" else {"decode_graphs": True, "decode_steps": 4}  # CPU: the eager step
    print(
        "| rows in flight | requests | side | tokens/s (wall) | vs without overlap | GPU busy | GPU busy, unprofiled wall "
        "| rounds queued ahead | admissions behind a round | admission ms |"
    )
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for rows in row_counts:
        count = rows * queued
        prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(32, 96))] for _ in range(count)]
        budgets = [rng.randint(new_tokens // 2, max(new_tokens * 3 // 2, 1)) for _ in range(count)]
        first = None
        for overlap in (False, True):
            _, stats, profiled = engine_decode(model, tokenizer, prompts, budgets, rows, **base, decode_overlap=overlap)
            rate = sum(budgets) / stats["wall_s"]
            first = first or rate
            busy = f"{profiled['busy']:.0%} | {profiled['busy_unprofiled']:.0%}" if profiled else "- | -"
            rounds = max(stats.get("decode_rounds", 0), 1)
            admissions = max(stats.get("prefill_forwards", 0), 1)
            print(
                f"| {rows} | {count} | rl2gem EmbeddedEngine{' decode_overlap=True' if overlap else ''} | {rate:.0f} "
                f"| {rate / first:.2f}x | {busy} | {stats.get('decode_rounds_ahead', 0) / rounds:.0%} "
                f"| {stats.get('admissions_behind', 0)} of {stats.get('prefill_forwards', 0)} "
                f"| {stats.get('time_admit_ms', 0) / admissions:.2f} |",
                flush=True,
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cuda = torch.cuda.is_available()
    parser.add_argument(
        "--models", default="1024x8,2048x16" if cuda else "256x2", help="HIDDENxLAYERS, comma-separated"
    )
    parser.add_argument("--sections", default="sft,dpo,rm,ppo,decode,mask")
    parser.add_argument("--steps", type=int, default=6 if cuda else 4)
    parser.add_argument(
        "--ours",
        default="actor.compile=false;actor.compile=true" if cuda else "actor.attention=auto",
        help="variants of our trainer's overrides, ';'-separated",
    )
    parser.add_argument(
        "--row-kinds", default="mixed,long", help="sft, dpo, rm: the rows, comma-separated (mixed, long)"
    )
    parser.add_argument("--ppo-groups", type=int, default=16 if cuda else 2, help="ppo: GuessTheNumber groups per step")
    parser.add_argument("--rows", default="64,256", help="decode: rows in flight, comma-separated")
    parser.add_argument("--new-tokens", type=int, default=128, help="decode: new tokens per row")
    parser.add_argument(
        "--decode-queue",
        type=int,
        default=3,
        help="decode: also requests for this many times the rows, queued (continuous batching; 0: not run)",
    )
    parser.add_argument(
        "--decode-sides", default=None, help="decode: the engine sides to run, by name, ';'-separated (default: all)"
    )
    parser.add_argument(
        "--scale", type=float, default=1.0 if cuda else 0.25, help="row lengths times this (CPU: a quarter)"
    )
    parser.add_argument("--tokenizer", default=None, help="a folder with SmolLM2's tokenizer (default: the built-in)")
    args = parser.parse_args(argv)
    sections = set(args.sections.split(","))
    kinds = args.row_kinds.split(",")
    if set(kinds) - {"mixed", "long"}:
        raise ValueError(f"--row-kinds: mixed or long, got {args.row_kinds!r}")
    tokenizer = args.tokenizer or str(resolve_model("smollm2-135m-instruct"))
    device = torch.cuda.get_device_name() if cuda else "CPU (fp32)"
    print(f"{device}; torch {torch.__version__}, transformers {transformers.__version__}\n", flush=True)
    dtype = torch.bfloat16 if cuda else torch.float32
    peak = peak_flops_from_config(None, torch.device("cuda" if cuda else "cpu"), dtype)
    for spec in args.models.split(","):
        hidden, layers = (int(x) for x in spec.split("x"))
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            model_dir = tmp / "model"
            make_model(model_dir, tokenizer, hidden, layers)
            size = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_pretrained(model_dir).parameters())
            print(f"\n## Llama {hidden} x {layers} ({size / 1e6:.1f}M parameters)\n", flush=True)
            for trainer in ("sft", "dpo", "rm"):
                if trainer in sections:
                    offline_section(trainer, model_dir, tmp, args.steps, args.ours.split(";"), peak, args.scale, kinds)
                    print()
            if "decode" in sections:
                sides = args.decode_sides.split(";") if args.decode_sides else None
                decode_section(model_dir, [int(n) for n in args.rows.split(",")], args.new_tokens, sides)
                print()
                if args.decode_queue:
                    queue_section(model_dir, [int(n) for n in args.rows.split(",")], args.new_tokens, args.decode_queue)
                    print()
            if "mask" in sections and spec == args.models.split(",")[0]:  # once, before the longest section
                print("## FlexAttention block masks\n", flush=True)
                mask_section([16384, 65536] if cuda else [4096, 16384])
                print()
            if "ppo" in sections:  # two trainer runs: the longest, least predictable section last
                gc.collect()  # the decode and mask sections' cached memory back to the device, which
                if cuda:  # the trainers' actor.max_length_per_device=auto probes
                    torch.cuda.empty_cache()
                ppo_section(model_dir, tmp, max(3, args.steps // 2), args.ppo_groups)
    if FAILED:
        print(f"\nfailed: {'; '.join(FAILED)}")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
