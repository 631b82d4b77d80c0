"""trainers/tune.py: search spaces, a study on a stand-in trainer (pruning, resume after kill -9,
the best recipe) and one real trial of the PPO trainer."""

import contextlib
import os
import signal
import subprocess
import sys
import time

import optuna
import psutil
import pytest
import torch
from helpers import ROOT, run_module
from omegaconf import OmegaConf
from rl2gem.trainers import tune

from rl2gem.config import ConfigError, load_config

FAKE = str(ROOT / "tests" / "trainers" / "fake_trainer.py")


def study_args(out, *extra):
    return [
        f"trainer={FAKE}",
        "nproc_per_node=0",
        "space={x: {type: float, low: 0.0, high: 10.0}}",
        "metric=eval/score",
        "sampler=random",
        "pruner_startup_trials=2",
        f"output_dir={out}",
        *extra,
    ]


def tune_run(*args):
    r = run_module("rl2gem.trainers.tune", *args)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r.stdout


def trials(out):
    return optuna.load_study(study_name="tune", storage=f"sqlite:///{out / 'study.db'}").trials


def test_search_space_and_config_errors(monkeypatch):
    space = tune.distributions(
        {
            "actor.lr": {"type": "float", "low": 1e-6, "high": 1e-4, "log": True},
            "rollout.responses_per_prompt": {"type": "int", "low": 2, "high": 8, "step": 2},
            "adv.estimator": {"type": "categorical", "choices": ["grpo", "drgrpo"]},
        }
    )
    assert space["actor.lr"] == optuna.distributions.FloatDistribution(1e-6, 1e-4, log=True)
    assert space["rollout.responses_per_prompt"] == optuna.distributions.IntDistribution(2, 8, step=2)
    assert space["adv.estimator"].choices == ("grpo", "drgrpo")
    for bad, message in [
        ({"a": {"type": "normal"}}, "type must be float, int or categorical"),
        ({"a": {"type": "float", "low": 1}}, "needs 'high'"),
        ({"a": {"type": "float", "low": 0, "high": 1, "log": True}}, "space.a"),
        ({}, "space is empty"),
        # a typo was ignored (a linear scale searched), a fractional int step read as 0, a list choice
        # crashed the study after it opened, a missing type named the key twice
        ({"a": {"type": "float", "low": 1e-5, "high": 1e-3, "logg": True}}, r"\['logg'\] are not fields of a float"),
        ({"a": {"type": "int", "low": 1, "high": 4, "step": 0.5}}, "step must be an integer, got 0.5"),
        ({"a": {"type": "categorical", "choices": [["q_proj"], "all-linear"]}}, "choices must be numbers, strings"),
        ({"a": {"low": 0, "high": 1}}, r"^space.a: type must be"),
    ]:
        with pytest.raises(ConfigError, match=message):
            tune.distributions(bad)
    cfg = load_config(tune.CONFIG, ["sampler=grid", "space={a: {type: float, low: 0, high: 1}}"])
    with pytest.raises(ConfigError, match="grid"):
        tune.check_config(cfg)
    cfg = load_config(tune.CONFIG, ["nproc_per_node=two", "space={a: {type: float, low: 0, high: 1}}"])
    with pytest.raises(ConfigError, match="nproc_per_node: ranks per node must be auto or an integer"):
        tune.check_config(cfg)
    # auto: 2 ranks (1 on a one-GPU machine); 0: plain python
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for ranks, launcher in (("auto", "--nproc_per_node=2"), (1, "--nproc_per_node=1"), (0, None)):
        command = tune.trial_command(load_config(tune.CONFIG, [f"nproc_per_node={ranks}"]), ["actor.lr=0.1"])
        assert (launcher in command) if launcher else ("torch.distributed.run" not in command)
        assert command[-1] == "actor.lr=0.1"
    r = run_module("rl2gem.trainers.tune", "space={a: {type: float, low: 0, high: 1}}", "trainer=ppx")
    assert r.returncode == 2 and "trainer='ppx'" in r.stderr


