"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for causal LMs, on CPU (gloo) and GPU (NCCL).

* :func:`init_distributed`: the process group from torchrun's environment (gloo
  + fp32 on CPU, NCCL on GPU); a single process works without torchrun.
* :func:`shard_model`: every decoder layer and the root become FSDP units over
  the data dims of the mesh (:mod:`rl2gem.parallel.mesh`; one rank under mixed precision alone:
  the root only, where its memory is small, :func:`root_unit_fits`); a 2-D ``(replicate,
  shard)`` mesh shards parameters within a group of ``world / ddp_size`` ranks and
  replicates them across groups (HSDP, ZeRO-3 inside a group, DDP across them); ``cpu_offload`` keeps
  parameters and gradients in host memory (``CPUOffloadPolicy(pin_memory=False)``
  on CPU); ``reshard_after_forward=False`` keeps gathered parameters until the
  backward (ZeRO-2 style, more memory, fewer all-gathers).
* :func:`load_sharded`: the model is created on the meta device on every rank,
  sharded, materialised empty, and filled from rank 0's checkpoint by broadcast
  (no rank but 0 ever holds a full copy from disk); tied input/output
  embeddings are re-tied before sharding.
* :func:`full_state_dict`: full tensors on every rank (for weight sync into a
  rollout engine and for ``save_pretrained``).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from rl2gem.models import decoder_layers
from rl2gem.parallel.attention import enable_attention
from rl2gem.parallel.ring_attention import enable_ring_attention, recompute_context
from rl2gem.parallel.tensor_parallel import check_tp, parallelize
from rl2gem.procs import exit_when

__all__ = [
    "HEADS",
    "init_distributed",
    "launched_world_size",
    "uses_cuda",
    "shard_model",
    "root_unit_fits",
    "float32_head",
    "load_sharded",
    "full_state_dict",
    "head_class",
    "clip_grad_norm",
]

#: Model heads :func:`load_sharded` builds: a causal LM, a per-token value (critic), a sequence reward.
HEADS = ("lm", "value", "reward")
COMPILED_VARIANTS = 32  # dynamo's recompile limit with compiled layers (``load_sharded``)


def head_class(head: str):
    """The transformers auto class a head's Hugging Face export loads with:
    ``AutoModelForCausalLM`` (``lm``), ``AutoModelForTokenClassification`` (``value``),
    ``AutoModelForSequenceClassification`` (``reward``).

    Raises:
        ValueError: unknown head.
    """
    import transformers

    names = {
        "lm": "AutoModelForCausalLM",
        "value": "AutoModelForTokenClassification",
        "reward": "AutoModelForSequenceClassification",
    }
    if head not in names:
        raise ValueError(f"head must be one of {HEADS}, got {head!r}")
    return getattr(transformers, names[head])


