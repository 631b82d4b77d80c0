"""Python sandbox: executions per second and per-execution latency, rl2gem's three paths against GEM.

Side by side, in one run, on the same snippet (``print(sum(i * i for i in range(1000)))``, which
must print 332833500), with every sandbox layer this host has unless a column says otherwise:

* **pool**: :func:`rl2gem.tools.run_python` forked by the fork server (the default);
* **session**: :class:`rl2gem.tools.PythonSession`, ``c`` sessions (episodes) in flight, each
  running its share of the calls one after another; the time includes starting the sessions;
* **fresh**: ``SandboxConfig(pool_size=0)``, a new interpreter per execution (the path before
  the pool);
* **GEM** 0.1.0 ``gem.tools.python_code_tool.PythonCodeTool`` (``sandbox_type="none"``: a string
  blacklist, ``subprocess.run``), synchronous, so ``c`` threads each call it (what a vectorised
  GEM env does);
* then the pool with each kernel layer switched off in turn, and with the audit hook alone:
  what each layer costs.

Throughput: ``c`` calls in flight on one event loop; each cell is the rate over three interleaved
rounds of max(48, 4c) executions. Latency: one execution at a time (nothing else in flight),
p50 and p95 of 100 (``--quick``: 10), wall clock from the call to its result; "session, first
call" is a new session's first call (the session's start included).
Run: ``python benchmarks/sandbox.py`` (``--quick`` for a smoke run: one round of 8).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from rl2gem.tools import PythonSession, SandboxConfig, run_python, sandbox_mode, warm_up

SNIPPET = "print(sum(i * i for i in range(1000)))"
EXPECTED = "332833500"


def _check(outputs: list[str]) -> None:
    assert all(EXPECTED in out for out in outputs), outputs[:3]


async def _pool(config: SandboxConfig, n: int) -> float:
    await run_python(SNIPPET, config)  # warm: the fork server starts (the fresh path: the probe)
    start = time.perf_counter()
    results = await asyncio.gather(*(run_python(SNIPPET, config) for _ in range(n)))
    elapsed = time.perf_counter() - start
    _check([r.stdout for r in results])
    return n / elapsed


async def _sessions(config: SandboxConfig, concurrency: int, n: int) -> float:
    await warm_up(config)
    calls = [n // concurrency + (i < n % concurrency) for i in range(concurrency)]

    async def episode(count: int) -> list[str]:
        session = PythonSession(config)
        try:
            return [(await session.run(SNIPPET)).stdout for _ in range(count)]
        finally:
            await session.aclose()

    start = time.perf_counter()
    outputs = await asyncio.gather(*(episode(count) for count in calls))
    elapsed = time.perf_counter() - start
    _check([out for episode_outputs in outputs for out in episode_outputs])
    return n / elapsed


def bench_rl2gem(kind: str, layers: dict, concurrency: int, n: int) -> float:
    config = SandboxConfig(max_concurrency=concurrency, timeout_s=60, pool_size=0 if kind == "fresh" else 1, **layers)
    return asyncio.run(_sessions(config, concurrency, n) if kind == "session" else _pool(config, n))


def _gem_tool():
    from gem.tools.python_code_tool import PythonCodeTool

    tool = PythonCodeTool(timeout=60, sandbox_type="none")
    action = f"```python\n{SNIPPET}\n```"
    return lambda _=None: tool.execute_action(action)[2]  # (is_valid, has_error, observation, parsed_action)


def bench_gem(concurrency: int, n: int) -> float:
    one = _gem_tool()
    one()
    with ThreadPoolExecutor(concurrency) as pool:
        start = time.perf_counter()
        outputs = list(pool.map(one, range(n)))
        elapsed = time.perf_counter() - start
    _check(outputs)
    return n / elapsed


def latencies(n: int, has_gem: bool) -> dict[str, list[float]]:
    """Milliseconds per execution, one at a time, for each path."""
    pooled, fresh = SandboxConfig(timeout_s=60), SandboxConfig(timeout_s=60, pool_size=0)

    async def timed(make_call) -> list[float]:
        out = []
        for _ in range(n):
            start = time.perf_counter()
            result = await make_call()
            out.append((time.perf_counter() - start) * 1000)
            _check([result.stdout])
        return out

    async def main() -> dict[str, list[float]]:
        await run_python(SNIPPET, pooled)
        await run_python(SNIPPET, fresh)
        session = PythonSession(pooled)
        await session.run(SNIPPET)
        sessions: list[PythonSession] = []

        async def first_call():
            sessions.append(PythonSession(pooled))
            return await sessions[-1].run(SNIPPET)

        try:
            return {
                "pool": await timed(lambda: run_python(SNIPPET, pooled)),
                "session, next call": await timed(lambda: session.run(SNIPPET)),
                "session, first call": await timed(first_call),
                "fresh": await timed(lambda: run_python(SNIPPET, fresh)),
            }
        finally:
            for each in (session, *sessions):
                await each.aclose()

    rows = asyncio.run(main())
    if has_gem:
        one = _gem_tool()
        one()
        rows["GEM 0.1.0 none"] = []
        for _ in range(n):
            start = time.perf_counter()
            _check([one()])
            rows["GEM 0.1.0 none"].append((time.perf_counter() - start) * 1000)
    return rows


def _same_python_for_gem() -> None:
    """GEM runs ``python`` from PATH: make that this interpreter (not a pyenv shim script), so both
    sides start the same binary."""
    bindir = os.path.dirname(sys.executable)
    if not os.path.exists(os.path.join(bindir, "python")):
        raise SystemExit(f"no 'python' next to {sys.executable}; GEM would run another interpreter")
    os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")


def columns() -> dict[str, tuple[str, dict]]:
    """Column name -> (path, SandboxConfig switches)."""
    host = sandbox_mode()
    out = {"pool": ("pool", {}), "session": ("session", {}), "fresh": ("fresh", {})}
    if host.namespaces:
        out["pool, no namespaces"] = ("pool", {"isolation": "audit"})
    if host.landlock:
        out["pool, no landlock"] = ("pool", {"landlock": False})
    if host.seccomp:
        out["pool, no seccomp"] = ("pool", {"seccomp": False})
    out["pool, audit hook only"] = ("pool", {"isolation": "audit", "landlock": False, "seccomp": False})
    return out


def throughput_table(levels: tuple[int, ...], quick: bool, has_gem: bool) -> None:
    cols = columns()
    ratios = ["pool", "session", "fresh"] if has_gem else []
    header = (
        "| in flight | "
        + " | ".join(f"{name} (exec/s)" for name in cols)
        + (" | GEM 0.1.0 none (exec/s) | " + " | ".join(f"{name} / GEM" for name in ratios) if has_gem else "")
        + " |"
    )
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for c in levels:
        n = 8 if quick else max(48, 4 * c)
        rounds = 1 if quick else 3  # interleaved, so drift of the machine hits every column
        seconds = {name: 0.0 for name in [*cols, *(["GEM"] if has_gem else [])]}
        for _ in range(rounds):
            for name, (kind, layers) in cols.items():
                seconds[name] += n / bench_rl2gem(kind, layers, c, n)
            if has_gem:
                seconds["GEM"] += n / bench_gem(c, n)
        rates = {name: rounds * n / s for name, s in seconds.items()}
        row = f"| {c} | " + " | ".join(f"{rates[name]:.1f}" for name in cols)
        if has_gem:
            row += f" | {rates['GEM']:.1f} | " + " | ".join(f"{rates[name] / rates['GEM']:.2f}x" for name in ratios)
        print(row + " |", flush=True)


def latency_table(n: int, has_gem: bool) -> None:
    print(f"\nLatency per execution, one at a time ({n} each), all layers:\n")
    print("| path | p50 (ms) | p95 (ms) |")
    print("|---|---|---|")
    for name, values in latencies(n, has_gem).items():
        values = sorted(values)
        p95 = values[min(len(values) - 1, int(round(0.95 * (len(values) - 1))))]
        print(f"| {name} | {statistics.median(values):.1f} | {p95:.1f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smoke run (few executions)")
    args = ap.parse_args()
    try:
        import gem  # noqa: F401

        has_gem = True
    except ImportError:
        has_gem = False
    print(f"CPU cores: {os.cpu_count()}; snippet: {SNIPPET!r}; sandbox layers here: {sandbox_mode()}")
    if not has_gem:
        print("GEM (gem-llm==0.1.0, the bench extra) is not installed: its column is left out.")
    # GEM's tool makes its temporary folders in the current directory: run it in a scratch one.
    _same_python_for_gem()
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory() as scratch:
        os.chdir(scratch)
        try:
            throughput_table((1, 8) if args.quick else (1, 8, 32, 128), args.quick, has_gem)
            latency_table(10 if args.quick else 100, has_gem)
        finally:
            os.chdir(cwd)


if __name__ == "__main__":
    main()
