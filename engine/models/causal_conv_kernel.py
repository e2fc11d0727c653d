"""A Triton kernel for the DiT's position convolution: grouped, causal, kernel 31, Mish after.

cuDNN runs this convolution (16 groups of 64 channels) as one "analytic" implicit GEMM per
group on a channels-first copy of the DiT's frame-major activations, plus layout
conversions each way: on an H100 a 64-chunk opening round spent ~24% of its kernel time
there, for ~2% of its arithmetic (round 38 of docs/benchmarks.md). Here one program computes
a tile of `BLOCK_T` output frames of one group of one row as 31 small matrix products (one
per tap: the tile's input frames shifted by the tap, [BLOCK_T, 64] x [64, 64]), reads the
frame-major input where it lies (frames before the row's start read as zeros, which is the
convolution's causal padding), and applies the bias and Mish before it stores.

`available(x, conv)` says whether this path can run: a convolution of that kind, CUDA (or
Triton's interpreter on the CPU, `TRITON_INTERPRET=1` set before Triton is imported, which
the tests use) and Triton importable.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
from torch import nn

from .triton_support import build, interpreting

# Output frames per program. Each tile re-reads its group's weights (31 x 64 x 64), which
# larger tiles amortise better and pad more masked frames. On an H100 (round 38 of
# docs/benchmarks.md, `bench.position_conv`) 64 was the fastest for one chunk's rows, 128
# 16-21% faster at 128 rows (the stage was measured with 64), 32 the slowest everywhere.
BLOCK_T = 64


@functools.cache
def _triton() -> Any | None:
    return build(_build)


def _build(triton: Any, tl: Any) -> Any:
    @triton.jit
    def grouped_causal_conv(x_ptr, w_ptr, b_ptr, out_ptr, frames, channels,
                            TAPS: tl.constexpr, PER_GROUP: tl.constexpr, BLOCK: tl.constexpr,
                            MISH: tl.constexpr, PRECISION: tl.constexpr):
        tile, group, row = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        t = tile * BLOCK + tl.arange(0, BLOCK)
        c = tl.arange(0, PER_GROUP)
        base = row.to(tl.int64) * frames * channels + group * PER_GROUP
        acc = tl.zeros((BLOCK, PER_GROUP), dtype=tl.float32)
        for tap in range(TAPS):
            src = t - (TAPS - 1) + tap
            keep = (src >= 0) & (src < frames)
            xs = tl.load(x_ptr + base + src[:, None] * channels + c[None, :], mask=keep[:, None], other=0.0)
            # Packed weights [groups, taps, in, out]: this tap's [in, out] block.
            ws = tl.load(w_ptr + ((group * TAPS + tap) * PER_GROUP + c[:, None]) * PER_GROUP + c[None, :])
            acc += tl.dot(xs, ws, input_precision=PRECISION)
        acc += tl.load(b_ptr + group * PER_GROUP + c).to(tl.float32)[None, :]
        if MISH:
            # x * tanh(softplus(x)) = x * n(n + 2) / (n(n + 2) + 2) with n = e^x; for x > 20
            # the factor is 1 in float32, and capping x keeps n^2 finite.
            n = tl.exp(tl.minimum(acc, 20.0))
            r = n * (n + 2.0)
            acc = acc * (r / (r + 2.0))
        tl.store(out_ptr + base + t[:, None] * channels + c[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=(t < frames)[:, None])

    return grouped_causal_conv


def supports(conv: nn.Conv1d) -> bool:
    """Whether the kernel computes `conv`: stride 1, no dilation, a bias, equal in and out
    channels per group, and a power of two of at least 16 of them (tl.dot's smallest tile)."""
    per_group = conv.in_channels // conv.groups
    return (conv.stride == (1,) and conv.dilation == (1,) and conv.bias is not None
            and conv.out_channels == conv.in_channels and per_group >= 16 and not per_group & (per_group - 1))


def available(x: torch.Tensor, conv: nn.Conv1d) -> bool:
    """Whether `grouped_causal_conv_mish` can run `conv` on x: CUDA, or the CPU under
    Triton's interpreter (tests); float32 inputs only under the interpreter (on the GPU the
    flow runs in bf16, and Triton's float32 dot would round through TF32)."""
    if not supports(conv) or x.shape[-1] != conv.in_channels:
        return False
    if conv.weight.dtype != x.dtype or conv.weight.device != x.device:
        return False  # e.g. float32 weights under autocast: tl.dot takes one dtype
    if x.is_cuda:
        return x.dtype in (torch.bfloat16, torch.float16) and _triton() is not None
    return interpreting() and x.dtype == torch.float32 and _triton() is not None


def packed_weight(conv: nn.Conv1d) -> torch.Tensor:
    """conv.weight [out, in / groups, taps] as [groups, taps, in / groups, out / groups]
    contiguous: each tap's block is one [in, out] matrix the kernel reads whole."""
    groups, taps = conv.groups, conv.kernel_size[0]
    out_pg, in_pg = conv.out_channels // groups, conv.in_channels // groups
    return conv.weight.detach().view(groups, out_pg, in_pg, taps).permute(0, 3, 2, 1).contiguous()


def grouped_causal_conv_mish(x: torch.Tensor, conv: nn.Conv1d, weight: torch.Tensor, mish: bool = True,
                             block: int = BLOCK_T) -> torch.Tensor:
    """Mish(conv(x)) (or conv(x) without `mish`) over frame-major x [B, T, C], the
    convolution's kernel - 1 frames of causal (zero) padding on the left implied, ->
    [B, T, C]; `weight` is `packed_weight(conv)`, `conv` one the kernel `supports`."""
    kernel = _triton()
    if kernel is None:
        raise RuntimeError("Triton is not importable")
    if not supports(conv) or x.shape[-1] != conv.in_channels:
        raise ValueError("the kernel takes stride 1, no dilation, a bias, equal in and out channels and "
                         "a power-of-two group width of at least 16")
    batch, frames, channels = x.shape
    groups, taps = conv.groups, conv.kernel_size[0]
    per_group = channels // groups
    x = x.contiguous()
    out = torch.empty_like(x)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # tf32: ignored for 16-bit inputs
    grid = (-(-frames // block), groups, batch)
    # Triton launches on the current device; a stage may live on another GPU than that.
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        kernel[grid](x, weight, conv.bias, out, frames, channels, TAPS=taps, PER_GROUP=per_group,
                     BLOCK=block, MISH=mish, PRECISION=precision)
    return out
