"""HTTP API against a real uvicorn server: voices, uploads, restart, health, auth, metrics.

The app is the production one (`gateway.app.create_app`) with the tiny random-weight
engine, served by `helpers.LiveServer` on a loopback port. Engine failures are injected
with `helpers.StageFault` around the real audio stage, never by a stand-in engine.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import logging
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import httpx
import numpy as np
import pytest
import websockets

from gateway.audio_files import decode_audio, wav_bytes
from gateway.auth import Auth
from gateway.http_api import speech_pieces
from helpers import (  # noqa: F401 (LiveServer, register, ... are re-exported for other test modules)
    API_KEY,
    AUTH,
    FAST,
    SAMPLES_PER_TOKEN,
    SR,
    LiveServer,
    StageFault,
    WsRecorder,
    err,
    eventually,
    gateway_settings,
    leftovers,
    live_gateway,
    register,
    same_prompt,
    scrape,
    tone,
    tone_wav,
)


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_gateway(tiny_model_dir, tmp_path_factory.mktemp("http")) as srv:
        yield srv


# --------------------------------------------------------------------------------------
# Health, readiness, auth
# --------------------------------------------------------------------------------------


def test_health_open_everything_else_needs_key(server) -> None:
    srv = server
    with srv.client() as c:
        assert c.get("/health").json() == {"status": "ok"}
        for method, path in [("GET", "/ready"), ("GET", "/metrics"), ("GET", "/debug/planner"), ("GET", "/v1/models"),
                             ("GET", "/v1/voices"), ("POST", "/v1/audio/speech"), ("DELETE", "/v1/voices/x")]:
            resp = c.request(method, path)
            assert err(resp) == (401, "unauthorized"), path
            assert resp.headers["www-authenticate"] == "Bearer"
        assert err(c.get("/ready", headers={"Authorization": "Bearer wrong"})) == (401, "unauthorized")
        assert c.get("/ready", headers=AUTH).json() == {"status": "ready", "model": srv.gw.engine.model_name}
        assert srv.gw.engine.model_name == "tiny-random"

        srv.gw.engine.ready = False
        try:
            assert err(c.get("/ready", headers=AUTH)) == (503, "not_ready")
            assert c.get("/health").status_code == 200  # liveness is not readiness
            srv.gw.draining = True  # speech says why it refuses, as /ready does
            speech = c.post("/v1/audio/speech", headers=AUTH, json={"model": "tts-1", "input": "Hi.", "voice": "default"})
            assert err(speech) == (503, "not_ready") and "draining" in speech.json()["error"]["message"]
        finally:
            srv.gw.engine.ready, srv.gw.draining = True, False


def test_a_known_path_asked_with_another_method_is_a_405(server) -> None:
    """Not the demo page's static mount's 404: the path exists, the method does not."""
    with server.client() as c:
        for method, path, allow in [("GET", "/v1/audio/speech", "POST"), ("PUT", "/v1/voices", "GET, HEAD, POST"),
                                    ("POST", "/v1/voices/x", "DELETE, GET, HEAD"), ("DELETE", "/health", "GET, HEAD")]:
            resp = c.request(method, path, headers=AUTH)
            assert err(resp) == (405, "method_not_allowed"), (method, path)
            assert resp.headers["allow"] == allow
        assert err(c.get("/v1/nothing", headers=AUTH)) == (404, "not_found")
        assert c.get("/", headers=AUTH).status_code == 200  # the page itself


def test_a_start_without_the_default_voice_says_so(tiny_model_dir: Path, tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """A server started outside the checkout finds no assets dir (a relative path): the
    default voice is then missing, which the start says instead of every request's 404."""
    with caplog.at_level(logging.WARNING, logger="gateway.app"), live_gateway(tiny_model_dir, tmp_path):
        pass
    (line,) = [r.getMessage() for r in caplog.records if "default voice" in r.getMessage()]
    assert "'default' is not registered" in line and "no-assets: not found" in line


def test_auth_websocket_query_token() -> None:
    auth = Auth((API_KEY,))
    ws = SimpleNamespace(headers={}, query_params={"token": API_KEY})
    assert auth.check_websocket(ws)
    assert not auth.check_websocket(SimpleNamespace(headers={}, query_params={"token": "nope"}))
    assert auth.check_websocket(SimpleNamespace(headers={"authorization": f"Bearer {API_KEY}"}, query_params={}))
    assert Auth(()).check_websocket(SimpleNamespace(headers={}, query_params={}))


def test_models_lists_aliases(server) -> None:
    srv = server
    with srv.client() as c:
        ids = [m["id"] for m in c.get("/v1/models", headers=AUTH).json()["data"]]
        assert ids == ["tts-1", "tts-1-hd", "gpt-4o-mini-tts", "cosyvoice3", "tiny-random"]
        assert c.get("/v1/models/tts-1", headers=AUTH).json()["id"] == "tts-1"
        assert err(c.get("/v1/models/whisper-1", headers=AUTH)) == (404, "model_not_found")


# --------------------------------------------------------------------------------------
# Voices
# --------------------------------------------------------------------------------------


