"""A bad config value stops every trainer before anything loads, with one line naming the key."""

import os
import subprocess
import sys

import pytest
from helpers import ROOT
from rl2gem.trainers import dpo, ppo, rm, sft

from rl2gem.training.trainer import launch


class MustNotBuild:
    """A trainer whose construction fails the test: nothing may load before the config is checked."""

    def __init__(self, cfg):
        raise AssertionError(f"the trainer was built with a bad config: {cfg}")


CASES = [
    ("actor.lr=abc", "config error: actor.lr: expected a float, got 'abc'"),
    ("rollout.responses_per_prompt=0", "config error: rollout.responses_per_prompt: must be >= 1, got 0"),
    ("trainer.total_steps=-1", "config error: trainer.total_steps: must be >= 0, got -1"),
    ("config=no_such_recipe", "config error: config=no_such_recipe: no such recipe file"),
    ("env=rl2/NoSuchEnv-v0", "config error: env: Environment `NoSuchEnv` doesn't exist in namespace rl2"),
    ("actor.model=/no/such/model", "config error: actor.model: no such model folder '/no/such/model'"),
]


@pytest.mark.parametrize(("argument", "line"), CASES)
def test_ppo_refuses_a_bad_value_before_building_anything(argument, line, capsys):
    assert launch(MustNotBuild, ppo.CONFIG, ppo.check_config, [argument]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(line), err


@pytest.mark.parametrize("trainer", [sft, rm, dpo])
def test_every_trainer_checks_types_and_models(trainer, capsys):
    for argument, line in [CASES[0], CASES[-1]]:
        assert launch(MustNotBuild, trainer.CONFIG, trainer.check_config, [argument]) == 2
        assert capsys.readouterr().err.strip().startswith(line)


def test_under_torchrun_the_error_is_one_line_and_no_model_is_fetched(tmp_path):
    """The README's command with a typo'd value: exit non-zero, the line, an untouched model cache."""
    cache = tmp_path / "cache"
    cache.mkdir()
    env = {**os.environ, "RL2GEM_CACHE": str(cache)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
    r = subprocess.run(
        [*command, str(ROOT / "trainers" / "ppo.py"), "actor.lr=abc"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode != 0
    assert "config error: actor.lr: expected a float, got 'abc'" in r.stderr
    assert "Traceback" not in r.stderr.split("config error")[0]  # nothing failed before the check
    assert list(cache.iterdir()) == []  # no model (nor data) was fetched or converted
