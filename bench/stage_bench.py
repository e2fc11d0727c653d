"""Time the audio stage's two halves (flow DiT, HiFT vocoder) at the full model size.

    python -m bench.stage_bench --device cuda --batches 1,8,32,64 --json out.json

Flow: `decode_chunks` on the engine's typical window: `--prompt-tokens` prompt +
`--context-tokens` left context + `--new-tokens` new tokens + 3 lookahead (rows after the
first get 5 or 10 fewer new tokens, so batches are ragged like the stage's), under bf16
weights and activations as `AudioStage` runs it on CUDA (`engine.flow_dtype`; `--autocast` runs
the previous mode instead: float32 weights under bf16 autocast; `--compile` compiles the DiT
blocks, `engine.flow_compile`). Per batch size it reports

* `flow_eager_ms`: eager, unpadded (the stage without graphs);
* `flow_graph_ms`: through `FlowGraphRunner` (CUDA graphs, padded to the bucket), and
  `graph_first_ms`, the first call (warm-up + capture + replay);
* `graph_vs_padded_max_abs`: graph vs the eager solve at the same padded shape (same
  kernels: expected 0 or close);
* `graph_vs_eager_max_abs` / `_rel`: graph vs unpadded eager (bf16 kernel-choice noise);
* on the `--check-batches` rows (prompt 7 tokens longer, so frames and rows both get
  padded): the same checks, plus float32 graphs vs float32 eager.

The run exits with status 1 if a bf16 graph result is off by more than `--tol-abs` (max
abs) or `--tol-rel` (relative norm) from the eager solve at its padded shape, or by more
than `--tol-rel` from the plain eager result. `--fp32` adds the float32 eager time and the bf16-vs-fp32 difference.

`--prompt-cache` also times the flow prompt cache (`engine.flow_prompt_cache`, bf16 on
CUDA): `prompt_cache_build_ms` (building the voice's entry once, outside the timings),
`flow_cached_ms` (decoding from the cache, eager), `cached_frames` (frames per row the
ODE ran at, vs `frames_per_chunk`), `cached_speedup` (eager / cached),
`cached_vs_eager_max_abs` / `_rel`, and with `--graphs` `flow_cached_graph_ms` (the cache
through the graph runner: the bench's batches are one voice, so a CUDA graph up to
`shared_prefix_max_rows` rows) and
`cached_graph_vs_eager_rel`; on the first batch also float32 cached vs float32
eager (`fp32_cached_vs_eager_max_abs`). The run exits with status 1 if the cached result
is off by more than `--tol-rel` (relative norm) from eager, or the float32 one by more
than `--tol-cache-fp32` (max abs).
Vocoder: one `stream_step` of the new tokens' mel frames per stream. Random weights
(`init_random_`); times are medians of `--reps` after one warm-up call.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from engine.flow_graphs import FlowGraphRunner, GraphPolicy
from engine.flow_prompt_cache import PromptCache, decode_with_prompt_cache
from engine.models import flow as flow_mod
from engine.models import hift as hift_mod
from engine.models.config import ModelConfig
from engine.models.flow import FlowChunk


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median seconds of `reps` calls after one warm-up call (reps=0: just the one call, nan)."""
    fn()  # warm-up (kernel selection, allocator, graph capture)
    if reps == 0:
        return float("nan")
    times = []
    for _ in range(reps):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def max_abs(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b))


def rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    x, y = torch.cat([m.float() for m in a]), torch.cat([m.float() for m in b])
    return float((x - y).norm() / y.norm())


