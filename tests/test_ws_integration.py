"""The streaming WebSocket endpoint over a real uvicorn server, real `websockets`
clients and the tiny random-weight engine.

The server (engine + uvicorn) runs in its own thread and event loop for the whole
module; each test drives plain TCP clients from its own `asyncio.run`. The engine is
told to emit exactly 2 speech tokens per text token (random weights never stop by
themselves), so audio lengths are deterministic.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, AsyncIterator, Iterator

import numpy as np
import pytest
import websockets
from starlette.applications import Starlette
from starlette.routing import WebSocketRoute

from engine.types import SessionOptions
from gateway.audio import EncoderOptions, decode_frames, resolve_format
from gateway.encode_pool import EncodePool
from gateway.protocol import CLOSE_POLICY, WsLimits
from gateway.app import transport_options
from gateway.settings import Settings
from gateway.ws import tts_websocket
from helpers import LiveServer

VOICE = "tester"


class _Voices:
    def __init__(self, prompts: dict[str, Any]) -> None:
        self._prompts = prompts

    async def get_prompt(self, voice_id: str) -> Any:
        return self._prompts[voice_id]  # KeyError for unknown ids, like the real store


class _Metrics:
    def __init__(self) -> None:
        self.errors: list[str] = []
        self.first_audio: list[float] = []
        self.open = 0

    def session_opened(self) -> None:
        self.open += 1

    def add_audio_seconds(self, seconds: float) -> None:
        pass

    def session_closed(self) -> None:
        self.open -= 1

    def session_refusal(self, limit: int | None) -> str | None:
        return None if limit is None or self.open < limit else f"too many sessions (at most {limit})"

    def observe_first_audio(self, seconds: float) -> None:
        self.first_audio.append(seconds)

    def error(self, code: str) -> None:
        self.errors.append(code)


class _Auth:
    def check_websocket(self, websocket: Any) -> bool:
        return websocket.query_params.get("token") != "bad"


@dataclass
class Server:
    url: str
    gw: SimpleNamespace
    loop: asyncio.AbstractEventLoop


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[Server]:
    """The endpoint on `helpers.LiveServer`: uvicorn serves a socket bound before it starts
    (no port to lose between choosing and binding it) and the fixture returns on the
    lifespan start-up's Event, or at once with an error when the start-up failed."""
    from engine.config import EngineConfig
    from engine.engine import Engine

    limits = WsLimits(max_message_bytes=4096, max_contexts=10, max_text_chars=2000, max_pending_bytes=64 << 10, max_lag_s=1.5, keepalive_interval_s=0)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # On the server's own loop: the engine's tasks live there.
        engine = await Engine.create(EngineConfig(model_dir=tiny_model_dir, device="cpu", lm_backend="torch"))
        encode_pool = EncodePool(2)
        try:
            sr = engine.sample_rate
            t = np.arange(3 * sr) / sr
            wav = (0.2 * np.sin(2 * np.pi * 180 * t)).astype(np.float32)
            prompt = await engine.prepare_voice(VOICE, wav, sr, "A short prompt.")
            app.state.gw = SimpleNamespace(
                engine=engine,
                voices=_Voices({VOICE: prompt}),
                settings=SimpleNamespace(ws=limits, default_voice=VOICE, audio=EncoderOptions()),
                metrics=_Metrics(),
                auth=_Auth(),
                encode_pool=encode_pool,
                session_defaults=SessionOptions(tokens_per_text_token=2.0, seed=0),
            )
            yield
        finally:
            await engine.close()
            encode_pool.close()

    app = Starlette(routes=[WebSocketRoute("/v1/tts/stream", tts_websocket)], lifespan=lifespan)
    with LiveServer(app, start_timeout=300, ws="websockets-sansio", **transport_options(Settings(ws=limits))) as srv:
        assert srv.server.loop is not None
        yield Server(srv.ws_url, srv.gw, srv.server.loop)


# ---- a small recording client -------------------------------------------------------------


@dataclass
class Recording:
    events: list[dict[str, Any]] = field(default_factory=list)
    audio: dict[str, list[bytes]] = field(default_factory=dict)
    order: list[tuple[str, str]] = field(default_factory=list)  # ("event", type) | ("audio", ctx)

    def of(self, kind: str, cid: str | None = None) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == kind and (cid is None or e.get("context_id") == cid)]


