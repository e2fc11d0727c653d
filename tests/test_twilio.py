"""The Twilio Media Streams bridge against the real gateway (tiny random-weight engine).

A scripted Twilio side checks what a phone line would receive: `media` messages of
exactly 160 μ-law bytes with the call's streamSid, a `mark` after each segment's last
frame, and a `clear` on barge-in after which no audio of the interrupted turn follows.
The example agent (`examples/twilio_agent.py`) is driven over a real WebSocket the way
Twilio drives it.
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import json
import io
import math
import sys
import wave
from pathlib import Path
from typing import Any, Iterator

import httpx
import numpy as np
import pytest
import websockets

from gateway.app import create_app
from gateway.audio import ulaw_decode, ulaw_encode
from gateway.client import GatewayClient
from gateway.settings import EngineSettings, Settings
from gateway.twilio import CallEnded, GatewayLost, SegmentPlayed, TurnError, TwilioBridge, is_from_twilio, twilio_signature
from helpers import LiveServer

ROOT = Path(__file__).resolve().parent.parent
API_KEY = "sk-twilio-test"
STREAM_SID = "MZ0123456789abcdef"
CONNECTED = {"event": "connected", "protocol": "Call", "version": "1.0.0"}
START = {
    "event": "start",
    "sequenceNumber": "1",
    "streamSid": STREAM_SID,
    "start": {
        "streamSid": STREAM_SID,
        "accountSid": "AC0000",
        "callSid": "CA0000",
        "tracks": ["inbound"],
        "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1},
        "customParameters": {"who": "test"},
    },
}


# ---- shared with test_demo_page.py ----------------------------------------------------------


def tone_wav(seconds: float, freq: float, sr: int = 16000) -> bytes:
    """A harmonic-rich tone as 16-bit WAV bytes (a stand-in voice prompt)."""
    t = np.arange(int(seconds * sr)) / sr
    x = 0.3 * np.sign(np.sin(2 * np.pi * freq * t)) * (0.6 + 0.4 * np.sin(2 * np.pi * 3 * t))
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sr)
        w.writeframes((x * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def gateway_settings(model_dir: Path, root: Path) -> Settings:
    assets = root / "assets"
    assets.mkdir(exist_ok=True)
    (assets / "default.wav").write_bytes(tone_wav(3.0, freq=180.0))
    (assets / "default.txt").write_text("This is the default voice.")
    return Settings(
        model=str(model_dir),
        data_dir=root / "data",
        assets_dir=assets,
        api_keys=(API_KEY,),
        default_voice="default",
        # 2 speech tokens per text token: random weights never stop on their own. Warm-up
        # keeps the first request's one-off costs out of time-to-first-audio.
        engine=EngineSettings(device="cpu", lm_backend="torch", warmup=True, tokens_per_text_token=2.0),
    )


@pytest.fixture(scope="module")
def gateway_url(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with LiveServer(create_app(gateway_settings(tiny_model_dir, tmp_path_factory.mktemp("twilio")))) as srv:
        yield f"ws://127.0.0.1:{srv.port}/v1/tts/stream"


class TwilioSide:
    """Records what the bridge sends to Twilio; lets a test wait for a message."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self._changed = asyncio.Condition()

    async def send(self, raw: str) -> None:
        async with self._changed:
            self.sent.append(json.loads(raw))
            self._changed.notify_all()

    async def wait_for(self, pred: Any, timeout: float = 60.0) -> None:
        async def wait() -> None:
            async with self._changed:
                await self._changed.wait_for(lambda: pred(self.sent))

        await asyncio.wait_for(wait(), timeout)

    def marks(self) -> list[str]:
        return [m["mark"]["name"] for m in self.sent if m["event"] == "mark"]


def words(text: str) -> list[str]:
    out, cur = [], ""
    for ch in text:
        if ch == " " and cur:
            out.append(cur)
            cur = ""
        cur += ch
    return out + [cur]


def check_media(msg: dict[str, Any]) -> bytes:
    assert msg["streamSid"] == STREAM_SID
    payload = base64.b64decode(msg["media"]["payload"], validate=True)
    assert len(payload) == 160, "Twilio media must be 20 ms of 8 kHz μ-law"
    return payload


TEXT = "Hello there, caller. This is the second sentence. And this is the third one!"


