"""A Triton kernel for the vocoder's Snake activation, x + sin^2(alpha x) / alpha per channel.

The HiFT vocoder applies ~70 Snake activations per decode, each as four or five elementwise
passes over a float32 activation in eager PyTorch (multiply, sine, square, multiply, add),
and at the stage's large rounds the vocoder runs eagerly (its CUDA graphs stop at 8 streams):
those passes re-read and re-write the largest tensors of the decode. Here one program reads
a tile of one channel of one row once and writes the activation once, in float32 arithmetic.

`available(x)` says whether this path can run: CUDA (or Triton's interpreter on the CPU,
`TRITON_INTERPRET=1` set before Triton is imported, which the tests use) and Triton
importable, for a [B, C, T] activation (made contiguous first where it is not).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

from .triton_support import build, interpreting

BLOCK_T = 1024  # samples of one channel per program


@functools.cache
def _triton() -> Any | None:
    return build(_build)


def _build(triton: Any, tl: Any) -> Any:
    @triton.jit
    def snake(x_ptr, alpha_ptr, inverse_ptr, out_ptr, length, channels, BLOCK: tl.constexpr):
        # Axis 0 (up to 2^31 - 1 programs) walks rows x channels, so one alpha per program;
        # axis 1 (at most 65535) the time tiles.
        line, tile = tl.program_id(0), tl.program_id(1)
        channel = line % channels
        t = tile * BLOCK + tl.arange(0, BLOCK)
        keep = t < length
        at = line.to(tl.int64) * length + t
        x = tl.load(x_ptr + at, mask=keep, other=0.0).to(tl.float32)
        alpha = tl.load(alpha_ptr + channel).to(tl.float32)
        inverse = tl.load(inverse_ptr + channel).to(tl.float32)
        s = tl.sin(x * alpha)
        tl.store(out_ptr + at, (x + inverse * s * s).to(out_ptr.dtype.element_ty), mask=keep)

    return snake


def available(x: torch.Tensor) -> bool:
    """Whether `snake` can run on x: a [B, C, T] activation on CUDA (float32 or 16-bit), or
    float32 on the CPU under Triton's interpreter (tests)."""
    if x.dim() != 3:
        return False
    if x.is_cuda:
        return x.dtype in (torch.float32, torch.bfloat16, torch.float16) and _triton() is not None
    return interpreting() and x.dtype == torch.float32 and _triton() is not None


def snake(x: torch.Tensor, alpha: torch.Tensor, inverse: torch.Tensor, block: int = BLOCK_T) -> torch.Tensor:
    """x + inverse * sin(alpha x)^2 over x [B, C, T]; alpha and inverse hold C values each
    (any shape, e.g. [1, C, 1]), inverse = 1 / (alpha + eps) as the caller keeps it."""
    batch, channels, length = x.shape
    alpha, inverse = alpha.reshape(-1), inverse.reshape(-1)
    if alpha.numel() != channels or inverse.numel() != channels:
        raise ValueError(f"alpha and its inverse need {channels} values, got {alpha.numel()} and {inverse.numel()}")
    kernel = _triton()
    if kernel is None:
        raise RuntimeError("Triton is not importable")
    x = x.contiguous()
    out = torch.empty_like(x)
    if x.numel() == 0:
        return out
    grid = (batch * channels, -(-length // block))
    # Triton launches on the current device; a stage may live on another GPU than that.
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        kernel[grid](x, alpha.contiguous(), inverse.contiguous(), out, length, channels, BLOCK=block)
    return out
