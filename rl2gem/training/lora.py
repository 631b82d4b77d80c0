"""LoRA adapters for a trained causal LM (``actor.lora.*``), through the ``peft`` library.

LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", arXiv:2106.09685)
freezes each target weight ``W`` (shape ``[out, in]``) and trains ``A`` (``[r, in]``, Kaiming
uniform at start) and ``B`` (``[out, r]``, zero at start): the layer computes
``W x + s * B (A x)`` with ``s = alpha / r`` (``alpha / sqrt(r)`` with rsLoRA, Kalajdzievski
2023, arXiv:2312.03732), so the model starts exactly as the base model.

How the training core uses it:

* :func:`lora_config` reads ``actor.lora`` (``rank: 0`` turns LoRA off) into a
  ``peft.LoraConfig``; :func:`rl2gem.parallel.fsdp.load_sharded` injects the adapter layers
  (``peft.inject_adapter_in_model``) into the meta-device model before FSDP2 shards it, so every
  rank holds shards of the frozen base and of the adapters, and rank 0's initial adapter values
  are broadcast like the base weights. Only adapter parameters have ``requires_grad``, so the
  optimizer holds states for them only.
* :func:`merged_state_dict` turns the model's full state dict (peft's names:
  ``...q_proj.base_layer.weight``, ``...q_proj.lora_A.default.weight``) into the base model's
  names with ``W + s * B A`` merged in: what a rollout engine loads and what the Hugging Face
  export writes, so evaluation and the next stage read a plain model.
* :func:`adapter_state_dict` and :func:`save_adapter` write the adapter alone in peft's format
  (``adapter_config.json`` and ``adapter_model.safetensors``), which
  ``peft.PeftModel.from_pretrained`` and SGLang's ``/load_lora_adapter`` read; :func:`load_adapter`
  and :func:`merge_adapter` read it back and merge it into base weights (``rl2gem.serve``'s
  ``/load_lora_adapter``).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from rl2gem.training.settings import LoraSettings

__all__ = [
    "ADAPTER",
    "adapter_state_dict",
    "inject",
    "load_adapter",
    "lora_config",
    "merge_adapter",
    "merged_state_dict",
    "save_adapter",
]

#: The adapter's name inside the model (peft's default).
ADAPTER = "default"


def lora_config(section: LoraSettings | Mapping[str, Any] | None):
    """A ``peft.LoraConfig`` from ``actor.lora``, or None when ``rank`` is 0 or the section is absent.

    Args:
        section: :class:`rl2gem.training.settings.LoraSettings`, or a mapping of its keys (a key it
            lacks takes the default there): ``rank`` (0 = off), ``alpha`` (the scale is
            ``alpha / rank``), ``dropout`` (on the adapter's input, training only),
            ``target_modules`` (a list of module names such as ``q_proj``, or ``all-linear``: every
            linear layer but the LM head), ``rslora`` (scale ``alpha / sqrt(rank)``).

    Raises:
        ValueError: an unknown key, a negative rank, a non-positive alpha, a dropout outside [0, 1)
            or an empty ``target_modules``.
    """
    settings = section if isinstance(section, LoraSettings) else LoraSettings.from_section(section)
    rank = int(settings.rank or 0)
    if rank < 0:
        raise ValueError(f"actor.lora.rank must be >= 0 (0 turns LoRA off), got {rank}")
    if rank == 0:
        return None
    alpha, dropout, targets = float(settings.alpha), float(settings.dropout), settings.target_modules
    if alpha <= 0:
        raise ValueError(f"actor.lora.alpha must be > 0, got {alpha}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"actor.lora.dropout must be in [0, 1), got {dropout}")
    if isinstance(targets, str):
        targets = targets if targets == "all-linear" else [targets]
    else:
        targets = [str(t) for t in targets]
    if not targets:
        raise ValueError("actor.lora.target_modules is empty")
    from peft import LoraConfig

    return LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=targets,
        use_rslora=bool(settings.rslora),
        bias="none",
        task_type="CAUSAL_LM",
    )


def scaling(config) -> float:
    """The adapter's output scale ``s``: ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA."""
    return float(config.lora_alpha) / (config.r**0.5 if config.use_rslora else config.r)


def _parts(name: str) -> tuple[str, str] | None:
    """``(module, kind)`` of a peft parameter name (kind ``base`` / ``A`` / ``B``), else None."""
    for suffix, kind in (
        (".base_layer.weight", "base"),
        (f".lora_A.{ADAPTER}.weight", "A"),
        (f".lora_B.{ADAPTER}.weight", "B"),
    ):
        if name.endswith(suffix):
            return name[: -len(suffix)], kind
    return None


def merged_state_dict(state: Mapping[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """The base model's state dict with every adapter merged: ``W + s * B @ A`` under ``W``'s name.

    Args:
        state: a full state dict of a model with injected adapters (any float dtype: the product
            is taken in float32 and cast back to ``W``'s dtype; each merged weight stays on ``W``'s
            device, a GPU's weight sync never round-trips through host memory).
        config: its ``peft.LoraConfig`` (for the scale).

    Returns:
        A new dict; names as in the base model (``base_layer.`` removed, adapter entries dropped).

    Raises:
        KeyError: an adapter whose layer is missing.
    """
    base = {name.replace(".base_layer.", "."): t for name, t in state.items() if ".lora_" not in name}
    return {**base, **merge_adapter(base, adapter_state_dict(state, device=None), config)}


def merge_adapter(
    base: Mapping[str, torch.Tensor], adapter: Mapping[str, torch.Tensor], config
) -> dict[str, torch.Tensor]:
    """The adapted weights only, merged: ``{"<module>.weight": W + s * B @ A}`` for each module of
    ``adapter`` (peft's saved names, :func:`adapter_state_dict`), ``W`` taken from ``base`` (the
    base model's names). Float32 product, cast to ``W``'s dtype and device.

    Raises:
        KeyError: a module of the adapter with no weight in ``base``, or an ``A`` without its ``B``.
    """
    s = scaling(config)
    out = {}
    prefix = "base_model.model."
    for name, a in adapter.items():
        if not name.endswith(".lora_A.weight"):
            continue
        module = (
            name[len(prefix) : -len(".lora_A.weight")] if name.startswith(prefix) else name[: -len(".lora_A.weight")]
        )
        b = adapter[name.replace(".lora_A.weight", ".lora_B.weight")]
        w = base[f"{module}.weight"]
        delta = b.float().to(w.device) @ a.float().to(w.device)
        out[f"{module}.weight"] = (w.float() + s * delta).to(w.dtype)
    return out


def load_adapter(path: str | Path):
    """``(config, tensors)`` of an adapter folder in peft's format (what :func:`save_adapter` writes).

    Raises:
        FileNotFoundError: no ``adapter_config.json`` / ``adapter_model.safetensors`` there.
        ValueError: an adapter that is not LoRA, or one the merge cannot apply exactly (per-module
            ranks or scales, DoRA, saved modules, embedding adapters).
    """
    from peft import LoraConfig
    from safetensors.torch import load_file

    path = Path(path)
    for file in ("adapter_config.json", "adapter_model.safetensors"):
        if not (path / file).is_file():
            raise FileNotFoundError(f"{path / file} does not exist (a peft LoRA adapter folder has both files)")
    config = LoraConfig.from_pretrained(str(path))
    if str(getattr(config, "peft_type", "LORA")).upper().split(".")[-1] != "LORA":
        raise ValueError(f"{path}: not a LoRA adapter ({config.peft_type})")
    # one scale alpha / r for every module and plain B @ A: what merge_adapter applies
    unsupported = [
        option
        for option in ("alpha_pattern", "rank_pattern", "use_dora", "modules_to_save")
        if getattr(config, option, None)
    ]
    if unsupported:
        raise ValueError(f"{path}: the adapter uses {unsupported}, which the merge here does not apply")
    tensors = load_file(str(path / "adapter_model.safetensors"))
    other = sorted(name for name in tensors if not name.endswith((".lora_A.weight", ".lora_B.weight")))
    if other:
        raise ValueError(f"{path}: tensors other than linear LoRA pairs, e.g. {other[:3]} (the merge would drop them)")
    return config, tensors


def adapter_state_dict(
    state: Mapping[str, torch.Tensor], device: str | torch.device | None = "cpu"
) -> dict[str, torch.Tensor]:
    """The adapter's tensors under peft's saved names (``base_model.model.<module>.lora_A.weight``),
    on ``device`` (None: where they are)."""
    out = {}
    for name, tensor in state.items():
        parts = _parts(name)
        if parts is not None and parts[1] != "base":
            tensor = tensor.detach() if device is None else tensor.detach().to(device)
            out[f"base_model.model.{parts[0]}.lora_{parts[1]}.weight"] = tensor.contiguous()
    return out


def target_names(state: Mapping[str, torch.Tensor]) -> list[str]:
    """The short names of the adapted modules (``q_proj``, ...), sorted: what SGLang's
    ``--lora-target-modules`` must list."""
    return sorted({p[0].rsplit(".", 1)[-1] for n in state if (p := _parts(n)) is not None and p[1] == "A"})


def save_adapter(path: str | Path, state: Mapping[str, torch.Tensor], config, base_model: str | None = None) -> Path:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` into ``path`` (peft's format).

    Args:
        state: the model's full state dict (peft names, see :func:`merged_state_dict`).
        config: its ``peft.LoraConfig``.
        base_model: written as ``base_model_name_or_path`` (the model the adapter applies to).

    Returns ``path``.
    """
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(config)
    config.target_modules = set(target_names(state))  # the resolved list ("all-linear" expanded)
    config.base_model_name_or_path = base_model
    config.save_pretrained(str(path))
    save_file(adapter_state_dict(state), str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    return path


def inject(model, config, trainable: Sequence[str] = ()) -> None:
    """Add ``config``'s adapter layers to ``model`` in place (``peft.inject_adapter_in_model``) and
    freeze every parameter but the adapters' (and those whose names contain one of ``trainable``)."""
    from peft import inject_adapter_in_model

    inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    not_linear = sorted({name.split(".lora_")[0] for name, _ in model.named_parameters() if ".lora_embedding_" in name})
    if not_linear:  # peft adapts embeddings with other tensors, which the merge into the engine and export miss
        raise ValueError(
            f"actor.lora.target_modules: LoRA here adapts linear layers only, not the embedding(s) {not_linear}"
        )
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(".lora_" in name or any(t in name for t in trainable))
