"""Where the flow's time goes: a torch.profiler table of one chunk batch's ODE solve.

    python -m bench.flow_profile --device cuda --batch 64 --frames 450 --top 25

Builds the full-size CosyVoice3 flow with random weights, runs `decode_chunks` on a batch of
`--batch` chunks whose windows are `--frames` mel frames (bf16 on CUDA, as the audio stage runs
it; `--autocast`: float32 weights under bf16 autocast, the stage's mode before
`engine.flow_dtype`), once to warm up, then once under the profiler, and prints the CUDA kernels
by total time, grouped into families (GEMM, attention, elementwise, normalisation, copies),
plus the achieved model FLOP/s of the solve.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections import defaultdict

import torch

from bench.flops import _flow_row_flops
from engine.models import flow as flow_mod
from engine.models.config import ModelConfig
from engine.models.flow import FlowChunk

FAMILIES = (  # first match wins
    ("attention", ("fmha", "flash", "attention", "softmax", "cutlassF", "efficient", "sdpa")),
    # Before GEMM: cuDNN's implicit-GEMM convolutions carry "gemm"/"cutlass"/"xmma" too.
    ("conv", ("fprop", "convolve", "nchwToNhwc", "nhwcToNchw")),
    ("gemm", ("gemm", "cutlass", "sm90", "nvjet", "cublas", "xmma", "matmul")),
    ("norm", ("layer_norm", "LayerNorm")),
    ("copy/cat", ("copy", "cat", "Copy", "Memcpy", "Memset", "gather", "index")),
    ("elementwise", ("elementwise", "vectorized", "reduce", "unrolled")),
)


def family(name: str) -> str:
    for fam, keys in FAMILIES:
        if any(k in name for k in keys):
            return fam
    return "other"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--frames", type=int, default=450, help="window per chunk (prompt + context + new), even")
    p.add_argument("--prompt-frames", type=int, default=300)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--autocast", action="store_true", help="float32 weights under bf16 autocast (the old mode)")
    p.add_argument("--compile", action="store_true", help="torch.compile the DiT blocks (engine.flow_compile)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    cfg = ModelConfig.tiny() if args.tiny else ModelConfig()
    flow = flow_mod.init_random_(flow_mod.CausalMaskedDiffWithDiT(cfg.flow), 0).to(dev).eval()
    g = torch.Generator().manual_seed(0)
    row_flops = _flow_row_flops(flow, args.frames // 2, dev)
    look, tp = cfg.flow.pre_lookahead_len, args.prompt_frames // 2
    n = args.frames // 2
    chunks = [FlowChunk(tokens=torch.randint(0, cfg.flow.vocab_size, (n + look,), generator=g),
                        prompt_feat=torch.randn(2 * tp, 80, generator=g), embedding=torch.randn(192, generator=g),
                        num_prompt_tokens=tp, out_start=tp, finalize=False) for _ in range(args.batch)]
    amp: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
    if dev.type == "cuda" and args.autocast:
        amp = torch.autocast(dev.type, dtype=torch.bfloat16)
    elif dev.type == "cuda":
        flow.to(torch.bfloat16)
    if args.compile:
        flow.decoder.estimator.compile_blocks()

    def solve() -> None:
        with amp:
            flow.decode_chunks(chunks, streaming=True)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    solve()
    t = time.perf_counter()
    solve()
    wall = time.perf_counter() - t
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with torch.profiler.profile(activities=acts) as prof:
        solve()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA] if dev.type == "cuda" \
        else list(prof.key_averages())
    attr = "device_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    total = sum(getattr(e, attr) for e in events) or 1.0
    fams: dict[str, float] = defaultdict(float)
    for e in events:
        fams[family(e.key)] += getattr(e, attr)
    flops = args.batch * row_flops
    mode = ("autocast" if args.autocast else str(next(flow.parameters()).dtype)) + (" compiled" if args.compile else "")
    report = {"mode": mode, "batch": args.batch, "frames": args.frames, "wall_ms": 1e3 * wall,
              "kernel_ms": total / 1e3, "model_tflops": flops / 1e12, "achieved_tflops_s": flops / wall / 1e12,
              "families_pct": {k: round(100 * v / total, 1) for k, v in sorted(fams.items(), key=lambda kv: -kv[1])}}
    print(json.dumps(report))
    for e in sorted(events, key=lambda e: -getattr(e, attr))[: args.top]:
        print(f"{100 * getattr(e, attr) / total:5.1f}%  {getattr(e, attr) / 1e3:8.1f} ms  x{e.count:<6d} {e.key[:110]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