async def receive_until(ws: Any, rec: Recording, done: Any, timeout: float = 60.0) -> None:
    """Read frames into ``rec`` until ``done(rec)`` is true."""
    deadline = time.monotonic() + timeout
    while not done(rec):
        msg = await asyncio.wait_for(ws.recv(), timeout=max(0.1, deadline - time.monotonic()))
        if isinstance(msg, bytes):
            n = msg[0]
            cid = msg[1 : 1 + n].decode()
            rec.audio.setdefault(cid, []).append(msg[1 + n :])
            rec.order.append(("audio", cid))
        else:
            ev = json.loads(msg)
            rec.events.append(ev)
            rec.order.append(("event", ev["type"]))
            if ev["type"] == "audio":  # base64 transport
                import base64

                rec.audio.setdefault(ev["context_id"], []).append(base64.b64decode(ev["data"]))


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def send(ws: Any, **msg: Any) -> None:
    await ws.send(json.dumps(msg))


def has_done(*cids: str) -> Any:
    return lambda rec: all(rec.of("done", c) for c in cids)


# ---- tests --------------------------------------------------------------------------------


def test_token_by_token_two_interleaved_contexts(server: Server) -> None:
    text_a = "Hello there, my friend. This is the second sentence."
    text_b = "Another voice speaks. Then it stops!"

    async def main() -> Recording:
        rec = Recording()
        async with websockets.connect(server.url) as ws:
            await receive_until(ws, rec, lambda r: bool(r.of("session_started")))
            await send(ws, type="config", format="pcm_s16le", sample_rate=16000)
            # Interleave single characters of both contexts (LLM-token-like appends).
            for i in range(max(len(text_a), len(text_b))):
                if i < len(text_a):
                    await send(ws, type="text", context_id="a", text=text_a[i])
                if i < len(text_b):
                    await send(ws, type="text", context_id="b", text=text_b[i], format="ulaw_8000")
            await send(ws, type="end", context_id="a")
            await send(ws, type="end", context_id="b")
            await receive_until(ws, rec, has_done("a", "b"))
        return rec

    rec = run(main())
    started = {e["context_id"]: e for e in rec.of("context_started")}
    assert started["a"]["format"] == "pcm_s16le" and started["a"]["sample_rate"] == 16000
    assert started["b"]["format"] == "ulaw_8000" and started["b"]["sample_rate"] == 8000
    for cid, text, rate in (("a", text_a, 16000), ("b", text_b, 8000)):
        segs = rec.of("segment_started", cid)
        # Segment texts tile the context text exactly and in order.
        assert "".join(s["text"] for s in segs) == text
        assert [s["text_start"] for s in segs] == [0] + [s["text_end"] for s in segs[:-1]]
        done = rec.of("done", cid)[0]
        fmt = resolve_format(started[cid]["format"], rate)
        pcm = decode_frames(fmt, rec.audio[cid])
        assert done["audio_samples"] == len(pcm) > rate // 2
        # Audio offsets grow and lie within the delivered audio.
        offs = [s["audio_offset"] for s in segs]
        assert offs[0] == 0 and offs == sorted(offs) and offs[-1] < len(pcm)
    assert all(len(f) == 160 for f in rec.audio["b"])  # exact 20 ms μ-law frames
    assert len(rec.of("segment_started", "a")) >= 2  # the first clause came early
    # The two contexts really interleaved on the socket.
    audio_order = [c for k, c in rec.order if k == "audio"]
    first_b = audio_order.index("b")
    assert "a" in audio_order[first_b:] or "b" in audio_order[: audio_order.index("a")]


def test_flush_speaks_buffer_and_acknowledges(server: Server) -> None:
    async def main() -> Recording:
        rec = Recording()
        async with websockets.connect(server.url) as ws:
            await send(ws, type="text", context_id="f", text="no punctuation here")
            await send(ws, type="flush", context_id="f")
            await receive_until(ws, rec, lambda r: bool(r.of("flushed", "f")))
            await send(ws, type="text", context_id="f", text=" more words", end=True)
            await receive_until(ws, rec, has_done("f"))
        return rec

    rec = run(main())
    segs = rec.of("segment_started", "f")
    assert [s["text"] for s in segs] == ["no punctuation here", " more words"]
    # `flushed` came after all audio of the first segment and before the second's.
    i_flushed = rec.order.index(("event", "flushed"))
    i_seg2 = [i for i, o in enumerate(rec.order) if o == ("event", "segment_started")][1]
    assert i_flushed < i_seg2
    assert rec.of("flushed", "f")[0]["flush_id"] == 1
    pcm_before = sum(len(f) for f in rec.audio["f"][: sum(1 for k, c in rec.order[:i_flushed] if k == "audio")]) // 2
    assert segs[1]["audio_offset"] == pcm_before  # offsets count exactly the audio delivered