def test_voice_crud(server) -> None:
    srv = server
    with srv.client() as c:
        resp = register(c, "crud", tone_wav(4.0), "A voice for the test.", name="Crud Voice")
        assert resp.status_code == 201, resp.text
        body = resp.json()
        assert (body["id"], body["name"], body["transcript"]) == ("crud", "Crud Voice", "A voice for the test.")
        assert body["duration_s"] == pytest.approx(4.0) and body["sample_rate"] == SR

        assert c.get("/v1/voices/crud", headers=AUTH).json() == body
        assert "crud" in [v["id"] for v in c.get("/v1/voices", headers=AUTH).json()["data"]]
        assert err(register(c, "crud", tone_wav(4.0))) == (409, "voice_exists")

        assert c.delete("/v1/voices/crud", headers=AUTH).json() == {"id": "crud", "object": "voice", "deleted": True}
        assert err(c.delete("/v1/voices/crud", headers=AUTH)) == (404, "voice_not_found")
        assert err(c.get("/v1/voices/crud", headers=AUTH)) == (404, "voice_not_found")


def test_voice_json_base64_upload(server) -> None:
    srv = server
    with srv.client() as c:
        audio = wav_bytes(tone(3.5, 16000), 16000)
        resp = c.post("/v1/voices", headers=AUTH, json={
            "id": "json-voice", "transcript": "Base64 upload.", "audio": base64.b64encode(audio).decode()})
        assert resp.status_code == 201, resp.text
        assert resp.json()["sample_rate"] == 16000
        resp = c.post("/v1/voices", headers=AUTH, json={"id": "gen", "transcript": "x", "audio": "%%%not-base64"})
        assert err(resp) == (400, "invalid_audio")


def test_a_large_json_upload_is_parsed_off_the_event_loop(server, monkeypatch) -> None:
    """A JSON voice upload carries up to ~27 MB of base64; parsing, checking and decoding it
    on the event loop held every stream's audio ~100 ms per 20 MB."""
    import asyncio

    import gateway.http_api as http_api

    on_loop: list[tuple[int, bool]] = []
    parse = http_api._parse_json_object

    def spy(raw: bytes) -> Any:
        on_loop.append((len(raw), asyncio._get_running_loop() is not None))
        return parse(raw)

    monkeypatch.setattr(http_api, "_parse_json_object", spy)
    with server.client() as c:
        audio = wav_bytes(tone(10.0, 16000), 16000)  # ~430 kB of base64
        resp = c.post("/v1/voices", headers=AUTH, json={
            "id": "json-large", "transcript": "A larger upload.", "audio": base64.b64encode(audio).decode()})
        assert resp.status_code == 201, resp.text
        assert c.post("/v1/audio/speech", headers=AUTH, json={"input": "Hi.", "voice": "json-large",
                                                              "response_format": "pcm", **FAST}).status_code == 200
    (large, large_on_loop), (small, small_on_loop) = on_loop
    assert large > http_api.OFF_LOOP_BYTES and not large_on_loop
    assert small < http_api.OFF_LOOP_BYTES and small_on_loop


def _flac_bytes(seconds: float) -> bytes:
    """A FLAC upload: registration must take any container PyAV decodes."""
    from gateway.audio_files import make_encoder

    enc = make_encoder("flac", SR)
    return enc.encode(tone(seconds)) + enc.close()


def test_voice_upload_other_container(server) -> None:
    srv = server
    with srv.client() as c:
        resp = register(c, "flac-voice", _flac_bytes(3.5), filename="prompt.flac")
        assert resp.status_code == 201, resp.text
        assert resp.json()["duration_s"] == pytest.approx(3.5, abs=0.01)


@pytest.mark.parametrize(
    "voice_id, audio, transcript, expected",
    [
        ("notaudio", b"this is a text file, not audio\n" * 40, "hi", (400, "invalid_audio")),
        ("short", tone_wav(1.5), "hi", (400, "audio_too_short")),
        ("long", wav_bytes(tone(31.0, 16000), 16000), "hi", (400, "audio_too_long")),
        ("lowrate", wav_bytes(tone(4.0, 8000), 8000), "hi", (400, "sample_rate_too_low")),
        ("bad/id", tone_wav(4.0), "hi", (400, "invalid_voice_id")),
        ("bad id", tone_wav(4.0), "hi", (400, "invalid_voice_id")),
        ("Ω-voice", tone_wav(4.0), "hi", (400, "invalid_voice_id")),
        ("x" * 65, tone_wav(4.0), "hi", (400, "invalid_voice_id")),
        ("notext", tone_wav(4.0), "", (400, "missing_transcript")),
    ],
)
def test_bad_uploads(server, voice_id, audio, transcript, expected) -> None:
    srv = server
    with srv.client() as c:
        resp = register(c, voice_id, audio, transcript)
        assert err(resp) == expected
        assert voice_id not in [v["id"] for v in c.get("/v1/voices", headers=AUTH).json()["data"]]


def test_json_voice_fields_of_the_wrong_type_are_invalid_requests(server) -> None:
    """README: a field of the wrong type is a 400 `invalid_request`. A number for `audio`
    was called missing (`missing_audio`), and a `format` that is no string was taken as
    the stored file's extension (a list became `.['wav']`, then `bin`) and registered."""
    audio = base64.b64encode(tone_wav(3.5)).decode()
    with server.client() as c:
        for voice_id, fields in (("typed-audio", {"audio": 123}), ("typed-format", {"audio": audio, "format": ["wav"]})):
            resp = c.post("/v1/voices", headers=AUTH, json={"id": voice_id, "transcript": "Hi.", **fields})
            assert err(resp) == (400, "invalid_request"), resp.text
            assert err(c.get(f"/v1/voices/{voice_id}", headers=AUTH)) == (404, "voice_not_found")
        assert err(c.post("/v1/voices", headers=AUTH, json={"id": "x", "transcript": "Hi.", "audio": ""})) == (
            400, "missing_audio")