def test_media_frames_and_a_mark_after_each_segment(gateway_url: str) -> None:
    async def main() -> tuple[TwilioSide, list[dict[str, Any]], list[Any]]:
        tw = TwilioSide()
        bridge = await TwilioBridge.connect(tw.send, gateway_url, API_KEY)
        await bridge.handle_twilio(json.dumps(CONNECTED))
        msg = await bridge.handle_twilio(json.dumps(START))
        assert msg.event == "start" and bridge.call is not None and bridge.call.custom_parameters == {"who": "test"}
        tid = await bridge.speak(words(TEXT))
        await bridge.wait_turn_sent(timeout=120)
        events = bridge.gateway_events(tid)
        # Twilio plays the audio and echoes every mark.
        for name in tw.marks():
            await bridge.handle_twilio({"event": "mark", "streamSid": STREAM_SID, "mark": {"name": name}})
        assert not bridge.speaking
        played = []
        while not bridge.events.empty():
            played.append(bridge.events.get_nowait())
        await bridge.aclose()
        assert isinstance(await bridge.events.get(), CallEnded)
        return tw, events, played

    tw, events, played = asyncio.run(main())
    starts = [e for e in events if e["type"] == "segment_started"]
    done = [e for e in events if e["type"] == "done"]
    assert len(starts) >= 2 and len(done) == 1
    assert "".join(s["text"] for s in starts) == TEXT

    # Every message is media or mark; media frames are exact and carry real audio.
    assert {m["event"] for m in tw.sent} == {"media", "mark"}
    media = [check_media(m) for m in tw.sent if m["event"] == "media"]
    assert len(media) * 160 == done[0]["audio_samples"]
    assert np.abs(ulaw_decode(b"".join(media)).astype(np.float64)).max() > 100

    # One mark per segment, in order, right after the frame holding its last sample.
    assert tw.marks() == [f"turn-1/{s['segment_index']}" for s in starts]
    ends = [s["audio_offset"] for s in starts[1:]] + [done[0]["audio_samples"]]
    frames_before = []
    count = 0
    for m in tw.sent:
        if m["event"] == "media":
            count += 1
        else:
            frames_before.append(count)
    assert frames_before == [math.ceil(e / 160) for e in ends]
    assert frames_before[-1] == len(media)  # the last mark follows the last frame

    # Echoed marks become SegmentPlayed events; the last one closes the turn.
    assert [(p.segment_index, p.text) for p in played] == [(s["segment_index"], s["text"]) for s in starts]
    assert [p.last for p in played] == [False] * (len(starts) - 1) + [True]


def test_barge_in_sends_clear_and_no_audio_of_the_turn_after_it(gateway_url: str) -> None:
    long_text = " ".join(f"Sentence number {i} is here." for i in range(1, 9))

    async def main() -> dict[str, Any]:
        tw = TwilioSide()
        bridge = await TwilioBridge.connect(tw.send, gateway_url, API_KEY)
        await bridge.handle_twilio(START)
        for piece in words(long_text):
            await bridge.say(piece)
        await bridge.end_turn()
        await tw.wait_for(lambda sent: any(m["event"] == "mark" for m in sent))
        first_mark = tw.marks()[0]
        await bridge.handle_twilio({"event": "mark", "streamSid": STREAM_SID, "mark": {"name": first_mark}})
        played = await bridge.events.get()
        assert bridge.speaking
        result = await bridge.barge_in()
        await bridge.wait_turn_sent(timeout=60)  # the forwarder has stopped for good
        snapshot = list(tw.sent)
        # Twilio returns the outstanding marks after a clear: they were not played.
        for name in tw.marks()[1:]:
            await bridge.handle_twilio({"event": "mark", "streamSid": STREAM_SID, "mark": {"name": name}})
        stray = bridge.events.qsize()
        # A piece of the interrupted turn still in flight (the agent's LLM stream was not
        # stopped yet) is dropped: it must not reopen turn-1 under the same id.
        assert await bridge.say(" and one more thing.", turn_id="turn-1") == "turn-1"
        # The next turn is heard again.
        tid2 = await bridge.speak(["Okay,", " go", " ahead."])
        await bridge.wait_turn_sent(timeout=60)
        events1 = bridge.gateway_events("turn-1")
        await bridge.aclose()
        return dict(sent=snapshot, all=list(tw.sent), played=played, result=result, stray=stray, tid2=tid2, events1=events1, speaking=bridge.speaking)

    r = asyncio.run(main())
    sent = r["sent"]
    clears = [i for i, m in enumerate(sent) if m["event"] == "clear"]
    assert len(clears) == 1 and sent[clears[0]]["streamSid"] == STREAM_SID
    assert all(m["event"] != "media" for m in sent[clears[0] + 1 :]), "audio of the interrupted turn after clear"
    assert all(m["event"] != "mark" for m in sent[clears[0] + 1 :])
    for m in sent:
        if m["event"] == "media":
            check_media(m)

    # What the caller heard: the confirmed first segment, cut during the second.
    assert isinstance(r["played"], SegmentPlayed) and r["played"].segment_index == 0
    res = r["result"]
    assert res.turn_id == "turn-1" and res.heard_text == r["played"].text
    assert res.interrupted_text and long_text.startswith(res.heard_text + res.interrupted_text)
    assert r["stray"] == 0, "marks echoed after a clear must not count as played"
    # The gateway context was really cancelled (if it was still producing) or done.
    kinds = [e["type"] for e in r["events1"]]
    assert "cancelled" in kinds or "done" in kinds

    # The following turn streams normally after the clear.
    after = r["all"][len(sent) :]
    assert r["tid2"] == "turn-2"
    assert sum(m["event"] == "media" for m in after) > 0 and [m["mark"]["name"] for m in after if m["event"] == "mark"][-1].startswith("turn-2/")