def test_a_built_in_trainers_check_runs_on_base_space_and_enqueue_before_the_study(tmp_path):
    """A typo'd space key (or a bad base value) failed every trial, and failed trials do not count
    towards n_trials: the study ran without end. Now the trainer's own check refuses it first."""
    for extra, message in (
        (["space={actor.lrr: {type: float, low: 1e-6, high: 1e-4}}"], "space actor.lrr=1e-06 (with base): unknown key"),
        (
            ["space={actor.lr: {type: float, low: 1e-6, high: 1e-4}}", "base=[rollout.responses_per_prompt=0]"],
            "rollout.responses_per_prompt: must be >= 1, got 0",
        ),
        (
            ["space={actor.lr: {type: float, low: 1e-6, high: 1e-4}}", "enqueue=[{actor.lr: abc}]"],
            "enqueue[0] actor.lr=abc (with base): actor.lr: expected a float",
        ),
    ):
        r = run_module("rl2gem.trainers.tune", "trainer=ppo", f"output_dir={tmp_path}", *extra)
        assert r.returncode == 2 and message in r.stderr, r.stderr
        assert not (tmp_path / "study.db").exists()  # refused before the study opened


def test_the_trials_check_sees_the_world_size_the_trials_run_at(tmp_path, monkeypatch):
    """The tuner checked each trial in its own process, where torchrun's WORLD_SIZE is unset: a
    2-rank tensor-parallel study that every trial would run was refused ("does not divide the
    world size 1"), and a batch that 2 ranks cannot split passed the check."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)

    def check(nproc, *base):
        space = {"actor.lr": {"type": "float", "low": 1e-6, "high": 1e-4}}
        cfg = {"trainer": "ppo", "nproc_per_node": nproc, "base": list(base), "space": space, "enqueue": []}
        tune.check_trials(OmegaConf.create({**cfg, "output_dir": str(tmp_path)}))

    check(2, "actor.tp_size=2", "rollout.prompts_per_rollout=2")
    with pytest.raises(ConfigError, match="prompts_per_rollout=3 must be a multiple of the world size 2"):
        check(2, "rollout.prompts_per_rollout=3")
    with pytest.raises(ConfigError, match="does not divide the world size 1"):
        check(0, "actor.tp_size=2")
    assert "WORLD_SIZE" not in os.environ


def test_format_value_writes_what_the_command_line_reads_back():
    """A null choice reached the trial as the string 'None'."""
    assert [tune.format_value(v) for v in (None, True, False, 3.0, "a b", "x")] == [
        "null",
        "true",
        "false",
        "3.0",
        '"a b"',
        "x",
    ]
    cfg = load_config(
        tune.CONFIG, [f"trial_timeout={tune.format_value(None)}", f"keep_checkpoints={tune.format_value(True)}"]
    )
    assert cfg.trial_timeout is None and cfg.keep_checkpoints is True


def test_failed_trials_in_a_row_stop_the_study(tmp_path):
    """A metric no trial logs failed every trial: the study never ended (failures do not count)."""
    r = run_module("rl2gem.trainers.tune", *study_args(tmp_path, "metric=eval/scor", "n_trials=2"))
    assert r.returncode == 1, r.stdout + r.stderr
    assert (
        r.stderr.strip()
        .splitlines()[-1]
        .startswith(
            f"stopped: {tune.FAILURES_IN_A_ROW} trials in a row failed; the last: trial 2 logged no 'eval/scor'"
        )
    )
    states = [
        t.state for t in optuna.load_study(study_name="tune", storage=f"sqlite:///{tmp_path / 'study.db'}").trials
    ]
    assert states == [optuna.trial.TrialState.FAIL] * tune.FAILURES_IN_A_ROW


def test_a_new_studys_trial_does_not_read_an_old_trials_metrics(tmp_path):
    """trial-<n> of a deleted study was reused: its metrics.jsonl was read from the start, so the new
    trial reported the old run's values (and its latest refused the real trainers)."""
    tune_run(*study_args(tmp_path, "n_trials=1", "enqueue=[{x: 7.0}]"))
    (tmp_path / "study.db").unlink()
    tune_run(*study_args(tmp_path, "n_trials=1", "enqueue=[{x: 2.0}]"))
    study = optuna.load_study(study_name="tune", storage=f"sqlite:///{tmp_path / 'study.db'}")
    assert study.trials[0].intermediate_values == {s: s * 5.0 for s in range(1, 6)}  # x=2, not x=7's s*10


