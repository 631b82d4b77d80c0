"""Micro-batch sizing: ``actor.max_length_per_device=auto`` and back-off on out-of-memory.

**auto** (the default) probes the device's memory on CUDA, where a short micro-batch leaves the GPU
launching kernels (PPO on one H200 spent 1.4 s of an 8.6 s step in the update, in 2,048-token
micro-batches). Off CUDA it is ``actor.cpu_max_length_per_device`` when set, else the trainer's
length (:data:`CPU_AUTO_LENGTH` for PPO), without a probe: RAM is shared with
everything else, probing it took about 20 s of a two-rank start on the 2-core machine, and a CPU's
time per token does not fall with longer micro-batches; a simulated device (below) is probed.

**The probe** (:func:`auto_max_length`). Each trained model runs a forward and backward pass on one
synthetic sequence at three probe lengths (128, 256 and 512 tokens per device), after a discarded
pass at the first (one-time allocations such as cuBLAS workspaces would bend the fit), and the
memory each pass adds is measured: on CUDA the allocator's peak above what was allocated before
the pass; elsewhere the bytes of the tensors autograd saved for the backward pass (the
activations; :class:`~rl2gem.training.metrics.SavedTensorBytes`). A quadratic ``a + b L + c L^2`` is fitted by least
squares (quadratic because attention without flash kernels keeps ``L x L`` scores; ``c`` is about
0 with them), and the length chosen is the largest multiple of 64 whose predicted peak fits the
budget: ``actor.memory_fraction`` of the memory free now (CUDA: ``torch.cuda.mem_get_info``; CPU:
the available RAM shared by the node's ranks), less the optimizer state AdamW has not allocated
yet by any trained model (and on CPU the gradients), and capped where a ``[tokens, vocabulary]``
tensor would pass ``2**31`` elements. Every rank probes the same shapes; the smallest choice over
ranks wins.

**Back-off** (:class:`MaxLength`). A step's gradient passes run through :meth:`MaxLength.run`;
when one runs out of memory before any optimizer step (``torch.OutOfMemoryError``, or a
``RuntimeError`` saying so: cuBLAS and some extension kernels raise those), the gradients are
dropped, FSDP2 leaves the backward it was in (:func:`~rl2gem.parallel.fsdp.end_failed_backward`),
the length halves, and the passes run again on a new micro-batch plan (logged as
``actor/max_length_per_device``). With more than one rank an out-of-memory error leaves the
others inside a collective, so no rank can go on: the halved length is written to
``<output_dir>/max_length_per_device`` and the error raised; the run relaunched with
``trainer.resume=true`` resumes from the last checkpoint with that length.

**Drills.** ``RL2GEM_SIMULATED_MEMORY_MIB=<n>`` makes every device one whose forward passes may
keep ``n`` MiB of activations: a pass that saves more raises ``torch.OutOfMemoryError`` as CUDA
would, and ``auto`` sizes against ``n``. Tests use it to exercise both paths on CPU.
"""

from __future__ import annotations

import gc
import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import numpy as np
import psutil
import torch
import torch.distributed as dist

from rl2gem.parallel.fsdp import end_failed_backward
from rl2gem.training.forward import sequence_scores, token_logprobs, token_values
from rl2gem.training.metrics import SavedTensorBytes, simulated_memory_bytes
from rl2gem.training.settings import WorkerSettings, is_length_setting

__all__ = ["CPU_AUTO_LENGTH", "MaxLength", "auto_max_length", "device_budget", "fit_max_length"]

PROBE_LENGTHS = (128, 256, 512)
MULTIPLE = 64
LIMIT = 2**20  # tokens per device: a ceiling for the fitted length
CPU_AUTO_LENGTH = 2048  # auto off CUDA (module docstring); the offline trainers' is 4096
RECORD = "max_length_per_device"  # the halved length a multi-rank run leaves for its restart
T = TypeVar("T")


