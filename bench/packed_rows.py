"""What one DiT call (one Euler step, both CFG halves) costs with its rows packed end to end
(`engine.models.packed_rows`) against padded to the longest, as the stage runs it now.

    python -m bench.packed_rows --mixes "30,140,140,140,140;140,140,140,140,140" --json out.json

A mix lists each row's frames in one CFG half (the call has it twice). Every row follows one
voice's prompt prefix of `--prefix` frames (the stage's one-voice path: keys and values per
CFG half, `DiTPrefix.shared`), as under a load of one registered voice. Per mix and way:

* `wall_ms`: per call, host and device (`--reps` calls back to back, then a sync);
* `gpu_ms` (CUDA): the union of the calls' kernel intervals, per call, and `families`, each
  kernel family's share (`--kernels N` lists the N largest);
* `frames`: the frames the blocks run over (padded: rows x longest; packed: the real ones);
* `mask_ms` (packed): making its `PackedMask`, once per flow call (its ten steps share it);
* `rel_rms`: the packed velocity's distance from the padded one on the real frames.

The blocks are compiled as in the stage (`--compile`, on by default), the attention and
position convolutions are the stage's (`--attention cudnn`, `--conv-kernel triton`) both
ways, and a batch of at least 8 rows a half attends to the prefix apart
(`flow_split_prefix_rows`), both ways too. Rows are padded to the longest, not to a CUDA
graph's frame bucket as in the stage. Random inputs of the full-size random model: the
cost is the shapes', not the values'.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from bench.stage_syncs import kernel_table, print_kernels, write_results
from engine.hub import resolve_model
from engine.models.dit import CONV_CONTEXT, DiT, DiTPrefix, attention_kernel_for
from engine.models.loader import load_model
from engine.models.packed_rows import PackedRows, forward_packed, packed_mask
from engine.stage_profile import kernel_intervals, union_within

DEFAULT_MIXES = ("30,140,140,140,140;30,30,140,140,140,140,140,140;140,140,140,140,140;"
                 "30,30,30,30,140,140,140,140,140,140,140,140,140,140,140,140")


def shared_prefix(dit: DiT, rows: int, width: int, device: torch.device, dtype: torch.dtype) -> DiTPrefix:
    """One voice's prompt prefix of `width` frames for `rows` rows (both halves)."""
    gen = torch.Generator().manual_seed(11)
    attn = dit.transformer_blocks[0].attn

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device, dtype)

    kv = [(rand(2, attn.heads, width, attn.dim_head), rand(2, attn.heads, width, attn.dim_head))
          for _ in dit.transformer_blocks]
    return DiTPrefix(layer_kv=kv, key_mask=torch.ones(rows, width, dtype=torch.bool, device=device),
                     positions=torch.full((rows,), width, dtype=torch.long, device=device),
                     conv_context=rand(2, CONV_CONTEXT, dit.norm_out.linear.in_features), shared=True)


def timed(call: Callable[[], torch.Tensor], reps: int, kernels: int, cuda: bool) -> tuple[dict[str, Any], torch.Tensor]:
    for _ in range(2):  # compiles, first launches
        out = call()
    if cuda:
        torch.cuda.synchronize()
    with (torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
          if cuda else contextlib.nullcontext()) as prof:
        t0 = time.perf_counter()
        for _ in range(reps):
            out = call()
        if cuda:
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / reps
    row: dict[str, Any] = {"wall_ms": 1e3 * wall}
    if cuda:
        row["gpu_ms"] = union_within(kernel_intervals(prof.events()), -math.inf, math.inf) / 1e3 / reps
        row["kernels"], row["families"] = kernel_table(prof.events(), reps, kernels)
    return row, out


