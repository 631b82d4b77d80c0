"""Worker settings: the library's defaults in one dataclass, read without ``get(key, default)``,
and the trainers' YAML files (which list the keys for ``--help``) in step with them."""

import dataclasses

import pytest
from omegaconf import OmegaConf
from rl2gem.trainers import dpo, ppo, rm, sft

from rl2gem.training.lora import lora_config
from rl2gem.training.settings import LoraSettings, WorkerSettings

#: Where a trainer's YAML deliberately differs from the library's default.
OVERRIDES = {
    "sft": {"lr": 1.0e-5, "max_length_per_device": 4096},
    "rm": {"lr": 1.0e-5, "max_length_per_device": 4096},
    "dpo": {"max_length_per_device": 4096},
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
    assert (settings.model, settings.lr, settings.dtype, settings.max_length_per_device) == ("m", 0.5, "auto", 2048)
    assert settings.lora == LoraSettings(rank=4) and settings.lora.alpha == 16.0
    assert WorkerSettings.from_section(settings) is settings
    with pytest.raises(ValueError, match=r"actor.lora: unknown keys \['ranks'\]"):
        WorkerSettings.from_section({"lora": {"ranks": 4}})
    config = lora_config({"rank": 4})  # the alpha default is the one in LoraSettings
    assert config.r == 4 and config.lora_alpha == 16.0 and lora_config(LoraSettings()) is None
