"""One context of a `/v1/tts/stream` socket (`gateway.ws`): its runtime state, how it is
opened (encoder + engine session) and how its text goes into the engine session.

Its audio coming back out is `gateway.ws_pump`; the writer tells it what really left
(`_ContextRuntime.on_sent`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from engine.frontend.text import strip_stream_markdown
from engine.types import SessionOptions

from .audio import ENGINE_RATE, Encoder, EncoderOptions, make_encoder
from .errors import not_ready_reason
from .protocol import ContextSettings, ProtocolError, Speak, StreamText
from .segmenter import Segment
from .ws_writer import _Item


class SendEvent(Protocol):
    """The connection's `send_event` (`gateway.ws._Connection.send_event`)."""

    def __call__(
        self,
        event: dict[str, Any] | Callable[[], dict[str, Any]],
        ctx: _ContextRuntime | None = None,
        segment: Segment | None = None,
    ) -> None: ...


@dataclass
class _ContextRuntime:
    cid: str
    settings: ContextSettings
    session: Any  # engine.session.Session
    encoder: Encoder
    header: bytes
    pending: deque = field(default_factory=deque)  # ("utt", uid, Segment) | ("flush", first id, last id)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    pump: asyncio.Task | None = None
    # `_settle` runs for a flush or an end: apart from the reader, which must not wait
    # behind the socket's backpressure (a `cancel` after it would wait too).
    settling: set = field(default_factory=set)
    settle_queued: bool = False  # a `settle_soon` task has not taken the lock yet
    cancelled: bool = False
    ended: bool = False
    done: bool = False
    # Timeline at the output rate: out_base samples were produced before the engine
    # sample in_base (both move when the encoder is drained at a flush).
    in_samples: int = 0
    in_base: int = 0
    out_base: int = 0
    out_produced: int = 0
    current_uid: str | None = None
    segments_submitted: int = 0
    # Filled by the writer as frames really leave.
    sent_samples: int = 0
    heard_text_end: int = 0
    segments_started_sent: int = 0
    first_submit_at: float | None = None
    first_audio_seen: bool = False
    streaming: "_StreamSegment | None" = None  # stream mode: the utterance taking text
    # Stream mode: a segment whose utterance could not open: its later words are dropped
    # (one error per segment, never an utterance opened mid-segment without its start).
    stream_failed: int | None = None
    # Stream mode: the next piece of text starts a line (the context's start, or after a
    # newline), where a heading's or a quote's mark is markdown (`strip_stream_markdown`).
    line_start: bool = True
    count_audio: Callable[[float], None] | None = None  # seconds of audio sent (the metrics' counter)
    # Seconds from the first segment's submission to its first audio frame leaving (the
    # metrics' first-audio histogram): timed at the send, after encoding and the queue,
    # as the HTTP route times its first bytes.
    first_audio: Callable[[float], None] | None = None

    @property
    def rate(self) -> int:
        return self.settings.format.sample_rate

    def timeline_offset(self) -> int:
        """Output-rate sample index of the next engine sample."""
        return self.out_base + round((self.in_samples - self.in_base) * self.rate / ENGINE_RATE)

    def on_sent(self, item: _Item) -> None:
        if item.samples and not self.first_audio_seen and self.first_submit_at is not None:
            self.first_audio_seen = True
            if self.first_audio is not None:
                self.first_audio(time.monotonic() - self.first_submit_at)
        self.sent_samples += item.samples
        if item.samples and self.count_audio is not None:
            self.count_audio(item.samples / self.rate)
        if item.segment is not None:
            self.heard_text_end = item.segment.end
            self.segments_started_sent += 1

    # -- text in -----------------------------------------------------------------------

    async def speak(self, cmd: Speak, send_event: SendEvent) -> None:
        """Submit the command's segments, each one utterance (`pending`: the pump matches
        the engine's events to them, in order)."""
        for seg in cmd.segments:
            if not seg.speakable:
                continue
            try:
                uid = await self.session.submit(seg.text.strip(), utterance_id=f"{self.cid}-{seg.index}")
            except Exception as exc:
                send_event(ProtocolError("synthesis_failed", _refusal(exc, seg.index), self.cid).event(), self)
                continue
            if self.first_submit_at is None:
                self.first_submit_at = time.monotonic()
            self.pending.append(("utt", uid, seg))
            self.segments_submitted += 1

    async def stream_text(self, cmd: StreamText, send_event: SendEvent) -> None:
        """Stream mode: feed words to the open streamed utterance (opening it first)."""
        line_start = self.line_start
        if cmd.text:
            self.line_start = cmd.text.rstrip(" \t").endswith("\n")
        if self.stream_failed == cmd.index:
            if cmd.close:
                self.stream_failed = None
            return
        cur = self.streaming
        if cur is None or cur.index != cmd.index:
            if cur is not None:  # cannot happen with StreamCutter; never leave one open
                cur.feed.close()
            try:
                uid, feed = await self.session.submit_stream(utterance_id=f"{self.cid}-{cmd.index}")
            except Exception as exc:
                self.streaming = None
                self.stream_failed = None if cmd.close else cmd.index
                send_event(ProtocolError("synthesis_failed", _refusal(exc, cmd.index), self.cid).event(), self)
                return
            cur = self.streaming = _StreamSegment(cmd.index, cmd.start, feed)
            if self.first_submit_at is None:
                self.first_submit_at = time.monotonic()
            self.pending.append(("utt", uid, cur))
            self.segments_submitted += 1
        cur.text += cmd.text
        cur.text_at = time.monotonic()
        # The cutter hands out complete words (`StreamCutter`), which the LM may read now
        # rather than with the next word; its copy without markdown marks.
        cur.feed.append(strip_stream_markdown(cmd.text, line_start), word_end=True)
        if cmd.close:
            cur.reason = cmd.reason
            cur.feed.close()
            self.streaming = None


