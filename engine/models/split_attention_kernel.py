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

The DiT's rotary embedding turns head 0 alone (the projection's first dh channels). With
`head0` the kernel reads that head's queries and own keys from small rotated tensors and the
other heads from the projection as it is, so no copy of all of q and k is made to rotate a
sixteenth of it (`EngineConfig.flow_attention_rotary`, on since round 46: 5.6-6.8% less stage
time a round on an H100). The two sources differ only in a program's base pointers: an
earlier variant rotated head 0 inside the key loop, a branch that made every program move
each key block from shared memory to registers and back: rounds took 4-8% longer than
with the copy.
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
    with head 0 apart, `head0`): CUDA in bf16 or fp16 where a trial
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
    across a block of keys, two rows; with `rotary` q, k and v are views of one projection,
    the own keys the queries' frames, each row at its own positions, and head 0's queries
    and keys rotated apart, as `dit.Attention` passes them), against the attention over the
    concatenated keys in float32 (with head 0 rotated)."""
    from .dit import RotaryEmbedding, rotated_channels  # not at the top: dit imports this module

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
        head0 = None
        if rotary:  # as the DiT calls it: q, k, v views of one projection, each row at its own position
            q, k, v = (t.view(batch, length, heads, dh).transpose(1, 2)
                       for t in rand(batch, length, 3 * heads * dh).split(heads * dh, dim=-1))
            positions = torch.arange(length, device=device) + 50 * torch.arange(batch, device=device)[:, None]
            angles = RotaryEmbedding(dh).to(device).at(positions)  # [B, T, dh] float32
            projection = (t.transpose(1, 2).flatten(2) for t in (q, k))  # [B, T, H x dh] views
            head0 = tuple(rotated_channels(t, angles.cos(), angles.sin()) for t in projection)
        got = split_prefix_attention(q, k, v, (pk, pv), *biases, head0)
        if head0 is not None:  # the reference puts the rotated head 0 in place itself
            q, k = q.clone(), k.clone()
            q[:, 0], k[:, 0] = head0
        keys = torch.cat((pk.repeat_interleave(batch // 2, dim=0), k), dim=2).float()
        values = torch.cat((pv.repeat_interleave(batch // 2, dim=0), v), dim=2).float()
        want = torch.softmax(q.float() @ keys.transpose(-1, -2) * dh ** -0.5, dim=-1) @ values
        want = want.transpose(1, 2).reshape(batch, length, heads * dh)
        worst = float((got.float() - want).abs().max())
        if not worst < 0.05:
            log.warning("the split attention kernel%s disagrees with the torch formula on %s (%s) by up to %.3g; "
                        "the DiT uses %s", " with head 0 apart" if rotary else "", device, dtype, worst,
                        "the kernel on a rotated copy of q and k" if rotary else "cuDNN's")
        return worst < 0.05
    except Exception:  # any failure of the trial: the stage takes cuDNN's two calls instead
        log.warning("the split attention kernel%s does not run on %s (%s); the DiT uses %s",
                    " with head 0 apart" if rotary else "", device, dtype,
                    "the kernel on a rotated copy of q and k" if rotary else "cuDNN's", exc_info=True)
        return False


def split_prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           prefix_kv: tuple[torch.Tensor, torch.Tensor], prefix_bias: torch.Tensor,
                           own_bias: torch.Tensor, head0: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """What `dit.split_prefix_attention` computes, as one kernel: q [B, H, T, dh] (B = 2R,
    rows [0, R) conditional), k, v [B, H, S, dh]; prefix_kv [2, H, W, dh] each; the
    additive biases [2, 1, 1, W] over the prefix keys and [B, 1, T, S] over each row's own.
    With `head0` (head 0's queries [B, T, dh] and own keys [B, S, dh], rotated) the kernel
    reads head 0 from there and the other heads from q and k, which may be the projection
    as it is, unrotated: the DiT's rotary embedding turns head 0 alone (`dit.apply_rotary`
    rotates the projection's first dh channels), so nothing copies the other heads.
    Returns [B, T, H x dh]."""
    if head0 is None:
        return torch.ops.cosyvoice.split_prefix_attention(q, k, v, prefix_kv[0], prefix_kv[1], prefix_bias, own_bias)
    return torch.ops.cosyvoice.split_prefix_attention_rotary(q, k, v, prefix_kv[0], prefix_kv[1], prefix_bias,
                                                             own_bias, head0[0], head0[1])


# Operators of their own: the DiT's blocks run under torch.compile, which takes each as one
# opaque call (its shape from `_fake`) instead of tracing the launch.
@torch.library.custom_op("cosyvoice::split_prefix_attention", mutates_args=())
def _split_prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pk: torch.Tensor, pv: torch.Tensor,
                            prefix_bias: torch.Tensor, own_bias: torch.Tensor) -> torch.Tensor:
    return launch(q, k, v, pk, pv, prefix_bias, own_bias, LAUNCH)


@torch.library.custom_op("cosyvoice::split_prefix_attention_rotary", mutates_args=())
def _split_prefix_attention_rotary(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pk: torch.Tensor,
                                   pv: torch.Tensor, prefix_bias: torch.Tensor, own_bias: torch.Tensor,
                                   q0: torch.Tensor, k0: torch.Tensor) -> torch.Tensor:
    return launch(q, k, v, pk, pv, prefix_bias, own_bias, LAUNCH, head0=(q0, k0))


def launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pk: torch.Tensor, pv: torch.Tensor,
           prefix_bias: torch.Tensor, own_bias: torch.Tensor, config: LaunchConfig, kernel: Any = None,
           head0: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
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
    q0, k0 = (q[:, 0], k[:, 0]) if head0 is None else head0  # without head0: never read (ROTARY is off)
    if head0 is not None:
        if q0.shape != (batch, length, dh) or k0.shape != (batch, own, dh):
            raise ValueError(f"head 0's queries and keys apart must be [{batch}, {length}, {dh}] and "
                             f"[{batch}, {own}, {dh}], not {tuple(q0.shape)} and {tuple(k0.shape)}")
        if q0.dtype != q.dtype or k0.dtype != q.dtype or q0.device != q.device or k0.device != q.device:
            raise ValueError("head 0's queries and keys apart must be of q's dtype and on q's device")
        q0, k0 = (t if t.stride(-1) == 1 else t.contiguous() for t in (q0, k0))
    # Strides as given, but each frame's dh values side by side (the projections' layout).
    q, k, v, pk, pv = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, pk, pv))
    if prefix_bias.stride(-1) != 1 or own_bias.stride(-1) != 1:
        prefix_bias, own_bias = prefix_bias.contiguous(), own_bias.contiguous()
    out = torch.empty(batch, length, heads * dh, dtype=q.dtype, device=q.device)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32: ignored for 16-bit inputs
    grid = (-(-length // config.block_m), batch * heads)
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        kernel[grid](q, k, v, pk, pv, prefix_bias, own_bias, out, q0, k0,
                     length, own, width, batch // 2, heads, dh ** -0.5,
                     q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                     v.stride(0), v.stride(1), v.stride(2), pk.stride(0), pk.stride(1), pk.stride(2),
                     pv.stride(0), pv.stride(1), pv.stride(2), prefix_bias.stride(0),
                     own_bias.stride(0), own_bias.stride(2), out.stride(0), out.stride(1),
                     q0.stride(0), q0.stride(1), k0.stride(0), k0.stride(1),
                     DH=dh, BM=config.block_m, BN=config.block_n, PRECISION=precision, ROTARY=head0 is not None,
                     num_warps=config.num_warps, num_stages=config.num_stages)
    return out


@_split_prefix_attention.register_fake
def _fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pk: torch.Tensor, pv: torch.Tensor,
          prefix_bias: torch.Tensor, own_bias: torch.Tensor) -> torch.Tensor:
    batch, heads, length, dh = q.shape
    return q.new_empty(batch, length, heads * dh)


@_split_prefix_attention_rotary.register_fake
def _fake_rotary(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pk: torch.Tensor, pv: torch.Tensor,
                 prefix_bias: torch.Tensor, own_bias: torch.Tensor, q0: torch.Tensor, k0: torch.Tensor) -> torch.Tensor:
    return _fake(q, k, v, pk, pv, prefix_bias, own_bias)
