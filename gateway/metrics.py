"""Prometheus metrics in the text exposition format (version 0.0.4), without a global registry.

One `Metrics` object per app: tests run several apps in one process and each must
count only its own traffic, which a module-level registry (prometheus_client's
default) would not give us. The format is simple enough to write by hand.

Gateway-side series are counted here; engine-side ones (queue depths, LM tokens/s,
batch sizes) are read from the engine's `stats()` snapshot at scrape time, so the
engine needs no knowledge of Prometheus.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import threading
from dataclasses import dataclass, field
from typing import Any

from engine.mps import daemon_pipe_directory

from .gc_pauses import GcPauses

PREFIX = "cosyvoice"

# Engine stats fields that only ever grow: exposed as Prometheus counters (`_total`).
ENGINE_COUNTERS: frozenset[str] = frozenset(
    {"lm_tokens", "batches", "chunks", "dropped_chunks", "stage_busy_seconds", "stage_handoff_seconds",
     "flow_frames", "flow_exact_frames", "flow_row_padding_frames", "flow_bucket_padding_frames", "vocoder_frames",
     "flow_grown_chunks", "flow_grown_tokens", "stage_batches_retried_apart", "stage_pipelined_batches",
     "patient_chunks", "patient_tokens",
     "first_chunk_holds", "first_chunk_hold_seconds", "first_chunk_hold_caught", "first_chunk_burst_holds",
     "first_chunk_passed_over",
     "first_chunk_below_floor", "first_chunk_crowded", "first_chunk_learnt_rounds",
     *(f"{kind}_{name}" for kind in ("first_chunk", "opening_chunk")
       for name in ("decisions", "decision_hop_tokens", "decision_lm_step_seconds", "decision_round_seconds",
                    "decision_second_round_seconds", "decision_staged", "decision_due")),
     "deadline_cuts", "first_chunk_cuts",
     "prompt_cache_hits", "context_reads", "context_records", "vocoder_graph_replays", "vocoder_eager_decodes",
     "first_chunks", "first_chunk_lm_first_token_seconds", "first_chunk_lm_decode_seconds",
     "first_chunk_stage_wait_seconds", "first_chunk_stage_seconds", "first_chunk_tokens",
     "first_chunk_planned_tokens", "first_chunk_batch_rows",
     "opening_chunks", "opening_chunk_lm_first_token_seconds", "opening_chunk_lm_decode_seconds",
     "opening_chunk_stage_wait_seconds", "opening_chunk_stage_seconds", "opening_chunk_tokens",
     "opening_chunk_planned_tokens", "opening_chunk_batch_rows",
     "slow_opening_chunks", "slow_opening_chunk_lm_first_token_seconds", "slow_opening_chunk_lm_decode_seconds",
     "slow_opening_chunk_stage_wait_seconds", "slow_opening_chunk_stage_seconds", "slow_opening_chunk_tokens",
     "slow_opening_chunk_planned_tokens", "slow_opening_chunk_batch_rows",
     "opening_second_chunks", "opening_second_chunk_ready_wait_seconds", "opening_second_chunk_stage_wait_seconds",
     "opening_second_chunk_stage_seconds", "opening_second_chunk_lates", "opening_second_chunk_late_seconds",
     "opening_second_chunk_late_first_rows", "opening_second_chunk_late_ready_seconds",
     "opening_second_chunk_late_stage_wait_seconds", "opening_second_chunk_late_stage_seconds",
     "opening_second_chunk_late_rows", "opening_second_chunk_close_calls", "opening_second_chunk_past_due",
     "opening_second_chunk_late_past_due",
     "lm_server_requests", "lm_server_queued_seconds", "lm_server_prefill_seconds", "lm_server_decode_seconds",
     "lm_server_decode_tokens", "lm_server_first_tokens", "lm_server_first_token_seconds"}
)

# Edges at the first-audio targets of issue #12 (60, 250 and 500 ms), so a quantile
# estimate there is not an interpolation across a wide bucket.
FIRST_AUDIO_BUCKETS: tuple[float, ...] = (0.025, 0.05, 0.06, 0.08, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5,
                                          2.0, 3.0, 5.0, 10.0)
LOOP_LAG_BUCKETS: tuple[float, ...] = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        self.total += value
        self.n += 1
        for i, upper in enumerate(self.buckets):
            if value <= upper:
                self.counts[i] += 1
                break

    def lines(self, name: str) -> list[str]:
        out: list[str] = []
        running = 0
        for upper, count in zip(self.buckets, self.counts):
            running += count
            out.append(f'{name}_bucket{{le="{_fmt(upper)}"}} {running}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.n}')
        out.append(f"{name}_sum {_fmt(self.total)}")
        out.append(f"{name}_count {self.n}")
        return out


def _fmt(value: float) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def process_rss_bytes() -> int | None:
    """This process's resident set size (Linux /proc; None elsewhere).

    Read at scrape time so that a benchmark can tell the gateway's memory per idle and
    per active session without knowing its PID (it may run on another host).
    """
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _loop_name() -> str | None:
    """'uvloop' or 'asyncio' when called on a running event loop (a scrape), else None."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return None
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"


