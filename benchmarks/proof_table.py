"""Tables and plots of the enhanced-RL2 proof runs (benchmarks/learning.md) from their ``metrics.jsonl``.

    python benchmarks/proof_table.py kl runs/kl-proof            # bash benchmarks/proofs.sh kl
    python benchmarks/proof_table.py entropy runs/entropy-proof  # bash benchmarks/proofs.sh entropy
    python benchmarks/proof_table.py offpolicy runs/offpolicy-proof  # bash benchmarks/proofs.sh offpolicy

``offpolicy``: stale-token fraction, reward, value loss and held-out success of each run.
``kl``: one row per run (fixed coefficient and each controller): the KL target, the mean measured
KL per token over the last half of the run, its ratio to the target, the first and last
coefficient, and held-out success; a plot of KL and coefficient per step. ``entropy``: the policy
entropy per step of each run, the bound and the multiplier. Each plot is written next to the
runs (``<runs>/curves.png``) and, with ``--plot``, to that path.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def series(records: list[dict], key: str) -> list[tuple[int, float]]:
    last = {}
    for r in records:
        if key in r:
            last[r["step"]] = r[key]
    return sorted(last.items())


def runs_of(root: Path) -> dict[str, list[dict]]:
    found = {p.parent.name: rows(p) for p in sorted(root.glob("*/metrics.jsonl"))}
    if not found:
        raise SystemExit(f"no <run>/metrics.jsonl under {root}")
    return dict(sorted(found.items(), key=lambda kv: (kv[0] != "fixed" and kv[0] != "unconstrained", kv[0])))


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def kl_table(runs: dict[str, list[dict]]) -> str:
    lines = [
        "| run | target KL | mean KL, 2nd half | KL / target | coef first -> last | held-out success |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, records in runs.items():
        kl = [v for _, v in series(records, "actor/kl")]
        coef = [v for _, v in series(records, "kl/coef")]
        target = next((v for _, v in series(records, "kl/target")), float("nan"))
        success = series(records, "eval/success")
        second = mean(kl[len(kl) // 2 :])
        controlled = not math.isnan(target)  # a fixed or scheduled coefficient logs no target
        target_cell = f"{target:.3g}" if controlled else "-"
        ratio_cell = f"{second / target:.2f}" if controlled else "-"
        success_cell = f"{success[-1][1]:.2f}" if success else ""
        lines.append(
            f"| {name} | {target_cell} | {second:.4f} | {ratio_cell} | {coef[0]:.3g} -> {coef[-1]:.3g} | {success_cell} |"
        )
    return "\n".join(lines)


def entropy_table(runs: dict[str, list[dict]]) -> str:
    names = list(runs)
    steps = sorted({s for r in runs.values() for s, _ in series(r, "actor/entropy")})
    header = "| step | " + " | ".join(f"{n} entropy" for n in names) + " | multiplier |"
    lines = [header, "|---:|" + "---:|" * (len(names) + 1)]
    entropy = {n: dict(series(r, "actor/entropy")) for n, r in runs.items()}
    multiplier = {}
    for r in runs.values():
        multiplier.update(dict(series(r, "constraint/entropy_multiplier")))
    for s in steps:
        cells = [f"{entropy[n][s]:.3f}" if s in entropy[n] else "" for n in names]
        lines.append(f"| {s} | " + " | ".join(cells) + f" | {multiplier.get(s, float('nan')):.3f} |")
    summary = ["", "| run | reward, last 5 steps | held-out success | entropy, last 5 steps |", "|---|---:|---:|---:|"]
    for n, r in runs.items():
        success = series(r, "eval/success")
        summary.append(
            f"| {n} | {mean(v for _, v in series(r, 'rollout/reward')[-5:]):.3f} | "
            f"{(success[-1][1] if success else float('nan')):.3f} | {mean(v for _, v in series(r, 'actor/entropy')[-5:]):.3f} |"
        )
    return "\n".join(lines + summary)


def offpolicy_table(runs: dict[str, list[dict]]) -> str:
    lines = [
        "| run | stale token fraction, steps 2-10 | mean rollout/reward | mean critic/vf_loss | mean mismatch KL | held-out success |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, records in runs.items():
        stale = [v for s, v in series(records, "rollout/stale_token_fraction") if s > 1]
        success = series(records, "eval/success")
        lines.append(
            f"| {name} | {mean(stale):.2f} | {mean(v for _, v in series(records, 'rollout/reward')):.3f} | "
            f"{mean(v for _, v in series(records, 'critic/vf_loss')):.4f} | "
            f"{mean(v for _, v in series(records, 'actor/mismatch_kl')):.4f} | "
            f"{(success[-1][1] if success else float('nan')):.2f} |"
        )
    return "\n".join(lines)


def plot(runs: dict[str, list[dict]], keys: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.6))
    for ax, key in zip(axes if len(keys) > 1 else [axes], keys, strict=True):
        for name, records in runs.items():
            points = series(records, key)
            if points:
                ax.plot(*zip(*points, strict=True), marker=".", label=name)
        if key == "actor/kl":
            target = next((v for r in runs.values() for _, v in series(r, "kl/target")), None)
            if target is not None:
                ax.axhline(target, color="k", ls="--", lw=1, label="target")
        if key == "actor/entropy":
            bound = next((v for r in runs.values() for _, v in series(r, "constraint/entropy_bound")), None)
            if bound is not None:
                ax.axhline(bound, color="k", ls="--", lw=1, label="bound")
        ax.set_title(key)
        ax.set_xlabel("step")
    axes_list = axes if len(keys) > 1 else [axes]
    axes_list[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kind", choices=["kl", "entropy", "offpolicy"])
    ap.add_argument("runs", type=Path, help="the folder holding one sub-folder per run")
    ap.add_argument("--plot", type=Path, default=None, help="also write the plot here")
    args = ap.parse_args(argv)
    runs = runs_of(args.runs)
    if args.kind == "kl":
        print(kl_table(runs))
        keys = ["actor/kl", "kl/coef", "rollout/reward"]
    elif args.kind == "entropy":
        print(entropy_table(runs))
        keys = ["actor/entropy", "constraint/entropy_multiplier", "rollout/reward"]
    else:
        print(offpolicy_table(runs))
        keys = ["rollout/stale_token_fraction", "critic/vf_loss", "rollout/reward"]
    for path in [args.runs / "curves.png", *([args.plot] if args.plot else [])]:
        plot(runs, keys, path)
        print(f"plot: {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
