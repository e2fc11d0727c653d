"""The official `openai` client against the real app (`gateway.app.create_app`) with the
tiny random-weight engine, served by uvicorn on a loopback port.

Every response format is streamed with `audio.speech.with_streaming_response`, decoded
back with PyAV and compared with the raw PCM the engine produced for the same seeded
request; SSE is parsed with the SDK's own SSE decoder; a voice registered over HTTP
survives a server restart.

Deterministic lengths: `tokens_per_text_token=2` (sent through `extra_body`) makes the
LM emit exactly 2 speech tokens per text token, and 1 speech token = 960 samples.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import openai
import pytest
from openai._streaming import SSEDecoder

from gateway.app import create_app
from gateway.audio_files import MEDIA_TYPES, decode_audio
from gateway.settings import EngineSettings, Settings
from helpers import API_KEY, AUTH, SR, LiveServer, register, tone_wav

TEXT = "Hello there, streaming test."
EXTRA = {"tokens_per_text_token": 2.0, "seed": 0}
SAMPLES_PER_TOKEN = 960


def make_settings(model_dir: Path, root: Path) -> Settings:
    assets = root / "assets"
    assets.mkdir(exist_ok=True)
    # The default voice comes from the assets dir, registered at start-up by the app.
    (assets / "default.wav").write_bytes(tone_wav(3.5, freq=180.0))
    (assets / "default.txt").write_text("This is the default voice.")
    return Settings(
        model=str(model_dir),
        data_dir=root / "data",
        assets_dir=assets,
        api_keys=(API_KEY,),
        default_voice="default",
        engine=EngineSettings(device="cpu", lm_backend="torch", initial_hop_max=0, chunk_patience_s=0.0),  # reproducible audio
    )


@pytest.fixture(scope="module")
def live(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    settings = make_settings(tiny_model_dir, tmp_path_factory.mktemp("oai"))
    with LiveServer(create_app(settings)) as srv:
        with srv.client() as c:
            resp = register(c, "alice", tone_wav(4.0, freq=240.0), "Alice reads a short sentence.")
            assert resp.status_code == 201, resp.text
        yield srv


@pytest.fixture(scope="module")
def client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def speech_bytes(client: openai.OpenAI, **kw: Any) -> tuple[bytes, int, str]:
    """Stream one request; return (body, number of chunks read, content type)."""
    args = dict(model="tts-1", voice="alice", input=TEXT, response_format="pcm", extra_body=EXTRA)
    args.update(kw)
    with client.audio.speech.with_streaming_response.create(**args) as resp:
        assert resp.status_code == 200
        chunks = [c for c in resp.iter_bytes() if c]
        return b"".join(chunks), len(chunks), resp.headers["content-type"]


@pytest.fixture(scope="module")
def reference(client: openai.OpenAI) -> np.ndarray:
    """The engine's PCM for TEXT (s16 samples), via the raw `pcm` format."""
    body, _, ctype = speech_bytes(client)
    assert ctype == MEDIA_TYPES["pcm"]
    assert len(body) % 2 == 0
    return np.frombuffer(body, "<i2")


def test_reference_pcm_is_deterministic_and_sized_by_tokens(client: openai.OpenAI, reference: np.ndarray) -> None:
    assert reference.size > 0 and reference.size % SAMPLES_PER_TOKEN == 0
    assert float(np.abs(reference).max()) > 0  # not silence
    again, _, _ = speech_bytes(client)
    assert np.array_equal(np.frombuffer(again, "<i2"), reference)


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac", "flac", "wav", "pcm"])
def test_every_format_streams_and_decodes(client: openai.OpenAI, reference: np.ndarray, fmt: str) -> None:
    body, _, ctype = speech_bytes(client, response_format=fmt)
    assert ctype == MEDIA_TYPES[fmt]
    ref = reference.astype(np.float32) / 32767.0
    ref_seconds = ref.size / SR
    if fmt == "pcm":
        got = np.frombuffer(body, "<i2").astype(np.float32) / 32767.0
        rate = SR
    else:
        audio = decode_audio(body)
        got, rate = audio.samples, audio.sample_rate
    assert rate == (48000 if fmt == "opus" else SR)
    seconds = got.size / rate
    if fmt in ("pcm", "wav", "flac"):  # lossless: the very same samples
        assert got.size == ref.size
        np.testing.assert_allclose(got, ref, atol=1.5 / 32767)
    else:  # lossy codecs add encoder delay/padding of at most a few frames
        assert abs(seconds - ref_seconds) < 0.15, (seconds, ref_seconds)
        assert float(np.sqrt(np.mean(got ** 2))) > 0.1 * float(np.sqrt(np.mean(ref ** 2)))
    if fmt == "wav":
        # Streaming WAV: the header goes out before the length is known (OpenAI's form).
        assert body[:4] == b"RIFF" and body[8:12] == b"WAVE"
        assert int.from_bytes(body[40:44], "little") == 0xFFFFFFFF


