"""A Triton kernel for the DiT's split attention: a one-voice batch's queries over the voice
prompt's cached keys and over each row's own keys, in one pass.

`dit.split_prefix_attention` runs that attention as two calls (cuDNN's, with log-sum-exps):
every CFG half's queries over its prompt keys, each row's queries over its own keys, and a
merge of the two by their log-sum-exps. At the rounds the stage runs under a steady load
(~5 chunks, padded to 8 rows) each call is launch-sized: on an H100 the 440 calls of a
round took 27 us each, 20% of its GPU time, and the merge another 4.6% (round 44 of
docs/benchmarks.md). Here one program takes a tile of `LaunchConfig.block_m` queries of
one row and one head through both key sets with one online softmax (the prompt's keys
first, then the row's own), so a block's attention is one launch and needs no merge. The
Triton code is `split_attention_triton`.

`runs_on(device, dtype)` says whether this path can run: CUDA with 16-bit inputs, or
Triton's interpreter on the CPU in float32 (`TRITON_INTERPRET=1` set before Triton is
imported, which the tests use). It is asked when the kernel is chosen
(`dit.attention_kernel_for`), not in the blocks, which run under torch.compile. The
stage's default (`EngineConfig.flow_attention` "triton") since round 45, where on H100s
the stage's rounds of 5-8 chunks took 3.5-5% less time with it than with cuDNN's two calls.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch

from .triton_support import interpreting

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LaunchConfig:
    """How the kernel is launched: `block_m` queries per program, `block_n` keys per step of
    the online softmax (powers of two, at least 16), and Triton's `num_warps` and
    `num_stages` (the loads kept in flight ahead of the step that uses them)."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3


# On an H100 (`bench.split_attention_tune`, round 45 of docs/benchmarks.md) these were the
# best of 22 settings at 8 rows, 200 prompt keys, 60 ring slots and 200 or 300 frames (54 and
# 80 us a call), the steady rounds' shapes by the time the stage's calls took. 32-key steps
# won at 50 and 100 frames (at 100 with the bias's strides specialised: 19.5 against 24.8
# us), and lost 2% at 200 frames and 9% at 300.
LAUNCH = LaunchConfig()


@functools.cache
def _triton() -> Any | None:
    """The jitted kernel (`split_attention_triton`), None where Triton does not import."""
    try:
        from . import split_attention_triton
    except ImportError:
        return None
    return split_attention_triton.split_attention


def runs_on(device: torch.device, dtype: torch.dtype, rotary: bool = False) -> bool:
    """Whether `split_prefix_attention` can run on inputs of `dtype` on `device` (`rotary`:
    with the rotary embedding applied in the kernel): CUDA in bf16 or fp16 where a trial
    call compiles, runs and agrees with the torch formula (`_trial`: a kernel that fails
    inside the stage's compiled blocks has no fallback), or the CPU in float32 under
    Triton's interpreter (tests), with Triton importable."""
    if _triton() is None:
        if device.type == "cuda":
            log.warning("Triton does not import: the split attention kernel does not run on %s", device)
        return False
    if device.type == "cuda":
        return dtype in (torch.bfloat16, torch.float16) and _trial(device, dtype, rotary)
    return device.type == "cpu" and interpreting() and dtype == torch.float32


