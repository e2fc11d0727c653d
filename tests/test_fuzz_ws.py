"""Fuzzing the WebSocket protocol.

Two layers:

* the sans-I/O parser and state machine (`parse_client_message`, `ConnectionState`)
  get thousands of hypothesis-generated frames: they never raise, and every refusal is
  an `error` event with a documented code;
* a live server gets a few hundred malformed, mistyped, oversized, binary and invalid
  UTF-8 frames over real sockets while a bystander socket streams a context: the fuzzed
  socket keeps answering with documented errors (or is closed with 1007 for invalid
  UTF-8, as RFC 6455 requires), the bystander's audio is complete and the engine is
  idle afterwards.

`FUZZ_WS_FRAMES` (env) scales the live run; docs/reliability.md records a long one.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
from pathlib import Path
from typing import Any, Iterator

import pytest
import websockets
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.types import SessionOptions
from gateway.protocol import (
    ERROR_CODES,
    ConnectionState,
    ContextSettings,
    ProtocolError,
    Send,
    WsLimits,
    parse_client_message,
)
from helpers import AUTH, SAMPLES_PER_TOKEN, LiveServer, WsRecorder, eventually, leftovers, live_gateway, register, tone_wav

DOCS = Path(__file__).resolve().parent.parent / "docs" / "protocol.md"
DOCUMENTED = set(re.findall(r"^\| `([a-z_]+)` \|", DOCS.read_text(), re.M)) & ERROR_CODES
# Compression on here (off by default): the fuzzed socket runs through the deflate path too.
LIMITS = WsLimits(max_message_bytes=4096, max_contexts=4, max_text_chars=600, keepalive_interval_s=0,
                  per_message_deflate=True)
FIELDS = ["type", "context_id", "text", "voice", "mode", "instruction", "speed", "language", "format",
          "sample_rate", "audio", "segmentation", "flush", "end", "stats_interval_ms", "text_mode"]
TYPES = ["text", "open", "flush", "end", "cancel", "config", "keepalive", "close"]


def test_documented_codes_cover_the_protocol() -> None:
    # Every code the protocol can send is in docs/protocol.md's table, and the table names
    # none the protocol does not list (`voice_store_unavailable` was sent and documented,
    # but missing from ERROR_CODES).
    assert ERROR_CODES - DOCUMENTED == set()
    errors = DOCS.read_text().split("\n## Errors\n", 1)[1].split("\n## ", 1)[0]
    assert set(re.findall(r"^\| `([a-z_]+)` \|", errors, re.M)) == ERROR_CODES


# ---- strategies -------------------------------------------------------------------------

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                         st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)), max_leaves=12)


@st.composite
def near_valid(draw: st.DrawFn) -> dict[str, Any]:
    """A message of a real type whose fields are drawn from valid and invalid values."""
    msg: dict[str, Any] = {"type": draw(st.sampled_from(TYPES + ["", "TEXT", "bogus"]))}
    for key in draw(st.lists(st.sampled_from(FIELDS[1:]), max_size=6, unique=True)):
        msg[key] = draw(st.one_of(
            json_values,
            st.sampled_from(["c1", "c2", "*", "", "a" * 65, "../x", "default", "ghost", "pcm_s16le", "opus",
                             "mulaw", "base64", "binary", "instruct", "stream", "segment"]),
            st.sampled_from([0, -1, 8000, 24000, 44100, 48000, 96000, 0.24, 0.25, 4.0, 4.01, 1e308]),
            st.text(min_size=0, max_size=300),
        ))
    return msg


frames = st.one_of(
    near_valid().map(json.dumps),
    json_values.map(lambda v: json.dumps(v, allow_nan=True)),
    st.text(max_size=200),  # mostly not JSON at all
    st.binary(max_size=200),  # binary frames
    st.integers(4000, 5000).map(lambda n: json.dumps({"type": "text", "context_id": "c", "text": "x" * n})),
    st.integers(1, 3000).map(lambda n: "[" * n + "]" * n),  # deep nesting
)


@settings(max_examples=int(os.environ.get("FUZZ_WS_EXAMPLES", "300")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(frames, min_size=1, max_size=8))
def test_parser_and_state_machine_never_raise(batch: list[str | bytes]) -> None:
    state = ConnectionState(ContextSettings(voice="default"), LIMITS)
    for raw in batch:
        msg = parse_client_message(raw, LIMITS)
        if isinstance(msg, ProtocolError):
            assert msg.code in DOCUMENTED, msg
        for cmd in state.handle(msg):
            if isinstance(cmd, Send) and cmd.event.get("type") == "error":
                assert cmd.event["code"] in DOCUMENTED, cmd.event
                assert isinstance(cmd.event["message"], str)
        # Whatever came in, the state never tracks more contexts than allowed.
        assert len(state.contexts) <= LIMITS.max_contexts


# ---- live -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_gateway(tiny_model_dir, tmp_path_factory.mktemp("fuzzws"), ws=LIMITS) as srv:
        # Cheap audio: the fuzzer opens many contexts by accident.
        srv.gw.session_defaults = SessionOptions(tokens_per_text_token=0.5, seed=0)
        with srv.client() as c:
            assert register(c, "default", tone_wav(3.5)).status_code == 201
        yield srv


def _mutations(rng: random.Random, n: int) -> Iterator[tuple[str, str | bytes]]:
    """(kind, frame): a seeded mix of every kind of bad input (and a few good ones)."""
    good = [{"type": "text", "context_id": "f", "text": "Hi there."}, {"type": "flush", "context_id": "f"},
            {"type": "end", "context_id": "f"}, {"type": "cancel", "context_id": "*"}, {"type": "keepalive"},
            {"type": "open", "context_id": "g"}, {"type": "config", "speed": 1.0}]
    junk_values: list[Any] = [None, True, 0, -1, 1.5, 1e309, "", "x" * 5000, [], {}, [1, {"a": None}],
                              "\u0000", "\ud800", "../../etc", "🙂" * 50, 2**64, "NaN"]
    for i in range(n):
        kind = rng.choice(["malformed", "wrong_type", "huge", "empty_text", "binary", "invalid_utf8_binary",
                           "unknown_voice", "bad_format", "bad_rate", "unknown_type", "good"])
        base = dict(rng.choice(good))
        if kind == "malformed":
            s = json.dumps(base)
            cut = rng.randrange(1, len(s))
            yield kind, rng.choice([s[:cut], s[cut:], s.replace('"', "'"), s + "}", "{" + s, s.replace(":", "=")])
        elif kind == "wrong_type":
            key = rng.choice(FIELDS)
            base[key] = rng.choice(junk_values)
            yield kind, json.dumps(base, allow_nan=True)
        elif kind == "huge":
            # Over max_message_bytes but under the transport's limit (the limit + 64 KiB here):
            # message_too_large on a live socket.
            yield kind, json.dumps({"type": "text", "context_id": "h", "text": "word " * rng.randint(900, 13000)})
        elif kind == "empty_text":
            yield kind, json.dumps({"type": "text", "context_id": f"e{i % 3}", "text": rng.choice(["", " ", "\n\t", "..."]),
                                    "end": rng.random() < 0.5})
        elif kind == "binary":
            yield kind, json.dumps(base).encode()
        elif kind == "invalid_utf8_binary":
            yield kind, b"\xff\xfe" + bytes(rng.randrange(256) for _ in range(rng.randint(0, 64)))
        elif kind == "unknown_voice":
            yield kind, json.dumps({"type": "text", "context_id": "v", "voice": rng.choice(["ghost", "../x", "a" * 200]),
                                    "text": "Hello.", "end": True})
        elif kind == "bad_format":
            yield kind, json.dumps({"type": "open", "context_id": "b", "format": rng.choice(["mp3", "wav", "", "PCM", 7])})
        elif kind == "bad_rate":
            yield kind, json.dumps({"type": "open", "context_id": "r", "format": rng.choice(["pcm_s16le", "opus", "ulaw_8000"]),
                                    "sample_rate": rng.choice([0, -8000, 7999, 96000, 2**40, 16000.5, "16000"])})
        elif kind == "unknown_type":
            yield kind, json.dumps({"type": rng.choice(["TEXT", "speak", "", "close_all", "\u0000"]), "context_id": "u"})
        else:
            yield kind, json.dumps(base)


async def _fuzz_socket(url: str, seed: int, n: int) -> tuple[WsRecorder, dict[str, int]]:
    rng = random.Random(seed)
    counts: dict[str, int] = {}
    async with websockets.connect(url, additional_headers=AUTH, max_size=None) as ws:
        assert [type(e).__name__ for e in ws.protocol.extensions] == ["PerMessageDeflate"]
        rec = WsRecorder(ws)
        await rec.recv_one()
        # Keep reading while sending (a socket that does not read is a slow consumer).
        reader = asyncio.create_task(rec.until(lambda r: r.finished("final"), 600))
        for kind, frame in _mutations(rng, n):
            counts[kind] = counts.get(kind, 0) + 1
            await ws.send(frame)
            if counts[kind] % 25 == 0:
                await ws.send(json.dumps({"type": "cancel", "context_id": "*"}))
        # Still serving: a clean context on the fuzzed socket completes.
        await ws.send(json.dumps({"type": "cancel", "context_id": "*"}))
        await ws.send(json.dumps({"type": "text", "context_id": "final", "voice": "default",
                                  "text": "Still here after the storm.", "end": True}))
        await asyncio.wait_for(reader, 180)
        return rec, counts


async def _invalid_utf8_text_frame(url: str) -> int | None:
    async with websockets.connect(url, additional_headers=AUTH) as ws:
        await ws.recv()
        await ws.send(b'{"type":"text","context_id":"x","text":"\xff\xfe"}', text=True)  # not UTF-8
        with pytest.raises(websockets.ConnectionClosed):
            while True:
                await asyncio.wait_for(ws.recv(), 10)
        return ws.close_code


class _AlwaysRead:
    """The server's voices as the PostgreSQL store serves them: none without a read first
    (here a few turns of the event loop, as a round trip would give), so every context
    starts in the background (`gateway.ws._Starting`) and races the messages after it."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.reads = 0

    def cached_prompt(self, voice_id: str) -> None:
        return None

    async def get_prompt(self, voice_id: str) -> Any:
        self.reads += 1
        for _ in range(3):
            await asyncio.sleep(0)
        return await self._inner.get_prompt(voice_id)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@pytest.mark.parametrize("starts", ["in order", "in the background"])
