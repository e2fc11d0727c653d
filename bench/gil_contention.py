"""How much a busy event loop slows a thread that launches many small torch operators.

    python -m bench.gil_contention --ops 2700 --duty 0.25,0.5,0.9 --switch-ms 5,1,0.2

The audio stage's worker thread and the gateway's event loop share one interpreter.
PyTorch's Python bindings release the interpreter lock around every operator call, so a
stage round (a 64-stream vocoder step alone dispatches ~2700 operators,
`bench.dispatch_count`) gives the lock up thousands of times, and the event loop takes
it whenever it has Python work. This times `--ops` one-element in-place additions (an
operator whose own cost is about a GPU launch's host cost) beside a thread that runs
Python for `duty` of every `--period-ms` and sleeps the rest (an event loop that busy;
the gateway's loop was 19-29% busy on average in the 40-64-session levels of round 17 of
docs/benchmarks.md, more during a burst's opening), once per switch interval
(`sys.setswitchinterval`, the gateway's `--gil-switch-interval-ms`). Printed: the median
of `--reps` timings per setting, and its ratio to the operators alone. A model of the
mechanism, not of the stage: `bench.stage_syncs --busy` runs the stage itself.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch


def loop_thread(duty: float, period_s: float, stop: threading.Event) -> threading.Thread:
    """A thread that runs Python for duty x period, then sleeps (lock free) for the rest."""
    def run() -> None:
        while not stop.is_set():
            end = time.perf_counter() + duty * period_s
            while time.perf_counter() < end:
                sum(i for i in range(50))
            if duty < 1:
                time.sleep((1 - duty) * period_s)

    return threading.Thread(target=run, daemon=True, name="busy-loop")


def time_ops(ops: int, reps: int, duty: float, period_s: float, switch_s: float) -> float:
    """Median ms for `ops` operator calls beside a loop of `duty` (0: alone)."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(switch_s)
    stop = threading.Event()
    thread = loop_thread(duty, period_s, stop) if duty > 0 else None
    t = torch.zeros(1)
    times = []
    try:
        if thread is not None:
            thread.start()
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(ops):
                t.add_(1)
            times.append(time.perf_counter() - t0)
    finally:
        stop.set()
        if thread is not None:
            thread.join()
        sys.setswitchinterval(before)
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", type=int, default=2700)
    p.add_argument("--duty", default="0.25,0.5,0.9", help="busy fractions of the loop thread")
    p.add_argument("--period-ms", type=float, default=10.0)
    p.add_argument("--switch-ms", default="5,1,0.2", help="interpreter switch intervals to try")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    duties = [float(d) for d in args.duty.split(",")]
    report: dict[str, Any] = {"ops": args.ops, "period_ms": args.period_ms, "results": []}
    for switch_ms in (float(s) for s in args.switch_ms.split(",")):
        alone = time_ops(args.ops, args.reps, 0.0, args.period_ms / 1e3, switch_ms / 1e3)
        row: dict[str, Any] = {"switch_ms": switch_ms, "alone_ms": alone, "beside": {}}
        for duty in duties:
            row["beside"][str(duty)] = time_ops(args.ops, args.reps, duty, args.period_ms / 1e3, switch_ms / 1e3)
        report["results"].append(row)
        cells = ", ".join(f"busy {float(d):.0%}: {ms:.1f} ms ({ms / alone:.1f}x)" for d, ms in row["beside"].items())
        print(f"switch interval {switch_ms:g} ms: {args.ops} operators alone {alone:.1f} ms; beside a loop {cells}",
              flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