def init_distributed(backend: str | None = None) -> tuple[int, int, torch.device]:
    """Join the torchrun process group (or make a 1-process one). Returns ``(rank, world_size, device)``.

    On GPU the group has NCCL for CUDA tensors and gloo for CPU tensors (``"cpu:gloo,cuda:nccl"``),
    so the small host-side reductions (metrics, evaluation totals, flags) work on every device.
    """
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        backend = backend or ("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
        os.environ.setdefault("LOCAL_RANK", str(local_rank(required="nccl" in backend)))
        if "nccl" in backend:
            torch.cuda.set_device(local_device_index(int(os.environ["LOCAL_RANK"]), torch.cuda.device_count()))
        dist.init_process_group(backend, timeout=timedelta(minutes=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    if not uses_cuda():
        return rank, world, torch.device("cpu")
    return (
        rank,
        world,
        torch.device("cuda", local_device_index(local_rank(), torch.cuda.device_count())),
    )


def launched_world_size() -> int:
    """The ranks the launcher started (torchrun's ``WORLD_SIZE``, set before the script runs; 1
    when unset): what a config is checked against before the process group exists."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def stop_with_the_launcher(poll_seconds: float = 1.0) -> threading.Thread | None:
    """Under torchrun: end this rank once torchrun itself is gone. Returns the watching thread
    (None elsewhere, or when this process has no parent to watch).

    torchrun starts each rank in a session of its own, so ``kill -9`` of torchrun (or of its process
    group) left the ranks training: they went on writing ``trainer.output_dir`` beside a resumed
    run. A daemon thread reads the parent pid every ``poll_seconds``; when it changes (torchrun
    gone, the rank adopted), the rank says so on stderr, kills the services it started (engine
    servers, the router: :func:`rl2gem.procs.kill_services`) and exits at once, as if killed (a
    checkpoint's ``latest`` is written last, so nothing written is lost).
    """
    parent = os.getppid()
    if "TORCHELASTIC_RUN_ID" not in os.environ or parent <= 1:
        return None

    def adopted() -> str:
        while os.getppid() == parent:
            time.sleep(poll_seconds)
        return f"rank {os.environ.get('RANK', '?')}: its launcher (pid {parent}) is gone; this rank stops"

    return exit_when(adopted, "rl2gem-launcher-watch")


#: where launchers put a process's rank on its node: torchrun, SLURM's srun, Open MPI, MPICH
LOCAL_RANK_VARIABLES = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")


def local_rank(required: bool = False) -> int:
    """This process's rank on its node, from the first of :data:`LOCAL_RANK_VARIABLES` that is
    set; 0 when none is and ``WORLD_SIZE`` is 1 (or unset).

    Raises:
        RuntimeError: none is set, ``WORLD_SIZE`` > 1 and ``required`` (CUDA ranks: every one
            would take GPU 0 and NCCL would refuse the duplicate device).
    """
    for name in LOCAL_RANK_VARIABLES:
        if os.environ.get(name, "").strip():
            return int(os.environ[name])
    world = launched_world_size()
    if required and world > 1:
        raise RuntimeError(
            f"WORLD_SIZE={world} but no rank on the node: set LOCAL_RANK for each process (torchrun does), "
            f"or launch with srun or mpirun, which set {', '.join(LOCAL_RANK_VARIABLES[1:])}"
        )
    return 0


def local_device_index(local_rank: int, devices: int) -> int:
    """The CUDA device index of the rank with ``LOCAL_RANK`` ``local_rank`` on a process that sees
    ``devices`` devices: ``local_rank`` when every GPU of the node is visible (torchrun), 0 when
    the launcher gave each process one GPU of its own (SLURM ``--gpus-per-task=1`` through
    ``srun``, not torchrun: ``CUDA_VISIBLE_DEVICES`` names a single device, and ``LOCAL_RANK``
    still counts the node's processes).

    Raises:
        RuntimeError: ``local_rank`` past the visible devices otherwise (more ranks per node
            than GPUs).
    """
    if local_rank < devices:
        return local_rank
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    # torchrun starts every rank of a node with the same devices visible: never one GPU each
    if devices == 1 and visible and "," not in visible and "TORCHELASTIC_RUN_ID" not in os.environ:
        return 0
    raise RuntimeError(
        f"LOCAL_RANK={local_rank}, but this machine has {devices} CUDA device(s): start at most {devices} "
        f"ranks per node (torchrun --nproc_per_node={devices})"
    )


#: ranks per node that ``auto`` starts: what the recipes' batches are sized for (their prompts per
#: rollout divide by it), fewer on a machine with fewer CUDA devices
AUTO_RANKS_PER_NODE = 2


def ranks_per_node(requested: int | str = "auto") -> int:
    """The processes a launcher starts per node for ``requested`` ranks: ``auto`` is
    :data:`AUTO_RANKS_PER_NODE` (CPU ranks over gloo without CUDA), at most one per CUDA device
    (a one-GPU machine runs one); a number is taken as it is (the batches must divide by it).

    Raises:
        ValueError: neither ``auto`` nor an integer >= 1.
    """
    if requested == "auto":
        return min(AUTO_RANKS_PER_NODE, torch.cuda.device_count()) if torch.cuda.is_available() else AUTO_RANKS_PER_NODE
    if isinstance(requested, bool) or not str(requested).isdigit() or int(requested) < 1:
        raise ValueError(f"ranks per node must be auto or an integer >= 1, got {requested!r}")
    return int(requested)


def uses_cuda() -> bool:
    """Whether the initialised process group runs NCCL (its models then live on CUDA)."""
    return "nccl" in str(dist.get_backend())


def _free_port() -> int:
    from rl2gem.procs import free_port

    return free_port()


def shard_model(
    model,
    mesh,
    *,
    cpu_offload: bool = False,
    reshard_after_forward: bool = True,
    param_dtype=None,
    float32_modules: Sequence[torch.nn.Module] = (),
    layer_units: bool = True,
):
    """Apply ``fully_shard`` to each decoder layer (``layer_units``) and to the root. Returns the
    model (now FSDP). ``float32_modules`` (a critic's or reward model's scalar head,
    :func:`float32_head`) are units of their own, whose float32 parameters a unit of the model's
    dtype could not hold (FSDP2 needs one dtype per unit); with ``param_dtype`` (mixed precision)
    they also compute in float32. ``layer_units=False`` (one rank, mixed precision only,
    :func:`root_unit_fits`): the root holds every layer, so each forward casts the whole model once
    and keeps the cast through the backward, with no FSDP hook between layers
    (``benchmarks/fsdp_one_rank.py``: on the CPU, a 16-layer model's forward and backward took about
    12 ms more than without FSDP with layer units, 3.5 ms more with the root alone)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    # the root alone does not reshard after the forward: the backward would cast the whole model again
    kw = {"mesh": mesh, "reshard_after_forward": reshard_after_forward and layer_units}
    if cpu_offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    float32 = {}
    if param_dtype is not None:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        float32 = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)}
    for module in float32_modules:
        fully_shard(module, **{**kw, **float32})
    for layer in decoder_layers(model) if layer_units else ():
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


#: The share of a GPU's memory that one rank's root unit may hold beyond layer units (its whole
#: compute-dtype copy and gradients through the backward): :func:`root_unit_fits`.
ROOT_UNIT_MEMORY_SHARE = 0.05


def root_unit_fits(model, dtype, device: torch.device) -> bool:
    """Whether one rank under mixed precision alone may wrap the root as its only FSDP unit
    (:func:`shard_model`'s ``layer_units=False``): the root holds the whole model's ``dtype``
    copy from the forward through the backward, and its ``dtype`` gradients until the backward
    ends, where layer units hold one layer's of each at a time; so ``2 x dtype size`` bytes per
    parameter more (4 at bf16: 4 GB for 1B parameters; ``benchmarks/fsdp_one_rank.py`` measured
    a forward and backward's peak at 8.0 bytes per parameter against layer units' 4.3 on the
    CPU, the float32 gradients included). Taken when that is at most
    :data:`ROOT_UNIT_MEMORY_SHARE` of the GPU's memory (all of a 1B model on an 80 GB GPU, not a
    3B one, whose layers' compute hides their hooks better), and always off CUDA."""
    if device.type != "cuda":
        return True
    extra = 2 * torch.empty((), dtype=dtype).element_size() * sum(p.numel() for p in model.parameters())
    return extra <= ROOT_UNIT_MEMORY_SHARE * torch.cuda.get_device_properties(device).total_memory


def float32_head(model) -> torch.nn.Module:
    """Make the scalar head ``model.score`` (a critic's values, a reward model's score) compute in
    float32 from the backbone's hidden states, whatever the model's dtype: its parameters in
    float32 and its input cast to float32 (a bf16 value keeps 8 significant bits: 0.7 is known to
    about 0.002, coarser than the value loss and GAE work at). Returns the head, for
    :func:`shard_model`'s ``float32_modules``."""
    head = model.score
    head.to(torch.float32)
    head.register_forward_pre_hook(lambda module, args: tuple(a.float() for a in args))
    return head


def end_failed_backward(model) -> None:
    """Put an FSDP2 model back in its idle state after a forward or backward that raised (an
    out-of-memory error): a backward that stops midway never runs FSDP's end-of-backward callback,
    so every module stays in its backward state, and from then on each forward is taken for a
    recompute: the unsharded parameters stay, gradients land on them and not on the shards the
    optimizer steps, and the weights stop changing with no error. Runs FSDP's end-of-backward
    callback, which reshards and reduces the gradients the failed pass left on the unsharded
    parameters into the shards (the caller drops them). With ``FSDPModule.reset_iter_state``
    (PyTorch 2.13, which discards those reductions) instead, the retried step of
    ``tests/training/test_checkpoint.py`` differed from a clean one. Call it after the failed
    pass's graph is freed: the reduction allocates. A model without FSDP is left as it is. One rank
    only: other ranks would not join the reductions.

    Raises:
        RuntimeError: this PyTorch's FSDP2 has no such callback (a retry would not train).
    """
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        return
    callback = getattr(model._get_fsdp_state(), "_root_post_backward_final_callback", None)
    if callback is None:
        raise RuntimeError("cannot reset FSDP2 after a failed backward with this PyTorch version")
    callback()


def _checkpointing(ring: bool) -> dict:
    """``torch.utils.checkpoint``'s arguments: not reentrant, and with ring attention its context
    entered again for the recompute (:func:`~rl2gem.parallel.ring_attention.recompute_context`)."""
    return {"use_reentrant": False, **({"context_fn": recompute_context} if ring else {})}


def load_sharded(
    name_or_path: str,
    mesh,
    *,
    device: torch.device,
    dtype=torch.float32,
    cpu_offload: bool = False,
    reshard_after_forward: bool = True,
    master_dtype=None,
    gradient_checkpointing: bool = False,
    head: str = "lm",
    tp_mesh=None,
    sp_group=None,
    adapt=None,
    attention: str = "block",
    compile_layers: bool = False,
):
    """Meta-device init on every rank, shard, then broadcast rank 0's weights into the shards.

    Args:
        head: ``"lm"``: the causal LM (actor, reference); ``"value"``: the same backbone with a
            scalar head (``AutoModelForTokenClassification``, one label, no dropout) for a PPO
            critic; the head starts at zero, so every initial value is 0; ``"reward"``: the same
            per-token model with the head's bias frozen at 0, for a reward model read at a
            sequence's last token (exported as ``AutoModelForSequenceClassification``, whose
            head has no bias; per-token outputs are what FSDP's backward hooks see).
        adapt: called with the meta-device model and with rank 0's loaded one before sharding, to
            add the same parameters to both (LoRA adapters: :func:`rl2gem.training.lora.inject`);
            rank 0's values of the new parameters are broadcast with the checkpoint's.
        attention: the kernel of packed rows, resolved (``flex``, ``flash``, ``sdpa`` or
            ``block``; :func:`rl2gem.parallel.attention.resolve_attention`); ignored with
            ``sp_group`` (ring attention).
        master_dtype: mixed precision (FSDP2's ``MixedPrecisionPolicy``, also at one rank): the
            trainable parameters (and so their gradients and optimizer state) are kept in this dtype
            (float32), the frozen ones (a LoRA base) in ``dtype``, and every forward and backward
            computes in ``dtype`` with gradients reduced in float32. None: everything in ``dtype``.
        compile_layers: compile each decoder layer's ``forward`` with ``torch.compile`` (Inductor:
            fused kernels, far fewer launches on CUDA; where layers are FSDP units, each stays its
            own, whose hooks run outside the compiled code; shapes go dynamic after the first
            recompile).
            The first steps pay the compilation (tens of seconds).

    Returns the model (train mode) with ``dtype`` parameters (the trainable ones ``master_dtype``):
    FSDP-wrapped, or, on a data mesh of one rank without tensor parallelism, CPU offload or mixed
    precision, the plain module (FSDP there only copies parameters and gradients through its
    buffers). One rank with mixed precision alone is one FSDP unit, the root (with a float32 head's
    own), where :func:`root_unit_fits`: :func:`shard_model`'s ``layer_units=False``.

    Raises:
        ValueError: unknown ``head``, or a model that ``tp_mesh`` cannot split
            (:func:`rl2gem.parallel.tensor_parallel.check_tp`).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from transformers import AutoConfig

    from rl2gem.models import resolve_model

    if head not in HEADS:
        raise ValueError(f"head must be one of {HEADS}, got {head!r}")
    path = resolve_model(name_or_path)
    config = AutoConfig.from_pretrained(path)
    cls = head_class("value" if head == "reward" else head)
    if head != "lm":
        config.num_labels, config.classifier_dropout = 1, 0.0
    if tp_mesh is not None:
        check_tp(config, tp_mesh.size())
    full = _full_state(path, dtype, head, config.hidden_size, adapt) if dist.get_rank() == 0 else None
    with torch.device("meta"):
        model = cls.from_config(config, dtype=dtype)
    if head == "lm" and getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    if adapt is not None:
        adapt(model)
    if head == "reward":  # Bradley-Terry is blind to a shared offset: keep it exactly 0 for the export
        model.score.bias.requires_grad_(False)
    float32_modules = [float32_head(model)] if head != "lm" else []
    param_dtype = None
    if master_dtype is not None and master_dtype != dtype:  # rank 0's values are cast as they load
        param_dtype = dtype
        for parameter in model.parameters():
            if parameter.requires_grad:
                parameter.data = parameter.data.to(master_dtype)
    model.rl2_tp_group = model.rl2_sp_group = None
    model.rl2_compute_dtype = dtype  # under mixed precision the parameters' own may be float32
    if tp_mesh is not None:
        parallelize(model, tp_mesh)
    if sp_group is not None:
        enable_ring_attention(model)
        model.rl2_sp_group = sp_group
    else:  # packed rows: FlexAttention / flash-attn on GPU, SDPA per block of queries on CPU
        enable_attention(model, attention)
    if gradient_checkpointing:  # ring attention's recompute needs the forward's layout and group
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=_checkpointing(sp_group is not None))
    if compile_layers:
        # the layers share one code object, whose compiled variants (train / no-grad / eval, static
        # then dynamic shapes, one-block rows) of an actor and its reference reach dynamo's default
        # limit of 8, past which new variants run eagerly without a word
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, COMPILED_VARIANTS)
        for layer in decoder_layers(model):
            layer.forward = torch.compile(layer.forward)
    layer_units = mesh.size() > 1 or tp_mesh is not None or cpu_offload
    sharded = layer_units or param_dtype is not None
    layer_units = layer_units or (sharded and not root_unit_fits(model, dtype, device))
    if sharded:  # else one rank: FSDP would only copy parameters and gradients through its buffers
        shard_model(
            model, mesh, cpu_offload=cpu_offload, reshard_after_forward=reshard_after_forward,
            param_dtype=param_dtype, float32_modules=float32_modules, layer_units=layer_units,
        )  # fmt: skip
    model.to_empty(device="cpu" if cpu_offload else device)
    if not sharded and head == "lm" and getattr(config, "tie_word_embeddings", False):
        model.tie_weights()  # to_empty gave each module its own new parameter (FSDP keeps the tie itself)
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=True)
    set_model_state_dict(model, full or {}, options=opts)
    _init_buffers(model, config, device)
    model.config.use_cache = False
    return model.train()


def _full_state(path: str, dtype, head: str, hidden_size: int, adapt) -> dict[str, torch.Tensor]:
    """Rank 0's full state dict for :func:`load_sharded`: the checkpoint's causal LM (``adapt``
    applied), for a scalar head without the LM head and with a zero ``score`` instead."""
    from transformers import AutoModelForCausalLM

    pretrained = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    if adapt is not None:
        adapt(pretrained)
    full = pretrained.state_dict()
    del pretrained
    if head != "lm":
        full = {k: v for k, v in full.items() if not k.startswith("lm_head.")}
        full["score.weight"] = torch.zeros(1, hidden_size, dtype=dtype)
        full["score.bias"] = torch.zeros(1, dtype=dtype)
    return full


def _init_buffers(model, config, device) -> None:
    """Non-persistent buffers (rotary ``inv_freq``) are not in checkpoints and ``to_empty`` leaves them
    uninitialised: rebuild each rotary module from the config and take its buffers."""
    for module in model.modules():
        if "inv_freq" not in dict(module.named_buffers(recurse=False)):
            continue
        with torch.device("cpu"):
            fresh = type(module)(config=getattr(module, "config", config))
        for name, buf in fresh.named_buffers(recurse=False):
            setattr(module, name, buf.to(device))
        if hasattr(fresh, "attention_scaling"):
            module.attention_scaling = fresh.attention_scaling


def full_state_dict(model, device: str | torch.device = "cpu", dtype=None) -> dict[str, torch.Tensor]:
    """Full (unsharded) tensors of every parameter and persistent buffer on ``device`` (default
    the CPU), the floating ones cast to ``dtype`` when given (float32 master weights sent to a
    bfloat16 engine: each cast as it is gathered, so no full float32 copy is held), on every rank
    (a collective). They never share memory with the model (on one rank an unsharded tensor would
    otherwise alias the live parameter and change with the next optimizer step)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, t in model.state_dict().items():
        local = t.to_local() if isinstance(t, DTensor) else t
        full = t.full_tensor() if isinstance(t, DTensor) else t
        full = full.detach().to(device, dtype=dtype if dtype is not None and full.is_floating_point() else None)
        if full.untyped_storage().data_ptr() == local.untyped_storage().data_ptr():
            full = full.clone()
        out[name] = full
    return out


def clip_grad_norm(parameters, max_norm: float) -> float:
    """Scale the gradients so that their global L2 norm is at most ``max_norm``; return the norm
    before clipping (over all ranks; a collective).

    ``torch.nn.utils.clip_grad_norm_`` stacks the per-parameter norms, which fails when the
    gradients are DTensors on different meshes (FSDP x TP shards beside FSDP-only norms): here
    the norms are taken per (mesh, placements) group, each reduced over its own mesh, and summed.
    """
    from torch.distributed.tensor import DTensor

    groups: dict = {}
    for p in parameters:
        if p.grad is not None:
            key = (p.grad.device_mesh, tuple(p.grad.placements)) if isinstance(p.grad, DTensor) else None
            groups.setdefault(key, []).append(p.grad)
    squares = 0.0
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        squares += float(norm) ** 2
    total = squares**0.5
    coefficient = float(max_norm) / (total + 1e-6)
    if coefficient < 1.0:
        for grads in groups.values():
            torch._foreach_mul_(grads, coefficient)  # one dispatch per group, not per DTensor
    return total
