"""The embedded retrieval service: queries/second under concurrent load, and BM25 recall@k.

* Throughput: one ``python -m rl2gem.retrieval serve`` process on loopback; an
  aiohttp client keeps ``c`` requests in flight (c = 1..64), one query each,
  topk 3, for ``--duration`` seconds; queries are the prepared SearchQA
  questions. Reported: queries/s and p50/p99 latency.
* Recall@k: for every prepared question (train + test), does a gold answer
  appear (case-insensitive) in the top-k passages when the question itself is
  the query? And when the subject is the query (what an agent that searched
  well would send)?

Run: ``python benchmarks/retrieval.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time

import numpy as np
from rl2gem.envs.search_qa import answer_prior, bridge_recall, load_questions

from rl2gem.procs import free_port
from rl2gem.retrieval import BM25Index, RetrievalClient


async def _load(url: str, queries: list[str], concurrency: int, duration: float) -> tuple[float, float, float]:
    client = RetrievalClient(url, timeout=30, retries=0)
    latencies: list[float] = []
    end = time.perf_counter() + duration

    async def worker(k: int) -> None:
        i = k
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            await client.retrieve([queries[i % len(queries)]], 3)
            latencies.append(time.perf_counter() - t0)
            i += concurrency

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(k) for k in range(concurrency)))
    elapsed = time.perf_counter() - t0
    await client.aclose()
    lat = np.array(latencies) * 1000
    return len(latencies) / elapsed, float(np.percentile(lat, 50)), float(np.percentile(lat, 99))


def recall_at(index: BM25Index, queries: list[str], golds: list[list[str]], ks: list[int]) -> dict[int, float]:
    hits = index.search(queries, max(ks))
    out = {}
    for k in ks:
        found = []
        for row, gold in zip(hits, golds, strict=True):
            text = " ".join(index.corpus[i]["text"].lower() for i, _ in row[:k])
            found.append(any(g.lower() in text for g in gold if g.strip()))
        out[k] = float(np.mean(found))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--duration", type=float, default=3.0)
    p.add_argument("--quick", action="store_true", help="smoke run: 0.5 s per level, 1 and 8 in flight")
    args = p.parse_args(argv)
    if args.quick:
        args.concurrency, args.duration = [1, 8], 0.5

    questions = load_questions("train") + load_questions("test")
    index = BM25Index.load_or_build()
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "rl2gem.retrieval", "serve", "--port", str(port), "--exit-on-stdin-eof"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().startswith("RL2GEM_RETRIEVAL_READY")
    try:
        rows = [
            (c, *asyncio.run(_load(f"http://127.0.0.1:{port}", [q["question"] for q in questions], c, args.duration)))
            for c in args.concurrency
        ]
    finally:
        proc.stdin.close()
        proc.wait(timeout=10)

    print(
        f"\nRetrieval service throughput (BM25, 10,033 passages, topk 3, {args.duration:.1f} s per level, loopback)\n"
    )
    print("| in flight | queries/s | p50 ms | p99 ms |")
    print("|---:|---:|---:|---:|")
    for c, qps, p50, p99 in rows:
        print(f"| {c} | {qps:.0f} | {p50:.1f} | {p99:.1f} |")

    ks = [1, 3, 5, 10]
    golds = [q["answers"] for q in questions]
    by_question = recall_at(index, [q["question"] for q in questions], golds, ks)
    by_subject = recall_at(index, [q["subject"] for q in questions], golds, ks)
    print(
        f"\nBM25 recall@k on the {len(questions)} prepared qa_wikidata questions (a gold answer in the top-k passages)\n"
    )
    print("| query | " + " | ".join(f"@{k}" for k in ks) + " |")
    print("|---|" + "---:|" * len(ks))
    print("| the question | " + " | ".join(f"{by_question[k]:.3f}" for k in ks) + " |")
    print("| the subject | " + " | ".join(f"{by_subject[k]:.3f}" for k in ks) + " |")

    two_hop = load_questions("train", hops=2) + load_questions("test", hops=2)
    print(
        f"\nTwo-hop questions (rl2/MultiHopQA-v0, {len(two_hop)}): the share whose bridge article, the one "
        "holding the answer, is in BM25's top-k for the question text (one search would do)\n"
    )
    print("| query | " + " | ".join(f"@{k}" for k in ks) + " |")
    print("|---|" + "---:|" * len(ks))
    print("| the question | " + " | ".join(f"{bridge_recall(index, two_hop, k):.3f}" for k in ks) + " |")
    train, test = load_questions("train", hops=2), load_questions("test", hops=2)
    print(
        f"\nWith no search at all: each outer relation's commonest train answer (`answer_prior`) gets "
        f"{answer_prior(train, test):.3f} EM on the {len(test)} test questions"
    )


if __name__ == "__main__":
    main()