def test_cancel_mid_utterance_then_new_context(server: Server) -> None:
    long_text = "This sentence is long enough to take several audio chunks to speak out loud. " * 2

    async def main() -> tuple[Recording, Recording]:
        rec = Recording()
        async with websockets.connect(server.url) as ws:
            await send(ws, type="text", context_id="c1", text=long_text, end=True)
            await receive_until(ws, rec, lambda r: len(r.audio.get("c1", [])) >= 2)
            await send(ws, type="cancel", context_id="c1")
            await receive_until(ws, rec, lambda r: bool(r.of("cancelled", "c1")))
            # A new turn on the same socket, no reconnect.
            after = Recording()
            await send(ws, type="text", context_id="c2", text="Next turn.", end=True)
            await receive_until(ws, after, has_done("c2"))
        return rec, after

    rec, after = run(main())
    cancelled = rec.of("cancelled", "c1")[0]
    assert cancelled["active"] is True
    assert not rec.of("done", "c1")
    # No c1 frame came after `cancelled`, and it counts exactly the frames received.
    assert "c1" not in after.audio
    assert cancelled["audio_samples"] == sum(len(f) for f in rec.audio["c1"]) // 2
    assert cancelled["audio_samples"] < 3 * len(long_text) * 24000 // 25  # stopped early
    assert 0 < cancelled["text_end"] < len(long_text)
    assert after.of("done", "c2") and after.audio["c2"]
    # The engine dropped the cancelled context's work.
    stats = asyncio.run_coroutine_threadsafe(_engine_stats(server), server.loop).result(10)
    assert stats.active_sessions == 0 and stats.lm_active == 0


async def _engine_stats(server: Server) -> Any:
    return server.gw.engine.stats()


FORMATS = [
    ("pcm_s16le", 8000), ("pcm_s16le", 22050), ("pcm_s16le", 44100), ("pcm_s16le", 48000), ("pcm_f32le", 24000),
    ("alaw_8000", 8000), ("opus", 48000), ("opus", 24000),
]


def test_every_format_decodes(server: Server) -> None:
    """One context per output format, all on one socket at once (the engine batches them)."""
    text = "Check this format."

    async def main() -> Recording:
        rec = Recording()
        async with websockets.connect(server.url) as ws:
            for k, (fmt, rate) in enumerate(FORMATS):
                await send(ws, type="open", context_id=f"x{k}", format=fmt, sample_rate=rate)
                await send(ws, type="text", context_id=f"x{k}", text=text, end=True)
            await receive_until(ws, rec, has_done(*(f"x{k}" for k in range(len(FORMATS)))))
        return rec

    rec = run(main())
    durations = []
    for k, (fmt, rate) in enumerate(FORMATS):
        frames = rec.audio[f"x{k}"]
        af = resolve_format(fmt, rate)
        if fmt == "opus":
            assert all(0 < len(f) < 1000 for f in frames)  # one raw packet per frame
        elif af.frame_samples:
            assert all(len(f) == af.frame_samples for f in frames)  # exact 20 ms
        pcm = decode_frames(af, frames)
        done = rec.of("done", f"x{k}")[0]
        assert done["audio_samples"] == len(pcm) > rate // 4
        assert np.isfinite(pcm).all() and np.abs(pcm).max() <= 1.0
        durations.append(len(pcm) / rate)
    # Same engine audio (fixed token count) -> the same duration at every rate, up to
    # one padded 20 ms frame and the resampler's rounding.
    assert max(durations) - min(durations) <= 0.021


def test_base64_transport(server: Server) -> None:
    async def main() -> Recording:
        rec = Recording()
        async with websockets.connect(server.url) as ws:
            await send(ws, type="text", context_id="j", text="Base64 please.", audio="base64", end=True)
            await receive_until(ws, rec, has_done("j"))
        return rec

    rec = run(main())
    assert not any(k == "audio" for k, _ in rec.order)  # no binary frames at all
    audio = rec.of("audio", "j")
    assert audio and audio[0]["audio_offset"] == 0
    total = sum(len(f) for f in rec.audio["j"]) // 2
    assert rec.of("done", "j")[0]["audio_samples"] == total


def test_language_picks_the_normalisation_grammar(server: Server) -> None:
    """`language` reaches the engine: "2024" is read by the English grammar under "en" and
    by the Chinese one under "zh" (detected: Chinese only for text with Chinese characters), and each
    context's audio has the length its own reading gives (2 speech tokens a text token)."""
    text = "Call 2024 now."

    async def main() -> Recording:
        rec = Recording()
        async with websockets.connect(server.url) as ws:
            for cid, language in (("en", "en-US"), ("zh", "zh")):
                await send(ws, type="text", context_id=cid, text=text, language=language, end=True)
            await receive_until(ws, rec, has_done("en", "zh"))
        return rec

    rec = run(main())
    engine = server.gw.engine
    english, chinese = engine.text_ids(text, "en"), engine.text_ids(text, "zh")
    assert english != chinese
    for cid, ids in (("en", english), ("zh", chinese)):
        assert rec.of("context_started", cid)[0]["language"] in ("en-US", "zh")
        assert rec.of("done", cid)[0]["audio_samples"] == 2 * len(ids) * 960


