"""`gateway.client.GatewayClient` and `gateway.stream_cli` against a live gateway (the
production app, tiny random-weight engine, 2 speech tokens per text token).

What a client must get right beyond the happy path: an id used again after a barge-in,
a socket that drops mid-turn, audio that must stop at `cancel()`, a consumer that does
not read, a context the server refused, a refused connection, and the command line's
exit status and messages in each case.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import wave
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator

import pytest

from engine.types import SessionOptions
from gateway.client import GatewayClient, GatewayError
from gateway.stream_cli import main as cli_main
from helpers import API_KEY, LiveServer, live_gateway, register, scrape, tone_wav

ROOT = Path(__file__).resolve().parent.parent
LONG = "The quick brown fox jumps over the lazy dog near the quiet river bank today. " * 4


@pytest.fixture(scope="module")
def srv(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_gateway(tiny_model_dir, tmp_path_factory.mktemp("client")) as server:
        # Random weights never stop by themselves: a fixed 2 speech tokens per text token.
        server.gw.session_defaults = SessionOptions(tokens_per_text_token=2.0, seed=0)
        with server.client() as c:
            assert register(c, "default", tone_wav(3.0)).status_code == 201
        yield server


def run(coro: Awaitable[Any], timeout: float = 60.0) -> Any:
    async def bounded() -> Any:
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


async def until(check: Callable[[], bool], timeout: float = 30.0) -> None:
    """Poll a condition set by the client's reader task (bounded)."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def drain(ctx: Any, timeout: float = 30.0) -> list[Any]:
    async def items() -> list[Any]:
        return [item async for item in ctx.stream()]

    return await asyncio.wait_for(items(), timeout)


def segment_texts(events: list[dict[str, Any]]) -> list[str]:
    return [e["text"] for e in events if e["type"] == "segment_started"]


# ---- 1. an id used again ------------------------------------------------------------------


def test_an_id_reused_after_a_barge_in_gets_its_own_turn(srv: LiveServer) -> None:
    """`ctx.cancel(); gw.context(same id)`: before, the old turn's `cancelled` ended the new
    handle, the new turn's audio was lost and the old handle's stream never ended."""

    async def main() -> None:
        async with await GatewayClient.connect(srv.ws_url, api_key=API_KEY) as gw:
            old = gw.context("agent")
            await old.send_text(LONG, flush=True)
            async for item in old.stream():
                if isinstance(item, bytes):
                    break  # audio flows: the caller interrupts
            with pytest.raises(ValueError, match="still open"):
                gw.context("agent")  # not yet ended or cancelled: it would take the old one's frames
            await old.cancel()
            new = gw.context("agent")
            await new.send_text("Second turn.", end=True)
            audio = await asyncio.wait_for(new.collect_audio(), 30)
            assert [e["type"] for e in new.events] == ["context_started", "segment_started", "done"]
            assert segment_texts(new.events) == ["Second turn."]
            assert len(audio) == new.events[-1]["audio_samples"] * 2 > 0
            rest = await drain(old, 10)
            assert rest[-1]["type"] == "cancelled" and rest[-1]["active"] is True and old.finished
            assert not gw._contexts  # nothing left behind for a long-lived client

    run(main())


def test_an_id_reused_while_the_old_turn_still_speaks_waits_for_it(srv: LiveServer) -> None:
    """The next turn prepared under the same id while the ended one still speaks: its text
    goes once the old one is `done`, and each handle gets exactly its own audio."""

    async def main() -> None:
        async with await GatewayClient.connect(srv.ws_url, api_key=API_KEY) as gw:
            old = gw.context("agent")
            await old.send_text(LONG, end=True)
            new = gw.context("agent")
            sending = asyncio.create_task(new.send_text("Next turn.", end=True))
            old_audio = await asyncio.wait_for(old.collect_audio(), 30)
            await asyncio.wait_for(sending, 10)
            new_audio = await asyncio.wait_for(new.collect_audio(), 30)
            assert old.events[-1]["type"] == new.events[-1]["type"] == "done"
            assert len(old_audio) == old.events[-1]["audio_samples"] * 2 > 0
            assert len(new_audio) == new.events[-1]["audio_samples"] * 2 > 0
            assert segment_texts(new.events) == ["Next turn."]
            assert "".join(segment_texts(old.events)) == LONG.rstrip()

    run(main())


