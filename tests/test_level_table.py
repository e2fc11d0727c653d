"""`bench.level_table`: a row per product level, the knobs it ran with, "-" for what a
report lacks, the baseline mode left out."""

from __future__ import annotations

import json

from bench.level_table import main, table
from bench.ws_load import plan_decisions


def _level(sessions: int, knobs: dict | None, p95: float, second: dict | None) -> dict:
    level = {"sessions": sessions, "ramp_s": 16.0, "first_audio_ms": {"p50": 200.4, "p95": p95},
             "sessions_with_underrun": 0, "first_chunk_phases_ms": {"tokens": 16.17, "stage_wait": 52.9, "stage": 47.5},
             "lm_server_ms": {"decode_per_token": 6.403},
             "server": {"flow_frames": 146, "vocoder_frames": 100, "first_chunk_plan_ms": {"round": 141.4},
                        "vocoder_graph_replays": 30, "vocoder_eager_decodes": 2}}
    if knobs is not None:
        level["planner_knobs"] = knobs
    if second is not None:
        level["opening_second_chunk_ms"] = second
    return level


def test_a_row_per_product_level_with_its_knobs_and_dashes_for_what_is_missing(tmp_path):
    report = {"results": {"product": [_level(272, {"due_rounds": False}, 570.5, {"stage_wait": 85.2, "stage": 169.0}),
                                      _level(272, {"due_rounds": True, "margin": 0.25}, 480.0, None)],
                          "baseline": [_level(64, None, 900.0, None)]}}
    d = "cosyvoice_engine_opening_chunk_decision"  # the means as bench.ws_load makes them
    report["results"]["product"][1]["server"]["opening_chunk_decisions"] = plan_decisions(
        {d + "s_total": 5, d + "_round_seconds_total": 1.559, d + "_second_round_seconds_total": 2.401,
         d + "_staged_total": 357, d + "_due_total": 88}, {}, "opening_chunk")
    lines = table([("a.json", report)]).splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [dict(zip(head, (c.strip() for c in line.strip("|").split("|")))) for line in lines[2:]]
    assert len(rows) == 2  # the baseline's level is not a row
    first, second = rows
    assert (first["file"], first["sessions"], first["ramp (s)"], first["knobs"]) == ("a.json", "272", "16", "due_rounds false")
    assert (first["p95"], first["first chunk (tokens)"], first["2nd chunk stage"]) == ("570", "16.2", "169")
    assert (first["flow frames / played"], first["vocoder graph / eager"], first["vLLM ms a token"]) == ("1.46", "30 / 2", "6.40")
    assert first["planned 2nd"] == "-"  # the report has no second round planned
    assert (first["opening decisions: round / 2nd (mean)"], first["their staged / due (mean)"]) == ("- / -", "- / -")
    assert (second["opening decisions: round / 2nd (mean)"], second["their staged / due (mean)"]) == ("312 / 480", "71.4 / 17.6")
    assert second["knobs"] == "due_rounds true, margin 0.25" and second["2nd chunk wait"] == "-"
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report))
    assert main([str(path)]).splitlines()[2].startswith("| r.json | 272 |")


def test_a_level_without_its_own_ramp_or_knobs_shows_the_runs_and_odd_values_read_as_dashes():
    level = _level(256, None, float("nan"), None)
    del level["ramp_s"]
    one = {"settings": {"ramp_s": 16.0, "planner_knobs": {"due_rounds": True}}, "results": {"product": [level]}}
    per_level = {"settings": {"ramp_s": [16.0, 0.0], "planner_knobs": None}, "results": {"product": [level]}}
    rows = [table([("r", report)]).splitlines()[2].split(" | ") for report in (one, per_level)]
    assert rows[0][2:6] == ["16", "due_rounds true", "200", "-"]  # the run's ramp and knobs; p95 NaN
    assert rows[1][2:4] == ["-", "-"]  # a list of ramps is the levels' own, and this one has none
    assert table([("r", {"results": None})]).count("\n") == 1  # no levels: the heading alone
