"""Security: API keys on every route that needs one, voice ids and upload names that
cannot leave the data dir, bodies bounded before they are read, and model / voice files
that are loaded without executing anything they contain.

Runs against the production app (`create_app`) with the tiny engine on loopback.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import shutil
import socket
from pathlib import Path
from typing import Any, Iterator

import httpx
import numpy as np
import pytest
import torch
import websockets
from starlette.routing import Route

from gateway.app import transport_options
from gateway.auth import OPEN_PATHS
from gateway.protocol import CLOSE_POLICY
from helpers import API_KEY, AUTH, FAST, LiveServer, err, live_gateway, register, tone_wav


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_gateway(tiny_model_dir, tmp_path_factory.mktemp("sec")) as srv:
        with srv.client() as c:
            assert register(c, "default", tone_wav(3.5)).status_code == 201
        yield srv


def _http_routes(srv: LiveServer) -> list[tuple[str, str]]:
    """(method, concrete path) for every HTTP route the app serves (HEAD aside)."""
    out = []
    for route in srv.app.routes:
        if isinstance(route, Route):
            path = route.path.replace("{model}", "tts-1").replace("{voice_id}", "default")
            out += [(m, path) for m in sorted(route.methods or ()) if m != "HEAD"]
    return out


# --------------------------------------------------------------------------------------
# API keys
# --------------------------------------------------------------------------------------


def test_every_http_route_needs_the_key(server: LiveServer) -> None:
    routes = _http_routes(server)
    assert len(routes) >= 10  # the walk really found the API
    bad_headers = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {API_KEY}"},
                   {"Authorization": "Bearer"}, {"Authorization": API_KEY}, {"X-Api-Key": API_KEY}]
    with server.client() as c:
        for method, path in routes:
            if path in OPEN_PATHS:
                assert c.request(method, path).status_code == 200, path
                continue
            for headers in bad_headers:
                resp = c.request(method, path, headers=headers)
                assert err(resp) == (401, "unauthorized"), (method, path, headers)
                assert resp.headers["www-authenticate"] == "Bearer"
            # A key in the query string is for WebSockets only.
            assert c.request(method, path, params={"token": API_KEY}).status_code == 401
        # The right key gets past auth everywhere (DELETE last: it removes the voice).
        for method, path in routes:
            if method == "DELETE" or path in OPEN_PATHS:
                continue
            assert c.request(method, path, headers=AUTH).status_code != 401, (method, path)
        assert c.delete("/v1/voices/default", headers=AUTH).status_code == 200
        assert register(c, "default", tone_wav(3.5)).status_code == 201
        assert c.get("/v1/voices", headers={"Authorization": f"bearer {API_KEY}"}).status_code == 200


async def _ws_first(url: str, headers: dict[str, str] | None = None) -> tuple[dict[str, Any], int | None]:
    async with websockets.connect(url, additional_headers=headers or {}) as ws:
        first = json.loads(await asyncio.wait_for(ws.recv(), 10))
        if first.get("type") == "session_started":
            await ws.close()
            return first, None
        with pytest.raises(websockets.ConnectionClosed):
            await asyncio.wait_for(ws.recv(), 10)
        return first, ws.close_code


def test_websocket_needs_the_key(server: LiveServer) -> None:
    url = server.ws_url
    for suffix, headers in [("", None), ("?token=wrong", None), ("?token=", None),
                            ("", {"Authorization": "Bearer wrong"}), ("", {"Authorization": f"Basic {API_KEY}"})]:
        first, code = asyncio.run(_ws_first(url + suffix, headers))
        assert (first["type"], first["code"], code) == ("error", "unauthorized", CLOSE_POLICY), (suffix, headers)
    for suffix, headers in [(f"?token={API_KEY}", None), ("", AUTH)]:
        first, code = asyncio.run(_ws_first(url + suffix, headers))
        assert first["type"] == "session_started" and code is None


# --------------------------------------------------------------------------------------
# Paths: voice ids and upload names stay inside the data dir
# --------------------------------------------------------------------------------------

EVIL_IDS = ["../escape", "..", ".", "a/b", "a\\b", "/etc/passwd", "%2e%2e", "x\x00y", "voices/../../x",
            "café", " spaced", "x" * 65, ""]


def _tree(root: Path) -> set[Path]:
    return {p for p in root.rglob("*")}


def test_voice_ids_cannot_escape(server: LiveServer) -> None:
    data_dir = Path(server.gw.settings.data_dir).resolve()
    outside_before = set(os.listdir(data_dir.parent))
    with server.client() as c:
        for vid in EVIL_IDS:
            if vid == "":
                continue  # an empty id means "generate one"
            resp = c.post("/v1/voices", headers=AUTH, data={"id": vid, "transcript": "hi"},
                          files={"file": ("a.wav", tone_wav(3.5), "audio/wav")})
            assert err(resp) == (400, "invalid_voice_id"), vid
            resp = c.post("/v1/voices", headers=AUTH, json={"id": vid, "transcript": "hi", "audio": "AAAA"})
            assert resp.status_code == 400, vid
        # Path parameters: encoded traversal never reaches a file.
        for raw in ["..%2F..%2Fetc%2Fpasswd", "%2e%2e", "..%5C..%5Cx", "default%00", "..%2Fvoices.sqlite3"]:
            for method in ("GET", "DELETE"):
                resp = c.request(method, f"/v1/voices/{raw}", headers=AUTH)
                assert resp.status_code in (404, 405), (method, raw, resp.status_code)
        # Upload names and formats only choose a sanitised extension inside the voice's dir.
        before = _tree(data_dir)
        resp = register(c, "named", tone_wav(3.5), filename="../../../../tmp/evil.sh")
        assert resp.status_code == 201, resp.text
        resp = c.post("/v1/voices", headers=AUTH, json={
            "id": "fmt", "transcript": "hi", "format": "../../../x/y",
            "audio": base64.b64encode(tone_wav(3.5)).decode()})
        assert resp.status_code == 201, resp.text
        new = _tree(data_dir) - before
        assert new and all(p.resolve().is_relative_to(data_dir / "voices") for p in new), new
        names = {p.name for p in new if p.is_file()}
        assert names <= {"source.sh", "source.bin", "prompt.npz"}, names
        # WebSocket voices go through the same lookup: unknown, never a path.
        assert c.get("/v1/voices/named", headers=AUTH).status_code == 200
    assert set(os.listdir(data_dir.parent)) == outside_before


async def _ws_voice(url: str, voice: str) -> dict[str, Any]:
    async with websockets.connect(url, additional_headers=AUTH) as ws:
        await ws.recv()  # session_started
        await ws.send(json.dumps({"type": "text", "context_id": "c", "voice": voice, "text": "Hi.", "end": True}))
        while True:
            ev = json.loads(await asyncio.wait_for(ws.recv(), 30))
            if ev["type"] == "error":
                return ev


def test_websocket_voice_is_a_lookup_not_a_path(server: LiveServer) -> None:
    for voice in ["../../etc/passwd", "/etc/passwd", "..", "default/../default"]:
        ev = asyncio.run(_ws_voice(server.ws_url, voice))
        assert (ev["code"], ev["context_id"]) == ("voice_not_found", "c")


# --------------------------------------------------------------------------------------
# Bodies are bounded before they are read
# --------------------------------------------------------------------------------------


def _raw_exchange(port: int, head: bytes, body: bytes = b"", timeout: float = 10.0) -> bytes:
    """Send a request head (and optionally a few body bytes); return what the server says."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head + body)
        out = b""
        while b"\r\n\r\n" not in out or len(out) < 40:
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
        return out


