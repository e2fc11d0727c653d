"""How late the event loop runs: the one number that says the host, not the GPU, is full.

Every WebSocket, every engine event hand-off and the vLLM output handling share this
process's one event loop (and its GIL with the flow/vocoder stage's worker thread). A
task that asks to wake every `interval` seconds and records how late it woke measures
the wait that every other callback on the loop saw at that moment. Lag near zero
means the host keeps up; lag of tens of milliseconds shows up directly as chunk gaps.

It also reports the CPU time the loop's thread used (`time.thread_time` read on that
thread): the loop's own load, apart from the engine's and the encoders' threads in the
same process. Its share of wall time says how close the loop is to saturation.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Callable


class LoopLagMonitor:
    def __init__(self, observe: Callable[[float], None], interval: float = 0.05,
                 add_cpu: Callable[[float], None] | None = None) -> None:
        if interval <= 0:
            raise ValueError("interval must be > 0")
        self.interval = interval
        self._observe = observe
        self._add_cpu = add_cpu
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="loop-lag-monitor")

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        cpu = time.thread_time()
        while True:
            # perf_counter, not loop.time(): uvloop's clock counts whole milliseconds, which
            # would leave the histogram's 1-2 ms buckets rounding noise.
            due = time.perf_counter() + self.interval
            await asyncio.sleep(self.interval)
            self._observe(max(0.0, time.perf_counter() - due))
            if self._add_cpu is not None:
                now = time.thread_time()
                self._add_cpu(now - cpu)
                cpu = now

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
