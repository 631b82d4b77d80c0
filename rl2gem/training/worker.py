"""Model workers: a model on the device mesh with its optimizer, scheduler and gradient clipping.

A :class:`Worker` is what every trainer holds for each model it trains or queries (the actor,
the reference policy, a critic, a reward model): meta-device init on every rank, FSDP2/HSDP
sharding over the mesh's data dims, rank 0's weights broadcast into the shards
(:func:`rl2gem.parallel.fsdp.load_sharded`), optional CPU offload and activation checkpointing,
and for trainable workers AdamW with a warm-up schedule. Its state goes into checkpoints through
:class:`rl2gem.training.checkpoint.Checkpointer`.
"""

from __future__ import annotations

import copy
import math
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import FSDPModule

from rl2gem.models import resolve_dtype, resolve_master_dtype, resolve_model
from rl2gem.parallel.attention import resolve_attention
from rl2gem.parallel.fsdp import clip_grad_norm, full_state_dict, head_class, init_distributed, load_sharded
from rl2gem.parallel.mesh import ParallelMesh, build_mesh
from rl2gem.training import lora
from rl2gem.training.settings import SCHEDULES, WorkerSettings, resolve_compile

__all__ = ["Worker", "resolve_dtype", "setup_distributed", "SCHEDULES"]


def setup_distributed(seed: int, section: Mapping[str, Any]) -> tuple[int, int, torch.device, ParallelMesh]:
    """Join the torchrun process group (a 1-process one without torchrun), give each local rank
    its share of the CPU threads, seed torch, and build the mesh from ``section``'s
    ``ddp_size`` / ``tp_size`` / ``sp_size``. Returns ``(rank, world, device, mesh)``.

    CPU threads: with one rank per node, ``OMP_NUM_THREADS`` where it is set, else every CPU; with
    ``LOCAL_WORLD_SIZE`` ranks, the node's CPUs divided by it (torchrun then sets
    ``OMP_NUM_THREADS=1`` itself, so that value is not the user's). The number is process-wide: it
    also sizes the OpenMP teams of threads started later (the embedded engine's). More threads
    than free cores make OpenMP's fork and join wait on descheduled threads: with 2 threads on
    2 cores that another process kept busy, a decode of the tiny test model ran up to 70x slower.

    Raises:
        ValueError: sizes that do not fit the world size (see :func:`rl2gem.parallel.mesh.build_mesh`).
    """
    rank, world, device = init_distributed()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if device.type == "cpu" and (local > 1 or not os.environ.get("OMP_NUM_THREADS")):
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    torch.manual_seed(seed)
    settings = WorkerSettings.from_section(section)
    mesh = build_mesh(int(settings.ddp_size), int(settings.tp_size), int(settings.sp_size))
    return rank, world, device, mesh


