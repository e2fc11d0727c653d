"""The first audio a burst's sessions could get at best, by the planner's own timeline.

    python -m bench.first_audio_floor docs/bench/ws_load_r21_mps_hold015.json --level 3 \\
        [--stage-speedup 1,1.5,2,3] [--lm-speedup 1,2]

Takes one level of a `bench.ws_load` JSON: the stage's round times the gateway had learnt by
its end (`server.planner.round_times`), the vocoder's holdback and the planner's margin, the
sessions' opening LM timings (`opening_chunk_phases_ms`) and vLLM's rate over the level
(`lm_server_ms.decode_per_token`), and the gateway's flags (graph buckets, hops, left
context) as the run had them (its first chunk's bounds, and how far below its floor the
planner could go, from the planner's snapshot). For
every first hop it asks the engine's own functions
(`first_chunk.stalls`, `token2wav.estimate_round`, `chunking.chunk_frames`) whether a burst of
that level's sessions would play through without running dry, and what its first audio
would be:

    first audio = LM first token + (hop + lookahead - 1) x opening LM step + opening round

with the opening LM step the level's measured one (its first segments' LM decode over their
tokens) and the LM rate after the first chunk vLLM's level average (the stage shares the GPU
then). The floor is the least first audio of a hop that plays through with no margin; the
planner's choice is the hop its margin picks. The what-ifs divide the round times (a faster
stage) and the LM times (a faster LM): how much faster each has to be for a target.

A model, not a measurement: waits for the stage (rounds that pass first chunks over, the
hold) are left out, so the measured p50 lies above it. Its use is the lower bound and the
what-ifs. The planner's choice also takes what second chunks took (`SecondRounds`, where
the gateway learnt it and its flags keep it on) as the least a later round lasts.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from engine.chunking import ChunkSchedule, chunk_frames
from engine.config import EngineConfig
from engine.stage_build import graph_policy
from engine.first_chunk import TOKEN_S, RoundTimes, SecondRounds, plan_first_hop, shortest_as_safe, stalls
from engine.flow_prompt_cache import cacheable_frames
from engine.token2wav import estimate_round
from gateway.app import engine_config
from gateway.settings import load_settings

# The first chunk's floor (`initial_hop`) of runs whose planner snapshot does not carry it
# (before round 23) and whose flags did not set it: the default then.
LEGACY_INITIAL_HOP = 6
TOKEN_MEL_RATIO = 2  # CosyVoice2 and 3: two mel frames per speech token
LOOKAHEAD = 3  # the flow's pre_lookahead_len
BLOCK = 50  # the DiT's attention block (static_chunk_size)


@dataclass(frozen=True)
class Level:
    """What one load level measured, as the floor needs it."""

    sessions: int
    rounds: RoundTimes
    holdback_s: float
    margin: float
    first_token_s: float  # opening utterances' LM first token (mean)
    open_step_s: float  # their LM seconds a token up to the first chunk's last token
    later_step_s: float  # vLLM's seconds a token over the level
    measured_p50_ms: float
    measured_hop: float
    config: EngineConfig
    prompt_tokens: int
    # The least a later chunk's round lasts in the planner's eyes (`SecondRounds` for the
    # level's sessions), None where nothing was learnt or the run turned it off.
    second_round_s: float | None = None
    # How far below its floor the planner could go (`first_chunk_min_hop`; 0: not at all),
    # and with how many others sizing theirs at most (`first_chunk_min_hop_crowd`).
    min_hop: int = 0
    min_hop_crowd: int = 4


def rounds_from_snapshot(points: list[dict[str, float]]) -> RoundTimes:
    """A `RoundTimes` that predicts as the snapshotted one did: each size's median, as
    often as it was measured."""
    rounds = RoundTimes()
    for p in points:
        for _ in range(int(p["batches"])):
            rounds.observe(int(p["work"]), float(p["wall_s"]))
    return rounds


def second_rounds_from_snapshot(octaves: dict[str, dict[str, float]]) -> SecondRounds:
    """A `SecondRounds` that predicts as the snapshotted one did (its octaves' medians)."""
    table = SecondRounds()
    for streams, seen in octaves.items():
        for _ in range(int(seen["utterances"])):
            table.observe(int(streams), float(seen["round_s"]))
    return table


def load_level(path: Path, index: int) -> Level:
    data = json.loads(path.read_text())
    levels = data["results"]["product"]
    if not 0 <= index < len(levels):
        raise SystemExit(f"{path}: --level {index} is not one of its {len(levels)} product levels")
    level = levels[index]
    if "planner" not in level.get("server", {}):
        raise SystemExit(f"{path}: level {index} has no server.planner (bench.ws_load records it "
                         "since GET /debug/planner, round 21 of docs/benchmarks.md)")
    settings_doc = data["settings"]
    settings_doc = ast.literal_eval(settings_doc) if isinstance(settings_doc, str) else settings_doc
    flags = settings_doc.get("gateway_flags", [])
    settings, _ = load_settings(["--model", settings_doc.get("model") or "full-random", *flags], environ={})
    planner = level["server"]["planner"]
    # The run's first-chunk bounds as its gateway had them, not this build's defaults.
    first = planner.get("initial_hop", None if "--engine.initial-hop" in flags else LEGACY_INITIAL_HOP)
    config = engine_config(settings, Path("."))
    config = replace(config, initial_hop=int(first) if first is not None else config.initial_hop,
                     initial_hop_max=int(planner.get("limit", config.initial_hop_max)))
    opening = level["opening_chunk_phases_ms"]
    hop = float(opening["tokens"])
    prompt_s = float(settings_doc.get("voice", {}).get("prompt_seconds", 4.25))
    learnt = planner.get("second_rounds")
    second = (second_rounds_from_snapshot(learnt).predict(int(level["sessions"]))
              if learnt and config.first_chunk_second_rounds else None)
    return Level(
        sessions=int(level["sessions"]), rounds=rounds_from_snapshot(planner["round_times"]),
        holdback_s=float(planner["holdback_s"]), margin=float(planner["margin"]),
        first_token_s=opening["lm_first_token"] / 1e3,
        open_step_s=opening["lm_decode"] / 1e3 / max(1.0, hop + LOOKAHEAD - 1),
        later_step_s=level["lm_server_ms"]["decode_per_token"] / 1e3,
        measured_p50_ms=float(level["first_audio_ms"]["p50"]), measured_hop=hop, config=config,
        prompt_tokens=round(prompt_s / TOKEN_S), second_round_s=second,
        # A snapshot without min_hop predates the option (round 28): such runs never went
        # below their floor, whatever this build's default.
        min_hop=int(planner.get("min_hop", config.first_chunk_min_hop
                                if "--engine.first-chunk-min-hop" in flags else 0)),
        min_hop_crowd=int(planner.get("min_hop_crowd", config.first_chunk_min_hop_crowd)))


def floor(level: Level, stage_speedup: float = 1.0, lm_speedup: float = 1.0) -> dict[str, Any]:
    """Per first hop: predicted first audio and whether it plays through (no margin, and
    the level's margin); the floor and the planner's choice."""
    cfg, P = level.config, level.prompt_tokens
    cached = cacheable_frames(P, TOKEN_MEL_RATIO, LOOKAHEAD, BLOCK) if cfg.flow_prompt_cache else 0
    policy = graph_policy(cfg)

    def round_s(offset: int, hop: int) -> float | None:
        frames = chunk_frames(P, offset, hop, cfg.flow_left_context, TOKEN_MEL_RATIO, cached)
        one = estimate_round(level.rounds, level.sessions, cfg.max_gpu_batch, policy, frames, cached)
        return None if one is None else one / stage_speedup

    schedule = ChunkSchedule(prompt_tokens=P, initial_hop=cfg.initial_hop, max_hop=cfg.max_hop, lookahead=LOOKAHEAD)
    later = level.later_step_s / lm_speedup
    floor_s = None if level.second_round_s is None else level.second_round_s / stage_speedup
    rows = []
    lowest = min(cfg.initial_hop, level.min_hop) if level.min_hop > 0 else cfg.initial_hop
    for hop in range(lowest, max(cfg.initial_hop, cfg.initial_hop_max) + 1):
        first_round = round_s(0, hop) or 0.0
        audio = level.first_token_s / lm_speedup + (hop + LOOKAHEAD - 1) * level.open_step_s / lm_speedup + first_round
        rows.append({"hop": hop, "first_audio_ms": round(audio * 1e3, 1), "round_ms": round(first_round * 1e3, 1),
                     "plays_through": stalls(schedule, hop, later, round_s, level.holdback_s, margin=0.0) is False,
                     "with_margin": stalls(schedule, hop, later, round_s, level.holdback_s, margin=level.margin,
                                           later_round_s=floor_s) is False})
    through = [r for r in rows if r["plays_through"]]
    # A limit at or below the floor is a fixed first chunk (`FirstChunkPlanner.first_hop`).
    planned = cfg.initial_hop < cfg.initial_hop_max
    chosen = (plan_first_hop(schedule, cfg.initial_hop_max, later, round_s, level.holdback_s, margin=level.margin,
                             later_round_s=floor_s) if planned else cfg.initial_hop)
    # A burst: every other session sizes its first chunk too.
    if planned and 0 < level.min_hop < chosen and level.sessions - 1 < level.min_hop_crowd:
        chosen = shortest_as_safe(schedule, chosen, level.min_hop, later, round_s, level.holdback_s,
                                  margin=level.margin, later_round_s=floor_s)
    return {"stage_speedup": stage_speedup, "lm_speedup": lm_speedup, "rows": rows,
            "floor": min(through, key=lambda r: r["first_audio_ms"]) if through else None,
            "planner": next(r for r in rows if r["hop"] == chosen)}


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json_path", type=Path, help="a bench.ws_load JSON")
    ap.add_argument("--level", type=int, required=True, help="index into results.product")
    ap.add_argument("--stage-speedup", default="1,1.5,2,3", help="divide the round times by each")
    ap.add_argument("--lm-speedup", default="1,2", help="divide the LM times by each")
    ap.add_argument("--json", default=None, help="write the result here")
    args = ap.parse_args(argv)
    level = load_level(args.json_path, args.level)
    print(f"{level.sessions} sessions: measured first audio p50 {level.measured_p50_ms:.0f} ms with "
          f"{level.measured_hop:g}-token first chunks; LM first token {level.first_token_s * 1e3:.0f} ms, "
          f"{level.open_step_s * 1e3:.1f} ms a token to the first chunk, {level.later_step_s * 1e3:.1f} after; "
          f"holdback {level.holdback_s * 1e3:.0f} ms, margin {level.margin:g}")
    out: dict[str, Any] = {"source": str(args.json_path), "level": args.level, "sessions": level.sessions,
                           "measured_p50_ms": level.measured_p50_ms, "results": []}
    for lm in _floats(args.lm_speedup):
        for stage in _floats(args.stage_speedup):
            r = floor(level, stage, lm)
            out["results"].append(r)
            f, p = r["floor"], r["planner"]
            where = (f"floor {f['first_audio_ms']:.0f} ms at {f['hop']} tokens (round {f['round_ms']:.0f})"
                     if f else "no hop plays through")
            print(f"stage x{stage:g}, LM x{lm:g}: {where}; planner {p['first_audio_ms']:.0f} ms at {p['hop']} "
                  f"tokens (round {p['round_ms']:.0f})")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.exit(0)
