"""How long the DiT's matrix products take at each batch of rows the stage runs.

    python -m bench.gemm_shapes --rows 1,2,3,4,5,6,8 --frames 200,250 --json out.json

The stage's flow graphs run the DiT's blocks on 2 x rows x frames positions (both CFG
halves), so every round size is a different M for cuBLAS, which picks a kernel by its own
heuristics. In round 48 (H100) a 4-chunk round's most-called product took 13.8 us a call
against 11.5 us at 5 chunks (`bench.stage_syncs` kernel tables): this times each product of
a block, bias included, at M = 2 x rows x frames and at M padded up to `--pad` (a multiple)
to show whether a shape is one cuBLAS serves badly. Microseconds a call, replayed from a
CUDA graph (`triton.testing.do_bench_cudagraph`), bf16. CUDA only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from engine.models.config import FlowConfig


def products(flow: FlowConfig) -> dict[str, tuple[int, int]]:
    """A DiT block's matrix products, name -> (in, out) features."""
    d, inner = flow.dim, flow.heads * flow.dim_head
    return {"qkv": (d, 3 * inner), "attn_out": (inner, d), "ff_in": (d, flow.ff_mult * d), "ff_out": (flow.ff_mult * d, d)}


def timed(m: int, k: int, n: int, device: torch.device) -> float:
    from triton.testing import do_bench_cudagraph

    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(m, k, generator=g).to(device, torch.bfloat16)
    w = torch.randn(n, k, generator=g).to(device, torch.bfloat16)
    b = torch.randn(n, generator=g).to(device, torch.bfloat16)
    return float(do_bench_cudagraph(lambda: F.linear(x, w, b), rep=50)) * 1e3  # ms -> us


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,2,3,4,5,6,8", help="chunks per round, comma-separated")
    p.add_argument("--frames", default="200,250", help="frames per row (the graph's frame bucket)")
    p.add_argument("--pad", type=int, default=128, help="also time M padded up to a multiple of this (0: no)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    frames = [int(f) for f in args.frames.split(",")]
    if args.pad < 0 or min(rows) < 1 or min(frames) < 1:
        p.error("--pad must be >= 0, --rows and --frames >= 1")
    if not torch.cuda.is_available():
        print("CUDA only", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    shapes = products(FlowConfig())
    results: list[dict[str, Any]] = []
    for f in frames:
        for r in rows:
            m = 2 * r * f
            padded = -(-m // args.pad) * args.pad if args.pad else m
            row: dict[str, Any] = {"rows": r, "frames": f, "m": m, "padded_m": padded}
            for name, (k, n) in shapes.items():
                row[name] = timed(m, k, n, device)
                if padded != m:
                    row[f"{name}_padded"] = timed(padded, k, n, device)
            total = sum(row[name] for name in shapes)
            row["block_us"] = total
            row["block_us_per_row"] = total / r
            results.append(row)
            padded_note = (f"  padded to M={padded}: {sum(row[f'{n}_padded'] for n in shapes):.1f} us"
                           if padded != m else "")
            print(f"rows {r:3d} frames {f:4d} M={m:6d}: " + " ".join(f"{n} {row[n]:6.1f}" for n in shapes)
                  + f"  block {total:6.1f} us ({total / r:5.1f} a row){padded_note}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