def cast_floating(state: Mapping[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """``state`` with its floating tensors in ``dtype`` (None: as they are); others kept."""
    return {k: v.to(dtype) if dtype is not None and v.is_floating_point() else v for k, v in state.items()}


def _schedule(kind: str, warmup: int, total: int):
    """Multiplier of the learning rate at optimizer step ``s``: linear warm-up over ``warmup``
    steps, then constant, linear decay to 0 or cosine decay to 0 at ``total``."""
    if kind not in SCHEDULES:
        raise ValueError(f"scheduler must be one of {SCHEDULES}, got {kind!r}")

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if kind == "constant" or total <= warmup:
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 1.0 - progress if kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def fused_adamw(parameters: list[torch.nn.Parameter]) -> bool:
    """Whether the trainers' AdamW is the fused one: on CUDA, every trained parameter there. The
    fused kernel updates every parameter in one launch where the foreach one passes over the
    weights and moments several times. Under tensor parallelism one fused call takes the
    parameters of both meshes (FSDP x TP weights beside FSDP-only norms): with torch 2.11 and 2.13
    its steps equal the foreach ones' (``tests/training/test_worker.py``, on the CPU's fused kernel)."""
    return bool(parameters) and all(p.is_cuda for p in parameters)


class Worker:
    """A model sharded over ``mesh`` and, when ``trainable``, its AdamW optimizer and scheduler.

    Args:
        section: the worker's config (a trainer's ``actor:`` / ``critic:``): ``model``, ``dtype``,
            ``master_dtype`` (float32 master weights under bfloat16 compute by default), ``lr``,
            ``weight_decay``, ``warmup_steps``, ``max_grad_norm``, ``cpu_offload``,
            ``gradient_checkpointing``, ``reshard_after_forward``, ``compile``, ``attention``
            (:func:`rl2gem.parallel.attention.resolve_attention`, with ``packing``), optional ``scheduler``
            (:data:`SCHEDULES`) and ``lora`` (:func:`rl2gem.training.lora.lora_config`; applied to
            trainable causal LMs only, so a reference policy built from the same section is the
            base model). Missing keys take the defaults of ``trainers/config``.
        mesh: from :func:`setup_distributed`.
        device: this rank's device.
        head: ``"lm"`` (a causal LM), ``"value"`` (the backbone with a zero-initialised per-token
            scalar head, for a critic) or ``"reward"`` (a zero-initialised sequence score, for a
            reward model); see :func:`rl2gem.parallel.fsdp.load_sharded`.
        model: overrides ``section.model``.
        trainable: False for frozen workers (a reference policy): eval mode, no optimizer.
        total_steps: optimizer steps of the run (for decaying schedules).

    Raises:
        ValueError: unknown head, dtype or schedule; a bad ``lora`` section, or LoRA with
            ``tp_size`` > 1 (not supported).
    """

    def __init__(
        self,
        section: Mapping[str, Any],
        mesh: ParallelMesh,
        device: torch.device,
        *,
        head: str = "lm",
        model: str | None = None,
        trainable: bool = True,
        total_steps: int = 0,
    ):
        settings = self.settings = WorkerSettings.from_section(section)
        self.name_or_path = model or settings.model
        self.head, self.mesh, self.device = head, mesh, device
        self.dtype = resolve_dtype(settings.dtype, device)  # the forward's and backward's
        self.master_dtype = resolve_master_dtype(settings.master_dtype, self.dtype, trainable)  # the parameters'
        tree = settings.packing == "tree"
        self.attention = resolve_attention(settings.attention, device, tree=tree, dtype=self.dtype)
        self.max_grad_norm = float(settings.max_grad_norm)
        self.lora = lora.lora_config(settings.lora) if trainable and head == "lm" else None
        if self.lora is not None and mesh.tp_mesh is not None:
            raise ValueError("actor.lora with tp_size > 1 is not supported: use tp_size 1 (FSDP shards the base)")
        self.model = load_sharded(
            self.name_or_path,
            mesh.data_mesh,
            device=device,
            dtype=self.dtype,
            master_dtype=self.master_dtype,  # the trainable parameters' (FSDP2 mixed precision when not dtype)
            head=head,
            cpu_offload=bool(settings.cpu_offload),
            reshard_after_forward=bool(settings.reshard_after_forward),
            gradient_checkpointing=trainable and bool(settings.gradient_checkpointing),
            tp_mesh=mesh.tp_mesh,
            sp_group=mesh.sp_group,
            adapt=(lambda model: lora.inject(model, self.lora)) if self.lora is not None else None,
            attention=self.attention,
            compile_layers=resolve_compile(settings, device.type),
        )
        self.optimizer = self.scheduler = None
        self.fused_optimizer = False  # the fused AdamW (:func:`fused_adamw`)
        self.optimizer_steps = 0  # in this process (a resumed run counts from 0)
        self.stepped_lr = 0.0  # the learning rate of the last optimizer step (step())
        if trainable:
            trained = [p for p in self.model.parameters() if p.requires_grad]
            self.fused_optimizer = fused_adamw(trained)
            self.optimizer = torch.optim.AdamW(
                trained,
                lr=float(settings.lr),
                weight_decay=float(settings.weight_decay),
                fused=self.fused_optimizer or None,
            )
            factor = _schedule(settings.scheduler, max(0, int(settings.warmup_steps)), int(total_steps))
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, factor)
        else:
            self.model.eval()
        # a DTensor counts its full shape; adapters are not counted in the FLOPs' model size
        self.num_parameters = sum(p.numel() for n, p in self.model.named_parameters() if ".lora_" not in n)
        self.num_trainable_parameters = sum(p.numel() for p in self.model.parameters() if p.requires_grad)

    @property
    def lr(self) -> float:
        """The learning rate of the next optimizer step (the scheduler's current one)."""
        return self.scheduler.get_last_lr()[0] if self.scheduler else 0.0

    def reshard(self) -> None:
        """Free the compute-dtype copies of the parameters that FSDP units keep after a no-grad
        forward (the root unit of one rank under mixed precision does not reshard after its
        forward: a backward would cast the whole model again; with no backward they stay until
        the next one): PPO's scoring leaves the critic's, which the actor's first micro-batch
        would otherwise carry on top of the memory ``auto`` planned for it."""
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def step(self) -> float:
        """Clip the gradient norm to ``max_grad_norm``, step the optimizer and the scheduler, zero
        the gradients. Returns the gradient norm before clipping (over all ranks)."""
        self.reshard()  # a no-grad forward since the backward left a root unit unsharded
        norm = clip_grad_norm([p for g in self.optimizer.param_groups for p in g["params"]], self.max_grad_norm)
        self.stepped_lr = self.lr  # what this step uses: the scheduler moves on below (the logged ``actor/lr``)
        self.optimizer.step()
        self.optimizer_steps += 1
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def full_state_dict(
        self, merged: bool = True, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
    ) -> dict[str, torch.Tensor]:
        """Full tensors on ``device`` (default the CPU) on every rank (a collective: call on all
        ranks), the floating ones in ``dtype`` when given (an engine's, under float32 masters).
        With LoRA and ``merged``, the base model's names with the adapters merged in (in the
        masters' precision, then cast; what a rollout engine and the Hugging Face export take);
        ``merged=False``: the adapted model's own names."""
        if not (merged and self.lora is not None):
            return full_state_dict(self.model, device, dtype)
        state = lora.merged_state_dict(full_state_dict(self.model, device), self.lora)
        return cast_floating(state, dtype)

    # ------------------------------------------------------------------ checkpoints
    def sharded_state(self) -> dict[str, Any]:
        """``{"model", "optim"}`` sharded state dicts for ``torch.distributed.checkpoint``."""
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer or [])
        return {"model": model_sd, "optim": optim_sd} if self.optimizer else {"model": model_sd}

    def load_sharded_state(self, state: Mapping[str, Any]) -> None:
        """Load what :meth:`sharded_state` gave (after ``dcp.load`` filled it). The optimizer keeps
        its own implementation (fused or not): a checkpoint's parameter groups carry the one of
        the run that wrote it, and each step count goes where this one reads it (the parameter's
        device for the fused AdamW, else the host)."""
        if self.optimizer:
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
            for group in self.optimizer.param_groups:
                group["fused"] = self.fused_optimizer or None
                for parameter in group["params"]:
                    step = self.optimizer.state.get(parameter, {}).get("step")
                    if isinstance(step, torch.Tensor):
                        where = parameter.device if self.fused_optimizer else "cpu"
                        self.optimizer.state[parameter]["step"] = step.to(where, torch.float32)
        else:
            set_state_dict(self.model, [], model_state_dict=state["model"], optim_state_dict={})

    def _generation_config(self):
        """The base model's ``generation_config.json`` as a ``GenerationConfig``, or None without one."""
        from transformers import GenerationConfig

        try:
            return GenerationConfig.from_pretrained(resolve_model(str(self.name_or_path)))
        except (OSError, ValueError):
            return None

    def export_hf(
        self, path: str | Path, tokenizer=None, state: Mapping[str, torch.Tensor] | None = None
    ) -> Path | None:
        """Write a Hugging Face folder (config, safetensors, tokenizer) that ``from_pretrained`` loads:
        a causal LM, for ``head="value"`` a token classifier and for ``head="reward"`` a sequence
        classifier, each with one label. With LoRA the folder holds the merged model and
        ``<path>/adapter`` the adapter alone (peft's format, :func:`rl2gem.training.lora.save_adapter`).

        A collective (the full state dict is gathered on every rank, pass ``state`` when it already
        is: the unmerged one with LoRA); only rank 0 writes. Returns the folder on rank 0, None elsewhere.
        """
        full = state if state is not None else self.full_state_dict(merged=False)
        if dist.get_rank() != 0:
            return None
        adapted = full
        if self.lora is not None:
            full = lora.merged_state_dict(adapted, self.lora)
        cls = head_class(self.head)
        if self.head == "reward":  # trained as a token classifier with a bias frozen at 0
            full = {k: v for k, v in full.items() if k != "score.bias"}
        config = self.model.config
        full = cast_floating(full, self.dtype)  # float32 masters
        with torch.device("meta"):
            skeleton = cls.from_config(config, dtype=self.dtype)
        skeleton.load_state_dict(dict(full), strict=False, assign=True)
        if getattr(config, "tie_word_embeddings", False) and self.head == "lm":
            skeleton.tie_weights()
        # the model's own generation settings (an instruct model's end-of-turn ids, sampling
        # defaults), not ones made from config.json; the KV cache on (training turned it off)
        skeleton.config.use_cache = True
        generation = self._generation_config()
        if generation is not None:
            skeleton.generation_config = generation
        skeleton.generation_config.use_cache = True
        if self.head == "reward":  # transformers reads the score at the last token that is not padding
            skeleton.config = copy.deepcopy(skeleton.config)  # from_config shares the live model's
            tokenizer = scoring_padding(skeleton.config, tokenizer, skeleton.generation_config)
        path = Path(path)
        skeleton.save_pretrained(path, is_main_process=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)
        if self.lora is not None:
            lora.save_adapter(path / "adapter", adapted, self.lora, base_model=str(self.name_or_path))
        return path