@pytest.mark.parametrize("path, ctype, code", [
    ("/v1/voices", "multipart/form-data; boundary=x", "audio_too_large"),
    ("/v1/voices", "application/json", "audio_too_large"),
    ("/v1/audio/speech", "application/json", "request_too_large"),
])
def test_declared_oversize_body_refused_before_reading(server: LiveServer, path: str, ctype: str, code: str) -> None:
    # 10 GB announced, 10 bytes sent: the answer comes without waiting for the rest.
    head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: {ctype}\r\nContent-Length: 10000000000\r\n\r\n").encode()
    reply = _raw_exchange(server.port, head, b"0123456789")
    status_line, _, rest = reply.partition(b"\r\n")
    assert b" 413 " in status_line, reply[:200]
    body = rest.partition(b"\r\n\r\n")[2]
    assert json.loads(body)["error"]["code"] == code


def test_chunked_json_speech_body_is_cut_at_the_limit(server: LiveServer) -> None:
    sent = {"bytes": 0}

    def endless() -> Iterator[bytes]:
        yield b'{"input": "'
        for _ in range(2000):  # 128 MB if the server kept reading
            sent["bytes"] += 65536
            yield b"a" * 65536

    with server.client() as c:
        resp = None
        try:
            resp = c.post("/v1/audio/speech", headers={**AUTH, "Content-Type": "application/json"}, content=endless())
        except httpx.TransportError:
            pass  # hung up mid-upload: also fine
        if resp is not None:
            assert err(resp) == (413, "request_too_large")
        assert sent["bytes"] < 50_000_000
        assert c.get("/health").status_code == 200