# ---- 2. a dropped socket ------------------------------------------------------------------


class DropProxy:
    """A TCP proxy to the gateway that aborts both sides after `limit` bytes went down."""

    def __init__(self, port: int, limit: int) -> None:
        self.port, self.limit = port, limit
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        async def start() -> None:
            self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
            self.listen = self.server.sockets[0].getsockname()[1]
            ready.set()

        def serve() -> None:
            self.loop.run_until_complete(start())
            self.loop.run_forever()

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()
        assert ready.wait(10)
        self.url = f"ws://127.0.0.1:{self.listen}/v1/tts/stream"

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", self.port)
        down = 0

        async def up() -> None:
            while data := await client_r.read(65536):
                server_w.write(data)
                await server_w.drain()

        async def down_() -> None:
            nonlocal down
            while data := await server_r.read(4096):
                down += len(data)
                if down > self.limit:
                    client_w.transport.abort()
                    server_w.transport.abort()
                    return
                client_w.write(data)
                await client_w.drain()

        await asyncio.gather(up(), down_(), return_exceptions=True)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def dropping(srv: LiveServer) -> Iterator[DropProxy]:
    proxy = DropProxy(srv.port, 60_000)
    yield proxy
    proxy.close()


def test_a_dropped_connection_is_an_error_not_a_short_turn(dropping: DropProxy, tmp_path: Path) -> None:
    """Before, the end of the stream looked like success: collect_audio() returned the
    audio so far and the CLI exited 0."""

    async def main() -> None:
        gw = await GatewayClient.connect(dropping.url, api_key=API_KEY)
        try:
            ctx = gw.context("t1")
            await ctx.send_text(LONG, end=True)
            with pytest.raises(GatewayError) as caught:
                await asyncio.wait_for(ctx.collect_audio(), 30)
            assert caught.value.code == "connection_closed" and caught.value.close_code == 1006
            assert ctx.finished and ctx.events[-1]["final"] is True
            assert gw.close_code == 1006 and not gw.connected
            with pytest.raises(GatewayError, match="connection_closed"):
                await ctx.send_text("more")
            ev = await asyncio.wait_for(gw.events.get(), 5)
            assert ev["code"] == "connection_closed" and ev["close_code"] == 1006
            # The connection's own calls say so the same way (they raised websockets'
            # ConnectionClosed and a ConnectionError).
            with pytest.raises(GatewayError) as caught:
                await gw.configure(voice="good")
            assert caught.value.code == "connection_closed" and caught.value.close_code == 1006
            with pytest.raises(GatewayError, match="connection_closed"):
                gw.context("t2")
        finally:
            await gw.aclose()

    run(main())
    (tmp_path / "in.txt").write_text(LONG)
    status = cli_main(["--url", dropping.url, "--api-key", API_KEY, "--file", str(tmp_path / "in.txt"),
                       "--rate", "0", "--out", str(tmp_path / "drop.wav")])
    assert status == 1
    with wave.open(str(tmp_path / "drop.wav")) as w:  # what did arrive is kept
        assert w.getnframes() > 0


# ---- 3. barge-in stops the audio at once -------------------------------------------------------


def test_cancel_drops_the_audio_not_yet_read(srv: LiveServer) -> None:
    """Before, audio already buffered in the client still came out of stream() after cancel()."""

    async def main() -> None:
        async with await GatewayClient.connect(srv.ws_url, api_key=API_KEY) as gw:
            ctx = gw.context("t1")
            await ctx.send_text("Hello there, this is the first part.", flush=True)
            await ctx.send_text(LONG, end=True)
            # Nothing is read: wait until the first part's audio sits in the client.
            await until(lambda: any(e["type"] == "flushed" for e in ctx.events))
            await ctx.cancel()
            items = await drain(ctx)
            assert not [i for i in items if isinstance(i, bytes)]
            assert items[-1]["type"] == "cancelled" and items[-1]["audio_samples"] > 0
            assert ctx.cancelled and ctx.finished
            with pytest.raises(GatewayError, match="context_cancelled"):
                await ctx.send_text("late token")

    run(main())


# ---- 4. a consumer that does not read ------------------------------------------------------------


