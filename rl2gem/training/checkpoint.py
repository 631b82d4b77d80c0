"""Checkpoints that a run killed at any moment resumes from, and Hugging Face exports.

``output_dir/checkpoint-<step>/`` holds

* ``dcp/``: every worker's sharded model and optimizer (``torch.distributed.checkpoint``);
* ``trainer_state.json``: the step, each worker's scheduler and whatever the trainer adds
  (data position, controller states), written by rank 0;
* ``rank<r>.pkl``: each rank's own state (torch RNG, engine RNG, rollout buffer, ...);
* ``hf/``: the trained model as a Hugging Face folder (optional).

``output_dir/latest`` names the newest complete checkpoint and is written last, atomically: a
run killed while saving resumes from the previous one. The checkpoint ``latest`` names is never
written again (a save of its step returns it as it is), and a folder of the step being saved that
``latest`` does not name (a killed save, another run's) is removed first. With ``keep`` set, once
``latest`` has moved, the complete checkpoints up to ``latest``'s step older than the newest
``keep`` lose their ``dcp/`` folder (the model and optimizer shards: about 12 bytes per fp32
parameter, most of a checkpoint's size); their ``hf/`` export and small files stay, so every
saved model can still be evaluated.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from rl2gem.parallel.fsdp import uses_cuda

__all__ = ["Checkpointer", "atomic_write"]


def atomic_write(path: str | Path, data: bytes) -> None:
    """Write ``path`` so that a crash (a power loss too: the bytes reach the disk before the
    rename) leaves the old content or the new one, never half of it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


