"""Sans-I/O protocol: message parsing, the per-socket state machine, the frame writer."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.protocol import (
    CancelContext,
    CancelMessage,
    CloseAfterDrain,
    ConfigMessage,
    ConnectionState,
    ContextSettings,
    EndContext,
    FlushMark,
    ProtocolError,
    Send,
    SetStatsInterval,
    Speak,
    StartContext,
    TextMessage,
    WsLimits,
    parse_client_message,
)
from gateway.audio import EncoderOptions
from gateway.encode_pool import EncodePool
from gateway.ws import FrameWriter, _Item

LIMITS = WsLimits(max_message_bytes=1000, max_contexts=2, max_text_chars=50)


def parse(obj: Any) -> Any:
    return parse_client_message(obj if isinstance(obj, (str, bytes)) else json.dumps(obj), LIMITS)


def code(obj: Any) -> str:
    res = parse(obj)
    assert isinstance(res, ProtocolError), res
    return res.code


def test_parse_valid_messages() -> None:
    msg = parse({"type": "text", "context_id": "c-1", "text": "hi", "speed": 1.5, "format": "opus", "flush": True})
    assert isinstance(msg, TextMessage) and msg.text == "hi" and msg.flush and not msg.end
    assert msg.patch.speed == 1.5 and msg.patch.format == "opus"
    assert parse({"type": "cancel"}) == CancelMessage(None)
    assert parse({"type": "cancel", "context_id": "*"}) == CancelMessage(None)
    cfg = parse({"type": "config", "voice": "v", "segmentation": {"first_min_chars": 3}, "stats_interval_ms": 500, "extra": 1})
    assert isinstance(cfg, ConfigMessage) and cfg.stats_interval_ms == 500
    assert cfg.patch.segmentation is not None and cfg.patch.segmentation.first_min_chars == 3
    assert cfg.patch.segmentation.eager_ends is None  # unset: the socket's own stays
    waits = parse({"type": "config", "segmentation": {"eager_ends": False}})
    assert isinstance(waits, ConfigMessage) and waits.patch.segmentation is not None
    assert not waits.patch.segmentation.eager_ends


@pytest.mark.parametrize(
    "obj,expected",
    [
        ("{", "invalid_json"),
        ("null", "invalid_json"),
        (b"\x01\x02", "binary_not_supported"),
        ({"context_id": "a"}, "invalid_message"),
        ({"type": "sing"}, "unknown_type"),
        ({"type": "text", "context_id": "", "text": "x"}, "invalid_message"),
        ({"type": "text", "context_id": "a" * 65, "text": "x"}, "invalid_message"),
        ({"type": "text", "context_id": "a b", "text": "x"}, "invalid_message"),
        ({"type": "text", "context_id": "a", "text": 5}, "invalid_message"),
        ({"type": "text", "context_id": "a", "text": "x", "speed": 0.1}, "invalid_speed"),
        ({"type": "text", "context_id": "a", "text": "x", "speed": True}, "invalid_message"),
        ({"type": "text", "context_id": "a", "text": "x", "format": "mp3"}, "unsupported_format"),
        ({"type": "text", "context_id": "a", "text": "x", "format": "ulaw_8000", "sample_rate": 16000}, "unsupported_format"),
        ({"type": "text", "context_id": "a", "text": "x", "mode": "sing"}, "invalid_message"),
        ({"type": "text", "context_id": "a", "text": "x", "flush": "yes"}, "invalid_message"),
        ({"type": "config", "segmentation": {"max_chars": 2}}, "invalid_message"),
        ({"type": "config", "segmentation": {"eager_ends": "no"}}, "invalid_message"),
        ({"type": "config", "segmentation": {"eager_ends": 0}}, "invalid_message"),
        ({"type": "config", "stats_interval_ms": 5}, "invalid_message"),
        ("x" * 1001, "message_too_large"),
        (json.dumps({"type": "text", "context_id": "a", "text": "é" * 600}), "message_too_large"),  # bytes, not chars
    ],
)
def test_parse_errors_have_codes(obj: Any, expected: str) -> None:
    assert code(obj) == expected


def test_a_frame_too_large_to_parse_is_refused_naming_its_context() -> None:
    """The client learns which context's text was not taken, wherever the id sits in the
    frame; a context id spelled inside the text is text, not the frame's id."""
    tail = json.dumps({"type": "text", "text": "x" * 1200, "context_id": "turn-7"})
    err = parse_client_message(tail, LIMITS)
    assert isinstance(err, ProtocolError) and err.code == "message_too_large"
    assert err.event()["context_id"] == "turn-7"
    quoted = json.dumps({"type": "text", "text": 'say "context_id": "evil" ' * 60})
    err = parse_client_message(quoted, LIMITS)
    assert isinstance(err, ProtocolError) and err.code == "message_too_large" and err.context_id is None


@settings(max_examples=300, deadline=None, derandomize=True)
@given(raw=st.one_of(st.text(max_size=200), st.binary(max_size=50), st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=10),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.sampled_from(["type", "context_id", "text", "speed", "format", "segmentation", "voice"]), c, max_size=5),
    max_leaves=12,
).map(json.dumps)))
def test_parser_never_raises(raw: str | bytes) -> None:
    res = parse_client_message(raw, LIMITS)
    assert res is not None
    if isinstance(res, ProtocolError):
        assert res.code and res.message


def state() -> ConnectionState:
    return ConnectionState(ContextSettings(voice="default"), LIMITS)


def run(st_: ConnectionState, obj: Any) -> list[Any]:
    return st_.handle(parse(obj))


