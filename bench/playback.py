"""Real-time playback accounting for streamed audio, as pure functions of timelines.

A streaming client plays audio as it arrives. Playback starts with the first chunk
(after an optional jitter buffer) and then consumes `sample_rate` samples per second of
wall time. If the next chunk has not arrived when the playhead reaches it, the listener
hears a stall: an *underrun*. Like a real player, playback then resumes when the chunk
arrives, so one late chunk is one underrun, not a cascade of them.

Silence caused by the *text* is not the TTS's fault: when the first chunk of a segment
is due before that segment's text was complete (the LLM had not written it yet), the
player idles until the text was complete (`ready_at`) without counting an underrun;
only the time after that is an underrun.

A session that ends without all its audio (it timed out, errored or lost its
connection) stalls from the moment its playhead ran out to the moment it ended: that is
one more underrun (`end`), though no chunk arrived to reveal it. Silence before its
first chunk is not an underrun but first-audio latency (see `bench.ws_load.analyse`).

Everything here is deterministic arithmetic on (time, samples) lists, so it can be
tested with exact numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence


@dataclass(frozen=True)
class Arrival:
    """One audio chunk as the client received it."""

    t: float  # arrival time, seconds on the client's clock
    samples: int
    ready_at: float | None = None  # first chunk of a segment: when its text was complete
    segment: int = -1  # which segment (utterance) of the session it belongs to; -1 unknown


@dataclass(frozen=True)
class Playback:
    underruns: int
    underrun_s: float  # total stall time heard
    text_wait_s: float  # silence while waiting for the text (not counted as underrun)
    gaps_s: tuple[float, ...]  # inter-arrival times of consecutive chunks
    audio_s: float
    play_start: float | None
    play_end: float | None  # when the last sample has been played
    # Per underrun, the audio of its segment already played when it began (seconds; the
    # session's audio so far where segments are unknown): 0 is a segment's first chunk
    # coming late, a fraction of a second its next chunk after a start, several seconds a
    # stage that cannot keep up.
    underrun_at_s: tuple[float, ...] = ()
    # Per underrun, its segment (-1 unknown) and when it began, in seconds after playback
    # started: whether stalls hit the first sentence right after a start or later ones.
    underrun_segment: tuple[int, ...] = ()
    underrun_since_start_s: tuple[float, ...] = ()
    # Per segment after the session's first: how long before the playhead reached it its
    # first chunk arrived (seconds; negative: late, an underrun). A segment made while
    # earlier audio still plays may come late in latency yet early here.
    segment_leads_s: tuple[float, ...] = ()


def simulate_playback(arrivals: Sequence[Arrival], sample_rate: int, prebuffer_s: float = 0.0,
                      end: float | None = None, end_ready: float | None = None) -> Playback:
    """Play `arrivals` (in arrival order) on a virtual clock; see the module doc.

    `end`: the session ended then with audio still owed (timed out, failed). When the
    playhead ran out before `end`, the silence up to `end` is one more underrun; the part
    of it before `end_ready` (when the text the missing audio needs had been sent, as far
    as the caller knows) is text wait instead, as for a segment's first chunk."""
    if sample_rate <= 0:
        raise ValueError("sample_rate must be positive")
    if not arrivals:
        return Playback(0, 0.0, 0.0, (), 0.0, None, None)
    underruns, stalled, waited = 0, 0.0, 0.0
    stall_positions: list[float] = []
    stall_segments: list[int] = []
    stall_times: list[float] = []
    leads: list[float] = []
    segment_start, segment = 0, None  # samples played before the current segment began
    gaps = tuple(b.t - a.t for a, b in zip(arrivals, arrivals[1:]))
    play_start = arrivals[0].t + prebuffer_s
    position = play_start  # wall time at which the playhead reaches the next chunk
    total = 0
    for i, chunk in enumerate(arrivals):
        opens = chunk.segment >= 0 and chunk.segment != segment
        if opens:
            segment, segment_start = chunk.segment, total
        if i > 0:
            due = position
            if chunk.ready_at is not None and chunk.ready_at > due:
                waited += chunk.ready_at - due
                due = chunk.ready_at
            if opens:
                leads.append(due - chunk.t)
            if chunk.t > due:
                underruns += 1
                stalled += chunk.t - due
                stall_positions.append((total - segment_start) / sample_rate)
                stall_segments.append(chunk.segment)
                stall_times.append(due - play_start)
                due = chunk.t
            position = due
        position += chunk.samples / sample_rate
        total += chunk.samples
    if end is not None:
        # No chunk arrives to reveal this stall: the session's end does.
        due = position
        if end_ready is not None and end_ready > due:
            waited += min(end_ready, end) - due
            due = end_ready
        if end > due:
            underruns += 1
            stalled += end - due
            stall_positions.append((total - segment_start) / sample_rate)
            stall_segments.append(segment if segment is not None else -1)
            stall_times.append(due - play_start)
    return Playback(underruns, stalled, waited, gaps, total / sample_rate, play_start, position,
                    tuple(stall_positions), tuple(stall_segments), tuple(stall_times), tuple(leads))


