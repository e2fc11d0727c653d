"""The audio stage with and without the flow context cache, over whole utterances.

    python -m bench.context_bench --device cuda --rows 16,32,64 --json out.json

Builds the stage the engine builds (`engine.build_stage`: bf16 flow, compiled DiT, CUDA
graphs, prompt cache; `--config k=v` changes an EngineConfig field) on a full-size random
model, with a context cache of `--cache-mib`. For each row count N it decodes N utterances of
`--tokens` speech tokens in lockstep, the way the engine chunks them (first chunk
`--initial-hop` tokens, then to the 25-token grid, then 50, 100, ..., left context
`flow_left_context`): round k is one stage batch of every utterance's k-th chunk (flow,
vocoder, PCM to the host). It runs the utterances once to warm up, then times them with the
cache off and on (two stages on the same modules), alternating `--reps` times. Per mode: each round's wall time, the total, and
the flow frames computed (rows x padded frames).

`--check`: two utterances, the cache's ring as long as the utterance (flow_left_context 1000)
against the recomputed whole prefix (flow_left_context -1, no cache), on this device and dtype:
the relative RMS difference of their PCM (0 up to rounding; the CPU tests show it exactly).

`--ab FIELD=VALUE` (repeatable): the same timing of any other stage option instead: "off" is
the stage without these EngineConfig fields, "on" with them, the context cache off in both
(e.g. `--ab flow_prompt_cache=false`); no `--check` then.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.stage_syncs import add_stage_arguments, config_overrides, kernel_table, load_stage_model
from engine.chunking import ChunkSchedule
from engine.config import EngineConfig
from engine.stage_pool import build_stage
from engine.models.flow import FlowChunk
from engine.models.loader import LoadedModel
from engine.stage_profile import kernel_intervals, union_within
from engine.token2wav import AudioStage, ChunkJob

LOOK = 3


def utterance_chunks(prompt: tuple[torch.Tensor, ...], speech: torch.Tensor, initial_hop: int, max_hop: int,
                     left: int) -> list[FlowChunk]:
    """The FlowChunks the engine cuts from one utterance (`Utterance._flow_chunk`)."""
    tokens, feat, emb = prompt
    p, total = int(tokens.numel()), int(speech.numel())
    s = ChunkSchedule(prompt_tokens=p, initial_hop=initial_hop, max_hop=max_hop, lookahead=LOOK)
    out = []
    while True:
        hop = s.ready(total)
        final = hop is None or s.offset + hop + LOOK > total
        end = total if final else s.offset + hop
        win = 0 if left < 0 else max(0, (s.offset - left) // 25 * 25)
        stop = end if final else end + LOOK
        out.append(FlowChunk(tokens=torch.cat((tokens, speech[win:stop])), prompt_feat=feat, embedding=emb,
                             num_prompt_tokens=p, out_start=p + s.offset - win, finalize=final, noise_offset=2 * win))
        if final:
            return out
        s.advance(end - s.offset)


def run_utterances(stage: AudioStage, chunks: list[list[FlowChunk]]) -> tuple[list[float], int, list[np.ndarray]]:
    """Every utterance's chunks in lockstep rounds; wall seconds per round, flow frames, PCM."""
    streams = [stage.new_stream() for _ in chunks]
    pcm: list[list[np.ndarray]] = [[] for _ in chunks]
    walls, frames = [], 0
    for k in range(max(len(c) for c in chunks)):
        rows = [i for i, c in enumerate(chunks) if k < len(c)]
        jobs = [ChunkJob(flow=chunks[i][k], hift_stream=streams[i], speed=1.0, chunk_index=k,
                         is_cancelled=lambda: False) for i in rows]
        t0 = time.perf_counter()
        out, work, _ = stage._compute(jobs)
        walls.append(time.perf_counter() - t0)
        frames += work
        for i, x in zip(rows, out):
            pcm[i].append(x)
    return walls, frames, [np.concatenate(p) for p in pcm]