def test_malformed_and_oversized_messages_keep_socket_healthy(server: Server) -> None:
    async def main() -> Recording:
        rec = Recording()
        async with websockets.connect(server.url) as ws:
            bad = [
                "not json",
                "[1, 2]",
                json.dumps({"type": "dance"}),
                json.dumps({"type": "text", "context_id": "bad id!", "text": "x"}),
                json.dumps({"type": "text", "context_id": "t"}),
                json.dumps({"type": "text", "context_id": "t", "text": "x", "format": "mp3"}),
                json.dumps({"type": "text", "context_id": "t", "text": "x", "speed": 9}),
                json.dumps({"type": "text", "context_id": "t", "text": "x", "voice": "nobody"}),
                json.dumps({"type": "text", "context_id": "t", "text": "y" * 5000}),  # > 4096 bytes
            ]
            for m in bad:
                await ws.send(m)
            await ws.send(b"\x00binary")
            await receive_until(ws, rec, lambda r: len(r.of("error")) >= len(bad) + 1)
            # Still healthy: a normal context works on the same socket.
            await send(ws, type="text", context_id="ok", text="Still fine.", end=True)
            await receive_until(ws, rec, has_done("ok"))
        return rec

    rec = run(main())
    codes = [e["code"] for e in rec.of("error")]
    assert codes == [
        "invalid_json", "invalid_json", "unknown_type", "invalid_message", "invalid_message",
        "unsupported_format", "invalid_speed", "voice_not_found", "message_too_large", "binary_not_supported",
    ]
    assert all(e["message"] for e in rec.of("error"))
    assert rec.of("done", "ok")


def test_limits_contexts_and_text(server: Server) -> None:
    async def main() -> Recording:
        rec = Recording()
        async with websockets.connect(server.url) as ws:
            for i in range(11):  # max_contexts = 10
                await send(ws, type="open", context_id=f"k{i}")
            for _ in range(3):  # 3 x 900 chars > max_text_chars = 2000
                await send(ws, type="text", context_id="k0", text="word " * 180)
            await send(ws, type="cancel")  # everything
            await receive_until(ws, rec, lambda r: len(r.of("cancelled")) >= 10)
        return rec

    rec = run(main())
    assert [e["code"] for e in rec.of("error")] == ["too_many_contexts", "text_too_long"]
    assert sorted(e["context_id"] for e in rec.of("cancelled")) == sorted(f"k{i}" for i in range(10))


def test_unauthorized_is_closed_with_1008(server: Server) -> None:
    async def main() -> tuple[dict[str, Any], int | None]:
        async with websockets.connect(server.url + "?token=bad") as ws:
            ev = json.loads(await ws.recv())
            with pytest.raises(websockets.ConnectionClosed):
                await ws.recv()
            return ev, ws.close_code

    ev, code = run(main())
    assert ev["code"] == "unauthorized" and code == CLOSE_POLICY


def test_close_message_drains_then_closes_normally(server: Server) -> None:
    async def main() -> tuple[Recording, int | None]:
        rec = Recording()
        async with websockets.connect(server.url) as ws:
            await send(ws, type="text", context_id="z", text="Last words")
            await send(ws, type="close")
            with pytest.raises(websockets.ConnectionClosed):
                await receive_until(ws, rec, lambda r: False)
            return rec, ws.close_code

    rec, code = run(main())
    assert code == 1000
    assert rec.of("done", "z") and [s["text"] for s in rec.of("segment_started", "z")] == ["Last words"]


def test_python_client_and_cli(server: Server, tmp_path: Path) -> None:
    from gateway.client import GatewayClient
    from gateway.stream_cli import fake_tokens, stream_file

    text = "The client streams tokens. It gets audio back."
    assert "".join(fake_tokens(text + "  ")) == text + "  "

    async def main() -> tuple[bytes, list[dict[str, Any]]]:
        async with await GatewayClient.connect(server.url) as gw:
            assert gw.session["engine_sample_rate"] == 24000
            ctx = gw.context("py")
            for tok in fake_tokens(text):
                await ctx.send_text(tok)
            await ctx.end()
            return await ctx.collect_audio(), ctx.events

    audio, events = run(main())
    assert events[-1]["type"] == "done" and events[-1]["audio_samples"] == len(audio) // 2
    out = tmp_path / "out.wav"
    result = run(stream_file(server.url, "Hello from the command line.", None, 0, out, "pcm_s16le", 16000, None))
    import wave

    with wave.open(str(out)) as w:
        assert w.getframerate() == 16000 and w.getnframes() == round(result["audio_s"] * 16000) > 0
    assert result["first_audio_s"] < result["wall_s"] and result["errors"] == 0
    # An error from the gateway is the command's failure, not a silent WAV.
    (tmp_path / "in.txt").write_text("Nobody speaks this.")
    from gateway.stream_cli import main as cli_main

    status = cli_main(["--url", server.url, "--voice", "no_such_voice", "--file", str(tmp_path / "in.txt"),
                       "--rate", "0", "--out", str(tmp_path / "none.wav")])
    assert status == 1
    # A file longer than one context may be (the fixture's 2000 characters): refused before sending.
    (tmp_path / "long.txt").write_text("word " * 500)
    status = cli_main(["--url", server.url, "--file", str(tmp_path / "long.txt"), "--rate", "0",
                       "--out", str(tmp_path / "long.wav")])
    assert status == 2 and not (tmp_path / "long.wav").exists()


