"""A Triton kernel for the vocoder's Snake activation, x + sin^2(alpha x) / alpha per channel.

The HiFT vocoder applies ~70 Snake activations per decode, each as four or five elementwise
passes over a float32 activation in eager PyTorch (multiply, sine, square, multiply, add),
and at the stage's large rounds the vocoder runs eagerly (its CUDA graphs stop at 8 streams):
those passes re-read and re-write the largest tensors of the decode. Here one program reads
a tile of one channel of one row once and writes the activation once, in float32 arithmetic.

`available(x)` says whether this path can run: CUDA (or Triton's interpreter on the CPU,
`TRITON_INTERPRET=1` set before Triton is imported, which the tests use) and Triton
importable, for a [B, C, T] activation (made contiguous first where it is not).
`snake_channels_last` is the same activation over a [B, C, 1, T] channels-last activation
(the vocoder's channels-last decode, frame-major storage): one program walks a tile of the
flat storage, whose channel is the index modulo C.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

from .triton_support import build, interpreting

BLOCK_T = 1024  # elements per program: samples of one channel (channels-first), frames x channels (last)


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

    @triton.jit
    def snake_channels_last(x_ptr, alpha_ptr, inverse_ptr, bias_ptr, out_ptr, row_in, row_out, pad, channels,
                            HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
        # Axis 0 walks a row's output tiles (frames x channels, channel fastest), axis 1
        # (at most 65535) the rows. The first `pad` elements of an output row are zeros.
        tile, row = tl.program_id(0), tl.program_id(1)
        at = tile.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # a row may pass 2^31 elements
        keep = at < row_out
        real = keep & (at >= pad)
        channel = at % channels  # C <= 512 values: the gathers hit the cache
        x = tl.load(x_ptr + row.to(tl.int64) * row_in + (at - pad), mask=real, other=0.0).to(tl.float32)
        if HAS_BIAS:
            x += tl.load(bias_ptr + channel, mask=keep, other=0.0).to(tl.float32)
        alpha = tl.load(alpha_ptr + channel, mask=keep, other=1.0).to(tl.float32)
        inverse = tl.load(inverse_ptr + channel, mask=keep, other=1.0).to(tl.float32)
        s = tl.sin(x * alpha)
        y = tl.where(real, x + inverse * s * s, 0.0)
        tl.store(out_ptr + row.to(tl.int64) * row_out + at, y.to(out_ptr.dtype.element_ty), mask=keep)

    return snake, snake_channels_last


def available(x: torch.Tensor, channels_last: bool = False) -> bool:
    """Whether `snake` (`snake_channels_last` with channels_last) can run on x: a [B, C, T]
    ([B, C, 1, T]) activation on CUDA (float32 or 16-bit), or float32 on the CPU under
    Triton's interpreter (tests)."""
    if x.dim() != (4 if channels_last else 3) or (channels_last and x.shape[2] != 1):
        return False
    if x.is_cuda:
        return x.dtype in (torch.float32, torch.bfloat16, torch.float16) and _triton() is not None
    return interpreting() and x.dtype == torch.float32 and _triton() is not None


def snake(x: torch.Tensor, alpha: torch.Tensor, inverse: torch.Tensor, block: int = BLOCK_T) -> torch.Tensor:
    """x + inverse * sin(alpha x)^2 over x [B, C, T]; alpha and inverse hold C values each
    (any shape, e.g. [1, C, 1]), inverse = 1 / (alpha + eps) as the caller keeps it."""
    batch, channels, length = x.shape
    alpha, inverse = _coefficients(alpha, inverse, channels)
    kernel = _kernels()[0]
    x = x.contiguous()
    out = torch.empty_like(x)
    if x.numel() == 0:
        return out
    grid = (batch * channels, -(-length // block))
    # Triton launches on the current device; a stage may live on another GPU than that.
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        kernel[grid](x, alpha, inverse, out, length, channels, BLOCK=block)
    return out


def snake_channels_last(x: torch.Tensor, alpha: torch.Tensor, inverse: torch.Tensor,
                        bias: torch.Tensor | None = None, pad_left: int = 0, block: int = BLOCK_T) -> torch.Tensor:
    """`snake` of x + bias over x [B, C, 1, T] in channels-last memory format (made so first
    where it is not), with `pad_left` zero frames before each row's output: [B, C, 1,
    pad_left + T], channels-last. The bias (C values) and the zeros are what a convolution
    before and a left-causal convolution after it would otherwise add and pad in passes of
    their own."""
    if x.dim() != 4 or x.shape[2] != 1:
        raise ValueError(f"a channels-last activation here is [B, C, 1, T], got {tuple(x.shape)}")
    batch, channels, _, frames = x.shape
    if batch > 65535:
        raise ValueError(f"at most 65535 rows (a grid axis), got {batch}")
    alpha, inverse = _coefficients(alpha, inverse, channels)
    if bias is not None and bias.numel() != channels:
        raise ValueError(f"the bias needs {channels} values, got {bias.numel()}")
    kernel = _kernels()[1]
    x = x.contiguous(memory_format=torch.channels_last)
    out = torch.empty((batch, channels, 1, pad_left + frames), dtype=x.dtype, device=x.device,
                      memory_format=torch.channels_last)
    if out.numel() == 0:
        return out
    row_out = (pad_left + frames) * channels
    grid = (-(-row_out // block), batch)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        kernel[grid](x, alpha, inverse, alpha if bias is None else bias.reshape(-1).contiguous(), out,
                     frames * channels, row_out, pad_left * channels, channels,
                     HAS_BIAS=bias is not None, BLOCK=block)
    return out


def _coefficients(alpha: torch.Tensor, inverse: torch.Tensor, channels: int) -> tuple[torch.Tensor, torch.Tensor]:
    alpha, inverse = alpha.reshape(-1), inverse.reshape(-1)
    if alpha.numel() != channels or inverse.numel() != channels:
        raise ValueError(f"alpha and its inverse need {channels} values, got {alpha.numel()} and {inverse.numel()}")
    return alpha.contiguous(), inverse.contiguous()


def _kernels() -> Any:
    kernels = _triton()
    if kernels is None:
        raise RuntimeError("Triton is not importable")
    return kernels
