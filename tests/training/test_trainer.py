"""Trainer.fit's outer loop: what a run killed at any point has written."""

import json

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from rl2gem.trainers import ppo

from rl2gem.parallel.fsdp import init_distributed
from rl2gem.tracking import Tracker
from rl2gem.training.trainer import Trainer, launch


class Recorder:
    """A checkpointer that records, at each save, its step and the metrics rows on disk."""

    def __init__(self, metrics_path):
        self.metrics_path, self.saves = metrics_path, []

    def save(self, step, rank_state, export):
        self.saves.append((step, metrics_rows(self.metrics_path)))
        return self.metrics_path.parent / f"checkpoint-{step}"


def metrics_rows(path) -> list[tuple[int, str]]:
    """(step, first metric name) of each row of ``metrics.jsonl``."""
    return [(row.pop("step"), next(iter(row))) for row in map(json.loads, path.read_text().splitlines())]


class Counting(Trainer):
    report_keys = ("loss",)

    def __init__(self, output_dir, total_steps, save_every):
        self.cfg = OmegaConf.create(
            {
                "trainer": {
                    "resume": False,
                    "eval_at_start": False,
                    "progress": False,
                    "eval_every": 0,
                    "save_every": save_every,
                    "loggers": ["jsonl"],
                }
            }
        )
        self.rank, self.step, self.total_steps, self.device = 0, 0, total_steps, torch.device("cpu")
        self.actor = self.tokenizer = None
        self.tracker = Tracker(["jsonl"], output_dir)
        self.checkpointer = Recorder(self.tracker.path)

    def train_step(self):
        self.step += 1
        return {"loss": float(self.step)}

    def evaluate(self):
        return {"eval/score": 1.0}


def test_each_step_is_logged_before_its_checkpoint(tmp_path):
    """A run killed right after a checkpoint resumes after that step, so the step's metrics row
    must already be written when the checkpoint is (kill -9 between them lost the row)."""
    trainer = Counting(tmp_path, total_steps=4, save_every=2)
    trainer.fit()
    steps = [(1, "loss"), (2, "loss"), (3, "loss"), (4, "loss")]
    final = (4, "eval/score")  # the final evaluation, before the final checkpoint
    assert trainer.checkpointer.saves == [(2, steps[:2]), (4, steps), (4, [*steps, final])]
    assert metrics_rows(tmp_path / "metrics.jsonl") == [*steps, final]


class JoinsTheGroup:
    """A trainer that joins the process group (one rank, gloo) and fails or not in its fit."""

    closed = 0

    def __init__(self, cfg, fails):
        self.fails = fails
        init_distributed("gloo")

    def fit(self):
        if self.fails:
            raise RuntimeError("a rank failed mid-step")

    def close(self):
        JoinsTheGroup.closed += 1


@pytest.mark.parametrize("fails", [False, True])
def test_a_failed_fit_leaves_the_process_group_to_the_process_exit(fails):
    """After a fit that returned, ``launch`` tears the group down; after one that raised, it only
    closes the trainer and re-raises: NCCL's teardown would wait for a collective the other ranks
    never join (a hang until the group's timeout), while the process's exit lets torchrun stop them."""
    before = JoinsTheGroup.closed
    try:
        if fails:
            with pytest.raises(RuntimeError, match="a rank failed mid-step"):
                launch(lambda cfg: JoinsTheGroup(cfg, fails), ppo.CONFIG, ppo.check_config, [])
        else:
            assert launch(lambda cfg: JoinsTheGroup(cfg, fails), ppo.CONFIG, ppo.check_config, []) == 0
        assert JoinsTheGroup.closed == before + 1
        assert dist.is_initialized() == fails
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