def test_study_prunes_resumes_and_writes_the_best_recipe(tmp_path):
    out = tmp_path / "study"
    stdout = tune_run(*study_args(out, "n_trials=6"))
    done = trials(out)
    states = [t.state.name for t in done]
    assert len(done) == 6 and "PRUNED" in states and states[:2] == ["COMPLETE", "COMPLETE"]
    for t in done:  # every logged value was reported at its step
        assert set(t.intermediate_values) <= {1, 2, 3, 4, 5} and t.intermediate_values
        x = t.params["x"]
        assert all(v == pytest.approx(s * (10 - abs(x - 7))) for s, v in t.intermediate_values.items())
        if t.state.name == "COMPLETE":
            assert t.value == pytest.approx(5 * (10 - abs(x - 7)))
    complete = [t for t in done if t.state.name == "COMPLETE"]
    best = max(complete, key=lambda t: t.value)
    recipe = OmegaConf.load(out / "best.yaml")
    assert float(recipe.x) == pytest.approx(best.params["x"]) and recipe.trainer.output_dir == str(out / "best")
    assert (out / "history.png").stat().st_size > 1000
    assert (out / "results.md").read_text().count("| pruned |") == states.count("PRUNED")
    assert f"best: trial {best.number}" in stdout
    # the same command with more trials continues the study
    tune_run(*study_args(out, "n_trials=8"))
    more = trials(out)
    assert len(more) == 8 and [t.params for t in more[:6]] == [t.params for t in done]
    assert not {t.params["x"] for t in more[6:]} & {t.params["x"] for t in done}  # new draws, not a replay


def test_enqueued_settings_run_first_and_only_once(tmp_path):
    out = tmp_path / "study"
    args = study_args(out, "pruner=none", "enqueue=[{x: 7.0}, {x: 1.5}]", "base=[steps=1]")
    tune_run(*args, "n_trials=3")
    done = trials(out)
    assert [t.params["x"] for t in done[:2]] == [7.0, 1.5] and done[0].value == pytest.approx(10.0)
    assert done[1].value == pytest.approx(10 - 5.5)
    tune_run(*args, "n_trials=4")  # resumed: the enqueued points are not queued again
    assert [t.params["x"] for t in trials(out)].count(7.0) == 1
    cfg = load_config(tune.CONFIG, ["space={x: {type: float, low: 0, high: 1}}", "enqueue=[{y: 1}]"])
    with pytest.raises(ConfigError, match=r"enqueue\[0\]: \['y'\] not in space"):
        tune.check_config(cfg)
    cfg = load_config(tune.CONFIG, ["space={x: {type: categorical, choices: [4, 8]}}", "enqueue=[{x: 6}]"])
    with pytest.raises(ConfigError, match=r"enqueue\[0\]: x=6 is outside space.x"):
        tune.check_config(cfg)


def test_the_progress_line_names_the_trial_that_ran_and_a_second_study_needs_its_own_folder(tmp_path):
    """With a point enqueued the line named the queued trial ("trial 1: waiting"); a second study
    in the same folder overwrote the first one's trial folders (its best.yaml then held the other
    study's values)."""
    stdout = tune_run(
        *study_args(tmp_path, "n_trials=2", "pruner=none", "enqueue=[{x: 7.0}, {x: 1.5}]", "base=[steps=1]")
    )
    assert "trial 0: complete eval/score=10.0 {'x': 7.0}" in stdout and "waiting" not in stdout
    r = run_module("rl2gem.trainers.tune", *study_args(tmp_path, "study_name=other", "n_trials=1"))
    assert r.returncode == 2 and f"output_dir={tmp_path} holds study 'tune'" in r.stderr


