"""The agentic pipeline's report (``python -m rl2gem.trainers.agentic``, stage ``table``): one row
per evaluated model in ``<out>/results.md`` and ``<out>/results.png``, each model against the
previous one on the same items (:func:`rl2gem.evaluation.paired_comparison`), and the training
tokens prefix merging saves against re-rendering each turn."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from rl2gem.evaluation import EpisodeRecord, paired_comparison, record_sums
from rl2gem.tracking import metrics_by_step

__all__ = ["prefix_merging_tokens", "records_of", "table"]


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


def records_of(path: Path) -> list[EpisodeRecord]:
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
    means["segments"] = sum(r.context_segments for r in records) / n
    means["summaries"] = sum(r.summaries for r in records) / n
    return {"episodes": len(records), "reported": reported, **means, "two_searches": two}


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


def table(out: Path, models: dict[str, str], segmented: bool = False) -> str:
    """The results table of ``<out>/eval/<label>.jsonl`` (and ``results.png``), one row per model
    in ``models`` (label -> model; the models share one tokenizer, the first's is used), and the
    paired comparison of each model with the one before it. With ``segmented`` (the evaluation
    managed the context, ``context.max_tokens``) the prefix-merging column is left out: a record
    then holds the last segment's messages only, not what the segments trained.

    Raises:
        ValueError: ``models`` is empty (no evaluation has finished).
    """
    from transformers import AutoTokenizer

    from rl2gem.models import resolve_model

    if not models:
        raise ValueError("no evaluation to tabulate: the eval stage has not finished for any model")
    tokenizer = None if segmented else AutoTokenizer.from_pretrained(resolve_model(next(iter(models.values()))))
    stats, merging = {}, {}
    for label in models:
        records = records_of(out / "eval" / f"{label}.jsonl")
        stats[label] = _summary(records)
        if not segmented:
            merging[label] = prefix_merging_tokens(records, tokenizer)
    reported = set().union(*(s["reported"] for s in stats.values()))
    columns = [
        c for c in _COLUMNS if c[1] not in ("em", "f1", "searches", "two_searches") or c[1].split("_")[-1] in reported
    ]
    if segmented:
        columns += [("new segments / ep", "segments", "{:.2f}"), ("summaries / ep", "summaries", "{:.2f}")]
    rows = []
    for label, s in stats.items():
        cells = [fmt.format(s[key]) for _, key, fmt in columns]
        if not segmented:
            merged, rerendered = merging[label]
            saved = 1.0 - merged / rerendered if rerendered else 0.0
            cells.append(f"{merged} / {rerendered} ({100 * saved:.0f}% saved)")
        rows.append(f"| {label} | {' | '.join(cells)} |")
    header = ["model", *(name for name, _, _ in columns)]
    if not segmented:
        header.append("training tokens: prefix-merged / re-rendered")
    text = "\n".join(["| " + " | ".join(header) + " |", "|---" + "|---:" * (len(header) - 1) + "|", *rows])
    for before, after in itertools.pairwise(models):
        gained, lost, p = paired_comparison(
            records_of(out / "eval" / f"{before}.jsonl"), records_of(out / "eval" / f"{after}.jsonl")
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
        by_step = sorted(metrics_by_step(curve).items())
        lines = (  # a step whose groups dynamic filtering all dropped has no kept reward: no point
            ("rollout/unfiltered_reward", "rollout reward, every group (train questions)", "."),
            ("rollout/reward", "rollout reward, kept groups", "."),
            ("eval/em", "held-out EM", "o"),
            ("eval/success", "held-out success", "o"),
        )
        for key, label, marker in lines:
            points = [(step, row[key]) for step, row in by_step if key in row]
            if points and not (key == "eval/success" and any("eval/em" in row for _, row in by_step)):
                axes[1].plot(*zip(*points, strict=True), marker=marker, label=label)
        axes[1].set_xlabel("PPO step")
        axes[1].set_ylim(0, 1)
        axes[1].set_title("during RL")
        axes[1].legend()
    fig.tight_layout()
    fig.savefig(out / "results.png", dpi=110)
    plt.close(fig)
