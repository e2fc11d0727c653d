"""Faults: the engine failing mid-utterance, a client that stops reading, SIGTERM while
audio is streaming, and SIGKILL in the middle of voice registrations.

Engine faults are injected into the real audio stage (`helpers.StageFault`) for one
voice only, so the test picks the victim through the public API. Signal tests run the
real `python -m gateway` in a subprocess.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import signal
import socket
import sqlite3
import threading
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
import websockets

from engine.types import SessionOptions
from gateway.protocol import CLOSE_GOING_AWAY, CLOSE_SERVICE_RESTART, CLOSE_SLOW_CONSUMER, CLOSE_TRY_LATER, WsLimits
from helpers import (
    AUTH,
    FAST,
    SAMPLES_PER_TOKEN,
    GatewayProcess,
    LiveServer,
    StageFault,
    WsRecorder,
    eventually,
    leftovers,
    live_gateway,
    register,
    scrape,
    tone_wav,
)

# Long enough for several chunks per utterance (first chunk after 15 tokens).
TEXT = "The quick brown fox jumps over the lazy dog near the quiet river bank today."


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    limits = WsLimits(max_pending_bytes=32 << 10, max_lag_s=1.0, keepalive_interval_s=0)
    with live_gateway(tiny_model_dir, tmp_path_factory.mktemp("faults"), send_buffer=16384, ws=limits) as srv:
        srv.gw.session_defaults = SessionOptions(tokens_per_text_token=2.0, seed=0)
        with srv.client() as c:
            for vid, freq in (("good", 200.0), ("faulty", 330.0)):
                assert register(c, vid, tone_wav(3.5, freq=freq)).status_code == 201
        yield srv


def _expected_samples(srv: LiveServer, text: str) -> int:
    """24 kHz samples for `text` spoken as one segment with 2 tokens per text token."""
    return 2 * len(srv.gw.engine.text_ids(text)) * SAMPLES_PER_TOKEN


async def _speak(url: str, contexts: dict[str, str], timeout: float = 120.0) -> WsRecorder:
    """One socket; each context speaks TEXT with its voice; wait until all end."""
    async with websockets.connect(url, additional_headers=AUTH) as ws:
        rec = WsRecorder(ws)
        await rec.recv_one()  # session_started
        for cid, voice in contexts.items():
            await rec.send(type="text", context_id=cid, voice=voice, text=TEXT, end=True)
        return await rec.until(lambda r: r.finished(*contexts), timeout)


# --------------------------------------------------------------------------------------
# Engine faults
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["run", "compute"])
def test_engine_fault_mid_utterance_fails_only_that_context(server: LiveServer, where: str) -> None:
    srv = server
    full = _expected_samples(srv, TEXT) * 2  # pcm_s16le bytes
    prompt = srv.call(srv.gw.voices.get_prompt("faulty"))

    async def scenario() -> tuple[WsRecorder, WsRecorder]:
        return await asyncio.gather(
            _speak(srv.ws_url, {"bad": "faulty", "ok1": "good"}),
            _speak(srv.ws_url, {"ok2": "good"}),
        )

    with StageFault(srv.gw.engine, prompt, from_chunk=1, where=where) as fault:
        if where == "compute":
            # A batch whose compute fails as a whole (here, not in the flow alone) fails every
            # chunk in it: run the victim alone, then show the stage still serves others.
            a = asyncio.run(_speak(srv.ws_url, {"bad": "faulty"}))
            ok1 = asyncio.run(_speak(srv.ws_url, {"ok1": "good"}))
            b = asyncio.run(_speak(srv.ws_url, {"ok2": "good"}))
            a.events += ok1.events
            a.audio.update(ok1.audio)
        else:
            a, b = asyncio.run(scenario())
    assert fault.count >= 1
    errors = a.of("error", "bad")
    assert [e["code"] for e in errors] == ["synthesis_failed"], a.events
    assert "final" not in errors[0]  # one segment failed; the context goes on to its `done`
    # The victim heard its first chunk, then the error, then `done` (the context ends cleanly).
    assert 0 < len(a.audio.get("bad", b"")) < full
    assert a.of("done", "bad")
    for rec, cid in ((a, "ok1"), (b, "ok2")):
        assert not rec.of("error", cid)
        (done,) = rec.of("done", cid)
        assert len(rec.audio[cid]) == full and done["audio_samples"] * 2 == full
    with srv.client() as c:
        eventually(lambda: leftovers(c) == {}, timeout=30)
    # The same voice speaks completely once the fault is gone.
    again = asyncio.run(_speak(srv.ws_url, {"bad": "faulty"}))
    assert not again.of("error") and len(again.audio["bad"]) == full


def test_engine_fault_mid_http_stream_reports_sse_error(server: LiveServer) -> None:
    srv = server
    prompt = srv.call(srv.gw.voices.get_prompt("faulty"))
    body = {"voice": "faulty", "input": TEXT, "response_format": "pcm", "stream_format": "sse", **FAST}
    with StageFault(srv.gw.engine, prompt, from_chunk=1, where="compute"), srv.client() as c:
        with c.stream("POST", "/v1/audio/speech", headers=AUTH, json=body) as resp:
            assert resp.status_code == 200  # the first chunk was fine: headers are out
            events = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert '"speech.audio.delta"' in events[0]
    assert '"error"' in events[-1] and "synthesis_failed" in events[-1]
    assert not any("speech.audio.done" in e for e in events)
    with srv.client() as c:
        resp = c.post("/v1/audio/speech", headers=AUTH, json={**body, "stream_format": "audio"})
        assert resp.status_code == 200 and len(resp.content) == 2 * _expected_samples(srv, TEXT)
        eventually(lambda: leftovers(c) == {}, timeout=30)


def test_engine_fault_mid_http_audio_stream_breaks_the_transfer(server: LiveServer) -> None:
    """Plain audio has no room for an error event: once part of the file is out, the
    server drops the connection, so the client sees an incomplete transfer rather than a
    clean end to a truncated file."""
    srv = server
    prompt = srv.call(srv.gw.voices.get_prompt("faulty"))
    body = {"voice": "faulty", "input": TEXT, "response_format": "pcm", **FAST}
    received = bytearray()
    with StageFault(srv.gw.engine, prompt, from_chunk=1, where="compute"), srv.client() as c:
        before = scrape(c)
        with c.stream("POST", "/v1/audio/speech", headers=AUTH, json=body) as resp:
            assert resp.status_code == 200  # the first chunk was fine: headers are out
            with pytest.raises(httpx.RemoteProtocolError):
                for data in resp.iter_bytes():
                    received += data
        after = scrape(c)
    assert 0 < len(received) < 2 * _expected_samples(srv, TEXT)
    # one failure, counted once: not also an unhandled internal error
    errors = 'cosyvoice_errors_total{code="%s"}'
    assert after[errors % "synthesis_failed"] - before.get(errors % "synthesis_failed", 0) == 1
    assert after.get(errors % "internal_error", 0) == before.get(errors % "internal_error", 0)
    with srv.client() as c:
        eventually(lambda: leftovers(c) == {}, timeout=30)


def test_http_client_that_leaves_before_its_first_audio_frees_the_engine_at_once(server: LiveServer) -> None:
    """The flow/vocoder stage is held (its batch waits on a gate), so no audio can exist
    yet; the client sends its speech request and hangs up. Its engine session is freed
    while the stage is still held, not when the first audio would have come."""
    srv = server
    stage = srv.gw.engine.stage
    orig = stage._launch  # a round's work, pipelined or not
    entered, gate = threading.Event(), threading.Event()

    def held(batch: list[Any], *args: Any, **kwargs: Any) -> Any:
        entered.set()
        gate.wait(120)
        return orig(batch, *args, **kwargs)

    stage._launch = held  # type: ignore[method-assign]
    left = 'cosyvoice_http_requests_total{route="/v1/audio/speech",status="499"}'
    with srv.client() as c:
        before = scrape(c)
    try:
        body = json.dumps({"voice": "good", "input": TEXT, "response_format": "pcm", **FAST}).encode()
        head = "".join(f"{k}: {v}\r\n" for k, v in {**AUTH, "Host": "gw", "Content-Type": "application/json",
                                                     "Content-Length": str(len(body))}.items())
        with socket.create_connection(("127.0.0.1", srv.port)) as sock:
            sock.sendall(f"POST /v1/audio/speech HTTP/1.1\r\n{head}\r\n".encode() + body)
            assert entered.wait(60)  # its first chunk is on the (held) stage
        with srv.client() as c:
            eventually(lambda: "cosyvoice_engine_active_sessions" not in leftovers(c), timeout=30)
            assert not gate.is_set()
            # Counted as a request its client abandoned (nginx's 499), not as a server error.
            after = scrape(c)
            assert after[left] == before.get(left, 0) + 1
            internal = 'cosyvoice_errors_total{code="internal_error"}'
            assert after.get(internal, 0) == before.get(internal, 0)
    finally:
        gate.set()
        del stage._launch
    with srv.client() as c:
        eventually(lambda: leftovers(c) == {}, timeout=30)


# --------------------------------------------------------------------------------------
# A client that stops reading
# --------------------------------------------------------------------------------------


def test_client_that_stops_reading_is_cut_off_others_unharmed(server: LiveServer) -> None:
    srv = server

    def slow_consumers() -> float:
        with srv.client() as c:
            return scrape(c).get('cosyvoice_errors_total{code="slow_consumer"}', 0.0)

    before = slow_consumers()

    async def stalled() -> int | None:
        # A small receive buffer set before connecting, then no reading at all: the
        # kernel buffers fill, the server's queue fills and its oldest frame ages.
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", srv.port))
        async with websockets.connect(srv.ws_url, additional_headers=AUTH, sock=sock, max_queue=1) as ws:
            await ws.send(json.dumps({"type": "text", "context_id": "s", "voice": "good", "text": TEXT * 8,
                                      "format": "pcm_s16le", "sample_rate": 48000, "audio": "base64", "end": True}))
            ws.transport.pause_reading()
            # Nothing can reach us while paused: wait for the server to report the cut.
            await asyncio.to_thread(eventually, lambda: slow_consumers() > before, 60)
            ws.transport.resume_reading()
            with contextlib.suppress(websockets.ConnectionClosed):
                while True:  # what was already on the wire, then the close frame
                    await asyncio.wait_for(ws.recv(), 30)
            return ws.close_code

    async def scenario() -> tuple[Any, WsRecorder]:
        stall = asyncio.create_task(stalled())
        healthy = await _speak(srv.ws_url, {"h": "good"})
        return await stall, healthy

    code, healthy = asyncio.run(scenario())
    assert code == CLOSE_SLOW_CONSUMER, code
    (done,) = healthy.of("done", "h")
    assert len(healthy.audio["h"]) == 2 * _expected_samples(srv, TEXT) == done["audio_samples"] * 2
    with srv.client() as c:
        assert 'cosyvoice_errors_total{code="slow_consumer"}' in c.get("/metrics", headers=AUTH).text
        eventually(lambda: leftovers(c) == {}, timeout=30)


# --------------------------------------------------------------------------------------
# Signals and crashes (subprocess)
# --------------------------------------------------------------------------------------


def _assets(root: Path) -> None:
    assets = root / "assets"
    assets.mkdir(parents=True, exist_ok=True)
    (assets / "default.wav").write_bytes(tone_wav(3.5))
    (assets / "default.txt").write_text("The default voice.")


def test_sigterm_drains_in_flight_context_then_exits_0(tiny_model_dir: Path, tmp_path: Path) -> None:
    _assets(tmp_path)
    gw = GatewayProcess(tiny_model_dir, tmp_path, "--shutdown-timeout", "60").start()
    try:
        async def scenario() -> tuple[WsRecorder, Any]:
            async with websockets.connect(gw.ws_url) as ws:
                rec = WsRecorder(ws)
                await rec.recv_one()
                await rec.send(type="text", context_id="t", text=TEXT, flush=True)
                await rec.until(lambda r: len(r.audio.get("t", b"")) > 0, 60)
                gw.signal(signal.SIGTERM)  # mid-stream, with the context still open
                # A newcomer during the drain is told to come back later.
                async with websockets.connect(gw.ws_url) as late:
                    refused = WsRecorder(late)
                    await refused.recv_one()
                    with pytest.raises(websockets.ConnectionClosed):
                        await refused.recv_one(30)
                # The open context still takes text and is spoken to the end; then, with no
                # context left, the server closes the connection as it goes away (the
                # process does not stop before: its audio and `done` were still to send).
                await rec.send(type="text", context_id="t", text="And one more sentence to finish.", end=True)
                await rec.until(lambda r: r.finished("t"), 120)
                with pytest.raises(websockets.ConnectionClosed):
                    await rec.recv_one(30)
                return rec, refused

        try:
            rec, refused = asyncio.run(scenario())
        except Exception as exc:
            raise AssertionError("server log:\n" + "\n".join(gw.log[-25:])) from exc
        assert refused.events[0]["code"] == "not_ready" and refused.ws.close_code == CLOSE_TRY_LATER
        assert "draining" in refused.events[0]["message"]  # not "still loading"
        assert rec.ws.close_code == CLOSE_GOING_AWAY
        (done,) = rec.of("done", "t")
        assert not rec.of("error") and done["audio_samples"] * 2 == len(rec.audio["t"]) > 0
        assert done["segments"] == 2 and rec.of("flushed", "t")
        assert gw.wait(60) == 0, "\n".join(gw.log[-20:])
        assert any("drained" in line for line in gw.log)
    finally:
        gw.kill()


@pytest.mark.parametrize("exit_on_failure", [True, False])
def test_a_stalled_stage_process_ends_its_contexts_and_the_gateway_restarts(
        tiny_model_dir: Path, tmp_path: Path, exit_on_failure: bool) -> None:
    """The stage's own process stops answering mid-stream (SIGSTOP: alive, silent, as a GPU
    hang looks from outside). The watchdog kills it, the open context ends with
    `engine_failed` (final) instead of waiting for audio that cannot come, and the gateway
    exits with status 3 for its supervisor to restart it, closing the socket with 1012.
    With the exit turned off it stays up, and says why on /health and /ready (503)."""
    _assets(tmp_path)
    gw = GatewayProcess(tiny_model_dir, tmp_path, "--shutdown-timeout", "60", "--engine.stage-process", "true",
                        "--engine.stage-stall-timeout-s", "3",
                        "--exit-on-engine-failure", str(exit_on_failure).lower()).start()
    pid = None
    try:
        (pid,) = [int(m.group(1)) for line in gw.log if (m := re.search(r"audio stage process (\d+) ready", line))]

        async def scenario() -> WsRecorder:
            async with websockets.connect(gw.ws_url) as ws:
                rec = WsRecorder(ws)
                await rec.recv_one()
                await rec.send(type="text", context_id="t", text=TEXT * 4, flush=True)
                await rec.until(lambda r: len(r.audio.get("t", b"")) > 0, 60)
                os.kill(pid, signal.SIGSTOP)
                await rec.until(lambda r: bool(r.of("error", "t")) and r.of("error", "t")[-1].get("final", False), 60)
                if exit_on_failure:
                    with pytest.raises(websockets.ConnectionClosed):
                        await rec.until(lambda r: False, 60)
                else:
                    with gw.client() as c:
                        health, ready = c.get("/health"), c.get("/ready")
                    assert health.status_code == 503 and health.json()["error"]["code"] == "engine_failed"
                    assert ready.status_code == 503 and "stalled" in ready.json()["error"]["message"]
                    assert "stalled" in health.json()["error"]["message"]
                    async with websockets.connect(gw.ws_url) as late:  # new sessions: come back later
                        refused = WsRecorder(late)
                        await refused.recv_one()
                        assert refused.events[0]["code"] == "not_ready"
                        assert "stalled" in refused.events[0]["message"]
                return rec

        try:
            rec = asyncio.run(scenario())
        except Exception as exc:
            raise AssertionError("server log:\n" + "\n".join(gw.log[-25:])) from exc
        final = rec.of("error", "t")[-1]
        assert final["code"] == "engine_failed" and "stalled" in final["message"], final
        assert not rec.of("done", "t")
        assert any("was killed" in line and "stalled" in line for line in gw.log)
        if exit_on_failure:
            assert rec.ws.close_code == CLOSE_SERVICE_RESTART
            assert gw.wait(60) == 3, "\n".join(gw.log[-20:])
        else:
            assert gw.proc.poll() is None  # still serving
    finally:
        gw.kill()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)  # a test that failed before the watchdog did


def _register_forever(url: str, prefix: str, acked: dict[str, dict[str, Any]], cut: list[str],
                      stop: threading.Event, killing: threading.Event) -> None:
    """Register voices one after another until the server dies; remember acknowledged
    ones and the one that was in flight when the connection broke: sent before the kill
    (`killing` is set just before it) and broken while sending or reading, not one that
    found the server already gone (a ConnectError, or a request begun after the kill)."""
    i = 0
    with httpx.Client(base_url=url, timeout=30) as c:
        while not stop.is_set():
            vid = f"{prefix}{i}"
            audio = tone_wav(3.2 + 0.1 * (i % 5), freq=150.0 + 7 * i)
            late = killing.is_set()
            try:
                resp = register(c, vid, audio, f"Voice {vid}.", headers={})
            except (httpx.WriteError, httpx.ReadError, httpx.RemoteProtocolError) as exc:
                if not late:
                    cut.append(f"{vid}: {type(exc).__name__}")  # the kill landed on this request
                return
            except httpx.TransportError:  # never connected: not in flight
                return
            if resp.status_code == 201:
                acked[vid] = resp.json()
            i += 1


def _check_store(data: Path, listed: list[dict[str, Any]]) -> None:
    """No partial voice: rows, dirs and the API agree; no temp dirs are left."""
    with sqlite3.connect(data / "voices.sqlite3") as db:
        rows = {r[0]: r[1] for r in db.execute("SELECT id, dir_name FROM voices")}
    assert set(rows) == {v["id"] for v in listed}
    dirs = {p.name for p in (data / "voices").iterdir()}
    assert dirs == set(rows.values()), (dirs, rows)
    for d in dirs:
        assert (data / "voices" / d / "prompt.npz").is_file()


def test_sigkill_during_registration_loses_no_committed_voice(tiny_model_dir: Path, tmp_path: Path) -> None:
    rng = random.Random(1234)
    acked: dict[str, dict[str, Any]] = {}
    cut: list[str] = []  # registrations the kill interrupted
    kills = 2
    for round_ in range(kills):
        gw = GatewayProcess(tiny_model_dir, tmp_path).start()
        stop, killing = threading.Event(), threading.Event()
        workers = [threading.Thread(target=_register_forever,
                                    args=(gw.url, f"r{round_}w{w}_", acked, cut, stop, killing))
                   for w in range(2)]
        for t in workers:
            t.start()
        # Kill at a random point while both workers are mid-registration.
        threading.Event().wait(rng.uniform(0.3, 1.5))
        killing.set()
        gw.kill()  # SIGKILL
        stop.set()
        for t in workers:
            t.join(30)
    gw = GatewayProcess(tiny_model_dir, tmp_path).start()
    try:
        with gw.client() as c:
            listed = c.get("/v1/voices").json()["data"]
            by_id = {v["id"]: v for v in listed}
            assert acked, "no registration was acknowledged before the kills"
            # Each kill landed while a worker's request was in flight.
            assert {entry.split("w", 1)[0] for entry in cut} == {f"r{r}" for r in range(kills)}, cut
            for vid, info in acked.items():
                assert by_id.get(vid) == info, vid  # committed = still there, unchanged
            _check_store(tmp_path / "data", listed)
            # Every listed voice (acknowledged or committed just before a kill) is usable.
            for vid in list(by_id)[:3] + list(by_id)[-2:]:
                resp = c.post("/v1/audio/speech", json={"voice": vid, "input": "Check.", "response_format": "pcm", **FAST})
                assert resp.status_code == 200 and len(resp.content) > 0, vid
    finally:
        gw.kill()


def test_idle_server_hands_freed_heap_back_once_per_burst(server: LiveServer) -> None:
    """`DrainingServer` trims the heap when the engine is idle after work, once per burst."""
    import uvicorn

    from gateway.__main__ import DrainingServer

    drainer = DrainingServer(uvicorn.Config(server.app), server.app, drain_timeout=1.0)
    calls: list[int] = []
    drainer._trim = lambda pad: calls.append(pad) or 1  # count instead of trimming
    with server.client() as c:
        resp = c.post("/v1/audio/speech", headers=AUTH, json={"voice": "good", "input": "Trim me.",
                                                               "response_format": "pcm", **FAST})
        assert resp.status_code == 200
        eventually(lambda: leftovers(c) == {}, timeout=30)
    asyncio.run(drainer._trim_if_idle())
    asyncio.run(drainer._trim_if_idle())  # nothing ran since: no second trim
    assert calls == [0]
    with server.client() as c:
        c.post("/v1/audio/speech", headers=AUTH, json={"voice": "good", "input": "Again.", "response_format": "pcm", **FAST})
        eventually(lambda: leftovers(c) == {}, timeout=30)
    asyncio.run(drainer._trim_if_idle())
    assert calls == [0, 0]


def test_the_drain_waits_for_a_voice_registration_in_progress(server: LiveServer) -> None:
    """A registration under way when SIGTERM comes (its featurising, or on a GPU its graph
    captures, 47-76 s for a new prompt width) is no session, and the drain ended at once:
    uvicorn then cut it off after 5 s, the client's voice lost. The drain waits for it as
    for a session (within shutdown_timeout)."""
    import time

    import uvicorn

    from gateway.__main__ import DrainingServer

    srv = server
    featurizer = srv.gw.engine.featurizer
    orig = featurizer.featurize
    entered, gate = threading.Event(), threading.Event()

    def held(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        gate.wait(120)
        return orig(*args, **kwargs)

    featurizer.featurize = held  # type: ignore[method-assign]
    drainer = DrainingServer(uvicorn.Config(srv.app), srv.app, drain_timeout=60.0)
    drainer.drain_deadline = time.monotonic() + 60.0  # as its signal handler sets it (not the shared engine's ready)
    answers: list[int] = []
    with srv.client() as c:
        worker = threading.Thread(target=lambda: answers.append(register(c, "drained", tone_wav(3.5)).status_code))
        worker.start()
        try:
            assert entered.wait(60)
            assert asyncio.run(drainer.on_tick(1)) is False  # still registering: not drained
        finally:
            gate.set()
            worker.join(120)
            del featurizer.featurize
        assert answers == [201]
        assert asyncio.run(drainer.on_tick(1)) is True
        assert c.delete("/v1/voices/drained", headers=AUTH).status_code in (200, 204)


def test_a_registration_asked_for_during_the_drain_is_refused(server: LiveServer) -> None:
    """A registration begun after SIGTERM would keep the drain waiting for it (on a GPU a
    new prompt width's graph captures take a minute): it is refused like new speech."""
    srv = server
    srv.gw.engine.ready, srv.gw.draining = False, True  # what the signal handler sets
    try:
        with srv.client() as c:
            resp = register(c, "too_late", tone_wav(3.5))
            assert resp.status_code == 503, resp.text
            assert resp.json()["error"]["code"] == "not_ready"
            assert "draining" in resp.json()["error"]["message"]
            assert srv.gw.registrations == 0
    finally:
        srv.gw.engine.ready, srv.gw.draining = True, False
    with srv.client() as c:
        assert c.get("/v1/voices/too_late", headers=AUTH).status_code == 404