def test_a_contexts_segmentation_fields_lay_over_the_sockets() -> None:
    """server defaults < socket `config` < context, field by field: a context that sets only
    `max_chars` keeps the socket's `first_min_chars` (it had fallen back to the server's).
    Whether the fields fit together is checked over the settings they are laid on."""
    s = state()
    assert run(s, {"type": "config", "segmentation": {"first_min_chars": 3, "eager_ends": False}}) == []
    run(s, {"type": "text", "context_id": "a", "text": "x", "segmentation": {"max_chars": 200}})
    seg = s.contexts["a"].settings.segmentation
    assert (seg.first_min_chars, seg.max_chars, seg.eager_ends) == (3, 200, False)
    run(s, {"type": "text", "context_id": "b", "text": "x"})
    assert s.contexts["b"].settings.segmentation == replace(seg, max_chars=220)
    s.context_finished("a"), s.context_finished("b")
    # 3 <= 10 over this socket's settings; over the server's (first_min_chars 12) it would not fit.
    run(s, {"type": "text", "context_id": "c", "text": "x", "segmentation": {"max_chars": 10}})
    assert s.contexts["c"].settings.segmentation.max_chars == 10
    (refused,) = run(s, {"type": "text", "context_id": "d", "text": "x", "segmentation": {"max_chars": 2}})
    assert refused.event["code"] == "invalid_message" and refused.event["context_id"] == "d"
    assert "d" not in s.contexts


def test_first_text_opens_context_with_socket_defaults_and_overrides() -> None:
    s = state()
    assert run(s, {"type": "config", "format": "ulaw_8000", "voice": "alice", "stats_interval_ms": 200}) == [SetStatsInterval(200)]
    cmds = run(s, {"type": "text", "context_id": "a", "text": "Hi. The", "speed": 2})
    start, speak = cmds
    assert isinstance(start, StartContext)
    assert start.settings.voice == "alice" and start.settings.format.sample_rate == 8000 and start.settings.speed == 2
    assert isinstance(speak, Speak) and [seg.text for seg in speak.segments] == ["Hi."]
    # Settings are fixed per context; a later config affects only new contexts.
    run(s, {"type": "config", "format": "pcm_s16le", "sample_rate": 16000})
    assert s.contexts["a"].settings.format.name == "ulaw_8000"
    assert isinstance(run(s, {"type": "text", "context_id": "b", "text": "x"})[0], StartContext)
    assert s.contexts["b"].settings.format.sample_rate == 16000


def test_flush_end_and_reuse_of_ids() -> None:
    s = state()
    run(s, {"type": "text", "context_id": "a", "text": "no end"})
    speak, mark = run(s, {"type": "flush", "context_id": "a"})
    assert isinstance(speak, Speak) and speak.segments[0].text == "no end"
    assert mark == FlushMark("a", 1)
    assert run(s, {"type": "flush", "context_id": "a"}) == [FlushMark("a", 2)]
    cmds = run(s, {"type": "text", "context_id": "a", "text": " tail", "end": True})
    assert isinstance(cmds[0], Speak) and cmds[-1] == EndContext("a")
    err = run(s, {"type": "text", "context_id": "a", "text": "late"})[0]
    assert isinstance(err, Send) and err.event["code"] == "context_ended"
    s.context_finished("a")  # done was sent: the id is free again
    assert isinstance(run(s, {"type": "text", "context_id": "a", "text": "x"})[0], StartContext)


def test_limits_on_contexts_and_text() -> None:
    s = state()
    run(s, {"type": "open", "context_id": "a"})
    assert run(s, {"type": "open", "context_id": "a"})[0].event["code"] == "context_exists"
    run(s, {"type": "open", "context_id": "b"})
    assert run(s, {"type": "open", "context_id": "c"})[0].event["code"] == "too_many_contexts"
    assert "c" not in s.contexts
    assert run(s, {"type": "text", "context_id": "a", "text": "x" * 40}) == []
    err = run(s, {"type": "text", "context_id": "a", "text": "x" * 11})
    assert err[0].event["code"] == "text_too_long" and s.contexts["a"].text_chars == 40
    # the refused message's end still ends the context: the text before it is spoken
    cmds = run(s, {"type": "text", "context_id": "a", "text": "x" * 11, "end": True})
    assert cmds[0].event["code"] == "text_too_long" and isinstance(cmds[-1], EndContext)
    assert [seg.text for c in cmds if isinstance(c, Speak) for seg in c.segments] == ["x" * 40]
    assert s.contexts["a"].ended
    cmds = run(s, {"type": "text", "context_id": "b", "text": "y" * 41, "flush": True})
    assert cmds[-1] == FlushMark("b", 1)


def test_cancel_and_close() -> None:
    s = state()
    run(s, {"type": "text", "context_id": "a", "text": "x"})
    run(s, {"type": "text", "context_id": "b", "text": "y"})
    assert run(s, {"type": "cancel", "context_id": "zz"})[0].event == {
        "type": "cancelled", "context_id": "zz", "active": False, "audio_samples": 0, "text_end": 0, "segments_started": 0}
    assert run(s, {"type": "cancel"}) == [CancelContext("a"), CancelContext("b")]
    cmds = run(s, {"type": "close"})
    assert cmds[-1] == CloseAfterDrain() and EndContext("a") in cmds and EndContext("b") in cmds
    assert run(s, {"type": "text", "context_id": "c", "text": "x"})[0].event["code"] == "invalid_message"


def test_instruct_mode_needs_instruction() -> None:
    s = state()
    assert run(s, {"type": "open", "context_id": "a", "mode": "instruct"})[0].event["code"] == "invalid_message"
    start = run(s, {"type": "open", "context_id": "a", "instruction": "Whisper."})[0]
    assert start.settings.effective_mode == "instruct"
    # Whitespace is no instruction: refused with an explicit instruct mode, zero-shot without.
    assert run(s, {"type": "open", "context_id": "b", "mode": "instruct", "instruction": " \n"})[0].event["code"] \
        == "invalid_message"
    start = run(s, {"type": "open", "context_id": "c", "instruction": "  "})[0]
    assert start.settings.effective_mode == "zero_shot"