def test_missing_file_field(server) -> None:
    srv = server
    with srv.client() as c:
        resp = c.post("/v1/voices", headers=AUTH, data={"id": "nofile", "transcript": "hi"},
                      files={"other": ("x.txt", b"abc", "text/plain")})
        assert err(resp) == (400, "missing_audio")


def test_too_large_upload_is_cut_off(server) -> None:
    """413 both when Content-Length says so and for a chunked body with no length."""
    srv = server
    big = tone_wav(45.0)  # 2.16 MB > the 2 MB limit of this server
    with srv.client() as c:
        assert err(register(c, "big", big)) == (413, "audio_too_large")

        sent = {"bytes": 0}
        boundary = "testboundary"
        head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"id\"\r\n\r\nbig2\r\n"
                f"--{boundary}\r\nContent-Disposition: form-data; name=\"transcript\"\r\n\r\nhi\r\n"
                f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n"
                f"Content-Type: audio/wav\r\n\r\n").encode()

        def endless() -> Iterator[bytes]:  # a client that would send 100 MB
            yield head
            block = b"\0" * 65536
            for _ in range(1600):
                sent["bytes"] += len(block)
                yield block

        resp = None
        with contextlib.suppress(httpx.TransportError):  # the server may hang up mid-upload
            resp = c.post("/v1/voices", headers={**AUTH, "Content-Type": f"multipart/form-data; boundary={boundary}"},
                          content=endless())
        if resp is not None:
            assert err(resp) == (413, "audio_too_large")
        # The server answered and hung up long before the client's 100 MB were out.
        assert sent["bytes"] < 50_000_000
        assert "big2" not in [v["id"] for v in c.get("/v1/voices", headers=AUTH).json()["data"]]


def test_bounded_stream_stops_pulling_at_the_limit() -> None:
    import asyncio

    from gateway.audio_files import read_body_bounded
    from gateway.errors import ApiError

    pulled = []

    async def source():
        for i in range(100):
            pulled.append(i)
            yield b"x" * 1000

    async def scenario() -> None:
        assert len(await read_body_bounded(source(), 200_000)) == 100_000
        pulled.clear()
        with pytest.raises(ApiError) as exc:
            await read_body_bounded(source(), 4_500)
        assert (exc.value.status, exc.value.code) == (413, "audio_too_large")
        assert len(pulled) == 5  # the 5th chunk crossed the limit; nothing after it was read

    asyncio.run(scenario())


# --------------------------------------------------------------------------------------
# Speech (the OpenAI client tests are in test_openai_client.py; these are the edges)
# --------------------------------------------------------------------------------------


