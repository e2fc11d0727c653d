"""The CosyVoice3 flow-matching estimator: a DiT over 50 Hz mel frames.

Given the noisy mel `x`, the upsampled token features `mu`, the prompt mel `cond`
(zeros outside the prompt), a speaker vector `spks` and the flow time `t`, the DiT
predicts the velocity dx/dt. Same maths as the official `cosyvoice/flow/DiT/dit.py`
(F5-TTS style); attribute names are chosen so that `state_dict()` keys equal the
official `decoder.estimator.*` names (see `shared/reference/cosyvoice3/flow_keys.txt`).

Architecture facts that matter for numerical parity with the official code:

* Time embedding: 256-dim sinusoid of `1000 * t` (sin half first, then cos), with
  frequencies `exp(-i * ln(10000) / 127)`, followed by Linear -> SiLU -> Linear.
* Input embedding: `Linear(cat[x, cond, mu, spk])` plus a *causal* convolutional
  position embedding (two grouped k=31 convs, each left-padded by 30, each followed
  by Mish), added residually. Being causal, right-padding a batch cannot leak into
  real frames.
* Rotary position embedding (x_transformers `RotaryEmbedding(dim_head)` and
  `apply_rotary_pos_emb`, x-transformers 2.11 as pinned by the official
  requirements): the frequencies are *interleaved* (channel pair (2i, 2i+1) rotates by
  `pos * inv_freq[i]`, `inv_freq[i] = 10000^(-2i/dim_head)`), and the rotation is
  applied to the projected q/k *before* they are split into heads. Because the
  rotary width is `dim_head`, only the first `dim_head` channels of q and k (i.e.
  head 0) are rotated; all other heads see no position signal except through the
  conv position embedding. This is a quirk of the reference, reproduced on purpose.
  xpos is off, so the scale is 1. `inv_freq` is a persistent buffer (it is in the
  checkpoint).
* Blocks: AdaLN-Zero (6 modulation vectors: shift/scale/gate for attention, then for
  the MLP; LayerNorm without affine, eps 1e-6), attention with biased q/k/v/out
  projections, GELU(tanh) MLP. Final norm: AdaLN with 2 vectors ordered
  (scale, shift) -- note the order differs from the block norm.
* Attention mask: key padding mask AND, when streaming, a block-causal mask over
  `static_chunk_size` frames (frame i sees frames < (i // chunk + 1) * chunk, i.e.
  its own chunk and all earlier ones). Attention outputs of padded frames are zeroed.

Prompt prefix (`DiTPrefix`, used by `engine.flow_prompt_cache`): in streaming mode the
frames of whole 50-frame blocks at the start of a row depend only on those frames, so a
caller may run the DiT over the later frames only and hand in, per block, the keys and
values the earlier frames produced, plus the last `CONV_CONTEXT` frames of the input
projection that the causal position convolutions read. `DiTRecord` collects exactly
those pieces from an ordinary call. Both are explicit arguments, no hooks.
"""

from __future__ import annotations

import copy
import logging
import math
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..compile_errors import is_compile_error
from . import causal_conv_kernel, split_attention_kernel
from .config import FlowConfig
from .derived import DerivedTensor
from .triton_support import is_kernel_error

log = logging.getLogger(__name__)

# Width of the sinusoidal time feature fed to the time MLP (official default).
TIME_FREQ_DIM = 256
# The flow time is in [0, 1]; the sinusoid is taken of 1000 * t (official scale).
TIME_SCALE = 1000.0
CONV_POS_KERNEL = 31
CONV_POS_GROUPS = 16
ROTARY_BASE = 10000.0
NORM_EPS = 1e-6
# Frames of the input projection before a row's first new frame that the two causal
# convolutions of the position embedding reach (each looks kernel - 1 frames back).
CONV_CONTEXT = 2 * (CONV_POS_KERNEL - 1)
# Compiled variants dynamo may keep for the shared block function: ~5 per stage device
# (plain batches, per-row and one-voice cached-prefix batches, and duck-sizing
# respecialisations of those; packed rows, `engine.models.packed_rows`, add theirs).
COMPILE_CACHE_LIMIT = 64


@dataclass
class DiTPrefix:
    """Cached frames [0, C_i) of each row for one DiT call (one Euler step, all CFG rows).

    layer_kv:     per block: the prefix keys and values [B, H, Cmax, dh] (keys rotated at
                  their own positions; slots j >= C_i of row i finite, masked). May be lazy:
                  a block reads only its own entry.
    key_mask:     [B, Cmax] bool, True for row i's real prefix keys (j < C_i).
    positions:    [B] long, C_i: absolute position of each row's first input frame.
    conv_context: [B, CONV_CONTEXT, D], the input projection over frames [C_i - 60, C_i)
                  (zeros where that is before frame 0, like the convolutions' padding).
    shared:       every row has the same prefix (one voice): layer_kv entries hold it once
                  per CFG half ([2, H, Cmax, dh]; rows [0, B/2) read half 0, the rest half
                  1). The blocks broadcast it inside the compiled attention, so no per-row
                  copy is ever made. conv_context is then [2, CONV_CONTEXT, D] too, unless it
                  has a row per batch row ([B, ...]: rows whose own context differs).
    ring_kv:      per block, more keys and values of each row [B, H, L, dh] after the
                  layer_kv ones (the utterance's own earlier frames, `engine.flow_context_cache`);
                  key_mask then spans Cmax + L slots. May be lazy.
    sink:         receives this call's keys and values and its input projection (to keep
                  some of them for a later call), without leaving the compiled blocks.
    """

    layer_kv: Sequence[tuple[torch.Tensor, torch.Tensor]]
    key_mask: torch.Tensor
    positions: torch.Tensor
    conv_context: torch.Tensor
    shared: bool = False
    ring_kv: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None
    sink: "PrefixSink | None" = None