# ---- FrameWriter: backpressure and lag --------------------------------------------------


class _Ctx:
    def __init__(self) -> None:
        self.cancelled = False
        self.sent = 0

    def on_sent(self, item: _Item) -> None:
        self.sent += item.samples


def test_writer_bounds_memory_and_reports_lag() -> None:
    async def main() -> None:
        now = [0.0]
        gate = asyncio.Event()  # the "client" reads nothing until the gate opens
        sent: list[bytes] = []

        async def send_bytes(b: bytes) -> None:
            await gate.wait()
            sent.append(b)

        async def send_text(t: str) -> None:
            sent.append(t.encode())

        w = FrameWriter(send_text, send_bytes, max_bytes=100, clock=lambda: now[0])
        task = asyncio.create_task(w.run())
        ctx = _Ctx()
        producer_done = []

        async def produce() -> None:
            for i in range(10):
                await w.put_audio(_Item(bytes([i]) * 40, ctx, 40, samples=20))
            producer_done.append(True)

        prod = asyncio.create_task(produce())
        for _ in range(20):
            await asyncio.sleep(0)
        # One frame in flight, the rest bounded by max_bytes: the producer waits.
        assert w.queued_bytes <= 100 + 40 and not producer_done
        now[0] = 7.0
        assert w.lag() == 7.0  # the stuck frame's age: what the monitor compares to max_lag_s
        # Barge-in drops queued frames and frees the producer.
        ctx.cancelled = True
        w.drop(ctx)
        await asyncio.wait_for(prod, 1)
        gate.set()
        w.put_event({"type": "cancelled"})
        await asyncio.wait_for(w.wait_drained(), 1)
        assert sent[-1] == b'{"type":"cancelled"}'
        assert len(sent) == 2 and ctx.sent == 20  # only the frame that was already sending
        assert w.lag() == 0.0
        task.cancel()

    asyncio.run(main())


# ---- a whole connection with a client that never reads ------------------------------


class _NeverReadingSocket:
    """Starlette-WebSocket stand-in: text frames pass, audio sends block forever."""

    def __init__(self, messages: list[str]) -> None:
        self.inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        for m in messages:
            self.inbox.put_nowait({"type": "websocket.receive", "text": m})
        self.texts: list[dict[str, Any]] = []
        self.closed_with: int | None = None

    async def receive(self) -> dict[str, Any]:
        return await self.inbox.get()

    async def send_text(self, data: str) -> None:
        self.texts.append(json.loads(data))

    async def send_bytes(self, data: bytes) -> None:
        await asyncio.Event().wait()  # the client's buffers are full

    async def close(self, code: int = 1000, reason: str = "") -> None:
        self.closed_with = code


class _EndlessSession:
    """Engine session stand-in producing audio as fast as it is pulled."""

    def __init__(self) -> None:
        self.aborted = False
        self.produced = 0

    async def submit(self, text: str, options: Any = None, utterance_id: str | None = None) -> str:
        return utterance_id or "u"

    async def events(self) -> Any:
        from engine.types import AudioChunk
        import numpy as np

        i = 0
        while not self.aborted:
            self.produced += 1
            yield AudioChunk("a-0", np.zeros(2400, np.float32), i * 2400, False, i)
            i += 1
            await asyncio.sleep(0)

    async def finish(self) -> None: ...

    async def abort(self) -> None:
        self.aborted = True


def test_slow_consumer_is_closed_with_4001_and_memory_stays_bounded() -> None:
    from types import SimpleNamespace

    from gateway.protocol import CLOSE_SLOW_CONSUMER
    from gateway.ws import _Connection

    async def main() -> None:
        session = _EndlessSession()
        errors: list[str] = []

        class Voices:
            async def get_prompt(self, voice_id: str) -> object:
                return object()

        limits = WsLimits(max_pending_bytes=20_000, max_lag_s=0.3, keepalive_interval_s=0)
        gw = SimpleNamespace(
            engine=SimpleNamespace(open_session=lambda voice, options: session, model_name="fake", sample_rate=24000),
            voices=Voices(),
            settings=SimpleNamespace(ws=limits, default_voice="v", audio=EncoderOptions()),
            metrics=SimpleNamespace(error=errors.append, observe_first_audio=lambda s: None,
                                    add_audio_seconds=lambda s: None),
            encode_pool=EncodePool(0),
        )
        sock = _NeverReadingSocket([json.dumps({"type": "text", "context_id": "a", "text": "Speak forever."})])
        conn = _Connection(sock, gw)  # type: ignore[arg-type]
        peak = 0

        async def watch() -> None:
            nonlocal peak
            while True:
                peak = max(peak, conn.writer.queued_bytes)
                await asyncio.sleep(0.005)

        watcher = asyncio.create_task(watch())
        t0 = asyncio.get_running_loop().time()
        await asyncio.wait_for(conn.run(), 5)
        elapsed = asyncio.get_running_loop().time() - t0
        watcher.cancel()
        assert sock.closed_with == CLOSE_SLOW_CONSUMER and "slow_consumer" in errors
        assert elapsed >= 0.3  # not before the lag limit (the wait_for above bounds the rest)
        # Producers waited: the queue never held much more than its bound (+ one frame),
        # and the engine was stopped rather than pulled without limit.
        assert peak <= 20_000 + 5000
        assert session.aborted and session.produced < 50

    asyncio.run(main())


