"""The DiT's position convolution (kernel 31, 16 groups of 64 channels) at the stage's shapes,
done each way the DiT could do it.

    python -m bench.position_conv --json out.json

A 64-row opening round on the GPU spent ~24% of its kernel time in this convolution (round
38 of docs/benchmarks.md): above `TAPS_MAX_BYTES` the DiT hands it to cuDNN on a
channels-first copy of its frame-major activations, and cuDNN runs an "analytic" implicit
GEMM plus layout conversions around it, for ~2% of the round's arithmetic. Per way and
shape (rows = CFG-doubled rows, frames = the conv's input length, context and padding
included), one convolution without its Mish:

* `us`: GPU time per call, from a CUDA graph of `--calls` calls replayed `--reps` times
  (as inside the engine's graphs: no launch cost);
* `max_abs_err`: against float32 `nn.Conv1d` on the same inputs;
* `error`: why the way could not run (say, out of memory).

Ways: `cudnn, channels first` (the DiT's way above the bound now), `cudnn, frame-major`
(the same call on a transposed view of the frame-major input, which is channels-last for
cuDNN: no layout copies), each also with `torch.backends.cudnn.benchmark` on, and `taps`
(`grouped_conv_by_taps`, the DiT's way below the bound, at any size), `triton`
(`engine.models.causal_conv_kernel`: frame-major in and out, one launch) and `triton, with
Mish` (the same kernel with the activation the DiT applies after it).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from bench.attention_backends import gpu_us
from engine.models import causal_conv_kernel
from engine.models.dit import CONV_POS_GROUPS, CONV_POS_KERNEL, grouped_conv_by_taps

DIM = 1024


def channels_first(conv: nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
    """x [B, T, C] frame-major, unpadded -> [B, T', C]: channels-first copy, cuDNN, back."""
    return conv(F.pad(x.transpose(1, 2), (conv.kernel_size[0] - 1, 0))).transpose(1, 2)


def frame_major(conv: nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
    """The same convolution on a transposed view: stride 1 over channels, channels-last to cuDNN."""
    padded = F.pad(x, (0, 0, conv.kernel_size[0] - 1, 0))
    return conv(padded.transpose(1, 2)).transpose(1, 2)


def taps(conv: nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
    return grouped_conv_by_taps(F.pad(x, (0, 0, conv.kernel_size[0] - 1, 0)), conv)


def triton(conv: nn.Conv1d, x: torch.Tensor, weight: torch.Tensor, mish: bool = False,
           block: int = causal_conv_kernel.BLOCK_T) -> torch.Tensor:
    """`weight`: `packed_weight(conv)`, packed once per shape as the DiT packs it once."""
    return causal_conv_kernel.grouped_causal_conv_mish(x, conv, weight, mish=mish, block=block)


# The Triton ways take the packed weight too; "with Mish" is the kernel as the DiT runs it
# (compare with a way's time plus a Mish pass).
TRITON_WAYS: dict[str, dict[str, Any]] = {
    "triton": {},
    "triton, with Mish": {"mish": True},
    "triton, 32-frame tiles": {"block": 32},
    "triton, 128-frame tiles": {"block": 128},
}

WAYS: dict[str, tuple[Callable[[nn.Conv1d, torch.Tensor], torch.Tensor], bool]] = {
    "cudnn, channels first": (channels_first, False),
    "cudnn, channels first, benchmark": (channels_first, True),
    "cudnn, frame-major": (frame_major, False),
    "cudnn, frame-major, benchmark": (frame_major, True),
    "taps": (taps, False),
}


def measure(rows: int, frames: int, device: torch.device, dtype: torch.dtype,
            calls: int, reps: int) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    reference_conv = nn.Conv1d(DIM, DIM, CONV_POS_KERNEL, groups=CONV_POS_GROUPS).to(device)
    conv = nn.Conv1d(DIM, DIM, CONV_POS_KERNEL, groups=CONV_POS_GROUPS).to(device, dtype)
    conv.load_state_dict({k: v.to(dtype) for k, v in reference_conv.state_dict().items()})
    x = torch.randn(rows, frames, DIM, device=device, dtype=dtype)
    with torch.no_grad():
        expected = channels_first(reference_conv, x.float())
    out: list[dict[str, Any]] = []
    ways = dict(WAYS)
    if causal_conv_kernel.available(x, conv):
        weight = causal_conv_kernel.packed_weight(conv)
        ways.update({name: (functools.partial(triton, weight=weight, **kw), False) for name, kw in TRITON_WAYS.items()})
    for name, (way, benchmark) in ways.items():
        row: dict[str, Any] = {"rows": rows, "frames": frames, "way": name}
        expected_here = F.mish(expected) if TRITON_WAYS.get(name, {}).get("mish") else expected
        torch.backends.cudnn.benchmark = benchmark
        try:
            with torch.no_grad():
                got = way(conv, x)
                row["max_abs_err"] = float((got.float() - expected_here).abs().max())
                if device.type == "cuda":
                    row["us"] = gpu_us(lambda: way(conv, x), calls, reps)
        except torch.OutOfMemoryError as exc:
            row["error"] = str(exc).splitlines()[0]
        finally:
            torch.backends.cudnn.benchmark = False
            if device.type == "cuda":
                torch.cuda.empty_cache()
        out.append(row)
        print(f"{rows:4d} rows x {frames:4d} frames  {name:34s} "
              + (f"{row['us']:9.1f} us " if "us" in row else "")
              + (f"err {row['max_abs_err']:.2e}" if "max_abs_err" in row else row.get("error", "")), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16")
    # Rows are CFG-doubled (2 = one chunk); frames include the 60 frames of cached context.
    p.add_argument("--rows", default="2,32,128")
    p.add_argument("--frames", default="110,160,260")
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    results = [r for rows in map(int, args.rows.split(",")) for frames in map(int, args.frames.split(","))
               for r in measure(rows, frames, device, dtype, args.calls, args.reps)]
    if args.json:
        args.json.write_text(json.dumps({"device": str(device), "dtype": args.dtype, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
