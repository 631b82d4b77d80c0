"""The agentic pipeline of an env, stage by stage and resumable: oracle episodes -> SFT -> PPO on
multi-turn rollouts -> evaluation of the base, SFT-only and SFT+RL models on held-out items.
Pipelines: ``searchqa`` (rl2/SearchQA-v0), ``guess`` (rl2/GuessTheNumber-v0) and ``multihop``
(rl2/MultiHopQA-v0: two searches per question), also with its history managed in 512-token
segments (``multihop-truncate``, ``multihop-summarize``; ``rollout.context``).

    python -m rl2gem.trainers.agentic searchqa          # the full run (README, "Agentic training")
    python -m rl2gem.trainers.agentic searchqa --toy    # a few items and one step per stage (CI)
    python -m rl2gem.trainers.agentic guess             # the second env
    python -m rl2gem.trainers.agentic multihop-summarize --sft-from runs/agentic-multihop

Stages (each a child process; ``--stages`` runs a subset):

1. ``collect``: the env's scripted solver plays the train split (``python -m rl2gem.collect``).
2. ``sft``: ``trainers/sft.py`` on those episodes (the recipe ``trainers/config/<env>_sft.yaml``).
3. ``ppo``: ``trainers/ppo.py`` from the SFT model (the recipe ``trainers/config/<env>.yaml``):
   multi-turn token-in/token-out rollouts, env tokens masked, turns prefix-merged.
4. ``eval``: ``python -m rl2gem.evaluate`` of each model on the same held-out items (greedy).
5. ``table``: ``<out>/results.md`` (one row per model: reward, success, EM / F1, searches and the
   share of episodes with two or more where the env reports them, turns, invalid actions,
   generated tokens, and the tokens prefix merging saved against re-rendering each turn as a new
   prompt; then each model against the previous one on the same items: items gained and lost and
   the sign test's p, :func:`paired_comparison`) and ``<out>/results.png``.

``--sft-from DIR`` takes the SFT model of another pipeline's run folder (its ``sft`` stage must be
done) and skips ``collect`` and ``sft``: the context-managed multihop runs start from the model of
the ``multihop`` run, so that the policies compare at equal steps from one starting point.

Resuming: a stage whose output is complete is skipped (collect and eval write to a temporary file
renamed at the end; SFT and PPO write ``<out>/<stage>/DONE`` when they exit cleanly), and an
interrupted SFT or PPO stage continues from its last checkpoint (``trainer.resume=true``). So the
same command, run again after a crash, picks up where it stopped.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from rl2gem.evaluation import EpisodeRecord, record_sums
from rl2gem.procs import quick_exit_collection

__all__ = ["PIPELINES", "Pipeline", "main", "paired_comparison", "prefix_merging_tokens"]

ROOT = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Pipeline:
    """One env's pipeline.

    Attributes:
        env: the env id.
        collect: ``key=value`` arguments of ``python -m rl2gem.collect`` (the solver's episodes).
        sft_config / ppo_config: recipe names in ``trainers/config``.
        eval: ``key=value`` arguments of ``python -m rl2gem.evaluate`` shared by every model.
        toy: overrides for ``--toy`` per stage (``collect``, ``sft``, ``ppo``, ``eval``).
    """

    env: str
    collect: list[str]
    sft_config: str
    ppo_config: str
    eval: list[str]
    toy: dict[str, list[str]] = field(default_factory=dict)


_TOY_TRAIN = ["trainer.total_steps=1", "trainer.eval_at_start=false", "trainer.eval_n=2", "trainer.progress=false"]


def _toy(env_kwargs: dict[str, str] | None = None) -> dict[str, list[str]]:
    """``--toy`` overrides per stage: 16 solver episodes, one SFT and one PPO step on 2 x 2 episodes,
    2 evaluation episodes per model; ``env_kwargs`` set in every stage."""
    kwargs = [f"env_kwargs.{k}={v}" for k, v in (env_kwargs or {}).items()]
    eval_kwargs = [f"trainer.eval_env_kwargs.{k}={v}" for k, v in (env_kwargs or {}).items()]
    return {
        "collect": ["n=16", *kwargs],
        "sft": [*_TOY_TRAIN, "data.batch_size=4", *eval_kwargs],
        "ppo": [*_TOY_TRAIN, "rollout.prompts_per_rollout=2", "rollout.responses_per_prompt=2", *kwargs],
        "eval": ["n=2", *kwargs],
    }


def _toy_multihop(context: bool) -> dict[str, list[str]]:
    """:func:`_toy` for a multihop pipeline: the PPO step updates (no dynamic filtering: the tiny
    test model's groups all score 0) and, with a context policy, segments of 256 tokens, so that
    the toy rollouts do start new segments."""
    toy = _toy()
    toy["ppo"] = [*toy["ppo"], "rollout.dynamic_filter=false", *(["rollout.context.max_tokens=256"] if context else [])]
    toy["eval"] = [*toy["eval"], *(["context.max_tokens=256"] if context else [])]
    return toy


PIPELINES: dict[str, Pipeline] = {
    "searchqa": Pipeline(
        env="rl2/SearchQA-v0",
        collect=["n=5000", "env_kwargs.topk=1"],
        sft_config="searchqa_sft",
        ppo_config="searchqa",
        eval=["n=200", "env_kwargs.topk=3", "env_kwargs.max_turns=4", "max_new_tokens=48", "batch_size=32"],
        toy=_toy(),
    ),
    "guess": Pipeline(
        env="rl2/GuessTheNumber-v0",
        collect=["n=2000", "env_kwargs.difficulty=expert"],
        sft_config="guess_sft",
        ppo_config="guess",
        eval=["n=200", "seed=100000", "env_kwargs.difficulty=expert", "max_new_tokens=16", "batch_size=64"],
        toy=_toy({"difficulty": "easy"}),  # 1..10 in 4 guesses: a toy run checks the stages, not the game
    ),
    **{
        name: Pipeline(
            env="rl2/MultiHopQA-v0",
            collect=["n=2000", "env_kwargs.topk=3"],
            sft_config="multihop_sft",
            ppo_config=name.replace("-", "_"),
            eval=[
                "n=200",
                "env_kwargs.topk=3",
                "env_kwargs.max_turns=5",
                "max_new_tokens=48",
                "batch_size=32",
                *context,
            ],
            toy=_toy_multihop(bool(context)),
        )
        for name, context in (
            ("multihop", []),
            ("multihop-truncate", ["context.max_tokens=512", "context.policy=truncate"]),
            (
                "multihop-summarize",
                ["context.max_tokens=512", "context.policy=summarize", "context.summary_max_new_tokens=96"],
            ),
        )
    },
    "guess-hard": Pipeline(  # few demonstrations: 64 solver games, so SFT stops well below the solver
        env="rl2/GuessTheNumber-v0",
        collect=["n=64", "env_kwargs.difficulty=hard"],
        sft_config="guess_hard_sft",
        ppo_config="guess_hard",
        eval=["n=200", "seed=100000", "env_kwargs.difficulty=hard", "max_new_tokens=16", "batch_size=64"],
        toy=_toy({"difficulty": "easy"}),
    ),
}


def prefix_merging_tokens(records: list[EpisodeRecord], tokenizer) -> tuple[int, int]:
    """Training tokens of ``records`` as one prefix-merged sequence per episode, and as one sample
    per turn that re-renders the whole conversation so far as its prompt (what trainers that
    re-tokenise each turn process).

    Returns:
        ``(merged, rerendered)`` token counts summed over the episodes.
    """
    from rl2gem.rollout.tito import ChatRenderer

    renderer = ChatRenderer(tokenizer)
    merged = rerendered = 0
    for r in records:
        messages = r.messages
        if not any(m["role"] == "assistant" for m in messages):
            continue
        merged += len(renderer.conversation(messages))
        for i, m in enumerate(messages):
            if m["role"] == "assistant":
                rerendered += len(renderer.prompt_ids(messages[:i])) + len(renderer.encode(m["content"])) + 1
    return merged, rerendered


def _run(cmd: list[str], log: Path, threads: int = 1) -> None:
    """Run one stage's command, its output appended to ``log``, with ``threads`` intra-op threads per
    process (1 for torchrun's ranks, one per core; every core for a one-process stage).

    Raises:
        SystemExit: the stage failed (the log's last lines in the message).
    """
    print(f"$ {' '.join(cmd)}  > {log}", flush=True)
    with open(log, "a") as sink:
        environment = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        r = subprocess.run(cmd, stdout=sink, stderr=subprocess.STDOUT, env=environment)
    if r.returncode:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        raise SystemExit(f"stage failed (exit {r.returncode}); the last lines of {log}:\n{tail}")


def _torchrun(script: str, args: list[str], nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script, *args]


def _checkpoint_hf(run_dir: Path) -> Path:
    return run_dir / (run_dir / "latest").read_text().strip() / "hf"


def _trained(stage: str, config: str, run_dir: Path, extra: list[str], nproc: int, log: Path) -> Path:
    """Run (or resume) a trainer stage; returns its final Hugging Face export."""
    if not (run_dir / "DONE").exists():
        args = [f"config={config}", f"trainer.output_dir={run_dir}", "trainer.resume=true", *extra]
        _run(_torchrun(str(ROOT / f"{stage}.py"), args, nproc), log)
        (run_dir / "DONE").write_text(time.strftime("%Y-%m-%d %H:%M:%S\n"))
    return _checkpoint_hf(run_dir)


def _evaluate(pipe: Pipeline, label: str, model: str, out: Path, extra: list[str]) -> Path:
    path = out / "eval" / f"{label}.jsonl"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".partial")
        tmp.unlink(missing_ok=True)
        args = [
            f"env={pipe.env}",
            f"model={model}",
            "split=test",
            *pipe.eval,
            *extra,
            f"output={tmp}",
            "progress=false",
        ]
        _run([sys.executable, "-m", "rl2gem.evaluate", *args], out / "eval" / f"{label}.log", os.cpu_count() or 1)
        tmp.rename(path)
    return path


def _records(path: Path) -> list[EpisodeRecord]:
    return [EpisodeRecord(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def _summary(records: list[EpisodeRecord]) -> dict[str, float]:
    """Per-episode means of ``records``, and ``reported`` (the names among em, f1 and searches that
    the env reports)."""
    sums = record_sums(records)
    n = max(sums["episodes"], 1.0)
    names = {"success": "success", "reward": "reward", "em": "em", "f1": "f1", "searches": "searches"}
    names.update(turns="turns", invalid="invalid_actions", tokens="response_tokens")
    reported = {name for name in ("em", "f1", "searches") if sums.get(f"reported/{name}", 0.0) > 0}
    two = sum(float(r.final_info.get("num_searches") or 0) >= 2 for r in records) / n  # multi-hop behaviour
    means = {name: sums[key] / n for name, key in names.items()}
    return {"episodes": len(records), "reported": reported, **means, "two_searches": two}


def _solved(record: EpisodeRecord) -> bool:
    """Exact match where the env reports it, else success."""
    em = record.final_info.get("em")
    return bool(em) if isinstance(em, (int, float)) else bool(record.success)


def paired_comparison(before: list[EpisodeRecord], after: list[EpisodeRecord]) -> tuple[int, int, float]:
    """Two models on the same items (matched by ``(seed, index)``): the items only ``after`` solves,
    those only ``before`` solves (:func:`_solved`), and the exact two-sided sign test's p-value on
    those discordant items (binomial, p = 1/2; McNemar's exact test).

    Raises:
        ValueError: the two lists do not cover the same items.
    """
    first = {(r.seed, r.index): _solved(r) for r in before}
    second = {(r.seed, r.index): _solved(r) for r in after}
    if first.keys() != second.keys():
        raise ValueError("the two evaluations are not on the same items")
    gained = sum(second[key] and not first[key] for key in first)
    lost = sum(first[key] and not second[key] for key in first)
    changed = gained + lost
    tail = sum(math.comb(changed, k) for k in range(min(gained, lost) + 1)) / 2**changed
    return gained, lost, min(1.0, 2 * tail)


#: The table's columns: (header, summary key, format); EM, F1 and searches only where the env reports them.
_COLUMNS = [
    ("episodes", "episodes", "{:d}"),
    ("EM", "em", "{:.3f}"),
    ("F1", "f1", "{:.3f}"),
    ("success", "success", "{:.3f}"),
    ("reward", "reward", "{:.3f}"),
    ("searches / ep", "searches", "{:.2f}"),
    ("2+ searches", "two_searches", "{:.3f}"),
    ("turns / ep", "turns", "{:.2f}"),
    ("invalid / ep", "invalid", "{:.2f}"),
    ("generated tokens / ep", "tokens", "{:.1f}"),
]


def table(out: Path, models: dict[str, str]) -> str:
    """The results table of ``<out>/eval/<label>.jsonl`` (and ``results.png``)."""
    from transformers import AutoTokenizer

    from rl2gem.models import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(models["base"]))
    stats, merging = {}, {}
    for label in models:
        records = _records(out / "eval" / f"{label}.jsonl")
        merging[label] = prefix_merging_tokens(records, tokenizer)
        merged, rerendered = merging[label]
        stats[label] = _summary(records)
        stats[label]["saved"] = 1.0 - merged / rerendered if rerendered else 0.0
    reported = set().union(*(s["reported"] for s in stats.values()))
    columns = [
        c for c in _COLUMNS if c[1] not in ("em", "f1", "searches", "two_searches") or c[1].split("_")[-1] in reported
    ]
    rows = []
    for label, s in stats.items():
        merged, rerendered = merging[label]
        cells = [fmt.format(s[key]) for _, key, fmt in columns]
        rows.append(f"| {label} | {' | '.join(cells)} | {merged} / {rerendered} ({100 * s['saved']:.0f}% saved) |")
    header = ["model", *(name for name, _, _ in columns), "training tokens: prefix-merged / re-rendered"]
    text = "\n".join(["| " + " | ".join(header) + " |", "|---" + "|---:" * (len(header) - 1) + "|", *rows])
    for before, after in itertools.pairwise(models):
        gained, lost, p = paired_comparison(
            _records(out / "eval" / f"{before}.jsonl"), _records(out / "eval" / f"{after}.jsonl")
        )
        text += f"\n\nPaired, {before} -> {after}: {gained} items gained, {lost} lost; sign test p = {p:.2g}"
    (out / "results.md").write_text(text + "\n")
    _plot(out, stats)
    return text


def _plot(out: Path, stats: dict[str, dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    names = [n for n in ("em", "f1", "success") if n == "success" or any(n in s["reported"] for s in stats.values())]
    width = 0.8 / len(stats)
    for i, (label, s) in enumerate(stats.items()):
        axes[0].bar([j + i * width for j in range(len(names))], [s[n] for n in names], width, label=label)
    axes[0].set_xticks(
        [j + width * (len(stats) - 1) / 2 for j in range(len(names))],
        [n.upper() if n != "success" else n for n in names],
    )
    axes[0].set_ylim(0, 1)
    axes[0].set_title("held-out items, greedy")
    axes[0].legend()
    curve = out / "ppo" / "metrics.jsonl"
    if curve.exists():
        reward, held_out = {}, {}
        for line in curve.read_text().splitlines():
            row = json.loads(line)
            if "rollout/reward" in row:
                reward[row["step"]] = row["rollout/reward"]
            if "eval/em" in row or "eval/success" in row:
                held_out[row["step"]] = row.get("eval/em", row.get("eval/success"))
        axes[1].plot(list(reward), list(reward.values()), marker=".", label="rollout reward (train questions)")
        if held_out:
            axes[1].plot(list(held_out), list(held_out.values()), marker="o", label="held-out EM (success where none)")
        axes[1].set_xlabel("PPO step")
        axes[1].set_ylim(0, 1)
        axes[1].set_title("during RL")
        axes[1].legend()
    fig.tight_layout()
    fig.savefig(out / "results.png", dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rl2gem.trainers.agentic", description=__doc__.split("\n\n")[0])
    p.add_argument("env", choices=sorted(PIPELINES))
    p.add_argument("--out", default=None, help="run folder (default runs/agentic-<env>[-toy])")
    p.add_argument("--toy", action="store_true", help="a few items and one step per stage (CI)")
    p.add_argument("--stages", default="collect,sft,ppo,eval,table")
    p.add_argument("--nproc", type=int, default=2, help="ranks of the SFT and PPO stages")
    p.add_argument("--base", default="smollm2-135m-instruct", help="the base model")
    p.add_argument("--sft-from", default=None, help="reuse the SFT model of this run folder (skips collect, sft)")
    args = p.parse_args(argv)
    pipe = PIPELINES[args.env]
    out = Path(args.out or f"runs/agentic-{args.env}{'-toy' if args.toy else ''}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    stages = args.stages.split(",")
    if args.sft_from:
        sft_dir = Path(args.sft_from).resolve() / "sft"
        if not (sft_dir / "DONE").exists():
            raise SystemExit(f"--sft-from: {sft_dir} has no finished SFT stage (no DONE file)")
        stages = [s for s in stages if s not in ("collect", "sft")]
    else:
        sft_dir = out / "sft"
    toy = pipe.toy if args.toy else {}
    oracle = out / "oracle.jsonl"
    if "collect" in stages and not oracle.exists():
        tmp = out / "oracle.partial"
        collect = [f"env={pipe.env}", "policy=solver", "split=train", *pipe.collect, *toy.get("collect", [])]
        _run([sys.executable, "-m", "rl2gem.collect", *collect, f"output={tmp}", "progress=false"], out / "collect.log")
        tmp.rename(oracle)
    common = [f"actor.model={args.base}", "trainer.progress=false"]
    models = {"base": args.base}
    if "sft" in stages:
        extra = [*common, f"data.train={oracle}", *toy.get("sft", [])]
        models["sft"] = str(_trained("sft", pipe.sft_config, sft_dir, extra, args.nproc, out / "sft.log"))
    elif (sft_dir / "latest").exists():
        models["sft"] = str(_checkpoint_hf(sft_dir))
    if "ppo" in stages:
        extra = ["trainer.progress=false", f"actor.model={models['sft']}", *toy.get("ppo", [])]
        models["sft+rl"] = str(_trained("ppo", pipe.ppo_config, out / "ppo", extra, args.nproc, out / "ppo.log"))
    elif (out / "ppo" / "latest").exists():
        models["sft+rl"] = str(_checkpoint_hf(out / "ppo"))
    if "eval" in stages:
        for label, model in models.items():
            _evaluate(pipe, label, model, out, toy.get("eval", []))
    if "table" in stages:
        print(table(out, {k: v for k, v in models.items() if (out / "eval" / f"{k}.jsonl").exists()}))
        print(f"table: {out / 'results.md'}  plot: {out / 'results.png'}")
    return 0


if __name__ == "__main__":
    quick_exit_collection()
    raise SystemExit(main())
