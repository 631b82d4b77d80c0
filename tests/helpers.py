"""Helpers shared by several test files: torchrun jobs, metrics rows, action-mask runs."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def torchrun_command(nproc: int, *args: str) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of a ``torchrun --standalone`` job run from the repository root."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    return cmd, {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def torchrun(nproc: int, *args: str, timeout: float = 600, cwd=None, env=None) -> str:
    """Run a torchrun job to the end; assert it succeeded (its output tails in the message); its stdout."""
    cmd, base = torchrun_command(nproc, *args)
    r = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd or ROOT, env={**base, **(env or {})}
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return r.stdout


def logged_steps(path, key: str) -> dict[int, dict]:
    """The last ``metrics.jsonl`` row holding ``key`` for each step (a resumed run logs again the steps
    after its checkpoint)."""
    rows = {}
    for line in Path(path).read_text().splitlines():
        row = json.loads(line)
        if key in row:
            rows[row["step"]] = row
    return rows


def masked_runs(ids, mask) -> list[list[int]]:
    """The token ids of each contiguous run where ``mask`` is set."""
    runs, current = [], []
    for token, on in zip(ids, mask, strict=True):
        if on:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def stop_and_resume(nproc: int, script: str, args: list[str], stop: int, total: int, out) -> None:
    """Run ``script`` to step ``stop`` (its checkpoint), then again with ``trainer.resume=true`` to
    ``total`` in the same ``out`` folder; assert that the second run resumed at ``stop``."""
    torchrun(nproc, script, *args, f"trainer.total_steps={stop}", f"trainer.output_dir={out}")
    stdout = torchrun(
        nproc, script, *args, f"trainer.total_steps={total}", "trainer.resume=true", f"trainer.output_dir={out}"
    )
    assert f"resumed from step {stop}" in stdout


def run_module(module: str, *args: str) -> subprocess.CompletedProcess:
    """``python -m module args`` from the repository root, its output captured as text."""
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, cwd=ROOT)
