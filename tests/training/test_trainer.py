"""Trainer.fit's outer loop: what a run killed at any point has written."""

import json

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from rl2gem.trainers import ppo

from rl2gem.parallel.fsdp import init_distributed
from rl2gem.tracking import Tracker, flat_config
from rl2gem.training.trainer import Trainer, check_common_keys, launch


class Recorder:
    """A checkpointer that records, at each save, its step and the metrics rows on disk."""

    def __init__(self, metrics_path):
        self.metrics_path, self.saves = metrics_path, []

    def save(self, step, trainer_state, rank_state, export):
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


class Resumable(Recorder):
    """A checkpointer that keeps what each save was given and loads the newest."""

    def __init__(self, metrics_path, saved=None):
        super().__init__(metrics_path)
        self.states = saved if saved is not None else []

    def save(self, step, trainer_state, rank_state, export):
        self.states.append({**trainer_state, "step": step})
        return super().save(step, trainer_state, rank_state, export)

    def load(self, expected):
        return (dict(self.states[-1]), {}) if self.states else None


class KilledAtStep(Counting):
    """A run killed (an exception) in the step after ``kill_after``."""

    def __init__(self, output_dir, kill_after=None, resume=False, saved=None):
        super().__init__(output_dir, total_steps=4, save_every=2)
        self.cfg.trainer.resume, self.kill_after = resume, kill_after
        self.tracker = Tracker(["jsonl"], output_dir, resume=resume)
        self.checkpointer = Resumable(self.tracker.path, saved)

    def train_step(self):
        if self.step == self.kill_after:
            raise KeyboardInterrupt("kill -9")
        return super().train_step()


def test_a_resumed_run_logs_each_step_once_and_a_finished_one_does_nothing(tmp_path, capsys):
    """Killed after logging step 3 (checkpoint 2): the resumed run's steps 3 and 4 replace the
    killed run's step 3 in metrics.jsonl; a resume of the finished run evaluates nothing again."""
    killed = KilledAtStep(tmp_path, kill_after=3)
    with pytest.raises(KeyboardInterrupt):
        killed.fit()
    killed.tracker.close()
    assert [step for step, _ in metrics_rows(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    resumed = KilledAtStep(tmp_path, resume=True, saved=killed.checkpointer.states)
    resumed.fit()
    whole = [(1, "loss"), (2, "loss"), (3, "loss"), (4, "loss"), (4, "eval/score")]
    assert metrics_rows(tmp_path / "metrics.jsonl") == whole
    again = KilledAtStep(tmp_path, resume=True, saved=resumed.checkpointer.states)
    assert again.fit() == {} and again.checkpointer.saves == []
    again.tracker.close()
    assert metrics_rows(tmp_path / "metrics.jsonl") == whole
    assert "the run finished at step 4: nothing left to do" in capsys.readouterr().out


def test_a_run_without_the_jsonl_logger_reports_from_its_own_rows(tmp_path, capsys):
    trainer = Counting(tmp_path, total_steps=3, save_every=0)
    trainer.tracker = Tracker(["stdout"], tmp_path / "run")
    trainer.fit()
    out = capsys.readouterr().out
    assert "| 3 | 3.000 |" in out and "metrics: not kept (no jsonl logger)" in out
    assert (tmp_path / "run" / "curves.png").exists() and not (tmp_path / "run" / "metrics.jsonl").exists()


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


def test_a_new_run_in_a_folder_that_holds_a_run_is_refused_before_anything_loads(tmp_path, capsys):
    """``trainer.resume=false`` in a folder with a checkpoint mixed the new run's metrics into the
    old run's and a later resume could continue the old run."""
    (tmp_path / "latest").write_text("checkpoint-6")
    args = [f"trainer.output_dir={tmp_path}", "trainer.total_steps=1"]
    assert launch(lambda cfg: pytest.fail("the trainer was built"), ppo.CONFIG, ppo.check_config, args) == 2
    line = capsys.readouterr().err.strip()
    assert line == (
        f"config error: trainer.output_dir: {tmp_path} holds a run (latest: checkpoint-6); "
        "continue it with trainer.resume=true, or start this one in another trainer.output_dir"
    )
    check_common_keys(OmegaConf.create({"trainer": {"output_dir": str(tmp_path), "resume": True}}))


def test_a_resume_with_a_changed_config_names_the_changes_and_keeps_the_first_config(tmp_path, capsys):
    trainer = Counting(tmp_path, total_steps=2, save_every=0)
    trainer.cfg.data = {"batch_size": 4, "seed": 0}
    trainer.open_tracker(tmp_path)
    saved = flat_config(OmegaConf.to_container(trainer.cfg))
    trainer.cfg.trainer.resume = True  # the documented relaunch: only trainer.resume differs
    trainer.open_tracker(tmp_path)
    trainer._warn_changed_config(saved)
    assert capsys.readouterr().err == "" and not (tmp_path / "config.1.yaml").exists()
    trainer.cfg.data = {"batch_size": 5, "seed": 0, "shuffle": True}
    trainer.step = 2
    trainer.open_tracker(tmp_path)
    trainer._warn_changed_config(saved)
    assert capsys.readouterr().err.strip() == (
        "warning: resuming step 2 with a changed config: data.batch_size: 4 -> 5, data.shuffle: (unset) -> True"
    )
    assert "batch_size: 4" in (tmp_path / "config.1.yaml").read_text()
    assert "batch_size: 5" in (tmp_path / "config.yaml").read_text()
    trainer.open_tracker(tmp_path)  # the same config again: nothing more kept
    assert sorted(p.name for p in tmp_path.glob("config*.yaml")) == ["config.1.yaml", "config.yaml"]
