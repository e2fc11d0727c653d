"""What one vocoder step costs at the stage's shapes, done each way the vocoder could run.

    python -m bench.vocoder_cost --rows 1,8,16,64 --json out.json

In a 64-chunk round of the stage the vocoder runs eagerly (its CUDA graphs stop at 8
streams) and in float32, and the round's kernel list held many float32 elementwise passes
and layout conversions next to the DiT's bf16 kernels. This times the vocoder alone: per
way and row count, `rows` streams each primed with `--context` mel frames, then `--reps`
steps of `--new` frames each (`CausalHiFTGenerator.stream_step`, as the stage calls it):

* `wall_ms`: per step, host and device, the step's PCM on the host at its end (as the
  stage copies it out);
* `gpu_ms` (CUDA): the union of the step's kernel intervals, and `families`, the share of
  each kernel family in the kernels' time (`--kernels N` lists the N largest);
* `max_abs_diff`: the last step's PCM against the first way's, same inputs.

Ways (`--ways`): `torch` (eager operators, the stage's default until this bench), `triton`
(`use_snake_kernel(..., "triton")`: the Snake activations fused, `engine.models.snake_kernel`),
`channels-last` (`triton` with the decode's activations and convolutions channels-last,
`CausalHiFTGenerator.channels_last`: no layout conversions around cuDNN's convolutions),
`compiled` (`torch.compile` of the decode, dynamic shapes: what an inductor-fused decode
would give, for comparison; not an engine setting). `--graphs`: at up to 8 rows the stage's CUDA
graphs (`engine.vocoder_graphs`) decode, as in the stage.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from bench.stage_syncs import kernel_table, print_kernels, write_results
from engine.hub import resolve_model
from engine.models.hift import CausalHiFTGenerator, use_snake_kernel
from engine.models.loader import load_model
from engine.stage_profile import kernel_intervals, union_within
from engine.vocoder_graphs import VocoderGraphRunner

WAYS = ("torch", "triton", "channels-last", "compiled")
Decode = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def mels(rows: int, frames: int, seed: int, device: torch.device) -> list[torch.Tensor]:
    """[80, frames] per row, in a log-mel's range."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(80, frames, generator=gen) * 2.0 - 5.0).to(device) for _ in range(rows)]


def decode_for(hift: CausalHiFTGenerator, way: str, graphs: bool) -> Decode | None:
    if way == "compiled":
        return torch.compile(hift._decode, dynamic=True)
    if graphs and hift.stft_window.is_cuda:
        return VocoderGraphRunner(hift)
    return None


def measure(hift: CausalHiFTGenerator, way: str, rows: int, args: argparse.Namespace,
            device: torch.device) -> dict[str, Any]:
    use_snake_kernel(hift, "triton" if way in ("triton", "channels-last") else "torch")
    hift.channels_last = way == "channels-last"
    decode = decode_for(hift, way, args.graphs)
    streams = [hift.new_stream() for _ in range(rows)]
    cuda = device.type == "cuda"

    def step(i: int) -> torch.Tensor:
        pcm = hift.stream_step(streams, mels(rows, args.new, 100 + i, device), [False] * rows, decode=decode)
        return torch.cat([p.reshape(-1) for p in pcm]).cpu()

    with torch.inference_mode():
        hift.stream_step(streams, mels(rows, args.context, 0, device), [False] * rows, decode=decode)
        for i in range(2):  # kernels' first launches, compiles, graph captures
            step(i)
        walls: list[float] = []
        with (torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
              if cuda else contextlib.nullcontext()) as prof:
            for i in range(args.reps):
                t0 = time.perf_counter()
                step(2 + i)
                walls.append(time.perf_counter() - t0)
        last = step(2 + args.reps)
    out: dict[str, Any] = {"way": way, "rows": rows, "wall_ms": 1e3 * statistics.fmean(walls), "pcm": last}
    if cuda:
        out["gpu_ms"] = union_within(kernel_intervals(prof.events()), -math.inf, math.inf) / 1e3 / args.reps
        out["kernels"], out["families"] = kernel_table(prof.events(), args.reps, args.kernels)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default="full-random", help="model dir or hub name (default full-random)")
    p.add_argument("--model-cache", type=Path, default=Path("/tmp/models"))
    p.add_argument("--rows", default="1,8,16,64")
    p.add_argument("--ways", default=",".join(WAYS))
    p.add_argument("--context", type=int, default=80, help="mel frames each stream is primed with")
    p.add_argument("--new", type=int, default=40, help="mel frames per stream and step (20 tokens)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--kernels", type=int, default=8, metavar="N")
    p.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="the stage's CUDA graphs at up to 8 rows (CUDA)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    ways = [w for w in args.ways.split(",") if w]
    if unknown := set(ways) - set(WAYS):
        p.error(f"unknown ways {sorted(unknown)}; known: {', '.join(WAYS)}")
    device = torch.device(args.device)
    hift = load_model(resolve_model(args.model, args.model_cache), load_lm=False).hift.to(device).eval()
    results: list[dict[str, Any]] = []
    for rows in map(int, args.rows.split(",")):
        first: torch.Tensor | None = None
        for way in ways:
            try:
                row = measure(hift, way, rows, args, device)
            except Exception as exc:  # one way failing (say, compile) still reports the others
                row = {"way": way, "rows": rows, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
            pcm = row.pop("pcm", None)
            if pcm is not None:
                first = pcm if first is None else first
                row["max_abs_diff"] = float((pcm - first).abs().max())
            results.append(row)
            print(f"{rows:3d} rows  {way:9s} " + (
                f"wall {row['wall_ms']:8.2f} ms" + (f"  gpu {row['gpu_ms']:8.2f} ms" if "gpu_ms" in row else "")
                + f"  diff {row['max_abs_diff']:.2e}  {row.get('families', '')}" if "wall_ms" in row else row["error"]),
                flush=True)
            print_kernels(row.get("kernels", []))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    write_results(args.json, device, args, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
