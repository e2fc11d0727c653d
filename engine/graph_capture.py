"""What the flow's and the vocoder's CUDA-graph runners share (`engine.flow_graphs`,
`engine.vocoder_graphs`)."""

from __future__ import annotations

import threading

import torch

# PyTorch allows one graph capture at a time per process (entering a capture empties
# every device's cache and checks that no capture is under way); with one stage per GPU
# (`engine.stage_pool`) several worker threads may want to capture at once, the flow's
# graphs and the vocoder's. A lock, not state: replays and eager work never take it.
CAPTURE_LOCK = threading.Lock()


def copy_padded(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst <- src, zero-padded at the end of every dim (dst is a static buffer)."""
    if dst.shape == src.shape:
        dst.copy_(src)
        return
    dst.zero_()
    dst[tuple(slice(0, n) for n in src.shape)].copy_(src)