#: how a ``RuntimeError`` that is not a ``torch.OutOfMemoryError`` says it ran out of device memory
OUT_OF_MEMORY_MESSAGES = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED")


def out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an out-of-memory error: ``torch.OutOfMemoryError`` (the caching
    allocator's), or a ``RuntimeError`` from a library that allocates on its own (cuBLAS, cuDNN,
    extension kernels) with one of :data:`OUT_OF_MEMORY_MESSAGES`."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and any(message in str(error) for message in OUT_OF_MEMORY_MESSAGES)


def fit_max_length(lengths: Sequence[int], peaks: Sequence[float], budget: float) -> int:
    """The largest multiple of 64 tokens whose peak, by a least-squares quadratic through
    ``(lengths, peaks)`` (bytes), is at most ``budget`` bytes; 0 when not even 64 fits.

    Raises:
        ValueError: fewer than three probe points.
    """
    if len(lengths) < 3:
        raise ValueError("fit_max_length needs three probe points or more")
    c, b, a = np.polyfit(np.asarray(lengths, dtype=np.float64), np.asarray(peaks, dtype=np.float64), 2)
    if c * max(lengths) ** 2 < 1e-6 * max(peaks):  # rounding noise of a linear curve (flash attention)
        c = 0.0
    c, b = max(c, 0.0), max(b, 0.0)  # memory does not fall as sequences grow: noise, not a model
    if c > 0:
        best = (-b + np.sqrt(max(b * b - 4 * c * (a - budget), 0.0))) / (2 * c) if a <= budget else 0.0
    else:
        best = (budget - a) / b if b > 0 else float(LIMIT)
    return int(min(max(best, 0.0), LIMIT)) // MULTIPLE * MULTIPLE


def _probe(worker, tokens: int, device: torch.device) -> float:
    """Bytes a forward and backward pass of one ``tokens``-token sequence adds on ``device``."""
    generator = torch.Generator().manual_seed(tokens)
    vocab = int(worker.model.config.vocab_size)
    sequence = [torch.randint(vocab, (tokens,), generator=generator).tolist()]
    worker.optimizer.zero_grad(set_to_none=True)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    with SavedTensorBytes() as saved:
        if worker.head == "lm":
            logprobs, entropies = token_logprobs(worker.model, sequence, device, entropy="grad")
            loss = logprobs.sum() + entropies.sum()
        elif worker.head == "value":
            loss = token_values(worker.model, sequence, device).sum()
        else:
            loss = sequence_scores(worker.model, sequence, device).sum()
    loss.backward()
    peak = torch.cuda.max_memory_allocated(device) - before if cuda else saved.bytes
    del loss
    worker.optimizer.zero_grad(set_to_none=True)
    return float(peak)


def _index_limit(worker) -> int:
    """Tokens per device below which no ``[tokens, vocabulary]`` logits tensor (an LM head's; a
    value or score head builds none) nor ``[tokens, hidden]`` activation passes ``2**31`` elements:
    kernels that index with 32-bit integers (some Triton ones) are not exercised past it, whatever
    the memory holds."""
    config = worker.model.config
    widest = int(getattr(config, "hidden_size", 1) or 1)
    if worker.head == "lm":
        widest = max(widest, int(getattr(config, "vocab_size", 1) or 1))
    return 2**31 // widest // MULTIPLE * MULTIPLE


def _trainable_bytes(worker, device: torch.device) -> int:
    """Bytes of this rank's shards of the trainable parameters on ``device``'s type (and so of
    their gradients and AdamW's moments, which live with them): none on CUDA under
    ``actor.cpu_offload``, whose shards, gradients and optimizer state stay on the host. The
    optimizer's parameters: the module's may be FSDP's unsharded compute copies between a forward
    and the end of its backward (the root unit of one rank under mixed precision keeps them)."""
    local = (getattr(p, "_local_tensor", p) for group in worker.optimizer.param_groups for p in group["params"])
    return sum(t.nbytes for t in local if t.device.type == device.type)