def test_idle_socket_gets_keepalives_then_idle_close() -> None:
    from types import SimpleNamespace

    from gateway.protocol import CLOSE_IDLE
    from gateway.ws import _Connection

    async def main() -> None:
        limits = WsLimits(idle_timeout_s=0.4, keepalive_interval_s=0.1)
        gw = SimpleNamespace(
            engine=SimpleNamespace(model_name="fake", sample_rate=24000),
            voices=None,
            settings=SimpleNamespace(ws=limits, default_voice="v"),
            metrics=SimpleNamespace(error=lambda code: None, add_audio_seconds=lambda s: None),
        )
        sock = _NeverReadingSocket([])
        t0 = asyncio.get_running_loop().time()
        await asyncio.wait_for(_Connection(sock, gw).run(), 5)  # type: ignore[arg-type]
        elapsed = asyncio.get_running_loop().time() - t0
        assert sock.closed_with == CLOSE_IDLE and elapsed >= 0.4  # not before idle_timeout_s (wait_for bounds it)
        kinds = [t["type"] for t in sock.texts]
        assert kinds[0] == "session_started" and kinds.count("keepalive") >= 2

    asyncio.run(main())


# ---- numbers that float() cannot take, ids too long to echo ----------------------------

_HUGE = "1" + "0" * 400  # an integer JSON allows and float() overflows on


# Every numeric field, past float's range, non-finite or merely out of range.
_BAD_NUMBERS = [
    ('{"type":"config","speed":%s}' % _HUGE, "invalid_speed"),
    ('{"type":"config","speed":-%s}' % _HUGE, "invalid_speed"),
    ('{"type":"config","speed":1e999}', "invalid_speed"),  # Python's JSON reader: inf
    ('{"type":"config","speed":NaN}', "invalid_speed"),
    ('{"type":"text","context_id":"a","text":"x","speed":-Infinity}', "invalid_speed"),
    ('{"type":"config","sample_rate":%s}' % _HUGE, "unsupported_format"),
    ('{"type":"open","context_id":"a","format":"opus","sample_rate":%s}' % _HUGE, "unsupported_format"),
    ('{"type":"config","sample_rate":-1}', "unsupported_format"),
    ('{"type":"config","segmentation":{"max_chars":%s}}' % _HUGE, "invalid_message"),
    ('{"type":"config","segmentation":{"first_min_chars":-%s}}' % _HUGE, "invalid_message"),
    ('{"type":"config","stats_interval_ms":%s}' % _HUGE, "invalid_message"),
]


def test_numeric_fields_out_of_range_are_refused_not_raised() -> None:
    # Before: float(10**400) raised OverflowError out of a parser that promises never to
    # raise, and a huge (or negative) rate or segment length was accepted as it came.
    for raw, expected in _BAD_NUMBERS:
        res = parse_client_message(raw, WsLimits())
        assert isinstance(res, ProtocolError) and res.code == expected, (raw[:80], res)
        assert len(res.message) < 100  # the number is not quoted back
        assert ConnectionState(ContextSettings(voice="v"), WsLimits()).handle(res) == [Send(res.event())]
    # The bounds themselves still parse.
    cfg = parse({"type": "config", "speed": 4, "sample_rate": 48000, "segmentation": {"max_chars": 100000}})
    assert isinstance(cfg, ConfigMessage) and cfg.patch.speed == 4.0 and isinstance(cfg.patch.speed, float)
    assert cfg.patch.sample_rate == 48000 and cfg.patch.segmentation.max_chars == 100000


def test_echoed_ids_and_names_are_truncated() -> None:
    limits = WsLimits(max_message_bytes=65536)
    bad_id = parse_client_message(json.dumps({"type": "flush", "context_id": "x" * 20000}), limits)
    assert isinstance(bad_id, ProtocolError) and bad_id.code == "invalid_message"
    assert bad_id.context_id == "x" * 128
    bad_type = parse_client_message(json.dumps({"type": "y" * 20000}), limits)
    assert isinstance(bad_type, ProtocolError) and bad_type.code == "unknown_type"
    assert len(bad_type.message) < 200


def test_writer_caps_queued_events() -> None:
    async def main() -> None:
        async def never(_: Any) -> None:
            await asyncio.Event().wait()

        w = FrameWriter(never, never, max_bytes=100)  # nothing is ever sent
        assert w.max_event_bytes == 200
        ctx = _Ctx()
        ev = {"type": "flushed", "context_id": "a", "flush_id": 1}
        size = len(json.dumps(ev, separators=(",", ":")))
        accepted = 0
        while w.put_event(ev, ctx):  # before: returned None and queued without limit
            accepted += 1
            assert accepted < 1000
        assert accepted == 200 // size and w.event_bytes == w.queued_bytes == accepted * size
        # Dropped events free their share of the cap.
        w.drop(ctx)
        assert w.event_bytes == 0 and w.put_event(ev)

    asyncio.run(main())


# ---- a whole connection that meets a bug, a broken encoder or a flood of events ----------