def measure(dit: DiT, half: list[int], args: argparse.Namespace, device: torch.device,
            dtype: torch.dtype) -> list[dict[str, Any]]:
    lengths = half + half
    batch, longest = len(lengths), max(lengths)
    gen = torch.Generator().manual_seed(5)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device, dtype)

    x, mu, cond, spks = rand(batch, 80, longest), rand(batch, 80, longest), rand(batch, 80, longest), rand(batch, 80)
    mask = (torch.arange(longest, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None])
    mask = mask.to(dtype).unsqueeze(1)
    prefix = shared_prefix(dit, batch, args.prefix, device, dtype) if args.prefix else None
    time_ = dit.time_conditioning(torch.tensor([0.5], device=device))[0]
    cuda = device.type == "cuda"
    with torch.inference_mode():
        padded, v_pad = timed(lambda: dit(x, mask, mu, torch.zeros(1, device=device), spks, cond, streaming=True,
                                          prefix=prefix, time=time_), args.reps, args.kernels, cuda)
        rows = PackedRows.of(lengths, device)
        t0 = time.perf_counter()
        for _ in range(args.reps):
            block = packed_mask(dit, rows, prefix, dtype)
        if cuda:
            torch.cuda.synchronize()
        mask_ms = 1e3 * (time.perf_counter() - t0) / args.reps
        packed, v_pack = timed(lambda: forward_packed(dit, x, mu=mu, spks=spks, cond=cond, rows=rows, time=time_,
                                                      prefix=prefix, mask=block),
                               args.reps, args.kernels, cuda)
    real = mask.bool().expand_as(v_pad)
    diff = (v_pack[real].float() - v_pad[real].float())
    rel = float(diff.pow(2).mean().sqrt() / v_pad[real].float().pow(2).mean().sqrt())
    mix = ",".join(map(str, half))
    padded |= {"way": "padded", "mix": mix, "frames": batch * longest}
    packed |= {"way": "packed", "mix": mix, "frames": rows.frames, "mask_ms": mask_ms, "rel_rms": rel}
    return [padded, packed]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default="full-random", help="model dir or hub name (default full-random)")
    p.add_argument("--model-cache", type=Path, default=Path("/tmp/models"))
    p.add_argument("--mixes", default=DEFAULT_MIXES, help="';'-separated mixes of rows' frames (one CFG half)")
    p.add_argument("--prefix", type=int, default=150, help="the shared prompt prefix's frames (whole blocks; 0: none)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--kernels", type=int, default=6, metavar="N")
    p.add_argument("--attention", default="cudnn", help="the attention kernel (ATTENTION_KERNELS), both ways")
    p.add_argument("--conv-kernel", default="triton", help="the position convolutions' kernel (CONV_KERNELS)")
    p.add_argument("--split-prefix-rows", type=int, default=8)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    flow = load_model(resolve_model(args.model, args.model_cache), load_lm=False).flow
    dit = flow.decoder.estimator.to(device, dtype).eval()
    if args.prefix % dit.static_chunk_size:
        p.error(f"--prefix must be whole blocks of {dit.static_chunk_size} frames")
    dit.use_attention_kernel(attention_kernel_for(args.attention, device, dtype))
    dit.use_conv_kernel(args.conv_kernel)  # the stage's default; torch's where Triton cannot run
    dit.split_prefix_rows = args.split_prefix_rows
    if args.compile:
        dit.compile_blocks()
    results: list[dict[str, Any]] = []
    for spec in filter(None, args.mixes.split(";")):
        half = [int(n) for n in spec.split(",")]
        try:
            pair = measure(dit, half, args, device, dtype)
        except Exception as exc:  # one mix failing (say, a compile) still reports the others
            pair = [{"mix": spec, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}]
        for row in pair:
            results.append(row)
            if "error" in row:
                print(f"{row['mix']}: {row['error']}", flush=True)
                continue
            extra = f"  mask {row['mask_ms']:.2f} ms  rel rms {row['rel_rms']:.2e}" if row["way"] == "packed" else ""
            gpu = f"  gpu {row['gpu_ms']:8.2f} ms" if "gpu_ms" in row else ""
            print(f"[{row['mix']}] {row['way']:6s} frames {row['frames']:5d}  wall {row['wall_ms']:8.2f} ms{gpu}"
                  f"{extra}  {row.get('families', '')}", flush=True)
            print_kernels(row.get("kernels", []))
        if len(pair) == 2:
            a, b = pair
            key = "gpu_ms" if "gpu_ms" in a else "wall_ms"
            print(f"[{a['mix']}] packed / padded {key}: {b[key] / a[key]:.3f}; frames {b['frames'] / a['frames']:.3f}",
                  flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    write_results(args.json, device, args, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