def scoring_padding(config, tokenizer=None, generation_config=None):
    """Give an exported reward model a padding token that never ends a scored sequence, and return
    the tokenizer to save with it (a copy padding with that token; None without one).

    ``*ForSequenceClassification`` reads the score at the last token that is not
    ``config.pad_token_id``; the trainer reads it at each sequence's last token, the end-of-turn
    token of a finished reply. Where the padding token is that end token (SmolLM2 pads with
    ``<|im_end|>``), transformers would score the token before it, and a reply cut off there alike.
    The first of the padding, unknown, begin-of-text and other special tokens that is not an
    end-of-text id of the config, the generation config (what generation stops on: Qwen2.5 stops
    on ``<|endoftext|>`` too, its padding token) or the tokenizer takes its place, in ``config``
    (in place).

    Every candidate an end-of-text id: a warning, and the padding stays.
    """
    ends = set()
    for source in (config, tokenizer, generation_config):
        end = getattr(source, "eos_token_id", None)
        ends.update(end if isinstance(end, (list, tuple)) else [end])
    candidates = [config.pad_token_id]
    if tokenizer is not None:
        candidates += [
            tokenizer.pad_token_id,
            tokenizer.unk_token_id,
            tokenizer.bos_token_id,
            *tokenizer.all_special_ids,
        ]
    candidates.append(getattr(config, "bos_token_id", None))
    padding = next((token for token in candidates if token is not None and token not in ends), None)
    if padding is None:
        warnings.warn(
            "the exported reward model pads with an end-of-text token (no other special token): transformers' "
            "pooling reads a finished reply's score one token early",
            stacklevel=2,
        )
        return tokenizer
    config.pad_token_id = int(padding)
    if tokenizer is None or tokenizer.pad_token_id == padding:
        return tokenizer
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.pad_token = tokenizer.convert_ids_to_tokens(int(padding))
    return tokenizer
