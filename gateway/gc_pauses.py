"""How long the cyclic garbage collector stops this process, per generation.

A collection holds the GIL from start to end: every thread waits for it, so a long full
pass reads as event-loop lag, late audio and a slow stage round at once. The collector
reports its passes through `gc.callbacks`; this times them.

The counters are written only by the callback, and the collector runs one pass at a time,
so there is one writer; readers (a scrape) may see a pass's count before its seconds.
The callback takes no lock: a pass can start inside any allocation, including one made
while the same thread holds some other lock, and waiting on that lock would deadlock.
"""

from __future__ import annotations

import contextlib
import gc
import time
from typing import Any

GENERATIONS = 3


class GcPauses:
    def __init__(self) -> None:
        self.collections = [0] * GENERATIONS
        self.seconds = [0.0] * GENERATIONS
        self.longest = 0.0  # seconds, any generation
        self._began: float | None = None

    def start(self) -> None:
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)

    def stop(self) -> None:
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        if self._began is None:  # registered in the middle of a pass
            return
        took = time.perf_counter() - self._began
        self._began = None
        generation = min(int(info.get("generation", GENERATIONS - 1)), GENERATIONS - 1)
        self.collections[generation] += 1
        self.seconds[generation] += took
        self.longest = max(self.longest, took)
