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


# Sizes and row strides not specialised: Triton would compile a variant for each combination
# of them being 1 or a multiple of 16, and a shape outside the captured graphs would wait for
# a compile (about a second) on a live request.
@triton.jit(do_not_specialize=["length", "own", "width", "rows", "sob_b", "sob_t"])
def split_attention(q_ptr, k_ptr, v_ptr, pk_ptr, pv_ptr, pb_ptr, ob_ptr, out_ptr, q0_ptr, k0_ptr,
                    length, own, width, rows, heads, scale,
                    sq_b, sq_h, sq_t, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s,
                    spk_c, spk_h, spk_w, spv_c, spv_h, spv_w, spb_c, sob_b, sob_t, so_b, so_t,
                    sq0_b, sq0_t, sk0_b, sk0_t,
                    DH: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, PRECISION: tl.constexpr,
                    ROTARY: tl.constexpr):
    tile, row_head = tl.program_id(0), tl.program_id(1)
    b, h = row_head // heads, row_head % heads
    half = b // rows  # rows [0, rows) are the conditional CFG half
    m = tile * BM + tl.arange(0, BM)
    d = tl.arange(0, DH)
    in_row = m < length
    # ROTARY: head 0's queries and own keys, the ones the rotary embedding turns, come from
    # q0 and k0 ([B, T, DH] and [B, S, DH], rotated), the other heads' from q and k (the
    # projection as it is): so nothing copies the unturned heads. Only the pointers differ:
    # a branch in the key loop made every program move each key block between shared
    # memory and registers (round 46).
    q_at = q_ptr + b.to(tl.int64) * sq_b + h * sq_h
    q_st = sq_t
    k_at = k_ptr + b.to(tl.int64) * sk_b + h * sk_h
    k_st = sk_s
    if ROTARY:
        if h == 0:
            q_at = q0_ptr + b.to(tl.int64) * sq0_b
            q_st = sq0_t
            k_at = k0_ptr + b.to(tl.int64) * sk0_b
            k_st = sk0_t
    q = tl.load(q_at + m[:, None] * q_st + d[None, :], mask=in_row[:, None], other=0.0)
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
        kt = tl.load(k_at + n[:, None] * k_st + d[None, :], mask=keep[:, None], other=0.0)
        vt = tl.load(v_ptr + b.to(tl.int64) * sv_b + h * sv_h + n[:, None] * sv_s + d[None, :],
                     mask=keep[:, None], other=0.0)
        bias = tl.load(ob_ptr + b.to(tl.int64) * sob_b + m[:, None] * sob_t + n[None, :],
                       mask=in_row[:, None] & keep[None, :], other=float("-inf")).to(tl.float32)
        best, total, acc = softmax_step(q, kt, vt, bias, best, total, acc, scale, PRECISION)
    acc = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(out_ptr + b.to(tl.int64) * so_b + m[:, None] * so_t + h * DH + d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=in_row[:, None])
