"""Profile the audio stage while it serves real traffic (`engine.stage_profile_dir`).

The flow benchmarks time the networks alone; under load the stage also spends time on the
host between and around kernels (batch assembly, cache lookups, the vocoder, the copy of the
PCM back), and the load benchmark saw the GPU only ~65% busy while the stage was ~90% busy.
This profiler answers where that goes: it runs `torch.profiler` over a window of the stage's
own batches (`count` of them, from the first batch at index `start` or later, counted from the
stage's first batch, that holds at least `min_chunks` chunks: a load level) and writes

* `stage_profile.json`: per batch its chunks, wall time and, on CUDA, the time the GPU was
  running kernels inside it (the union of the kernel intervals; every batch ends with a
  device-to-host copy, so all of its kernels finish inside its wall time), plus totals;
* `stage_profile.txt`: the operators and kernels of the window by total time.

On CUDA each batch row also lists its CUDA graph launches (`graph_launches`): how long
each `cudaGraphLaunch` call held the host, and how long after the call began the GPU
started the next kernel. Launching a one-chunk flow graph (~5000 kernels) took ~2.7 ms on
the H200 (under cProfile, the stage alone), and the GPU sat idle for most of the flow
phase (round 14): whether the GPU waits for the whole launch decides whether splitting
the graph would start it sooner.

Each batch row also splits the batch by the stage's phases (`PHASES`, the
`record_function` ranges `AudioStage._launch` opens): per phase its host time and, on
CUDA, how long the GPU ran no kernel inside it. A one-chunk batch in the gateway took
27-36 ms against 21-22 ms alone, with the GPU busy ~70% of it (round 13 of
docs/benchmarks.md): this says which host phase the GPU waited on.

It lives on the stage's worker thread (the only thread that runs the stage's tensor work),
so the profiler starts and stops there; the analysis and the files are done on a thread of
their own (for a compiled flow under load they take tens of seconds, which on the worker
thread stalled every session; on a thread they still compete with serving for the
interpreter, so do not measure the load right after the window). Recording every operator
slows the host too: the busy share is a lower bound. The GPU-side copies of the
`stage_batch_N` annotations are neither the batches' wall time nor kernels.
"""

from __future__ import annotations

import bisect
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch

log = logging.getLogger(__name__)
T = TypeVar("T")

# The phases of a stage batch, as `record_function` names: the flow (inputs, the ODE solve
# or its graph), the vocoder, and the copy of the PCM to the host.
PHASES: tuple[str, ...] = ("stage.flow", "stage.vocoder", "stage.to_host")


@dataclass
class StageProfiler:
    out_dir: Path
    start: int = 20
    count: int = 20
    cuda: bool = False
    min_chunks: int = 0
    # The batch index `start` counts from; None until it is known (`AudioStage.started`
    # sets it at the end of the engine's start, so its warm-up is never profiled).
    origin: int | None = 0
    done: bool = False
    profiled: int = 0  # batches run under the profiler (slower than rounds: not rounds)
    _prof: torch.profiler.profile | None = None
    _writer: threading.Thread | None = None
    _t0_ns: int = 0
    _window_ms: float = 0.0
    _batches: list[tuple[int, int]] = field(default_factory=list)  # (stage batch index, chunks)

    def run(self, index: int, chunks: int, fn: Callable[[], T]) -> T:
        """Run one batch's work (`fn`, on the worker thread), profiled inside the window."""
        if (self.done or self.origin is None or index < self.origin + self.start
                or (self._prof is None and chunks < self.min_chunks)):
            return fn()
        if self._prof is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=activities)
            self._prof.start()
            self._t0_ns = time.perf_counter_ns()
        self.profiled += 1
        with torch.profiler.record_function(f"stage_batch_{index}"):
            out = fn()
        self._batches.append((index, chunks))
        if len(self._batches) >= self.count:
            self._finish()
        return out

    def close(self) -> None:
        """Stop a window cut short (the stage is closing), and wait until the profile is
        written. Call it on the worker thread: a profiler left running past its thread
        crashes the process at exit."""
        if self._prof is not None and not self.done:
            self._finish()
        if self._writer is not None:
            self._writer.join()

    def _finish(self) -> None:
        assert self._prof is not None
        prof, self._prof = self._prof, None
        prof.stop()
        self._window_ms = (time.perf_counter_ns() - self._t0_ns) / 1e6
        self.done = True
        self._writer = threading.Thread(target=self._write_safely, args=(prof,), name="stage-profile-writer")
        self._writer.start()

    def _write_safely(self, prof: torch.profiler.profile) -> None:
        try:
            self._write(prof)
        except Exception:  # a profile must never take the stage down
            log.exception("writing the stage profile failed")

    def _write(self, prof: torch.profiler.profile) -> None:
        events = prof.events()
        ranges = batch_ranges(events)
        kernels = kernel_intervals(events)
        phases = phase_ranges(events)
        launches = graph_launch_ranges(events) if self.cuda else []
        rows: list[dict[str, Any]] = []
        for index, chunks in self._batches:
            r = ranges.get(f"stage_batch_{index}")
            if r is None:
                continue
            start, end = r
            row: dict[str, Any] = {"batch": index, "chunks": chunks, "wall_ms": (end - start) / 1e3}
            if self.cuda:
                busy = union_within(kernels, start, end)
                row["gpu_busy_ms"] = busy / 1e3
                row["gpu_busy_share"] = busy / (end - start) if end > start else None
            row["phases"] = phase_split(phases, kernels if self.cuda else None, start, end)
            if self.cuda:
                row["graph_launches"] = launch_delays(launches, kernels, start, end)
            rows.append(row)
        wall = sum(r["wall_ms"] for r in rows)
        report: dict[str, Any] = {"batches": rows, "wall_ms": wall, "chunks": sum(r["chunks"] for r in rows),
                                  "window_ms": self._window_ms}
        if self.cuda:
            busy = sum(r["gpu_busy_ms"] for r in rows)
            report["gpu_busy_ms"] = busy
            report["gpu_busy_share"] = busy / wall if wall > 0 else None
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / "stage_profile.json").write_text(json.dumps(report, indent=2))
        sort = "cuda_time_total" if self.cuda else "cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=90)
        (self.out_dir / "stage_profile.txt").write_text(table)
        log.info("stage profile of %d batches written to %s", len(rows), self.out_dir)