class PrefixSink(Protocol):
    """Where a DiT call hands what a later call of the same rows will need as its prefix."""

    def projection(self, h: torch.Tensor) -> None:
        """h [B, CONV_CONTEXT + T, D]: the prefix's conv context, then this call's input projection."""

    def keys_values(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """One block's rotated keys and its values of this call's frames, [B, T, H x dh]."""


@dataclass
class DiTRecord:
    """What an ordinary DiT call leaves for `DiTPrefix`: per block the rotated keys and the
    values [B, H, T, dh], and the last CONV_CONTEXT frames of the input projection."""

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    conv_context: torch.Tensor | None = None


def timestep_sinusoid(t: torch.Tensor, dim: int = TIME_FREQ_DIM) -> torch.Tensor:
    """[B] flow times -> [B, dim] features: [sin(1000 t w_i), cos(1000 t w_i)]."""
    half = dim // 2
    step = math.log(10000.0) / (half - 1)
    freqs = torch.exp(torch.arange(half, device=t.device, dtype=torch.float32) * -step)
    angles = TIME_SCALE * t.float().unsqueeze(1) * freqs.unsqueeze(0)
    return torch.cat((angles.sin(), angles.cos()), dim=-1).to(t.dtype)


def per_row(halves: torch.Tensor, rows: int) -> torch.Tensor:
    """[2, ...] (one tensor per CFG half) -> [rows, ...]: rows [0, rows/2) get half 0, the
    rest half 1. In eager mode this is a copy; inside a compiled block the compiler folds
    the broadcast into the kernel that reads it (the key/value concatenation)."""
    return halves.unsqueeze(1).expand(2, rows // 2, *halves.shape[1:]).reshape(rows, *halves.shape[1:])


def share_storage(linears: Sequence[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor]:
    """One weight [sum of outputs, inputs] and one bias holding the linears' parameters one
    after the other; each linear's parameters become views of them. One matrix product then
    computes all the linears, while `state_dict`, `load_state_dict` (which copies in place)
    and `init_random_` still see the official tensors under the official names."""
    with torch.no_grad():
        weight = torch.cat([lin.weight for lin in linears])
        bias = torch.cat([lin.bias for lin in linears])
    start = 0
    for lin in linears:
        end = start + lin.out_features
        lin.weight.data, lin.bias.data = weight[start:end], bias[start:end]
        start = end
    return weight, bias


@dataclass(frozen=True)
class TimeConditioning:
    """What the flow time t gives a DiT call: per block its six AdaLN vectors [depth, R, 6 D]
    and the final norm's two [R, 2 D], for R = 1 (one t for every row) or one t per row."""

    blocks: torch.Tensor
    final: torch.Tensor


def block_causal_mask(length: int, chunk: int, device: torch.device) -> torch.Tensor:
    """[length, length] bool: query i may attend key j iff j < (i // chunk + 1) * chunk."""
    pos = torch.arange(length, device=device)
    limit = (torch.div(pos, chunk, rounding_mode="floor") + 1) * chunk
    return pos.unsqueeze(0) < limit.unsqueeze(1)


def attention_mask(pad_mask: torch.Tensor, chunk: int | None) -> torch.Tensor:
    """Key padding mask [B, T] (True = real frame) -> SDPA bool mask [B, 1, T, T].

    chunk=None gives full attention over the real frames.
    """
    batch, length = pad_mask.shape
    keys = pad_mask[:, None, :]  # [B, 1, T]: same key set for every query row
    if chunk is None:
        mask = keys.expand(batch, length, length)
    else:
        mask = keys & block_causal_mask(length, chunk, pad_mask.device).unsqueeze(0)
    # A query row with no visible key would make SDPA return NaN. It cannot happen for
    # non-empty sequences (key 0 is always visible), but keep the reference's guard.
    empty = ~mask.any(dim=-1, keepdim=True)
    mask = mask | empty
    return mask.unsqueeze(1)


# How the DiT's attention runs (`DiT.attention_kernel`, EngineConfig.flow_attention):
# "sdpa": F.scaled_dot_product_attention with the boolean mask (PyTorch picks; the split
# attention's log-sum-exps come from the memory-efficient kernel); "cudnn": cuDNN's fused
# attention with the mask made an additive bias once per DiT call (CUDA; elsewhere the
# same bias goes through SDPA). On the H200, cuDNN ran the DiT's attention 1.7-2.0x faster
# at the engine's shapes (round 14 of docs/benchmarks.md, `bench.attention_backends`); in
# the stage, where compiled SDPA picks cuDNN by itself except for the split attention's
# log-sum-exps, rounds of 16-64 chunks took 11-12% less time with it (round 38, an H100).
# "triton", the stage's default since round 45: as "cudnn", but a batch split at its prompt
# attends to both key sets in one kernel (`split_attention_kernel`; rounds of 5-8 chunks
# took 3.5-5% less time on H100s).
ATTENTION_KERNELS: tuple[str, ...] = ("sdpa", "cudnn", "triton")
_BIAS_ALIGN = 8  # elements: SDPA's fused kernels want the bias rows aligned (its preprocess_mask)


def cudnn_attention_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether cuDNN's fused attention runs on `device` at the DiT's kind of call (16 heads
    of 64, an additive bias, with and without the log-sum-exp), tried once on small inputs:
    it needs a recent GPU and cuDNN, and "cudnn" calls it with no fallback of PyTorch's."""
    try:
        q = torch.randn(2, 16, 50, 64, device=device, dtype=dtype)
        k = v = torch.randn(2, 16, 100, 64, device=device, dtype=dtype)
        bias = attention_bias(torch.ones(2, 1, 50, 100, dtype=torch.bool, device=device), dtype)
        for lse in (False, True):
            torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, bias.expand(2, 16, 50, 100), lse)
        torch.cuda.synchronize(device)
    except Exception:  # any failure of the trial: not worth risking every flow call on it
        log.warning("cuDNN's fused attention does not run on %s (%s); the DiT uses SDPA's pick",
                    device, dtype, exc_info=True)
        return False
    return True


def attention_kernel_for(name: str, device: torch.device, dtype: torch.dtype,
                         runs: Callable[[torch.device, torch.dtype], bool] = cudnn_attention_runs) -> str:
    """`name` (ATTENTION_KERNELS); "cudnn" where it is "triton" and that kernel does not run
    on `device` in `dtype` (`split_attention_kernel.runs_on`); and "sdpa" where it is
    "cudnn" (or "triton", whose calls not split at the prompt are cuDNN's) on a CUDA device
    cuDNN's kernel does not run on (`runs`): a default must not break older GPUs."""
    device = torch.device(device)
    if name == "triton" and not split_attention_kernel.runs_on(device, dtype):
        name = "cudnn"
    if name in ("cudnn", "triton") and device.type == "cuda" and not runs(device, dtype):
        return "sdpa"
    return name


def split_prefix_rows_for(kernel: str) -> int:
    """The fewest rows (per CFG half) of a one-voice prefixed call whose prompt is attended
    apart (`DiT.split_prefix_rows`) by default with attention `kernel`. The split kernel
    ("triton") pays at small sizes too: on an H100 (round 48 of docs/benchmarks.md) rounds of
    1-3, 5 and 6 chunks took 6-11% less time than over per-row copies of the prompt, and 4
    the same. cuDNN's two calls and a merge pay only in larger batches (round 17, H200: a
    64-chunk round 129 against 142 ms, one chunk 24.0 against 21.4); SDPA's pair is not
    measured at small sizes; on the CPU a full-size 3-chunk round took 39.3 s split against
    32.2 (round 48)."""
    return 1 if kernel == "triton" else 8


def attention_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean SDPA mask [B, 1, Tq, Tk] as the additive bias the kernels take (0 where
    True, -inf where False), in rows whose storage is padded to `_BIAS_ALIGN` elements:
    made once per DiT call, where SDPA would convert and pad it again in every block."""
    batch, one, tq, tk = mask.shape
    width = -(-tk // _BIAS_ALIGN) * _BIAS_ALIGN
    bias = torch.zeros(batch, one, tq, width, dtype=dtype, device=mask.device)
    bias[..., :tk].masked_fill_(~mask, float("-inf"))
    return bias[..., :tk]


class SplitMasks(NamedTuple):
    """What a one-voice prefixed call's blocks take instead of a mask when its attention is
    split (`split_prefix_attention`): additive biases over the shared prefix keys [2, 1, 1, W]
    and over each row's own keys [B, 1, T, L + T], the kernel (ATTENTION_KERNELS), and
    whether that kernel ("triton") takes head 0 rotated apart and the other heads from the
    projection where it can, sparing a rotated copy of q and k (`DiT.rotary_in_attention`)."""

    prefix: torch.Tensor
    own: torch.Tensor
    kernel: str
    rotary: bool = False


def split_prefix_masks(mask: torch.Tensor, width: int, dtype: torch.dtype, kernel: str,
                       rotary: bool = False) -> SplitMasks:
    """The boolean mask of a one-voice prefixed call ([B, 1, T, W + L + T], see
    `prefixed_attention_mask`) as the two additive biases `split_prefix_attention` takes:
    the prefix keys' [2, 1, 1, W] (every query of a CFG half sees the same ones: the rows'
    first, a whole number of blocks before them) and the row's own keys' [B, 1, T, L + T];
    `rotary` ("triton" only): the kernel takes head 0 rotated apart (`SplitMasks.rotary`)."""
    batch = mask.shape[0]
    first = mask[:, :, :1, :width].reshape(2, batch // 2, 1, 1, width)[:, 0]
    if rotary and kernel != "triton":
        raise ValueError(f"only the triton kernel takes head 0 rotated apart, not {kernel!r}")
    return SplitMasks(attention_bias(first, dtype), attention_bias(mask[..., width:], dtype), kernel, rotary)


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                       kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T / sqrt(dh) + bias) v [B, H, Tq, dh] and the log-sum-exp of each query's
    scaled scores [B, H, Tq] (float32), which two attentions over disjoint key sets need to
    be merged into the attention over their union. CUDA: cuDNN's or the memory-efficient
    kernel (`kernel`); elsewhere the same formula written out, in at least float32."""
    batch, heads, length, _ = q.shape
    bias = bias.expand(batch, heads, length, k.shape[2])
    if q.is_cuda:
        if kernel == "cudnn":
            res = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, bias, True)
        else:
            res = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True)
        # cuDNN's statistics are [B, H, Tq, 1]; the memory-efficient kernel pads Tq to 32.
        return res[0], res[1].reshape(batch, heads, -1)[..., :length].float()
    wide = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(q.to(wide), k.to(wide).transpose(-1, -2)) * q.shape[-1] ** -0.5 + bias.to(wide)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.to(wide))
    return out.to(q.dtype), lse