# ---- small statistics -------------------------------------------------------------------


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between order statistics
    (numpy's default method); None for no values (JSON null, unlike NaN)."""
    xs = sorted(float(v) for v in values)
    if not xs:
        return None
    if not 0.0 <= q <= 100.0:
        raise ValueError("q must be within [0, 100]")
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def percentile_above(values: Iterable[float], above: int, q: float) -> float | None:
    """The q-th percentile of `values` together with `above` more values known only to
    exceed every one of them (sessions that never finished: their ratio has no bound),
    interpolated as `percentile`; None when it depends on one of those unknown values."""
    xs = sorted(float(v) for v in values)
    count = len(xs) + max(0, above)
    if count == 0:
        return None
    if not 0.0 <= q <= 100.0:
        raise ValueError("q must be within [0, 100]")
    pos = (count - 1) * q / 100.0
    lo = math.floor(pos)
    frac = pos - lo
    if lo >= len(xs) or (frac > 0 and lo + 1 >= len(xs)):
        return None
    return xs[lo] if frac == 0 else xs[lo] + (xs[lo + 1] - xs[lo]) * frac


def covered_s(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length of the union of (start, end) intervals (an empty or reversed one
    covers nothing): overlapping ones are counted once."""
    total, reach = 0.0, -math.inf
    for a, b in sorted((a, b) for a, b in intervals if b > a):
        if b <= reach:
            continue
        total += b - max(a, reach)
        reach = b
    return total


def summary_ms(values_s: Iterable[float], qs: tuple[float, ...] = (50, 95, 99)) -> dict[str, float | None]:
    """{"p50": ..., "p95": ..., "p99": ..., "max": ..., "n": ...} in milliseconds."""
    xs = [float(v) for v in values_s]
    out: dict[str, float | None] = {f"p{q:g}": _ms(percentile(xs, q)) for q in qs}
    out["max"] = _ms(max(xs)) if xs else None
    out["n"] = len(xs)
    return out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is 0 (a ratio that does not exist)."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def text_ready_time(text_end: int, sends: Sequence[tuple[float, int]],
                    flushes: Sequence[tuple[float, int]] = ()) -> float | None:
    """When a segment ending at character `text_end` could be spoken.

    sends:   (time, characters sent so far) after each text message, in order.
    flushes: (time, characters sent so far) of each flush.
    The segment's text was complete when its last character was sent; a segment that
    the flush closed (it ends exactly where the text stood at a flush that came at or
    after that moment) is ready at the flush.
    """
    last_byte = next((t for t, n in sends if n >= text_end), None)
    if last_byte is None:
        return None
    for t, n in flushes:
        if n == text_end and t >= last_byte:
            return t
    return last_byte


def text_first_byte_time(text_start: int, sends: Sequence[tuple[float, int]]) -> float | None:
    """When the first character of a segment starting at character `text_start` was sent
    (`sends` as for `text_ready_time`); None when it never was. In stream mode the model
    reads a segment while it arrives, so this, not its end, is where its wait begins."""
    return next((t for t, n in sends if n > text_start), None)
