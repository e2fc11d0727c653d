"""The product levels of `bench.ws_load` reports as one Markdown table: a row a level, with
what an A/B of the planner or the stage is read on (first audio, dry sessions, the first
and second chunks' phases and plans, the stage's rounds, vLLM's step).

    python -m bench.level_table docs/bench/ws_load_r52_maxhop_150-100_v0.json [more.json ...]

Levels run with planner knobs (`--planner-knobs`) show them in the `knobs` column, and a
level without a ramp or knobs of its own shows the run's (`settings`); the baseline mode's
levels are left out. A value a report lacks (an older report, a level that made no second
chunk) reads "-". The "planned" columns are the latest decision of the level, of any
utterance and of a session's first (`first_chunk_plan_ms`, `opening_chunk_plan_ms`); the
"decisions" columns are means over the level's decisions for sessions' first utterances
(`opening_chunk_decisions`, reports from round 54 on), with the utterances in progress on the
stage then, all and those not waiting patiently. The sessions column is the engine's open
sessions at their peak, sampled every 0.25 s.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any, Callable, Sequence

Cell = Callable[[dict[str, Any]], Any]


def _get(level: dict[str, Any], *path: str) -> Any:
    node: Any = level
    for key in path:
        if not isinstance(node, dict):
            return None
        node = node.get(key)
    return node


def _frames_per_played(level: dict[str, Any]) -> float | None:
    flow, played = _get(level, "server", "flow_frames"), _get(level, "server", "vocoder_frames")
    return flow / played if flow is not None and played else None


def _knobs(knobs: dict[str, Any] | None) -> str:
    return ", ".join(f"{k} {json.dumps(v)}" for k, v in sorted(knobs.items())) if knobs else "-"


# (heading, cell, digits): the columns, in order.
COLUMNS: tuple[tuple[str, Cell, int], ...] = (
    ("sessions", lambda lv: lv.get("sessions"), 0),
    ("ramp (s)", lambda lv: lv.get("ramp_s"), 0),
    ("knobs", lambda lv: _knobs(lv.get("planner_knobs")), 0),
    ("first audio p50", lambda lv: _get(lv, "first_audio_ms", "p50"), 0),
    ("p95", lambda lv: _get(lv, "first_audio_ms", "p95"), 0),
    ("dry", lambda lv: lv.get("sessions_with_underrun"), 0),
    ("first chunk (tokens)", lambda lv: _get(lv, "first_chunk_phases_ms", "tokens"), 1),
    ("its stage wait", lambda lv: _get(lv, "first_chunk_phases_ms", "stage_wait"), 0),
    ("its stage", lambda lv: _get(lv, "first_chunk_phases_ms", "stage"), 0),
    ("planned round", lambda lv: _get(lv, "server", "first_chunk_plan_ms", "round"), 0),
    ("planned 2nd", lambda lv: _get(lv, "server", "first_chunk_plan_ms", "second_round"), 0),
    ("opening planned round / 2nd", lambda lv: (_get(lv, "server", "opening_chunk_plan_ms", "round"),
                                                _get(lv, "server", "opening_chunk_plan_ms", "second_round")), 0),
    ("opening decisions: round / 2nd (mean)", lambda lv: (_get(lv, "server", "opening_chunk_decisions", "round_ms"),
                                                          _get(lv, "server", "opening_chunk_decisions", "second_round_ms")), 0),
    ("their staged / due (mean)", lambda lv: (_get(lv, "server", "opening_chunk_decisions", "staged"),
                                              _get(lv, "server", "opening_chunk_decisions", "due")), 1),
    ("2nd chunk wait", lambda lv: _get(lv, "opening_second_chunk_ms", "stage_wait"), 0),
    ("2nd chunk stage", lambda lv: _get(lv, "opening_second_chunk_ms", "stage"), 0),
    ("stage busy", lambda lv: _get(lv, "server", "stage_busy_share"), 2),
    ("rows a round", lambda lv: _get(lv, "server", "mean_flow_batch"), 1),
    ("peak sessions open", lambda lv: _get(lv, "server", "max_active_sessions"), 0),
    ("flow frames / played", _frames_per_played, 2),
    ("re-read", lambda lv: _get(lv, "server", "flow_reread_share"), 3),
    ("vLLM ms a token", lambda lv: _get(lv, "lm_server_ms", "decode_per_token"), 2),
    ("vocoder graph / eager", lambda lv: (_get(lv, "server", "vocoder_graph_replays"),
                                          _get(lv, "server", "vocoder_eager_decodes")), 0),
)


def cell(value: Any, digits: int) -> str:
    """A value as the table prints it: `digits` decimals, a pair joined by " / ", "-" for
    none (and for a NaN or an infinity, which `round` cannot take)."""
    if value is None:
        return "-"
    if isinstance(value, tuple):
        return " / ".join(cell(v, digits) for v in value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if not math.isfinite(value):
        return "-"
    return f"{value:.{digits}f}" if digits else f"{round(value):d}"


def product_levels(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The levels of a `bench.ws_load` report's product mode, in the order they ran, each
    with the run's ramp and knobs (`settings`) where it has none of its own."""
    settings = report.get("settings") or {}
    run: dict[str, Any] = {}
    if isinstance(settings.get("ramp_s"), (int, float)):  # a list: each level has its own
        run["ramp_s"] = settings["ramp_s"]
    if isinstance(settings.get("planner_knobs"), dict):
        run["planner_knobs"] = settings["planner_knobs"]
    return [run | level for level in (report.get("results") or {}).get("product") or []]


def table(reports: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """One Markdown table of every report's product levels, each row led by its file."""
    head = ["file"] + [name for name, _, _ in COLUMNS]
    rows = [head, ["---"] * len(head)]
    for name, report in reports:
        for level in product_levels(report):
            rows.append([name] + [cell(get(level), digits) for _, get, digits in COLUMNS])
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)


def main(argv: Sequence[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("reports", nargs="+", type=Path, help="bench.ws_load JSON reports")
    args = ap.parse_args(argv)
    out = table([(p.name, json.loads(p.read_text())) for p in args.reports])
    print(out)
    return out


if __name__ == "__main__":
    main()