def split_prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           prefix_kv: tuple[torch.Tensor, torch.Tensor], masks: SplitMasks,
                           head0: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Attention of a one-voice batch over [shared prefix; own keys] without a per-row copy
    of the prefix: each CFG half's queries, all rows as one sequence, attend to its prefix
    once ([2, H, R x T] queries over W keys), each row's queries to its own keys (ring and
    new frames, [B, H, T] over L + T), and the two are merged by their log-sum-exps
    (softmax over a union of key sets = the two softmaxes weighted by their shares of the
    total exp-sum). On the H200 the per-row copies and the attention reading them were a
    third of a 64-chunk opening round's GPU time (round 15 of docs/benchmarks.md).

    q, k, v: [B, H, T, dh] (B = 2R: rows [0, R) conditional); prefix_kv: [2, H, W, dh] each.
    Returns [B, T, H x dh]. With `masks.kernel` "triton" one kernel does it all
    (`split_attention_kernel`; chosen only where it runs, `attention_kernel_for`), and with
    `head0` (the kernel only: head 0's queries and own keys, rotated, [B, T, dh] and
    [B, S, dh]) q and k are the projection's, unrotated, and the kernel reads head 0 from
    `head0` instead."""
    if masks.kernel == "triton":
        return split_attention_kernel.split_prefix_attention(q, k, v, prefix_kv, masks.prefix, masks.own, head0)
    if head0 is not None:
        raise ValueError(f"the {masks.kernel!r} attention takes q and k rotated")
    batch, heads, length, dh = q.shape
    halves = q.transpose(1, 2).reshape(2, batch // 2 * length, heads, dh).transpose(1, 2)
    o_pre, l_pre = attention_with_lse(halves, prefix_kv[0], prefix_kv[1], masks.prefix, masks.kernel)
    o_own, l_own = attention_with_lse(q, k, v, masks.own, masks.kernel)
    o_pre = o_pre.transpose(1, 2).reshape(batch, length, heads, dh)
    l_pre = l_pre.transpose(1, 2).reshape(batch, length, heads)
    o_own, l_own = o_own.transpose(1, 2), l_own.transpose(1, 2)
    share = torch.sigmoid(l_pre - l_own).unsqueeze(-1)  # exp(l_pre) / (exp(l_pre) + exp(l_own))
    out = o_own.to(share.dtype) + (o_pre.to(share.dtype) - o_own.to(share.dtype)) * share
    return out.to(q.dtype).reshape(batch, length, heads * dh)


class PackedMask(NamedTuple):
    """What the blocks take instead of a mask when a call's rows run end to end as one
    sequence [1, N, D] (`engine.models.packed_rows`): their matrix products and elementwise
    passes run over the N real frames, and their attention alone over the rows padded
    again, by the kernels and masks of a padded call (`inner`). `gather` [B, T]: the packed
    frame in each padded slot (any, where the slot is padding: the mask hides it as a key,
    and its query's output is dropped); `scatter` [N]: each packed frame's slot in the
    flattened [B x T]."""

    gather: torch.Tensor
    scatter: torch.Tensor
    inner: torch.Tensor | SplitMasks


def prefixed_attention_mask(prefix_mask: torch.Tensor, pad_mask: torch.Tensor, chunk: int) -> torch.Tensor:
    """SDPA bool mask [B, 1, T, P + T] for queries at frames [C_i, C_i + T) of each row
    over keys = P cached prefix slots then the T new frames.

    Every query sees all of its row's real prefix keys (C_i is a whole number of blocks
    before it). Among the new frames the block-causal rule is the usual one counted from
    C_i, since C_i is a multiple of `chunk` (the blocks stay aligned).
    """
    batch, length = pad_mask.shape
    new = pad_mask[:, None, :] & block_causal_mask(length, chunk, pad_mask.device).unsqueeze(0)
    old = prefix_mask[:, None, :].expand(batch, length, prefix_mask.shape[1])
    mask = torch.cat((old, new), dim=-1)
    empty = ~mask.any(dim=-1, keepdim=True)  # padded rows: see attention_mask
    return (mask | empty).unsqueeze(1)


class TimestepEmbedding(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.time_mlp = nn.Sequential(nn.Linear(TIME_FREQ_DIM, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        # The sinusoid of 1000 t needs t in float32 (a bf16 t is off by up to 0.4%, i.e.
        # several radians); the MLP then runs in the weights' dtype.
        return self.time_mlp(timestep_sinusoid(t.float()).to(self.time_mlp[0].weight.dtype))


# Largest unfolded input (bytes) for which a grouped convolution runs as one batched matrix
# product over its taps (`grouped_conv_by_taps`); larger inputs go to the library's
# convolution. 512 MiB in bf16 holds 32 rows (16 chunks x 2 CFG rows) of 260 frames (a
# 200-frame bucket plus the 60 frames of cached context) at 1024 channels x 31 taps, or 16
# rows of 500: every CUDA-graph batch up to 16 chunks. A 64-chunk eager batch does not fit.
TAPS_MAX_BYTES = 512 << 20


def grouped_conv_by_taps(x: torch.Tensor, conv: nn.Conv1d) -> torch.Tensor:
    """`conv` (stride 1, no padding, no dilation) over frame-major x [B, T + kernel - 1, C]
    (already padded) -> [B, T, C_out], as one batched matrix product over the unfolded
    windows of each group.

    Why: cuDNN ran this grouped convolution (kernel 31, 16 groups of 64 channels) as one
    kernel per group plus layout transposes: 320 convolution launches of ~35 us per flow
    batch on the H200, a third of a one-chunk batch's summed kernel time for ~2% of its
    arithmetic (`bench.stage_syncs --kernels`, round 6). Here it is a few copies (the
    windows, the output's group order) and one bmm, frame-major throughout."""
    if conv.stride != (1,) or conv.padding != (0,) or conv.dilation != (1,):
        raise ValueError("grouped_conv_by_taps takes stride 1, no padding and no dilation")
    batch, length, channels = x.shape
    if channels != conv.in_channels:
        raise ValueError(f"input has {channels} channels, the convolution takes {conv.in_channels}")
    k, groups = conv.kernel_size[0], conv.groups
    frames, per_group = length - k + 1, channels // groups
    out_per_group = conv.out_channels // groups
    # [B, T, C, k] view -> [G, B*T, per_group*k] (the copy), matching the weight's
    # [out, in/G, k] flattening.
    windows = x.unfold(1, k, 1).reshape(batch, frames, groups, per_group * k)
    windows = windows.permute(2, 0, 1, 3).reshape(groups, batch * frames, per_group * k)
    weight = conv.weight.reshape(groups, out_per_group, per_group * k).transpose(1, 2)
    if conv.bias is None:
        out = torch.bmm(windows, weight)
    else:
        out = torch.baddbmm(conv.bias.view(groups, 1, out_per_group), windows, weight)
    return out.view(groups, batch, frames, out_per_group).permute(1, 2, 0, 3).reshape(batch, frames, -1)


# How the position convolutions run (`DiT.use_conv_kernel`, EngineConfig.flow_conv_kernel):
# "torch": `grouped_conv_by_taps` up to TAPS_MAX_BYTES, cuDNN above; "triton": one Triton
# kernel with the Mish fused (`causal_conv_kernel`), where it can run (CUDA with Triton),
# else as "torch".
CONV_KERNELS: tuple[str, ...] = ("torch", "triton")


class CausalConvPositionEmbedding(nn.Module):
    """Two left-padded grouped convolutions: a relative-position signal that never looks ahead."""

    def __init__(self, dim: int, kernel_size: int = CONV_POS_KERNEL, groups: int = CONV_POS_GROUPS) -> None:
        super().__init__()
        self.kernel_size = kernel_size
        self.conv1 = nn.Sequential(nn.Conv1d(dim, dim, kernel_size, groups=groups), nn.Mish())
        self.conv2 = nn.Sequential(nn.Conv1d(dim, dim, kernel_size, groups=groups), nn.Mish())
        self.kernel = "torch"  # one of CONV_KERNELS
        # Each conv's weight in the Triton kernel's layout (`DerivedTensor`: packed again
        # after a move, cast or load).
        self._packed: dict[str, DerivedTensor[torch.Tensor]] = {"conv1": DerivedTensor(), "conv2": DerivedTensor()}

    def _packed_weight(self, name: str, conv: nn.Conv1d) -> torch.Tensor:
        return self._packed[name].get(conv.weight, lambda _: causal_conv_kernel.packed_weight(conv))

    def _conv(self, layer: nn.Sequential, h: torch.Tensor, name: str) -> torch.Tensor:
        """One causal conv + Mish, frame-major [B, T, D] -> [B, T, D]."""
        conv, act = layer[0], layer[1]
        if self.kernel == "triton" and causal_conv_kernel.available(h, conv):
            try:
                return causal_conv_kernel.grouped_causal_conv_mish(h, conv, self._packed_weight(name, conv))
            except Exception as exc:
                if not is_kernel_error(exc):
                    raise
                # The first call is a graph's eager warm-up, so this falls back before any
                # capture; the flow stays correct, only slower.
                log.exception("the Triton position convolution cannot run here; the DiT uses torch's")
                self.kernel = "torch"
        if h.numel() * self.kernel_size * h.element_size() <= TAPS_MAX_BYTES:
            return act(grouped_conv_by_taps(F.pad(h, (0, 0, self.kernel_size - 1, 0)), conv))
        return act(conv(F.pad(h.transpose(1, 2), (self.kernel_size - 1, 0)))).transpose(1, 2)

    def forward(
        self, x: torch.Tensor, context: torch.Tensor | None = None, context_valid: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x: [B, T, D] -> [B, T, D]. `context` [B, CONV_CONTEXT, D]: the input frames just
        before x (see DiTPrefix), zeros where they would be before frame 0, which
        `context_valid` [B, CONV_CONTEXT] (bool) marks False; without context x starts at
        frame 0 (zero left padding)."""
        h = x if context is None else torch.cat((context.to(x.dtype), x), dim=1)
        h = self._conv(self.conv1, h, "conv1")
        if context_valid is not None:
            # conv1 outputs "before frame 0" are conv2's zero padding in a full-length run.
            keep = F.pad(context_valid, (0, x.shape[1]), value=True)
            h = h * keep.unsqueeze(-1).to(h.dtype)
        h = self._conv(self.conv2, h, "conv2")
        # The context's own outputs are dropped; the ones of x only read conv1 outputs at
        # most kernel - 1 frames back, which read inputs at most kernel - 1 further back.
        return h[:, h.shape[1] - x.shape[1] :]


class InputEmbedding(nn.Module):
    def __init__(self, mel_dim: int, mu_dim: int, spk_dim: int, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(2 * mel_dim + mu_dim + spk_dim, dim)
        self.conv_pos_embed = CausalConvPositionEmbedding(dim)

    def project(self, x: torch.Tensor, cond: torch.Tensor, mu: torch.Tensor, spks: torch.Tensor) -> torch.Tensor:
        # All inputs are frame-major [B, T, C] except spks [B, C], broadcast over frames.
        spk = spks.unsqueeze(1).expand(-1, x.shape[1], -1)
        return self.proj(torch.cat((x, cond, mu, spk), dim=-1))

    def forward(
        self, x: torch.Tensor, cond: torch.Tensor, mu: torch.Tensor, spks: torch.Tensor,
        context: torch.Tensor | None = None, context_valid: torch.Tensor | None = None,
        record: DiTRecord | None = None, sink: PrefixSink | None = None,
    ) -> torch.Tensor:
        h = self.project(x, cond, mu, spks)
        if sink is not None and context is not None:
            sink.projection(torch.cat((context.to(h.dtype), h), dim=1))
        if record is not None:
            # Left-pad with zeros when shorter than the context: the convs' own padding.
            record.conv_context = F.pad(h, (0, 0, max(0, CONV_CONTEXT - h.shape[1]), 0))[:, -CONV_CONTEXT:]
        return self.conv_pos_embed(h, context, context_valid) + h


class RotaryEmbedding(nn.Module):
    """Interleaved rotary angles for positions 0..T-1 (see the module docstring)."""

    def __init__(self, dim_head: int, base: float = ROTARY_BASE) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim_head, 2).float() / dim_head))
        self.register_buffer("inv_freq", inv_freq)  # persistent: part of the checkpoint

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> "RotaryEmbedding":
        # The frequencies stay float32 whatever dtype the model is cast to (its device
        # still follows): in bf16 both they and the positions would round (position 257
        # becomes 256, an angle error of up to several radians past frame 1000).
        exact = self.inv_freq
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float32:
            self.inv_freq = exact.to(device=self.inv_freq.device, dtype=torch.float32)
        return self

    def forward(self, length: int) -> torch.Tensor:
        """[T, dim_head] angles; channels 2i and 2i+1 share the angle pos * inv_freq[i]."""
        pos = torch.arange(length, device=self.inv_freq.device, dtype=self.inv_freq.dtype)
        angles = torch.outer(pos, self.inv_freq)
        return angles.repeat_interleave(2, dim=-1)

    def at(self, positions: torch.Tensor) -> torch.Tensor:
        """Angles at given absolute positions: [..., L] ints -> [..., L, dim_head]."""
        pos = positions.to(self.inv_freq.dtype).unsqueeze(-1)
        return (pos * self.inv_freq).repeat_interleave(2, dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] channels of x [B, T, C] pairwise; pass the rest through.

    cos/sin are of the rotary angles [T, width]. Pair (a, b) at channels (2i, 2i+1)
    becomes (a cos - b sin, b cos + a sin). Computed in float32 like the reference
    (which disables autocast here). Out of place, as one concatenation: x may be a view
    of the fused q/k/v product, and the compiler then writes the rotated copy in one
    pass (an in-place write into a view made it copy the whole product first).
    """
    return torch.cat((rotated_channels(x, cos, sin), x[..., cos.shape[-1]:]), dim=-1)


def rotated_channels(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The first cos.shape[-1] channels of x, rotated as `apply_rotary` rotates them; the
    rest are not returned: [B, T, width]."""
    rot = x[..., :cos.shape[-1]].float()
    pairs = rot.unflatten(-1, (-1, 2))
    swapped = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    return (rot * cos + swapped * sin).to(x.dtype)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """LayerNorm(x) * (1 + scale) + shift, per row [B, D] over frames; one fused
    multiply-add instead of two passes (the DiT is memory-bound on such passes)."""
    return torch.addcmul(shift[:, None], F.layer_norm(x, x.shape[-1:], eps=NORM_EPS), 1 + scale[:, None])


class AdaLayerNormZero(nn.Module):
    """Time-conditioned LayerNorm of a DiT block. Its `linear` maps SiLU(time embedding) to
    six modulation vectors; the DiT computes that for all blocks at once
    (`DiT.time_conditioning`) and hands each block its own [R, 6 D]."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, 6 * dim)

    def forward(self, x: torch.Tensor, mod: torch.Tensor) -> tuple[torch.Tensor, ...]:
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = mod.chunk(6, dim=-1)
        return modulate(x, shift_a, scale_a), gate_a, shift_m, scale_m, gate_m


class AdaLayerNormZeroFinal(nn.Module):
    """The final norm: `linear` gives two vectors, ordered (scale, shift)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, 2 * dim)

    def forward(self, x: torch.Tensor, mod: torch.Tensor) -> torch.Tensor:
        scale, shift = mod.chunk(2, dim=-1)
        return modulate(x, shift, scale)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, dim_head: int) -> None:
        super().__init__()
        self.heads = heads
        self.dim_head = dim_head
        inner = heads * dim_head
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        # A ModuleList (not a bare Linear) so the checkpoint name is `to_out.0`.
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])
        self.register_buffer("qkv_weight", torch.empty(0), persistent=False)
        self.register_buffer("qkv_bias", torch.empty(0), persistent=False)
        self.fuse()

    def fuse(self) -> None:
        """q, k and v as one projection (`share_storage`): at one chunk the DiT is bound by
        kernel launches, and this is two fewer per block and step."""
        self.qkv_weight, self.qkv_bias = share_storage((self.to_q, self.to_k, self.to_v))

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> "Attention":
        # A move or cast gives every parameter its own new tensor: share them again.
        super()._apply(fn, recurse)
        self.fuse()
        return self

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | SplitMasks | PackedMask,
        pad_mask: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        prefix_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
        record: DiTRecord | None = None,
        shared: bool = False,
        ring_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
        keep_kv: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`prefix_kv`: cached prefix keys/values put before this call's (the mask then
        covers them too), per row, or per CFG half when `shared` (see DiTPrefix), and
        `ring_kv` per row after them; with `SplitMasks` (shared only) the prefix is attended
        apart (`split_prefix_attention`); `record` receives this call's keys and values;
        `keep_kv` also returns them as the projections make them, [B, T, H x dh] (out,
        keys, values). With `PackedMask` x is a call's rows end to end, [1, N, D], every
        frame real (`pad_mask` is not read), and nothing is recorded or kept."""
        batch, length, _ = x.shape
        q, k, v = F.linear(x, self.qkv_weight, self.qkv_bias).split(self.heads * self.dim_head, dim=-1)
        packed = mask if isinstance(mask, PackedMask) else None
        # Rotary on the un-split projections: only head 0 gets position information. The split
        # kernel can take that head rotated apart and the others from the projection as it is
        # (`SplitMasks.rotary`), sparing a rotated copy of q and k, where it attends to them
        # alone: no ring before them and no keys kept or recorded (those are the rotated ones).
        head0 = None
        if isinstance(mask, SplitMasks) and mask.rotary and ring_kv is None and record is None and not keep_kv:
            head0 = (rotated_channels(q, *rope), rotated_channels(k, *rope))
        else:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        new_k, new_v = k, v  # [B, T, H x dh]: a frame's heads side by side
        if packed is not None:  # the attention alone runs on the padded rows
            if record is not None or keep_kv:
                raise ValueError("packed rows keep no keys or values")
            q, k, v = (t[0][packed.gather] for t in (q, k, v))
            batch, length = packed.gather.shape
            mask = packed.inner
        q, k, v = (t.view(batch, length, self.heads, self.dim_head).transpose(1, 2) for t in (q, k, v))
        if record is not None:
            record.keys.append(k)
            record.values.append(v)
        if isinstance(mask, SplitMasks):
            if prefix_kv is None or not shared:
                raise ValueError("split attention masks need a prefix shared by every row")
            if ring_kv is not None:
                k, v = torch.cat((ring_kv[0], k), dim=2), torch.cat((ring_kv[1], v), dim=2)
            out = split_prefix_attention(q, k, v, prefix_kv, mask, head0)
        else:
            if prefix_kv is not None:
                pk, pv = (per_row(t, batch) for t in prefix_kv) if shared else prefix_kv
                if ring_kv is None:
                    k, v = torch.cat((pk, k), dim=2), torch.cat((pv, v), dim=2)
                else:
                    k, v = torch.cat((pk, ring_kv[0], k), dim=2), torch.cat((pv, ring_kv[1], v), dim=2)
            if mask.is_floating_point() and q.is_cuda:  # DiT.attention_kernel "cudnn": a bias
                bias = mask.expand(batch, self.heads, length, k.shape[2])
                out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, bias, False)[0]
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            out = out.transpose(1, 2).reshape(batch, length, self.heads * self.dim_head)
        if packed is not None:  # back to the real frames only: none is padding
            out = self.to_out[0](out.reshape(batch * length, -1)[packed.scatter].unsqueeze(0))
        else:
            out = self.to_out[0](out) * pad_mask.unsqueeze(-1).to(out.dtype)
        return (out, new_k, new_v) if keep_kv else out


class FeedForward(nn.Module):
    def __init__(self, dim: int, mult: int) -> None:
        super().__init__()
        inner = dim * mult
        # Nested layout reproduces the checkpoint names ff.0.0 (in) and ff.2 (out);
        # index 1 is the (inference no-op) dropout slot.
        self.ff = nn.Sequential(
            nn.Sequential(nn.Linear(dim, inner), nn.GELU(approximate="tanh")),
            nn.Identity(),
            nn.Linear(inner, dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ff(x)


class DiTBlock(nn.Module):
    def __init__(self, dim: int, heads: int, dim_head: int, ff_mult: int) -> None:
        super().__init__()
        self.attn_norm = AdaLayerNormZero(dim)
        self.attn = Attention(dim, heads, dim_head)
        self.ff = FeedForward(dim, ff_mult)

    def forward(
        self,
        x: torch.Tensor,
        mod: torch.Tensor,
        mask: torch.Tensor | SplitMasks | PackedMask,
        pad_mask: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        prefix_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
        record: DiTRecord | None = None,
        shared: bool = False,
        ring_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
        keep_kv: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The block's output, and with `keep_kv` its attention's keys and values too. `mod`:
        this block's AdaLN vectors (`TimeConditioning.blocks[i]`)."""
        normed, gate_a, shift_m, scale_m, gate_m = self.attn_norm(x, mod)
        attn = self.attn(normed, mask, pad_mask, rope, prefix_kv, record, shared, ring_kv, keep_kv)
        out, kv = (attn[0], attn[1:]) if keep_kv else (attn, None)
        x = torch.addcmul(x, gate_a[:, None], out)
        x = torch.addcmul(x, gate_m[:, None], self.ff(modulate(x, shift_m, scale_m)))
        return x if kv is None else (x, *kv)


def _run_block(block: "DiTBlock", h: torch.Tensor, mod: torch.Tensor, mask: torch.Tensor | SplitMasks | PackedMask,
               pad_mask: torch.Tensor,
               rope: tuple[torch.Tensor, torch.Tensor], kv: tuple[torch.Tensor, torch.Tensor] | None,
               record: DiTRecord | None, shared: bool = False, ring: tuple[torch.Tensor, torch.Tensor] | None = None,
               keep_kv: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block call; a function of its inputs (the block's weights included), so one
    compiled graph of it serves all blocks."""
    return block(h, mod, mask, pad_mask, rope, kv, record, shared, ring, keep_kv)


class DiT(nn.Module):
    """Velocity estimator v(x, t | mu, spks, cond) of the conditional flow matching decoder."""

    def __init__(self, cfg: FlowConfig) -> None:
        super().__init__()
        self.static_chunk_size = cfg.static_chunk_size
        mel = cfg.output_size
        self.time_embed = TimestepEmbedding(cfg.dim)
        self.input_embed = InputEmbedding(mel_dim=mel, mu_dim=cfg.input_size, spk_dim=mel, dim=cfg.dim)
        self.rotary_embed = RotaryEmbedding(cfg.dim_head)
        self.transformer_blocks = nn.ModuleList(
            [DiTBlock(cfg.dim, cfg.heads, cfg.dim_head, cfg.ff_mult) for _ in range(cfg.depth)]
        )
        self.norm_out = AdaLayerNormZeroFinal(cfg.dim)
        self.proj_out = nn.Linear(cfg.dim, mel)
        self._compiled_block: Callable[..., torch.Tensor] | None = None
        self.attention_kernel = "sdpa"  # one of ATTENTION_KERNELS (`use_attention_kernel`)
        self.rotary_in_attention = False  # the split kernel takes head 0 rotated apart (`use_attention_kernel`)
        # One-voice prefixed calls of at least this many rows per CFG half attend to the shared
        # prefix apart from each row's own keys (`split_prefix_attention`) instead of over
        # per-row copies of it; 0: never (EngineConfig.flow_split_prefix_rows).
        self.split_prefix_rows = 8
        self.register_buffer("time_weight", torch.empty(0), persistent=False)
        self.register_buffer("time_bias", torch.empty(0), persistent=False)
        self.fuse()
        # load_state_dict(assign=True) puts new tensors in place of the shared ones.
        self.register_load_state_dict_post_hook(lambda module, _keys: module.fuse())

    def fuse(self) -> None:
        """Every block's AdaLN linear and the final norm's as one (`share_storage`), and each
        block's q, k and v: the modulation of a whole call is then one matrix product from
        the time embedding (`time_conditioning`), not one per block and step."""
        for block in self.transformer_blocks:
            block.attn.fuse()
        self._fuse_time()

    def _fuse_time(self) -> None:
        linears = [block.attn_norm.linear for block in self.transformer_blocks] + [self.norm_out.linear]
        self.time_weight, self.time_bias = share_storage(linears)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> "DiT":
        super()._apply(fn, recurse)  # the blocks' attentions share their q, k, v again themselves
        self._fuse_time()
        return self

    def time_conditioning(self, t: torch.Tensor) -> list[TimeConditioning]:
        """Flow times [S] -> the conditioning of S calls, from one matrix product (the ODE
        solver asks for all of its steps at once)."""
        vectors = self._time_vectors(t)  # [S, depth * 6 D + 2 D]
        return [self._split_time(v.unsqueeze(0)) for v in vectors]

    def _time_vectors(self, t: torch.Tensor) -> torch.Tensor:
        return F.linear(F.silu(self.time_embed(t)), self.time_weight, self.time_bias)

    def _split_time(self, vectors: torch.Tensor) -> TimeConditioning:
        """[R, depth * 6 D + 2 D] -> TimeConditioning (views)."""
        rows, depth = vectors.shape[0], len(self.transformer_blocks)
        width = self.norm_out.linear.in_features
        split = depth * 6 * width
        blocks = vectors[:, :split].view(rows, depth, 6 * width).transpose(0, 1)
        return TimeConditioning(blocks=blocks, final=vectors[:, split:])

    def use_attention_kernel(self, name: str, rotary: bool = False) -> None:
        """How the blocks' attention runs from now on (see ATTENTION_KERNELS); `rotary`:
        "triton" takes head 0 rotated apart and the other heads from the projection where it
        can (`SplitMasks.rotary`)."""
        if name not in ATTENTION_KERNELS:
            raise ValueError(f"attention kernel must be one of {', '.join(ATTENTION_KERNELS)}, not {name!r}")
        if rotary and name != "triton":
            raise ValueError(f"only the triton kernel takes head 0 rotated apart, not {name!r}")
        self.attention_kernel = name
        self.rotary_in_attention = rotary

    def use_conv_kernel(self, name: str) -> None:
        """How the position convolutions run from now on (see CONV_KERNELS)."""
        if name not in CONV_KERNELS:
            raise ValueError(f"conv kernel must be one of {', '.join(CONV_KERNELS)}, not {name!r}")
        self.input_embed.conv_pos_embed.kernel = name

    def compile_blocks(self, backend: str | Callable[..., object] = "inductor") -> None:
        """Run the blocks through `torch.compile` (dynamic shapes: one compiled graph serves
        every block, batch and length). The DiT's time is mostly memory-bound elementwise
        passes between its matrix products (LayerNorm, modulation, gates, rotary, layout
        copies), which the compiler fuses. Calls that record keys/values stay eager."""
        # Every stage's DiT shares this one function, so its compiled variants (plain and
        # prefix batches, per device and dtype) share dynamo's per-function cache limit (8).
        config = torch._dynamo.config
        limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
        setattr(config, limit, max(getattr(config, limit), COMPILE_CACHE_LIMIT))
        self._compiled_block = torch.compile(_run_block, dynamic=True, backend=backend)

    def _run_blocks(self, run: Callable[..., torch.Tensor], h: torch.Tensor, mods: torch.Tensor,
                    attn_mask: torch.Tensor | SplitMasks | PackedMask, pad_mask: torch.Tensor,
                    rope: tuple[torch.Tensor, torch.Tensor],
                    prefix: DiTPrefix | None, record: DiTRecord | None) -> torch.Tensor:
        shared = prefix is not None and prefix.shared
        rings = None if prefix is None else prefix.ring_kv
        sink = None if prefix is None else prefix.sink
        for i, block in enumerate(self.transformer_blocks):
            kv = None if prefix is None else prefix.layer_kv[i]
            ring = None if rings is None else rings[i]
            if sink is None:
                h = run(block, h, mods[i], attn_mask, pad_mask, rope, kv, record, shared, ring)
            else:
                h, keys, values = run(block, h, mods[i], attn_mask, pad_mask, rope, kv, record, shared, ring, True)
                sink.keys_values(i, keys, values)
        return h

    def block_masks(self, attn_mask: torch.Tensor, prefix: DiTPrefix | None,
                    dtype: torch.dtype) -> torch.Tensor | SplitMasks:
        """A call's boolean attention mask [B, 1, T, keys] as its blocks' attention takes it:
        as is, as an additive bias (cuDNN), or split in two for a one-voice prefix attended
        apart (`split_prefix_rows`)."""
        batch = attn_mask.shape[0]
        if prefix is not None and prefix.shared and 0 < self.split_prefix_rows <= batch // 2:
            return split_prefix_masks(attn_mask, prefix.layer_kv[0][0].shape[2], dtype, self.attention_kernel,
                                      self.rotary_in_attention)
        if self.attention_kernel in ("cudnn", "triton"):
            return attention_bias(attn_mask, dtype)
        return attn_mask

    def __deepcopy__(self, memo: dict[int, object]) -> "DiT":
        # A compiled callable does not deep-copy (a stage copy per GPU); the copy starts
        # uncompiled and its stage compiles it again.
        state = dict(self.__dict__, _compiled_block=None)
        clone = self.__class__.__new__(self.__class__)
        memo[id(self)] = clone
        clone.__dict__.update(copy.deepcopy(state, memo))
        clone.fuse()  # parameters deep-copy one by one: share their storage again
        return clone

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor,
        mu: torch.Tensor,
        t: torch.Tensor,
        spks: torch.Tensor,
        cond: torch.Tensor,
        streaming: bool = False,
        prefix: DiTPrefix | None = None,
        record: DiTRecord | None = None,
        time: TimeConditioning | None = None,
    ) -> torch.Tensor:
        """x, mu, cond: [B, 80, T]; mask: [B, 1, T] (1 = real frame); t: [B] or scalar;
        spks: [B, 80]. Returns the velocity [B, 80, T] (channel-major, like the reference).
        `time`: t's conditioning computed ahead (`time_conditioning`); t is then not read.

        With `prefix` (streaming only) the T input frames of row i are frames
        [C_i, C_i + T) of the sequence and the earlier ones come from the cache; with
        `record` this call's keys, values and conv context are collected."""
        batch, _, length = x.shape
        if time is None:
            time = self._split_time(self._time_vectors(t.reshape(-1)))  # one row, or one per row
        context = context_valid = None
        if prefix is not None:
            context = prefix.conv_context
            if context.shape[0] != batch:  # one per CFG half (see DiTPrefix.shared)
                context = per_row(context, batch)
            before = torch.arange(-CONV_CONTEXT, 0, device=prefix.positions.device)
            context_valid = (prefix.positions.unsqueeze(1) + before) >= 0  # [B, CONV_CONTEXT]
        h = self.input_embed(x.transpose(1, 2), cond.transpose(1, 2), mu.transpose(1, 2), spks,
                             context, context_valid, record, None if prefix is None else prefix.sink)
        pad_mask = mask[:, 0, :].bool()
        if prefix is None:
            attn_mask = attention_mask(pad_mask, self.static_chunk_size if streaming else None)
            angles = self.rotary_embed(length)
        else:
            if not streaming:
                raise ValueError("a cached prefix is only exact with block-causal (streaming) attention")
            attn_mask = prefixed_attention_mask(prefix.key_mask, pad_mask, self.static_chunk_size)
            offsets = torch.arange(length, device=prefix.positions.device)
            angles = self.rotary_embed.at(prefix.positions.unsqueeze(1) + offsets)  # [B, T, dh]
        rope = (angles.cos(), angles.sin())  # once per call, shared by all blocks
        h = self.run_blocks(h, time.blocks, self.block_masks(attn_mask, prefix, h.dtype), pad_mask, rope, prefix,
                            record)
        return self.proj_out(self.norm_out(h, time.final)).transpose(1, 2)

    def run_blocks(self, h: torch.Tensor, mods: torch.Tensor, masks: torch.Tensor | SplitMasks | PackedMask,
                   pad_mask: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], prefix: DiTPrefix | None = None,
                   record: DiTRecord | None = None) -> torch.Tensor:
        """The transformer blocks over the embedded input h, compiled where they are
        (`compile_blocks`; calls that record keys and values stay eager)."""
        blocks = (h, mods, masks, pad_mask, rope, prefix, record)
        if self._compiled_block is not None and record is None:
            try:
                return self._run_blocks(self._compiled_block, *blocks)
            except Exception as exc:
                if not is_compile_error(exc):
                    raise  # e.g. out of memory: an error of this call, not of compiling
                # No working compiler (no Triton, no C compiler, an unsupported op), on any
                # of the compiled variants: the flow stays correct, only slower.
                log.exception("torch.compile of the DiT blocks failed; the flow runs them eagerly")
                self._compiled_block = None
        return self._run_blocks(_run_block, *blocks)