def test_sse_events_as_the_sdk_parses_them(live: LiveServer, client: openai.OpenAI, reference: np.ndarray) -> None:
    with client.audio.speech.with_streaming_response.create(
        model="gpt-4o-mini-tts", voice="alice", input=TEXT, response_format="pcm",
        stream_format="sse", extra_body=EXTRA,
    ) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = list(SSEDecoder().iter_bytes(resp.iter_bytes()))
    payloads = [sse.json() for sse in events]
    assert len(payloads) >= 2
    *deltas, done = payloads
    assert all(set(d) == {"type", "audio"} and d["type"] == "speech.audio.delta" for d in deltas)
    assert set(done) == {"type", "usage"} and done["type"] == "speech.audio.done"
    audio = np.frombuffer(b"".join(base64.b64decode(d["audio"]) for d in deltas), "<i2")
    assert np.array_equal(audio, reference)
    usage = done["usage"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert usage["output_tokens"] == 2 * usage["input_tokens"]
    assert usage["output_tokens"] * SAMPLES_PER_TOKEN == reference.size


def test_speed_is_honoured_while_streaming(client: openai.OpenAI, reference: np.ndarray) -> None:
    fast, _, _ = speech_bytes(client, speed=2.0)
    slow, _, _ = speech_bytes(client, speed=0.5)
    n_fast, n_slow = len(fast) // 2, len(slow) // 2
    assert abs(n_fast - reference.size / 2) <= 0.02 * reference.size
    assert abs(n_slow - reference.size * 2) <= 0.02 * reference.size


def test_aliases_stock_voice_and_instructions(client: openai.OpenAI, reference: np.ndarray) -> None:
    for model in ("tts-1", "gpt-4o-mini-tts", "cosyvoice3"):
        body, _, _ = speech_bytes(client, model=model)
        assert len(body) // 2 == reference.size
    # A stock OpenAI voice name is served by the default voice registered from assets/.
    body, _, _ = speech_bytes(client, voice="alloy")
    assert len(body) // 2 == reference.size
    body, _, _ = speech_bytes(client, instructions="Speak slowly and warmly.")
    assert len(body) > 0
    ids = {m.id for m in client.models.list()}
    assert {"tts-1", "tts-1-hd", "gpt-4o-mini-tts", "cosyvoice3"} <= ids


def test_errors_reach_the_client_typed(live: LiveServer, client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        speech_bytes(client, voice="nobody")
    assert e.value.code == "voice_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        speech_bytes(client, input="a" * 4097)
    assert e.value.code == "input_too_long"
    with pytest.raises(openai.BadRequestError) as e:
        speech_bytes(client, speed=8.0)
    assert e.value.code == "invalid_speed"
    bad = openai.OpenAI(base_url=live.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        speech_bytes(bad)


def test_registered_voice_survives_restart(tiny_model_dir: Path, tmp_path: Path) -> None:
    settings = make_settings(tiny_model_dir, tmp_path)
    with LiveServer(create_app(settings)) as srv, srv.client() as c:
        resp = register(c, "carol", tone_wav(5.0, freq=300.0), "Carol stays for good.")
        assert resp.status_code == 201, resp.text
        listed = c.get("/v1/voices", headers=AUTH).json()["data"]
        assert {v["id"] for v in listed} == {"carol", "default"}
        first = openai.OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0)
        before, _, _ = speech_bytes(first, voice="carol")

    with LiveServer(create_app(settings)) as srv, srv.client() as c:
        after_list = c.get("/v1/voices", headers=AUTH).json()["data"]
        assert after_list == listed
        again = openai.OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0)
        after, _, _ = speech_bytes(again, voice="carol")
        # Same persisted prompt features + same seed => the same audio as before.
        assert after == before
        metrics = c.get("/metrics", headers=AUTH).text.splitlines()
        assert "cosyvoice_sessions_opened_total 1" in metrics  # counters start afresh per app