def build(model: LoadedModel, device: torch.device, model_dir: Path, overrides: dict[str, Any]) -> AudioStage:
    stage = build_stage(model, device, EngineConfig(model_dir=model_dir, device=str(device), **overrides))
    assert isinstance(stage, AudioStage)
    return stage


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_stage_arguments(p, "flow_context_min_rows=1")
    p.add_argument("--rows", default="16,32,64")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--tokens", type=int, default=105, help="speech tokens per utterance (the load's segments: ~105)")
    p.add_argument("--initial-hop", type=int, default=8)
    p.add_argument("--cache-mib", type=int, default=24 << 10)
    p.add_argument("--kernels", type=int, default=0, metavar="N",
                   help="profile the last rep of each mode: GPU busy time and the N kernels with the most time")
    p.add_argument("--check", action="store_true", help="also compare an unbounded ring with the whole prefix")
    p.add_argument("--ab", action="append", default=[], metavar="FIELD=VALUE",
                   help="compare the stage without these EngineConfig fields (off) against with them (on), the "
                        "context cache off in both, instead of the context cache off against on")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    ab = config_overrides(args.ab)
    for shared in ("flow_attention", "flow_attention_rotary"):
        if shared in ab:
            # The kernel is the shared DiT's (`DiT.use_attention_kernel`): the second stage
            # built would set it for both. Two runs, one with --config FIELD=... each.
            p.error(f"--ab {shared}: both stages share the DiT; run twice, once with --config {shared}=...")
    device, model_dir, model = load_stage_model(args)
    # Two stages on the same modules (their own graphs): with the cache and without, or
    # without and with the --ab fields (and no cache).
    if ab:
        overrides: dict[str, Any] = {**config_overrides(args.config), "flow_context_cache_bytes": 0}
        stages = {False: build(model, device, model_dir, overrides),
                  True: build(model, device, model_dir, {**overrides, **ab})}
    else:
        overrides = {"flow_context_cache_bytes": args.cache_mib << 20, **config_overrides(args.config)}
        stages = {True: build(model, device, model_dir, overrides),
                  False: build(model, device, model_dir, {**overrides, "flow_context_cache_bytes": 0})}
    config = EngineConfig(model_dir=model_dir, **{k: v for k, v in overrides.items()})
    g = torch.Generator().manual_seed(0)
    n = args.prompt_tokens
    prompt = (torch.randint(0, 6561, (n,), generator=g), torch.randn(2 * n, 80, generator=g) * 2 - 5,
              torch.randn(192, generator=g))
    report: dict[str, Any] = {"device": str(device), "config": {k: v for k, v in overrides.items()},
                              "ab": ab, "tokens": args.tokens, "prompt_tokens": n, "results": []}
    ctx = stages[True].context_cache
    assert ab or ctx is not None, "the context cache needs the prompt cache and the CosyVoice3 flow"

    def once(chunks: list[list[FlowChunk]], on: bool) -> tuple[list[float], int, list[np.ndarray]]:
        return run_utterances(stages[on], chunks)

    for rows in (int(r) for r in args.rows.split(",")):
        speech = [torch.randint(0, 6561, (args.tokens,), generator=g) for _ in range(rows)]
        chunks = [utterance_chunks(prompt, s, args.initial_hop, config.max_hop, config.flow_left_context)
                  for s in speech]
        # Compile, graph captures, prompt cache entry; and the two modes' audio.
        warm = {on: once(chunks, on)[2] for on in (False, True)}
        runs: dict[str, list[tuple[list[float], int]]] = {"off": [], "on": []}
        profiles: dict[str, Any] = {}
        for rep in range(args.reps):
            for on in (False, True):
                mode = "on" if on else "off"
                if args.kernels and rep == args.reps - 1 and device.type == "cuda":
                    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                        walls, frames, _ = once(chunks, on)
                    busy = union_within(kernel_intervals(prof.events()), -math.inf, math.inf) / 1e3
                    table, families = kernel_table(prof.events(), 1, args.kernels)
                    profiles[mode] = {"gpu_busy_ms": busy, "wall_ms": 1e3 * sum(walls), "kernels": table,
                                      "families": families}
                else:
                    walls, frames, _ = once(chunks, on)
                runs[mode].append((walls, frames))
        r: dict[str, Any] = {"rows": rows, "chunks_per_utterance": len(chunks[0]),
                             "chunk_tokens": [c.out_start for c in chunks[0]], "profile": profiles,
                             "dynamo": {k: int(v) for k, v in torch._dynamo.utils.counters["stats"].items()}}
        for mode, got in runs.items():
            totals = [1e3 * sum(w) for w, _ in got]
            r[mode] = {"total_ms": statistics.fmean(totals), "totals_ms": totals,
                       "round_ms": [1e3 * statistics.fmean(x) for x in zip(*(w for w, _ in got))],
                       "flow_frames": got[0][1]}
        r["ratio_on_off"] = r["on"]["total_ms"] / r["off"]["total_ms"]
        if ab:  # an option meant to change only the speed changes the audio by rounding at most
            r["pcm_relative_rms"] = max(float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(a**2)))
                                        for a, b in zip(warm[False], warm[True]))
        if ctx is not None:
            r["context_reads"], r["context_records"] = ctx.reads, ctx.records
        report["results"].append(r)
        print(f"{rows:4d} utterances x {len(chunks[0])} chunks: off {r['off']['total_ms']:.0f} ms "
              f"({r['off']['flow_frames']} frames), on {r['on']['total_ms']:.0f} ms ({r['on']['flow_frames']} frames), "
              f"on/off {r['ratio_on_off']:.2f}", flush=True)
        if ab:
            print(f"      PCM relative RMS on vs off: {r['pcm_relative_rms']:.2e}", flush=True)
        print("      rounds off: " + " ".join(f"{x:.0f}" for x in r["off"]["round_ms"]), flush=True)
        print("      rounds on:  " + " ".join(f"{x:.0f}" for x in r["on"]["round_ms"]), flush=True)
        print(f"      dynamo: {r['dynamo']}", flush=True)
        for mode, prof in profiles.items():
            print(f"      {mode}: gpu busy {prof['gpu_busy_ms']:.0f} of {prof['wall_ms']:.0f} ms; "
                  + ", ".join(f"{k} {100 * v:.0f}%" for k, v in prof["families"].items()), flush=True)
            for k in prof["kernels"]:
                print(f"        {100 * k['share']:5.1f}% {k['ms']:7.2f} ms x{k['calls']:<6g} {k['kernel'][:80]}", flush=True)
        if args.json:
            args.json.write_text(json.dumps(report, indent=2))
    if args.check and ab:
        print("check: skipped (it compares the context cache, which --ab turns off)")
    elif args.check:
        speech = [torch.randint(0, 6561, (args.tokens,), generator=g) for _ in range(2)]
        exact_stage = build(model, device, model_dir, {**overrides, "flow_context_cache_bytes": 0,
                                                        "flow_left_context": -1})
        ring_stage = build(model, device, model_dir, {**overrides, "flow_left_context": 1000,
                                                       "flow_context_min_rows": 1})
        _, _, exact = run_utterances(exact_stage, [utterance_chunks(prompt, s, args.initial_hop, config.max_hop, -1)
                                                   for s in speech])
        _, _, kept = run_utterances(ring_stage, [utterance_chunks(prompt, s, args.initial_hop, config.max_hop, 1000)
                                                 for s in speech])
        rel = [float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(a**2))) for a, b in zip(exact, kept)]
        report["check_relative_rms"] = rel
        print("check: PCM relative RMS, unbounded ring vs whole prefix: " + ", ".join(f"{x:.2e}" for x in rel))
        if args.json:
            args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