@torch.inference_mode()
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--check-batches", default="3,13",
                   help="extra batch sizes, with 7 more prompt tokens, only checked graph vs eager (row and frame padding)")
    p.add_argument("--prompt-tokens", type=int, default=150)
    p.add_argument("--context-tokens", type=int, default=50)
    p.add_argument("--new-tokens", type=int, default=25)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="time the CUDA-graph runner too (default: on CUDA)")
    p.add_argument("--fp32", action="store_true", help="also time float32 eager")
    p.add_argument("--tol-abs", type=float, default=5e-2, help="graph vs eager at the same padded shape, max abs")
    p.add_argument("--tol-rel", type=float, default=2e-2, help="graph vs eager (padded and unpadded), relative norm")
    p.add_argument("--prompt-cache", action="store_true", help="also time the flow prompt K/V cache (see above)")
    p.add_argument("--tol-cache-fp32", type=float, default=1e-3, help="float32 cached vs eager, max abs")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--compile", action="store_true", help="torch.compile the DiT blocks (engine.flow_compile)")
    p.add_argument("--autocast", action="store_true",
                   help="bf16 autocast over float32 weights (the stage's mode before engine.flow_dtype)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    graphs = (dev.type == "cuda") if args.graphs is None else args.graphs
    cfg = ModelConfig.tiny() if args.tiny else ModelConfig()
    flow = flow_mod.init_random_(flow_mod.CausalMaskedDiffWithDiT(cfg.flow), 0).to(dev).eval()
    hift = hift_mod.init_random_(hift_mod.CausalHiFTGenerator(cfg.hift), 0).to(dev).eval()
    g = torch.Generator().manual_seed(0)
    tp, tc = args.prompt_tokens, args.context_tokens
    look = cfg.flow.pre_lookahead_len
    prompt = (torch.randint(0, cfg.flow.vocab_size, (tp,), generator=g), torch.randn(2 * tp, 80, generator=g),
              torch.randn(192, generator=g))
    bf16 = torch.bfloat16 if dev.type == "cuda" else None
    # The stage's bf16 mode: a bf16 copy of the flow, no autocast (or, with --autocast,
    # the fp32 flow under bf16 autocast, the mode before engine.flow_dtype).
    low = flow if (bf16 is None or args.autocast) else copy.deepcopy(flow).to(bf16)
    if args.compile:  # engine.flow_compile: the low-precision flow's DiT blocks
        if low is flow:  # --autocast: keep the float32 reference runs uncompiled
            low = copy.deepcopy(flow)
        low.decoder.estimator.compile_blocks()

    def flow_for(dtype: torch.dtype | None) -> flow_mod.CausalMaskedDiffWithDiT:
        return flow if dtype is None else low

    odd = (torch.randint(0, cfg.flow.vocab_size, (tp + 7,), generator=g), torch.randn(2 * (tp + 7), 80, generator=g),
           torch.randn(192, generator=g))

    def chunk(i: int, voice: tuple[torch.Tensor, ...] = prompt) -> FlowChunk:
        new = max(1, args.new_tokens - 5 * (i % 3))
        toks = torch.randint(0, cfg.flow.vocab_size, (tc + new + look,), generator=g)
        n_prompt = len(voice[0])
        return FlowChunk(tokens=torch.cat((voice[0], toks)), prompt_feat=voice[1], embedding=voice[2],
                         num_prompt_tokens=n_prompt, out_start=n_prompt + tc, finalize=False,
                         noise_offset=2 * 25 * (i % 4))

    def autocast(dtype: torch.dtype | None) -> contextlib.AbstractContextManager[object]:
        on = dtype is not None and args.autocast
        return torch.autocast(dev.type, dtype=dtype) if on else contextlib.nullcontext()

    amp = bf16 if args.autocast else None

    policy = GraphPolicy()
    # Off CUDA, --graphs runs the runner's padded static-buffer path without capture (a smoke test).
    runner = FlowGraphRunner(low.decoder, policy, autocast_dtype=amp, capture=dev.type == "cuda") if graphs else None
    padded_eager = FlowGraphRunner(low.decoder, policy, autocast_dtype=amp, capture=False)
    runner32 = FlowGraphRunner(flow.decoder, policy, capture=dev.type == "cuda") if graphs else None
    rows, failed = [], False
    plan = [(int(x), True) for x in args.batches.split(",") if x]
    if runner is not None:
        plan += [(int(x), False) for x in args.check_batches.split(",") if x]
    for b, timing in plan:
        chunks = [chunk(i) if timing else chunk(i, odd) for i in range(b)]
        reps = args.reps if timing else 0
        outs: dict[str, list[torch.Tensor]] = {}
        shapes: dict[str, flow_mod.FlowBatchShape] = {}

        def run(name: str, dtype: torch.dtype | None, solver: FlowGraphRunner | None = None) -> Callable[[], object]:
            def fn() -> object:
                with autocast(dtype):
                    out, shape = flow_for(dtype).decode_chunks(chunks, solver=solver)
                outs[name], shapes[name] = out, shape
                return out
            return fn

        row: dict[str, object] = {"batch": b, "timed": timing,
                                   "frames_per_chunk": 2 * (len(chunks[0].tokens) - look)}
        row["flow_eager_ms"] = 1e3 * timed(run("eager", bf16), dev, reps)
        if args.fp32 and timing:
            row["flow_fp32_ms"] = 1e3 * timed(run("fp32", None), dev, args.reps)
            row["bf16_vs_fp32_rel"] = rel(outs["eager"], outs["fp32"])
        if args.prompt_cache and timing:
            ok = time_prompt_cache(flow, low, chunks, row, outs, bf16, dev, args, runner, fp32_check=not any(
                r.get("timed") and "flow_cached_ms" in r for r in rows))
            row["cached_ok"] = ok
            failed |= not ok
        if runner is not None:
            fn = run("graph", bf16, runner)
            sync(dev)
            t = time.perf_counter()
            fn()
            sync(dev)
            row["graph_first_ms"] = 1e3 * (time.perf_counter() - t)
            row["flow_graph_ms"] = 1e3 * timed(fn, dev, reps)
            row["padded_shape"] = [shapes["graph"].rows, shapes["graph"].frames]
            run("padded_eager", bf16, padded_eager)()
            row["graph_vs_padded_max_abs"] = max_abs(outs["graph"], outs["padded_eager"])
            row["graph_vs_padded_rel"] = rel(outs["graph"], outs["padded_eager"])
            row["graph_vs_eager_max_abs"] = max_abs(outs["graph"], outs["eager"])
            row["graph_vs_eager_rel"] = rel(outs["graph"], outs["eager"])
            if timing:
                row["speedup"] = row["flow_eager_ms"] / row["flow_graph_ms"]  # type: ignore[operator]
            if not timing and runner32 is not None:
                # float32 graphs on the padding-check batches: padding exactness without bf16 noise.
                run("graph32", None, runner32)()
                run("eager32", None)()
                row["fp32_graph_vs_eager_max_abs"] = max_abs(outs["graph32"], outs["eager32"])
                row["fp32_graph_vs_eager_rel"] = rel(outs["graph32"], outs["eager32"])
            ok = (row["graph_vs_padded_max_abs"] <= args.tol_abs  # type: ignore[operator]
                  and row["graph_vs_padded_rel"] <= args.tol_rel and row["graph_vs_eager_rel"] <= args.tol_rel)  # type: ignore[operator]
            row["graph_ok"] = ok
            failed |= not ok
        if not timing:
            rows.append(row)
            print(json.dumps(row), flush=True)
            continue
        mels = [m.float().T.contiguous() for m in outs["eager"]]

        def voc() -> object:
            streams = [hift.new_stream() for _ in range(b)]
            return hift.stream_step(streams, mels, [False] * b)
        row["hift_ms"] = 1e3 * timed(voc, dev, args.reps)
        row["audio_s_per_chunk"] = mels[0].shape[1] / 50.0
        rows.append(row)
        print(json.dumps(row), flush=True)
    report: dict[str, object] = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                                 "torch": torch.__version__, "rows": rows}
    if runner is not None:
        report["graphs"] = vars(runner.stats) | {"num_graphs": runner.num_graphs}
        if dev.type == "cuda":
            report["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
        print(json.dumps({k: v for k, v in report.items() if k != "rows"}), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    if failed:
        print("FAIL: CUDA-graph or prompt-cache output differs from eager beyond tolerance", file=sys.stderr)
        return 1
    return 0


def time_prompt_cache(flow: flow_mod.CausalMaskedDiffWithDiT, low: flow_mod.CausalMaskedDiffWithDiT,
                      chunks: list[FlowChunk], row: dict[str, object],
                      outs: dict[str, list[torch.Tensor]], dtype: torch.dtype | None, dev: torch.device,
                      args: argparse.Namespace, runner: FlowGraphRunner | None, fp32_check: bool) -> bool:
    """Fill `row` with the prompt cache's figures for this batch (`outs["eager"]` is the
    reference; `low` is the flow in the stage's low precision); returns whether it matched
    within the tolerances."""
    def autocast(dt: torch.dtype | None) -> contextlib.AbstractContextManager[object]:
        on = dt is not None and args.autocast
        return torch.autocast(dev.type, dtype=dt) if on else contextlib.nullcontext()

    def flow_for(dt: torch.dtype | None) -> flow_mod.CausalMaskedDiffWithDiT:
        return flow if dt is None else low

    def build(dt: torch.dtype | None) -> tuple[PromptCache, list[object]]:
        cache = PromptCache()
        with autocast(dt):
            entries = cache.entries_for(flow_for(dt), chunks)
        return cache, entries

    sync(dev)
    t = time.perf_counter()
    cache, entries = build(dtype)
    sync(dev)
    row["prompt_cache_build_ms"] = 1e3 * (time.perf_counter() - t)
    row["prompt_cache_frames"] = max((e.frames for e in entries if e is not None), default=0)
    row["prompt_cache_mib"] = cache.nbytes / 2**20
    got: dict[str, object] = {}

    def fn() -> object:
        with autocast(dtype):
            got["out"], got["shape"] = decode_with_prompt_cache(flow_for(dtype), chunks, entries)  # type: ignore[arg-type]
        return got["out"]

    row["flow_cached_ms"] = 1e3 * timed(fn, dev, args.reps)
    row["cached_frames"] = got["shape"].frames  # type: ignore[attr-defined]
    row["cached_speedup"] = row["flow_eager_ms"] / row["flow_cached_ms"]  # type: ignore[operator]
    row["cached_vs_eager_max_abs"] = max_abs(got["out"], outs["eager"])  # type: ignore[arg-type]
    row["cached_vs_eager_rel"] = rel(got["out"], outs["eager"])  # type: ignore[arg-type]
    ok = row["cached_vs_eager_rel"] <= args.tol_rel  # type: ignore[operator]
    if runner is not None:
        # The cached prefixes through the graph runner (static prefix buffers, one voice; a
        # graph when the batch fits shared_prefix_max_rows, eagerly otherwise).
        def graph_fn() -> object:
            with autocast(dtype):
                got["gout"], got["gshape"] = decode_with_prompt_cache(  # type: ignore[arg-type]
                    flow_for(dtype), chunks, entries, solver=runner)
            return got["gout"]

        graph_fn()  # capture
        row["flow_cached_graph_ms"] = 1e3 * timed(graph_fn, dev, args.reps)
        row["cached_graph_shape"] = [got["gshape"].rows, got["gshape"].frames]  # type: ignore[attr-defined]
        row["cached_graph_vs_eager_rel"] = rel(got["gout"], outs["eager"])  # type: ignore[arg-type]
        ok = ok and row["cached_graph_vs_eager_rel"] <= args.tol_rel  # type: ignore[operator]
    if fp32_check:
        _, entries32 = build(None)
        cached32, _ = decode_with_prompt_cache(flow, chunks, entries32)  # type: ignore[arg-type]
        eager32, _ = flow.decode_chunks(chunks)
        row["fp32_cached_vs_eager_max_abs"] = max_abs(cached32, eager32)
        ok = ok and row["fp32_cached_vs_eager_max_abs"] <= args.tol_cache_fp32  # type: ignore[operator]
    return bool(ok)


if __name__ == "__main__":
    sys.exit(main())
