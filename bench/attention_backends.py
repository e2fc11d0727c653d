"""The DiT's attention at the engine's shapes, on each of PyTorch's SDPA backends.

    python -m bench.attention_backends --json out.json

At one chunk the flow is launch- and latency-bound, and its attention kernel (the memory-
efficient one, the only fused backend that took the DiT's boolean mask so far) was the
largest single item of a one-row stage round on the H200: ~27 us a call, 220 calls a round,
~6 ms of ~20 ms of GPU time (round 14 of docs/benchmarks.md). This times one call of
`F.scaled_dot_product_attention` as a DiT block makes it from the prompt cache: queries
are a chunk's new frames (both CFG halves of every row), keys the voice's cached prefix
then the new frames, under the DiT's own mask (`prefixed_attention_mask`: all of the
prefix, block-causal among the new frames, padded frames masked). Per backend:

* `us`: GPU time per call, from a CUDA graph of `--calls` calls replayed `--reps` times
  (no launch cost in it: inside the engine's graphs there is none either);
* `max_abs_err`: against the math backend in float32 on the same inputs;
* `error`: why the backend refused these inputs.

`flash (no mask)` runs the flash backend without the mask, which it cannot take: a bound
on what a kernel that knows the mask's structure could reach, not a usable result.

The prefix is one voice's (the same keys and values in every row of a CFG half, as in a
one-voice batch), so the engine's two ways to attend to it compare too: `copy + <kernel>`
makes each row's keys and values from the shared prefix and its own frames (the per-row
copy a block makes) and attends with SDPA on that kernel; `split <kernel>` is
`split_prefix_attention` (the prefix once per CFG half for all rows' queries, each row's
own frames apart, merged by log-sum-exp; `--engine.flow-split-prefix-rows`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.models.dit import (
    per_row,
    prefixed_attention_mask,
    split_prefix_attention,
    split_prefix_masks,
)

HEADS, DIM_HEAD, CHUNK = 16, 64, 50  # CosyVoice3's DiT and its block of 25 tokens

BACKENDS: dict[str, tuple[SDPBackend, bool]] = {  # name -> (backend, with the mask)
    "efficient": (SDPBackend.EFFICIENT_ATTENTION, True),
    "cudnn": (SDPBackend.CUDNN_ATTENTION, True),
    "math": (SDPBackend.MATH, True),
    "flash (no mask)": (SDPBackend.FLASH_ATTENTION, False),
}


class Inputs(NamedTuple):
    """One block's attention inputs: q and the own frames' keys/values [2 rows, H, frames, dh],
    the voice's prefix keys/values [2 (CFG halves), H, prefix, dh], and the DiT's mask
    [2 rows, 1, frames, prefix + frames]."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    prefix_k: torch.Tensor
    prefix_v: torch.Tensor
    mask: torch.Tensor

    def keys_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's prefix then own keys, and the same of the values (the per-row copy)."""
        rows = self.q.shape[0]
        return (torch.cat((per_row(self.prefix_k, rows), self.k), dim=2),
                torch.cat((per_row(self.prefix_v, rows), self.v), dim=2))


