"""Attention that also returns the log-sum-exp of its scores, and the merge of two such
partial attentions over disjoint key sets.

Softmax attention over keys A u B equals the attention over A (output o_A, log-sum-exp
l_A per query) and over B (o_B, l_B) merged as

    o = o_A * sigmoid(l_A - l_B) + o_B * sigmoid(l_B - l_A)

(the weights are exp(l_A) / (exp(l_A) + exp(l_B)) and its complement). The DiT uses it
for one-voice batches (`engine.models.dit.PrefixAttention`): the voice's cached prefix is
attended once per CFG half by all the half's queries, the rows' own frames per row, so the
prefix's keys and values are never copied per row.

Kernels (`LSE_KERNELS`, chosen by name per call, never by global state):

* "efficient": `aten._scaled_dot_product_efficient_attention` on CUDA (the memory-efficient
  kernel; log-sum-exp [B, H, ceil(Lq / 32) * 32] float32, only the first Lq are real);
* "cudnn": `aten._scaled_dot_product_cudnn_attention` on CUDA (fp16/bf16 only;
  log-sum-exp [B, H, Lq, 1] float32);
* "math": plain matrix products in float32 (float64 for float64 inputs), any device.

Off CUDA "efficient" and "cudnn" run `aten._scaled_dot_product_flash_attention_for_cpu`
(log-sum-exp [B, H, Lq], float32 for reduced precision, else the inputs' dtype); other
devices run "math". All take the SDPA default scale 1/sqrt(dh), and a query must see at
least one key: what a kernel returns for a fully masked row differs (the CPU kernel gives
a log-sum-exp of 0 there, not -inf), so callers guard such rows.
"""

from __future__ import annotations

from typing import Callable

import torch

# The memory-efficient kernel reads a bias row in aligned vectors: each row must start on
# a multiple of 16 elements (torch's own SDPA pads its masks the same way before calling it,
# `preprocess_mask` in aten/src/ATen/native/transformers/attention.cpp).
BIAS_ALIGN = 16

LseKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def attention_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (True = attend) or an additive bias -> additive bias (0 / -inf) in `dtype`.

    A new bias is stored with its last dim padded to BIAS_ALIGN and sliced back, so every
    row starts aligned for the CUDA kernels; a bias already in `dtype` is taken as it is
    (build it here once and reuse it across calls)."""
    if mask.dtype == dtype:
        return mask
    width = mask.shape[-1]
    padded = -(-width // BIAS_ALIGN) * BIAS_ALIGN
    bias = torch.zeros(*mask.shape[:-1], padded, dtype=dtype, device=mask.device)[..., :width]
    if mask.dtype == torch.bool:
        return bias.masked_fill_(~mask, float("-inf"))
    return bias.copy_(mask)


def _full_bias(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The bias as the memory-efficient and CPU kernels take it: q's dtype, expanded (a view)
    to [B, H, Lq, Lk]."""
    return attention_bias(mask, q.dtype).expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def _efficient(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse, _seed, _offset = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, _full_bias(mask, q, k), True, 0.0, False)
    return out, lse[..., : q.shape[2]]  # padded to a multiple of 32 queries


def _cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Not expanded here: the op expands a bias to [B, its heads (or 1), Lq, Lk] itself, as
    # for the masks torch's own SDPA hands it (a head stride of 0 is not a layout that path
    # makes).
    out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, attention_bias(mask, q.dtype), True, 0.0, False, False)
    if lse.dim() == 4:  # [B, H, Lq, 1]
        lse = lse.squeeze(-1)
    return out, lse[..., : q.shape[2]]


def _cpu_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Takes a float bias only (a bool mask is refused), 2-D or 4-D, broadcast over its dims.
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, attn_mask=_full_bias(mask, q, k))


def _math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * q.shape[-1] ** -0.5
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask.to(acc)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.to(acc))
    return out.to(q.dtype), lse


# CUDA kernels by name (`PrefixAttention` picks one per stage).
LSE_KERNELS: dict[str, LseKernel] = {"efficient": _efficient, "cudnn": _cudnn, "math": _math}


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                       kernel: str = "efficient") -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, H, Lq, dh], k and v [B, H, Lk, dh], mask bool (True = attend) or additive bias
    broadcastable to [B, H, Lq, Lk] -> (out [B, H, Lq, dh] in q's dtype, log-sum-exp of the
    scaled, masked scores [B, H, Lq], float32 or float64). `kernel`: a key of LSE_KERNELS
    (see the module doc for what runs off CUDA)."""
    if kernel not in LSE_KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r} (one of {', '.join(LSE_KERNELS)})")
    if q.device.type == "cuda":
        run = LSE_KERNELS[kernel]
    elif kernel == "math" or q.device.type != "cpu":
        run = _math
    else:
        run = _cpu_flash
    return run(q, k, v, mask)


def merge_by_lse(o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor) -> torch.Tensor:
    """Attention over two disjoint key sets from its parts: outputs [..., dh] and their
    log-sum-exps [...] (same leading shape) -> the attention over both, in o1's dtype. The
    weights are taken in float32 at least (bf16 sigmoid weights would cost the output bits)."""
    acc = torch.promote_types(torch.promote_types(o1.dtype, l1.dtype), torch.float32)
    w1 = torch.sigmoid((l1 - l2).to(acc)).unsqueeze(-1)
    w2 = torch.sigmoid((l2 - l1).to(acc)).unsqueeze(-1)
    return (o1.to(acc) * w1 + o2.to(acc) * w2).to(o1.dtype)
