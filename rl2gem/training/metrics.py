"""Metrics every trainer logs: averages over micro-batches and ranks, throughput, FLOPs and MFU.

MFU (model FLOPs utilisation, Chowdhery et al. 2022, PaLM appendix B) is the model's FLOPs per
second over the machine's peak: a forward costs ``2 * P`` FLOPs per token and a forward plus
backward ``6 * P`` (``P`` parameters; attention's quadratic term left out, as usual). is given (``trainer.peak_flops``, FLOP/s per rank) or, when it is null, the datasheet's
dense peak of a known GPU in the training dtype (:data:`DATASHEET_PEAKS`, :func:`datasheet_peak_flops`),
else measured once at start with a large matmul (:func:`measure_peak_flops`; a measurement varies
run to run and sits below the datasheet, so MFU against it reads high). The peak used is printed
once.

Memory (``memory/<phase>_peak_mib``, :class:`PeakMemory`): the highest memory of a phase of a
step, the maximum over ranks, in MiB: on CUDA ``torch.cuda.max_memory_allocated`` (tensors the
caching allocator handed out), on CPU the process's resident set size (RSS: everything the process
holds, Python and libraries included), on Linux the kernel's own peak (``VmHWM``, reset as the
phase starts), elsewhere sampled every few milliseconds while the phase runs.
On CPU a phase also hands the heap that glibc keeps after ``free`` back to the system, once a second
while it runs and when it ends (:func:`release_free_heap`): a rank that allocates and frees
gigabytes of tensors per phase (rollout KV caches, scoring, the update) otherwise holds its highest
phase's memory for the rest of the run, which on a 24 GiB host filled it with two ranks
(``benchmarks/learning.md``, the two-hop run).
:class:`SavedTensorBytes` counts the activations autograd keeps for backward (what
``actor.max_length_per_device=auto`` sizes on CPU, :mod:`rl2gem.training.autosize`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import re
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping

import psutil
import torch
import torch.distributed as dist

__all__ = [
    "Averager",
    "PeakMemory",
    "SavedTensorBytes",
    "DATASHEET_PEAKS",
    "datasheet_peak_flops",
    "measure_peak_flops",
    "peak_flops_from_config",
    "reduce_mean",
    "release_free_heap",
    "simulated_memory_bytes",
    "throughput_metrics",
    "train_flops",
]

MIB = 2**20


@functools.cache
def _glibc_malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS, Windows)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_free_heap() -> bool:
    """Return the pages of freed heap memory to the operating system (glibc ``malloc_trim(0)``).

    glibc keeps memory that ``free`` gave back inside its arenas (and raises its mmap threshold
    after large frees, so later large tensors come from the heap too); ``malloc_trim(0)`` releases
    every whole free page of every arena (``madvise(MADV_DONTNEED)``), so the resident set size
    falls to what is still allocated. Safe to call from any thread (it takes each arena's lock in
    turn). Returns True when memory was released, False when none was or the C library is not glibc.
    """
    trim = _glibc_malloc_trim()
    return bool(trim(0)) if trim is not None else False


def reset_peak_rss() -> bool:
    """Set the kernel's peak resident set size of this process (``VmHWM``) to its current one
    (Linux: ``5`` written to ``/proc/self/clear_refs``). Returns False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def peak_rss() -> int | None:
    """The kernel's peak resident set size of this process in bytes (``VmHWM``; every page ever
    resident since the last :func:`reset_peak_rss`, however briefly), or None off Linux."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class Averager:
    """Weighted means of named scalars over micro-batches and ranks.

    ``add(values, weight)`` once per micro-batch (weight 0 for a placeholder micro-batch, so every
    rank adds the same keys); values and weights may be Python numbers or 0-dim tensors on any
    device (a tensor is summed where it is, so adding one never waits for the device);
    :meth:`means` reads them once, all-reduces the sums and weights over ranks (a collective when
    ``torch.distributed`` is initialised) and returns ``prefix + key -> mean`` (0 where no weight
    was added anywhere).
    """

    def __init__(self):
        self.sums: dict[str, float | torch.Tensor] = defaultdict(float)
        self.weights: dict[str, float | torch.Tensor] = defaultdict(float)

    def add(self, values: Mapping[str, float | torch.Tensor], weight: float | torch.Tensor = 1.0) -> None:
        if isinstance(weight, torch.Tensor):
            weight = weight.detach().double()
        for key, value in values.items():
            value = value.detach().double() if isinstance(value, torch.Tensor) else float(value)
            self.sums[key] = self.sums[key] + weight * value
            self.weights[key] = self.weights[key] + weight

    def means(self, prefix: str = "", divisors: Mapping[str, float] | None = None) -> dict[str, float]:
        """``prefix + key -> mean`` over every rank; a key in ``divisors`` gets its sum over every
        rank divided by that number instead (a loss whose micro-batch values are shares of it)."""
        divisors = divisors or {}
        names = sorted(self.sums)
        table = torch.tensor(
            [[float(self.sums[k]) for k in names], [float(self.weights[k]) for k in names]], dtype=torch.float64
        )
        if dist.is_initialized() and dist.get_world_size() > 1 and names:
            dist.all_reduce(table)
        return {
            f"{prefix}{k}": (s / divisors[k] if k in divisors else s / w if w > 0 else 0.0)
            for k, s, w in zip(names, *table.tolist(), strict=True)
        }


def reduce_mean(metrics: dict[str, float], keys: Iterable[str] | None = None) -> dict[str, float]:
    """Average ``keys`` (default: all) of every rank's ``metrics`` in place, in one all-reduce.

    Every rank must pass the same keys. Returns ``metrics``.
    """
    names = sorted(metrics if keys is None else keys)
    if not dist.is_initialized() or dist.get_world_size() == 1 or not names:
        return metrics
    values = torch.tensor([float(metrics[k]) for k in names], dtype=torch.float64)
    dist.all_reduce(values)
    for key, value in zip(names, (values / dist.get_world_size()).tolist(), strict=True):
        metrics[key] = value
    return metrics


def measure_peak_flops(
    device: torch.device, dtype: torch.dtype = torch.float32, size: int | None = None, repeats: int = 5
) -> float:
    """Achievable matmul FLOP/s of one rank: the best of ``repeats`` ``size x size`` products in
    ``dtype`` on ``device`` (threads as this process has them). ``size`` defaults to
    :func:`peak_matmul_size`."""
    size = size or peak_matmul_size(device)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(repeats + 1):  # the first run warms up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        (a @ b).sum().item()
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best


def peak_matmul_size(device: torch.device) -> int:
    """The side of :func:`measure_peak_flops`'s matmul: 2048 on an accelerator; 1024 on a CPU, which
    reaches its matmul peak there (one thread of this project's 2-core host: 59 GFLOP/s at 1024 in
    0.16 s, 64 GFLOP/s at 2048 in 1.8 s, per rank at every trainer start)."""
    return 1024 if torch.device(device).type == "cpu" else 2048


#: Dense (no structured sparsity) peak TFLOP/s per GPU from the vendors' datasheets, by device
#: name (``torch.cuda.get_device_name``, a regular expression, first match wins) and by the
#: matmul's precision: ``bf16`` (also float16), ``tf32`` (float32 with TF32 matmuls allowed) and
#: ``fp32`` (float32, IEEE). Sources: NVIDIA H100, H200, A100, L40S, L40, L4, A10, V100 and B200
#: datasheets; AMD Instinct MI300X and MI250X datasheets.
DATASHEET_PEAKS: tuple[tuple[str, str, dict[str, float]], ...] = (
    (r"H100.*PCIe", "H100 PCIe", {"bf16": 756.5, "tf32": 378.0, "fp32": 51.2}),
    (r"H100.*NVL", "H100 NVL", {"bf16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    (r"H200.*NVL", "H200 NVL", {"bf16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    (r"H100|H200|GH200|H800", "H100/H200 SXM", {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    (r"B200", "B200", {"bf16": 2250.0, "tf32": 1100.0, "fp32": 75.0}),
    (r"A100|A800", "A100", {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    (r"L40S", "L40S", {"bf16": 362.05, "tf32": 183.0, "fp32": 91.6}),
    (r"\bL40\b", "L40", {"bf16": 181.05, "tf32": 90.5, "fp32": 90.5}),
    (r"\bL4\b", "L4", {"bf16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    (r"\bA10\b", "A10", {"bf16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    (r"V100", "V100", {"bf16": 125.0, "tf32": 15.7, "fp32": 15.7}),  # float16 tensor cores; no bf16 units
    (r"MI300X", "MI300X", {"bf16": 1307.4, "tf32": 653.7, "fp32": 163.4}),
    (r"MI250X", "MI250X", {"bf16": 383.0, "tf32": 47.9, "fp32": 47.9}),
)


def _precision(dtype: torch.dtype) -> str:
    if dtype in (torch.bfloat16, torch.float16):
        return "bf16"
    tf32 = torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest"
    return "tf32" if tf32 else "fp32"


def datasheet_peak_flops(device_name: str, dtype: torch.dtype) -> tuple[float, str] | None:
    """``(FLOP/s, what it is)`` of ``device_name`` (e.g. ``"NVIDIA H100 80GB HBM3"``) in ``dtype``
    from :data:`DATASHEET_PEAKS`, or None for a device not listed."""
    for pattern, name, peaks in DATASHEET_PEAKS:
        if re.search(pattern, device_name):
            precision = _precision(dtype)
            return peaks[precision] * 1e12, f"{name} {precision} dense, datasheet"
    return None


def peak_flops_from_config(value, device: torch.device, dtype: torch.dtype) -> float:
    """The MFU denominator, FLOP/s per rank: ``trainer.peak_flops`` as given; when null/0 the
    datasheet peak of a known GPU (:func:`datasheet_peak_flops`), else measured
    (:func:`measure_peak_flops`), averaged over ranks so every rank reports the same MFU
    denominator. Rank 0 prints the peak used and where it comes from."""
    device = torch.device(device)
    listed = datasheet_peak_flops(torch.cuda.get_device_name(device), dtype) if device.type == "cuda" else None
    if value:
        peak, source = float(value), "trainer.peak_flops"
    elif listed is not None:
        peak, source = listed
    else:
        peak, source = (
            measure_peak_flops(device, dtype),
            f"measured: a {peak_matmul_size(device)}^3 {str(dtype).removeprefix('torch.')} matmul",
        )
    if dist.is_initialized():
        t = torch.tensor([peak], dtype=torch.float64)
        dist.all_reduce(t)
        peak = float(t[0]) / dist.get_world_size()
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"MFU peak: {peak / 1e12:.4g} TFLOP/s per rank ({source})", flush=True)
    return peak


def train_flops(
    num_parameters: int, forward_tokens: int = 0, train_tokens: int = 0, generated_tokens: int = 0
) -> float:
    """Model FLOPs: ``2 P`` per token of a forward-only pass (scoring, generation) and ``6 P`` per
    token of a forward + backward pass."""
    return 2.0 * num_parameters * (forward_tokens + generated_tokens) + 6.0 * num_parameters * train_tokens


def throughput_metrics(flops: float, tokens: float, seconds: float, peak_flops: float, world: int = 1) -> dict:
    """``perf/tokens_per_second`` (``tokens / seconds``), ``perf/mfu`` (``flops / seconds`` over
    ``world`` ranks' ``peak_flops``, FLOP/s per rank) and ``time/step`` (``seconds``) of one step."""
    return {
        "perf/tokens_per_second": tokens / seconds,
        "perf/mfu": flops / seconds / peak_flops / world,
        "time/step": seconds,
    }


class PeakMemory:
    """Peak memory per named phase of a step (see the module docstring).

    ``with memory.phase("update"): ...`` once per phase; :meth:`metrics` returns
    ``memory/<phase>_peak_mib`` for the phases since the last call (a collective: the maximum over
    ranks when ``torch.distributed`` is initialised) and starts over.

    Args:
        device: the training device; CUDA devices report allocator peaks, others RSS.
        interval: seconds between RSS samples on CPU.
        release_every: on CPU, seconds between :func:`release_free_heap` calls while a phase runs
            (and once when it ends); None never releases.
    """

    def __init__(self, device: torch.device, interval: float = 0.005, release_every: float | None = 1.0):
        self.device, self.interval, self.release_every = torch.device(device), interval, release_every
        self.peaks: dict[str, float] = {}
        self._process = psutil.Process()

    def phase(self, name: str):
        return _Phase(self, name)

    def metrics(self) -> dict[str, float]:
        names = sorted(self.peaks)
        values = torch.tensor([self.peaks[n] for n in names], dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1 and names:
            dist.all_reduce(values, op=dist.ReduceOp.MAX)
        self.peaks = {}
        return {f"memory/{n}_peak_mib": v / MIB for n, v in zip(names, values.tolist(), strict=True)}


class _Phase:
    def __init__(self, owner: PeakMemory, name: str):
        self.owner, self.name = owner, name
        self.peak, self.done = 0, threading.Event()

    def _sample(self):
        release_every = self.owner.release_every
        last_release = time.monotonic()
        while not self.done.wait(self.owner.interval):
            self.peak = max(self.peak, self.owner._process.memory_info().rss)
            if release_every is not None and time.monotonic() - last_release >= release_every:
                release_free_heap()
                last_release = time.monotonic()

    def __enter__(self):
        if self.owner.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.owner.device)
        else:
            # the kernel's own peak where it can be reset (exact), the samples where not: a sampler
            # thread on a busy host can miss a short spike
            self.kernel_peak = reset_peak_rss()
            self.peak = self.owner._process.memory_info().rss
            self.thread = threading.Thread(target=self._sample, daemon=True, name=f"rss-{self.name}")
            self.thread.start()
        return self

    def __exit__(self, *exc):
        if self.owner.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.owner.device)
        else:
            self.done.set()
            self.thread.join()
            peak = max(self.peak, self.owner._process.memory_info().rss)
            if self.kernel_peak:
                peak = max(peak, peak_rss() or 0)
            if self.owner.release_every is not None:
                release_free_heap()
        self.owner.peaks[self.name] = max(self.owner.peaks.get(self.name, 0), peak)
        return False


