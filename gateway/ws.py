"""The streaming WebSocket endpoint `/v1/tts/stream` (protocol: docs/protocol.md).

I/O only: protocol rules live in `gateway.protocol` (sans-I/O), text cutting in
`gateway.segmenter`, encoding in `gateway.audio`. Per socket there are

* one reader task: parse a frame, run the state machine, execute its commands (here,
  `_Connection`, with the socket's lifecycle);
* one start task per context whose voice must first be loaded (`gateway.ws_starts`): the
  commands for that context wait in order behind it, the other contexts' (a cancel, say)
  do not;
* one writer task draining a byte-bounded queue (`gateway.ws_writer.FrameWriter`): audio
  producers wait when it is full, so a client that does not read stops the engine instead
  of growing memory, and a monitor disconnects it (4001) once its oldest frame is too old;
* one pump task per context: engine `AudioChunk`s -> encoded frames + events
  (`gateway.ws_pump`; a context's runtime and text submission: `gateway.ws_context`);
* one monitor task: lag, idle timeout, keepalive and periodic stats (`gateway.ws_monitor`).

All state is per connection (`_Connection` and the parts it holds); nothing is kept on
the module.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from typing import Any, Callable

from starlette.websockets import WebSocket, WebSocketDisconnect

from .audio import ENGINE_RATE
from .errors import not_ready_reason
from .protocol import (
    CLOSE_INTERNAL,
    CLOSE_NORMAL,
    CLOSE_POLICY,
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
    parse_client_message,
)
from .segmenter import Segment
from .ws_context import _ContextRuntime
from .ws_monitor import ConnectionMonitor
from .ws_pump import AudioPump
from .ws_starts import ContextStarts, _Starting
from .ws_writer import FrameWriter, _dumps, _Item  # noqa: F401  (_dumps, _Item: imported from here by the tests)

log = logging.getLogger(__name__)


def _default_settings(gw: Any) -> ContextSettings:
    return ContextSettings(voice=str(getattr(gw.settings, "default_voice", "default")))


class _Connection:
    """One socket: its lifecycle (tasks, stop, teardown), its reader and the dispatch of
    the state machine's commands to the parts that carry them out (`ContextStarts`,
    `AudioPump`, `ConnectionMonitor`, the contexts' runtimes, the `FrameWriter`)."""

    def __init__(self, websocket: WebSocket, gw: Any) -> None:
        self.ws = websocket
        self.gw = gw
        self.limits: WsLimits = getattr(gw.settings, "ws", None) or WsLimits()
        self.state = ConnectionState(_default_settings(gw), self.limits)
        self.session_id = "ws-" + uuid.uuid4().hex[:10]
        self.writer = FrameWriter(websocket.send_text, websocket.send_bytes, self.limits.max_pending_bytes)
        self.contexts: dict[str, _ContextRuntime] = {}
        self.pump = AudioPump(self)
        self.starts = ContextStarts(self)
        self.monitor = ConnectionMonitor(self)
        self.stop = asyncio.Event()
        self.close_code: int | None = None
        self.close_reason = ""
        self.drain_before_close = False
        self.last_client_at = time.monotonic()
        self._writer_task: asyncio.Task | None = None

    @property
    def starting(self) -> dict[str, _Starting]:
        """The contexts being started in the background."""
        return self.starts.starting

    @property
    def _start_tasks(self) -> set[asyncio.Task[None]]:
        return self.starts.tasks  # the tests look at them here

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
            asyncio.create_task(self.monitor.run(), name=f"{self.session_id}-monitor"),
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
        await self.starts.cancel_all()
        for rt in list(self.contexts.values()):
            await self.pump.stop_context(rt)
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

    def slow_consumer(self, why: str) -> None:
        if self.stop.is_set():
            return
        log.info("%s: slow consumer (%s), closing", self.session_id, why)
        self.gw.metrics.error("slow_consumer")
        self.request_close(CLOSE_SLOW_CONSUMER, "slow consumer")

    def maybe_close(self) -> None:
        if self.state.closing and not self.state.contexts:
            self.request_close(CLOSE_NORMAL, "bye", drain=True)

    # -- the reader --------------------------------------------------------------------

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
        for cid in [c for c in self.state.contexts if c not in self.contexts and c not in self.starts.starting]:
            self.state.context_finished(cid)
            self.send_event(ProtocolError("internal_error", "context could not be started", cid).event())

    # -- the monitor's round over the contexts -----------------------------------------

    async def check_contexts(self, now: float) -> None:
        """Contexts whose engine failed end; stream-mode utterances gone quiet close."""
        await self.pump.end_failed_contexts()
        await self._end_idle_streams(now)

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
            self.slow_consumer(f"over {self.writer.max_event_bytes} bytes of events queued")

    async def _execute(self, cmd: Command) -> None:
        if await self.starts.hold(cmd):
            return  # behind its context's start (`_Starting`)
        if isinstance(cmd, StartContext) and not self.starts.at_once(cmd.settings.voice):
            await self.starts.begin(cmd)
            return
        await self.run_command(cmd)

    async def run_command(self, cmd: Command) -> None:
        if isinstance(cmd, Send):
            self.send_event(cmd.event)
        elif isinstance(cmd, StartContext):
            # Here from a backlog only when its id ended while its start caught up, and
            # was opened again: started in its turn, in that task (a cancel stops it).
            await self.starts.start(cmd)
        elif isinstance(cmd, Speak):
            rt = self.contexts.get(cmd.context_id)
            if rt is None or rt.cancelled:
                return  # the context failed to start; its error was sent already
            await rt.speak(cmd, self.send_event)
        elif isinstance(cmd, StreamText):
            rt = self.contexts.get(cmd.context_id)
            if rt is None or rt.cancelled:
                return
            await rt.stream_text(cmd, self.send_event)
        elif isinstance(cmd, FlushMark):
            rt = self.contexts.get(cmd.context_id)
            if rt is None:
                # Not open: answered at once with flush_id 0. A flush id of its own means the
                # state machine opened it in this frame and its start was refused: the final
                # error was its last event.
                if cmd.flush_id == 0:
                    self.send_event({"type": "flushed", "context_id": cmd.context_id, "flush_id": 0})
            else:
                tail = rt.pending[-1] if rt.pending else None
                if tail is not None and tail[0] == "flush":
                    # Flushes in a row settle together: one entry for all of them, or a
                    # client sending flushes behind a long utterance grows the list per message.
                    rt.pending[-1] = ("flush", tail[1], cmd.flush_id)
                else:
                    rt.pending.append(("flush", cmd.flush_id, cmd.flush_id))
                self.pump.settle_soon(rt)
        elif isinstance(cmd, EndContext):
            rt = self.contexts.get(cmd.context_id)
            if rt is not None:
                rt.ended = True
                with contextlib.suppress(Exception):
                    await rt.session.finish()
                self.pump.settle_soon(rt)
        elif isinstance(cmd, CancelContext):
            await self._cancel(cmd.context_id)
        elif isinstance(cmd, CloseAfterDrain):
            self.maybe_close()
        elif isinstance(cmd, SetStatsInterval):
            self.monitor.stats_interval_s = cmd.interval_ms / 1000.0

    async def _cancel(self, cid: str) -> None:
        await self.starts.cancel(cid)  # a start still running opens nothing
        rt = self.contexts.get(cid)
        if rt is None:
            self.state.context_finished(cid)
            self.send_event({"type": "cancelled", "context_id": cid, "active": False, "audio_samples": 0, "text_end": 0, "segments_started": 0})
            self.maybe_close()  # a `close` may have waited for the start
            return
        await self.pump.stop_context(rt)
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
        self.maybe_close()

    def forget(self, rt: _ContextRuntime) -> None:
        """The context is over: its id free again, in the state machine too."""
        if self.contexts.get(rt.cid) is rt:
            del self.contexts[rt.cid]
            self.state.context_finished(rt.cid)
            if not self.state.contexts:  # the idle clock starts when the last context ends
                self.last_client_at = max(self.last_client_at, time.monotonic())


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
