"""What sizing one first chunk costs the event loop (`FirstChunkPlanner.first_hop`).

    python -m bench.plan_cost [--reps 200]

The planner runs on the gateway's event loop once per utterance, and a burst of N sessions
plans N first chunks within a few LM steps of each other: on the H200 (round 19 of
docs/benchmarks.md) the loop lagged over 100 ms in 1-2% of its samples at 64 sessions.
This times one decision against round times like a warmed stage's (`RoundTimes` filled with
7 batches at each of 18 sizes, 1-64 rows x 50-500 frames) through the engine's own
`estimate_round` and graph policy, for a light load (one session: the 6-token first chunk
plays through at once) and for a burst (64 sessions, 12 ms a token: every hop from 6 up to
the first that plays through is tried). Prints the milliseconds per decision and the round
predictions it asked for.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from typing import Any

from engine.chunking import ChunkSchedule
from engine.config import EngineConfig
from engine.first_chunk import FirstChunkPlanner, RoundTimes
from engine.flow_graphs import GraphPolicy
from engine.token2wav import estimate_round

PROMPT_TOKENS = 106  # the load benchmark's 4.25 s voice
CACHED_FRAMES = 200  # its cached prompt frames (`cacheable_frames`)


def warmed_rounds(seed: int = 0) -> RoundTimes:
    rounds, rng = RoundTimes(), random.Random(seed)
    for rows in (1, 2, 4, 8, 16, 32, 64):
        for frames in (50, 100, 150, 200, 300, 400, 500):
            for _ in range(7):
                work = rows * frames
                rounds.observe(work, 0.02 + 1e-5 * work * rng.uniform(0.9, 1.1))
    return rounds


def one(rounds: RoundTimes, live: int, step_s: float, reps: int, initial_hop: int = 6,
        min_hop: int = 0) -> dict[str, Any]:
    policy = GraphPolicy()
    asked = 0

    def round_s(offset: int, hop: int) -> float | None:
        nonlocal asked
        asked += 1
        frames = 2 * (PROMPT_TOKENS + offset + hop) - CACHED_FRAMES  # no left-context cut: an upper bound
        return estimate_round(rounds, live, 64, policy, frames, CACHED_FRAMES)

    planner = FirstChunkPlanner(limit=40, margin=0.5, holdback_s=0.16, min_hop=min_hop)
    hop = 0
    start = time.perf_counter()
    for _ in range(reps):
        schedule = ChunkSchedule(prompt_tokens=PROMPT_TOKENS, initial_hop=initial_hop, max_hop=EngineConfig.max_hop)
        hop = planner.first_hop(schedule, step_s, round_s, 1.0)
    per = (time.perf_counter() - start) / reps
    return {"sessions": live, "lm_step_ms": step_s * 1e3, "first_hop": hop, "ms_per_plan": round(per * 1e3, 4),
            "round_predictions_per_plan": asked / reps}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--initial-hop", type=int, default=6, help="the floor (EngineConfig.initial_hop)")
    ap.add_argument("--min-hop", type=int, default=0, help="EngineConfig.first_chunk_min_hop")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rounds = warmed_rounds()
    hops = {"initial_hop": args.initial_hop, "min_hop": args.min_hop}
    out = {"sizes": len(rounds.sizes), **hops, "results": [one(rounds, 1, 0.0035, args.reps, **hops),
                                                           one(rounds, 64, 0.012, args.reps, **hops)]}
    for r in out["results"]:
        print(f"{r['sessions']:3d} sessions, {r['lm_step_ms']:.1f} ms a token: first hop {r['first_hop']}, "
              f"{r['ms_per_plan']:.3f} ms a decision ({r['round_predictions_per_plan']:.0f} round predictions)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.exit(0)
