"""The socket writer of `/v1/tts/stream` (`gateway.ws`): one consumer per socket for its
outgoing frames, bounded by the bytes queued.

It knows nothing of the protocol beyond a frame's owner (`FrameOwner`: a context, whose
frames are dropped once it is cancelled and who hears of each frame sent).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Protocol

from .segmenter import Segment


def _dumps(event: dict[str, Any]) -> str:
    text = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        # A lone surrogate a client sent as a JSON escape ("\ud800") and we echo back
        # (a voice name, a context id hint) cannot go out as UTF-8: escape everything.
        text = json.dumps(event, ensure_ascii=True, separators=(",", ":"))
    return text


class FrameOwner(Protocol):
    """The context a frame belongs to (`gateway.ws_context._ContextRuntime`), as the writer
    sees it: its frames go out unless it is `cancelled`, and it hears of each one sent
    (its timeline and metrics count what really left)."""

    cancelled: bool

    def on_sent(self, item: _Item) -> None: ...


@dataclass
class _Item:
    # A callable is rendered when the frame is sent (events whose numbers must count
    # every frame sent before them, e.g. `cancelled`).
    data: str | bytes | Callable[[], str]
    ctx: FrameOwner | None
    nbytes: int
    samples: int = 0  # output samples carried (audio frames)
    segment: Segment | None = None  # set on segment_started events
    enqueued_at: float = 0.0
    event: bool = False  # queued by put_event (not subject to the producers' wait)


class FrameWriter:
    """Single consumer of a socket's outgoing frames, bounded by queued bytes.

    `put_audio` waits while more than `max_bytes` are queued (backpressure to the
    engine). Events (`put_event`) never wait: they are small and must not block the
    reader. But a client may provoke them without reading (a `flush` per frame), so
    they have a hard cap of their own, `max_event_bytes`: past it `put_event` refuses
    and the caller disconnects the client. Items of a cancelled context are dropped.
    """

    def __init__(
        self,
        send_text: Callable[[str], Awaitable[None]],
        send_bytes: Callable[[bytes], Awaitable[None]],
        max_bytes: int,
        clock: Callable[[], float] = time.monotonic,
        max_event_bytes: int | None = None,
    ) -> None:
        self._send_text = send_text
        self._send_bytes = send_bytes
        self._max_bytes = max_bytes
        self.max_event_bytes = 2 * max_bytes if max_event_bytes is None else max_event_bytes
        self._clock = clock
        self._queue: deque[_Item] = deque()
        self._has_items = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._sending: _Item | None = None
        self.queued_bytes = 0
        self.event_bytes = 0  # the part of queued_bytes that put_event queued
        self.frames_sent = 0
        self.bytes_sent = 0
        self.last_sent_at = clock()

    def lag(self) -> float:
        """Age of the oldest frame not yet fully handed to the socket."""
        oldest = self._sending or (self._queue[0] if self._queue else None)
        return 0.0 if oldest is None else self._clock() - oldest.enqueued_at

    @property
    def idle(self) -> bool:
        return not self._queue and self._sending is None

    async def put_audio(self, item: _Item) -> None:
        while self.queued_bytes >= self._max_bytes:
            if item.ctx is not None and item.ctx.cancelled:
                return
            self._room.clear()
            await self._room.wait()
        if item.ctx is not None and item.ctx.cancelled:
            return
        self._push(item)

    def put_event(
        self,
        event: dict[str, Any] | Callable[[], dict[str, Any]],
        ctx: FrameOwner | None = None,
        segment: Segment | None = None,
    ) -> bool:
        """Queue an event; False (and nothing queued) when events are over their cap."""
        if callable(event):
            render = event
            item = _Item(lambda: _dumps(render()), ctx, 256, segment=segment, event=True)  # 256: a size estimate
        else:
            data = _dumps(event)
            item = _Item(data, ctx, len(data), segment=segment, event=True)
        if self.event_bytes + item.nbytes > self.max_event_bytes:
            return False
        self._push(item)
        return True

    def _push(self, item: _Item) -> None:
        item.enqueued_at = self._clock()
        self._queue.append(item)
        self.queued_bytes += item.nbytes
        if item.event:
            self.event_bytes += item.nbytes
        self._has_items.set()
        self._idle.clear()

    def drop(self, ctx: FrameOwner) -> None:
        """Remove every queued item of ``ctx`` (barge-in) and release waiting producers."""
        self._queue = deque(i for i in self._queue if i.ctx is not ctx)
        self.queued_bytes = sum(i.nbytes for i in self._queue)
        self.event_bytes = sum(i.nbytes for i in self._queue if i.event)
        self._room.set()
        if self.idle:
            self._idle.set()

    async def wait_drained(self) -> None:
        await self._idle.wait()

    async def run(self) -> None:
        while True:
            while not self._queue:
                self._has_items.clear()
                self._idle.set()
                await self._has_items.wait()
            item = self._queue.popleft()
            self.queued_bytes -= item.nbytes
            if item.event:
                self.event_bytes -= item.nbytes
            if self.queued_bytes < self._max_bytes:
                self._room.set()
            if item.ctx is not None and item.ctx.cancelled:
                continue
            self._sending = item
            try:
                if isinstance(item.data, bytes):
                    await self._send_bytes(item.data)
                elif isinstance(item.data, str):
                    await self._send_text(item.data)
                else:
                    await self._send_text(item.data())
            finally:
                self._sending = None
            self.frames_sent += 1
            self.bytes_sent += item.nbytes
            self.last_sent_at = self._clock()
            if item.ctx is not None:
                item.ctx.on_sent(item)
