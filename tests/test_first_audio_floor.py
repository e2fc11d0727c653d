"""`bench.first_audio_floor`: the planner's timeline over a load level's learnt inputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.first_audio_floor import LOOKAHEAD, main


def _write_level(path: Path, wall_per_work_s: float, flags: list[str] | None = None,
                 second_rounds: dict[str, dict[str, float]] | None = None,
                 bounds: dict[str, int] | None = None) -> Path:
    """A `bench.ws_load` JSON with one 64-session level whose rounds take 20 ms plus
    `wall_per_work_s` per row x frame, at the sizes a burst meets."""
    rounds = [{"work": w, "wall_s": 0.02 + wall_per_work_s * w, "batches": 7, "predicted_s": 0.0}
              for w in (50, 100, 200, 400, 800, 1600, 3200, 3840, 6400, 9600, 12800, 19200)]
    settings = {"model": "full-random", "gateway_flags": flags or [], "voice": {"prompt_seconds": 4.25}}
    level = {"sessions": 64, "first_audio_ms": {"p50": 500.0},
             "opening_chunk_phases_ms": {"lm_first_token": 50.0, "lm_decode": 180.0, "tokens": 16.0},
             "lm_server_ms": {"decode_per_token": 13.0},
             "server": {"planner": {"holdback_s": 0.16, "margin": 0.5, "round_times": rounds}}}
    if second_rounds is not None:
        level["server"]["planner"]["second_rounds"] = second_rounds
    level["server"]["planner"].update(bounds or {})
    path.write_text(json.dumps({"settings": repr(settings), "results": {"product": [level]}}))
    return path


def test_the_floor_falls_with_a_faster_stage_or_lm(tmp_path: Path) -> None:
    src = _write_level(tmp_path / "level.json", 4e-5)
    out = main([str(src), "--level", "0", "--stage-speedup", "1,2", "--lm-speedup", "1,2",
                "--json", str(tmp_path / "out.json")])
    assert json.loads((tmp_path / "out.json").read_text())["sessions"] == 64
    by = {(r["stage_speedup"], r["lm_speedup"]): r for r in out["results"]}
    base = by[(1.0, 1.0)]
    assert base["floor"] is not None and base["floor"]["plays_through"]
    # The floor is the least first audio that plays through; the margin asks no less.
    assert base["planner"]["hop"] >= base["floor"]["hop"]
    assert all(r["first_audio_ms"] >= base["floor"]["first_audio_ms"] for r in base["rows"] if r["plays_through"])
    # First audio: first token + (hop + lookahead - 1) opening LM steps + the opening round.
    row = base["rows"][0]
    step_ms = 180.0 / (16 + LOOKAHEAD - 1)
    assert abs(row["first_audio_ms"] - (50.0 + (row["hop"] + LOOKAHEAD - 1) * step_ms + row["round_ms"])) < 0.2
    for faster in ((2.0, 1.0), (1.0, 2.0), (2.0, 2.0)):
        assert by[faster]["floor"]["first_audio_ms"] < base["floor"]["first_audio_ms"]


def test_nothing_plays_through_rounds_of_seconds(tmp_path: Path) -> None:
    src = _write_level(tmp_path / "slow.json", 2e-3)
    (r,) = main([str(src), "--level", "0", "--stage-speedup", "1", "--lm-speedup", "1"])["results"]
    assert r["floor"] is None
    assert r["planner"]["hop"] == 40  # initial_hop_max: the planner's limit


def test_the_runs_frame_buckets_are_the_ones_planned_on(tmp_path: Path) -> None:
    """With `--engine.flow-graph-frames 60,70,80` a 22-token first chunk (56 frames) is a
    60-frame round, not the 100-frame one of the multiples of 50."""
    plain = main([str(_write_level(tmp_path / "a.json", 4e-5)), "--level", "0",
                  "--stage-speedup", "1", "--lm-speedup", "1"])["results"][0]
    buckets = main([str(_write_level(tmp_path / "b.json", 4e-5, ["--engine.flow-graph-frames", "60,70,80"])),
                    "--level", "0", "--stage-speedup", "1", "--lm-speedup", "1"])["results"][0]
    at = {r["hop"]: r["round_ms"] for r in plain["rows"]}, {r["hop"]: r["round_ms"] for r in buckets["rows"]}
    assert abs(at[0][22] - (20 + 4e-2 * 64 * 100)) < 0.5
    assert abs(at[1][22] - (20 + 4e-2 * 64 * 60)) < 0.5


def test_the_planners_choice_takes_the_learnt_second_rounds_the_floor_does_not(tmp_path: Path) -> None:
    """A run that learnt long second chunks (waits included) has the planner's choice
    planned on them, unless its flags turned them off; the floor (no waits) is unchanged."""
    learnt = {"32": {"round_s": 0.9, "utterances": 5}}
    plain, slow, off = (main([str(_write_level(tmp_path / name, 4e-5, flags, rounds)), "--level", "0",
                              "--stage-speedup", "1", "--lm-speedup", "1"])["results"][0]
                        for name, flags, rounds in (("a.json", None, None), ("b.json", None, learnt),
                                                    ("c.json", ["--engine.first-chunk-second-rounds", "false"], learnt)))
    assert slow["planner"]["hop"] > plain["planner"]["hop"] == off["planner"]["hop"]
    assert slow["floor"] == plain["floor"] == off["floor"]


def test_a_level_without_the_planner_snapshot_is_refused_plainly(tmp_path: Path) -> None:
    src = _write_level(tmp_path / "level.json", 4e-5)
    with pytest.raises(SystemExit, match="not one of its 1 product levels"):
        main([str(src), "--level", "1"])
    data = json.loads(src.read_text())
    del data["results"]["product"][0]["server"]["planner"]
    src.write_text(json.dumps(data))
    with pytest.raises(SystemExit, match="no server.planner"):
        main([str(src), "--level", "0"])


def test_the_first_chunk_bounds_are_the_runs(tmp_path: Path) -> None:
    """The hops replayed run from the run's own first-chunk floor to its limit: the planner's
    snapshot says them since round 23; before, the flags or the default of then (6)."""
    def hops(name: str, **kwargs: object) -> list[int]:
        src = _write_level(tmp_path / f"{name}.json", 4e-5, **kwargs)  # type: ignore[arg-type]
        (r,) = main([str(src), "--level", "0", "--stage-speedup", "1", "--lm-speedup", "1"])["results"]
        return [row["hop"] for row in r["rows"]]

    assert hops("old") == list(range(6, 41))
    assert hops("flagged", flags=["--engine.initial-hop", "8"]) == list(range(8, 41))
    assert hops("snapshot", bounds={"initial_hop": 10, "limit": 30}) == list(range(10, 31))


def test_a_limit_at_or_below_the_floor_is_a_fixed_first_chunk(tmp_path: Path) -> None:
    """A run whose planner's `limit` was tuned to its floor or below (a fixed first chunk,
    as the engine takes it) is replayed with the floor's hop chosen, not planned and not
    taken below the floor."""
    src = _write_level(tmp_path / "fixed.json", 1e-5, bounds={"initial_hop": 10, "limit": 8, "min_hop": 6,
                                                              "min_hop_crowd": 1000})
    (r,) = main([str(src), "--level", "0", "--stage-speedup", "4", "--lm-speedup", "4"])["results"]
    assert r["planner"]["hop"] == 10 and [row["hop"] for row in r["rows"]] == list(range(6, 11))


def test_the_runs_min_hop_is_replayed(tmp_path: Path) -> None:
    """A run whose planner could go below its floor (`min_hop` in the snapshot) has the hops
    from there replayed, and the planner's choice is below the one without it where its crowd
    limit lets it go there, with at least as much time to spare by its own check (plays
    through with the margin)."""
    def result(name: str, **bounds: int) -> dict:
        src = _write_level(tmp_path / f"{name}.json", 1e-5, bounds={"initial_hop": 10, **bounds})
        (r,) = main([str(src), "--level", "0", "--stage-speedup", "4", "--lm-speedup", "4"])["results"]
        return r

    plain, below = result("plain"), result("below", min_hop=6, min_hop_crowd=1000)
    assert [row["hop"] for row in plain["rows"]][0] == 10 and [row["hop"] for row in below["rows"]][0] == 6
    assert below["planner"]["hop"] == 8 < plain["planner"]["hop"] == 10
    assert below["planner"]["with_margin"] or not plain["planner"]["with_margin"]
    # A burst of the level's sessions is a crowd of first chunks (`min_hop_crowd`, 4 by default).
    assert result("crowd", min_hop=6)["planner"] == plain["planner"]