def test_websocket_frame_size_is_bounded(server: LiveServer) -> None:
    limit = server.gw.settings.ws.max_message_bytes
    transport_limit = transport_options(server.gw.settings)["ws_max_size"]
    assert isinstance(transport_limit, int) and transport_limit > limit

    async def main() -> tuple[dict[str, Any], int | None, list[Any]]:
        async with websockets.connect(server.ws_url, additional_headers=AUTH, max_size=None) as ws:
            # The client offers permessage-deflate; the gateway declines it by default
            # (audio does not compress; deflating it cost the event loop).
            extensions = list(ws.protocol.extensions)
            await ws.recv()
            await ws.send(json.dumps({"type": "text", "context_id": "c", "text": "a" * (limit + 10)}))
            ev = json.loads(await asyncio.wait_for(ws.recv(), 10))
        # Just over the limit: an error event on a live socket (above). Far over it: the
        # transport refuses the frame with the standard close code.
        async with websockets.connect(server.ws_url, additional_headers=AUTH, max_size=None) as ws:
            await ws.recv()
            await ws.send(json.dumps({"type": "text", "context_id": "c", "text": "a" * transport_limit}))
            with pytest.raises(websockets.ConnectionClosed):
                while True:
                    await asyncio.wait_for(ws.recv(), 10)
            return ev, ws.close_code, extensions

    ev, code, extensions = asyncio.run(main())
    assert (ev["type"], ev["code"]) == ("error", "message_too_large")
    assert code == 1009
    assert extensions == []


# --------------------------------------------------------------------------------------
# Files are data, never code
# --------------------------------------------------------------------------------------