class _Socket:
    """Starlette-WebSocket stand-in driven by the test: `push` feeds the reader (an
    exception instance is raised by `receive`), `next_event` waits for a sent event."""

    def __init__(self, block_sends: bool = False) -> None:
        self.inbox: asyncio.Queue[Any] = asyncio.Queue()
        self.sent: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.texts: list[dict[str, Any]] = []
        self.closed_with: int | None = None
        self.block_sends = block_sends  # a client that reads nothing at all

    def push(self, **msg: Any) -> None:
        self.inbox.put_nowait({"type": "websocket.receive", "text": json.dumps(msg)})

    async def receive(self) -> dict[str, Any]:
        item = await self.inbox.get()
        if isinstance(item, BaseException):
            raise item
        return item

    async def send_text(self, data: str) -> None:
        if self.block_sends:
            await asyncio.Event().wait()
        ev = json.loads(data)
        self.texts.append(ev)
        self.sent.put_nowait(ev)

    async def send_bytes(self, data: bytes) -> None:
        if self.block_sends:
            await asyncio.Event().wait()

    async def close(self, code: int = 1000, reason: str = "") -> None:
        self.closed_with = code

    async def next_event(self, kind: str) -> dict[str, Any]:
        while True:
            ev = await asyncio.wait_for(self.sent.get(), 5)
            if ev["type"] == kind:
                return ev

    def errors(self) -> list[tuple[str, str | None]]:
        return [(e["code"], e.get("context_id")) for e in self.texts if e["type"] == "error"]


class _ScriptedSession:
    """Engine session stand-in: one short final chunk per submitted segment."""

    def __init__(self) -> None:
        self.aborted = False
        self.texts: list[str] = []
        self._events: asyncio.Queue[Any] = asyncio.Queue()

    async def submit(self, text: str, options: Any = None, utterance_id: str | None = None) -> str:
        from engine.types import AudioChunk
        import numpy as np

        self.texts.append(text)
        uid = utterance_id or "u"
        self._events.put_nowait(AudioChunk(uid, np.zeros(480, np.float32), 0, True, 0))
        return uid

    async def finish(self) -> None:
        self._events.put_nowait(None)

    async def abort(self) -> None:
        self.aborted = True
        self._events.put_nowait(None)

    async def events(self) -> Any:
        while (ev := await self._events.get()) is not None:
            yield ev


def _fake_gw(limits: WsLimits, sessions: list[_ScriptedSession] | None = None, encode_pool: Any = None) -> Any:
    from types import SimpleNamespace

    class Voices:
        async def get_prompt(self, voice_id: str) -> object:
            return object()

    def open_session(voice: object, options: object) -> _ScriptedSession:
        session = _ScriptedSession()
        if sessions is not None:
            sessions.append(session)
        return session

    errors: list[str] = []
    return SimpleNamespace(
        engine=SimpleNamespace(open_session=open_session, model_name="fake", sample_rate=24000),
        voices=Voices(),
        settings=SimpleNamespace(ws=limits, default_voice="v", audio=EncoderOptions()),
        metrics=SimpleNamespace(error=errors.append, observe_first_audio=lambda s: None,
                                add_audio_seconds=lambda s: None),
        encode_pool=encode_pool or EncodePool(0),
        errors=errors,
    )


class _Bug(Exception):
    pass


def test_unexpected_error_in_one_message_costs_only_that_message() -> None:
    from gateway.ws import _Connection

    async def main() -> None:
        sock = _Socket()
        conn = _Connection(sock, _fake_gw(WsLimits(keepalive_interval_s=0)))  # type: ignore[arg-type]
        real_handle = conn.state.handle

        def handle(msg: Any) -> list[Any]:
            commands = real_handle(msg)
            if isinstance(msg, TextMessage) and msg.context_id == "a":
                raise _Bug("after the state machine opened 'a'")  # its StartContext never runs
            return commands

        conn.state.handle = handle  # type: ignore[method-assign]
        sock.push(type="text", context_id="a", text="Hi")
        sock.push(type="flush", context_id="zz")
        sock.push(type="close")  # completes only if no context is left waiting
        # Before: the exception killed the reader silently and the socket hung.
        await asyncio.wait_for(conn.run(), 5)
        assert sock.errors() == [("internal_error", None), ("internal_error", "a")]
        assert {"type": "flushed", "context_id": "zz", "flush_id": 0} in sock.texts
        assert sock.closed_with == 1000 and not conn.state.contexts

    asyncio.run(main())


@pytest.mark.parametrize("task", ["reader", "monitor"])
def test_a_dead_socket_task_closes_the_socket_with_1011(task: str) -> None:
    from gateway.protocol import CLOSE_INTERNAL
    from gateway.ws import _Connection

    async def main() -> None:
        sock = _Socket()
        conn = _Connection(sock, _fake_gw(WsLimits(keepalive_interval_s=0)))  # type: ignore[arg-type]
        if task == "reader":
            sock.inbox.put_nowait(_Bug("receive broke"))
        else:
            def lag() -> float:
                raise _Bug("monitor broke")

            conn.writer.lag = lag  # type: ignore[method-assign]
        # Before: the task died alone and the socket stayed open with nobody serving it.
        await asyncio.wait_for(conn.run(), 5)
        assert sock.closed_with == CLOSE_INTERNAL
        assert sock.errors() == [("internal_error", None)]

    asyncio.run(main())


class _FailingEncodes:
    """The encode pool, failing its first encode (an encoder error mid-stream)."""

    def __init__(self) -> None:
        self.pool = EncodePool(0)
        self.failures_left = 1

    async def encode(self, encoder: Any, pcm: Any) -> list[bytes]:
        if self.failures_left:
            self.failures_left -= 1
            raise _Bug("encoder broke")
        return await self.pool.encode(encoder, pcm)

    async def flush(self, encoder: Any) -> list[bytes]:
        return await self.pool.flush(encoder)


