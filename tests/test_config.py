"""key=value config over YAML defaults, recipes, clear errors."""

import re
from pathlib import Path

import pytest

from rl2gem.config import ConfigError, load_config

ROOT = Path(__file__).parents[1]
PPO = ROOT / "trainers" / "config" / "ppo.yaml"


@pytest.fixture
def defaults(tmp_path):
    (tmp_path / "base.yaml").write_text("env: a\nenv_kwargs: {}\nactor:\n  lr: 1.0\n  model: m\n")
    (tmp_path / "fast.yaml").write_text("actor:\n  lr: 5.0\nenv_kwargs:\n  task: t\n")
    (tmp_path / "bad.yaml").write_text("actor:\n  lrr: 5.0\n")
    return tmp_path / "base.yaml"


def test_overrides_recipes_and_precedence(defaults):
    cfg = load_config(defaults, ["actor.model=x", "env_kwargs.size=3"])
    assert (cfg.actor.lr, cfg.actor.model, cfg.env_kwargs.size) == (1.0, "x", 3)
    cfg = load_config(defaults, ["config=fast"])
    assert (cfg.actor.lr, cfg.env_kwargs.task, cfg.actor.model) == (5.0, "t", "m")
    cfg = load_config(defaults, ["actor.lr=7", "config=fast"])  # command-line keys win over the recipe
    assert cfg.actor.lr == 7


def test_errors_name_the_closest_key_or_the_recipes(defaults):
    with pytest.raises(ConfigError, match="did you mean 'actor.lr'"):
        load_config(defaults, ["actor.lrr=2"])
    with pytest.raises(ConfigError, match="bad.yaml.*did you mean 'actor.lr'"):
        load_config(defaults, ["config=bad"])
    with pytest.raises(ConfigError, match=r"no such recipe.*\['base', 'fast'\]"):  # bad.yaml's keys do not fit
        load_config(defaults, ["config=nope"])
    with pytest.raises(ConfigError, match=r"^actor=\[1\]: Cannot merge incompatible container types"):
        load_config(defaults, ["actor.lr=2", "actor=[1]"])  # a list where the defaults have a mapping
    with pytest.raises(ConfigError, match="key=value"):
        load_config(defaults, ["actor"])


def test_the_shipped_recipes_load_over_the_trainer_defaults():
    folder = ROOT / "trainers" / "config"
    trainers = {p.stem for p in (ROOT / "trainers").glob("*.py") if (folder / f"{p.stem}.yaml").exists()}
    assert {"ppo", "sft", "rm", "dpo"} <= trainers
    for recipe in folder.glob("*.yaml"):
        if recipe.stem in trainers:
            continue
        # a recipe names its command in its header: trainers/<name>.py config=<recipe>
        named = set(re.findall(rf"trainers/(\w+)\.py config={recipe.stem}\b", recipe.read_text()))
        assert len(named) == 1 and named <= trainers, (
            f"{recipe.name} must name its one trainer's command, names {named}"
        )
        load_config(folder / f"{named.pop()}.yaml", [f"config={recipe.stem}"])  # raises on a key the trainer lacks
    base = folder / "ppo.yaml"
    cfg = load_config(base, ["config=arithmetic", "trainer.total_steps=2"])
    assert (
        cfg.env_kwargs.answer == "last_number"
        and list(cfg.env_kwargs.operators) == ["+", "-"]
        and cfg.trainer.total_steps == 2
    )


@pytest.mark.parametrize(
    ("argument", "message"),
    [
        ("actor.lr=abc", "actor.lr: expected a float, got 'abc'"),
        ("trainer.total_steps=2.5", "trainer.total_steps: expected an int, got 2.5"),
        ("rollout.responses_per_prompt=four", "rollout.responses_per_prompt: expected an int, got 'four'"),
        ("trainer.progress=maybe", "trainer.progress: expected a bool (true or false), got 'maybe'"),
    ],
)
def test_a_value_of_the_wrong_type_names_its_key(argument, message):
    with pytest.raises(ConfigError) as caught:
        load_config(PPO, [argument])
    assert str(caught.value) == message


def test_values_that_fit_their_defaults_pass():
    cfg = load_config(PPO, ["actor.lr=3", "actor.max_length_per_device=auto", "rollout.system_prompt=hi"])
    assert cfg.actor.lr == 3 and cfg.actor.max_length_per_device == "auto"
