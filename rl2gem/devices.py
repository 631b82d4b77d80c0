"""Host-to-device copies that do not wait for the device, and a count of the tensor operations a
piece of code dispatches (each a kernel launch or more on a GPU: host time the device may wait for)."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OperationCounter", "indexes_to_device", "to_device"]


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` (on the host) on ``device``: through pinned memory and without waiting on CUDA,
    a plain copy elsewhere. A copy from pageable memory (``torch.tensor(values, device="cuda")``,
    ``.to("cuda")``) first waits for the stream's queued work, so one made after a forward stops
    the host from queueing the backward until the GPU is done, and one made while the engine's
    next decode round runs (``decode_overlap``) waits for that round. The pinned buffer comes from
    PyTorch's caching host allocator, which keeps it until the copy is done."""
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def indexes_to_device(arrays, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Integer host arrays (numpy arrays or lists, any lengths) -> int64 tensors on ``device``,
    one each, through one :func:`to_device` copy of their concatenation (one copy, not one per
    array, and no wait for the device's queued work on CUDA): views of one buffer."""
    lengths = [len(array) for array in arrays]
    flat = np.concatenate([np.asarray(array, dtype=np.int64) for array in arrays])
    return to_device(torch.from_numpy(flat), device).split(lengths)


class OperationCounter(TorchDispatchMode):
    """``with OperationCounter() as counter:``: ``counter.count`` is the number of ATen operations
    dispatched in the entering thread inside the block (views included), on any device."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))
