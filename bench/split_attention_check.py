"""How close each kernel's split prefix attention is to exact arithmetic, at the stage's shapes.

    python -m bench.split_attention_check --json out.json

`split_prefix_attention` (one-voice batches of `flow_split_prefix_rows` rows or more) takes
each part's log-sum-exp from cuDNN's kernel (`flow_attention=cudnn`) or the memory-efficient
one (`sdpa`). In round 38 the stage's PCM moved by ~3% relative RMS between the two at 16
and 64 steady rows (chunks after a ring of cached context), against ~0.15% at opening
chunks (round 15). This separates the attention from the rest: per kernel and shape, bf16
on the GPU against the same formula in float64 on the CPU (that the formula is the attention
over the concatenated keys is the CPU test `test_one_voice_split_attention_is_the_same_
arithmetic_in_float64`'s job), over the queries of real frames:

* `max_abs_err` and `rel_rms` of the output;
* `lse_max_abs_err` of each part's log-sum-exp (`attention_with_lse`; none for `triton`,
  `engine.models.split_attention_kernel`, which attends to both parts in one pass and keeps
  no log-sum-exp: on the GPU only, and in Triton's interpreter on the CPU).

Shapes: `rows` chunks (both CFG halves), a `prefix` of the voice's prompt keys, a ring of
`ring` context slots of which each row holds a different number (the first rows fewer:
utterances at different points), `frames` new frames of which the last rows pad some.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from engine.models import split_attention_kernel
from engine.models.dit import attention_with_lse, prefixed_attention_mask, split_prefix_attention, split_prefix_masks

HEADS, DIM_HEAD, CHUNK = 16, 64, 50


def inputs(rows: int, prefix: int, ring: int, frames: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    batch = 2 * rows
    held = torch.linspace(0, ring, rows).round().long().repeat(2)  # ring slots each row holds
    ring_mask = torch.arange(ring)[None, :] >= (ring - held)[:, None]  # the newest slots, at the end
    prefix_mask = torch.cat((torch.ones(batch, prefix, dtype=torch.bool), ring_mask), dim=1)
    real = torch.full((rows,), frames).sub(torch.arange(rows) % 7).clamp(min=1).repeat(2)
    pad_mask = torch.arange(frames)[None, :] < real[:, None]
    shape = (batch, HEADS, frames, DIM_HEAD)
    return {
        "q": torch.randn(shape, generator=g), "k": torch.randn(batch, HEADS, ring + frames, DIM_HEAD, generator=g),
        "v": torch.randn(batch, HEADS, ring + frames, DIM_HEAD, generator=g),
        "pk": torch.randn(2, HEADS, prefix, DIM_HEAD, generator=g), "pv": torch.randn(2, HEADS, prefix, DIM_HEAD, generator=g),
        "mask": prefixed_attention_mask(prefix_mask, pad_mask, CHUNK), "pad": pad_mask,
    }


def kernels(device: torch.device) -> tuple[str, ...]:
    """The kernels to check: `triton` where it runs (`split_attention_kernel.runs_on`)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return ("sdpa", "cudnn", "triton") if split_attention_kernel.runs_on(device, dtype) else ("sdpa", "cudnn")


def run(x: dict[str, torch.Tensor], prefix: int, kernel: str, device: torch.device,
        dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    t = {k: v.to(device, dtype if v.is_floating_point() else v.dtype) for k, v in x.items()}
    masks = split_prefix_masks(t["mask"], prefix, dtype, kernel)
    out = split_prefix_attention(t["q"], t["k"], t["v"], (t["pk"], t["pv"]), masks)
    if kernel == "triton":
        return out.double().cpu(), None, None
    batch, heads, length, dh = t["q"].shape
    halves = t["q"].transpose(1, 2).reshape(2, batch // 2 * length, heads, dh).transpose(1, 2)
    _, l_pre = attention_with_lse(halves, t["pk"], t["pv"], masks.prefix, kernel)
    _, l_own = attention_with_lse(t["q"], t["k"], t["v"], masks.own, kernel)
    return out.double().cpu(), l_pre.double().cpu(), l_own.double().cpu()


def check(rows: int, prefix: int, ring: int, frames: int, device: torch.device) -> list[dict[str, Any]]:
    x = inputs(rows, prefix, ring, frames)
    exact, l_pre, l_own = run(x, prefix, "sdpa", torch.device("cpu"), torch.float64)
    assert l_pre is not None and l_own is not None
    real = x["pad"]  # [B, T]
    results = []
    for kernel in kernels(device):
        got, g_pre, g_own = run(x, prefix, kernel, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
        diff = (got - exact)[real]
        own_real = real[:, None, :].expand_as(l_own)
        lse = (None if g_pre is None or g_own is None else
               max(float((g_pre - l_pre).abs().max()), float((g_own - l_own)[own_real].abs().max())))
        row = {"rows": rows, "prefix": prefix, "ring": ring, "frames": frames, "kernel": kernel,
               "max_abs_err": float(diff.abs().max()),
               "rel_rms": float(diff.pow(2).mean().sqrt() / exact[real].pow(2).mean().sqrt()),
               "lse_max_abs_err": lse}
        results.append(row)
        print(f"{rows:3d} rows prefix {prefix} ring {ring} frames {frames:3d} {kernel:6s} "
              f"max {row['max_abs_err']:.3e} rel_rms {row['rel_rms']:.3e} lse "
              f"{'-' if lse is None else f'{lse:.3e}'}", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shapes", default="8:200:0:50,16:200:60:100,64:200:60:100,64:200:0:50",
                   help="rows:prefix:ring:frames, comma-separated")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    results = []
    for shape in args.shapes.split(","):
        rows, prefix, ring, frames = map(int, shape.split(":"))
        results += check(rows, prefix, ring, frames, device)
    if args.json:
        args.json.write_text(json.dumps({"device": str(device), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
