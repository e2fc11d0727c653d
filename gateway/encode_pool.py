"""Runs the costly stream encoders (Opus) on worker threads instead of the event loop.

One event loop serves every WebSocket of the process. Opus at complexity 10 takes ~13 ms
of CPU per second of speech, so a few hundred streams would saturate the loop on
encoding alone and every session's frames, events and reads would queue behind it.
libopus is called through ctypes, which releases the GIL, so the threads encode
streams in parallel on several cores. Encoders that cost less than the hop (PCM,
G.711) stay on the loop.

Each stream still has one encoder, used by one caller at a time: the WebSocket code calls
it under the context's lock and awaits each call before the next, so a stream's frames
keep their order.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

import numpy as np

from .audio import Encoder

T = TypeVar("T")


class EncodePool:
    def __init__(self, threads: int) -> None:
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="encode") if threads > 0 else None

    async def encode(self, encoder: Encoder, pcm: np.ndarray) -> list[bytes]:
        return await self._run(encoder, lambda: encoder.encode(pcm))

    async def flush(self, encoder: Encoder) -> list[bytes]:
        return await self._run(encoder, encoder.flush)

    async def _run(self, encoder: Encoder, work: Callable[[], T]) -> T:
        if self._executor is None or encoder.inline:
            return work()
        try:
            job = self._executor.submit(work)
        except RuntimeError:  # shut down (the app is stopping): finish on the loop
            return work()
        fut = asyncio.wrap_future(job)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            # Not started yet: it never will be, and the caller may go at once (a barge-in
            # must not wait behind other streams' queued chunks). Running: the thread holds
            # the encoder, so wait until it lets go (one encode, milliseconds), through
            # any further cancellation, before the caller's clean-up can touch it.
            if not job.cancel():
                while not fut.done():
                    try:
                        await asyncio.wait([fut])
                    except asyncio.CancelledError:
                        pass
            raise

    def close(self) -> None:
        """Stop taking work. What is queued still runs on the threads (its callers get their
        frames), but the event loop does not wait for it."""
        if self._executor is not None:
            self._executor.shutdown(wait=False)
