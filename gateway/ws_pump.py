"""The audio side of a `/v1/tts/stream` socket's contexts (`gateway.ws`).

Per context, one pump task turns the engine's events (`AudioChunk`, `UtteranceError`)
into encoded frames and events for the writer, and settle tasks say `flushed` / `done`
once the audio before them is out. `AudioPump` makes those tasks, so it is also what
stops a context (a cancel, a failure, the socket's end): its tasks cancelled, its engine
session aborted, its queued frames dropped.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
from collections import deque
from typing import Any, Awaitable, Callable, Protocol

from engine.types import AudioChunk, UtteranceError

from .protocol import ConnectionState, ProtocolError
from .segmenter import Segment
from .ws_context import SendEvent, _ContextRuntime, _StreamSegment
from .ws_writer import FrameWriter, _Item

# The socket's log keeps its one name, whichever of its modules writes.
log = logging.getLogger("gateway.ws")


class PumpHost(Protocol):
    """What a context's audio needs of its connection (`gateway.ws._Connection`)."""

    gw: Any
    session_id: str
    writer: FrameWriter
    state: ConnectionState
    contexts: dict[str, _ContextRuntime]

    send_event: SendEvent

    def forget(self, rt: _ContextRuntime) -> None: ...

    def maybe_close(self) -> None: ...


class AudioPump:
    """A connection's per-context audio tasks: engine events -> frames, settles, stops."""

    def __init__(self, conn: PumpHost) -> None:
        self.conn = conn

    def start(self, rt: _ContextRuntime) -> None:
        """The context's pump task, for as long as its engine session has events."""
        rt.pump = asyncio.create_task(self._guarded(rt, self._pump_events, "pump"),
                                      name=f"{self.conn.session_id}-{rt.cid}-pump")

    # -- frames ------------------------------------------------------------------------

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
            await self.conn.writer.put_audio(_Item(data, rt, len(data), samples=samples))

    async def _drain_encoder(self, rt: _ContextRuntime) -> None:
        """End of a flush/context: everything encoded so far goes out. The encoder stays:
        an Opus decoder on the client runs on (a fresh encoder's warm-up replaced the last
        6.5 ms before every flush)."""
        await self._emit_frames(rt, await self.conn.gw.encode_pool.flush(rt.encoder), None)
        rt.in_base, rt.out_base = rt.in_samples, rt.out_produced

    # -- settling ----------------------------------------------------------------------

    def settle_soon(self, rt: _ContextRuntime) -> None:
        """`_settle` in a task of the context's (serialised with its pump by `rt.lock`). One
        that has not taken the lock yet settles every mark queued by then: a client sending
        flushes without reading starts no more tasks than the lock is taken."""
        if rt.settle_queued:
            return
        rt.settle_queued = True
        task = asyncio.create_task(self._guarded(rt, self._settle, "settling"),
                                   name=f"{self.conn.session_id}-{rt.cid}-settle")
        rt.settling.add(task)
        task.add_done_callback(rt.settling.discard)

    async def _settle(self, rt: _ContextRuntime) -> None:
        """Emit `flushed`/`done` whose audio is complete (head of the pending list)."""
        conn = self.conn
        async with rt.lock:
            rt.settle_queued = False  # marks queued from here on need a settle of their own
            while rt.pending and rt.pending[0][0] == "flush" and not rt.cancelled:
                _, first, last = rt.pending.popleft()
                await self._drain_encoder(rt)
                if rt.cancelled:
                    return
                for flush_id in range(first, last + 1):
                    conn.send_event({"type": "flushed", "context_id": rt.cid, "flush_id": flush_id}, rt)
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
                cstate = conn.state.contexts.get(rt.cid)
                conn.send_event(
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
                conn.forget(rt)
                with contextlib.suppress(Exception):
                    await rt.session.abort()  # frees the engine session (already finished)
                conn.maybe_close()

    # -- the pump ----------------------------------------------------------------------

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
            await self.fail_context(rt, "audio pipeline failed")

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

    async def _on_engine_event(self, rt: _ContextRuntime, ev: AudioChunk | UtteranceError) -> bool:
        """Handle one engine event; True when an utterance finished."""
        conn = self.conn
        head = rt.pending[0] if rt.pending else None
        seg: Segment | None = head[2] if head is not None and head[0] == "utt" and head[1] == ev.utterance_id else None
        if isinstance(seg, _StreamSegment):
            seg = seg.snapshot()  # stream mode: the text received so far
        if isinstance(ev, UtteranceError):
            where = f" (text {seg.start}..{seg.end})" if seg is not None else ""
            conn.send_event(ProtocolError("synthesis_failed", f"{ev.code}: {ev.message}{where}", rt.cid).event(), rt)
            if seg is not None:
                rt.pending.popleft()
            rt.current_uid = None
            return True
        if seg is not None and rt.current_uid != ev.utterance_id:
            rt.current_uid = ev.utterance_id
            offset = rt.timeline_offset()
            conn.send_event(
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
        frames = await conn.gw.encode_pool.encode(rt.encoder, pcm)
        rt.in_samples += int(pcm.size)
        await self._emit_frames(rt, frames, seg)
        if ev.is_last:
            if seg is not None:
                rt.pending.popleft()
            rt.current_uid = None
            return True
        return False

    # -- stopping ----------------------------------------------------------------------

    async def stop_context(self, rt: _ContextRuntime, keep_queued: bool = False) -> None:
        """Barge-in: no more frames, engine work aborted, queued frames dropped (unless
        `keep_queued`: what was made is still sent)."""
        if not keep_queued:
            rt.cancelled = True
            self.conn.writer.drop(rt)
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
        self.conn.forget(rt)

    async def fail_context(self, rt: _ContextRuntime, message: str) -> None:
        """The context's audio can no longer be produced: end it as a cancel would (engine
        session aborted, its frames dropped, its id free again), with an error instead
        of `done`, so neither the engine session nor a `close` waits on it forever."""
        if rt.cancelled:
            return  # already being stopped: its client asked for that
        await self.stop_context(rt)
        self.conn.send_event(ProtocolError("internal_error", message, rt.cid).event())
        self.conn.maybe_close()

    async def end_failed_contexts(self) -> None:
        """End the contexts whose engine can serve no more (its stage process died or
        stalled, its vLLM engine core died): each of their segments would fail, so the
        context ends now with `engine_failed` rather than skip segment after segment. The
        audio it made is still sent, the error after it. Per context: in a pool of
        engines the other engines' contexts go on (until the gateway's drain for a
        restart ends, `Settings.exit_on_engine_failure`)."""
        conn = self.conn
        for rt in list(conn.contexts.values()):
            failure = getattr(getattr(rt.session, "engine", None), "failure", None)
            # Each await below lets the client and the pumps run: a context may have ended
            # (done, cancelled) or its id been opened again since the list was taken.
            if failure is None or rt.cancelled or rt.done or conn.contexts.get(rt.cid) is not rt:
                continue
            # Before anything can run: no more audio of it, its id free, the error queued
            # after the audio it made (and marked final).
            if rt.pump is not None:
                rt.pump.cancel()
            conn.forget(rt)
            conn.send_event(ProtocolError("engine_failed", f"the engine can serve no more: {failure}", rt.cid).event())
            await self.stop_context(rt, keep_queued=True)  # the pump's end, the session's abort
            conn.maybe_close()