# ---- the example agent, driven like Twilio drives it --------------------------------------


def load_example() -> Any:
    spec = importlib.util.spec_from_file_location("twilio_agent", ROOT / "examples" / "twilio_agent.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through it
    spec.loader.exec_module(module)
    return module


def ulaw_tone(frames: int, amplitude: float) -> list[str]:
    t = np.arange(frames * 160) / 8000
    pcm = (amplitude * 32767 * np.sin(2 * np.pi * 440 * t)).astype(np.int16)
    data = ulaw_encode(pcm)
    return [base64.b64encode(data[i : i + 160]).decode() for i in range(0, len(data), 160)]


def test_example_agent_over_a_twilio_socket(gateway_url: str) -> None:
    ex = load_example()
    cfg = ex.AgentConfig(gateway_url=gateway_url, api_key=API_KEY, greeting=TEXT, tokens_per_second=0.0, speech_frames=3, silence_frames=4)
    with LiveServer(ex.create_agent_app(cfg)) as agent:
        twiml = httpx.post(f"{agent.url}/twiml", headers={"host": "agent.example"}, timeout=10)
        assert twiml.status_code == 200 and '<Stream url="ws://agent.example/media"/>' in twiml.text

        async def main() -> list[dict[str, Any]]:
            got: list[dict[str, Any]] = []

            async def until(ws: Any, pred: Any) -> None:
                while not pred():
                    got.append(json.loads(await asyncio.wait_for(ws.recv(), 60)))

            async with websockets.connect(f"ws://127.0.0.1:{agent.port}/media") as ws:
                await ws.send(json.dumps(CONNECTED))
                await ws.send(json.dumps(START))
                await until(ws, lambda: any(m["event"] == "mark" for m in got))
                # The first segment was played: echo its mark, then the caller talks.
                await ws.send(json.dumps({"event": "mark", "streamSid": STREAM_SID, "mark": {"name": got[-1]["mark"]["name"]}}))
                for i, payload in enumerate(ulaw_tone(4, 0.5) + ulaw_tone(5, 0.0)):
                    await ws.send(json.dumps({"event": "media", "streamSid": STREAM_SID, "sequenceNumber": str(i + 2),
                                              "media": {"track": "inbound", "chunk": str(i + 1), "timestamp": str(20 * i), "payload": payload}}))
                # The caller fell silent: the agent answers in a new turn.
                await until(ws, lambda: any(m["event"] == "mark" and m["mark"]["name"].startswith("turn-2/") for m in got))
                await ws.send(json.dumps({"event": "stop", "streamSid": STREAM_SID, "stop": {"callSid": "CA0000"}}))
                with pytest.raises(websockets.ConnectionClosed):
                    while True:
                        got.append(json.loads(await asyncio.wait_for(ws.recv(), 30)))
            return got

        got = asyncio.run(main())
    events = [m["event"] for m in got]
    assert set(events) <= {"media", "mark", "clear"}
    clear = events.index("clear")
    assert events.count("clear") == 1
    assert "media" in events[:clear] and "mark" in events[:clear]
    for m in got:
        if m["event"] == "media":
            check_media(m)
    # Marks of the greeting before the clear, the answer's after it; none of turn 1 after.
    after = [m["mark"]["name"] for m in got[clear + 1 :] if m["event"] == "mark"]
    assert after and all(n.startswith("turn-2/") for n in after)
    assert "media" in events[clear + 1 :]


def test_twilio_signature_is_twilios_published_example() -> None:
    """Twilio's documented request-validation example: auth token, URL, form parameters
    and the signature Twilio sends for them."""
    url = "https://mycompany.com/myapp.php?foo=1&bar=2"
    params = {"CallSid": "CA1234567890ABCDE", "Caller": "+14158675309", "Digits": "1234", "From": "+14158675309",
              "To": "+18005551212"}
    assert twilio_signature("12345", url, params.items()) == "RSOYDt4T1cUTdK1PDd93/VVr8B8="
    assert is_from_twilio("12345", url, "RSOYDt4T1cUTdK1PDd93/VVr8B8=", reversed(list(params.items())))
    assert not is_from_twilio("12345", url, "RSOYDt4T1cUTdK1PDd93/VVr8B8=", {**params, "Digits": "9999"}.items())
    assert not is_from_twilio("54321", url, "RSOYDt4T1cUTdK1PDd93/VVr8B8=", params.items())
    assert not is_from_twilio("12345", url, None, params.items())


def test_example_agent_takes_only_requests_twilio_signed(gateway_url: str) -> None:
    """With the account's auth token the agent refuses /twiml and /media without Twilio's
    signature of the public URL (the one Twilio calls, not the one the agent sees)."""
    ex = load_example()
    token, public = "the-auth-token", "https://agent.example"
    cfg = ex.AgentConfig(gateway_url=gateway_url, api_key=API_KEY, greeting=TEXT, tokens_per_second=0.0,
                         twilio_auth_token=token, public_url=public)
    form = {"CallSid": "CA0000", "From": "+15550001111"}
    with LiveServer(ex.create_agent_app(cfg)) as agent:
        assert httpx.post(f"{agent.url}/twiml", data=form, timeout=10).status_code == 403
        forged = twilio_signature("another-token", f"{public}/twiml", form.items())
        assert httpx.post(f"{agent.url}/twiml", data=form, headers={"x-twilio-signature": forged},
                          timeout=10).status_code == 403
        signed = twilio_signature(token, f"{public}/twiml", form.items())
        twiml = httpx.post(f"{agent.url}/twiml", data=form, headers={"x-twilio-signature": signed}, timeout=10)
        assert twiml.status_code == 200 and '<Stream url="wss://agent.example/media"/>' in twiml.text

        async def media() -> None:
            with pytest.raises(websockets.InvalidStatus) as refused:
                async with websockets.connect(f"ws://127.0.0.1:{agent.port}/media"):
                    pass
            assert refused.value.response.status_code == 403
            headers = {"x-twilio-signature": twilio_signature(token, "wss://agent.example/media")}
            async with websockets.connect(f"ws://127.0.0.1:{agent.port}/media", additional_headers=headers) as ws:
                await ws.send(json.dumps(CONNECTED))
                await ws.send(json.dumps({"event": "stop", "streamSid": STREAM_SID, "stop": {"callSid": "CA0000"}}))
                with pytest.raises(websockets.ConnectionClosed):
                    await asyncio.wait_for(ws.recv(), 30)

        asyncio.run(media())


def test_a_refused_turn_does_not_silence_the_next_and_garbled_frames_are_ignored(gateway_url: str) -> None:
    """A turn whose context the gateway refuses (an unknown voice) ends with its error
    (`final`), so the turn after it is spoken; frames that are not Twilio JSON objects
    change nothing."""
    async def main() -> tuple[TwilioSide, list[Any], list[str]]:
        tw = TwilioSide()
        bridge = await TwilioBridge.connect(tw.send, gateway_url, API_KEY)
        garbled = [(await bridge.handle_twilio(raw)).event
                   for raw in ("{nope", "[1, 2]", '{"event": "media", "media": "x"}', '{"event": "mark", "mark": 3}')]
        await bridge.handle_twilio(START)
        await bridge.say("Nobody can say this.", voice="nobody-registered-this")
        await bridge.end_turn()
        await bridge.say("But this is spoken.")
        await bridge.end_turn()
        await tw.wait_for(lambda sent: any(m["event"] == "mark" and m["mark"]["name"].startswith("turn-2/")
                                           for m in sent))
        errors = []
        while not bridge.events.empty():
            errors.append(bridge.events.get_nowait())
        await bridge.aclose()
        return tw, errors, garbled

    tw, errors, garbled = asyncio.run(main())
    assert garbled == ["invalid", "invalid", "media", "mark"]
    assert [(e.turn_id, e.code) for e in errors if isinstance(e, TurnError)] == [("turn-1", "voice_not_found")]
    assert not any(n.startswith("turn-1/") for n in tw.marks())
    assert any(m["event"] == "media" for m in tw.sent)


def test_text_before_start_waits_for_the_stream_and_stop_ends_the_call(gateway_url: str) -> None:
    async def main() -> tuple[TwilioSide, Any, Any, bool]:
        tw = TwilioSide()
        bridge = await TwilioBridge.connect(tw.send, gateway_url, API_KEY)
        # The agent may start talking before Twilio's `start` (no streamSid yet) ...
        await bridge.say("Welcome, caller.")
        # A segment's mark follows once the next segment starts (or a flush / the end).
        await bridge.say(" Please hold on. I am checking that")
        sent_before_start = len(tw.sent)
        await bridge.handle_twilio(START)
        await tw.wait_for(lambda sent: any(m["event"] == "mark" for m in sent))
        # ... and Twilio hangs up mid-turn: the gateway context is cancelled, the call ends.
        await bridge.handle_twilio({"event": "stop", "sequenceNumber": "9", "streamSid": STREAM_SID, "stop": {"callSid": "CA0000"}})
        ended = await asyncio.wait_for(bridge.events.get(), 10)
        with pytest.raises(RuntimeError):
            await bridge.say("too late")
        return tw, sent_before_start, ended, bridge.speaking

    tw, before, ended, speaking = asyncio.run(main())
    assert before == 0
    assert tw.sent[0]["event"] == "media" and check_media(tw.sent[0])
    assert tw.marks()[0] == "turn-1/0"
    assert isinstance(ended, CallEnded) and ended.reason == "stop"
    assert all(m["event"] in ("media", "mark") for m in tw.sent)


def test_flush_marks_the_text_spoken_so_far(gateway_url: str) -> None:
    async def main() -> tuple[TwilioSide, Any]:
        tw = TwilioSide()
        bridge = await TwilioBridge.connect(tw.send, gateway_url, API_KEY)
        await bridge.handle_twilio(START)
        await bridge.say("Let me check that")  # no sentence end: nothing would be spoken yet
        await bridge.flush()  # the LLM paused (a tool call): speak what we have
        await tw.wait_for(lambda sent: bool(tw.marks()))
        await bridge.handle_twilio({"event": "mark", "streamSid": STREAM_SID, "mark": {"name": tw.marks()[0]}})
        played = await bridge.events.get()
        await bridge.aclose()
        return tw, played

    tw, played = asyncio.run(main())
    assert tw.marks() == ["turn-1/0"]
    assert tw.sent[-1]["event"] == "mark" and sum(m["event"] == "media" for m in tw.sent) > 0
    assert isinstance(played, SegmentPlayed) and played.text == "Let me check that" and not played.last


def test_two_calls_on_one_shared_gateway_client_keep_their_own_turns(gateway_url: str) -> None:
    """Every call's first turn is "turn-1": on one shared client the gateway contexts must
    still be apart, or one call got both callers' speech and the other none."""
    from gateway.client import GatewayClient

    async def main() -> tuple[TwilioSide, TwilioSide, int]:
        client = await GatewayClient.connect(gateway_url, api_key=API_KEY)
        sides = [TwilioSide(), TwilioSide()]
        bridges = [TwilioBridge(side.send, client) for side in sides]
        for bridge, text in zip(bridges, ("The first caller hears this.", "The second caller hears that one.")):
            await bridge.handle_twilio(START)
            await bridge.say(text)
            await bridge.end_turn()
        for side in sides:
            await side.wait_for(lambda sent: any(m["event"] == "mark" for m in sent))
        for bridge in bridges:
            await bridge.wait_turn_sent(60)
            await bridge.aclose()
        left = len(client._contexts)
        await client.aclose()
        return sides[0], sides[1], left

    first, second, left = asyncio.run(main())
    assert first.marks() == ["turn-1/0"] and second.marks() == ["turn-1/0"]
    media = [sum(m["event"] == "media" for m in side.sent) for side in (first, second)]
    assert all(n > 0 for n in media) and media[0] != media[1]  # each its own sentence's audio
    assert left == 0  # finished turns leave no handle on the shared client


def test_a_lost_gateway_is_reported_and_say_refuses(gateway_url: str) -> None:
    """The audio already sent still plays: its segment gets a mark, and `speaking` stays
    true until Twilio echoes it (a barge-in then still sends `clear`)."""
    async def main() -> tuple[Any, list[bool], list[str]]:
        tw = TwilioSide()
        bridge = await TwilioBridge.connect(tw.send, gateway_url, API_KEY)
        await bridge.handle_twilio(START)
        await bridge.say("Hello there, caller. This sentence is cut off when the socket goes")
        await tw.wait_for(lambda sent: any(m["event"] == "media" for m in sent))
        await bridge.gateway.ws.close()  # the network or a deploy ends the gateway socket
        lost = await asyncio.wait_for(bridge.events.get(), 10)
        with pytest.raises(ConnectionError):
            await bridge.say("Nobody will hear this.")
        await bridge.wait_turn_sent(10)
        speaking = [bridge.speaking]
        for name in tw.marks():
            await bridge.handle_twilio({"event": "mark", "streamSid": STREAM_SID, "mark": {"name": name}})
        speaking.append(bridge.speaking)
        await bridge.aclose()
        return lost, speaking, tw.marks()

    lost, speaking, marks = asyncio.run(main())
    assert isinstance(lost, GatewayLost) and marks and speaking == [True, False]


def test_a_new_turn_id_ends_the_open_turn_and_the_last_segment_is_reported_last(gateway_url: str) -> None:
    """Naming a new turn while one is open ends that one, so the new one is not stuck
    behind it; a turn whose last segment was heard before it ended (a flush marked it)
    still reports `last`."""
    async def main() -> tuple[TwilioSide, list[Any]]:
        tw = TwilioSide()
        bridge = await TwilioBridge.connect(tw.send, gateway_url, API_KEY)
        await bridge.handle_twilio(START)
        await bridge.say("Hi there. How", turn_id="a")
        await bridge.say("Next reply, please wait", turn_id="b")
        await bridge.flush()
        await tw.wait_for(lambda sent: any(n.startswith("b/") for n in tw.marks()))
        for name in tw.marks():
            await bridge.handle_twilio({"event": "mark", "streamSid": STREAM_SID, "mark": {"name": name}})
        await bridge.end_turn()
        events: list[Any] = []
        while not any(isinstance(e, SegmentPlayed) and e.turn_id == "b" and e.last for e in events):
            events.append(await asyncio.wait_for(bridge.events.get(), 30))
        await bridge.aclose()
        return tw, events

    tw, events = asyncio.run(main())
    assert [n.split("/")[0] for n in tw.marks()][-1] == "b" and any(n.startswith("a/") for n in tw.marks())
    played_b = [e for e in events if isinstance(e, SegmentPlayed) and e.turn_id == "b"]
    assert [e.last for e in played_b] == [False, True] and played_b[0].text == played_b[1].text


def test_a_late_end_of_an_interrupted_turn_does_not_end_the_next(gateway_url: str) -> None:
    """An LLM loop not stopped before `barge_in` ends *its* turn when it finishes; the turn
    after the barge-in goes on taking text (it lost its rest before)."""
    async def main() -> list[str]:
        tw = TwilioSide()
        bridge = await TwilioBridge.connect(tw.send, gateway_url, API_KEY)
        await bridge.handle_twilio(START)
        first = await bridge.say("The first reply goes on and on.")
        await bridge.barge_in()
        second = await bridge.say("Okay, go ahead")
        await bridge.end_turn(first)  # the interrupted turn's loop ends late
        await bridge.say(" then. More words follow.")
        await bridge.end_turn()
        await bridge.wait_turn_sent(60)
        texts = [e["text"] for e in bridge.gateway_events(second) if e.get("type") == "segment_started"]
        await bridge.aclose()
        return texts

    assert "".join(asyncio.run(main())) == "Okay, go ahead then. More words follow."


def test_text_after_a_refused_turn_opens_a_new_turn(gateway_url: str) -> None:
    async def main() -> tuple[str, str, list[Any]]:
        tw = TwilioSide()
        bridge = await TwilioBridge.connect(tw.send, gateway_url, API_KEY)
        await bridge.handle_twilio(START)
        refused = await bridge.say("Hello", voice="nobody-registered-this")
        error = await asyncio.wait_for(bridge.events.get(), 30)
        spoken = await bridge.say(" there. This one is heard.")
        await bridge.end_turn()
        await bridge.wait_turn_sent(60)
        await bridge.aclose()
        return refused, spoken, [error, tw.marks()]

    refused, spoken, (error, marks) = asyncio.run(main())
    assert isinstance(error, TurnError) and error.turn_id == refused == "turn-1" and error.code == "voice_not_found"
    assert spoken == "turn-2" and marks and all(m.startswith("turn-2/") for m in marks)


def test_barge_in_reports_the_turn_the_caller_was_hearing(gateway_url: str) -> None:
    """A second reply queued behind the first on the line: the caller was hearing the first."""
    async def main() -> Any:
        tw = TwilioSide()
        bridge = await TwilioBridge.connect(tw.send, gateway_url, API_KEY)
        await bridge.handle_twilio(START)
        await bridge.say("The answer is forty two.")
        await bridge.end_turn()
        await bridge.say("And here is a second reply.")
        await bridge.end_turn()
        await tw.wait_for(lambda sent: any(m["event"] == "media" for m in sent))
        result = await bridge.barge_in()
        await bridge.aclose()
        return result

    result = asyncio.run(main())
    assert result.turn_id == "turn-1" and result.heard_text == "" and result.frames_sent > 0
    assert result.interrupted_text == "The answer is forty two."


def test_stream_mode_segments_report_their_whole_text(gateway_url: str) -> None:
    """In `text_mode: "stream"` a `segment_started` carries only the text received when its
    audio began; what the caller heard (`SegmentPlayed.text`) must still be all of it. The
    sentence's last words are sent only after its first audio went to Twilio."""
    head = " ".join(f"word{i}" for i in range(60))
    text = head + " and the last words come after the first audio. Then more"

    async def main() -> tuple[list[Any], str]:
        tw = TwilioSide()
        bridge = await TwilioBridge.connect(tw.send, gateway_url, API_KEY, text_mode="stream",
                                            segmentation={"max_chars": 1000, "first_min_chars": 1000})
        await bridge.handle_twilio(START)
        for piece in words(head + " "):
            await bridge.say(piece)
        await tw.wait_for(lambda sent: any(m["event"] == "media" for m in sent))
        for piece in words(text[len(head) + 1:]):
            await bridge.say(piece)
        await bridge.end_turn()
        await bridge.wait_turn_sent(120)
        started = next(e["text"] for e in bridge.gateway_events("turn-1") if e.get("type") == "segment_started")
        for name in tw.marks():
            await bridge.handle_twilio({"event": "mark", "streamSid": STREAM_SID, "mark": {"name": name}})
        played = []
        while not bridge.events.empty():
            played.append(bridge.events.get_nowait())
        await bridge.aclose()
        return played, started

    events, started = asyncio.run(main())
    played = [e for e in events if isinstance(e, SegmentPlayed)]
    assert len(started) < len(head) + 10  # the first segment's audio began before its text was all there
    assert played and played[-1].last
    assert "".join(e.text for e in played) == text and played[-1].text_end == len(text)


def test_a_turn_refused_while_the_last_one_plays_takes_no_more_text_quietly(gateway_url: str) -> None:
    """The client knows of turn 2's refusal before the bridge's forwarder (behind turn 1's,
    still playing) has read it: `say`, `flush` and `end_turn` for turn 2 must not raise
    the refusal at the agent (it comes as a TurnError), nor send text after it."""
    long = "The quick brown fox jumps over the lazy dog near the quiet river bank today. " * 4

    async def main() -> list[Any]:
        tw = TwilioSide()
        bridge = await TwilioBridge.connect(tw.send, gateway_url, API_KEY)
        await bridge.handle_twilio(START)
        await bridge.say(long)
        await bridge.end_turn()  # turn 1 goes on being spoken
        await bridge.say("Hello", voice="nobody-registered-this")  # turn 2: refused
        ctx2 = bridge._turn.ctx
        for _ in range(3000):  # the client's reader has the refusal
            if ctx2.finished:
                break
            await asyncio.sleep(0.01)
        assert ctx2.finished and ctx2.error is not None and ctx2.error["code"] == "voice_not_found"
        await bridge.say(" there.")  # opens a new turn instead
        await bridge.flush()
        await bridge.end_turn()
        with pytest.raises(ValueError, match="context id"):
            await bridge.say("x", turn_id="greeting 1")  # a space: no context id
        await tw.wait_for(lambda sent: any(m["event"] == "mark" and "turn-3/" in m["mark"]["name"] for m in sent))
        errors = []
        while not bridge.events.empty():
            ev = bridge.events.get_nowait()
            if isinstance(ev, TurnError):
                errors.append(ev)
        await bridge.aclose()
        return errors

    errors = asyncio.run(main())
    assert [e.code for e in errors] == ["voice_not_found"]


def test_the_turn_counts_as_playing_while_its_last_segment_is_closed(gateway_url: str) -> None:
    """At the turn's `done` the last segment gets its padded frame and its mark: until the
    mark is out, that audio is sent but unmarked, so the turn must still be playing (a
    barge-in then sends `clear`). It was marked finished first: `speaking` read False in
    that window (the padded frame's send, a wait for the send lock) and a barge-in sent
    nothing, letting the last segment play out."""

    async def main() -> list[tuple[bool, bool]]:
        tw = TwilioSide()
        bridge = await TwilioBridge.connect(tw.send, gateway_url, API_KEY)
        seen: list[tuple[bool, bool]] = []
        close = bridge._close_open_segment

        async def closing(turn: Any, pad: bool = False, text_end: int | None = None) -> None:
            seen.append((pad, bridge.speaking))  # as a barge-in would read it now
            await close(turn, pad=pad, text_end=text_end)

        bridge._close_open_segment = closing  # type: ignore[method-assign]
        await bridge.handle_twilio(START)
        await bridge.speak(["Hello", " there."])
        await bridge.wait_turn_sent(timeout=60)
        await bridge.aclose()
        return seen

    seen = asyncio.run(main())
    assert (True, True) in seen and all(speaking for _, speaking in seen), seen


# ---- found by a review of the Twilio bridge ---------------------------------------------------


class GoneTwilio(TwilioSide):
    """Twilio's socket that breaks after `frames` media messages (the caller's network
    failed, the agent's server dropped the socket): every later send raises."""

    def __init__(self, frames: int) -> None:
        super().__init__()
        self.frames = frames
        self.gone = asyncio.Event()

    async def send(self, raw: str) -> None:
        if self.gone.is_set():
            raise RuntimeError("WebSocket is not connected")
        await super().send(raw)
        if sum(m["event"] == "media" for m in self.sent) >= self.frames:
            self.gone.set()


def test_a_call_whose_twilio_socket_broke_cancels_its_gateway_context_on_close(gateway_url: str) -> None:
    """Twilio's socket breaks mid-turn (no `stop`): the turn's forwarder dies on the failed
    send. The agent then closes the bridge (docs/telephony.md's `finally: aclose()`): the
    turn's gateway context must be cancelled, not left open on a shared client holding its
    engine session (it was: the dead forwarder had marked the turn finished)."""

    async def main() -> list[Any]:
        client = await GatewayClient.connect(gateway_url, api_key=API_KEY)
        tw = GoneTwilio(frames=3)
        bridge = TwilioBridge(tw.send, client)
        await bridge.handle_twilio(START)
        await bridge.say("Hello there, caller. This reply is still being written by the")
        ctx, forwarder = bridge._turn.ctx, bridge._turn.forwarder
        await asyncio.wait_for(asyncio.wait({forwarder}), 60)  # it died on the failed send
        assert isinstance(forwarder.exception(), RuntimeError) and not ctx.finished
        await bridge.aclose()
        items = []

        async def rest() -> None:
            async for item in ctx.stream():
                if isinstance(item, dict):
                    items.append(item)

        try:
            await asyncio.wait_for(rest(), 20)
        finally:
            await client.aclose()
        return items

    events = asyncio.run(main())
    assert events[-1]["type"] == "cancelled"


def test_a_turn_cut_off_by_a_lost_gateway_is_not_reported_as_heard_whole(gateway_url: str) -> None:
    """The gateway socket closes mid-turn (a deploy, an engine failure): the audio already
    sent still plays and its segment gets a mark, but the reply was cut off (the agent had
    not even ended the turn). `SegmentPlayed.last` says "the whole reply was heard": it
    must not be set for such a turn (it was, for the cut segment's echo)."""

    async def main() -> list[Any]:
        tw = TwilioSide()
        bridge = await TwilioBridge.connect(tw.send, gateway_url, API_KEY)
        await bridge.handle_twilio(START)
        await bridge.say("Hello there, caller. This sentence is cut off when the socket goes")
        await tw.wait_for(lambda sent: any(m["event"] == "media" for m in sent))
        await bridge.gateway.ws.close()
        await bridge.wait_turn_sent(10)
        for name in tw.marks():
            await bridge.handle_twilio({"event": "mark", "streamSid": STREAM_SID, "mark": {"name": name}})
        events = []
        while not bridge.events.empty():
            events.append(bridge.events.get_nowait())
        await bridge.aclose()
        return events

    played = [e for e in asyncio.run(main()) if isinstance(e, SegmentPlayed)]
    assert played, "the audio sent before the loss still gets its mark"
    assert not any(e.last for e in played), played


def test_a_closed_call_is_not_kept_alive_by_a_shared_gateway_client(gateway_url: str) -> None:
    """Calls sharing one long-lived gateway client: a call's bridge, with every turn, every
    gateway event and mark of its call, must be freed once the call is closed. The bridge
    registered a callback on the client's reader task (to report a lost socket) and never
    removed it, so each call ever made on the client stayed in memory until that socket
    closed."""
    import gc
    import weakref

    async def main() -> bool:
        client = await GatewayClient.connect(gateway_url, api_key=API_KEY)
        try:
            tw = TwilioSide()
            bridge = TwilioBridge(tw.send, client)
            await bridge.handle_twilio(START)
            await bridge.speak(["Hello", " there."])
            await bridge.wait_turn_sent(60)
            await bridge.aclose()
            await asyncio.wait({bridge._keepalive})
            ref = weakref.ref(bridge)
            del bridge
            gc.collect()
            return ref() is None
        finally:
            await client.aclose()

    assert asyncio.run(main()), "the closed bridge is still referenced"