def test_live_fuzz_keeps_serving_and_bystanders_unaffected(server: LiveServer, starts: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    always_read = _AlwaysRead(server.gw.voices)
    if starts == "in the background":
        monkeypatch.setattr(server.gw, "voices", always_read)
    n = int(os.environ.get("FUZZ_WS_FRAMES", "500"))
    text = "The bystander speaks one clean sentence, start to end."

    async def bystander() -> WsRecorder:
        async with websockets.connect(server.ws_url, additional_headers=AUTH) as ws:
            rec = WsRecorder(ws)
            await rec.recv_one()
            for word in text.split(" "):  # token by token, as an LLM would send it
                await rec.send(type="text", context_id="b", text=word + " ")
            await rec.send(type="end", context_id="b")
            return await rec.until(lambda r: r.finished("b"), 120)

    async def scenario() -> tuple[tuple[WsRecorder, dict[str, int]], WsRecorder, int | None]:
        fuzz, by, utf8 = await asyncio.gather(_fuzz_socket(server.ws_url, 7, n), bystander(),
                                              _invalid_utf8_text_frame(server.ws_url))
        return fuzz, by, utf8

    (rec, counts), by, utf8_code = asyncio.run(scenario())
    assert sum(counts.values()) == n and len(counts) >= 10
    assert (always_read.reads > 20) == (starts == "in the background")  # contexts started that way
    errors = rec.of("error")
    assert errors, "the fuzzer provoked no error at all"
    codes = {e["code"] for e in errors}
    assert codes <= DOCUMENTED and "internal_error" not in codes, codes
    assert {"invalid_json", "invalid_message", "binary_not_supported", "message_too_large"} <= codes, codes
    (final,) = rec.of("done", "final")
    assert final["audio_samples"] > 0
    # Invalid UTF-8 in a text frame is a protocol violation: closed 1007, nothing else.
    assert utf8_code == 1007
    # The bystander heard its whole sentence.
    assert not by.of("error")
    (done,) = by.of("done", "b")
    assert done["audio_samples"] * 2 == len(by.audio["b"]) > 0
    expected = sum(round(0.5 * len(server.gw.engine.text_ids(s["text"].strip()))) or 1
                   for s in by.of("segment_started", "b")) * SAMPLES_PER_TOKEN
    assert done["audio_samples"] == expected
    with server.client() as c:
        assert c.get("/health").status_code == 200
        eventually(lambda: leftovers(c) == {}, timeout=30)


def test_lone_surrogates_are_refused_and_never_kill_the_socket(server: LiveServer) -> None:
    """Regression (found by the live fuzzer): JSON may spell "\\ud800", which is not
    text; echoing it in an event crashed the socket's writer (1011) and the tokenizer
    failed on it. Now the message is refused and the socket carries on."""
    from gateway.ws import _dumps

    async def main() -> WsRecorder:
        async with websockets.connect(server.ws_url, additional_headers=AUTH) as ws:
            rec = WsRecorder(ws)
            await rec.recv_one()
            await ws.send('{"type":"text","context_id":"a","voice":"\\ud800x","text":"Hi."}')
            await ws.send('{"type":"open","context_id":"b","language":"\\udfff"}')
            await ws.send('{"type":"text","context_id":"c","text":"Odd \\ud800 text.","end":true}')
            await ws.send('{"type":"text","context_id":"b","text":"Fine \\ud83d\\ude00.","end":true}')  # a valid pair
            return await rec.until(lambda r: r.finished("b"), 60)

    rec = asyncio.run(main())
    assert [e["code"] for e in rec.of("error")] == ["invalid_message"] * 3
    assert not rec.of("context_started", "a") and not rec.of("context_started", "c")
    assert rec.of("done", "b")[0]["audio_samples"] > 0
    # Defence in depth: an event holding one still goes out, as an ASCII JSON escape.
    assert _dumps({"voice": "\ud800"}) == '{"voice":"\\ud800"}'
