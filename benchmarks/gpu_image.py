"""Check, on the CPU machine, that the GPU session imports only what the device image has.

The lent GPU machines run an image with torch, transformers and some 200 other distributions
(``benchmarks/gpu_image.txt``) and no network; ``benchmarks/gpu_session.sh`` carries the rest as
wheels (its ``WHEELS`` and ``SOURCE_ONLY`` lists). A module the session imports that is in
neither fails there at import, after minutes of scarce device time. This script builds a Python
environment here holding only those distributions (links into this interpreter's site-packages)
and the tree laid out as the session lays it out (``envs/`` and ``trainers/`` inside ``rl2gem/``),
then, in it: imports every trainer, ``rl2gem.evaluate`` and the built-in envs, collects
``tests/test_gpu.py``, runs ``benchmarks/gpu.py --help`` and ``benchmarks/fsdp_one_rank.py`` on a
two-layer model (the stage ``FSDP_SECONDS`` of ``gpu_session.sh``); ``--bench`` also runs
``benchmarks/gpu.py`` on its CPU fallback at a tiny scale (the imports made at run time).

    python benchmarks/gpu_image.py [--bench] [--without NAME ...]

``--without``: leave distributions out (the test's control: a missing one must fail the check).
Prints one line per check and exits 1 when one failed (the missing module named in its output).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
IMAGE = ROOT / "benchmarks" / "gpu_image.txt"
SESSION = ROOT / "benchmarks" / "gpu_session.sh"
IMPORTS = (
    "import rl2gem.trainers.ppo, rl2gem.trainers.sft, rl2gem.trainers.rm, rl2gem.trainers.dpo, "
    "rl2gem.trainers.agentic, rl2gem.evaluate, rl2gem.envs, gymnasium; "
    "import rl2gem.envs.reasoning_gym, rl2gem.envs.math"
)


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def dependency_closure(names: set[str]) -> set[str]:
    """``names`` and, transitively, the distributions they require as installed here (without
    extras): the image holds its own versions' dependencies, which may differ from this machine's
    newer versions' (transformers 5.17 there, a later one here)."""
    installed = {normalized(d.metadata["Name"]): d for d in importlib.metadata.distributions()}
    closure, queue = set(names), list(names)
    while queue:
        distribution = installed.get(queue.pop())
        for line in (distribution.requires or []) if distribution else []:
            requirement = Requirement(line)
            name = normalized(requirement.name)
            if name not in closure and (requirement.marker is None or requirement.marker.evaluate({"extra": ""})):
                closure.add(name)
                queue.append(name)
    return closure


def allowed_distributions(without: set[str]) -> set[str]:
    """The image's distributions with their dependencies, and the session's wheels as listed (they
    are installed without dependencies), less ``without`` (normalized names)."""
    image = {normalized(line) for line in IMAGE.read_text().split("\n") if line and not line.startswith("#")}
    names = dependency_closure(image - {normalized(name) for name in without})
    for block in re.findall(r"(?:WHEELS|SOURCE_ONLY)=\(([^)]*)\)", SESSION.read_text()):
        names |= {normalized(word.split("==")[0]) for word in block.split() if not word.startswith("#")}
    return names - {normalized(name) for name in without}


def build_environment(folder: Path, allowed: set[str]) -> tuple[Path, Path]:
    """A venv in ``folder`` whose site-packages links the allowed distributions' files, and a
    mirror of the tree -> (its python, the mirror's root)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder / "venv")], check=True)
    python = folder / "venv" / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    site, source = Path(purelib), Path(sysconfig.get_paths()["purelib"])
    for distribution in importlib.metadata.distributions():
        if normalized(distribution.metadata["Name"]) not in allowed:
            continue
        for top in {file.parts[0] for file in distribution.files or [] if file.parts[0] != ".."}:
            if (source / top).exists() and not (site / top).exists():
                (site / top).symlink_to(source / top)
    tree = folder / "tree"
    (tree / "rl2gem").mkdir(parents=True)
    for entry in ROOT.iterdir():
        if entry.name not in ("rl2gem", ".venv", ".git"):
            (tree / entry.name).symlink_to(entry)
    for entry in (ROOT / "rl2gem").iterdir():
        (tree / "rl2gem" / entry.name).symlink_to(entry)
    for package in ("envs", "trainers"):  # as the editable install (and gpu_session.sh) maps them
        (tree / "rl2gem" / package).symlink_to(ROOT / package)
    return python, tree


def checks(bench: bool) -> list[tuple[str, list[str]]]:
    """(name, arguments after the python) of each check, run from the mirror's root."""
    found = [
        ("imports", ["-c", IMPORTS]),
        ("pytest collects tests/test_gpu.py", ["-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                                               "tests/test_gpu.py"]),
        ("benchmarks/gpu.py --help", ["benchmarks/gpu.py", "--help"]),
        ("benchmarks/fsdp_one_rank.py, tiny", ["benchmarks/fsdp_one_rank.py", "--layers", "2", "--rounds", "1",
                                               "--iterations", "1"]),
    ]  # fmt: skip
    if bench:
        tokenizer = str(ROOT / ".tok") if (ROOT / ".tok").exists() else None
        arguments = ["benchmarks/gpu.py", "--models", "64x2", "--sections", "sft,dpo,rm,decode,ppo,mask", "--steps", "3",
                     "--scale", "0.05", "--rows", "4", "--new-tokens", "4"]  # fmt: skip
        found.append(("benchmarks/gpu.py on the CPU", arguments + (["--tokenizer", tokenizer] if tokenizer else [])))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bench", action="store_true", help="also run benchmarks/gpu.py on its CPU fallback")
    parser.add_argument("--without", nargs="*", default=[], help="distributions to leave out (a control)")
    args = parser.parse_args(argv)
    failed = 0
    with tempfile.TemporaryDirectory() as folder:
        python, tree = build_environment(Path(folder), allowed_distributions(set(args.without)))
        env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1", "WANDB_MODE": "offline"}
        for name, arguments in checks(args.bench):
            run = subprocess.run([str(python), *arguments], cwd=tree, env=env, capture_output=True, text=True)
            print(f"{name}: {'ok' if run.returncode == 0 else f'FAILED (exit {run.returncode})'}", flush=True)
            if run.returncode:
                failed += 1
                print((run.stdout + run.stderr)[-3000:], flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