@dataclass
class _StreamSegment:
    """Stream mode: a segment whose text is still arriving (one engine utterance)."""

    index: int
    start: int
    feed: Any  # engine.text_stream.TextFeed
    text: str = ""
    reason: str = "stream"
    text_at: float = field(default_factory=time.monotonic)  # when its last words came

    def snapshot(self) -> Segment:
        return Segment(self.index, self.text, self.start, self.start + len(self.text), self.reason)  # type: ignore[arg-type]


def _refusal(exc: Exception, segment: int) -> str:
    """A `synthesis_failed` message for a segment the engine would not take: its reason
    first (`EngineError.code`: `unsupported`, `session_closed`, ...), as for one it failed."""
    return f"{getattr(exc, 'code', 'engine_error')}: {exc} (segment {segment})"


def new_encoder(settings: ContextSettings, options: EncoderOptions | None) -> Encoder:
    return make_encoder(settings.format.name, settings.format.sample_rate, options)


async def open_runtime(gw: Any, cid: str, settings: ContextSettings, voice: Any,
                       base_options: SessionOptions) -> _ContextRuntime | ProtocolError:
    """Encoder and engine session of a new context, for its voice's prompt. Refusals
    the client can act on come back as errors; anything else raises, but never with
    an engine session left open. It waits for nothing unless it fails."""
    # Before the engine session: an encoder that cannot be built (no libopus) then
    # has nothing to clean up.
    encoder = new_encoder(settings, gw.settings.audio)
    options = dataclasses.replace(
        base_options, mode=settings.effective_mode, instruction=settings.instruction, speed=settings.speed,
        language=settings.language,
    )
    try:
        session = gw.engine.open_session(voice, options)
    except Exception as exc:
        if getattr(exc, "code", None) == "not_ready":  # the gateway knows why (a drain, too)
            return ProtocolError("not_ready", not_ready_reason(gw), cid)
        return ProtocolError("internal_error", str(exc), cid)
    try:
        raw_id = cid.encode("utf-8")
        return _ContextRuntime(cid, settings, session, encoder, bytes([len(raw_id)]) + raw_id,
                               count_audio=gw.metrics.add_audio_seconds,
                               first_audio=gw.metrics.observe_first_audio)
    except BaseException:
        with contextlib.suppress(Exception):
            await session.abort()
        raise
