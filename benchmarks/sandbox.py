"""Python sandbox throughput: executions/second of a trivial snippet at 1, 8 and 32 in flight.

Side by side, in one run, on the same snippets:

* **rl2gem** :class:`rl2gem.tools.PythonTool`, async (``asyncio.create_subprocess_exec``),
  ``c`` calls in flight on one event loop, with every sandbox layer this host has, then with
  each layer switched off in turn (namespaces, Landlock, seccomp), then with the audit hook
  alone (no kernel layer): what each layer costs.
* **GEM** 0.1.0 ``gem.tools.python_code_tool.PythonCodeTool`` (``sandbox_type="none"``:
  a string blacklist, ``subprocess.run``), which is synchronous, so ``c``
  threads each call it (what a vectorised GEM env does).

Each executes ``print(sum(i * i for i in range(1000)))`` and must print 332833500.
Each cell is the rate over three interleaved rounds of max(48, 4c) executions.
Run: ``python benchmarks/sandbox.py`` (``--quick`` for a smoke run: one round of 8).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from rl2gem.tools import PythonTool, SandboxConfig, sandbox_mode

SNIPPET = "print(sum(i * i for i in range(1000)))"
EXPECTED = "332833500"


def bench_rl2gem(layers: dict, concurrency: int, n: int) -> float:
    tool = PythonTool(SandboxConfig(max_concurrency=concurrency, timeout_s=60, **layers))

    async def main() -> float:
        await tool.call({"code": SNIPPET})  # warm-up
        t0 = time.perf_counter()
        out = await asyncio.gather(*(tool.call({"code": SNIPPET}) for _ in range(n)))
        elapsed = time.perf_counter() - t0
        assert all(o.strip() == EXPECTED for o in out), out[:3]
        return n / elapsed

    return asyncio.run(main())


def bench_gem(concurrency: int, n: int) -> float:
    from gem.tools.python_code_tool import PythonCodeTool

    tool = PythonCodeTool(timeout=60, sandbox_type="none")
    action = f"```python\n{SNIPPET}\n```"

    def one(_: int) -> str:
        return tool.execute_action(action)[2]  # (is_valid, has_error, observation, parsed_action)

    one(0)
    with ThreadPoolExecutor(concurrency) as pool:
        t0 = time.perf_counter()
        out = list(pool.map(one, range(n)))
        elapsed = time.perf_counter() - t0
    assert all(EXPECTED in o for o in out), out[:3]
    return n / elapsed


def _same_python_for_gem() -> None:
    """GEM runs ``python`` from PATH: make that this interpreter (not a pyenv shim script), so both
    sides start the same binary."""
    bindir = os.path.dirname(sys.executable)
    if not os.path.exists(os.path.join(bindir, "python")):
        raise SystemExit(f"no 'python' next to {sys.executable}; GEM would run another interpreter")
    os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")


def configurations() -> dict[str, dict]:
    """Column name -> SandboxConfig switches: all layers, each kernel layer off, the hook alone."""
    host = sandbox_mode()
    columns = {"all layers": {}}
    if host.namespaces:
        columns["no namespaces"] = {"isolation": "audit"}
    if host.landlock:
        columns["no landlock"] = {"landlock": False}
    if host.seccomp:
        columns["no seccomp"] = {"seccomp": False}
    columns["audit hook only"] = {"isolation": "audit", "landlock": False, "seccomp": False}
    return columns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smoke run (few executions)")
    args = ap.parse_args()
    levels = (1, 8, 32)
    columns = configurations()
    try:
        import gem  # noqa: F401

        has_gem = True
    except ImportError:
        has_gem = False
    print(f"CPU cores: {os.cpu_count()}; snippet: {SNIPPET!r}; sandbox layers here: {sandbox_mode()}")
    if not has_gem:
        print("GEM (gem-llm==0.1.0, the bench extra) is not installed: its column is left out.")
    header = (
        "| in flight | "
        + " | ".join(f"rl2gem {name} (exec/s)" for name in columns)
        + (" | GEM 0.1.0 none (exec/s) | rl2gem all layers / GEM |" if has_gem else " |")
    )
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    # GEM's tool makes its temporary folders in the current directory: run it in a scratch one.
    _same_python_for_gem()
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory() as scratch:
        os.chdir(scratch)
        try:
            for c in levels:
                n = 8 if args.quick else max(48, 4 * c)
                rounds = 1 if args.quick else 3  # interleaved, so drift of the machine hits every column
                seconds = {name: 0.0 for name in [*columns, *(["GEM"] if has_gem else [])]}
                for _ in range(rounds):
                    for name, layers in columns.items():
                        seconds[name] += n / bench_rl2gem(layers, c, n)
                    if has_gem:
                        seconds["GEM"] += n / bench_gem(c, n)
                rates = {name: rounds * n / s for name, s in seconds.items()}
                row = f"| {c} | " + " | ".join(f"{rates[name]:.1f}" for name in columns)
                if has_gem:
                    row += f" | {rates['GEM']:.1f} | {rates['all layers'] / rates['GEM']:.2f}x |"
                else:
                    row += " |"
                print(row, flush=True)
        finally:
            os.chdir(cwd)


if __name__ == "__main__":
    main()
