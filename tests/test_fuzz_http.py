"""Fuzzing every HTTP route with hypothesis against the live production app.

Bodies are drawn near the valid shape (real field names with valid, wrong-typed,
out-of-range, huge and empty values), as arbitrary JSON, as raw bytes (invalid UTF-8
included) and under wrong content types. Every answer must be a success or an error
from the table in `gateway/errors.py` with its documented status, never a 500, and the
server must answer `/health` after each one. A bystander streams speech all along and
must receive its complete audio; afterwards the engine is idle.

`FUZZ_HTTP_EXAMPLES` (env) scales the run; docs/reliability.md records a long one.
"""

from __future__ import annotations

import base64
import json
import os
import re
import threading
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import quote

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gateway.errors
from helpers import AUTH, LiveServer, err, eventually, leftovers, live_gateway, register, tone_wav

# (code -> status) from the table in gateway/errors.py's docstring.
DOCUMENTED: dict[str, int] = {m[0]: int(m[1]) for m in re.findall(r"^([a-z_]+)\s+(\d{3})\s", gateway.errors.__doc__ or "", re.M)}
BYSTANDER_TEXT = "A bystander keeps talking while the fuzzer hammers every route."
MAX_CHARS = 300


def test_error_table_parsed() -> None:
    assert DOCUMENTED["invalid_request"] == 400 and DOCUMENTED["audio_too_large"] == 413 and len(DOCUMENTED) >= 20


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_gateway(tiny_model_dir, tmp_path_factory.mktemp("fuzzhttp"), max_input_chars=MAX_CHARS) as srv:
        with srv.client() as c:
            assert register(c, "default", tone_wav(3.5)).status_code == 201
            assert register(c, "keeper", tone_wav(3.5, freq=300.0)).status_code == 201
        yield srv


# ---- strategies -------------------------------------------------------------------------

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), st.text(max_size=30))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                      max_leaves=8)
texts = st.one_of(st.text(max_size=60), st.just(""), st.just("   "), st.text(min_size=MAX_CHARS, max_size=MAX_CHARS + 5),
                  # "\ud800": a lone surrogate, legal as a JSON escape but not Unicode text
                  st.sampled_from(["Hello there.", "1234 5678", "🙂🙂", "\u0000", "\ud800 lone", "x\udfff"]))