@functools.cache
def _trial(device: torch.device, dtype: torch.dtype, rotary: bool = False) -> bool:
    """One call at the DiT's kind of shape (16 heads of 64, a prompt and own keys each
    across a block of keys, two rows; with `rotary` q, k and v are views of one projection
    and the own keys the queries' frames, each row at its own positions), against the
    attention over the concatenated keys in float32 (head 0's queries and own keys rotated
    first, as `dit.apply_rotary` does)."""
    from .dit import RotaryEmbedding, apply_rotary  # not at the top: dit imports this module

    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        batch, heads, length, width, dh = 4, 16, 70, 90, 64
        own = length if rotary else 100

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g).to(device, dtype)

        q, k, v, pk, pv = rand(batch, heads, length, dh), rand(batch, heads, own, dh), rand(batch, heads, own, dh), \
            rand(2, heads, width, dh), rand(2, heads, width, dh)
        zeros = torch.zeros
        biases = (zeros(2, 1, 1, width, device=device, dtype=dtype),
                  zeros(batch, 1, length, own, device=device, dtype=dtype))
        rope = None
        if rotary:  # as the DiT calls it: q, k, v views of one projection, each row at its own position
            q, k, v = (t.view(batch, length, heads, dh).transpose(1, 2)
                       for t in rand(batch, length, 3 * heads * dh).split(heads * dh, dim=-1))
            positions = torch.arange(length, device=device) + 50 * torch.arange(batch, device=device)[:, None]
            angles = RotaryEmbedding(dh).to(device).at(positions)  # [B, T, dh] float32
            rope = (angles.cos(), angles.sin())
        got = split_prefix_attention(q, k, v, (pk, pv), *biases, rope)
        if rope is not None:  # the reference rotates head 0 of the queries and own keys itself
            q, k = q.clone(), k.clone()
            q[:, 0], k[:, 0] = apply_rotary(q[:, 0], *rope), apply_rotary(k[:, 0], *rope)
        keys = torch.cat((pk.repeat_interleave(batch // 2, dim=0), k), dim=2).float()
        values = torch.cat((pv.repeat_interleave(batch // 2, dim=0), v), dim=2).float()
        want = torch.softmax(q.float() @ keys.transpose(-1, -2) * dh ** -0.5, dim=-1) @ values
        want = want.transpose(1, 2).reshape(batch, length, heads * dh)
        worst = float((got.float() - want).abs().max())
        if not worst < 0.05:
            log.warning("the split attention kernel%s disagrees with the torch formula on %s (%s) by up to %.3g; "
                        "the DiT uses %s", " with the rotary embedding" if rotary else "", device, dtype, worst,
                        "the kernel without it" if rotary else "cuDNN's")
        return worst < 0.05
    except Exception:  # any failure of the trial: the stage takes cuDNN's two calls instead
        log.warning("the split attention kernel%s does not run on %s (%s); the DiT uses %s",
                    " with the rotary embedding" if rotary else "", device, dtype,
                    "the kernel without it" if rotary else "cuDNN's", exc_info=True)
        return False


def split_prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           prefix_kv: tuple[torch.Tensor, torch.Tensor], prefix_bias: torch.Tensor,
                           own_bias: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """What `dit.split_prefix_attention` computes, as one kernel: q [B, H, T, dh] (B = 2R,
    rows [0, R) conditional), k, v [B, H, S, dh]; prefix_kv [2, H, W, dh] each; the
    additive biases [2, 1, 1, W] over the prefix keys and [B, 1, T, S] over each row's own.
    With `rope` (cos and sin of the frames' rotary angles, [B, T, dh] float32) q and the
    own keys are as the projection makes them, the own keys are the queries' frames
    (S = T), and head 0 of both is rotated in the kernel (`dit.apply_rotary` rotates the
    projection's first dh channels). Returns [B, T, H x dh]."""
    if rope is None:
        return torch.ops.cosyvoice.split_prefix_attention(q, k, v, prefix_kv[0], prefix_kv[1], prefix_bias, own_bias)
    return torch.ops.cosyvoice.split_prefix_attention_rotary(q, k, v, prefix_kv[0], prefix_kv[1], prefix_bias,
                                                             own_bias, rope[0], rope[1])


# Operators of their own: the DiT's blocks run under torch.compile, which takes each as one
# opaque call (its shape from `_fake`) instead of tracing the launch.
@torch.library.custom_op("cosyvoice::split_prefix_attention", mutates_args=())
def _split_prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pk: torch.Tensor, pv: torch.Tensor,
                            prefix_bias: torch.Tensor, own_bias: torch.Tensor) -> torch.Tensor:
    return launch(q, k, v, pk, pv, prefix_bias, own_bias, LAUNCH)


@torch.library.custom_op("cosyvoice::split_prefix_attention_rotary", mutates_args=())
def _split_prefix_attention_rotary(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pk: torch.Tensor,
                                   pv: torch.Tensor, prefix_bias: torch.Tensor, own_bias: torch.Tensor,
                                   cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return launch(q, k, v, pk, pv, prefix_bias, own_bias, LAUNCH, rope=(cos, sin))


def launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pk: torch.Tensor, pv: torch.Tensor,
           prefix_bias: torch.Tensor, own_bias: torch.Tensor, config: LaunchConfig, kernel: Any = None,
           rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The operators' body with `config` (and `kernel`, a jitted variant of the kernel:
    `bench.split_attention_tune` compares launch settings with it)."""
    kernel = kernel if kernel is not None else _triton()
    if kernel is None:
        raise RuntimeError("Triton is not importable")
    batch, heads, length, dh = q.shape
    own, width = k.shape[2], pk.shape[2]
    if dh & (dh - 1) or dh < 16:
        raise ValueError(f"the kernel takes a power-of-two head size of at least 16, not {dh}")
    # Checked here, where a wrong shape would otherwise read out of bounds on the GPU (the
    # operators are opaque to torch.compile: the checks cost nothing in the compiled blocks).
    if batch % 2 or k.shape != v.shape or k.shape != (batch, heads, own, dh) \
            or pk.shape != pv.shape or pk.shape != (2, heads, width, dh) \
            or prefix_bias.shape != (2, 1, 1, width) or own_bias.shape != (batch, 1, length, own):
        raise ValueError(f"shapes do not fit a split attention: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}, prefix {tuple(pk.shape)} and {tuple(pv.shape)}, biases "
                         f"{tuple(prefix_bias.shape)} and {tuple(own_bias.shape)}")
    if len({t.dtype for t in (q, k, v, pk, pv)}) > 1 or len({t.device for t in (q, k, v, pk, pv)}) > 1:
        raise ValueError("q, k, v and the prefix keys and values must share one dtype and one device")
    cos, sin = (q, q) if rope is None else rope  # without rope: never read (ROTARY is off)
    if rope is not None:
        if own != length:
            raise ValueError(f"the rotary embedding in the kernel takes the own keys at the queries' {length} "
                             f"frames, not {own} keys")
        if cos.dtype != torch.float32 or sin.dtype != torch.float32:
            raise ValueError(f"the rotary embedding's cos and sin must be float32, not {cos.dtype} and {sin.dtype}")
        if cos.shape != sin.shape or cos.shape != (batch, length, dh):
            raise ValueError(f"the rotary embedding's cos and sin must be [{batch}, {length}, {dh}], not "
                             f"{tuple(cos.shape)} and {tuple(sin.shape)}")
        if cos.stride() != sin.stride() or cos.stride(-1) != 1:
            cos, sin = cos.contiguous(), sin.contiguous()
    # Strides as given, but each frame's dh values side by side (the projections' layout).
    q, k, v, pk, pv = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, pk, pv))
    if prefix_bias.stride(-1) != 1 or own_bias.stride(-1) != 1:
        prefix_bias, own_bias = prefix_bias.contiguous(), own_bias.contiguous()
    out = torch.empty(batch, length, heads * dh, dtype=q.dtype, device=q.device)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32: ignored for 16-bit inputs
    grid = (-(-length // config.block_m), batch * heads)
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        kernel[grid](q, k, v, pk, pv, prefix_bias, own_bias, out, cos, sin,
                     length, own, width, batch // 2, heads, dh ** -0.5,
                     q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                     v.stride(0), v.stride(1), v.stride(2), pk.stride(0), pk.stride(1), pk.stride(2),
                     pv.stride(0), pv.stride(1), pv.stride(2), prefix_bias.stride(0),
                     own_bias.stride(0), own_bias.stride(2), out.stride(0), out.stride(1),
                     cos.stride(0), cos.stride(1),
                     DH=dh, BM=config.block_m, BN=config.block_n, PRECISION=precision, ROTARY=rope is not None,
                     num_warps=config.num_warps, num_stages=config.num_stages)
    return out


@_split_prefix_attention.register_fake
def _fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pk: torch.Tensor, pv: torch.Tensor,
          prefix_bias: torch.Tensor, own_bias: torch.Tensor) -> torch.Tensor:
    batch, heads, length, dh = q.shape
    return q.new_empty(batch, length, heads * dh)


@_split_prefix_attention_rotary.register_fake
def _fake_rotary(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pk: torch.Tensor, pv: torch.Tensor,
                 prefix_bias: torch.Tensor, own_bias: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return _fake(q, k, v, pk, pv, prefix_bias, own_bias)