def batch_ranges(events: Any) -> dict[str, tuple[float, float]]:
    """(start, end) of each `stage_batch_N` range on the host. On CUDA the profiler also
    puts copies of each range on the GPU timeline, later and shorter: not the batch's wall."""
    return {e.name: (e.time_range.start, e.time_range.end) for e in events
            if e.name.startswith("stage_batch_") and e.device_type == torch.autograd.DeviceType.CPU}


def phase_ranges(events: Any) -> list[tuple[str, float, float]]:
    """(name, start, end) of each host range of a stage phase (`PHASES`), sorted by start."""
    return sorted(((e.name, e.time_range.start, e.time_range.end) for e in events
                   if e.name in PHASES and e.device_type == torch.autograd.DeviceType.CPU), key=lambda r: r[1])


def phase_split(phases: list[tuple[str, float, float]], kernels: list[tuple[float, float]] | None,
                lo: float, hi: float) -> dict[str, dict[str, float]]:
    """Per phase inside [lo, hi] (one batch): its host time, and with `kernels` the time
    the GPU ran none of them while the phase was on the host (ms; a phase may run more
    than once in a batch: summed)."""
    out: dict[str, dict[str, float]] = {}
    for name, start, end in phases:
        start, end = max(start, lo), min(end, hi)
        if end <= start:
            continue
        acc = out.setdefault(name, {"host_ms": 0.0} | ({"gpu_idle_ms": 0.0} if kernels is not None else {}))
        acc["host_ms"] += (end - start) / 1e3
        if kernels is not None:
            acc["gpu_idle_ms"] += (end - start - union_within(kernels, start, end)) / 1e3
    return out


def graph_launch_ranges(events: Any) -> list[tuple[float, float]]:
    """(start, end) of each `cudaGraphLaunch` runtime call on the host, sorted."""
    return sorted((e.time_range.start, e.time_range.end) for e in events
                  if e.name.startswith("cudaGraphLaunch") and e.device_type == torch.autograd.DeviceType.CPU)


def launch_delays(launches: list[tuple[float, float]], kernels: list[tuple[float, float]],
                  lo: float, hi: float) -> list[dict[str, float | None]]:
    """Per graph launch inside [lo, hi]: its host time, and from its start until the first
    kernel that starts after it (ms; None when none does in the batch)."""
    out: list[dict[str, float | None]] = []
    starts = [k[0] for k in kernels]
    for start, end in launches:
        if not lo <= start < hi:
            continue
        i = bisect.bisect_left(starts, start)
        first = starts[i] if i < len(starts) and starts[i] < hi else None
        out.append({"host_ms": (end - start) / 1e3,
                    "gpu_start_ms": None if first is None else (first - start) / 1e3})
    return out


def kernel_intervals(events: Any) -> list[tuple[float, float]]:
    """(start, end) of the device's kernels and copies, sorted: CUDA-side events less the
    GPU copies of `record_function` annotations (batches, phases), which span many kernels."""
    return sorted((e.time_range.start, e.time_range.end) for e in events
                  if e.device_type == torch.autograd.DeviceType.CUDA
                  and not getattr(e, "is_user_annotation", False) and not e.name.startswith("stage_batch_")
                  and e.name not in PHASES)


def union_within(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Total length of the union of sorted `intervals`, clipped to [lo, hi]."""
    total, cur_start, cur_end = 0.0, None, None
    for s, e in intervals:
        s, e = max(s, lo), min(e, hi)
        if e <= s:
            continue
        if cur_end is None or s > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start  # type: ignore[operator]
            cur_start, cur_end = s, e
        else:
            cur_end = max(cur_end, e)
    if cur_end is not None:
        total += cur_end - cur_start  # type: ignore[operator]
    return total