def _unallocated_state_bytes(worker, device: torch.device) -> int:
    """AdamW's two moments when it has not stepped yet, plus (off CUDA, where the probe does not
    see them) the gradients."""
    local = _trainable_bytes(worker, device)
    moments = 2 * local if not worker.optimizer.state else 0
    return moments + (local if device.type != "cuda" else 0)


def device_budget(device: torch.device, fraction: float) -> int:
    """Bytes ``auto`` may plan for on this rank: ``fraction`` of the free device memory (CPU: of
    the available RAM over the node's ranks), or the simulated memory."""
    simulated = simulated_memory_bytes()
    if simulated is not None:
        return simulated
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(fraction * free)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size() if dist.is_initialized() else 1))
    return int(fraction * psutil.virtual_memory().available / max(local, 1))


def auto_max_length(
    workers, device: torch.device, fraction: float, tokens_per_length: int = 1, reserved_bytes: int = 0
) -> int:
    """``max_length_per_device`` for ``auto`` over the trained ``workers`` (see the module
    docstring); the same on every rank (a collective). ``tokens_per_length``: the mesh's
    ``sp * tp`` (a micro-batch holds that many times the per-device length). ``reserved_bytes``:
    memory free now that something else takes later (the engine's KV store kept through the
    update), taken off the budget.

    Raises:
        RuntimeError: not even 64 tokens per device fit the budget.
    """
    best, simulated = LIMIT, simulated_memory_bytes() is not None
    # every trained model's optimizer state is there during each one's passes, and on CUDA (where a
    # probe's peak holds its own gradients) the other models' gradients too: the update holds all
    unallocated = 0 if simulated else sum(_unallocated_state_bytes(worker, device) for worker in workers)
    gradients = sum(_trainable_bytes(worker, device) for worker in workers) if device.type == "cuda" else 0
    for worker in workers:
        others = gradients - _trainable_bytes(worker, device) if gradients else 0
        budget = device_budget(device, fraction) - reserved_bytes - unallocated - others
        _probe(worker, PROBE_LENGTHS[0] * tokens_per_length, device)  # warm-up: one-time workspaces
        peaks = [_probe(worker, n * tokens_per_length, device) for n in PROBE_LENGTHS]
        best = min(best, fit_max_length(PROBE_LENGTHS, peaks, budget), _index_limit(worker))
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if dist.is_initialized() and dist.get_world_size() > 1:
        value = torch.tensor([best], dtype=torch.int64)
        dist.all_reduce(value, op=dist.ReduceOp.MIN)
        best = int(value)
    if best < MULTIPLE:
        raise RuntimeError(
            f"actor.max_length_per_device=auto: not even {MULTIPLE} tokens per device fit the memory budget; "
            "try actor.gradient_checkpointing=true, actor.cpu_offload=true, more ranks, or a smaller model"
        )
    return best


