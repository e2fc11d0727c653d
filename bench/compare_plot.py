"""First audio against sessions for labelled sets of `bench.ws_load` reports, one chart:
an A/B whose runs came from several calls (each call a gateway of one setting) drawn as
one line per setting and percentile.

    python -m bench.compare_plot --out docs/bench/ws_load_r48_ab.svg \\
        "new=docs/bench/ws_load_r48_ab_1_new.json,docs/bench/ws_load_r48_ba_0_new.json" \\
        "old=docs/bench/ws_load_r48_ab_0_old.json,docs/bench/ws_load_r48_ba_1_old.json"

Each label's product levels are pooled across its files; a session count run more than
once is drawn at the median of its runs (as `ws_load.plot` draws repeats), p50 solid and
p95 dashed. Levels of the baseline mode are left out. A label whose levels differ in ramp
or planner knobs (which `ws_load.plot` draws as lines of their own) is refused: give each
its own label.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from bench.svg_plot import Chart, Series, render_svg

COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")


def parse_spec(spec: str) -> tuple[str, list[Path]]:
    """`label=path[,path...]` as (label, paths)."""
    label, sep, paths = spec.partition("=")
    if not sep or not label or not paths:
        raise ValueError(f"expected LABEL=PATH[,PATH...], got {spec!r}")
    return label, [Path(p) for p in paths.split(",") if p]


def group_of(report: dict[str, Any], level: dict[str, Any]) -> tuple[Any, str]:
    """What besides its session count sets a level apart (`ws_load.level_group`), with the
    run's own ramp and knobs where the level has none of its own."""
    settings = report.get("settings") or {}
    ramp = level.get("ramp_s", settings.get("ramp_s"))
    knobs = level.get("planner_knobs", settings.get("planner_knobs"))
    return ramp, json.dumps(knobs, sort_keys=True)


def check_one_group(label: str, reports: list[dict[str, Any]]) -> None:
    """ValueError when the label's product levels mix ramps or planner knobs."""
    groups = {group_of(r, lv) for r in reports for lv in r["results"].get("product") or []}
    if len(groups) > 1:
        raise ValueError(f"{label}: levels of more than one ramp or planner setting {sorted(map(str, groups))}; "
                         "give each its own label")


def medians(reports: list[dict[str, Any]], quantile: str) -> tuple[tuple[float, float], ...]:
    """(sessions, median first-audio `quantile` in ms) over the reports' product levels."""
    by_n: dict[int, list[float]] = {}
    for report in reports:
        for level in report["results"].get("product") or []:
            value = level["first_audio_ms"][quantile]
            if value is not None:
                by_n.setdefault(level["sessions"], []).append(value)
    return tuple((float(n), statistics.median(v)) for n, v in sorted(by_n.items()))


def chart(sets: list[tuple[str, list[dict[str, Any]]]], title: str, log_x: bool = False) -> str:
    """The SVG of one chart: per labelled set of reports, its p50 and p95 lines."""
    series = []
    for k, (label, reports) in enumerate(sets):
        check_one_group(label, reports)
        colour = COLOURS[k % len(COLOURS)]
        for quantile, dashed in (("p50", False), ("p95", True)):
            points = medians(reports, quantile)
            if points:
                series.append(Series(f"{label} {quantile}", points, colour, dashed))
    return render_svg(Chart(title, "concurrent sessions", "first audio (ms)", tuple(series), log_x=log_x))


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sets", nargs="+", metavar="LABEL=PATH[,PATH...]")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--title", default="First-audio latency vs concurrent sessions")
    p.add_argument("--log-x", action="store_true", help="sessions on a log scale (default linear)")
    args = p.parse_args(argv)
    sets = []
    for spec in args.sets:
        label, paths = parse_spec(spec)
        sets.append((label, [json.loads(path.read_text()) for path in paths]))
    svg = chart(sets, args.title, args.log_x)
    args.out.write_text(svg)
    return svg


if __name__ == "__main__":
    main()