class _Payload:
    """A pickle that would create `marker` when unpickled by a code-executing loader."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


def test_model_checkpoints_are_loaded_without_executing_code(tiny_model_dir: Path, tmp_path: Path) -> None:
    from engine.models.loader import ModelDirError, load_model

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    marker = tmp_path / "pwned"
    for name in ("llm.pt", "flow.pt", "hift.pt"):
        original = (model / name).read_bytes()
        torch.save({"weights": _Payload(marker)}, model / name)
        with pytest.raises(ModelDirError, match="cannot be loaded safely"):
            load_model(model)
        assert not marker.exists(), f"{name}: unpickling ran code"
        (model / name).write_bytes(original)
    load_model(model)  # the restored directory still loads


def test_model_yaml_cannot_construct_objects(tiny_model_dir: Path, tmp_path: Path) -> None:
    from engine.models.loader import load_model

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    marker = tmp_path / "pwned"
    yaml_path = model / "cosyvoice3.yaml"
    original = yaml_path.read_text()
    attacks = [
        f"evil: !!python/object/apply:pathlib.Path.touch [!!python/object/apply:pathlib.Path ['{marker}']]\n",
        f"evil: !!python/object/new:pathlib.Path ['{marker}']\n",
        "evil: !!python/name:os.system\n",
    ]
    for attack in attacks:
        yaml_path.write_text(attack + original)
        with pytest.raises(Exception) as exc:
            load_model(model)
        assert "python/" in str(exc.value) or "constructor" in str(exc.value).lower(), exc.value
        assert not marker.exists()
    # A `!new:` tag only names a class; a foreign one is refused, never imported or called.
    yaml_path.write_text(original.replace("!new:cosyvoice.llm.llm.CosyVoice3LM", "!new:os.system", 1))
    assert "!new:os.system" in yaml_path.read_text()
    with pytest.raises(Exception, match="expected CosyVoice3LM"):
        load_model(model)


def test_voice_prompt_files_are_plain_arrays(server: LiveServer) -> None:
    """A tampered prompt.npz holding pickled objects is refused, not unpickled."""
    gw = server.gw
    with server.client() as c:
        assert register(c, "tamper", tone_wav(3.5)).status_code == 201
    info = gw.voices.get("tamper")
    npz = Path(gw.settings.data_dir) / "voices" / info.dir_name / "prompt.npz"
    marker = npz.parent / "pwned"
    np.savez(npz, speech_tokens=np.array([_Payload(marker)], dtype=object),
             speech_feat=np.zeros((2, 80), np.float32), embedding=np.zeros(192, np.float32))
    gw.voices._cache.pop("tamper", None)  # force a read from disk
    with pytest.raises(ValueError, match="pickle"):
        server.call(gw.voices.get_prompt("tamper"))
    assert not marker.exists()
    with server.client() as c:  # the server keeps serving other voices
        resp = c.post("/v1/audio/speech", headers=AUTH, json={"voice": "default", "input": "Still fine.",
                                                               "response_format": "pcm", **FAST})
        assert resp.status_code == 200 and len(resp.content) > 0


def test_idle_connections_leave_room_far_beyond_the_sessions() -> None:
    """uvicorn answers every request with a bare 503 once its connection limit is reached,
    /health included, and it counts sockets that never sent a byte: the limit was
    max_sessions + 64, so ~576 silent sockets locked every client out."""
    from gateway.settings import load_settings

    settings, _ = load_settings([], environ={})
    assert transport_options(settings)["limit_concurrency"] == 4096 == settings.max_connections
    settings, _ = load_settings(["--max-sessions", "8000", "--max-connections", "100"], environ={})
    assert transport_options(settings)["limit_concurrency"] == 8064  # never below the sessions it serves
    with pytest.raises(ValueError, match="max_connections"):
        load_settings(["--max-connections", "0"], environ={})


@contextlib.contextmanager
def _gateway_logging() -> Iterator[logging.Logger]:
    """uvicorn's loggers as `python -m gateway` has them (uvicorn's log_config=None: its
    records reach the root handler; a test server started earlier with uvicorn's own
    logging config has not), and the root's handlers back afterwards; yields uvicorn.error."""
    root = logging.getLogger()
    uvicorn_logs = [logging.getLogger("uvicorn"), logging.getLogger("uvicorn.error")]
    saved = [(lg, lg.handlers[:], lg.level, lg.propagate) for lg in (root, *uvicorn_logs)]
    for lg in uvicorn_logs:
        lg.handlers[:], lg.propagate = [], True
        lg.setLevel(logging.INFO)
    try:
        yield uvicorn_logs[1]
    finally:
        for lg, handlers, level, propagate in saved:
            lg.handlers[:], lg.propagate = handlers, propagate
            lg.setLevel(level)


def test_the_api_key_in_a_websocket_url_is_not_logged(capsys: pytest.CaptureFixture[str]) -> None:
    """The demo page passes its key as `?token=` (a browser sets no WebSocket headers), and
    uvicorn logs every accepted socket with its URL."""
    from gateway.__main__ import setup_logging

    with _gateway_logging() as uvicorn_error:
        for as_json in (False, True):
            setup_logging("info", as_json)
            uvicorn_error.info('%s - "WebSocket %s" [accepted]', "127.0.0.1:50680",
                               "/v1/tts/stream?voice=a&token=sk-secret-key&x=1")
    err = capsys.readouterr().err
    assert "sk-secret-key" not in err and err.count("token=***&x=1") == 2 and "voice=a" in err


def test_a_response_broken_off_on_purpose_is_not_logged_as_an_asgi_exception(capsys: pytest.CaptureFixture[str]) -> None:
    """A speech response broken off on purpose (`ReportedError`: a synthesis failed
    mid-stream, a client that stopped reading) is logged where it happens; uvicorn's
    "Exception in ASGI application" ERROR with its traceback would read as a bug. Other
    exceptions still reach the log."""
    from gateway.__main__ import setup_logging
    from gateway.http_api import SpeechClientStalled

    with _gateway_logging() as uvicorn_error:
        setup_logging("info", False)
        for exc in (SpeechClientStalled("the client took no bytes for 60 s"), RuntimeError("a real bug")):
            try:
                raise exc
            except Exception:
                uvicorn_error.exception("Exception in ASGI application\n")
    err = capsys.readouterr().err
    assert err.count("Exception in ASGI application") == 1 and "a real bug" in err and "took no bytes" not in err