def test_pump_failure_aborts_the_session_and_frees_the_context() -> None:
    from gateway.ws import _Connection

    async def main() -> None:
        sock = _Socket()
        sessions: list[_ScriptedSession] = []
        gw = _fake_gw(WsLimits(keepalive_interval_s=0), sessions, _FailingEncodes())
        conn = _Connection(sock, gw)  # type: ignore[arg-type]
        run = asyncio.create_task(conn.run())
        sock.push(type="text", context_id="a", text="Hello there.", flush=True)
        assert await sock.next_event("error") == {
            "type": "error", "code": "internal_error", "message": "audio pipeline failed", "context_id": "a",
            "final": True}  # no `done` follows: the id is free again
        # Before: the engine session ran on and "a" stayed registered (a zombie).
        assert sessions[0].aborted and not conn.contexts and not conn.state.contexts
        sock.push(type="text", context_id="a", text="Again.", end=True)  # the id is free again
        done = await sock.next_event("done")
        assert done["context_id"] == "a" and done["audio_samples"] == 480 and sessions[1].aborted
        sock.push(type="close")
        await asyncio.wait_for(run, 5)
        assert sock.closed_with == 1000 and not any(e["type"] == "flushed" for e in sock.texts)

    asyncio.run(main())


def test_client_provoking_events_without_reading_is_closed_with_4001() -> None:
    from gateway.protocol import CLOSE_SLOW_CONSUMER
    from gateway.ws import _Connection

    async def main() -> None:
        sock = _Socket(block_sends=True)
        for i in range(500):  # each one answered by a `flushed` event at once
            sock.push(type="flush", context_id=f"c{i}")
        # The lag monitor alone would wait a minute: the event cap must act first.
        gw = _fake_gw(WsLimits(max_pending_bytes=1000, max_lag_s=60, keepalive_interval_s=0))
        conn = _Connection(sock, gw)  # type: ignore[arg-type]
        await asyncio.wait_for(conn.run(), 5)
        assert sock.closed_with == CLOSE_SLOW_CONSUMER and gw.errors == ["slow_consumer"]
        assert conn.writer.event_bytes <= 2 * 1000

    asyncio.run(main())


class _GatedVoices:
    """Voices whose "slow..." ones load only when the test lets them (a disk read, a prompt
    made again): "slow-2" has gates of its own, the others share `asked` and `release`;
    every other voice loads at once."""

    def __init__(self) -> None:
        self.gates = {key: (asyncio.Event(), asyncio.Event()) for key in ("slow", "slow-2")}
        self.asked, self.release = self.gates["slow"]

    def cached_prompt(self, voice_id: str) -> object | None:
        return None if voice_id.startswith("slow") else object()

    async def get_prompt(self, voice_id: str) -> object:
        if voice_id.startswith("slow"):
            asked, release = self.gates["slow-2" if voice_id == "slow-2" else "slow"]
            asked.set()
            await release.wait()
        if voice_id == "slow-missing":  # read, then found gone
            raise KeyError(voice_id)
        return object()


def _started(sock: _Socket, cid: str) -> bool:
    return any(e["type"] == "context_started" and e["context_id"] == cid for e in sock.texts)


def _gated_connection() -> tuple[_Socket, list[_ScriptedSession], _GatedVoices, Any]:
    from gateway.ws import _Connection

    sock, sessions, voices = _Socket(), [], _GatedVoices()
    gw = _fake_gw(WsLimits(keepalive_interval_s=0), sessions)
    gw.voices = voices
    return sock, sessions, voices, _Connection(sock, gw)


def test_a_slow_voice_load_holds_only_its_own_context() -> None:
    """While context b's voice loads, a cancel of context a is served at once (before: the
    reader waited for b's voice, and a kept speaking); b's own text and flush wait for its
    start and then run in order."""
    async def main() -> None:
        sock, sessions, voices, conn = _gated_connection()
        serving = asyncio.create_task(conn.run())
        sock.push(type="text", context_id="a", text="Hello there.")
        assert (await sock.next_event("context_started"))["context_id"] == "a"
        sock.push(type="text", context_id="b", text="A second voice.", voice="slow", flush=True)
        await voices.asked.wait()
        sock.push(type="cancel", context_id="a")
        cancelled = await sock.next_event("cancelled")
        assert (cancelled["context_id"], cancelled["active"]) == ("a", True)
        assert sessions[0].aborted and not _started(sock, "b") and len(sessions) == 1
        voices.release.set()
        assert (await sock.next_event("context_started"))["context_id"] == "b"
        assert await sock.next_event("flushed") == {"type": "flushed", "context_id": "b", "flush_id": 1}
        sock.push(type="end", context_id="b")
        assert (await sock.next_event("done"))["context_id"] == "b"
        sock.push(type="close")
        await asyncio.wait_for(serving, 5)
        assert sock.closed_with == 1000 and not conn.starting and not sock.errors()

    asyncio.run(main())


def test_a_cancel_while_its_voice_loads_ends_the_context_before_it_starts() -> None:
    """No `context_started`, no engine session, `cancelled` with active false, and a
    `close` waiting on it completes."""
    async def main() -> None:
        sock, sessions, voices, conn = _gated_connection()
        serving = asyncio.create_task(conn.run())
        sock.push(type="text", context_id="b", text="Never heard.", voice="slow")
        await voices.asked.wait()
        sock.push(type="close")
        sock.push(type="cancel", context_id="b")
        cancelled = await sock.next_event("cancelled")
        assert (cancelled["context_id"], cancelled["active"], cancelled["audio_samples"]) == ("b", False, 0)
        await asyncio.wait_for(serving, 5)
        assert sock.closed_with == 1000 and not sessions and not _started(sock, "b") and not conn.starting

    asyncio.run(main())


