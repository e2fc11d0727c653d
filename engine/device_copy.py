"""Small host-built tensors onto the GPU without making the host wait for the GPU.

A plain host->device copy from pageable memory makes PyTorch synchronize the stream:
the host stops until every kernel queued before the copy has run. In the middle of a
flow/vocoder batch that empties the GPU's queue (the Python work after it runs with the
GPU idle); in vLLM's logits processor it undoes the overlap of step N+1's scheduling
with step N's kernels. Copying from pinned memory with ``non_blocking`` queues the copy
in stream order instead; PyTorch's caching host allocator keeps the pinned buffer alive
until the copy has run. Off CUDA both are plain copies.
"""

from __future__ import annotations

from typing import Any

import torch


def to_device(t: torch.Tensor, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t`` on ``device`` (and ``dtype``), queued behind the GPU's work instead of waiting for it."""
    device = torch.device(device)
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)  # on the host: the copy moves the final dtype
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def tensor_on(data: Any, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.tensor(data, dtype=dtype, device=device)`` without the wait."""
    return to_device(torch.tensor(data, dtype=dtype), device)