def test_client_splits_a_text_piece_over_the_frame_limit() -> None:
    """`text_messages`: parts within the limit as sent, texts concatenating back, the open
    overrides on the first part and flush/end on the last only."""
    from gateway.client import text_messages

    text = 'Grüße "aus" Köln \\ 你好。' * 40 + "😀 end"
    msg = {"type": "text", "context_id": "c", "text": text, "voice": "alice", "flush": True, "end": True}
    parts = text_messages(msg, 300)
    assert len(parts) > 1 and all(len(json.dumps(p)) <= 300 for p in parts)
    assert "".join(p["text"] for p in parts) == text
    assert parts[0]["voice"] == "alice" and all("voice" not in p for p in parts[1:])
    assert parts[-1]["flush"] is parts[-1]["end"] is True
    assert all("flush" not in p and "end" not in p for p in parts[:-1])
    assert text_messages(msg, None) == [msg] and text_messages({**msg, "text": "hi"}, 300) == [{**msg, "text": "hi"}]
    with pytest.raises(ValueError, match="no room for text"):
        text_messages(msg, 60)


def test_python_client_sends_a_piece_over_the_frame_limit_whole(server: Server) -> None:
    """A say() piece larger than `max_message_bytes` as the client sends it (the fixture's
    4096; non-ASCII text is escaped on the wire): the server would refuse such a frame with
    `message_too_large`, and its text would be lost. The client splits it instead, and the
    server takes all of it: no error before the `cancelled` that follows."""
    from gateway.client import GatewayClient

    text = "你好。" * 300  # 900 characters, 5400 bytes as sent

    async def main() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        async with await GatewayClient.connect(server.url) as gw:
            assert gw.max_message_bytes == 4096 and len(json.dumps({"text": text})) > 4096
            ctx = gw.context("big")
            await ctx.send_text(text)
            await ctx.cancel()
            async for _ in ctx.stream():
                pass
            stray: list[dict[str, Any]] = []
            while not gw.events.empty():
                stray.append(gw.events.get_nowait())
            return ctx.events, stray

    events, stray = run(main())
    assert not [e for e in events + stray if e["type"] == "error"], events + stray
    assert events[-1]["type"] == "cancelled" and events[-1]["active"] is True


# ---- a context that cannot start, and the session limit ------------------------------------


