"""The streaming WebSocket endpoint `/v1/tts/stream` (protocol: docs/protocol.md).

I/O only: protocol rules live in `gateway.protocol` (sans-I/O), text cutting in
`gateway.segmenter`, encoding in `gateway.audio`. Per socket there are

* one reader task: parse a frame, run the state machine, execute its commands;
* one start task per context whose voice must first be loaded (`_Starting`): the
  commands for that context wait in order behind it, the other contexts' (a cancel, say)
  do not;
* one writer task draining a byte-bounded queue (`FrameWriter`): audio producers wait
  when it is full, so a client that does not read stops the engine instead of growing
  memory, and a monitor disconnects it (4001) once its oldest frame is too old;
* one pump task per context: engine `AudioChunk`s -> encoded frames + events;
* one monitor task: lag, idle timeout, keepalive and periodic stats.

All state is per connection (`_Connection`); nothing is kept on the module.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from starlette.websockets import WebSocket, WebSocketDisconnect

from engine.frontend.text import strip_stream_markdown
from engine.types import AudioChunk, SessionOptions, UtteranceError

from .audio import ENGINE_RATE, Encoder, make_encoder
from .errors import ApiError, not_ready_reason
from .protocol import (
    CLOSE_GOING_AWAY,
    CLOSE_IDLE,
    CLOSE_INTERNAL,
    CLOSE_NORMAL,
    CLOSE_POLICY,
    CLOSE_SERVICE_RESTART,
    CLOSE_SLOW_CONSUMER,
    CLOSE_TRY_LATER,
    CancelContext,
    CloseAfterDrain,
    Command,
    ConnectionState,
    ContextSettings,
    EndContext,
    FlushMark,
    ProtocolError,
    Send,
    SetStatsInterval,
    Speak,
    StartContext,
    StreamText,
    WsLimits,
    echo,
    parse_client_message,
)
from .segmenter import Segment

log = logging.getLogger(__name__)


def _dumps(event: dict[str, Any]) -> str:
    text = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        # A lone surrogate a client sent as a JSON escape ("\ud800") and we echo back
        # (a voice name, a context id hint) cannot go out as UTF-8: escape everything.
        text = json.dumps(event, ensure_ascii=True, separators=(",", ":"))
    return text


# ---- the socket writer --------------------------------------------------------------


@dataclass
class _Item:
    # A callable is rendered when the frame is sent (events whose numbers must count
    # every frame sent before them, e.g. `cancelled`).
    data: str | bytes | Callable[[], str]
    ctx: "_ContextRuntime | None"
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
        ctx: "_ContextRuntime | None" = None,
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

    def drop(self, ctx: "_ContextRuntime") -> None:
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


# ---- per-context runtime --------------------------------------------------------------


@dataclass
class _ContextRuntime:
    cid: str
    settings: ContextSettings
    session: Any  # engine.engine.Session
    encoder: Encoder
    header: bytes
    pending: deque = field(default_factory=deque)  # ("utt", uid, Segment) | ("flush", id)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    pump: asyncio.Task | None = None
    # `_settle` runs for a flush or an end: apart from the reader, which must not wait
    # behind the socket's backpressure (a `cancel` after it would wait too).
    settling: set = field(default_factory=set)
    settle_queued: bool = False  # a `_settle_soon` task has not taken the lock yet
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


@dataclass
class _Starting:
    """A context being started (`_Connection._start_then_catch_up`): its voice may take a
    disk read, a re-made prompt or a database round trip, which must not hold the reader,
    so the context's own commands that come meanwhile wait here, in order, and run once it
    has started (or been refused). A cancel does not wait: while the voice loads it marks
    the start `cancelled` (the load goes on, to be cached, and opens nothing), after that
    it stops the task."""

    backlog: deque[Command] = field(default_factory=deque)
    cancelled: bool = False
    loaded: bool = False  # the start itself is over (opened or refused): catching up
    task: asyncio.Task[None] | None = None  # set right after the task is made


# Commands one starting context holds for it; past them the reader waits for the start, as
# it did for every start before starts ran in the background (a client sending this much
# while its voice loads is not reading its own errors either).
STARTING_BACKLOG_MAX = 256


def _context_of(cmd: Command) -> str | None:
    """The context a command is about (a `Send` by its event's id), None for the socket's."""
    if isinstance(cmd, Send):
        cid = cmd.event.get("context_id") if isinstance(cmd.event, dict) else None
        return cid if isinstance(cid, str) else None
    cid = getattr(cmd, "context_id", None)
    return cid if isinstance(cid, str) else None


# ---- the connection -------------------------------------------------------------------


def _default_settings(gw: Any) -> ContextSettings:
    return ContextSettings(voice=str(getattr(gw.settings, "default_voice", "default")))


class _Connection:
    def __init__(self, websocket: WebSocket, gw: Any) -> None:
        self.ws = websocket
        self.gw = gw
        self.limits: WsLimits = getattr(gw.settings, "ws", None) or WsLimits()
        self.state = ConnectionState(_default_settings(gw), self.limits)
        self.session_id = "ws-" + uuid.uuid4().hex[:10]
        self.writer = FrameWriter(websocket.send_text, websocket.send_bytes, self.limits.max_pending_bytes)
        self.contexts: dict[str, _ContextRuntime] = {}
        self.starting: dict[str, _Starting] = {}
        # Every start task still running, a cancelled start's load included; at most
        # `max_contexts` (the reader waits for one to end before it makes another).
        self._start_tasks: set[asyncio.Task[None]] = set()
        self.stop = asyncio.Event()
        self.close_code: int | None = None
        self.close_reason = ""
        self.drain_before_close = False
        self.last_client_at = time.monotonic()
        self.stats_interval_s = 0.0
        self.last_stats_at = time.monotonic()
        self._writer_task: asyncio.Task | None = None
        # Tests may fix engine options (e.g. a deterministic speech-token count).
        self.base_options: SessionOptions = getattr(gw, "session_defaults", None) or SessionOptions()

    # -- lifecycle ---------------------------------------------------------------------

    def request_close(self, code: int | None, reason: str = "", drain: bool = False) -> None:
        if self.close_code is None and not self.stop.is_set():
            self.close_code, self.close_reason, self.drain_before_close = code, reason, drain
        self.stop.set()

    async def run(self) -> None:
        limits = self.limits
        self.send_event(
            {
                "type": "session_started",
                "session_id": self.session_id,
                "model": getattr(self.gw.engine, "model_name", ""),
                "engine_sample_rate": getattr(self.gw.engine, "sample_rate", ENGINE_RATE),
                "defaults": {k: v for k, v in self.state.defaults.describe().items() if k in ("voice", "format", "sample_rate", "audio")},
                "limits": {k: v for k, v in dataclasses.asdict(limits).items() if k != "per_message_deflate"},
            }
        )
        self._writer_task = asyncio.create_task(self._writer_loop(), name=f"{self.session_id}-writer")
        tasks = [
            self._writer_task,
            asyncio.create_task(self._reader_loop(), name=f"{self.session_id}-reader"),
            asyncio.create_task(self._monitor_loop(), name=f"{self.session_id}-monitor"),
        ]
        for t in tasks:
            t.add_done_callback(self._on_task_done)
        try:
            await self.stop.wait()
            tasks[1].cancel()  # read no more
            if self.drain_before_close and self.close_code is not None:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.writer.wait_drained(), timeout=max(1.0, limits.max_lag_s))
        finally:
            # In a task of its own: a second cancel of this one must not cut it short (its
            # engine sessions would stay open and its tasks run on).
            await asyncio.shield(asyncio.ensure_future(self._teardown(tasks)))

    async def _teardown(self, tasks: list[asyncio.Task]) -> None:
        # First the reader and the starts: either would otherwise open contexts after the
        # stop below.
        tasks[1].cancel()
        await asyncio.wait([tasks[1]])
        starts = list(self._start_tasks)
        for t in starts:
            t.cancel()
        if starts:
            await asyncio.wait(starts)
        for rt in list(self.contexts.values()):
            await self._stop_context(rt)
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t
        if self.close_code is not None:
            # A slow consumer may not even take the close frame: do not wait for it.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.ws.close(code=self.close_code, reason=self.close_reason), timeout=2.0)

    def _on_task_done(self, task: asyncio.Task) -> None:
        """A socket task ended. Each one runs until the socket stops; one that ended
        before (a bug) would leave the socket open with nobody reading, writing or
        watching, and the idle timeout is off while a context is open: close it."""
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None and self.stop.is_set():
            return  # it asked for the close itself
        log.error("%s: task %s ended unexpectedly", self.session_id, task.get_name(), exc_info=exc)
        writer_alive = task is not self._writer_task
        if writer_alive:  # the client may still learn why
            self.send_event(ProtocolError("internal_error", "internal error").event())
        self.request_close(CLOSE_INTERNAL, "internal error", drain=writer_alive)

    async def _writer_loop(self) -> None:
        try:
            await self.writer.run()
        except (WebSocketDisconnect, RuntimeError, OSError):
            self.request_close(None)  # the client went away mid-send
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("websocket writer failed")
            self.request_close(CLOSE_INTERNAL, "internal error")

    async def _reader_loop(self) -> None:
        try:
            while True:
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    self.request_close(None)
                    return
                self.last_client_at = time.monotonic()
                raw = message.get("text")
                if raw is None:
                    raw = message.get("bytes") or b""
                await self._handle_frame(raw)
        except asyncio.CancelledError:
            raise
        except (WebSocketDisconnect, RuntimeError):
            self.request_close(None)

    async def _handle_frame(self, raw: str | bytes) -> None:
        """One client frame. A bug met while handling it costs that frame an
        `internal_error`, never the reader: a dead reader leaves the socket hanging."""
        failed = False
        commands: list[Command] = []
        try:
            commands = self.state.handle(parse_client_message(raw, self.limits))
        except Exception:
            log.exception("%s: websocket message failed", self.session_id)
            failed = True
        for cmd in commands:
            try:
                await self._execute(cmd)
            except Exception:
                log.exception("websocket command %r failed", cmd)
                failed = True
        if failed:
            self.send_event(ProtocolError("internal_error", "internal error").event())
            self._drop_unstarted_contexts()  # only now: a later command may have started them

    def _drop_unstarted_contexts(self) -> None:
        """After a failed frame: contexts the state machine opened but that never got a
        runtime would swallow their text and keep `close` waiting for a `done` that
        cannot come. Between frames every context of the state has a runtime or is
        being started."""
        for cid in [c for c in self.state.contexts if c not in self.contexts and c not in self.starting]:
            self.state.context_finished(cid)
            self.send_event(ProtocolError("internal_error", "context could not be started", cid).event())

    async def _monitor_loop(self) -> None:
        limits = self.limits
        while True:
            periods = [0.5, limits.max_lag_s / 4, limits.idle_timeout_s / 4]
            if limits.keepalive_interval_s > 0:
                periods.append(limits.keepalive_interval_s / 2)
            if limits.stream_idle_s > 0:
                periods.append(limits.stream_idle_s / 4)
            if self.stats_interval_s > 0:
                periods.append(self.stats_interval_s / 2)
            await asyncio.sleep(max(0.02, min(periods)))
            now = time.monotonic()
            if self.writer.lag() > limits.max_lag_s:
                self._slow_consumer(f"lag {self.writer.lag():.1f}s")
                return
            await self._end_failed_contexts()
            await self._end_idle_streams(now)
            if not self.state.contexts and now - self.last_client_at > limits.idle_timeout_s:
                self.request_close(CLOSE_IDLE, "idle timeout", drain=True)
                return
            if not self.state.contexts and getattr(self.gw, "draining", False):
                if getattr(self.gw, "engine_failure", None):
                    self.request_close(CLOSE_SERVICE_RESTART, "engine failed: the gateway restarts", drain=True)
                else:
                    self.request_close(CLOSE_GOING_AWAY, "server shutting down", drain=True)
                return
            if limits.keepalive_interval_s > 0 and self.writer.idle and now - self.writer.last_sent_at > limits.keepalive_interval_s:
                self.send_event({"type": "keepalive", "t": round(now, 3)})
            if self.stats_interval_s > 0 and now - self.last_stats_at >= self.stats_interval_s:
                self.last_stats_at = now
                self.send_event(self._stats())

    async def _end_idle_streams(self, now: float) -> None:
        """Stream mode: an utterance whose client went quiet mid-sentence ends with the
        words it has (`stream_idle_s`), so that its LM request does not hold a batch slot
        for as long as the socket lives."""
        idle_s = self.limits.stream_idle_s
        if idle_s <= 0:
            return
        for rt in list(self.contexts.values()):
            cur = rt.streaming
            if cur is not None and not rt.cancelled and now - cur.text_at > idle_s:
                for cmd in self.state.stream_idle(rt.cid):
                    await self._execute(cmd)

    def _stats(self) -> dict[str, Any]:
        engine_stats: dict[str, Any] = {}
        with contextlib.suppress(Exception):
            engine_stats = dataclasses.asdict(self.gw.engine.stats())
        return {
            "type": "stats",
            "contexts": len(self.state.contexts),
            "queued_bytes": self.writer.queued_bytes,
            "frames_sent": self.writer.frames_sent,
            "bytes_sent": self.writer.bytes_sent,
            "engine": engine_stats,
        }

    def _slow_consumer(self, why: str) -> None:
        if self.stop.is_set():
            return
        log.info("%s: slow consumer (%s), closing", self.session_id, why)
        self.gw.metrics.error("slow_consumer")
        self.request_close(CLOSE_SLOW_CONSUMER, "slow consumer")

    # -- commands ----------------------------------------------------------------------

    def send_event(
        self,
        event: dict[str, Any] | Callable[[], dict[str, Any]],
        ctx: _ContextRuntime | None = None,
        segment: Segment | None = None,
    ) -> None:
        if isinstance(event, dict) and event.get("type") == "error":
            self.gw.metrics.error(str(event.get("code")))
            cid = event.get("context_id")
            if cid is not None and cid not in self.state.contexts:
                # The context was refused, never opened or ended by the server: no `done`
                # or `cancelled` will follow, so the error is its last event.
                event = {**event, "final": True}
        if not self.writer.put_event(event, ctx, segment):
            # Events only pile up this far when the client provokes them without reading.
            self._slow_consumer(f"over {self.writer.max_event_bytes} bytes of events queued")

    async def _execute(self, cmd: Command) -> None:
        cid = _context_of(cmd)
        starting = self.starting.get(cid) if cid is not None else None
        if starting is not None and not isinstance(cmd, CancelContext):
            if len(starting.backlog) < STARTING_BACKLOG_MAX:
                starting.backlog.append(cmd)  # behind its context's start, in order
                return
            assert starting.task is not None
            await asyncio.wait([starting.task])
            await self._execute(cmd)  # its start is over: as any command now
            return
        if isinstance(cmd, StartContext) and not self._starts_at_once(cmd.settings.voice):
            while len(self._start_tasks) >= self.limits.max_contexts:
                await asyncio.wait(self._start_tasks, return_when=asyncio.FIRST_COMPLETED)
            starting = self.starting[cmd.context_id] = _Starting()
            task = starting.task = asyncio.create_task(self._start_then_catch_up(cmd, starting),
                                                       name=f"{self.session_id}-{cmd.context_id}-start")
            self._start_tasks.add(task)
            task.add_done_callback(self._start_tasks.discard)
            return
        await self._run(cmd)

    def _starts_at_once(self, voice: str) -> bool:
        """Whether a context of this voice starts without waiting (its prompt cached, or
        the id unknown: refused at once), so that it starts right here, in the order of
        the client's messages; otherwise in the background (`_Starting`)."""
        peek = getattr(self.gw.voices, "cached_prompt", None)
        if peek is None:
            return True  # a store that cannot tell
        try:
            return peek(voice) is not None
        except KeyError:
            return True

    async def _start_then_catch_up(self, cmd: StartContext, starting: _Starting) -> None:
        """A context's start, then the commands for it that came meanwhile (`_Starting`).
        An error in one of them costs that command an `internal_error`, as in the reader."""
        cid = cmd.context_id
        try:
            await self._start_context(cmd, starting)
            starting.loaded = True
            while starting.backlog and not starting.cancelled:  # it grows while a command here waits
                queued = starting.backlog.popleft()
                try:
                    await self._run(queued)
                except Exception:
                    log.exception("websocket command %r failed", queued)
                    self.send_event(ProtocolError("internal_error", "internal error").event())
        except Exception:  # a bug: the id must not stay open with nothing left to end it
            log.exception("%s: context %s failed to start", self.session_id, cid)
            if cid not in self.contexts and self.starting.get(cid) is starting:  # not cancelled or reopened
                self.state.context_finished(cid)
                self.send_event(ProtocolError("internal_error", "context could not be started", cid).event())
                self._maybe_close()
        finally:
            # No await since the backlog was last found empty: a command for this
            # context from now on runs directly.
            if self.starting.get(cid) is starting:
                del self.starting[cid]

    async def _run(self, cmd: Command) -> None:
        if isinstance(cmd, Send):
            self.send_event(cmd.event)
        elif isinstance(cmd, StartContext):
            # Here from a backlog only when its id ended while its start caught up, and
            # was opened again: started in its turn, in that task (a cancel stops it).
            await self._start_context(cmd)
        elif isinstance(cmd, Speak):
            await self._speak(cmd)
        elif isinstance(cmd, StreamText):
            await self._stream_text(cmd)
        elif isinstance(cmd, FlushMark):
            rt = self.contexts.get(cmd.context_id)
            if rt is None:
                # Not open: answered at once with flush_id 0. A flush id of its own means the
                # state machine opened it in this frame and its start was refused: the final
                # error was its last event.
                if cmd.flush_id == 0:
                    self.send_event({"type": "flushed", "context_id": cmd.context_id, "flush_id": 0})
            else:
                rt.pending.append(("flush", cmd.flush_id))
                self._settle_soon(rt)
        elif isinstance(cmd, EndContext):
            rt = self.contexts.get(cmd.context_id)
            if rt is not None:
                rt.ended = True
                with contextlib.suppress(Exception):
                    await rt.session.finish()
                self._settle_soon(rt)
        elif isinstance(cmd, CancelContext):
            await self._cancel(cmd.context_id)
        elif isinstance(cmd, CloseAfterDrain):
            self._maybe_close()
        elif isinstance(cmd, SetStatsInterval):
            self.stats_interval_s = cmd.interval_ms / 1000.0

    async def _start_context(self, cmd: StartContext, starting: _Starting | None = None) -> None:
        """Open the context (voice, encoder, engine session, pump) and say so. `starting`:
        it runs in the background, and a cancel may come while its voice loads."""
        cid, settings = cmd.context_id, cmd.settings
        started: _ContextRuntime | ProtocolError
        try:
            voice = await self._voice(cid, settings.voice)
            if starting is not None and starting.cancelled:
                return  # its `cancelled` was sent: open nothing (no await from here on)
            started = voice if isinstance(voice, ProtocolError) else await self._open_runtime(cid, settings, voice)
        except Exception:
            log.exception("%s: context %s failed to start", self.session_id, cid)
            started = ProtocolError("internal_error", "context could not be started", cid)
        if starting is not None and starting.cancelled:
            return
        if isinstance(started, ProtocolError):
            # The state machine opened it: without this its later text would be dropped
            # silently and `close` would wait for a `done` that never comes.
            self.state.context_finished(cid)
            self.send_event(started.event())
            self._maybe_close()  # a start in the background may end after the `close` came
            return
        rt = started
        self.contexts[cid] = rt
        rt.pump = asyncio.create_task(self._guarded(rt, self._pump_events, "pump"),
                                      name=f"{self.session_id}-{cid}-pump")
        # Not tied to the context: a cancel right after must not drop it (its `cancelled`
        # says `active: true`, which a client reads as after its `context_started`).
        self.send_event({"type": "context_started", "context_id": cid, **settings.describe()})

    async def _voice(self, cid: str, voice_id: str) -> Any:
        """The voice's prompt, or the refusal the client can act on."""
        try:
            return await self.gw.voices.get_prompt(voice_id)
        except KeyError:
            return ProtocolError("voice_not_found", f"voice {echo(voice_id)!r} is not registered", cid)
        except ApiError as exc:  # e.g. the shared voice store is unreachable
            return ProtocolError(exc.code, exc.message, cid)

    async def _open_runtime(self, cid: str, settings: ContextSettings, voice: Any) -> _ContextRuntime | ProtocolError:
        """Encoder and engine session of a new context, for its voice's prompt. Refusals
        the client can act on come back as errors; anything else raises, but never with
        an engine session left open. It waits for nothing unless it fails."""
        # Before the engine session: an encoder that cannot be built (no libopus) then
        # has nothing to clean up.
        encoder = self._new_encoder(settings)
        options = dataclasses.replace(
            self.base_options, mode=settings.effective_mode, instruction=settings.instruction, speed=settings.speed,
            language=settings.language,
        )
        try:
            session = self.gw.engine.open_session(voice, options)
        except Exception as exc:
            if getattr(exc, "code", None) == "not_ready":  # the gateway knows why (a drain, too)
                return ProtocolError("not_ready", not_ready_reason(self.gw), cid)
            return ProtocolError("internal_error", str(exc), cid)
        try:
            raw_id = cid.encode("utf-8")
            return _ContextRuntime(cid, settings, session, encoder, bytes([len(raw_id)]) + raw_id,
                                   count_audio=self.gw.metrics.add_audio_seconds,
                                   first_audio=self.gw.metrics.observe_first_audio)
        except BaseException:
            with contextlib.suppress(Exception):
                await session.abort()
            raise

    async def _speak(self, cmd: Speak) -> None:
        rt = self.contexts.get(cmd.context_id)
        if rt is None or rt.cancelled:
            return  # the context failed to start; its error was sent already
        for seg in cmd.segments:
            if not seg.speakable:
                continue
            try:
                uid = await rt.session.submit(seg.text.strip(), utterance_id=f"{rt.cid}-{seg.index}")
            except Exception as exc:
                self.send_event(ProtocolError("synthesis_failed", _refusal(exc, seg.index), rt.cid).event(), rt)
                continue
            if rt.first_submit_at is None:
                rt.first_submit_at = time.monotonic()
            rt.pending.append(("utt", uid, seg))
            rt.segments_submitted += 1

    async def _stream_text(self, cmd: StreamText) -> None:
        """Stream mode: feed words to the open streamed utterance (opening it first)."""
        rt = self.contexts.get(cmd.context_id)
        if rt is None or rt.cancelled:
            return
        line_start = rt.line_start
        if cmd.text:
            rt.line_start = cmd.text.rstrip(" \t").endswith("\n")
        if rt.stream_failed == cmd.index:
            if cmd.close:
                rt.stream_failed = None
            return
        cur = rt.streaming
        if cur is None or cur.index != cmd.index:
            if cur is not None:  # cannot happen with StreamCutter; never leave one open
                cur.feed.close()
            try:
                uid, feed = await rt.session.submit_stream(utterance_id=f"{rt.cid}-{cmd.index}")
            except Exception as exc:
                rt.streaming = None
                rt.stream_failed = None if cmd.close else cmd.index
                self.send_event(ProtocolError("synthesis_failed", _refusal(exc, cmd.index), rt.cid).event(), rt)
                return
            cur = rt.streaming = _StreamSegment(cmd.index, cmd.start, feed)
            if rt.first_submit_at is None:
                rt.first_submit_at = time.monotonic()
            rt.pending.append(("utt", uid, cur))
            rt.segments_submitted += 1
        cur.text += cmd.text
        cur.text_at = time.monotonic()
        # The cutter hands out complete words (`StreamCutter`), which the LM may read now
        # rather than with the next word; its copy without markdown marks.
        cur.feed.append(strip_stream_markdown(cmd.text, line_start), word_end=True)
        if cmd.close:
            cur.reason = cmd.reason
            cur.feed.close()
            rt.streaming = None

    async def _cancel(self, cid: str) -> None:
        starting = self.starting.pop(cid, None)
        if starting is not None:
            # Still loading its voice: it will open nothing, and ends here without a
            # runtime (`cancelled` says not active; it sent no `context_started`).
            # Catching up on its commands: the task stops in the one in progress (a
            # reopened start's load too), and a runtime it has is stopped below.
            starting.cancelled = True
            if starting.loaded and starting.task is not None:
                starting.task.cancel()
                await asyncio.wait([starting.task])
            # What the state machine had to say about the context's messages still goes
            # out (a text too long, say), before its `cancelled`.
            for queued in starting.backlog:
                if isinstance(queued, Send):
                    self.send_event(queued.event)
            starting.backlog.clear()
        rt = self.contexts.get(cid)
        if rt is None:
            self.state.context_finished(cid)
            self.send_event({"type": "cancelled", "context_id": cid, "active": False, "audio_samples": 0, "text_end": 0, "segments_started": 0})
            self._maybe_close()  # a `close` may have waited for the start
            return
        await self._stop_context(rt)
        # Rendered when sent: a frame that was mid-send at cancel time is counted too.
        self.send_event(
            lambda: {
                "type": "cancelled",
                "context_id": cid,
                "active": True,
                "audio_samples": rt.sent_samples,
                "text_end": rt.heard_text_end,
                "segments_started": rt.segments_started_sent,
            }
        )
        self._maybe_close()

    async def _stop_context(self, rt: _ContextRuntime, keep_queued: bool = False) -> None:
        """Barge-in: no more frames, engine work aborted, queued frames dropped (unless
        `keep_queued`: what was made is still sent)."""
        if not keep_queued:
            rt.cancelled = True
            self.writer.drop(rt)
        current = asyncio.current_task()
        tasks = [t for t in (rt.pump, *rt.settling) if t is not None and t is not current]
        for task in tasks:
            task.cancel()
        if tasks:
            # `wait`, not `await task`: a cancel of the caller itself (the reader, at the
            # socket's end) must reach it, not pass for the task's own and be swallowed.
            await asyncio.wait(tasks)
        with contextlib.suppress(Exception):
            await rt.session.abort()
        self._forget(rt)

    def _forget(self, rt: _ContextRuntime) -> None:
        if self.contexts.get(rt.cid) is rt:
            del self.contexts[rt.cid]
            self.state.context_finished(rt.cid)
            if not self.state.contexts:  # the idle clock starts when the last context ends
                self.last_client_at = max(self.last_client_at, time.monotonic())

    def _maybe_close(self) -> None:
        if self.state.closing and not self.state.contexts:
            self.request_close(CLOSE_NORMAL, "bye", drain=True)

    # -- audio -------------------------------------------------------------------------

    async def _emit_frames(self, rt: _ContextRuntime, frames: list[bytes], seg: Segment | None) -> None:
        fmt = rt.settings.format
        for payload in frames:
            samples = fmt.samples_in(payload)
            if rt.settings.audio == "base64":
                event = {
                    "type": "audio",
                    "context_id": rt.cid,
                    "segment_index": seg.index if seg is not None else None,
                    "data": base64.b64encode(payload).decode("ascii"),
                    "audio_offset": rt.out_produced,
                }
                data: str | bytes = json.dumps(event, separators=(",", ":"))
            else:
                data = rt.header + payload
            rt.out_produced += samples
            await self.writer.put_audio(_Item(data, rt, len(data), samples=samples))

    def _new_encoder(self, settings: ContextSettings) -> Encoder:
        return make_encoder(settings.format.name, settings.format.sample_rate, self.gw.settings.audio)

    async def _drain_encoder(self, rt: _ContextRuntime) -> None:
        """End of a flush/context: everything encoded so far goes out. The encoder stays:
        an Opus decoder on the client runs on (a fresh encoder's warm-up replaced the last
        6.5 ms before every flush)."""
        await self._emit_frames(rt, await self.gw.encode_pool.flush(rt.encoder), None)
        rt.in_base, rt.out_base = rt.in_samples, rt.out_produced

    def _settle_soon(self, rt: _ContextRuntime) -> None:
        """`_settle` in a task of the context's (serialised with its pump by `rt.lock`). One
        that has not taken the lock yet settles every mark queued by then: a client sending
        flushes without reading starts no more tasks than the lock is taken."""
        if rt.settle_queued:
            return
        rt.settle_queued = True
        task = asyncio.create_task(self._guarded(rt, self._settle, "settling"),
                                   name=f"{self.session_id}-{rt.cid}-settle")
        rt.settling.add(task)
        task.add_done_callback(rt.settling.discard)

    async def _settle(self, rt: _ContextRuntime) -> None:
        """Emit `flushed`/`done` whose audio is complete (head of the pending list)."""
        async with rt.lock:
            rt.settle_queued = False  # marks queued from here on need a settle of their own
            while rt.pending and rt.pending[0][0] == "flush" and not rt.cancelled:
                _, flush_id = rt.pending.popleft()
                await self._drain_encoder(rt)
                if rt.cancelled:
                    return
                self.send_event({"type": "flushed", "context_id": rt.cid, "flush_id": flush_id}, rt)
            if not rt.pending and not rt.ended and not rt.cancelled and rt.in_samples > rt.in_base:
                # Nothing more to say until the client sends text: what the encoder holds
                # (a resampler's filter delay, a partial frame: 30-90 ms) is the end of the
                # last word, which must not wait for the next one.
                await self._drain_encoder(rt)
            if rt.ended and not rt.pending and not rt.done and not rt.cancelled:
                rt.done = True
                await self._drain_encoder(rt)
                if rt.cancelled:
                    return
                cstate = self.state.contexts.get(rt.cid)
                self.send_event(
                    {
                        "type": "done",
                        "context_id": rt.cid,
                        "audio_samples": rt.out_produced,
                        "duration_ms": round(rt.out_produced * 1000 / rt.rate, 1),
                        "segments": rt.segments_submitted,
                        "text_chars": cstate.text_chars if cstate is not None else None,
                    },
                    rt,
                )
                self._forget(rt)
                with contextlib.suppress(Exception):
                    await rt.session.abort()  # frees the engine session (already finished)
                self._maybe_close()

    async def _guarded(self, rt: _ContextRuntime, work: Callable[[_ContextRuntime], Awaitable[None]],
                       what: str) -> None:
        """A task of the context's (its pump, a settle): an error in it ends the context.
        `work` is called here, not by the caller: a task cancelled before its first step
        then leaves no coroutine that was never awaited."""
        try:
            await work(rt)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s of context %s failed", what, rt.cid)
            await self._fail_context(rt, "audio pipeline failed")

    async def _pump_events(self, rt: _ContextRuntime) -> None:
        async for ev in rt.session.events():
            if rt.cancelled:
                return
            async with rt.lock:
                finished = await self._on_engine_event(rt, ev)
            if finished:
                await self._settle(rt)
        # The engine stream ended: anything still pending will never come.
        if not rt.cancelled and any(p[0] == "utt" for p in rt.pending):
            rt.pending = deque(p for p in rt.pending if p[0] != "utt")
            await self._settle(rt)

    async def _fail_context(self, rt: _ContextRuntime, message: str) -> None:
        """The context's audio can no longer be produced: end it as a cancel would (engine
        session aborted, its frames dropped, its id free again), with an error instead
        of `done`, so neither the engine session nor a `close` waits on it forever."""
        if rt.cancelled:
            return  # already being stopped: its client asked for that
        await self._stop_context(rt)
        self.send_event(ProtocolError("internal_error", message, rt.cid).event())
        self._maybe_close()

    async def _end_failed_contexts(self) -> None:
        """End the contexts whose engine can serve no more (its stage process died or
        stalled, its vLLM engine core died): each of their segments would fail, so the
        context ends now with `engine_failed` rather than skip segment after segment. The
        audio it made is still sent, the error after it. Per context: in a pool of
        engines the other engines' contexts go on (until the gateway's drain for a
        restart ends, `Settings.exit_on_engine_failure`)."""
        for rt in list(self.contexts.values()):
            failure = getattr(getattr(rt.session, "engine", None), "failure", None)
            # Each await below lets the client and the pumps run: a context may have ended
            # (done, cancelled) or its id been opened again since the list was taken.
            if failure is None or rt.cancelled or rt.done or self.contexts.get(rt.cid) is not rt:
                continue
            # Before anything can run: no more audio of it, its id free, the error queued
            # after the audio it made (and marked final).
            if rt.pump is not None:
                rt.pump.cancel()
            self._forget(rt)
            self.send_event(ProtocolError("engine_failed", f"the engine can serve no more: {failure}", rt.cid).event())
            await self._stop_context(rt, keep_queued=True)  # the pump's end, the session's abort
            self._maybe_close()

    async def _on_engine_event(self, rt: _ContextRuntime, ev: AudioChunk | UtteranceError) -> bool:
        """Handle one engine event; True when an utterance finished."""
        head = rt.pending[0] if rt.pending else None
        seg: Segment | None = head[2] if head is not None and head[0] == "utt" and head[1] == ev.utterance_id else None
        if isinstance(seg, _StreamSegment):
            seg = seg.snapshot()  # stream mode: the text received so far
        if isinstance(ev, UtteranceError):
            where = f" (text {seg.start}..{seg.end})" if seg is not None else ""
            self.send_event(ProtocolError("synthesis_failed", f"{ev.code}: {ev.message}{where}", rt.cid).event(), rt)
            if seg is not None:
                rt.pending.popleft()
            rt.current_uid = None
            return True
        if seg is not None and rt.current_uid != ev.utterance_id:
            rt.current_uid = ev.utterance_id
            offset = rt.timeline_offset()
            self.send_event(
                {
                    "type": "segment_started",
                    "context_id": rt.cid,
                    "segment_index": seg.index,
                    "text": seg.text,
                    "text_start": seg.start,
                    "text_end": seg.end,
                    "audio_offset": offset,
                    "audio_offset_ms": round(offset * 1000 / rt.rate, 1),
                },
                rt,
                seg,
            )
        pcm = ev.pcm
        frames = await self.gw.encode_pool.encode(rt.encoder, pcm)
        rt.in_samples += int(pcm.size)
        await self._emit_frames(rt, frames, seg)
        if ev.is_last:
            if seg is not None:
                rt.pending.popleft()
            rt.current_uid = None
            return True
        return False


def _refusal(exc: Exception, segment: int) -> str:
    """A `synthesis_failed` message for a segment the engine would not take: its reason
    first (`EngineError.code`: `unsupported`, `session_closed`, ...), as for one it failed."""
    return f"{getattr(exc, 'code', 'engine_error')}: {exc} (segment {segment})"


async def _refuse(websocket: WebSocket, error: ProtocolError, close_code: int, reason: str) -> None:
    await websocket.send_text(json.dumps(error.event()))
    await websocket.close(code=close_code, reason=reason)


async def tts_websocket(websocket: WebSocket) -> None:
    """Starlette WebSocket endpoint, mounted at /v1/tts/stream."""
    gw = websocket.app.state.gw
    await websocket.accept()
    # Accept first, then refuse with an event + close code that a browser can read.
    if not gw.auth.check_websocket(websocket):
        gw.metrics.error("unauthorized")
        await _refuse(websocket, ProtocolError("unauthorized", "missing or invalid API key"), CLOSE_POLICY, "unauthorized")
        return
    if not getattr(gw.engine, "ready", True):
        gw.metrics.error("not_ready")
        await _refuse(websocket, ProtocolError("not_ready", not_ready_reason(gw)), CLOSE_TRY_LATER, "not ready")
        return
    # uvicorn's limit_concurrency does not count WebSocket upgrades: enforced here.
    refusal = gw.metrics.session_refusal(getattr(gw.settings, "max_sessions", None))
    if refusal is not None:
        gw.metrics.error("too_many_sessions")
        await _refuse(websocket, ProtocolError("too_many_sessions", refusal), CLOSE_TRY_LATER, "too many sessions")
        return
    gw.metrics.session_opened()
    try:
        await _Connection(websocket, gw).run()
    finally:
        gw.metrics.session_closed()