def _label(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class Metrics:
    """Counters for one gateway app. All methods are cheap and thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sessions_opened = 0
        self._sessions_active = 0
        self._first_audio = Histogram(FIRST_AUDIO_BUCKETS)
        self._loop_lag = Histogram(LOOP_LAG_BUCKETS)
        self._loop_cpu = 0.0
        self._errors: dict[str, int] = {}
        self._requests: dict[tuple[str, int], int] = {}
        self._audio_seconds = 0.0
        # The collector's passes in this process: counted once `gc_pauses.start()` is called
        # (the app's lifespan), written by the collector's callback outside `_lock`.
        self.gc_pauses = GcPauses()
        # How many objects `gc.freeze` exempted, set by whoever froze them (the app's
        # lifespan). Not `gc.get_freeze_count()` per scrape: it walks every one of them with
        # the GIL held, 18 ms for the 186,000 of a gateway on this project's CPU machine
        # (96 ns each; the H200 gateway froze 741,000), and the load benchmark scrapes 4
        # times a second (round 29 of docs/benchmarks.md).
        self.frozen_objects = 0

    # -- gateway events --------------------------------------------------------------
    def session_opened(self) -> None:
        with self._lock:
            self._sessions_opened += 1
            self._sessions_active += 1

    def session_closed(self) -> None:
        with self._lock:
            self._sessions_active = max(0, self._sessions_active - 1)

    @property
    def sessions_active(self) -> int:
        """WebSocket connections and HTTP speech streams open now."""
        return self._sessions_active

    def session_refusal(self, limit: int | None) -> str | None:
        """Why a new session is refused at `limit` (settings.max_sessions: WebSockets and HTTP
        speech count together); None while there is room. Callers open the session with no
        await after asking, so concurrent ones cannot slip past the limit together."""
        if limit is None or self._sessions_active < limit:
            return None
        return f"too many sessions (at most {limit}); try again later"

    def observe_first_audio(self, seconds: float) -> None:
        with self._lock:
            self._first_audio.observe(seconds)

    def observe_loop_lag(self, seconds: float) -> None:
        with self._lock:
            self._loop_lag.observe(seconds)

    def add_loop_cpu(self, seconds: float) -> None:
        with self._lock:
            self._loop_cpu += seconds

    def add_audio_seconds(self, seconds: float) -> None:
        with self._lock:
            self._audio_seconds += seconds

    def error(self, code: str) -> None:
        with self._lock:
            self._errors[code] = self._errors.get(code, 0) + 1

    def observe_request(self, route: str, status: int) -> None:
        with self._lock:
            key = (route, int(status))
            self._requests[key] = self._requests.get(key, 0) + 1

    # -- read-back (tests, /metrics) -------------------------------------------------
    def error_count(self, code: str) -> int:
        with self._lock:
            return self._errors.get(code, 0)

    def render(self, engine_stats: Any | None = None) -> str:
        p = PREFIX
        lines: list[str] = []

        def head(name: str, kind: str, doc: str) -> None:
            lines.append(f"# HELP {name} {doc}")
            lines.append(f"# TYPE {name} {kind}")

        rss = process_rss_bytes()  # a /proc read: outside the lock
        mps = daemon_pipe_directory() is not None
        loop = _loop_name()
        with self._lock:
            head(f"{p}_sessions_opened_total", "counter", "Sessions (WebSocket or HTTP speech requests) opened.")
            lines.append(f"{p}_sessions_opened_total {self._sessions_opened}")
            head(f"{p}_sessions_active", "gauge", "Sessions currently open.")
            lines.append(f"{p}_sessions_active {self._sessions_active}")
            head(f"{p}_first_audio_seconds", "histogram", "Time from request to the first audio bytes sent.")
            lines.extend(self._first_audio.lines(f"{p}_first_audio_seconds"))
            head(f"{p}_audio_seconds_total", "counter", "Seconds of audio delivered (HTTP speech and WebSocket contexts).")
            lines.append(f"{p}_audio_seconds_total {_fmt(self._audio_seconds)}")
            head(f"{p}_errors_total", "counter", "Errors returned to clients, by code.")
            for code, n in sorted(self._errors.items()):
                lines.append(f'{p}_errors_total{{code="{_label(code)}"}} {n}')
            head(f"{p}_http_requests_total", "counter", "HTTP requests by route and status.")
            for (route, status), n in sorted(self._requests.items()):
                lines.append(f'{p}_http_requests_total{{route="{_label(route)}",status="{status}"}} {n}')
            if self._loop_lag.n:
                head(f"{p}_event_loop_lag_seconds", "histogram",
                     "How late the event loop woke a periodic check (its wait is every callback's wait).")
                lines.extend(self._loop_lag.lines(f"{p}_event_loop_lag_seconds"))
                head(f"{p}_event_loop_cpu_seconds_total", "counter",
                     "CPU time of the event loop's thread (the engine's and encoders' threads excluded).")
                lines.append(f"{p}_event_loop_cpu_seconds_total {_fmt(self._loop_cpu)}")
            gcp = self.gc_pauses
            if any(gcp.collections):
                head(f"{p}_gc_collections_total", "counter", "Cyclic garbage collector passes, by generation.")
                for g, n in enumerate(gcp.collections):
                    lines.append(f'{p}_gc_collections_total{{generation="{g}"}} {n}')
                head(f"{p}_gc_pause_seconds_total", "counter",
                     "Seconds the collector's passes held the GIL (every thread waits), by generation.")
                for g, secs in enumerate(gcp.seconds):
                    lines.append(f'{p}_gc_pause_seconds_total{{generation="{g}"}} {_fmt(secs)}')
                head(f"{p}_gc_pause_max_seconds", "gauge", "The longest collector pass since start.")
                lines.append(f"{p}_gc_pause_max_seconds {_fmt(gcp.longest)}")
            head(f"{p}_gc_frozen_objects", "gauge",
                 "Objects exempted from the collector's passes at start (gc.freeze; freed ones not subtracted).")
            lines.append(f"{p}_gc_frozen_objects {self.frozen_objects}")
            if loop is not None:
                head(f"{p}_event_loop_info", "gauge", "The event loop implementation serving this process.")
                lines.append(f'{p}_event_loop_info{{loop="{loop}"}} 1')
            head(f"{p}_mps_daemon", "gauge",
                 "1 while an NVIDIA MPS daemon runs for this process's GPU work (the stage's and vLLM's MPS "
                 "settings need one), else 0.")
            lines.append(f"{p}_mps_daemon {int(mps)}")
            if rss is not None:
                head(f"{p}_process_resident_memory_bytes", "gauge", "Resident memory of the gateway process.")
                lines.append(f"{p}_process_resident_memory_bytes {rss}")

        if engine_stats is not None:
            lines.extend(_engine_lines(engine_stats))
            lines.extend(self._derived_lines(engine_stats))
        return "\n".join(lines) + "\n"

    def _derived_lines(self, stats: Any) -> list[str]:
        """The mean GPU batch size. (The LM's rate is `rate(cosyvoice_engine_lm_tokens_total[1m])`:
        a gauge of tokens since the previous scrape gave each of several scrapers, a
        Prometheus pair or a benchmark, a window cut short by the others.)"""
        p = PREFIX
        lines: list[str] = []
        batches, chunks = getattr(stats, "batches", None), getattr(stats, "chunks", None)
        if isinstance(batches, int) and isinstance(chunks, int):
            mean = chunks / batches if batches else 0.0
            lines += [f"# HELP {p}_mean_batch_size Chunks per flow/vocoder batch since start.",
                      f"# TYPE {p}_mean_batch_size gauge", f"{p}_mean_batch_size {_fmt(mean)}"]
        return lines


def _engine_lines(stats: Any) -> list[str]:
    """Every numeric field of the engine's stats snapshot as one series.

    Numbers become gauges (counters when the name ends in ``_total``); a dict field
    (e.g. batch size -> count) becomes one series per key with a ``key`` label. Reading
    the fields generically keeps /metrics in step as the engine grows new stats.
    """
    if dataclasses.is_dataclass(stats) and not isinstance(stats, type):
        items = {f.name: getattr(stats, f.name) for f in dataclasses.fields(stats)}
    elif isinstance(stats, dict):
        items = dict(stats)
    else:
        items = {k: v for k, v in vars(stats).items() if not k.startswith("_")}
    lines: list[str] = []
    for key, value in sorted(items.items()):
        counter = key.endswith("_total") or key in ENGINE_COUNTERS
        name = f"{PREFIX}_engine_{key}" + ("_total" if counter and not key.endswith("_total") else "")
        kind = "counter" if counter else "gauge"
        if isinstance(value, bool):
            value = int(value)
        if isinstance(value, (int, float)):
            lines.append(f"# TYPE {name} {kind}")
            lines.append(f"{name} {_fmt(value)}")
        elif isinstance(value, dict) and all(isinstance(v, (int, float)) for v in value.values()):
            lines.append(f"# TYPE {name} {kind}")
            for k, v in sorted(value.items(), key=lambda kv: str(kv[0])):
                lines.append(f'{name}{{key="{_label(k)}"}} {_fmt(v)}')
    return lines
