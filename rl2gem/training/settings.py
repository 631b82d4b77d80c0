"""The settings of a worker (a trained or frozen model on the device mesh), typed, with their
defaults in one place.

Every trainer's ``actor:`` section holds these keys (plus its own: the PPO loss, ...), and a PPO
critic's section overrides some of them. The library reads a section through
:meth:`WorkerSettings.from_section` (a key the section lacks takes the default here), never with
``section.get(key, default)``; the trainers' YAML files list the same keys with the same defaults
(``tests/training/test_settings.py`` fails when one drifts) so ``--help`` shows them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["LoraSettings", "SCHEDULES", "WorkerSettings", "is_length_setting", "resolve_compile"]

#: ``scheduler``: the learning rate after warm-up.
SCHEDULES = ("constant", "linear", "cosine")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class LoraSettings:
    """``actor.lora``: LoRA adapters (peft; :func:`rl2gem.training.lora.lora_config`).

    Attributes:
        rank: adapter rank; 0 turns LoRA off (every weight trains).
        alpha: output scale ``alpha / rank`` (``alpha / sqrt(rank)`` with ``rslora``).
        dropout: on the adapter's input, in training only; in [0, 1).
        target_modules: ``all-linear`` (every linear layer but the LM head) or module names.
        rslora: rank-stabilised scaling.
    """

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: Any = "all-linear"
    rslora: bool = False

    @classmethod
    def from_section(cls, section: Mapping[str, Any] | None) -> LoraSettings:
        """The settings of a ``lora:`` mapping (None or empty, or a key set to null: the defaults).

        Raises:
            ValueError: a key that is not a LoRA setting.
        """
        values = dict(section or {})
        names = [field.name for field in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise ValueError(f"actor.lora: unknown keys {unknown} (known: {names})")
        return cls(**{key: value for key, value in values.items() if value is not None})  # null: the default

    def problems(self) -> list[str]:
        """What cannot work, each ``lora.<key>: ...``."""
        out = []
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 0:
            out.append(f"lora.rank: expected an int >= 0 (0: off), got {self.rank!r}")
        if not _number(self.alpha) or self.alpha <= 0:
            out.append(f"lora.alpha: expected a number > 0, got {self.alpha!r}")
        if not _number(self.dropout) or not 0 <= self.dropout < 1:
            out.append(f"lora.dropout: expected a number in [0, 1), got {self.dropout!r}")
        targets = self.target_modules
        names = [targets] if isinstance(targets, str) else list(targets) if isinstance(targets, Sequence) else None
        if not names or not all(isinstance(name, str) and name for name in names):
            out.append(f"lora.target_modules: expected all-linear or a non-empty list of module names, got {targets!r}")
        elif isinstance(targets, str) and "," in targets:  # one module named "q_proj,v_proj" for peft
            out.append(f"lora.target_modules: a list is written [{targets}], got the one name {targets!r}")
        elif any(name in ("lm_head", "embed_tokens") for name in names):
            out.append(
                f"lora.target_modules: {sorted(set(names) & {'lm_head', 'embed_tokens'})} cannot be adapted here "
                "(the LM head and the embeddings are tied or not linear layers the merge handles); "
                "adapt the decoder layers' projections"
            )
        return out


def resolve_compile(settings: WorkerSettings, device_type: str) -> bool:
    """``settings.compile`` (``actor.compile``) on a device of type ``device_type`` (``"cuda"``,
    ``"cpu"``...). ``auto`` is on for CUDA without tensor or sequence parallelism or CPU offload.
    Only one-rank FSDP has run compiled on a GPU; FSDP and HSDP over more ranks run the same
    per-layer code, and TP, SP and offload change it. On one H200 compiled layers ran SFT at 235k / 245k
    tokens/s (mixed / long rows) against 184k / 194k eager (141.6M Llama, 2026-11-25), and PPO,
    DPO, RM and SFT passed their GPU tests compiled at one rank (2026-11-27;
    ``benchmarks/RESULTS.md``); on the 2-core CPU Inductor's C++ compile costs more than it saves.

    Raises:
        ValueError: a value other than ``auto``, true or false (the message starts with the key).
    """
    value = settings.compile
    if value == "auto":
        untested = int(settings.tp_size) > 1 or int(settings.sp_size) > 1 or bool(settings.cpu_offload)
        return device_type == "cuda" and not untested
    if isinstance(value, bool):
        return value
    raise ValueError(f"compile: expected true, false or auto, got {value!r}")


def is_length_setting(value) -> bool:
    """Whether ``value`` is a ``max_length_per_device``: a positive integer or ``auto``."""
    return value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value > 0)


@dataclasses.dataclass(frozen=True)
class WorkerSettings:
    """A worker's settings (:class:`rl2gem.training.Worker`, :class:`rl2gem.training.autosize.MaxLength`,
    :func:`rl2gem.training.setup_distributed`).

    Attributes:
        model: built-in name, folder or hub id (no download at run time).
        dtype: the compute dtype: ``auto`` (float32 on CPU, bfloat16 on CUDA), ``float32`` or ``bfloat16``.
        master_dtype: the trainable parameters' and optimizer state's (a LoRA base stays in
            ``dtype``): ``auto`` (float32 for a trainable
            worker computing in bfloat16: FSDP2 mixed precision; :func:`rl2gem.models.resolve_master_dtype`)
            or a dtype name (``bfloat16`` with ``dtype=bfloat16``: pure bfloat16, half the memory).
        lr, weight_decay: AdamW's.
        warmup_steps: linear warm-up of the learning rate, in optimizer steps.
        scheduler: after warm-up: ``constant``, ``linear`` or ``cosine`` (decay to 0 at the run's end).
        max_grad_norm: gradient clipping (global L2 norm over ranks).
        attention: the packed rows' kernel: ``auto``, ``flex``, ``flash``, ``sdpa`` or ``block``
            (:func:`rl2gem.parallel.attention.resolve_attention`).
        compile: ``torch.compile`` each decoder layer: ``auto`` (on CUDA at ``tp_size`` and
            ``sp_size`` 1 without ``cpu_offload``, not elsewhere; :func:`resolve_compile`),
            ``true`` or ``false``.
        packing: ``flat`` (one row of concatenated sequences) or ``tree`` (their prefix tree).
        max_length_per_device: tokens per rank in a packed micro-batch (times ``sp_size * tp_size``),
            or ``auto``: on CUDA the longest that fits ``memory_fraction`` (probed at start), else
            the trainer's CPU length, 2048 for PPO and 4096 for SFT, DPO and RM
            (:mod:`rl2gem.training.autosize`).
        cpu_max_length_per_device: with ``auto`` off CUDA, this length (a positive integer; a
            recipe sized for a CPU sets it and leaves CUDA to the probe), or None: the trainer's.
        memory_fraction: with ``auto``: the share of free device memory to plan for.
        oom_backoff: out of memory in a step: halve ``max_length_per_device`` and run it again.
        ddp_size, tp_size, sp_size: HSDP replicas, tensor-parallel and sequence-parallel ranks.
        cpu_offload: FSDP2 parameter offload to the host.
        gradient_checkpointing: recompute activations in the backward pass.
        reshard_after_forward: FSDP2 frees the gathered parameters after each forward. Not for a
            model that is one FSDP unit (one rank under mixed precision,
            :func:`~rl2gem.parallel.fsdp.root_unit_fits`): it keeps its compute-dtype copy
            through the backward, which would otherwise cast the whole model again.
        lora: :class:`LoraSettings`.
    """

    model: str | None = "smollm2-135m-instruct"
    dtype: str = "auto"
    master_dtype: str = "auto"
    lr: float = 1e-6
    weight_decay: float = 0.0
    warmup_steps: int = 0
    scheduler: str = "constant"
    max_grad_norm: float = 1.0
    attention: str = "auto"
    compile: bool | str = "auto"
    packing: str = "flat"
    max_length_per_device: int | str = "auto"
    cpu_max_length_per_device: int | None = None
    memory_fraction: float = 0.8
    oom_backoff: bool = True
    ddp_size: int = 1
    tp_size: int = 1
    sp_size: int = 1
    cpu_offload: bool = False
    gradient_checkpointing: bool = False
    reshard_after_forward: bool = True
    lora: LoraSettings = dataclasses.field(default_factory=LoraSettings)

    @classmethod
    def from_section(cls, section: WorkerSettings | Mapping[str, Any]) -> WorkerSettings:
        """The worker settings of a config section (a dict or an OmegaConf node): its keys that
        are worker settings, the defaults for those it lacks; its other keys (a trainer's loss
        settings) are not the worker's and are left to the trainer.

        Raises:
            ValueError: a bad ``lora`` section (:meth:`LoraSettings.from_section`).
        """
        if isinstance(section, WorkerSettings):
            return section
        names = {field.name for field in dataclasses.fields(cls)}
        values = {key: section[key] for key in section if key in names}
        if "lora" in values:
            values["lora"] = LoraSettings.from_section(values["lora"])
        return cls(**values)

    def problems(self) -> list[str]:
        """What cannot work in the numbers and names a worker only reads once it is built (the
        optimizer, the schedule, the mesh, LoRA), each ``<key>: ...``; checked before anything loads."""
        out = []
        bounds = {
            "lr": (0, False),
            "max_grad_norm": (0, False),
            "weight_decay": (0, True),
            "memory_fraction": (0, False),
        }
        for key, (low, inclusive) in bounds.items():
            value = getattr(self, key)
            if not _number(value) or value < low or (value == low and not inclusive):
                out.append(f"{key}: expected a number {'>=' if inclusive else '>'} {low}, got {value!r}")
        if _number(self.memory_fraction) and self.memory_fraction > 1:
            out.append(f"memory_fraction: expected a share of the device in (0, 1], got {self.memory_fraction!r}")
        for key, low in (("warmup_steps", 0), ("ddp_size", 1), ("tp_size", 1), ("sp_size", 1)):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                out.append(f"{key}: expected an int >= {low}, got {value!r}")
        if self.scheduler not in SCHEDULES:
            out.append(f"scheduler: expected one of {list(SCHEDULES)}, got {self.scheduler!r}")
        if isinstance(self.tp_size, int) and self.tp_size > 1 and _number(self.lora.rank) and self.lora.rank > 0:
            out.append(
                f"lora.rank: LoRA with tp_size={self.tp_size} is not supported: use tp_size 1 (FSDP shards the base)"
            )
        return out + self.lora.problems()
