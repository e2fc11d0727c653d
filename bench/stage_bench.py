"""Time the audio stage's two halves (flow DiT, HiFT vocoder) at the full model size.

    python -m bench.stage_bench --device cuda --batches 1,8,32 --json out.json

Flow: `inference_chunks` on chunks of `--prompt-tokens` prompt + `--new-tokens` tokens
(the engine's typical window: prompt + 50 left context + hop + lookahead), float32 vs
bf16 autocast (what `AudioStage` uses on CUDA), with the relative mel difference
between the two. Vocoder: one `stream_step` of `2 * --new-tokens` mel frames per
stream. Random weights (`init_random_`); times are medians of `--reps` after warm-up.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from engine.models import flow as flow_mod
from engine.models import hift as hift_mod
from engine.models.config import ModelConfig
from engine.models.flow import FlowChunk


def timed(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    fn()  # warm-up (kernel selection, allocator)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


@torch.inference_mode()
def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--prompt-tokens", type=int, default=125)
    p.add_argument("--new-tokens", type=int, default=150)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    cfg = ModelConfig.tiny() if args.tiny else ModelConfig()
    flow = flow_mod.CausalMaskedDiffWithDiT(cfg.flow)
    flow_mod.init_random_(flow, 0)
    flow = flow.to(dev).eval()
    hift = hift_mod.CausalHiFTGenerator(cfg.hift)
    hift_mod.init_random_(hift, 0)
    hift = hift.to(dev).eval()
    g = torch.Generator().manual_seed(0)
    tp, tn = args.prompt_tokens, args.new_tokens

    def chunk() -> FlowChunk:
        toks = torch.randint(0, cfg.flow.vocab_size, (tp + tn,), generator=g)
        return FlowChunk(tokens=toks.to(dev), prompt_feat=torch.randn(2 * tp, 80, generator=g).to(dev),
                         embedding=torch.randn(192, generator=g).to(dev), num_prompt_tokens=tp,
                         out_start=tp, finalize=False)

    rows = []
    for b in [int(x) for x in args.batches.split(",")]:
        chunks = [chunk() for _ in range(b)]
        row: dict[str, float | int] = {"batch": b, "frames_per_chunk": 2 * (tp + tn - cfg.flow.pre_lookahead_len)}
        outs = {}
        for name, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
            def run(dtype: torch.dtype | None = dtype) -> object:
                ctx = torch.autocast(dev.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()
                with ctx:
                    out = flow.inference_chunks(chunks)
                outs[name] = out
                return out
            row[f"flow_{name}_ms"] = 1e3 * timed(run, dev, args.reps)
        a, c = torch.cat([m.float() for m in outs["fp32"]]), torch.cat([m.float() for m in outs["bf16"]])
        row["bf16_rel_diff"] = float((a - c).norm() / a.norm())
        mels = [m.float().T.contiguous() for m in outs["fp32"]]

        def voc() -> object:
            streams = [hift.new_stream() for _ in range(b)]
            return hift.stream_step(streams, mels, [False] * b)
        row["hift_ms"] = 1e3 * timed(voc, dev, args.reps)
        row["audio_s_per_chunk"] = mels[0].shape[1] / 50.0
        rows.append(row)
        print(json.dumps(row), flush=True)
    report = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
              "torch": torch.__version__, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