def test_a_context_cancelled_before_its_start_ran_can_be_opened_again() -> None:
    """Text and cancel read back to back, before the start task's first step: the cancel
    frees the id at once (else its later text would wait behind that start), and the
    start's load goes on and opens nothing."""
    async def main() -> None:
        sock, sessions, _, conn = _gated_connection()
        sock.push(type="text", context_id="c", text="Gone.", voice="slow")
        sock.push(type="cancel", context_id="c")
        serving = asyncio.create_task(conn.run())
        cancelled = await sock.next_event("cancelled")
        assert (cancelled["context_id"], cancelled["active"]) == ("c", False) and not sessions
        sock.push(type="text", context_id="c", text="Back again.", end=True)
        assert (await sock.next_event("context_started"))["context_id"] == "c"
        assert (await sock.next_event("done"))["context_id"] == "c"
        sock.push(type="close")
        await asyncio.wait_for(serving, 5)
        assert sock.closed_with == 1000 and len(sessions) == 1 and not conn.starting

    asyncio.run(main())


async def _until(condition: Any, turns: int = 500) -> None:
    """Let the other tasks run until `condition()` holds (each turn one pass of the event
    loop, no clock): the reader and the start tasks need a few passes per frame."""
    for _ in range(turns):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never held")


def test_a_start_refused_after_the_close_came_still_closes_the_socket() -> None:
    """A voice found gone after its read, with `close` sent meanwhile: the refusal is the
    context's last event and the socket closes with 1000 (before: nothing closed it until
    the idle timeout, 300 s by default)."""
    async def main() -> None:
        sock, sessions, voices, conn = _gated_connection()
        serving = asyncio.create_task(conn.run())
        sock.push(type="text", context_id="b", text="Nobody.", voice="slow-missing", end=True)
        await voices.asked.wait()
        sock.push(type="close")
        await _until(lambda: conn.state.closing)
        voices.release.set()
        await asyncio.wait_for(serving, 5)
        assert sock.errors() == [("voice_not_found", "b")] and sock.closed_with == 1000 and not sessions

    asyncio.run(main())


def test_a_starting_context_holds_a_bounded_backlog_then_the_reader_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past `STARTING_BACKLOG_MAX` commands the reader waits for the start, as it did for
    every start before; nothing is lost and the context's text keeps its order."""
    import gateway.ws_starts

    monkeypatch.setattr(gateway.ws_starts, "STARTING_BACKLOG_MAX", 2)

    async def main() -> None:
        sock, sessions, voices, conn = _gated_connection()
        serving = asyncio.create_task(conn.run())
        sock.push(type="text", context_id="b", text="One.", voice="slow", flush=True)  # a Speak and a flush mark
        await voices.asked.wait()
        for word in ("Two.", "Three.", "Four.", "Five."):
            sock.push(type="text", context_id="b", text=word, flush=True)
        await _until(lambda: sock.inbox.qsize() == 3)  # the reader holds "Two." and waits
        assert len(conn.starting["b"].backlog) == 2
        voices.release.set()
        sock.push(type="end", context_id="b")
        assert (await sock.next_event("done"))["context_id"] == "b"
        assert sessions[0].texts == ["One.", "Two.", "Three.", "Four.", "Five."]
        assert [e["flush_id"] for e in sock.texts if e["type"] == "flushed"] == [1, 2, 3, 4, 5]
        sock.push(type="close")
        await asyncio.wait_for(serving, 5)
        assert sock.closed_with == 1000

    asyncio.run(main())


def test_a_socket_that_ends_while_a_voice_loads_opens_nothing_after() -> None:
    async def main() -> None:
        sock, sessions, voices, conn = _gated_connection()
        serving = asyncio.create_task(conn.run())
        sock.push(type="text", context_id="b", text="Too late.", voice="slow")
        await voices.asked.wait()
        sock.inbox.put_nowait({"type": "websocket.disconnect"})
        await asyncio.wait_for(serving, 5)
        assert not conn._start_tasks and not conn.starting
        voices.release.set()
        await _until(lambda: True)
        assert not sessions and not conn.contexts

    asyncio.run(main())


def test_an_id_reopened_while_its_cancelled_start_still_loads_starts_once() -> None:
    """The cancelled start's load goes on (to be cached) and opens nothing; the new start
    of the same id opens the one context."""
    async def main() -> None:
        sock, sessions, voices, conn = _gated_connection()
        serving = asyncio.create_task(conn.run())
        sock.push(type="text", context_id="b", text="First try.", voice="slow")
        await voices.asked.wait()
        sock.push(type="cancel", context_id="b")
        cancelled = await sock.next_event("cancelled")
        assert (cancelled["context_id"], cancelled["active"]) == ("b", False)
        sock.push(type="text", context_id="b", text="Second try.", voice="slow", end=True)
        await _until(lambda: len(conn._start_tasks) == 2)  # the cancelled one still loads
        voices.release.set()
        assert (await sock.next_event("done"))["context_id"] == "b"
        assert len(sessions) == 1 and sessions[0].texts == ["Second try."]
        assert [e["context_id"] for e in sock.texts if e["type"] == "context_started"] == ["b"]
        sock.push(type="close")
        await asyncio.wait_for(serving, 5)
        assert sock.closed_with == 1000 and not conn._start_tasks

    asyncio.run(main())


class _SlowFinishSession(_ScriptedSession):
    """An engine session whose `finish` waits for the test (a session of another process)."""

    def __init__(self, finishing: asyncio.Event) -> None:
        super().__init__()
        self.finishing = finishing

    async def finish(self) -> None:
        await self.finishing.wait()
        await super().finish()