def inputs(rows: int, prefix: int, frames: int, padded: int, device: torch.device, dtype: torch.dtype,
           seed: int = 0) -> Inputs:
    """`Inputs` of `rows` chunks of one voice; the last `padded` new frames of each row are padding."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    batch = 2 * rows  # both CFG halves

    def rand(n: int, length: int) -> torch.Tensor:
        return torch.randn(n, HEADS, length, DIM_HEAD, generator=g).to(device, dtype)

    q, k, v = rand(batch, frames), rand(batch, frames), rand(batch, frames)
    pad = torch.ones(batch, frames, dtype=torch.bool)
    if padded:
        pad[:, frames - padded:] = False
    mask = prefixed_attention_mask(torch.ones(batch, prefix, dtype=torch.bool), pad, CHUNK).to(device)
    return Inputs(q, k, v, rand(2, prefix), rand(2, prefix), mask)


def call(backend: SDPBackend, masked: bool, x: Inputs, keys: torch.Tensor, values: torch.Tensor,
         copy: bool = False) -> Callable[[], torch.Tensor]:
    """SDPA on `backend` over the concatenated keys; `copy`: making them is part of the call."""
    def fn() -> torch.Tensor:
        k, v = x.keys_values() if copy else (keys, values)
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(x.q, k, v, attn_mask=x.mask if masked else None)
    return fn


def split_call(kernel: str, x: Inputs) -> Callable[[], torch.Tensor]:
    """`split_prefix_attention` with `kernel`'s log-sum-exp attention, as [rows, H, frames, dh]."""
    masks = split_prefix_masks(x.mask, x.prefix_k.shape[2], x.q.dtype, kernel)

    def fn() -> torch.Tensor:
        batch, heads, length, dh = x.q.shape
        out = split_prefix_attention(x.q, x.k, x.v, (x.prefix_k, x.prefix_v), masks)
        return out.view(batch, length, heads, dh).transpose(1, 2)
    return fn


def gpu_us(fn: Callable[[], torch.Tensor], calls: int, reps: int) -> float:
    """GPU microseconds per call: `calls` calls captured in one CUDA graph, replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / (reps * calls)


def measure(rows: int, prefix: int, frames: int, padded: int, device: torch.device, dtype: torch.dtype,
            calls: int, reps: int) -> dict[str, Any]:
    x = inputs(rows, prefix, frames, padded, device, dtype)
    k, v = x.keys_values()
    ref = F.scaled_dot_product_attention(x.q.float(), k.float(), v.float(), attn_mask=x.mask)
    out: dict[str, Any] = {"rows": rows, "prefix": prefix, "frames": frames, "padded": padded, "backends": {}}
    calls_of: dict[str, tuple[Callable[[], torch.Tensor], bool]] = {
        name: (call(backend, masked, x, k, v), masked) for name, (backend, masked) in BACKENDS.items()}
    for kernel, backend in (("sdpa", SDPBackend.EFFICIENT_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        label = "efficient" if kernel == "sdpa" else kernel
        calls_of[f"copy + {label}"] = (call(backend, True, x, k, v, copy=True), True)
        calls_of[f"split {label}"] = (split_call(kernel, x), True)
    for name, (fn, masked) in calls_of.items():
        r: dict[str, Any] = {}
        try:
            got = fn()
        except RuntimeError as exc:  # the backend refuses these inputs
            r["error"] = str(exc).splitlines()[0][:200]
        else:
            if masked:
                r["max_abs_err"] = float((got.float() - ref).abs().max())
            if device.type == "cuda":
                r["us"] = gpu_us(fn, calls, reps)
        out["backends"][name] = r
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--rows", default="1,8,64", help="chunks per batch (each is two CFG rows)")
    p.add_argument("--prefix", type=int, default=200, help="cached prompt frames (the bench voice: 200)")
    p.add_argument("--frames", default="50,100", help="new frames per chunk (graph buckets)")
    p.add_argument("--padded", type=int, default=6, help="padding frames at the end of each row")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    report: dict[str, Any] = {"device": str(device), "dtype": args.dtype, "torch": torch.__version__, "results": []}
    for rows in (int(r) for r in args.rows.split(",")):
        for frames in (int(f) for f in args.frames.split(",")):
            r = measure(rows, args.prefix, frames, args.padded, device, dtype, args.calls, args.reps)
            report["results"].append(r)
            cells = []
            for name, b in r["backends"].items():
                if "error" in b:
                    cells.append(f"{name}: refused")
                else:
                    us = f"{b['us']:.1f} us" if "us" in b else "-"
                    err = f" (err {b['max_abs_err']:.1e})" if "max_abs_err" in b else ""
                    cells.append(f"{name}: {us}{err}")
            print(f"rows {rows:3d} x {frames:3d} frames + {args.prefix} prefix: " + "; ".join(cells), flush=True)
            if args.json:
                args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
