"""The one-voice prefix attended by log-sum-exp merge (`PrefixAttention` "merge",
engine/models/attention_lse.py): each kernel's output and log-sum-exp against plain
arithmetic, and the DiT attention's merge path against its concatenation path on random
tensors (a bucketed prefix with masked slots, padded frames and whole padded rows,
several attention blocks). CPU: the CUDA kernel names run the CPU kernel here."""

from __future__ import annotations

import pytest
import torch

from engine.models.attention_lse import BIAS_ALIGN, LSE_KERNELS, attention_bias, attention_with_lse, merge_by_lse
from engine.models.dit import (Attention, DiTPrefix, attention_mask, merged_prefix, prefixed_attention_mask,
                               shared_prefix_mask)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and log-sum-exp in float64 by the definition."""
    scores = (q.double() @ k.double().transpose(-1, -2)) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v.double(), scores.logsumexp(-1)


@pytest.mark.parametrize("kernel", sorted(LSE_KERNELS))
@pytest.mark.parametrize("dtype,tol,lse_tol", [(torch.float64, 1e-12, 1e-12), (torch.float32, 1e-5, 1e-5),
                                               (torch.bfloat16, 3e-2, 1e-4)])
def test_each_kernel_gives_the_attention_and_its_log_sum_exp(kernel: str, dtype: torch.dtype, tol: float,
                                                             lse_tol: float) -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 2, n, 8, generator=g).to(dtype) for n in (7, 21, 21))
    mask = torch.rand(3, 1, 7, 21, generator=g) > 0.4
    mask[..., 0] = True
    ref_out, ref_lse = _reference(q, k, v, mask)
    # A bool mask, a bias in the inputs' dtype, one in float32; then a mask broadcast over rows.
    for m in (mask, attention_bias(mask, dtype), attention_bias(mask, torch.float32)):
        out, lse = attention_with_lse(q, k, v, m, kernel)
        assert out.shape == q.shape and out.dtype == dtype and lse.shape == (3, 2, 7)
        assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        assert (out.double() - ref_out).abs().max().item() <= tol
        assert (lse.double() - ref_lse).abs().max().item() <= lse_tol
    row = mask[:1, :, :1]  # [1, 1, 1, Lk]
    out, lse = attention_with_lse(q, k, v, row, kernel)
    ref_out, ref_lse = _reference(q, k, v, row)
    assert (out.double() - ref_out).abs().max().item() <= tol
    assert (lse.double() - ref_lse).abs().max().item() <= lse_tol


def test_unknown_kernels_are_refused() -> None:
    q = torch.zeros(1, 1, 2, 4)
    with pytest.raises(ValueError, match="unknown attention kernel"):
        attention_with_lse(q, q, q, torch.ones(1, 1, 2, 2, dtype=torch.bool), "flash")


def test_a_bias_row_starts_aligned() -> None:
    mask = torch.rand(2, 1, 5, 21) > 0.5
    bias = attention_bias(mask, torch.bfloat16)
    assert bias.shape == mask.shape and bias.stride(-1) == 1 and bias.stride(-2) % BIAS_ALIGN == 0
    assert torch.equal(bias == 0, mask) and torch.equal(bias.isinf(), ~mask)
    assert attention_bias(bias, torch.bfloat16) is bias  # built once, reused as it is


def test_merging_two_parts_is_the_attention_over_both() -> None:
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, n, 8, generator=g, dtype=torch.float64) for n in (5, 30, 30))
    ref, _ = _reference(q, k, v, torch.ones(1, 1, 5, 30, dtype=torch.bool))
    o1, l1 = attention_with_lse(q, k[:, :, :12], v[:, :, :12], torch.ones(1, 1, 1, 12, dtype=torch.bool), "math")
    o2, l2 = attention_with_lse(q, k[:, :, 12:], v[:, :, 12:], torch.ones(1, 1, 1, 18, dtype=torch.bool), "math")
    assert (merge_by_lse(o1, l1, o2, l2) - ref).abs().max().item() <= 1e-14


def test_an_empty_shared_prefix_stays_finite() -> None:
    """Zero-filled graph buffers (key mask all False at a capture) must not poison the merge."""
    mask = torch.zeros(4, 10, dtype=torch.bool)
    assert shared_prefix_mask(mask).all() and shared_prefix_mask(mask).shape == (1, 1, 1, 10)
    real = torch.arange(10).unsqueeze(0).expand(4, 10) < 6
    assert torch.equal(shared_prefix_mask(real)[0, 0, 0], real[0])


def test_only_a_shared_prefix_without_ring_is_merged() -> None:
    t = torch.zeros(1)
    base = DiTPrefix(layer_kv=[], key_mask=t, positions=t, conv_context=t, shared=True, attention="merge")
    assert merged_prefix(base)
    assert not merged_prefix(DiTPrefix(layer_kv=[], key_mask=t, positions=t, conv_context=t, shared=True))
    assert not merged_prefix(DiTPrefix(layer_kv=[], key_mask=t, positions=t, conv_context=t, attention="merge"))
    assert not merged_prefix(DiTPrefix(layer_kv=[], key_mask=t, positions=t, conv_context=t, shared=True,
                                       attention="merge", ring_kv=[]))
    assert not merged_prefix(None)


@pytest.mark.parametrize("kernel", ["efficient", "cudnn", "math"])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_the_merge_path_equals_the_concatenation(kernel: str, dtype: torch.dtype, tol: float) -> None:
    """Attention over a one-voice prefix per CFG half, merged, against the concatenated keys:
    a prefix bucket of 24 slots holding 20 frames (junk behind the key mask), three rows per
    half (full, padded, wholly padded), 11 frames over blocks of 4."""
    g = torch.Generator().manual_seed(2)
    heads, dh, dim, rows, length, width, frames, chunk = 3, 8, 24, 3, 11, 24, 20, 4
    attn = Attention(dim, heads, dh).to(dtype)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=dtype) * 0.3)
    batch = 2 * rows
    x = torch.randn(batch, length, dim, generator=g, dtype=dtype)
    pad = torch.arange(length).unsqueeze(0) < torch.tensor([11, 6, 0] * 2).unsqueeze(1)
    key_mask = (torch.arange(width) < frames).expand(batch, width)
    pk, pv = (torch.randn(2, heads, width, dh, generator=g, dtype=dtype) for _ in range(2))
    pk[:, :, frames:], pv[:, :, frames:] = 50.0, -50.0  # masked slots: finite junk
    angles = torch.randn(length, dh, generator=g)
    rope = (angles.cos(), angles.sin())

    ref = attn(x, prefixed_attention_mask(key_mask, pad, chunk), pad, rope, (pk, pv), shared=True)
    own, prefix = attention_mask(pad, chunk), shared_prefix_mask(key_mask)
    for masks in ((own, prefix), (attention_bias(own, dtype), attention_bias(prefix, dtype))):
        got = attn(x, masks[0], pad, rope, (pk, pv), shared=True, prefix_mask=masks[1], kernel=kernel)
        assert got.shape == ref.shape and got.isfinite().all()
        assert (got - ref)[pad].abs().max().item() <= tol
        assert (got[~pad] == 0).all()  # padded frames: zeroed after the projection, as before
    with pytest.raises(ValueError, match="shared prefix without ring"):
        attn(x, own, pad, rope, (pk, pv), shared=False, prefix_mask=prefix, kernel=kernel)


def test_the_gpu_check_runs_on_the_cpu(tmp_path, capsys) -> None:  # noqa: ANN001
    """bench/prefix_attention_check.py on small shapes: every variant agrees with the
    concatenation, and a variant that fails is reported without ending the check."""
    import json

    from bench.prefix_attention_check import main

    out = tmp_path / "check.json"
    report = main(["--device", "cpu", "--dtype", "float32", "--rows", "1,4", "--frames", "22,60", "--width", "32",
                   "--prefix-frames", "20", "--heads", "2", "--dim-head", "8", "--chunk", "8", "--reps", "2",
                   "--warmup", "1", "--variants", "efficient,cudnn,math,nonesuch", "--json", str(out)])
    assert json.loads(out.read_text()) == report and len(report["results"]) == 4
    for r in report["results"]:
        assert r["concat"]["ms"] > 0
        for kernel in ("efficient", "cudnn", "math"):
            e = r[f"merge-{kernel}"]
            assert e["finite"] and e["ms"] > 0 and e["vs_concat"]["max_abs"] <= 1e-5
        assert "unknown attention kernel" in r["merge-nonesuch"]["error"]
    assert "merge-nonesuch   FAILED" in capsys.readouterr().out
