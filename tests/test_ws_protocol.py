"""Sans-I/O protocol: message parsing, the per-socket state machine, the frame writer."""

from __future__ import annotations

import asyncio
import json
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
    assert cfg.patch.segmentation.eager_ends  # the default
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
            metrics=SimpleNamespace(error=errors.append, observe_first_audio=lambda s: None),
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
        assert 0.3 <= elapsed < 2.0
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
            metrics=SimpleNamespace(error=lambda code: None),
        )
        sock = _NeverReadingSocket([])
        t0 = asyncio.get_running_loop().time()
        await asyncio.wait_for(_Connection(sock, gw).run(), 5)  # type: ignore[arg-type]
        elapsed = asyncio.get_running_loop().time() - t0
        assert sock.closed_with == CLOSE_IDLE and 0.4 <= elapsed < 1.5
        kinds = [t["type"] for t in sock.texts]
        assert kinds[0] == "session_started" and kinds.count("keepalive") >= 2

    asyncio.run(main())
