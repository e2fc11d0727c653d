"""How fast the split attention kernel runs at the stage's shapes under each launch setting.

    python -m bench.split_attention_tune --json out.json

`engine.models.split_attention_kernel` runs one-voice batches' attention (prompt keys, then
each row's own, one online softmax) with `LAUNCH`. On an H100 (round 45 of
docs/benchmarks.md) the stage's rounds spent about as long in it (51 us a call at 8 rows)
as in cuDNN's two calls, at 12-17% of the GPU's matrix peak. This times, per shape
(`rows:prefix:ring:frames`, as in `bench.split_attention_check`):

* `cudnn`: `dit.split_prefix_attention` with cuDNN's two calls and the merge, eager (the
  stage's compiled blocks fuse the merge and the reshapes around it: compare kernels there,
  `bench.stage_syncs`, and launch settings here);
* each `LaunchConfig` of the sweep (block sizes, warps, stages), with the shipped kernel and
  with a variant that specialises the own bias's strides (`specialised`: Triton then knows
  their alignment when it plans the bias's loads; the shipped kernel does not, so that a
  new row length never waits for a compile);

in microseconds a call, replayed from a CUDA graph (`triton.testing.do_bench_cudagraph`: no
launch overhead, as in the stage's graphs), with each output's largest difference from
cuDNN's. CUDA only.

`--rotary` passes the inputs as the stage's DiT does (`flow_attention_rotary`): q, k and v
strided views of their projections, head 0's queries and keys apart (`head0`); cuDNN and
the reference get them with head 0 put in place. `--sweep tiles` adds query tiles of 16
and 32 (more, smaller programs, so that a grid just past a whole number of waves on the
GPU's SMs loses less to its last one; on an H100 in round 49 they were slower at every
shape timed).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any, Callable

import torch

from bench.split_attention_check import inputs
from engine.models import split_attention_kernel as sak
from engine.models.dit import split_prefix_attention, split_prefix_masks


def sweep(quick: bool, tiles: bool = False) -> list[sak.LaunchConfig]:
    """The launch settings to time, the shipped one among them (first with `quick`);
    `tiles`: query tiles of 16 and 32 too (with 2 or 4 warps)."""
    if quick:
        return [sak.LAUNCH, sak.LaunchConfig(128, 64, 8, 3)]
    configs = [sak.LaunchConfig(m, n, w, s) for m, n, w, s in
               itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3))]
    if tiles:
        configs += [sak.LaunchConfig(m, n, w, s) for m, n, w, s in
                    itertools.product((16, 32), (32, 64), (2, 4), (2, 3))]
    # A 128-query tile across 4 warps holds a 128 x 128 float32 score block in registers: spills.
    return [c for c in configs if not (c.block_m == 128 and c.block_n == 128 and c.num_warps == 4)]


def timed(fn: Callable[[], torch.Tensor]) -> float:
    from triton.testing import do_bench_cudagraph
    return float(do_bench_cudagraph(fn, rep=50)) * 1e3  # ms -> us


def projected(t: torch.Tensor, blank_head0: bool = False) -> torch.Tensor:
    """`t` ([B, H, T, dh]) as the DiT passes it with head 0 apart: a strided view into a
    projection of three times its width ([B, T, 3 x H x dh]); `blank_head0`: head 0 zero
    there (q and k: the kernel must read it from `head0`, as the DiT's projection holds it
    unrotated, so a kernel that read it from the view would show in the difference)."""
    batch, heads, length, dh = t.shape
    wide = t.new_zeros(batch, length, 3 * heads * dh)
    wide[..., : heads * dh] = t.transpose(1, 2).reshape(batch, length, heads * dh)
    if blank_head0:
        wide[..., :dh] = 0
    return wide[..., : heads * dh].view(batch, length, heads, dh).transpose(1, 2)


def tune(shape: str, device: torch.device, configs: list[sak.LaunchConfig],
         kernels: dict[str, Any], rotary: bool = False) -> list[dict[str, Any]]:
    """One row a kernel and setting at `shape`: its time a call and its largest difference
    from cuDNN's output over the real frames; cuDNN's own row first. `rotary`: q, k and v
    as projection views with head 0 apart, as the stage's DiT passes them."""
    rows, prefix, ring, frames = map(int, shape.split(":"))
    x = {k: v.to(device, torch.bfloat16 if v.is_floating_point() else v.dtype)
         for k, v in inputs(rows, prefix, ring, frames).items()}
    q, k, v, pk, pv = x["q"], x["k"], x["v"], x["pk"], x["pv"]
    head0 = None
    if rotary:  # head 0 apart (any values: the reference reads the same ones in place)
        head0 = (q[:, 0].clone(), k[:, 0].clone())
        q, k, v = projected(q, blank_head0=True), projected(k, blank_head0=True), projected(v)
    cudnn_masks = split_prefix_masks(x["mask"], prefix, torch.bfloat16, "cudnn")
    masks = split_prefix_masks(x["mask"], prefix, torch.bfloat16, "triton")
    placed = (x["q"], x["k"], x["v"])  # contiguous, head 0 in place
    reference = split_prefix_attention(*placed, (pk, pv), cudnn_masks).float()
    real = x["pad"].to(device)
    base = {"rows": rows, "prefix": prefix, "ring": ring, "frames": frames, "rotary": rotary}
    results = [{**base, "kernel": "cudnn", "us": timed(lambda: split_prefix_attention(*placed, (pk, pv), cudnn_masks)),
                "max_diff": 0.0}]
    print(f"{shape:>16} cudnn{'':33s} {results[0]['us']:7.1f} us", flush=True)
    for config in configs:
        for name, kernel in kernels.items():
            def call() -> torch.Tensor:
                return sak.launch(q, k, v, pk, pv, masks.prefix, masks.own, config, kernel, head0=head0)
            try:
                diff = float((call().float() - reference)[real].abs().max())
                us = timed(call)
            except Exception as e:  # a setting that does not compile (shared memory, registers)
                print(f"{shape:>16} {config} {name}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            row = {**base, "kernel": name, "config": vars(config), "us": us, "max_diff": diff,
                   "default": config == sak.LAUNCH and name == "shipped"}
            results.append(row)
            print(f"{shape:>16} {name:13s} m{config.block_m:<4d} n{config.block_n:<4d} w{config.num_warps} "
                  f"s{config.num_stages} {us:7.1f} us  diff {diff:.2e}{'  (default)' if row['default'] else ''}",
                  flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="8:200:60:100,8:200:60:200,8:200:60:300,16:200:60:200",
                   help="rows:prefix:ring:frames, comma-separated")
    p.add_argument("--quick", action="store_true", help="two settings only")
    p.add_argument("--sweep", choices=("default", "tiles"), default="default",
                   help="tiles: query tiles of 16 and 32 too")
    p.add_argument("--kernels", default="shipped,specialised",
                   help="which jitted variants to time, comma-separated: shipped, specialised")
    p.add_argument("--rotary", action="store_true", help="head 0 apart, q, k and v projection views (the stage's DiT)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    names = args.kernels.split(",")
    if any(n not in ("shipped", "specialised") for n in names):
        print(f"--kernels takes shipped and/or specialised, not {args.kernels!r}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("CUDA only", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    shipped = sak._triton()
    if shipped is None:
        print("Triton is not importable", file=sys.stderr)
        return 2
    import triton
    specialised = triton.jit(shipped.fn, do_not_specialize=["length", "own", "width", "rows"])
    variants = {"shipped": shipped, "specialised": specialised}
    kernels = {n: variants[n] for n in names}
    results: list[dict[str, Any]] = []
    for shape in args.shapes.split(","):
        rows = tune(shape, device, sweep(args.quick, args.sweep == "tiles"), kernels, args.rotary)
        results += rows
        best = min((r for r in rows if r["kernel"] != "cudnn"), key=lambda r: r["us"], default=None)
        if best is not None:
            print(f"{shape:>16} best: {best['kernel']} {best['config']} {best['us']:.1f} us "
                  f"(cudnn {rows[0]['us']:.1f}, {rows[0]['us'] / best['us']:.2f}x)", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