class _VanishingVoices:
    """The fixture's voices, but "vanished" fails as a voice deleted mid-read does."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    async def get_prompt(self, voice_id: str) -> Any:
        if voice_id == "vanished":
            raise FileNotFoundError("voices/vanished/prompt.npz")
        return await self._inner.get_prompt(voice_id)


async def _close_code(ws: Any, rec: Recording) -> int | None:
    await send(ws, type="close")
    with pytest.raises(websockets.ConnectionClosed):
        await receive_until(ws, rec, lambda r: False, timeout=30)
    return ws.close_code


def test_voice_failing_at_start_leaves_no_phantom_context(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server.gw, "voices", _VanishingVoices(server.gw.voices))

    async def main() -> tuple[Recording, int | None]:
        rec = Recording()
        async with websockets.connect(server.url) as ws:
            await send(ws, type="text", context_id="v", text="Hello.", voice="vanished")
            await receive_until(ws, rec, lambda r: bool(r.of("error")))
            # Before: "v" stayed open in the protocol state, so this text was dropped
            # silently and `close` waited forever for its `done`.
            await send(ws, type="text", context_id="v", text="Hello again.", end=True)
            await receive_until(ws, rec, has_done("v"))
            return rec, await _close_code(ws, rec)

    rec, code = run(main())
    assert [(e["code"], e.get("context_id"), e.get("final")) for e in rec.of("error")] == [("internal_error", "v", True)]
    assert rec.of("done", "v")[0]["audio_samples"] > 0 and code == 1000


def test_encoder_failing_at_start_opens_no_engine_session(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    import gateway.ws_context

    real_make_encoder = gateway.ws_context.make_encoder

    def make_encoder(name: str, sample_rate: int | None = None, options: Any = None) -> Any:
        if name == "opus":
            raise RuntimeError("libopus not found")  # what a host without libopus raises
        return real_make_encoder(name, sample_rate, options)

    monkeypatch.setattr(gateway.ws_context, "make_encoder", make_encoder)

    async def main() -> tuple[Recording, Any, int | None]:
        rec = Recording()
        async with websockets.connect(server.url) as ws:
            await send(ws, type="text", context_id="o", text="Hello.", format="opus", end=True)
            await receive_until(ws, rec, lambda r: bool(r.of("error")))
            # Before: the engine session opened before the encoder failed was never closed.
            stats = asyncio.run_coroutine_threadsafe(_engine_stats(server), server.loop).result(10)
            await send(ws, type="text", context_id="o", text="Plain audio then.", end=True)
            await receive_until(ws, rec, has_done("o"))
            return rec, stats, await _close_code(ws, rec)

    rec, stats, code = run(main())
    assert [(e["code"], e.get("context_id")) for e in rec.of("error")] == [("internal_error", "o")]
    assert stats.active_sessions == 0
    assert rec.of("done", "o")[0]["audio_samples"] > 0 and code == 1000


def test_max_sessions_refuses_sockets_over_the_limit(tiny_model_dir: Path, tmp_path: Path) -> None:
    from gateway.protocol import CLOSE_TRY_LATER
    from helpers import AUTH, eventually, live_gateway

    async def session_started(ws: Any) -> None:
        assert json.loads(await asyncio.wait_for(ws.recv(), 30))["type"] == "session_started"

    with live_gateway(tiny_model_dir, tmp_path, max_sessions=2) as srv:
        metrics = srv.gw.metrics

        async def over_the_limit() -> tuple[dict[str, Any], int | None, str | None, int]:
            async with websockets.connect(srv.ws_url, additional_headers=AUTH) as a, \
                    websockets.connect(srv.ws_url, additional_headers=AUTH) as b:
                await session_started(a)
                await session_started(b)
                # Before: uvicorn's limit_concurrency does not count WebSocket upgrades,
                # so this third socket was served too.
                async with websockets.connect(srv.ws_url, additional_headers=AUTH) as c:
                    ev = json.loads(await asyncio.wait_for(c.recv(), 30))
                    with pytest.raises(websockets.ConnectionClosed):
                        await asyncio.wait_for(c.recv(), 30)
                return ev, c.close_code, c.close_reason, metrics.sessions_active

        ev, code, reason, active = asyncio.run(over_the_limit())
        assert ev["type"] == "error" and ev["code"] == "too_many_sessions" and "too many sessions" in ev["message"]
        assert code == CLOSE_TRY_LATER and reason == "too many sessions"
        assert active == 2  # the refused socket was never counted
        # Closed sockets give their places back (counted down once their handler ends).
        eventually(lambda: metrics.sessions_active == 0)

        async def room_again() -> None:
            async with websockets.connect(srv.ws_url, additional_headers=AUTH) as ws:
                await session_started(ws)

        asyncio.run(room_again())


# ---- after a review of the connection's lifecycle (round 35) -------------------------------


def socket_full_for(monkeypatch: Any, cid: str) -> threading.Event:
    """The server's socket stays full for context `cid` until it is cancelled (`drop` makes
    room); the event is set once the context's pump waits for room."""
    from gateway.ws import FrameWriter

    put_audio = FrameWriter.put_audio
    full = threading.Event()

    async def stuck(self: Any, item: Any) -> None:
        if item.ctx is not None and item.ctx.cid == cid:
            full.set()
            while not item.ctx.cancelled:
                self._room.clear()
                await self._room.wait()
            return
        await put_audio(self, item)

    monkeypatch.setattr(FrameWriter, "put_audio", stuck)
    return full


def test_a_cancel_after_a_flush_is_not_held_behind_a_full_socket(server: Server, monkeypatch: Any) -> None:
    """The reader settled a `flush` (and an `end`) inline: behind the socket's backpressure
    it waited for the context's pump, which held the context's lock while it waited for room,
    so a `cancel` sent after the flush was not read until the client read again, and the
    cancelled context went on. The socket here stays full until the context is cancelled."""
    full = socket_full_for(monkeypatch, "bp")

    async def main() -> Recording:
        rec = Recording()
        async with websockets.connect(server.url) as ws:
            await receive_until(ws, rec, lambda r: bool(r.of("session_started")))
            await send(ws, type="text", context_id="bp", text="A first sentence to speak. And a second one.")
            assert await asyncio.to_thread(full.wait, 60)
            await send(ws, type="flush", context_id="bp")
            await send(ws, type="cancel", context_id="bp")
            await receive_until(ws, rec, lambda r: bool(r.of("cancelled", "bp")), timeout=20)
        return rec

    rec = run(main())
    assert rec.of("cancelled", "bp")[0]["active"] and not rec.of("flushed", "bp")