def field(options: list[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(st.sampled_from(options), values)


speech_fields = {
    "model": field(["tts-1", "tts-1-hd", "cosyvoice3", "whisper-1", ""]),
    "input": st.one_of(texts, values),
    "voice": field(["default", "keeper", "alloy", "ghost", "../etc/passwd", {"id": "default"}, {"id": 3}]),
    "response_format": field(["mp3", "opus", "aac", "flac", "wav", "pcm", "ogg", "", "PCM"]),
    "stream_format": field(["audio", "sse", "ws"]),
    "speed": field([0.25, 4.0, 0.24, 4.01, 1, "1.0", float("nan"), float("inf")]),
    "instructions": field(["Speak softly.", "", "x" * 600]),
    "seed": field([0, -1, 2**63, 1.5]),
    "tokens_per_text_token": field([0.5, 0, 50, 50.1, -1, float("nan")]),
}
voice_fields = {
    "id": field(["new1", "bad id", "../x", "x" * 65, "", "default"]),
    "transcript": st.one_of(texts, values),
    "name": field(["n", "x" * 300]),
    "format": field(["wav", "../../x", "", "toolongext"]),
    "audio": st.one_of(st.binary(max_size=64).map(lambda b: base64.b64encode(b).decode()), values,
                       st.sampled_from(["%%%", "data:audio/wav;base64,AAAA", ""])),
}


VALID_SPEECH = {"model": "tts-1", "input": "Hello there.", "voice": "default", "response_format": "pcm",
                "tokens_per_text_token": 0.5, "seed": 0}
VALID_VOICE = {"transcript": "A fuzzed voice.", "audio": base64.b64encode(tone_wav(3.2)).decode(), "format": "wav"}


@st.composite
def bodies(draw: st.DrawFn, fields: dict[str, st.SearchStrategy[Any]], valid: dict[str, Any]) -> dict[str, Any]:
    """A valid body with 0-3 fields replaced, some removed, maybe an unknown one added."""
    out = dict(valid)
    for key in draw(st.lists(st.sampled_from(sorted(fields)), unique=True, max_size=3)):
        if draw(st.integers(0, 4)) == 0:
            out.pop(key, None)
        else:
            out[key] = draw(fields[key])
    if draw(st.integers(0, 3)) == 0:
        out[draw(st.text(max_size=8))] = draw(values)  # an unknown field
    return out


payloads = st.one_of(
    st.tuples(st.just("json"), st.none()),  # the near-valid body for the route
    st.tuples(st.just("json"), st.none()),
    st.tuples(st.just("any_json"), values),
    st.tuples(st.just("bytes"), st.binary(max_size=300)),  # includes invalid UTF-8
    st.tuples(st.just("form"), st.dictionaries(st.sampled_from(["id", "transcript", "text", "file", "audio"]),
                                               st.text(max_size=20), max_size=4)),
    st.tuples(st.just("wrong_ctype"), st.text(max_size=50)),
)
ROUTES = ["speech", "create_voice", "get_voice", "delete_voice", "get_model", "list"]
WEIGHTED_ROUTES = ROUTES[:2] * 3 + ROUTES[2:]  # the two routes with bodies get most of the budget


def _send(c: httpx.Client, route: str, kind: str, extra: Any, body: dict[str, Any], seg: str) -> httpx.Response:
    if route in ("get_voice", "delete_voice", "get_model"):
        method = "DELETE" if route == "delete_voice" else "GET"
        prefix = "/v1/models/" if route == "get_model" else "/v1/voices/"
        return c.request(method, prefix + quote(seg, safe=""), headers=AUTH)
    if route == "list":
        return c.get(seg and f"/v1/{quote(seg, safe='')}" or "/v1/voices", headers=AUTH)
    path = "/v1/audio/speech" if route == "speech" else "/v1/voices"
    if kind == "json":
        content, ctype = json.dumps(body, allow_nan=True).encode(), "application/json"
    elif kind == "any_json":
        content, ctype = json.dumps(extra, allow_nan=True).encode(), "application/json"
    elif kind == "bytes":
        content, ctype = extra, "application/json"
    elif kind == "form":
        files = {"file": ("a.wav", extra.pop("file").encode(), "audio/wav")} if "file" in extra else None
        return c.post(path, headers=AUTH, data=extra, files=files)
    else:
        content, ctype = extra.encode(), "text/plain"
    headers = {**AUTH, "Content-Type": ctype}
    # Stream, and hang up right after the status: a valid request costs one chunk, and
    # every hang-up exercises the abort path too.
    with c.stream("POST", path, headers=headers, content=content) as resp:
        if resp.status_code >= 400:
            resp.read()
        return resp


def _check(resp: httpx.Response) -> str:
    """The documented outcome of one response: "2xx" or its error code."""
    status = resp.status_code
    assert status in (200, 201, 400, 404, 405, 409, 413, 503), (status, resp.request.url)
    if status < 400:
        return "2xx"
    code_status = err(resp)
    assert DOCUMENTED.get(code_status[1]) == status, code_status
    return code_status[1]


def _fuzz(server: LiveServer, tally: dict[str, int], outcomes: dict[str, int]):
    n = int(os.environ.get("FUZZ_HTTP_EXAMPLES", "100"))

    @settings(max_examples=n, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])
    @given(route=st.sampled_from(WEIGHTED_ROUTES), payload=payloads, speech=bodies(speech_fields, VALID_SPEECH),
           voice=bodies(voice_fields, VALID_VOICE),
           seg=st.one_of(st.text(max_size=80), st.sampled_from(["default", "keeper", "tts-1", "..", "%2e%2e", ""])))
    def run(route: str, payload: tuple[str, Any], speech: dict[str, Any], voice: dict[str, Any], seg: str) -> None:
        kind, extra = payload
        if route == "delete_voice" and seg in ("keeper", "default"):
            seg = seg + "-not"  # keep the voices the bystander and others use
        if route == "create_voice" and voice.get("id") in ("keeper", "default"):
            voice["id"] = "new1"
        body = speech if route == "speech" else voice
        with server.client(timeout=60) as c:
            outcome = _check(_send(c, route, kind, extra, body, seg))
            assert c.get("/health").status_code == 200
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        tally[route] = tally.get(route, 0) + 1

    return run


def test_fuzz_every_route_server_alive_bystander_unharmed(server: LiveServer) -> None:
    result: dict[str, Any] = {}

    def bystander() -> None:
        body = {"voice": "keeper", "input": BYSTANDER_TEXT, "response_format": "pcm",
                "tokens_per_text_token": 2.0, "seed": 0}
        with server.client() as c:
            result["first"] = c.post("/v1/audio/speech", headers=AUTH, json=body)
            result["second"] = c.post("/v1/audio/speech", headers=AUTH, json=body)

    t = threading.Thread(target=bystander)
    t.start()
    tally: dict[str, int] = {}
    outcomes: dict[str, int] = {}
    _fuzz(server, tally, outcomes)()
    t.join(120)
    print(f"fuzzed requests per route: {tally}; outcomes: {outcomes}")
    # The fuzzer got past validation as well as into many distinct refusals.
    assert outcomes.get("2xx", 0) > 0 and len(outcomes) >= 6, outcomes
    assert sum(tally.values()) >= int(os.environ.get("FUZZ_HTTP_EXAMPLES", "100")) and set(tally) == set(ROUTES), tally
    first, second = result["first"], result["second"]
    expected = 2 * 2 * len(server.gw.engine.text_ids(BYSTANDER_TEXT)) * 960  # s16, 2 tokens/text token
    assert first.status_code == second.status_code == 200
    assert len(first.content) == len(second.content) == expected
    # Same seed, same audio: nothing leaked in from the fuzz. Not bit for bit: the bystander's
    # chunks share flow batches with whatever the fuzzer got through, and a batch of another
    # shape rounds differently in the last bits, which the flow's steps and the vocoder carry
    # on (seen: 1 LSB, and 3 once in a CI run). A leak (other text, other voice, shifted
    # state) moves samples by about the signal's own size: the bound is 1% of its peak.
    a = np.frombuffer(first.content, dtype="<i2").astype(np.int32)
    b = np.frombuffer(second.content, dtype="<i2").astype(np.int32)
    peak = np.abs(a).max()
    assert peak > 100  # real audio, so the bound below means something
    assert np.abs(a - b).max() <= max(2, peak // 100), (np.abs(a - b).max(), peak)
    with server.client() as c:
        assert c.get("/v1/voices/keeper", headers=AUTH).status_code == 200
        assert "internal_error" not in c.get("/metrics", headers=AUTH).text
        eventually(lambda: leftovers(c) == {}, timeout=30)


def test_lone_surrogate_in_json_is_a_400_not_a_500(server: LiveServer) -> None:
    """Regression (found while fuzzing): "\\ud800" is a legal JSON escape but not text;
    it used to reach SQLite / the tokenizer and come back as a 500 or a reset."""
    audio = base64.b64encode(tone_wav(3.2)).decode()
    cases = [("/v1/voices", {"id": "sur1", "transcript": "\ud800 hi", "audio": audio}),
             ("/v1/voices", {"id": "sur2", "transcript": "hi", "name": "\udfff", "audio": audio}),
             ("/v1/audio/speech", {"voice": "default", "input": "\ud800 hello", "response_format": "pcm"}),
             ("/v1/audio/speech", {"voice": "default", "input": "hi", "instructions": "x\udfff"})]
    with server.client() as c:
        for path, body in cases:
            resp = c.post(path, headers={**AUTH, "Content-Type": "application/json"}, content=json.dumps(body).encode())
            assert err(resp) == (400, "invalid_request"), (path, body)
        assert c.get("/v1/voices/sur1", headers=AUTH).status_code == 404
        ok = c.post("/v1/audio/speech", headers=AUTH, json={"voice": "default", "input": "Fine \U0001F600.",
                                                             "response_format": "pcm", "tokens_per_text_token": 1.0})
        assert ok.status_code == 200 and len(ok.content) > 0


def test_control_character_only_input_is_a_client_error(server: LiveServer) -> None:
    with server.client() as c:
        resp = c.post("/v1/audio/speech", headers=AUTH, json={"voice": "default", "input": "\u0000",
                                                               "response_format": "pcm"})
        assert resp.status_code == 400
