"""The Triton code of `split_attention_kernel`, imported only where the kernel is built (this
module imports Triton, which the CPU machine's engine never needs). Module-level functions:
one jitted function calls another by its global name, in the compiler and the interpreter.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def softmax_step(q, kt, vt, bias, best, total, acc, scale, PRECISION: tl.constexpr):
    """One block of keys into the online softmax: the scores, the running maximum (a row
    with no key seen yet shifts by 0, not -inf, so no NaN), the rescaled sums."""
    s = tl.dot(q, tl.trans(kt), input_precision=PRECISION) * scale + bias
    new_best = tl.maximum(best, tl.max(s, 1))
    shift = tl.where(new_best == float("-inf"), 0.0, new_best)
    p = tl.exp(s - shift[:, None])
    fade = tl.exp(best - shift)
    total = total * fade + tl.sum(p, 1)
    acc = acc * fade[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PRECISION)
    return new_best, total, acc


@triton.jit
def rotated(x, swapped_ptrs, cos_ptrs, sin_ptrs, odd, mask):
    """x [N, DH] with the DiT's interleaved rotary embedding applied in the rows `mask`
    holds (the others are padding): the pair (a, b) at channels (2i, 2i + 1) becomes
    (a cos - b sin, b cos + a sin), in float32 and rounded to x's dtype as
    `dit.apply_rotary` does. `swapped_ptrs` point at each channel's partner (channel ^ 1),
    `odd` says which channels are the pairs' second."""
    partner = tl.load(swapped_ptrs, mask=mask, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptrs, mask=mask, other=1.0)
    sin = tl.load(sin_ptrs, mask=mask, other=0.0)
    partner = tl.where(odd[None, :], partner, -partner)
    return (x.to(tl.float32) * cos + partner * sin).to(x.dtype)


# Sizes and row strides not specialised: Triton would compile a variant for each combination
# of them being 1 or a multiple of 16, and a shape outside the captured graphs would wait for
# a compile (about a second) on a live request.
@triton.jit(do_not_specialize=["length", "own", "width", "rows", "sob_b", "sob_t"])
def split_attention(q_ptr, k_ptr, v_ptr, pk_ptr, pv_ptr, pb_ptr, ob_ptr, out_ptr, cos_ptr, sin_ptr,
                    length, own, width, rows, heads, scale,
                    sq_b, sq_h, sq_t, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s,
                    spk_c, spk_h, spk_w, spv_c, spv_h, spv_w, spb_c, sob_b, sob_t, so_b, so_t, sr_b, sr_t,
                    DH: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, PRECISION: tl.constexpr,
                    ROTARY: tl.constexpr):
    tile, row_head = tl.program_id(0), tl.program_id(1)
    b, h = row_head // heads, row_head % heads
    half = b // rows  # rows [0, rows) are the conditional CFG half
    m = tile * BM + tl.arange(0, BM)
    d = tl.arange(0, DH)
    in_row = m < length
    q_at = q_ptr + b.to(tl.int64) * sq_b + h * sq_h + m[:, None] * sq_t
    q = tl.load(q_at + d[None, :], mask=in_row[:, None], other=0.0)
    # ROTARY: q and the row's own keys come straight from the projection, and the rotary
    # embedding (the first DH channels of the projection: head 0) is applied here, at the
    # frames' positions (cos and sin [B, T, DH], float32), instead of in a copy of q and k.
    # Head 0 alone (a branch, not a mask: the other heads' programs skip the arithmetic too).
    odd = (d % 2) == 1
    if ROTARY:
        if h == 0:
            at = b.to(tl.int64) * sr_b + m[:, None] * sr_t + d[None, :]
            q = rotated(q, q_at + (d ^ 1)[None, :], cos_ptr + at, sin_ptr + at, odd, in_row[:, None])
    best = tl.full((BM,), float("-inf"), tl.float32)
    total = tl.zeros((BM,), tl.float32)
    acc = tl.zeros((BM, DH), tl.float32)
    # The prompt's keys: one bias for every query of the half.
    for start in range(0, width, BN):
        n = start + tl.arange(0, BN)
        keep = n < width
        kt = tl.load(pk_ptr + half * spk_c + h * spk_h + n[:, None] * spk_w + d[None, :], mask=keep[:, None],
                     other=0.0)
        vt = tl.load(pv_ptr + half * spv_c + h * spv_h + n[:, None] * spv_w + d[None, :], mask=keep[:, None],
                     other=0.0)
        bias = tl.load(pb_ptr + half * spb_c + n, mask=keep, other=float("-inf")).to(tl.float32)
        best, total, acc = softmax_step(q, kt, vt, bias[None, :], best, total, acc, scale, PRECISION)
    # The row's own keys (ring and window): a bias per query.
    for start in range(0, own, BN):
        n = start + tl.arange(0, BN)
        keep = n < own
        k_at = k_ptr + b.to(tl.int64) * sk_b + h * sk_h + n[:, None] * sk_s
        kt = tl.load(k_at + d[None, :], mask=keep[:, None], other=0.0)
        if ROTARY:  # the own keys are the call's frames: key n is at frame n's position
            if h == 0:
                at = b.to(tl.int64) * sr_b + n[:, None] * sr_t + d[None, :]
                kt = rotated(kt, k_at + (d ^ 1)[None, :], cos_ptr + at, sin_ptr + at, odd, keep[:, None])
        vt = tl.load(v_ptr + b.to(tl.int64) * sv_b + h * sv_h + n[:, None] * sv_s + d[None, :],
                     mask=keep[:, None], other=0.0)
        bias = tl.load(ob_ptr + b.to(tl.int64) * sob_b + m[:, None] * sob_t + n[None, :],
                       mask=in_row[:, None] & keep[None, :], other=float("-inf")).to(tl.float32)
        best, total, acc = softmax_step(q, kt, vt, bias, best, total, acc, scale, PRECISION)
    acc = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(out_ptr + b.to(tl.int64) * so_b + m[:, None] * so_t + h * DH + d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=in_row[:, None])