def test_a_context_cancelled_at_once_still_gets_its_context_started(server: Server) -> None:
    """`context_started` was queued as the context's own frame, so a cancel read before the
    writer sent it dropped it, while `cancelled` said `active: true`."""
    async def main() -> Recording:
        rec = Recording()
        async with websockets.connect(server.url) as ws:
            await receive_until(ws, rec, lambda r: bool(r.of("session_started")))
            for i in range(5):
                await ws.send(json.dumps({"type": "text", "context_id": f"q{i}", "text": "Hello there."}))
                await ws.send(json.dumps({"type": "cancel", "context_id": f"q{i}"}))
            await receive_until(ws, rec, lambda r: len(r.of("cancelled")) == 5, timeout=30)
        return rec

    rec = run(main())
    for i in range(5):
        started, cancelled = rec.of("context_started", f"q{i}"), rec.of("cancelled", f"q{i}")
        assert cancelled[0]["active"] and len(started) == 1
        assert rec.events.index(started[0]) < rec.events.index(cancelled[0])


def test_the_idle_clock_starts_when_the_last_context_ends(server: Server, monkeypatch: Any) -> None:
    """Idle means no client message while no context is active: a turn that outlasted
    `idle_timeout_s` after the client's last message closed the socket with 4000 right
    after its `done`. Here the turn's audio is held for longer than the 1 s timeout (the
    client sends nothing meanwhile), then the client pauses 0.4 s before its next turn."""
    from gateway.ws import FrameWriter

    settings = server.gw.settings
    server.gw.settings = SimpleNamespace(**{**vars(settings), "ws": dataclasses.replace(settings.ws, idle_timeout_s=1.0)})
    put_audio = FrameWriter.put_audio
    held, release = threading.Event(), asyncio.Event()

    async def holding(self: Any, item: Any) -> None:
        if item.ctx is not None and item.ctx.cid == "long" and not release.is_set():
            held.set()
            await release.wait()
        await put_audio(self, item)

    monkeypatch.setattr(FrameWriter, "put_audio", holding)

    async def main() -> Recording:
        rec = Recording()
        async with websockets.connect(server.url) as ws:
            await receive_until(ws, rec, lambda r: bool(r.of("session_started")))
            await send(ws, type="text", context_id="long", text="A turn to speak.", end=True)
            assert await asyncio.to_thread(held.wait, 60)
            await asyncio.sleep(1.5)  # the turn lasts past the idle timeout; the client is quiet
            server.loop.call_soon_threadsafe(release.set)
            await receive_until(ws, rec, has_done("long"), timeout=60)
            await asyncio.sleep(0.4)  # the client's pause between turns, under the timeout
            await send(ws, type="text", context_id="next", text="Hi.", end=True)
            await receive_until(ws, rec, has_done("next"), timeout=60)
        return rec

    try:
        rec = run(main())
    finally:
        server.gw.settings = settings
    assert rec.of("done", "long") and rec.of("done", "next")


def test_a_context_refused_with_a_flush_gets_no_flushed_after_its_final_error(server: Server) -> None:
    """The refusal (`final`) is the context's last event; its flush was answered
    `flushed` after it."""
    async def main() -> Recording:
        rec = Recording()
        async with websockets.connect(server.url) as ws:
            await receive_until(ws, rec, lambda r: bool(r.of("session_started")))
            await send(ws, type="text", context_id="x", text="Hello.", voice="nobody", flush=True)
            await send(ws, type="flush", context_id="y")  # not open: flush_id 0 at once
            await send(ws, type="text", context_id="ok", text="Hi.", end=True)
            await receive_until(ws, rec, has_done("ok"), timeout=60)
        return rec

    rec = run(main())
    assert [e["code"] for e in rec.of("error", "x")] == ["voice_not_found"] and rec.of("error", "x")[0]["final"]
    assert not rec.of("flushed", "x")
    assert [e["flush_id"] for e in rec.of("flushed", "y")] == [0]