def simulated_memory_bytes() -> int | None:
    """``RL2GEM_SIMULATED_MEMORY_MIB`` in bytes, or None (see the module docstring)."""
    value = os.environ.get("RL2GEM_SIMULATED_MEMORY_MIB")
    return int(float(value) * MIB) if value else None


class SavedTensorBytes:
    """Counts the bytes of the tensors autograd saves for backward inside the ``with`` block (each
    storage once). With ``limit``, saving past it raises ``torch.OutOfMemoryError``.

    Attributes:
        bytes: the count so far.
    """

    active = 0  # blocks open now: autograd uses only the innermost hooks, so one counter at a time

    def __init__(self, limit: int | None = None):
        self.limit, self.bytes, self._seen = limit, 0, set()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        local = getattr(tensor, "_local_tensor", tensor)  # a DTensor's shard
        try:
            storage = local.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor subclass without a storage of its own
            return tensor
        key = (storage.device, storage.data_ptr())
        if key not in self._seen:
            self._seen.add(key)
            self.bytes += storage.nbytes()
            if self.limit is not None and self.bytes > self.limit:
                raise torch.OutOfMemoryError(
                    f"simulated device memory: activations need more than {self.limit / MIB:.0f} MiB "
                    "(RL2GEM_SIMULATED_MEMORY_MIB)"
                )
        return tensor

    def __enter__(self):
        self._hooks.__enter__()
        SavedTensorBytes.active += 1
        return self

    def __exit__(self, *exc):
        SavedTensorBytes.active -= 1
        self._seen.clear()
        return self._hooks.__exit__(*exc)