def test_a_consumer_that_does_not_read_holds_the_socket_back(srv: LiveServer) -> None:
    """A context's unread audio is bounded (the reader then waits, and so does the server),
    and `events` keeps only the newest `max_events`; before, both grew without limit."""
    limit = 64 << 10

    async def main() -> None:
        async with await GatewayClient.connect(srv.ws_url, api_key=API_KEY, max_buffered_bytes=limit,
                                               max_events=3) as gw:
            await gw.configure(stats_interval_ms=100)
            await until(lambda: gw.events_dropped >= 2)
            assert gw.events.qsize() == 3
            ctx = gw.context("slow")
            await ctx.send_text(LONG * 2, end=True)
            await until(lambda: not ctx._writable.is_set())  # the reader waits for room
            # No more frames are read now, the socket's `stats` included.
            # (A window in which an unbounded client would have read on, not a synchronisation.)
            dropped = gw.events_dropped
            await asyncio.sleep(0.3)
            assert ctx._buffered - ctx._items[-1][1] < limit and gw.events_dropped == dropped
            # Reading again lets it go on: the whole turn arrives.
            audio = await asyncio.wait_for(ctx.collect_audio(), 30)
            assert ctx.events[-1]["type"] == "done" and len(audio) == ctx.events[-1]["audio_samples"] * 2
            assert len(audio) > 4 * limit

    run(main())


# ---- 5. a refused context --------------------------------------------------------------------------


def test_a_refused_context_takes_no_more_text(srv: LiveServer) -> None:
    """Before, the tokens after a refusal opened a new context with the default voice."""

    async def main() -> None:
        async with await GatewayClient.connect(srv.ws_url, api_key=API_KEY) as gw:
            ctx = gw.context("t1")
            await ctx.send_text("Hello", voice="no_such_voice")
            items = await drain(ctx)
            assert items[-1]["code"] == "voice_not_found" and items[-1]["final"]
            for send in (lambda: ctx.send_text(" there"), ctx.flush, ctx.end):
                with pytest.raises(GatewayError) as caught:
                    await send()
                assert caught.value.code == "voice_not_found"
            assert ctx.error is items[-1]
            # Tokens already on their way when the refusal came opened a context with the
            # default voice on the server: the client cancels it, so the id starts clean.
            racing = gw.context("t2")
            await racing.send_text("Hello", voice="no_such_voice")
            await racing.send_text(" there, how are you")
            await racing.send_text(" today?")
            with pytest.raises(GatewayError, match="voice_not_found"):
                await asyncio.wait_for(racing.collect_audio(), 30)
            await until(lambda: "t2" not in gw._contexts)
            again = gw.context("t2")
            await again.send_text("Fine.", end=True)
            await asyncio.wait_for(again.collect_audio(), 30)
            assert segment_texts(again.events) == ["Fine."]

    run(main())


def errors_of(srv: LiveServer, code: str) -> float:
    with srv.client() as c:
        return sum(v for k, v in scrape(c).items() if "error" in k and f'"{code}"' in k)