def test_flushes_sent_without_reading_keep_bounded_tasks_and_queue(server: Server, monkeypatch: Any) -> None:
    """A flush is settled apart from the reader; a client that sends flushes while its
    socket is full must not make a task of each (the marks wait in the context's queue),
    nor grow that queue by a mark a message (it did, without limit): marks in a row are one
    entry, and each still gets its own `flushed`, in order."""
    from gateway.ws_pump import AudioPump

    full = socket_full_for(monkeypatch, "bp2")
    runtimes: dict[str, Any] = {}
    start = AudioPump.start

    def recording(self: Any, rt: Any) -> None:
        runtimes[rt.cid] = rt
        start(self, rt)

    monkeypatch.setattr(AudioPump, "start", recording)

    async def settling() -> tuple[int, int]:
        tasks = sum(1 for t in asyncio.all_tasks() if t.get_name().endswith("-bp2-settle"))
        return tasks, len(runtimes["bp2"].pending)

    async def main() -> tuple[Recording, tuple[int, int]]:
        rec = Recording()
        async with websockets.connect(server.url) as ws:
            await receive_until(ws, rec, lambda r: bool(r.of("session_started")))
            await send(ws, type="text", context_id="bp2", text="A first sentence to speak. And a second one.")
            assert await asyncio.to_thread(full.wait, 60)
            for _ in range(500):
                await send(ws, type="flush", context_id="bp2")
            await send(ws, type="flush", context_id="probe")  # answered at once: the reader got this far
            await receive_until(ws, rec, lambda r: bool(r.of("flushed", "probe")), timeout=20)
            held = asyncio.run_coroutine_threadsafe(settling(), server.loop).result(10)
            await send(ws, type="cancel", context_id="bp2")
            await receive_until(ws, rec, lambda r: bool(r.of("cancelled", "bp2")), timeout=20)
            # Marks in a row on a socket that is read: one `flushed` each, in order.
            await send(ws, type="text", context_id="f3", text="Hello there")
            for _ in range(5):
                await send(ws, type="flush", context_id="f3")
            await send(ws, type="end", context_id="f3")
            await receive_until(ws, rec, has_done("f3"), timeout=60)
        return rec, held

    rec, (tasks, marks) = run(main())
    assert tasks <= 2, tasks
    assert marks <= 3, marks  # the utterances of "bp2" and one entry for its marks
    assert [e["flush_id"] for e in rec.of("flushed", "f3")] == [1, 2, 3, 4, 5]
    assert rec.events.index(rec.of("flushed", "f3")[-1]) < rec.events.index(rec.of("done", "f3")[0])


# ---- after a review of the limits (engine run-ahead) -----------------------------------------


def test_a_full_socket_stops_the_engine_making_later_segments_audio(server: Server, monkeypatch: Any) -> None:
    """The socket's queue is bounded, but the engine went on: each segment's utterance
    made its audio into a queue of its own, so a client that did not read had its whole
    text made and held (here ~40 s of audio for a socket capped at 64 KiB). Past
    `max_unread_audio_s` only the utterance being delivered makes more now."""
    engine = server.gw.engine
    monkeypatch.setattr(engine, "config", dataclasses.replace(engine.config, max_unread_audio_s=1.0))
    full = socket_full_for(monkeypatch, "ra")
    text = " ".join(f"This is sentence number {i} of a long reply." for i in range(40))

    async def held() -> tuple[float, bool]:
        """Seconds of the context's audio the engine holds, and whether every LM is done."""
        sessions = [s for s in engine._sessions if any(uid.startswith("ra-") for uid in s._stats)]
        samples = sum(sum(len(ev.pcm) for ev in s._events._queue if hasattr(ev, "pcm"))
                      + sum(u.undelivered for u in s._utts.values()) for s in sessions)
        lm_done = all(u.lm_done.is_set() for s in sessions for u in s._utts.values())
        return samples / engine.sample_rate, bool(sessions) and lm_done and len(sessions[0]._stats) == 40

    async def main() -> tuple[Recording, float]:
        rec = Recording()
        async with websockets.connect(server.url) as ws:
            await receive_until(ws, rec, lambda r: bool(r.of("session_started")))
            await send(ws, type="text", context_id="ra", text=text, end=True)
            assert await asyncio.to_thread(full.wait, 60)
            most = 0.0
            deadline = time.monotonic() + 120
            while True:  # until every segment's LM is done (the LM is not held back)
                seconds, done = asyncio.run_coroutine_threadsafe(held(), server.loop).result(10)
                most = max(most, seconds)
                if done or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.05)  # pacing the poll, not synchronising
            assert done, "the LM did not finish every segment"
            await send(ws, type="cancel", context_id="ra")
            await receive_until(ws, rec, lambda r: bool(r.of("cancelled", "ra")), timeout=20)
        return rec, most

    rec, most = run(main())
    assert rec.of("cancelled", "ra")
    assert most < 8.0, most  # the cap, the utterance being delivered and a chunk or two besides
    assert not [s for s in engine._sessions if any(uid.startswith("ra-") for uid in s._stats)]