def test_a_start_that_fails_after_the_engine_loaded_closes_the_engine(tiny_model_dir: Path, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The voice store failing to open (a PostgreSQL store that cannot be reached) after the
    engine loaded: the start fails with that error, and the engine is closed, not left with
    its stage process (which once kept the interpreter from exiting)."""
    from gateway import app as app_module

    built: list[Any] = []
    closed: list[Any] = []

    async def engine_then_record(*args: Any, **kwargs: Any) -> Any:
        engine = await real_create_engine(*args, **kwargs)
        close = engine.close

        async def recorded_close() -> None:
            closed.append(engine)
            await close()

        engine.close = recorded_close
        built.append(engine)
        return engine

    class Unreachable:
        async def open(self) -> None:
            raise RuntimeError("voice store unreachable")

    real_create_engine = app_module.create_engine
    monkeypatch.setattr(app_module, "create_engine", engine_then_record)
    monkeypatch.setattr(app_module, "create_voice_store", lambda *args, **kwargs: Unreachable())
    from starlette.testclient import TestClient

    with pytest.raises(RuntimeError, match="voice store unreachable"):
        with TestClient(app_module.create_app(gateway_settings(tiny_model_dir, tmp_path))):
            pass
    assert len(built) == 1 and closed == built and not built[0].ready


def test_long_speech_input_is_spoken_sentence_by_sentence(server) -> None:
    """A long input goes to the engine as the WebSocket path would send it, one utterance
    per segment (a whole 4096-character input in one LM request would overrun its context):
    the audio and the SSE usage add up over the pieces, and the file ends once, after the
    last."""
    srv = server
    text = " ".join(f"Sentence number {n} is here." for n in range(1, 31))  # ~800 characters
    pieces = speech_pieces(text)
    assert len(pieces) == 30 and "".join(pieces).replace(" ", "") == text.replace(" ", "")
    tokens = sum(len(srv.gw.engine.text_ids(p)) for p in pieces)
    body = {"model": "tts-1", "voice": "long-reader", "input": text, **FAST}
    with srv.client() as c:
        assert register(c, "long-reader", tone_wav(3.5)).status_code == 201
        chunks = srv.gw.engine.stats().chunks
        pcm = c.post("/v1/audio/speech", headers=AUTH, json={**body, "response_format": "pcm"})
        assert pcm.status_code == 200 and len(pcm.content) == 2 * tokens * 2 * SAMPLES_PER_TOKEN
        # At least a chunk per piece: one utterance of its ~400 tokens would be ~10 chunks.
        assert srv.gw.engine.stats().chunks - chunks >= len(pieces)
        wav = decode_audio(c.post("/v1/audio/speech", headers=AUTH, json={**body, "response_format": "wav"}).content)
        assert wav.samples.shape[0] == 2 * tokens * SAMPLES_PER_TOKEN
        sse = c.post("/v1/audio/speech", headers=AUTH, json={**body, "response_format": "pcm", "stream_format": "sse"})
        events = [json.loads(line[6:]) for line in sse.text.splitlines() if line.startswith("data: ")]
        assert [e["type"] for e in events].count("speech.audio.done") == 1 and events[-1]["type"] == "speech.audio.done"
        assert events[-1]["usage"]["output_tokens"] == 2 * tokens
    assert speech_pieces("...") == ["..."]  # nothing speakable: the engine says so


def test_speech_errors(server) -> None:
    srv = server
    with srv.client() as c:
        assert register(c, "speaker", tone_wav(3.5)).status_code == 201

        def speech(**body: Any) -> httpx.Response:
            return c.post("/v1/audio/speech", headers=AUTH, json={"model": "tts-1", "voice": "speaker",
                                                                 "input": "Hi there.", **FAST, **body})

        assert speech().status_code == 200
        assert err(speech(input="x" * 4097)) == (400, "input_too_long")
        # The body limit follows max_input_chars: 25,001 emoji are 300 kB of JSON escapes,
        # and the answer is about the input, not the bytes.
        settings = srv.gw.settings
        srv.gw.settings = dataclasses.replace(settings, max_input_chars=25_000)
        try:
            assert err(speech(input="\N{GRINNING FACE}" * 25_001)) == (400, "input_too_long")
        finally:
            srv.gw.settings = settings
        assert err(speech(input="   ")) == (400, "invalid_request")
        assert err(speech(voice="nobody")) == (404, "voice_not_found")
        assert err(speech(model="whisper-1")) == (404, "model_not_found")
        # A dated snapshot of a served name, as OpenAI's documentation names them.
        assert speech(model="gpt-4o-mini-tts-2025-12-15").status_code == 200
        assert err(speech(model="gpt-4o-mini-tts-turbo")) == (404, "model_not_found")
        assert err(speech(speed=4.5)) == (400, "invalid_speed")
        assert err(speech(speed=0.1)) == (400, "invalid_speed")
        assert err(speech(speed=10**400)) == (400, "invalid_speed")  # float() of it overflows
        assert err(speech(seed=-1)) == (400, "invalid_request")
        assert err(speech(seed=2**64)) == (400, "invalid_request")
        assert speech(seed=2**63 - 1).status_code == 200
        assert err(speech(instructions="x" * 501)) == (400, "instructions_too_long")
        # max_sessions counts HTTP syntheses with the WebSockets: with the one slot held by
        # a socket, a speech request is refused, not queued.
        from websockets.sync.client import connect

        settings = srv.gw.settings
        with connect(srv.ws_url, additional_headers=AUTH) as ws:
            assert json.loads(ws.recv(timeout=30))["type"] == "session_started"  # counted by now
            assert srv.gw.metrics.sessions_active == 1
            srv.gw.settings = dataclasses.replace(settings, max_sessions=1)
            try:
                assert err(speech()) == (503, "too_many_sessions")
            finally:
                srv.gw.settings = settings
        assert speech().status_code == 200
        assert err(speech(response_format="ogg")) == (400, "unsupported_format")
        assert err(speech(stream_format="ws")) == (400, "unsupported_format")
        # The engine failing before any audio exists is a proper 500, not a broken 200.
        assert register(c, "faulty", tone_wav(3.5, freq=330.0)).status_code == 201
        with StageFault(srv.gw.engine, srv.call(srv.gw.voices.get_prompt("faulty")), from_chunk=0) as fault:
            assert err(speech(voice="faulty")) == (500, "synthesis_failed")
            assert speech().status_code == 200  # other voices are served meanwhile
        assert fault.count == 1
        assert speech(voice="faulty").status_code == 200  # and the voice works once the fault is gone
        resp = c.post("/v1/audio/speech", headers={**AUTH, "Content-Type": "application/json"}, content=b"{nope")
        assert err(resp) == (400, "invalid_request")
        # Bodies json.loads refuses with other errors than a syntax error: an integer past
        # Python's digit limit (ValueError), arrays nested past the recursion limit.
        for raw in (b'{"input": "Hi.", "seed": 1' + b"0" * 5000 + b"}", b"[" * 100_000 + b"]" * 100_000):
            resp = c.post("/v1/audio/speech", headers={**AUTH, "Content-Type": "application/json"}, content=raw)
            assert err(resp) == (400, "invalid_request")
        # A stock OpenAI voice name with no "default" voice registered is a clean 404.
        assert err(speech(voice="alloy")) == (404, "voice_not_found")


def test_client_disconnect_aborts_engine_session(server) -> None:
    srv = server
    with srv.client() as c:
        assert register(c, "longtalk", tone_wav(3.5)).status_code in (201, 409)
        assert leftovers(c) == {}
        body = {"model": "tts-1", "voice": "longtalk", "input": "word " * 400, "response_format": "pcm",
                "tokens_per_text_token": 20.0}  # ~5 minutes of audio if read to the end
        with c.stream("POST", "/v1/audio/speech", headers=AUTH, json=body) as resp:
            assert resp.status_code == 200
            chunks = resp.iter_raw()  # keep a reference: a collected iterator closes the response
            first = next(chunks)
            assert len(first) > 0
            with srv.client() as probe:
                busy = scrape(probe)
            assert busy["cosyvoice_engine_active_sessions"] == 1 and busy["cosyvoice_sessions_active"] == 1
        # Closing the response closes the connection; the server must abort the session:
        # no engine session, utterance, LM request or queued chunk is left behind.
        eventually(lambda: leftovers(c) == {}, timeout=30)


def speak_once(c, voice_id: str, text: str) -> None:
    """Register a voice (or find it registered) and speak `text` with it once."""
    assert register(c, voice_id, tone_wav(3.5)).status_code in (201, 409)
    resp = c.post("/v1/audio/speech", headers=AUTH, json={"model": "tts-1", "voice": voice_id, "input": text, **FAST})
    assert resp.status_code == 200, resp.text


def test_metrics_exposition(server) -> None:
    srv = server
    with srv.client() as c:
        speak_once(c, "metered", "Count me.")
        c.post("/v1/audio/speech", headers=AUTH, json={"model": "tts-1", "voice": "ghost", "input": "x"})
        text = c.get("/metrics", headers=AUTH).text
    lines = text.splitlines()
    assert "# TYPE cosyvoice_first_audio_seconds histogram" in lines
    count = next(float(l.split()[-1]) for l in lines if l.startswith("cosyvoice_first_audio_seconds_count"))
    inf = next(float(l.split()[-1]) for l in lines if l.startswith('cosyvoice_first_audio_seconds_bucket{le="+Inf"}'))
    assert count >= 1 and inf == count
    assert any(l.startswith('cosyvoice_errors_total{code="voice_not_found"}') for l in lines)
    assert any(l.startswith('cosyvoice_http_requests_total{route="/v1/audio/speech",status="200"}') for l in lines)
    assert "cosyvoice_sessions_active 0" in lines
    opened = next(int(l.split()[-1]) for l in lines if l.startswith("cosyvoice_sessions_opened_total"))
    assert opened >= 1
    assert any(l.startswith("cosyvoice_engine_lm_tokens") for l in lines)
    # Every sample line parses as "<name>[{labels}] <number>".
    for line in lines:
        if line and not line.startswith("#"):
            float(line.rsplit(" ", 1)[1])


def test_an_unexpected_error_is_a_counted_json_500(server, monkeypatch) -> None:
    srv = server

    def broken() -> list[Any]:
        raise RuntimeError("a bug")

    with srv.client() as c:
        series = 'cosyvoice_http_requests_total{route="/v1/voices",status="500"}'
        before = scrape(c).get(series, 0.0)
        monkeypatch.setattr(srv.gw.voices, "list", broken)
        assert err(c.get("/v1/voices", headers=AUTH)) == (500, "internal_error")
        monkeypatch.undo()
        assert scrape(c)[series] == before + 1


def test_audio_seconds_count_websocket_audio_too(server) -> None:
    srv = server
    with srv.client() as c:
        assert register(c, "wsmeter", tone_wav(3.5)).status_code in (201, 409)
        before = scrape(c).get("cosyvoice_audio_seconds_total", 0.0)

    async def speak() -> WsRecorder:
        async with websockets.connect(srv.ws_url, additional_headers=AUTH) as ws:
            rec = WsRecorder(ws)
            await rec.recv_one()
            await rec.send(type="text", context_id="m", voice="wsmeter", text="Count this audio.", end=True)
            return await rec.until(lambda r: r.finished("m"), 60)

    with srv.client() as c:
        firsts = scrape(c).get("cosyvoice_first_audio_seconds_count", 0.0)
    (done,) = asyncio.run(speak()).of("done", "m")
    with srv.client() as c:
        metrics = scrape(c)
    after = metrics["cosyvoice_audio_seconds_total"]
    assert done["duration_ms"] > 0
    assert after - before == pytest.approx(done["duration_ms"] / 1000, abs=0.03)
    assert metrics["cosyvoice_first_audio_seconds_count"] == firsts + 1  # one context, one first audio


def test_websocket_first_audio_is_timed_when_its_frame_is_sent() -> None:
    """As the HTTP route's: after encoding and the socket's queue, at the first frame that
    carries audio (not at the engine's PCM, nor at an event)."""
    from gateway.protocol import ContextSettings
    from gateway.ws import _ContextRuntime, _Item

    seen: list[float] = []
    rt = _ContextRuntime("c", ContextSettings(voice="v"), session=None, encoder=None, header=b"",  # type: ignore[arg-type]
                         first_audio=seen.append)
    rt.on_sent(_Item("{}", rt, 2))  # an event before any submission
    rt.first_submit_at = time.monotonic() - 5.0  # submitted 5 s ago
    rt.on_sent(_Item("{}", rt, 2))  # segment_started: no audio
    assert seen == []
    rt.on_sent(_Item(b"x" * 960, rt, 960, samples=480))
    rt.on_sent(_Item(b"x" * 960, rt, 960, samples=480))
    # Once, and from the submission (not from the first event sent, nor 0): at least the 5 s.
    assert len(seen) == 1 and seen[0] >= 5.0


def test_debug_planner_tuning_needs_the_setting(server) -> None:
    """POST /debug/planner sets planner knobs only with `debug_tuning`: 403 without it, 400
    for a bad knob (nothing set), 200 and the new state with it."""
    srv = server
    planner = srv.gw.engine.first_chunks
    start = planner.min_hop  # the configured default (8); each post asks for another value
    assert start != 6
    with srv.client() as c:
        resp = c.post("/debug/planner", json={"min_hop": 6}, headers=AUTH)
        assert resp.status_code == 403 and resp.json()["error"]["code"] == "tuning_off"
        assert planner.min_hop == start
        assert c.post("/debug/planner", json={"min_hop": 6}).status_code == 401  # auth first
        srv.gw.settings = dataclasses.replace(srv.gw.settings, debug_tuning=True)
        planner.limit = planner.limit_ceiling = 40  # a planner that sizes first chunks (this server's are fixed)
        try:
            resp = c.post("/debug/planner", json={"min_hop": 6, "idle_hop": 99}, headers=AUTH)
            assert resp.status_code == 400 and "idle_hop" in resp.json()["error"]["message"]
            assert planner.min_hop == start
            resp = c.post("/debug/planner", json={"min_hop": 6, "margin": 0.25}, headers=AUTH)
            assert resp.status_code == 200 and resp.json()["min_hop"] == 6 and resp.json()["margin"] == 0.25
            assert (planner.min_hop, planner.margin) == (6, 0.25)
            assert c.get("/debug/planner", headers=AUTH).json()["min_hop"] == 6
            resp = c.post("/debug/planner", json={"limit": 41}, headers=AUTH)  # past the configured limit
            assert resp.status_code == 400 and "limit must be within [0, 40]" in resp.json()["error"]["message"]
            resp = c.post("/debug/planner", json={"limit": 30}, headers=AUTH)
            assert resp.status_code == 200 and resp.json()["limit"] == planner.limit == 30
            resp = c.post("/debug/planner", content=b"[1]", headers=AUTH | {"content-type": "application/json"})
            assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_request"
            # The stage's own settings too, all or none with the planner's.
            engine, stage = srv.gw.engine, srv.gw.engine.stage
            resp = c.post("/debug/planner", json={"min_hop": 7, "split_call_cost": -1}, headers=AUTH)
            assert resp.status_code == 400 and "split_call_cost" in resp.json()["error"]["message"]
            assert planner.min_hop == 6 and stage.split_call_cost == 730
            resp = c.post("/debug/planner", json={"nonsense": 1}, headers=AUTH)
            message = resp.json()["error"]["message"]
            assert resp.status_code == 400 and "fill_padding" in message and "min_hop" in message
            resp = c.post("/debug/planner", json={"fill_padding": True, "split_call_cost": 400}, headers=AUTH)
            assert resp.status_code == 200
            assert (stage.fill_padding, stage.split_call_cost, engine.fill_padding) == (True, 400, True)
        finally:
            srv.gw.engine.tune_planner({"fill_padding": False, "split_call_cost": 730})
            planner.tune({"min_hop": start, "margin": 0.5})
            planner.limit = planner.limit_ceiling = srv.gw.engine.config.initial_hop_max
            srv.gw.settings = dataclasses.replace(srv.gw.settings, debug_tuning=False)


def test_debug_planner_shows_what_first_chunks_are_sized_on(server) -> None:
    srv = server
    with srv.client() as c:
        speak_once(c, "planned", "Plan me a first chunk.")
        resp = c.get("/debug/planner", headers=AUTH)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("application/json")
    state = resp.json()
    assert set(state) >= {"round_times", "lm_steps", "holdback_s", "margin", "limit", "initial_hop", "opening_rate",
                          "live_utterances"}
    rounds = state["round_times"]
    assert rounds and all(r["batches"] >= 1 and r["wall_s"] > 0 for r in rounds)  # the stage ran batches
    works = [r["work"] for r in rounds]
    predicted = [r["predicted_s"] for r in rounds]
    assert works == sorted(works) and predicted == sorted(predicted)  # the curve never falls
    assert set(state["lm_steps"]) == {"opening", "later"}
    assert state["limit"] == srv.gw.engine.config.initial_hop_max
    assert state["initial_hop"] == srv.gw.engine.config.initial_hop


# --------------------------------------------------------------------------------------
# Persistence across a restart
# --------------------------------------------------------------------------------------


def test_voice_survives_restart(tiny_model_dir: Path, tmp_path: Path) -> None:
    with live_gateway(tiny_model_dir, tmp_path) as srv, srv.client() as c:
        assert register(c, "persist", tone_wav(4.0), "I will be back.").status_code == 201
        before = c.get("/v1/voices/persist", headers=AUTH).json()
        prompt_before = srv.call(srv.gw.voices.get_prompt("persist"))
        speech = {"model": "tts-1", "voice": "persist", "input": "Still here.", "response_format": "pcm", **FAST}
        pcm_before = c.post("/v1/audio/speech", headers=AUTH, json=speech).content

    with live_gateway(tiny_model_dir, tmp_path) as srv, srv.client() as c:
        assert c.get("/v1/voices/persist", headers=AUTH).json() == before
        assert same_prompt(srv.call(srv.gw.voices.get_prompt("persist")), prompt_before)
        resp = c.post("/v1/audio/speech", headers=AUTH, json={**speech, "response_format": "wav"})
        assert resp.status_code == 200
        audio = decode_audio(resp.content)
        assert audio.sample_rate == SR and audio.duration_s > 0.1
        assert np.all(np.isfinite(audio.samples)) and float(np.abs(audio.samples).max()) > 0
        # Same voice, same seed: the restarted server speaks the same samples as before.
        assert c.post("/v1/audio/speech", headers=AUTH, json=speech).content == pcm_before
        tokens = len(srv.gw.engine.text_ids("Still here."))
        assert len(pcm_before) == 2 * tokens * 2 * SAMPLES_PER_TOKEN  # s16, 2 tokens per text token


def test_registrations_in_progress_are_bounded(server, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each registration holds its upload and threads synthesis shares: past
    `voices.max_concurrent_registrations` one is refused before its body is read."""
    gw = server.gw
    monkeypatch.setattr(gw, "settings", dataclasses.replace(
        gw.settings, voices=dataclasses.replace(gw.settings.voices, max_concurrent_registrations=1)))

    async def main() -> tuple[int, dict[str, Any], int, int]:
        release = asyncio.Event()

        async def slow_body() -> Any:
            yield b'{"transcript": "Hello there.", "audio": "'
            await release.wait()
            yield b'AAAA"}'

        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as client:
            first = asyncio.create_task(client.post("/v1/voices", content=slow_body(),
                                                    headers={"content-type": "application/json"}))
            async with asyncio.timeout(30):  # until the server holds the first one
                while gw.registrations == 0:
                    await asyncio.sleep(0.01)
            refused = await client.post("/v1/voices", json={"transcript": "Hi.", "audio": "AAAA"})
            release.set()
            done = await first
            after = await client.post("/v1/voices", json={"transcript": "Hi.", "audio": "AAAA"})
        return refused.status_code, refused.json(), done.status_code, after.status_code

    status, body, first_status, after_status = asyncio.run(main())
    assert status == 429 and body["error"]["code"] == "too_many_registrations"
    assert first_status == 400 and after_status == 400 and gw.registrations == 0  # not audio, but let in


def test_a_non_string_model_is_a_400_not_a_500(server) -> None:
    """`model` of another JSON type (a number, a list, an object) is a wrong-typed field,
    documented as 400 invalid_request; `serves_model` called `.startswith` on it (a 500)."""
    with server.client() as c:
        for model in (5, ["tts-1"], {"id": "tts-1"}, True):
            resp = c.post("/v1/audio/speech", headers=AUTH, json={"model": model, "input": "Hi.", "voice": "default"})
            assert resp.status_code == 400 and err(resp) == (400, "invalid_request"), (model, resp.status_code)


def test_an_empty_file_part_gives_way_to_the_next_audio_name(server) -> None:
    """README: "Where several names are given, the first non-empty one in that order
    counts". An empty `file` part (a form's file input left empty) beside the audio under
    `audio` must register from `audio`, not fail with missing_audio."""
    b = "emptyfirstboundary"
    body = (f"--{b}\r\nContent-Disposition: form-data; name=\"id\"\r\n\r\nempty-first\r\n"
            f"--{b}\r\nContent-Disposition: form-data; name=\"transcript\"\r\n\r\nHello there.\r\n"
            # What a browser sends for a file input left empty.
            f"--{b}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"\"\r\n"
            f"Content-Type: application/octet-stream\r\n\r\n\r\n"
            f"--{b}\r\nContent-Disposition: form-data; name=\"audio\"; filename=\"prompt.wav\"\r\n"
            f"Content-Type: audio/wav\r\n\r\n").encode() + tone_wav(3.5) + f"\r\n--{b}--\r\n".encode()
    with server.client() as c:
        resp = c.post("/v1/voices", headers={**AUTH, "Content-Type": f"multipart/form-data; boundary={b}"}, content=body)
        assert resp.status_code == 201, resp.text


def test_a_client_that_leaves_mid_body_is_no_internal_error(server) -> None:
    """A client that hangs up while its body is still coming (a browser tab closed during a
    voice upload, a speech request given up) is not a bug of the server: Starlette's
    `ClientDisconnect` went to the last resort, logged as an unhandled error with its
    traceback and counted as a 500 `internal_error`, which an alert on internal errors
    reads as the gateway failing. It is counted as 499, as a speech client that leaves
    before its first audio is."""
    import socket

    def served(metrics: dict[str, float], route: str) -> float:
        return sum(v for k, v in metrics.items() if k.startswith(f'cosyvoice_http_requests_total{{route="{route}"'))

    cases = [("/v1/voices", "application/json", b'{"transcript": "Hello there.", "audio": "UklGR'),
             ("/v1/voices", "multipart/form-data; boundary=b",
              b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\nRIFF'),
             ("/v1/audio/speech", "application/json", b'{"model": "tts-1", "input": "Hel')]
    with server.client() as c:
        for route, ctype, part in cases:
            before = scrape(c)
            with socket.create_connection(("127.0.0.1", server.port)) as sock:
                sock.sendall(f"POST {route} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: {AUTH['Authorization']}\r\n"
                             f"Content-Type: {ctype}\r\nContent-Length: 100000\r\n\r\n".encode() + part)
            # Gone with most of the body unsent: wait until the server has answered it.

            def answered() -> dict[str, float] | None:
                metrics = scrape(c)
                return metrics if served(metrics, route) > served(before, route) else None

            after = eventually(answered)
            key = f'cosyvoice_http_requests_total{{route="{route}",status="500"}}'
            assert after.get(key, 0.0) == before.get(key, 0.0), route
            internal = 'cosyvoice_errors_total{code="internal_error"}'
            assert after.get(internal, 0.0) == before.get(internal, 0.0), route
            key = f'cosyvoice_http_requests_total{{route="{route}",status="499"}}'
            assert after.get(key, 0.0) == before.get(key, 0.0) + 1, route


def test_a_multipart_charset_that_spells_a_lone_surrogate_is_a_400(server) -> None:
    """A multipart body's `charset` decodes its text fields, and UTF-7 can spell a lone
    surrogate (`+2AA-` is U+D800), which JSON bodies are refused for: the transcript or
    name reached SQLite after the voice was featurised, a 500."""
    b = "utf7boundary"
    for field, value in (("transcript", "Hello +2AA- there."), ("name", "A +2AA- name")):
        fields = {"id": f"utf7-{field}", "transcript": "Hello there.", field: value}
        body = "".join(f"--{b}\r\nContent-Disposition: form-data; name=\"{k}\"\r\n\r\n{v}\r\n"
                       for k, v in fields.items()).encode()
        body += (f"--{b}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"prompt.wav\"\r\n"
                 f"Content-Type: audio/wav\r\n\r\n").encode() + tone_wav(3.5) + f"\r\n--{b}--\r\n".encode()
        with server.client() as c:
            resp = c.post("/v1/voices", content=body,
                          headers={**AUTH, "Content-Type": f"multipart/form-data; boundary={b}; charset=utf-7"})
            assert err(resp) == (400, "invalid_request"), (field, resp.status_code, resp.text)
            assert err(c.get(f"/v1/voices/utf7-{field}", headers=AUTH)) == (404, "voice_not_found")


def test_instructions_with_nothing_to_instruct_are_a_400(server) -> None:
    """`instructions` that are only CosyVoice's own prompt parts (its system sentence, the
    `<|endofprompt|>` marker) leave no instruction once brought into the prompt's form: the
    engine refuses them as `bad_options`, a fault of the request, which was answered as a
    500 `synthesis_failed` (an engine failure)."""
    with server.client() as c:
        assert register(c, "instructed", tone_wav(3.5)).status_code in (201, 409)
        for instructions in ("<|endofprompt|>", "You are a helpful assistant.", "<|endofprompt|>Speak happily."):
            resp = c.post("/v1/audio/speech", headers=AUTH, json={"input": "Hello there.", "voice": "instructed",
                                                                 "instructions": instructions, **FAST})
            assert err(resp) == (400, "invalid_request"), (instructions, resp.status_code, resp.text)
        ok = c.post("/v1/audio/speech", headers=AUTH, json={"input": "Hello there.", "voice": "instructed",
                                                           "instructions": "Speak happily.", **FAST})
        assert ok.status_code == 200


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
def test_a_speech_response_whose_client_stops_reading_is_broken_off(spec_version: str) -> None:
    """A speech client that stays connected but stops reading makes the server's `send`
    wait for ever (flow control), and its session, one of `max_sessions`, was held as long:
    a few such clients locked everyone else out with `too_many_sessions`. After
    `speech_send_timeout_s` without progress the transfer is broken off and the body closed
    (its `finally` aborts the engine session), the stall counted."""
    import asyncio

    from gateway.http_api import SpeechClientStalled, _ClosingStreamingResponse

    closed: list[bool] = []
    stalls: list[int] = []
    sent: list[str] = []

    async def body():
        try:
            for _ in range(1000):
                yield b"x" * 1000
        finally:
            closed.append(True)

    async def main() -> None:
        async def send(message) -> None:
            sent.append(message["type"])
            if len(sent) > 2:  # the client's buffers are full: this send never returns
                await asyncio.Event().wait()

        async def receive():
            await asyncio.Event().wait()  # connected: no disconnect ever comes

        resp = _ClosingStreamingResponse(body(), media_type="audio/pcm", send_timeout_s=0.05,
                                         on_stall=lambda: stalls.append(1))
        with pytest.raises(SpeechClientStalled):
            await resp({"type": "http", "asgi": {"spec_version": spec_version}}, receive, send)

    asyncio.run(asyncio.wait_for(main(), 30))
    assert closed == [True] and stalls == [1]
    assert sent == ["http.response.start", "http.response.body", "http.response.body"]


def test_unknown_voice_and_model_names_are_quoted_back_cut_short(server) -> None:
    """An unknown voice or model name was quoted back whole in the 404's message (a name
    of tens of KB in a speech body, a long path segment), where the WebSocket's errors cut
    client strings to 128 characters: so do these."""
    long = "v" * 20_000
    with server.client() as c:
        responses = [
            c.post("/v1/audio/speech", headers=AUTH, json={"input": "Hello there.", "voice": long, **FAST}),
            c.post("/v1/audio/speech", headers=AUTH, json={"input": "Hello there.", "model": long, **FAST}),
            c.get(f"/v1/voices/{'v' * 4000}", headers=AUTH),
            c.delete(f"/v1/voices/{'v' * 4000}", headers=AUTH),
            c.get(f"/v1/models/{'m' * 4000}", headers=AUTH),
        ]
        for resp, code in zip(responses, ["voice_not_found", "model_not_found", "voice_not_found", "voice_not_found",
                                          "model_not_found"]):
            assert err(resp) == (404, code), resp.text[:200]
            message = resp.json()["error"]["message"]
            assert len(message) < 300 and ("v" * 128 in message or "m" * 128 in message), message[:300]