def test_the_cli_stops_sending_after_a_refusal(srv: LiveServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before, it streamed the whole file into refused contexts (each token another
    `voice_not_found`), wrote an empty WAV and printed "first audio after nan ms"."""
    (tmp_path / "in.txt").write_text("word " * 40)
    before = errors_of(srv, "voice_not_found")
    status = cli_main(["--url", srv.ws_url, "--api-key", API_KEY, "--voice", "nope", "--file", str(tmp_path / "in.txt"),
                       "--rate", "200", "--out", str(tmp_path / "o.wav")])
    out = capsys.readouterr()
    assert status == 1 and not (tmp_path / "o.wav").exists()
    assert errors_of(srv, "voice_not_found") - before < 10  # 40 before
    assert "nan" not in out.out + out.err and "no audio received" in out.err
    assert out.err.count("error: voice_not_found") == 1


# ---- 6. a refused connection -------------------------------------------------------------------


def test_connect_raises_when_the_gateway_refuses(srv: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, connect() returned a dead client; and `await gw.events.get()` hung once the
    socket was closed."""

    async def refused(key: str) -> GatewayError:
        with pytest.raises(GatewayError) as caught:
            await GatewayClient.connect(srv.ws_url, api_key=key)
        return caught.value

    err = run(refused("wrong"))
    assert (err.code, err.close_code) == ("unauthorized", 1008)
    monkeypatch.setattr(srv.gw.metrics, "session_refusal", lambda limit: "too many sessions (test)")
    err = run(refused(API_KEY))
    assert (err.code, err.close_code) == ("too_many_sessions", 1013)
    monkeypatch.undo()

    async def events_end() -> dict[str, Any]:
        gw = await GatewayClient.connect(srv.ws_url, api_key=API_KEY)
        await gw.aclose()
        return await asyncio.wait_for(gw.events.get(), 5)

    ev = run(events_end())
    assert ev["type"] == "error" and ev["code"] == "connection_closed" and ev["close_code"] == 1000


# ---- 7. the command line's failures ------------------------------------------------------------


def test_the_cli_reports_failures_in_one_line(srv: LiveServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: tracebacks (server down, bad key, unknown format, missing file)."""
    text = tmp_path / "in.txt"
    text.write_text("Hello there.")
    base = ["--file", str(text), "--rate", "0", "--out", str(tmp_path / "o.wav")]
    with socket_without_server() as port:
        cases = {
            "server down": ["--url", f"ws://127.0.0.1:{port}/v1/tts/stream", *base],
            "bad key": ["--url", srv.ws_url, "--api-key", "wrong", *base],
            "bad format": ["--url", srv.ws_url, "--api-key", API_KEY, "--format", "mp3", *base],
            "missing file": ["--url", srv.ws_url, "--api-key", API_KEY, *base, "--file", str(tmp_path / "nope.txt")],
        }
        errors = {}
        for name, argv in cases.items():
            status = cli_main(argv)
            errors[name] = capsys.readouterr().err
            assert status == 1, name
            assert len(errors[name].strip().splitlines()) == 1, (name, errors[name])
            assert errors[name].startswith("error: ") and "Traceback" not in errors[name], (name, errors[name])
    assert "unauthorized" in errors["bad key"] and "mp3" in errors["bad format"]
    assert not (tmp_path / "o.wav").exists()
    # The turn was spoken but its WAV cannot be written: said so, not "cannot connect".
    status = cli_main(["--url", srv.ws_url, "--api-key", API_KEY, "--file", str(text), "--rate", "0",
                       "--out", str(tmp_path / "no-such-dir" / "o.wav")])
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert status == 1 and last.startswith("error: cannot write ") and "Traceback" not in err, err


@contextlib.contextmanager
def socket_without_server() -> Iterator[int]:
    """A loopback port that is bound (so nobody else takes it) but not listening."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def test_ctrl_c_keeps_the_audio_received_and_exits_130(srv: LiveServer, tmp_path: Path) -> None:
    """Before: a traceback, no WAV, exit status -2."""
    (tmp_path / "in.txt").write_text("Hello there. This is one sentence. " * 20)
    out = tmp_path / "o.wav"
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.stream_cli", "--url", srv.ws_url, "--api-key", API_KEY,
         "--file", str(tmp_path / "in.txt"), "--rate", "10", "--out", str(out)],
        cwd=ROOT, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        # A shell without job control starts background commands with SIGINT ignored, and a
        # child inherits that: the CLI would then never see the Ctrl-C sent below.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert proc.stderr is not None
        segments = 0
        deadline = time.monotonic() + 60
        while segments < 2 and time.monotonic() < deadline:  # the 1st segment's audio has come
            line = proc.stderr.readline()
            assert line, "the CLI ended early"
            segments += bool(re.match(r"\[\s*\d+\.\d+s\]", line))
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("interrupted: wrote")
    with wave.open(str(out)) as w:
        assert w.getnframes() > 0


@pytest.mark.parametrize("rate", ["-5", "nan"])
def test_the_cli_refuses_a_negative_or_nan_rate(rate: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Both sent the whole text at once, as `--rate 0` asks, without a word."""
    (tmp_path / "t.txt").write_text("Hello there.")
    with pytest.raises(SystemExit) as exc:
        cli_main(["--file", str(tmp_path / "t.txt"), "--rate", rate, "--url", "ws://127.0.0.1:9/none"])
    assert exc.value.code == 2 and "--rate must be >= 0" in capsys.readouterr().err


@pytest.mark.parametrize("fmt", ["pcm_s16le", "ulaw_8000", "alaw_8000"])
def test_the_cli_wav_holds_the_16_bit_samples_it_received(fmt: str, tmp_path: Path) -> None:
    """Before, the WAV of a 16-bit or G.711 stream was scaled by 32767/32768 on the way
    out: every sample past half scale lost one step, so the file was not what came."""
    import numpy as np

    from gateway.audio import alaw_decode, alaw_encode, resolve_format, ulaw_decode, ulaw_encode
    from gateway.stream_cli import _write_wav

    s16 = np.array([32767, -32768, 30000, -30000, 16385, -16385, 1000, -1, 0] * 20, np.int16)[:160]
    frames = {"pcm_s16le": [s16.astype("<i2").tobytes()], "ulaw_8000": [ulaw_encode(s16)],
              "alaw_8000": [alaw_encode(s16)]}[fmt]
    sent = {"pcm_s16le": s16, "ulaw_8000": ulaw_decode(frames[0]), "alaw_8000": alaw_decode(frames[0])}[fmt]
    _write_wav(tmp_path / "o.wav", resolve_format(fmt, 8000), frames)
    with wave.open(str(tmp_path / "o.wav")) as w:
        assert w.getframerate() == 8000 and w.getsampwidth() == 2
        assert np.frombuffer(w.readframes(w.getnframes()), "<i2").tolist() == sent.tolist()


# ---- 8. context ids ------------------------------------------------------------------------------


def test_context_ids_the_server_would_refuse_raise(srv: LiveServer) -> None:
    """Before, an id over 64 characters hung collect_audio(): the server's error named a
    shortened id that no handle had."""
    from gateway.protocol import _CONTEXT_ID as server_rule

    async def main() -> None:
        async with await GatewayClient.connect(srv.ws_url, api_key=API_KEY) as gw:
            for bad in ("x" * 65, "", "with space", "ü", "a/b", "x\n"):
                with pytest.raises(ValueError, match="context id"):
                    gw.context(bad)
                assert not server_rule.match(bad) or bad.endswith("\n")
            ok = "A-z_0.9:" + "x" * 56
            assert server_rule.match(ok)
            ctx = gw.context(ok)
            await ctx.send_text("Hi.", end=True)
            assert await asyncio.wait_for(ctx.collect_audio(), 30)

    run(main())


def test_a_long_text_stops_between_its_frames_once_refused(srv: LiveServer) -> None:
    """A text over the frame limit goes as several frames; a refusal or a cancel() that
    comes while they go stops the rest, which would open a context with the socket's
    defaults that nobody reads (and that a reused id would then join)."""
    async def main() -> None:
        async with await GatewayClient.connect(srv.ws_url, api_key=API_KEY) as gw:
            gw.session.setdefault("limits", {})["max_message_bytes"] = 200  # as if the server said so
            ctx = gw.context("long")
            sent: list[dict[str, Any]] = []
            send = gw.send

            async def refused_after_the_first(message: dict[str, Any]) -> None:
                sent.append(message)
                await send(message)
                if len(sent) == 1:  # the gateway's refusal arrives now
                    ctx.error = {"type": "error", "code": "voice_not_found", "message": "no such voice", "final": True}

            gw.send = refused_after_the_first  # type: ignore[method-assign]
            with pytest.raises(GatewayError, match="voice_not_found"):
                await ctx.send_text("word " * 200, voice="nobody-has-this")
            assert len(sent) == 1

    run(main())


def test_a_reused_id_does_not_wait_for_ever_behind_a_full_unread_turn(srv: LiveServer) -> None:
    """`old.end(); new = gw.context(id); await new.send_text(...)`, old not read yet: the
    reader must read on past old's full buffer to its `done`, or the send never goes."""
    limit = 32 << 10

    async def main() -> None:
        async with await GatewayClient.connect(srv.ws_url, api_key=API_KEY, max_buffered_bytes=limit) as gw:
            old = gw.context("agent")
            await old.send_text(LONG, end=True)
            await until(lambda: not old._writable.is_set())  # the reader waits for room in old
            new = gw.context("agent")
            await asyncio.wait_for(new.send_text("Next turn.", end=True), 30)
            new_audio = await asyncio.wait_for(new.collect_audio(), 30)
            old_audio = await asyncio.wait_for(old.collect_audio(), 30)
            assert old.events[-1]["type"] == new.events[-1]["type"] == "done"
            assert len(old_audio) == old.events[-1]["audio_samples"] * 2 > limit
            assert len(new_audio) == new.events[-1]["audio_samples"] * 2 > 0

    run(main())


def test_cancel_drops_the_unread_audio_of_a_turn_already_synthesised(srv) -> None:
    """A real-time player reads a turn far behind the engine: the turn's `done` is in the
    client long before its audio has been played. A barge-in then (`cancel()`) must still
    drop the audio not yet read; it did nothing once `done` had arrived, and the rest of
    the reply kept coming out of `stream()`."""

    async def main() -> None:
        async with await GatewayClient.connect(srv.ws_url, api_key=API_KEY) as gw:
            ctx = gw.context("t1")
            await ctx.send_text("Hello there, this is a short reply.", end=True)
            stream = ctx.stream()
            first = await stream.__anext__()  # the player has started
            assert isinstance(first, dict)
            await until(lambda: ctx.finished)  # synthesis is over; the audio is unread
            assert any(isinstance(i, bytes) for i, _ in ctx._items)
            await ctx.cancel()  # the caller speaks
            rest = [item async for item in stream]
            assert not [i for i in rest if isinstance(i, bytes)], "audio after cancel()"
            assert rest[-1]["type"] == "done"
            assert not gw._contexts

    run(main())


# ---- 9. a turn without text, a URL websockets cannot parse ---------------------------------------


def test_end_of_a_turn_that_got_no_text_is_done(srv: LiveServer, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """An LLM turn may produce no tokens at all (a tool call, an empty answer). Before,
    `end()` of such a context sent a bare `end`, which the server refuses for an id it has
    not opened: collect_audio() raised `invalid_message: unknown context`, and the CLI
    reported that error (exit 1) for an empty file."""

    async def main() -> None:
        async with await GatewayClient.connect(srv.ws_url, api_key=API_KEY) as gw:
            ctx = gw.context("silent")
            await ctx.end()
            assert await asyncio.wait_for(ctx.collect_audio(), 30) == b""
            assert ctx.events[-1]["type"] == "done" and ctx.error is None

    run(main())
    (tmp_path / "empty.txt").write_text("")
    status = cli_main(["--url", srv.ws_url, "--api-key", API_KEY, "--file", str(tmp_path / "empty.txt"),
                       "--rate", "0", "--out", str(tmp_path / "o.wav")])
    err = capsys.readouterr().err
    assert status == 0 and "error" not in err and "no audio received" in err


@pytest.mark.parametrize("url", ["ws://127.0.0.1:99999/v1/tts/stream", "ws://127.0.0.1:port/v1/tts/stream",
                                 "ws://[::1/v1/tts/stream"])
def test_a_url_with_a_bad_port_or_host_is_a_one_line_error(url: str, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """websockets turns a bad scheme into InvalidURI but lets urllib's ValueError for a bad
    port or IPv6 host through: connect() raised a bare ValueError, the CLI a traceback."""
    import websockets

    with pytest.raises(websockets.InvalidURI):
        run(GatewayClient.connect(url))
    (tmp_path / "in.txt").write_text("Hello.")
    status = cli_main(["--url", url, "--file", str(tmp_path / "in.txt"), "--out", str(tmp_path / "o.wav")])
    err = capsys.readouterr().err
    assert status == 1 and len(err.strip().splitlines()) == 1 and err.startswith("error: cannot connect"), err


def test_max_buffered_bytes_0_reads_one_frame_at_a_time(srv: LiveServer) -> None:
    """Before, 0 ("buffer nothing") made the reader wait for room before the first frame,
    which no read could ever make: every turn hung."""

    async def main() -> None:
        async with await GatewayClient.connect(srv.ws_url, api_key=API_KEY, max_buffered_bytes=0) as gw:
            ctx = gw.context("t1")
            await ctx.send_text("Hello there.", end=True)
            audio = await asyncio.wait_for(ctx.collect_audio(), 10)
            assert ctx.events[-1]["type"] == "done" and len(audio) == ctx.events[-1]["audio_samples"] * 2 > 0

    run(main())