def test_a_pruned_trial_stops_every_process_under_it(tmp_path):
    out = tmp_path / "study"
    args = study_args(out, "enqueue=[{x: 7.0}, {x: 0.0}]", "pruner_startup_trials=1", "n_trials=2")
    tune_run(*args, "base=[worker=1, seconds_per_step=1.0, steps=8]")
    assert [t.state.name for t in trials(out)] == ["COMPLETE", "PRUNED"]
    for trial in ("trial-0", "trial-1"):  # the pruned trial's worker too, though it is in its own session
        pid = int((out / trial / "worker.pid").read_text())
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def _running(argument: str) -> bool:
    """Whether a process (not a zombie) has ``argument`` in its command line."""
    for process in psutil.process_iter(["cmdline", "status"]):
        if process.info["status"] != psutil.STATUS_ZOMBIE and any(
            argument in part for part in process.info["cmdline"] or []
        ):
            return True
    return False


def test_a_killed_study_resumes_and_reruns_the_interrupted_trial(tmp_path):
    out = tmp_path / "study"
    args = study_args(out, "n_trials=2", "pruner=none", "base=[seconds_per_step=0.5, steps=12]")
    proc = subprocess.Popen(
        [sys.executable, "-m", "rl2gem.trainers.tune", *args],
        cwd=ROOT,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 120
        while not (out / "trial-1" / "metrics.jsonl").exists():  # the second trial is running
            assert proc.poll() is None and time.time() < deadline
            time.sleep(0.1)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # tune; its trial runs in a session of its own
        proc.wait()
    # the interrupted trial (in a session of its own) ends with its tuner: it trained on beside the
    # resumed study
    deadline = time.time() + 3  # well before its 12 steps of 0.5 s end
    while _running(str(out / "trial-1")) and time.time() < deadline:
        time.sleep(0.1)
    assert not _running(str(out / "trial-1"))
    before = trials(out)
    assert [t.state.name for t in before] == ["COMPLETE", "RUNNING"]
    time.sleep(2 * tune.HEARTBEAT_SECONDS + 1)  # the killed trial's heartbeat goes stale
    tune_run(*args)
    after = trials(out)
    assert [t.state.name for t in after] == ["COMPLETE", "FAIL", "COMPLETE"]
    assert after[2].params == before[1].params  # the interrupted trial again, same value
    assert after[2].system_attrs.get("failed_trial") == before[1].number


# slow: the README's tune command runs a real PPO trial in its short form
@pytest.mark.slow
def test_one_real_ppo_trial(tiny_dir, tmp_path):
    out = tmp_path / "ppo"
    tune_run(
        "trainer=ppo",
        "nproc_per_node=1",
        f"base=[env=rl2/ReasoningGym-v0, env_kwargs.task=basic_arithmetic, actor.model={tiny_dir}, "
        "rollout.prompts_per_rollout=1, rollout.responses_per_prompt=2, rollout.max_new_tokens=4, "
        "trainer.total_steps=1, trainer.eval_n=2]",
        "space={actor.lr: {type: categorical, choices: [0.001]}, adv.estimator: {type: categorical, choices: [rloo]}}",
        "metric=eval/reward",
        "n_trials=1",
        f"output_dir={out}",
    )
    [trial] = trials(out)
    assert trial.state.name == "COMPLETE" and set(trial.intermediate_values) == {0, 1}  # eval at start and end
    assert (out / "trial-0" / "metrics.jsonl").exists() and not list((out / "trial-0").glob("checkpoint-*"))
    from rl2gem.trainers import ppo

    cfg = load_config(ppo.CONFIG, [f"config={out / 'best.yaml'}"])  # the best recipe is a valid PPO recipe
    assert cfg.actor.lr == 0.001 and cfg.adv.estimator == "rloo" and cfg.trainer.output_dir == str(out / "best")
