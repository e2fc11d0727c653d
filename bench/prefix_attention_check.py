"""One-voice prefix attention: the log-sum-exp merge against the concatenation, per kernel.

    python -m bench.prefix_attention_check --json out.json          # on the GPU

For each shape (R rows per CFG half x T frames, a prefix bucket of W slots of which the
voice fills `--prefix-frames`, H heads of dh) it builds what one DiT attention sees in a
one-voice batch from the prompt cache: q, k, v of the 2R rows as views of their [2R, T,
H x dh] projections (rows of several lengths, padded frames; wholly padded rows when
R >= 4), the prefix's keys/values once per CFG half [2, H, W, dh] with junk behind its key
mask, the block-causal mask over `--chunk` frames. It runs

* "concat": today's path (`PrefixAttention` "concat"): the prefix broadcast to every row,
  concatenated before the row's own keys, one `F.scaled_dot_product_attention` with the
  bool mask of `prefixed_attention_mask`;
* "merge-<kernel>" for each `--variants` kernel (`engine.models.attention_lse.LSE_KERNELS`:
  efficient, cudnn, math): `merged_prefix_attention`, the masks prebuilt as the DiT builds
  them once per call;

and prints per path the time (CUDA events on the GPU, perf_counter elsewhere; the median of
`--reps` calls after `--warmup`), and per variant its difference from "concat" on the real
frames (max abs, relative RMS), next to both paths' difference from a float32 reference
(what rounding alone gives). A variant that fails (a kernel refusing the shape or the
dtype) is reported with its error; the others still run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from engine.models.attention_lse import attention_bias
from engine.models.dit import (attention_mask, merged_prefix_attention, per_row, prefixed_attention_mask,
                               shared_prefix_mask)


def make_inputs(rows: int, frames: int, width: int, prefix_frames: int, heads: int, dh: int, chunk: int,
                dtype: torch.dtype, device: torch.device, seed: int = 0) -> dict[str, Any]:
    """One attention's inputs of a one-voice batch of 2 x `rows` rows (see the module doc)."""
    g = torch.Generator().manual_seed(seed)
    batch = 2 * rows

    def per_head(t: torch.Tensor) -> torch.Tensor:  # [B, T, H x dh] -> [B, H, T, dh], a view
        return t.view(batch, frames, heads, dh).transpose(1, 2)

    q, k, v = (per_head(torch.randn(batch, frames, heads * dh, generator=g).to(device, dtype)) for _ in range(3))
    prefix = [torch.randn(2, heads, width, dh, generator=g) for _ in range(2)]
    for t, junk in zip(prefix, (30.0, -30.0)):
        t[:, :, prefix_frames:] = junk  # finite, masked
    pk, pv = (t.to(device, dtype) for t in prefix)
    # Row lengths: whole, shorter by a third and two thirds, and none (a padded bucket row).
    lengths = [frames, max(1, frames - frames // 3), max(1, frames // 3), 0]
    per_half = torch.tensor([lengths[i % 4] for i in range(rows)])
    pad = (torch.arange(frames).unsqueeze(0) < torch.cat((per_half, per_half)).unsqueeze(1)).to(device)
    key_mask = (torch.arange(width, device=device) < prefix_frames).expand(batch, width)
    return {"q": q, "k": k, "v": v, "pk": pk, "pv": pv, "pad": pad, "key_mask": key_mask, "chunk": chunk}


def concat_path(x: dict[str, Any], mask: torch.Tensor) -> torch.Tensor:
    """Today's attention over a shared prefix: [B, T, H x dh]."""
    q, batch = x["q"], x["q"].shape[0]
    k = torch.cat((per_row(x["pk"], batch), x["k"]), dim=2)
    v = torch.cat((per_row(x["pv"], batch), x["v"]), dim=2)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.transpose(1, 2).reshape(batch, q.shape[2], -1)


def merge_path(x: dict[str, Any], own: torch.Tensor, prefix: torch.Tensor, kernel: str) -> torch.Tensor:
    return merged_prefix_attention(x["q"], x["k"], x["v"], (x["pk"], x["pv"]), prefix, own, kernel)


def timed(fn: Callable[[], torch.Tensor], device: torch.device, warmup: int, reps: int) -> float:
    """Median milliseconds of one call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times) if times else float("nan")


def difference(got: torch.Tensor, ref: torch.Tensor, real: torch.Tensor) -> dict[str, float]:
    """Max abs and relative RMS difference over the real frames (`real` [B, T])."""
    d = (got.double() - ref.double())[real]
    r = ref.double()[real]
    return {"max_abs": float(d.abs().max()), "rel_rms": float(d.pow(2).mean().sqrt() / r.pow(2).mean().sqrt())}


def check_shape(rows: int, frames: int, args: argparse.Namespace, device: torch.device,
                dtype: torch.dtype) -> dict[str, Any]:
    x = make_inputs(rows, frames, args.width, args.prefix_frames, args.heads, args.dim_head, args.chunk, dtype, device)
    real = x["pad"]
    mask = prefixed_attention_mask(x["key_mask"], x["pad"], args.chunk)
    own = attention_bias(attention_mask(x["pad"], args.chunk), dtype)
    prefix = attention_bias(shared_prefix_mask(x["key_mask"]), dtype)
    up = {**x, **{n: x[n].float() for n in ("q", "k", "v", "pk", "pv")}}
    with torch.inference_mode():
        reference = concat_path(up, mask)
        concat = concat_path(x, mask)
    result: dict[str, Any] = {
        "rows": rows, "frames": frames, "batch": 2 * rows,
        "concat": {"ms": timed(lambda: concat_path(x, mask), device, args.warmup, args.reps),
                   "vs_reference": difference(concat, reference, real)},
    }
    for kernel in args.variants.split(","):
        name = f"merge-{kernel}"
        try:
            with torch.inference_mode():
                got = merge_path(x, own, prefix, kernel)
                entry: dict[str, Any] = {"finite": bool(got.isfinite().all()),
                                         "vs_concat": difference(got, concat, real),
                                         "vs_reference": difference(got, reference, real)}
                entry["ms"] = timed(lambda: merge_path(x, own, prefix, kernel), device, args.warmup, args.reps)
        except Exception as exc:  # a kernel refusing the shape must not end the check
            entry = {"error": f"{type(exc).__name__}: {exc}".strip()[:2000]}
            traceback.print_exc()
        result[name] = entry
    return result


def report_lines(r: dict[str, Any]) -> list[str]:
    c = r["concat"]
    lines = [f"R={r['rows']:3d} (B={r['batch']}) T={r['frames']:4d}: concat {c['ms']:8.3f} ms, "
             f"vs fp32 ref max {c['vs_reference']['max_abs']:.2e} rel {c['vs_reference']['rel_rms']:.2e}"]
    for name, e in r.items():
        if not name.startswith("merge-"):
            continue
        if "error" in e:
            lines.append(f"    {name:16s} FAILED: {e['error'].splitlines()[0][:200]}")
            continue
        lines.append(f"    {name:16s} {e['ms']:8.3f} ms ({e['ms'] / c['ms']:.2f}x), vs concat max "
                     f"{e['vs_concat']['max_abs']:.2e} rel {e['vs_concat']['rel_rms']:.2e}, vs fp32 ref max "
                     f"{e['vs_reference']['max_abs']:.2e} rel {e['vs_reference']['rel_rms']:.2e}"
                     + ("" if e["finite"] else ", NOT FINITE"))
    return lines


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32", "float64"])
    p.add_argument("--rows", default="1,64", help="rows per CFG half (the batch has twice as many)")
    p.add_argument("--frames", default="22,150", help="new frames per row")
    p.add_argument("--width", type=int, default=224, help="prefix slots (the bucket)")
    p.add_argument("--prefix-frames", type=int, default=212, help="the voice's cached frames (<= width)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim-head", type=int, default=64)
    p.add_argument("--chunk", type=int, default=50, help="block-causal block in frames")
    p.add_argument("--variants", default="efficient,cudnn,math", help="LSE kernels of the merge path")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if not 0 < args.prefix_frames <= args.width:
        p.error("--prefix-frames must be within [1, --width]")
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    report: dict[str, Any] = {"device": str(device), "dtype": args.dtype, "width": args.width,
                              "prefix_frames": args.prefix_frames, "heads": args.heads, "dim_head": args.dim_head,
                              "chunk": args.chunk, "torch": torch.__version__, "results": []}
    if device.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(device)
    for rows in (int(r) for r in args.rows.split(",")):
        for frames in (int(t) for t in args.frames.split(",")):
            r = check_shape(rows, frames, args, device, dtype)
            report["results"].append(r)
            print("\n".join(report_lines(r)), flush=True)
            if args.json:
                args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