class MaxLength:
    """The per-device token budget of a trainer's micro-batches: a fixed number or ``auto``, with
    back-off on out-of-memory (see the module docstring).

    Args:
        section: the ``actor`` config (``max_length_per_device``, ``memory_fraction``, ``oom_backoff``).
        workers: the trained workers (probed by ``auto``; their gradients are dropped on a back-off).
        mesh: the :class:`~rl2gem.parallel.mesh.ParallelMesh`.
        device: this rank's device.
        output_dir: where a multi-rank run records a halved length for its restart.
        resume: whether this run continues one (only then is a recorded length read).
        reserved_bytes: with ``auto``, memory free now that the update will not have
            (:func:`auto_max_length`).
        cpu_length: ``auto`` off CUDA (no simulated device) without ``cpu_max_length_per_device``:
            :data:`CPU_AUTO_LENGTH` unless given.

    Attributes:
        value: tokens per device now.

    Raises:
        ValueError: a setting that is neither a positive integer nor ``auto``.
    """

    def __init__(
        self,
        section,
        workers: Sequence,
        mesh,
        device: torch.device,
        output_dir: str | Path,
        reserved_bytes: int = 0,
        cpu_length: int = CPU_AUTO_LENGTH,
        resume: bool = True,
    ):
        settings = WorkerSettings.from_section(section)
        setting = settings.max_length_per_device
        self.workers, self.mesh, self.device = list(workers), mesh, device
        self.backoff = bool(settings.oom_backoff)
        self.record = Path(output_dir) / RECORD
        if setting == "auto" and (device.type == "cuda" or simulated_memory_bytes() is not None):
            fraction = float(settings.memory_fraction)
            self.value = auto_max_length(self.workers, device, fraction, mesh.micro_batch_tokens(1), reserved_bytes)
        elif setting == "auto":
            self.value = int(settings.cpu_max_length_per_device or cpu_length)
        elif is_length_setting(setting):
            self.value = setting
        else:
            raise ValueError(f"actor.max_length_per_device must be a positive integer or auto, got {setting!r}")
        if resume and self.backoff and self.record.exists():  # left by a run that ran out of memory on several ranks
            self.value = min(self.value, int(self.record.read_text()))

    @property
    def micro_batch_tokens(self) -> int:
        """Tokens one micro-batch may hold (``sp * tp * value``)."""
        return self.mesh.micro_batch_tokens(self.value)

    def run(self, passes: Callable[[], T], longest: int, planned: Callable[[], int] | None = None) -> T:
        """``passes()``, again at half the length after an out-of-memory error raised before any
        optimizer step; ``passes`` plans its micro-batches with :attr:`micro_batch_tokens`.
        ``longest``: the longest sequence of the step (a micro-batch never holds less than one
        sequence, so the back-off stops there). ``planned``: the tokens of the largest micro-batch
        the failed passes planned; the length halves from it when it is below the budget (a plan
        can hold much less than the budget allows, and halving the budget alone would plan the
        same micro-batches again).

        Raises:
            torch.OutOfMemoryError: (or the ``RuntimeError`` that said so, as raised) back-off off,
                an optimizer step already taken, nothing left to halve, or (with several ranks)
                after recording the halved length.
            RuntimeError: from :func:`~rl2gem.parallel.fsdp.end_failed_backward`.
        """
        while True:
            steps = [w.optimizer_steps for w in self.workers]
            try:
                return passes()
            except RuntimeError as error:
                if not out_of_memory(error):
                    raise
                stepped = steps != [w.optimizer_steps for w in self.workers]
                used = self.value if planned is None else min(self.value, planned() // self.mesh.micro_batch_tokens(1))
                halved = max(used // 2, MULTIPLE)
                if not self.backoff or stepped:
                    raise
                if halved == self.value or self.micro_batch_tokens <= longest:
                    raise torch.OutOfMemoryError(
                        f"out of memory at actor.max_length_per_device={self.value}, where a micro-batch holds one "
                        f"sequence (the longest has {longest} tokens): nothing left to halve; try "
                        "actor.gradient_checkpointing=true, actor.sp_size, actor.cpu_offload or shorter sequences"
                    ) from error
                if dist.is_initialized() and dist.get_world_size() > 1:
                    self.record.parent.mkdir(parents=True, exist_ok=True)
                    self.record.write_text(f"{halved}\n")
                    raise torch.OutOfMemoryError(
                        f"out of memory at actor.max_length_per_device={self.value}; {self.record} now says {halved}: "
                        "relaunch with trainer.resume=true to go on from the last checkpoint with it"
                    ) from error
                warnings.warn(
                    f"out of memory at actor.max_length_per_device={self.value}; retrying the step at {halved}",
                    stacklevel=2,
                )
                self.value = halved
            # out of the except block, where the failed passes' frames (their graph, its activations)
            # are freed: a backward cut short leaves FSDP2 mid-backward; the gradients go
            for worker in self.workers:
                end_failed_backward(worker.model)
                worker.optimizer.zero_grad(set_to_none=True)
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
