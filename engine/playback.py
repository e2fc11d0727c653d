"""When a session's listener runs out of audio, and so when each of its chunks is due."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .config import DEADLINE_MARGIN_S


def chunk_due(now: float, runs_out: float, ahead_s: float, margin: float = DEADLINE_MARGIN_S) -> tuple[float, bool]:
    """(deadline, urgent) of a chunk: when its audio is needed (time.monotonic seconds, for
    the stage's "deadline" policy) and whether the listener is, or is about to be, waiting
    for it in silence (what lets a first chunk jump the "first_chunks" queue).

    The listener plays what it was delivered until `runs_out` (`PlaybackClock`; -inf:
    nothing yet), then the `ahead_s` seconds of audio that play before this chunk and are
    not delivered yet: made but still queued, or generated speech tokens of earlier
    utterances not yet made into audio. The chunk is due when all of that has played, less
    `margin`. With nothing delivered and nothing ahead it is needed now: first-audio
    latency. A due time already past is a stall in progress, and the older it is the
    longer the listener has waited."""
    if ahead_s <= 0:
        if runs_out == -math.inf:
            return now, True
        due = runs_out - margin
    else:
        due = max(now, runs_out) + ahead_s - margin
    return (due, True) if due <= now else (due, False)


@dataclass
class PlaybackClock:
    """When a session's listener runs out of audio, from what was delivered and when.
    Playback starts at a delivery into silence and then runs at the sample rate; audio
    delivered after the previous audio ran out starts it again (what a client that plays
    on arrival does)."""

    sample_rate: int
    started_at: float | None = None
    samples: int = 0

    def runs_out(self) -> float:
        """time.monotonic seconds at which the delivered audio ends (-inf: none yet)."""
        return -math.inf if self.started_at is None else self.started_at + self.samples / self.sample_rate

    def deliver(self, samples: int, now: float) -> None:
        if self.started_at is None or now >= self.runs_out():
            self.started_at, self.samples = now, 0
        self.samples += samples
