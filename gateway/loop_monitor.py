"""How late the event loop runs: the one number that says the host, not the GPU, is full.

Every WebSocket, every engine event hand-off and the vLLM output handling share this
process's one event loop (and its GIL with the flow/vocoder stage's worker thread). A
task that asks to wake every `interval` seconds and records how late it woke measures
the wait that every other callback on the loop saw at that moment. Lag near zero
means the host keeps up; lag of tens of milliseconds shows up directly as chunk gaps.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Callable


class LoopLagMonitor:
    def __init__(self, observe: Callable[[float], None], interval: float = 0.05) -> None:
        if interval <= 0:
            raise ValueError("interval must be > 0")
        self.interval = interval
        self._observe = observe
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="loop-lag-monitor")

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.interval
            await asyncio.sleep(self.interval)
            self._observe(max(0.0, loop.time() - due))

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