def test_a_start_reopened_behind_a_catching_up_start_is_cancelled_with_it() -> None:
    """b's start catches up on its text and end, and waits in the end's `finish`; b is done
    meanwhile and opened again with a voice to read, which waits behind that. A cancel of
    the new b ends it before it starts: nothing opens after its `cancelled`."""
    async def main() -> None:
        sock, sessions, voices, conn = _gated_connection()
        finishing = asyncio.Event()

        def open_session(voice: object, options: object) -> _ScriptedSession:
            sessions.append(_SlowFinishSession(finishing))
            return sessions[-1]

        conn.gw.engine.open_session = open_session
        serving = asyncio.create_task(conn.run())
        sock.push(type="text", context_id="b", text="Once.", voice="slow", end=True)
        await voices.asked.wait()
        voices.release.set()
        assert (await sock.next_event("done"))["context_id"] == "b"
        assert conn.starting["b"].loaded  # still in the end's `finish`
        sock.push(type="text", context_id="b", text="Twice.", voice="slow-2")
        await _until(lambda: len(conn.starting["b"].backlog) == 2)  # its start and its text
        sock.push(type="cancel", context_id="b")
        cancelled = await sock.next_event("cancelled")
        assert (cancelled["context_id"], cancelled["active"]) == ("b", False)
        voices.gates["slow-2"][1].set()
        finishing.set()
        sock.push(type="close")
        await asyncio.wait_for(serving, 5)
        assert [e["type"] for e in sock.texts if e.get("context_id") == "b"][-1] == "cancelled"
        assert len(sessions) == 1 and not conn.contexts and not voices.gates["slow-2"][0].is_set()

    asyncio.run(main())


def test_a_cancel_while_its_voice_loads_still_sends_the_errors_of_its_messages() -> None:
    async def main() -> None:
        sock, sessions, voices, conn = _gated_connection()
        conn.state.limits = replace(conn.state.limits, max_text_chars=10)
        serving = asyncio.create_task(conn.run())
        sock.push(type="text", context_id="b", text="Short.", voice="slow")
        await voices.asked.wait()
        sock.push(type="text", context_id="b", text="Far too long for the limit.")
        sock.push(type="cancel", context_id="b")
        await sock.next_event("cancelled")
        assert [(e["type"], e.get("code")) for e in sock.texts if e.get("context_id") == "b"] == [
            ("error", "text_too_long"), ("cancelled", None)]
        sock.push(type="close")
        await asyncio.wait_for(serving, 5)
        assert sock.closed_with == 1000 and not sessions

    asyncio.run(main())


def test_a_socket_task_cancelled_twice_still_ends_its_contexts() -> None:
    """The second cancel lands in the teardown the first began: the teardown goes on by
    itself (the engine session is aborted, the socket's tasks end)."""
    async def main() -> None:
        sock, sessions, voices, conn = _gated_connection()
        serving = asyncio.create_task(conn.run())
        sock.push(type="text", context_id="a", text="Speaking.")
        await sock.next_event("context_started")
        serving.cancel()
        await asyncio.sleep(0)  # into the teardown
        serving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await serving
        await _until(lambda: sessions[0].aborted and not conn.contexts)
        await _until(lambda: conn._writer_task is not None and conn._writer_task.done())

    asyncio.run(main())


# ---- found by a review of the WebSocket path ------------------------------------------------


def test_a_frame_nested_as_deep_as_json_takes_is_refused_not_raised() -> None:
    """A lone-surrogate escape sends the parsed object through a second, recursive walk
    (`_is_unicode`), one call deeper than `json.loads`: at the one nesting depth that
    `json.loads` still took, that walk raised RecursionError out of a parser that promises
    never to raise, and the reader answered `internal_error`. Where the stack runs out
    depends on the caller's depth, so every depth up to past the limit is tried."""
    import sys

    for depth in range(1, sys.getrecursionlimit() + 100):
        raw = '{"type":"text","context_id":"a","text":"\\ud800","x":' + "[" * depth + "]" * depth + "}"
        res = parse_client_message(raw, WsLimits())
        assert isinstance(res, ProtocolError) and res.code in ("invalid_message", "invalid_json"), (depth, res)


def test_an_unknown_format_is_quoted_back_cut_short() -> None:
    """Client strings quoted back in errors are cut to 128 characters (docs/protocol.md): an
    unknown `format` was quoted whole, so a 60 KB name cost a 60 KB error event."""
    limits = WsLimits(max_message_bytes=65536)
    for msg in ({"type": "config", "format": "f" * 60000},
                {"type": "open", "context_id": "a", "format": "f" * 60000, "sample_rate": 16000}):
        res = parse_client_message(json.dumps(msg), limits)
        assert isinstance(res, ProtocolError) and res.code == "unsupported_format", res
        assert "f" * 128 in res.message and len(res.message) < 300, len(res.message)


# ---- found by a review of the WebSocket path (2) --------------------------------------------


def test_a_start_refused_in_the_background_sends_its_messages_errors_before_its_final_error() -> None:
    """A voice found gone after its read, with a message of the context refused meanwhile
    (its text over the limit): that refusal was sent after the start's final
    `voice_not_found`, as a second final error of a context no longer open. The final
    error must be the context's last event (docs/protocol.md: nothing follows it), as a
    cancel of a loading start sends its messages' errors before its `cancelled`."""
    async def main() -> None:
        sock, sessions, voices, conn = _gated_connection()
        conn.state.limits = replace(conn.state.limits, max_text_chars=10)
        serving = asyncio.create_task(conn.run())
        sock.push(type="text", context_id="b", text="Short.", voice="slow-missing")
        await voices.asked.wait()
        sock.push(type="text", context_id="b", text="Far too long for the limit.")
        await _until(lambda: len(conn.starting["b"].backlog) == 1)
        voices.release.set()
        sock.push(type="close")
        await asyncio.wait_for(serving, 5)
        events = [e for e in sock.texts if e.get("context_id") == "b"]
        assert [(e["code"], e.get("final", False)) for e in events] == [
            ("text_too_long", False), ("voice_not_found", True)], events
        assert sock.closed_with == 1000 and not sessions

    asyncio.run(main())
