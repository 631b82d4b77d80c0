"""Run by tests/test_models.py under torchrun (2 ranks, gloo): both ranks load the built-in model
from an empty cache, the rank given as ``argv[1]`` taking the conversion lock first; the other calls
``load_model`` only once it has seen that lock held."""

import fcntl
import sys
import time
from pathlib import Path

import torch.distributed as dist

from rl2gem.assets import cache_dir, missing_files
from rl2gem.models import MODEL_FILES, load_model, resolve_model
from rl2gem.procs import run_main

NAME = "smollm2-135m-instruct"


def lock_is_held(path: Path) -> bool:
    """Whether another process holds the flock on ``path`` (probed without blocking)."""
    if not path.exists():
        return False
    with open(path, "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fh, fcntl.LOCK_UN)
    return False


def main() -> None:
    first = int(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank != first:
        lock = cache_dir() / "models" / f".{NAME}.lock"
        deadline = time.monotonic() + 600
        while not lock_is_held(lock):
            if time.monotonic() > deadline:
                raise SystemExit(f"rank {rank}: rank {first} never took {lock}")
            time.sleep(0.02)
        print(f"rank {rank}: rank {first} holds the conversion lock", flush=True)
    model, _ = load_model(NAME)
    folder = Path(resolve_model(NAME))
    assert not missing_files(folder, MODEL_FILES), sorted(p.name for p in folder.iterdir())
    print(f"rank {rank}: loaded {sum(p.numel() for p in model.parameters())} parameters from {folder}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main)
