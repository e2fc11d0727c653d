"""Whether the LM still makes tokens while requests wait for them.

vLLM's engine core can be alive and answer nothing (a GPU hang, a deadlock in its
process): vLLM raises only when the process dies, so every session would wait for
tokens for ever. The engine counts the LM streams that wait on the LM (open, and not
waiting for more text of their own, as text-in streaming does between arrivals) and
when any of them last got a token. `LMWatch.stalled` names a stall once some have waited
`timeout_s` and none got a token meanwhile; the engine then reports itself failed, and
the gateway drains and exits for a restart (`Engine.failure`).

Overload is not a stall: requests queued behind full batches wait, but the ones running
still get tokens. A wait is counted from when the first stream began to wait on the
LM, never from an idle LM's last token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, TypeVar

T = TypeVar("T")


@dataclass
class LMWatch:
    """Counts kept by the engine's LM streams (`opened`, `token`, `closed`, `text`)."""

    timeout_s: float
    clock: Callable[[], float] = time.monotonic
    streams: int = 0  # LM streams open
    awaiting_text: int = 0  # of them, waiting for their next piece of text
    progress_at: float = field(default=0.0)  # the last token, or when streams began to wait on the LM

    @property
    def waiting(self) -> int:
        """Streams that wait on the LM."""
        return self.streams - self.awaiting_text

    def _change(self, streams: int, awaiting: int) -> None:
        before = self.waiting
        self.streams, self.awaiting_text = streams, awaiting
        if before <= 0 < self.waiting:
            self.progress_at = self.clock()

    def opened(self) -> None:
        self._change(self.streams + 1, self.awaiting_text)

    def closed(self) -> None:
        self._change(self.streams - 1, self.awaiting_text)

    def token(self) -> None:
        self.progress_at = self.clock()

    def pause(self) -> None:
        """Nothing can be judged for a while (the watcher itself did not run on time): the
        wait counts from now."""
        self.progress_at = self.clock()

    async def text(self, source: AsyncIterator[T]) -> AsyncIterator[T]:
        """`source` (a stream's text arrivals), counting the stream as waiting for text, not
        on the LM, while the LM backend waits for its next item."""
        while True:
            self._change(self.streams, self.awaiting_text + 1)
            try:
                item = await anext(source)
            except StopAsyncIteration:
                return
            finally:
                self._change(self.streams, self.awaiting_text - 1)
            yield item

    def stalled(self) -> str | None:
        """Why the LM looks stuck, or None: streams wait on it and it has made no token for
        `timeout_s` (0: never)."""
        if self.timeout_s <= 0 or self.waiting <= 0:
            return None
        silent = self.clock() - self.progress_at
        if silent < self.timeout_s:
            return None
        return (f"the LM made no token for {silent:.0f} s while {self.waiting} request(s) waited on it "
                f"(engine.lm_stall_timeout_s {self.timeout_s:g})")