class Checkpointer:
    """Save and resume a run's workers and states under ``output_dir`` (see the module doc).

    Args:
        output_dir: the run's folder.
        workers: ``{name: rl2gem.training.Worker}`` whose model (and optimizer, scheduler) is saved.
        keep: resumable checkpoints kept (the newest); ``0`` keeps every one.

    Raises:
        ValueError: ``keep < 0``.
    """

    def __init__(self, output_dir: str | Path, workers: Mapping[str, Any], keep: int = 0):
        if keep < 0:
            raise ValueError(f"keep must be >= 0, got {keep}")
        self.output_dir = Path(output_dir)
        self.workers = dict(workers)
        self.keep = int(keep)

    def _sharded(self) -> dict[str, Any]:
        return {name: worker.sharded_state() for name, worker in self.workers.items()}

    def save(
        self,
        step: int,
        trainer_state: Mapping[str, Any] | None = None,
        rank_state: Mapping[str, Any] | None = None,
        export: Callable[[Path], None] | None = None,
    ) -> Path:
        """Write ``checkpoint-<step>`` on every rank (a collective) and point ``latest`` at it.

        Args:
            trainer_state: JSON-serialisable state of the run (rank 0's is written).
            rank_state: picklable state of this rank.
            export: called on every rank with ``checkpoint-<step>/hf`` (e.g. a worker's
                :meth:`~rl2gem.training.Worker.export_hf`) before ``latest`` moves.

        Returns the checkpoint folder.
        """
        path = self.output_dir / f"checkpoint-{step}"
        meta_path = path / "trainer_state.json"
        if self.latest() == path and meta_path.exists():  # saved already (a run's last step): not rewritten,
            if dist.get_rank() == 0 and dict(trainer_state or {}).get("finished"):  # but a run's end is noted
                meta = json.loads(meta_path.read_text())
                if not meta.get("finished"):
                    atomic_write(meta_path, json.dumps({**meta, "finished": True}).encode())
            dist.barrier()
            return path
        rank = dist.get_rank()
        if rank == 0 and path.exists():  # not what latest names: a killed save's, or another run's
            shutil.rmtree(path)
        dist.barrier()
        dcp.save(self._sharded(), checkpoint_id=str(path / "dcp"))
        local = {"torch_rng": torch.get_rng_state(), **dict(rank_state or {})}
        if uses_cuda():  # the rank's device's generator (dropout, LoRA's included, draws from it)
            local["cuda_rng"] = torch.cuda.get_rng_state()
        atomic_write(path / f"rank{rank}.pkl", pickle.dumps(local))
        if export is not None:
            export(path / "hf")
        if rank == 0:
            meta = {
                "step": int(step),
                "world_size": dist.get_world_size(),
                "schedulers": {n: w.scheduler.state_dict() for n, w in self.workers.items() if w.scheduler is not None},
                **dict(trainer_state or {}),
            }
            atomic_write(path / "trainer_state.json", json.dumps(meta).encode())
        dist.barrier()
        if rank == 0:
            atomic_write(self.output_dir / "latest", path.name.encode())
            self.prune()
        dist.barrier()
        return path

    def prune(self) -> list[Path]:
        """Remove ``dcp/`` from the complete checkpoints up to ``latest``'s step older than the
        newest :attr:`keep` (none when ``keep`` is 0); returns the checkpoint folders pruned. A
        folder without ``trainer_state.json`` (a save under way or killed) or past ``latest``'s
        step (another run's) is left alone."""
        latest = self.latest()
        if not self.keep or latest is None:
            return []
        newest = int(latest.name.removeprefix("checkpoint-"))
        steps = sorted(
            step
            for child in self.output_dir.iterdir()
            if (match := re.fullmatch(r"checkpoint-(\d+)", child.name))
            and (step := int(match.group(1))) <= newest
            and (child / "dcp").exists()
            and (child / "trainer_state.json").exists()
        )
        pruned = [self.output_dir / f"checkpoint-{step}" for step in steps[: max(0, len(steps) - self.keep)]]
        for folder in pruned:
            shutil.rmtree(folder / "dcp")
        return pruned

    def latest(self) -> Path | None:
        """The newest complete checkpoint folder, or None."""
        pointer = self.output_dir / "latest"
        return self.output_dir / pointer.read_text().strip() if pointer.exists() else None

    def load(self, expected: Mapping[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """Restore every worker from :meth:`latest` and this rank's torch RNGs (the CPU's, and on
        CUDA its device's).

        Args:
            expected: entries the checkpoint's ``trainer_state`` must hold where it has them (e.g.
                ``{"trainer": "sft"}``), checked before anything loads.

        Returns:
            ``(trainer_state, rank_state)`` as saved (``trainer_state["step"]`` included), or None
            when there is no checkpoint.

        Raises:
            ValueError: the checkpoint was written by a run with another world size (on every
                rank, before any loads: each rank's RNGs, rollout and engine state are its own), or
                it differs from ``expected``.
            FileNotFoundError: this rank's state file is missing.
        """
        path = self.latest()
        if path is None:
            return None
        meta = json.loads((path / "trainer_state.json").read_text())
        for key, value in dict(expected or {}).items():
            if meta.get(key, value) != value:
                raise ValueError(
                    f"{path} was written with {key}={meta[key]!r}, this run has {key}={value!r}: resume it with "
                    f"that {key}, or start a new run in another trainer.output_dir (from its weights: {path / 'hf'})"
                )
        world = dist.get_world_size()
        if meta.get("world_size", world) != world:
            raise ValueError(
                f"{path} was written by {meta['world_size']} rank(s), this run has {world}: resume with "
                f"{meta['world_size']}, or start a new run from its weights (actor.model={path / 'hf'})"
            )
        mine = path / f"rank{dist.get_rank()}.pkl"
        if not mine.exists():
            raise FileNotFoundError(f"{mine} is missing: resume with the world size that wrote {path}")
        state = self._sharded()
        dcp.load(state, checkpoint_id=str(path / "dcp"))
        for name, worker in self.workers.items():
            worker.load_sharded_state(state[name])
        for name, sched in meta.get("schedulers", {}).items():
            self.workers[name].scheduler.load_state_dict(sched)
        local = pickle.loads(mine.read_bytes())
        torch.set_rng_state(local["torch_rng"])
        if "cuda_rng" in local and uses_cuda():
            torch.cuda.set_rng_state(local["cuda_rng"])
        return meta, local
