"""Host-to-device copies that do not wait for the device."""

from __future__ import annotations

import torch

__all__ = ["to_device"]


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
