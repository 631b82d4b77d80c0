"""Worker and rollout settings: the library's defaults in one dataclass each, read without
``get(key, default)``, and the trainers' YAML files and the eval CLI's defaults (which list the keys
for ``--help``) in step with them, every difference declared."""

import dataclasses

import pytest
from omegaconf import OmegaConf
from rl2gem.trainers import dpo, ppo, rm, sft

from rl2gem.training.lora import lora_config
from rl2gem.training.settings import LoraSettings, WorkerSettings, resolve_compile

#: Where a trainer's YAML deliberately differs from the library's default.
OVERRIDES = {
    "sft": {"lr": 1.0e-5},
    "rm": {"lr": 1.0e-5},
}
#: Worker settings a trainer does not offer (its YAML leaves them out, so setting one is an error).
NOT_OFFERED = {"sft": {"packing"}, "rm": {"packing", "lora"}}


@pytest.mark.parametrize("trainer", [ppo, sft, rm, dpo], ids=lambda module: module.__name__.rsplit(".", 1)[1])
def test_each_trainer_yaml_lists_the_worker_settings_with_the_library_defaults(trainer):
    name = trainer.__name__.rsplit(".", 1)[1]
    actor = OmegaConf.to_container(OmegaConf.load(trainer.CONFIG).actor)
    defaults = dataclasses.asdict(WorkerSettings())
    assert set(defaults) - set(actor) == NOT_OFFERED.get(name, set())
    expected = {**defaults, **OVERRIDES.get(name, {})}
    assert {key: actor[key] for key in defaults if key in actor} == {
        key: value for key, value in expected.items() if key in actor
    }


def test_a_section_takes_the_defaults_it_lacks_and_leaves_other_keys_to_the_trainer():
    settings = WorkerSettings.from_section({"model": "m", "lr": 0.5, "clip_low": 0.2, "lora": {"rank": 4}})
    assert (settings.model, settings.lr, settings.dtype, settings.max_length_per_device) == ("m", 0.5, "auto", "auto")
    assert settings.lora == LoraSettings(rank=4) and settings.lora.alpha == 16.0
    assert WorkerSettings.from_section(settings) is settings
    with pytest.raises(ValueError, match=r"actor.lora: unknown keys \['ranks'\]"):
        WorkerSettings.from_section({"lora": {"ranks": 4}})
    config = lora_config({"rank": 4})  # the alpha default is the one in LoraSettings
    assert config.r == 4 and config.lora_alpha == 16.0 and lora_config(LoraSettings()) is None


#: Where ppo.yaml's ``rollout:`` section deliberately differs from :class:`RolloutConfig`'s default:
#: CPU-sized actions and sequences (the library's defaults suit served models).
ROLLOUT_OVERRIDES = {"max_new_tokens": 64, "max_length": 1024}
#: RolloutConfig fields the trainer sets itself rather than from its YAML.
ROLLOUT_NOT_OFFERED = {"top_k", "seed", "progress"}
#: Where the eval CLI's defaults deliberately differ: greedy, one episode per task, room for long
#: answers and episodes (max_length None: the model's whole context), a progress bar on the terminal.
EVALUATE_OVERRIDES = {
    "temperature": 0.0,
    "responses_per_prompt": 1,
    "max_new_tokens": 512,
    "max_length": None,
    "progress": True,
}


def test_rollout_defaults_live_in_rollout_config_and_every_difference_is_declared():
    """ppo.yaml's rollout section and the eval CLI's defaults list RolloutConfig's fields with its
    defaults, except where declared above: a default changed in one place only fails here."""
    from rl2gem.evaluation import DEFAULTS
    from rl2gem.rollout import RolloutConfig
    from rl2gem.training.rl_config import TRAINER_ROLLOUT_KEYS

    defaults = dataclasses.asdict(RolloutConfig())
    section = OmegaConf.to_container(OmegaConf.load(ppo.CONFIG).rollout)
    assert set(defaults) - set(section) == ROLLOUT_NOT_OFFERED
    assert set(section) - set(defaults) <= set(TRAINER_ROLLOUT_KEYS)  # the trainer's own keys
    expected = {**defaults, **ROLLOUT_OVERRIDES}
    assert {key: section[key] for key in defaults if key in section} == {
        key: value for key, value in expected.items() if key in section
    }
    shared = {key: DEFAULTS[key] for key in defaults if key in DEFAULTS}
    assert shared == {key: {**defaults, **EVALUATE_OVERRIDES}[key] for key in shared}


#: Keys the trainers' YAML files share but set differently on purpose, with why.
DIFFERENT_ON_PURPOSE = {
    "actor.lr": "RL steps are smaller than supervised ones",
    "rollout.max_length": "PPO's CPU-sized episodes; the offline trainers' evaluations play longer ones",
    "rollout.max_new_tokens": "likewise",
    "rollout.temperature": "PPO samples; the offline trainers evaluate greedily",
    "trainer.eval_seed": "PPO's evaluation episodes are seeded far from its training episodes",
    "trainer.output_dir": "one folder per trainer",
    "trainer.total_steps": "PPO has no epochs: a step count; the offline trainers default to their epochs",
}


def test_a_key_the_trainers_share_has_one_default_unless_declared():
    """Across ppo.yaml, sft.yaml, rm.yaml and dpo.yaml, a key present in several has the same
    default everywhere, or is in DIFFERENT_ON_PURPOSE (and that table holds no stale entry)."""

    def leaves(node, prefix=""):
        if isinstance(node, dict) and node:
            return {k: v for key, value in node.items() for k, v in leaves(value, f"{prefix}{key}.").items()}
        return {prefix.rstrip("."): node}

    flat = {t.__name__: leaves(OmegaConf.to_container(OmegaConf.load(t.CONFIG))) for t in (ppo, sft, rm, dpo)}
    differing = set()
    for key in set().union(*flat.values()):
        values = {repr(keys[key]) for keys in flat.values() if key in keys}
        if len(values) > 1:
            differing.add(key)
    assert differing == set(DIFFERENT_ON_PURPOSE)


def test_compile_auto_is_on_for_cuda_at_one_model_parallel_rank_and_a_bool_is_kept():
    def resolve(device_type, **values):
        return resolve_compile(WorkerSettings(**values), device_type)

    assert WorkerSettings().compile == "auto"
    assert resolve("cuda") is True
    assert resolve("cpu") is False and resolve("mps") is False
    # layouts that have not run compiled on a GPU stay eager under auto, compile when asked
    for untested in ({"tp_size": 2}, {"sp_size": 2}, {"cpu_offload": True}):
        assert resolve("cuda", **untested) is False and resolve("cuda", compile=True, **untested) is True
    assert resolve("cuda", compile=False) is False and resolve("cpu", compile=True) is True
    with pytest.raises(ValueError, match="^compile: expected true, false or auto, got 'yes'"):
        resolve("cuda", compile="yes")
