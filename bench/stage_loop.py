"""The audio stage's own loop under a steady load, with pipelined rounds or without.

    python -m bench.stage_loop --device cuda --streams 4,16 --steps 12 --leads 0,5 --reps 2 --json out.json

`bench.stage_syncs` times `AudioStage._compute`, one round at a time: it cannot show rounds
overlapping (`engine.stage_pipeline_lead_ms`). This bench runs the stage as the engine does:
`--streams` utterances each queue their next chunk as soon as the stage has taken the one
before (`ChunkJob.started`), `--steps` chunks each, shaped as `stage_syncs` shapes them
(`make_batch`), and the stage's loop batches them. Per (streams, lead), `--reps` times, the
lead set on the same stage (`AudioStage.tune`), leads alternating:

* `wall_ms`: from the first chunk queued to the last one's audio;
* `chunks_per_s`, `rounds` and `rows_per_round`;
* `busy_share`: the stage's busy time over the wall (`StageStats.busy_seconds`);
* `pcm_rel_rms`: each run's audio against the first lead's first run at that size, relative
  RMS over all its utterances (batches form by timing: a row's bucket, and so its kernels,
  may differ between runs).

Each size runs once more before its measured runs, untimed, for its graph captures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.stage_syncs import add_stage_arguments, config_overrides, load_stage_model, make_batch
from engine.config import EngineConfig
from engine.stage_pool import build_stage
from engine.token2wav import AudioStage, ChunkJob


async def run_level(stage: AudioStage, prompt: tuple[torch.Tensor, ...], streams: int, steps: int,
                    lead_ms: float) -> tuple[dict[str, Any], list[np.ndarray]]:
    """One load: `streams` new utterances of `steps` chunks each through the stage's loop;
    its figures and each utterance's audio."""
    stage.tune({"pipeline_lead_ms": lead_ms})
    handles = [stage.new_stream() for _ in range(streams)]
    jobs = [make_batch(stage, handles, prompt, step) for step in range(steps)]  # [step][utterance]
    st = stage.stats
    batches0, chunks0, busy0 = st.batches, st.chunks, st.busy_seconds

    async def utterance(i: int) -> np.ndarray:
        futures = []
        for step in range(steps):
            job: ChunkJob = jobs[step][i]
            futures.append(stage.submit(job))
            await job.started  # as the engine does: the next chunk is queued once this one is taken
        return np.concatenate([await f for f in futures])

    t0 = time.perf_counter()
    pcm = await asyncio.gather(*(utterance(i) for i in range(streams)))
    wall = time.perf_counter() - t0
    rounds = st.batches - batches0
    return ({"streams": streams, "lead_ms": lead_ms, "wall_ms": 1e3 * wall,
             "chunks_per_s": (st.chunks - chunks0) / wall, "rounds": rounds,
             "rows_per_round": (st.chunks - chunks0) / max(rounds, 1),
             "busy_share": (st.busy_seconds - busy0) / wall}, list(pcm))


def rel_rms(got: list[np.ndarray], ref: list[np.ndarray]) -> float:
    """Relative RMS difference over all utterances' samples."""
    a, b = np.concatenate(got).astype(np.float64), np.concatenate(ref).astype(np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2)) / max(np.sqrt(np.mean(b ** 2)), 1e-12))


async def run(stage: AudioStage, prompt: tuple[torch.Tensor, ...], sizes: list[int], steps: int,
              leads: list[float], reps: int, json_out: Path | None, report: dict[str, Any]) -> None:
    await stage.start()
    try:
        for streams in sizes:
            await run_level(stage, prompt, streams, steps, leads[0])  # warm-up: its captures, the allocator
            ref: list[np.ndarray] | None = None
            for rep in range(reps):
                for lead in leads:
                    r, pcm = await run_level(stage, prompt, streams, steps, lead)
                    ref = pcm if ref is None else ref
                    r["rep"], r["pcm_rel_rms"] = rep, rel_rms(pcm, ref)
                    report["results"].append(r)
                    print(f"{streams:4d} streams lead {lead:g} ms: wall {r['wall_ms']:.1f} ms, "
                          f"{r['chunks_per_s']:.1f} chunks/s, {r['rounds']} rounds of {r['rows_per_round']:.1f}, "
                          f"busy {100 * r['busy_share']:.0f}%, pcm rel rms {r['pcm_rel_rms']:.2e}", flush=True)
                    if json_out:
                        json_out.write_text(json.dumps(report, indent=2))
    finally:
        await stage.close()
    for streams in sizes:  # the ratio of medians, each lead against the first
        base = statistics.median(r["wall_ms"] for r in report["results"]
                                 if r["streams"] == streams and r["lead_ms"] == leads[0])
        for lead in leads[1:]:
            wall = statistics.median(r["wall_ms"] for r in report["results"]
                                     if r["streams"] == streams and r["lead_ms"] == lead)
            report["ratios"].append({"streams": streams, "lead_ms": lead, "wall_vs_first_lead": wall / base})
            print(f"{streams:4d} streams: lead {lead:g} ms takes {wall / base:.3f}x the wall of lead {leads[0]:g}",
                  flush=True)
    if json_out:
        json_out.write_text(json.dumps(report, indent=2))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_stage_arguments(p, "flow_compile=false")
    p.add_argument("--streams", default="4,16", help="utterances at once, per level (comma-separated)")
    p.add_argument("--steps", type=int, default=12, help="chunks per utterance")
    p.add_argument("--leads", default="0,5", help="pipeline leads in ms, alternating on one stage (0: off)")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    device, model_dir, model = load_stage_model(args)
    overrides = config_overrides(args.config)
    stage = build_stage(model, device, EngineConfig(model_dir=model_dir, device=args.device, **overrides))
    assert isinstance(stage, AudioStage)
    g = torch.Generator().manual_seed(0)
    n = args.prompt_tokens
    prompt = (torch.randint(0, 6561, (n,), generator=g), torch.randn(2 * n, 80, generator=g) * 2 - 5,
              torch.randn(192, generator=g))
    report: dict[str, Any] = {"device": str(device), "config": overrides, "prompt_tokens": n, "steps": args.steps,
                              "results": [], "ratios": []}
    sizes = [int(s) for s in args.streams.split(",")]
    leads = [float(x) for x in args.leads.split(",")]
    asyncio.run(run(stage, prompt, sizes, args.steps, leads, args.reps, args.json, report))
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
