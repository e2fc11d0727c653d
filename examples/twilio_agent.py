"""A runnable phone voice agent: Twilio Media Streams in, the gateway's voice out.

    # 1. the gateway
    cosyvoice-gateway --model FunAudioLLM/Fun-CosyVoice3-0.5B-2512 --port 8080
    # 2. this agent (Twilio must reach it: a public https URL, e.g. through a tunnel)
    python examples/twilio_agent.py --gateway ws://127.0.0.1:8080/v1/tts/stream --port 5050
    # 3. Twilio console: the phone number's "A call comes in" webhook -> https://<public>/twiml
    # In production add --twilio-auth-token (or TWILIO_AUTH_TOKEN) and --public-url https://<public>:
    # requests without Twilio's signature are then refused (403).

The agent greets the caller, stops talking as soon as the caller speaks (barge-in:
the gateway stops synthesising and Twilio's buffer is cleared), and answers when the
caller falls silent. There is no speech recogniser or LLM here: `reply_tokens` is the
place to plug them in (feed `msg.pcm16()` of inbound `media` to the recogniser, stream
the LLM's tokens into `bridge.say`). Everything telephony-specific is in
`gateway.twilio.TwilioBridge` (docs/telephony.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import re
from dataclasses import dataclass
from typing import AsyncIterator

import numpy as np
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.datastructures import URL
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from gateway.twilio import GatewayLost, SegmentPlayed, TurnError, TwilioBridge, is_from_twilio

log = logging.getLogger("twilio_agent")

GREETING = "Hello! Thanks for calling. This call is voiced by CosyVoice through the streaming gateway. How can I help you today?"


@dataclass(frozen=True)
class AgentConfig:
    gateway_url: str = "ws://127.0.0.1:8080/v1/tts/stream"
    api_key: str | None = None
    voice: str | None = None
    greeting: str = GREETING
    tokens_per_second: float = 30.0  # how fast the fake LLM emits tokens (0 = at once)
    speech_dbfs: float = -35.0  # inbound level counted as the caller speaking
    speech_frames: int = 3  # 60 ms of speech starts a caller turn (and a barge-in)
    silence_frames: int = 25  # 500 ms of silence ends it
    # With the account's auth token, /twiml and /media take only requests Twilio signed
    # (`X-Twilio-Signature`). Twilio signs the URL it called, which behind a tunnel or a
    # TLS-terminating proxy is not the one this server sees: `public_url` is that base
    # ("https://agent.example.com"; /media's is its wss:// form).
    twilio_auth_token: str | None = None
    public_url: str | None = None


class EnergyVad:
    """The smallest useful voice activity detector: 20 ms frames above a level.

    A real agent would use its recogniser's end-of-speech events instead.
    """

    def __init__(self, threshold_dbfs: float, speech_frames: int, silence_frames: int) -> None:
        self.threshold = threshold_dbfs
        self.speech_frames = speech_frames
        self.silence_frames = silence_frames
        self.in_speech = False
        self._run = 0
        self.speech_seconds = 0.0

    def update(self, pcm16: np.ndarray) -> str | None:
        """One inbound frame; returns "start", "end" or None."""
        if pcm16.size == 0:
            return None
        rms = float(np.sqrt(np.mean((pcm16.astype(np.float64) / 32768.0) ** 2)))
        loud = 20 * np.log10(max(rms, 1e-9)) > self.threshold
        if self.in_speech:
            self.speech_seconds += pcm16.size / 8000
        if loud == self.in_speech:
            self._run = 0
            return None
        self._run += 1
        if not self.in_speech and self._run >= self.speech_frames:
            self.in_speech, self._run, self.speech_seconds = True, 0, self.speech_frames * 0.02
            return "start"
        if self.in_speech and self._run >= self.silence_frames:
            self.in_speech, self._run = False, 0
            return "end"
        return None


async def llm_tokens(text: str, tokens_per_second: float) -> AsyncIterator[str]:
    """Stand-in for an LLM: yields word-sized pieces of ``text`` at a steady rate."""
    for piece in re.findall(r"\s*\S+", text):
        yield piece
        if tokens_per_second > 0:
            await asyncio.sleep(1.0 / tokens_per_second)


def reply_tokens(cfg: AgentConfig, heard_seconds: float, interrupted: str) -> AsyncIterator[str]:
    """Plug the recogniser + LLM in here. This toy answer only echoes what it knows."""
    text = f"I heard you speak for {heard_seconds:.1f} seconds."
    if interrupted:
        text += " Sorry for talking over you."
    return llm_tokens(text, cfg.tokens_per_second)


class CallAgent:
    """One phone call: reads Twilio's socket, talks through the bridge."""

    def __init__(self, cfg: AgentConfig, bridge: TwilioBridge) -> None:
        self.cfg = cfg
        self.bridge = bridge
        self.vad = EnergyVad(cfg.speech_dbfs, cfg.speech_frames, cfg.silence_frames)
        self.talking: asyncio.Task | None = None
        self.interrupted_text = ""

    async def start_talking(self, tokens: AsyncIterator[str]) -> None:
        if self.talking is not None and not self.talking.done():
            # The caller spoke again before the last reply's first words: that reply is
            # stale. Cancelled, and its turn with it if it had opened one (else both
            # replies would stream into that turn).
            self.talking.cancel()
            with contextlib.suppress(BaseException):
                await self.talking
            await self.bridge.barge_in()
        self.talking = asyncio.create_task(self.bridge.speak(tokens))

    async def stop_talking(self) -> None:
        if self.talking is not None and not self.talking.done():
            self.talking.cancel()  # the LLM stream: no more text
            with contextlib.suppress(BaseException):
                await self.talking
        result = await self.bridge.barge_in()
        self.interrupted_text = result.interrupted_text
        log.info("barge-in on %s: heard %r, cut during %r", result.turn_id, result.heard_text, result.interrupted_text)

    async def on_message(self, raw: str) -> bool:
        """Handle one Twilio message; False once the call is over."""
        msg = await self.bridge.handle_twilio(raw)
        if msg.event == "start":
            log.info("call %s started (stream %s)", self.bridge.call.call_sid, self.bridge.call.stream_sid)
            await self.start_talking(llm_tokens(self.cfg.greeting, self.cfg.tokens_per_second))
        elif msg.event == "media":
            change = self.vad.update(msg.pcm16())
            if change == "start" and self.bridge.speaking:
                await self.stop_talking()
            elif change == "end":
                await self.start_talking(reply_tokens(self.cfg, self.vad.speech_seconds, self.interrupted_text))
                self.interrupted_text = ""
        elif msg.event == "stop":
            return False
        return True

    async def log_events(self) -> None:
        while True:
            ev = await self.bridge.events.get()
            if isinstance(ev, SegmentPlayed):
                log.info("played %s #%d%s: %r", ev.turn_id, ev.segment_index, " (end of turn)" if ev.last else "", ev.text)
            elif isinstance(ev, TurnError):
                log.warning("turn %s: %s %s", ev.turn_id, ev.code, ev.message)
            elif isinstance(ev, GatewayLost):
                log.error("gateway socket closed (%s %s): this call can say no more", ev.code, ev.reason)
                return
            else:
                return


def _signed_url(cfg: AgentConfig, seen: URL, websocket: bool) -> str:
    """The URL Twilio called, as it signed it: `cfg.public_url`'s scheme and host (wss/ws
    for the WebSocket) with the path and query this server saw."""
    if cfg.public_url is None:
        return str(seen)
    base = cfg.public_url.rstrip("/")
    if websocket:
        base = re.sub(r"^http", "ws", base)
    return base + seen.path + (f"?{seen.query}" if seen.query else "")


def create_agent_app(cfg: AgentConfig) -> Starlette:
    async def twiml(request: Request) -> Response:
        # Twilio asks what to do with the call: stream it (both ways) to /media.
        if cfg.twilio_auth_token is not None:
            form = await request.form() if request.method == "POST" else None
            params = [(k, v) for k, v in form.multi_items() if isinstance(v, str)] if form is not None else []
            url = _signed_url(cfg, request.url, websocket=False)
            if not is_from_twilio(cfg.twilio_auth_token, url, request.headers.get("x-twilio-signature"), params):
                log.warning("refused /twiml without a valid Twilio signature (from %s)", request.client)
                return Response("not signed by Twilio", status_code=403)
        if cfg.public_url is not None:
            host = URL(cfg.public_url).netloc
            scheme = "wss" if cfg.public_url.startswith("https") else "ws"
        else:
            host = request.headers.get("host", "localhost")
            scheme = "wss" if request.url.scheme == "https" or request.headers.get("x-forwarded-proto") == "https" else "ws"
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>'
            f'<Response><Connect><Stream url="{scheme}://{host}/media"/></Connect></Response>'
        )
        return Response(body, media_type="application/xml")

    async def media(websocket: WebSocket) -> None:
        if cfg.twilio_auth_token is not None:
            url = _signed_url(cfg, websocket.url, websocket=True)
            if not is_from_twilio(cfg.twilio_auth_token, url, websocket.headers.get("x-twilio-signature")):
                log.warning("refused /media without a valid Twilio signature (from %s)", websocket.client)
                await websocket.close(code=1008)  # before the accept: an HTTP 403
                return
        await websocket.accept()
        settings = {"voice": cfg.voice} if cfg.voice else {}
        bridge = await TwilioBridge.connect(websocket.send_text, cfg.gateway_url, cfg.api_key, **settings)
        agent = CallAgent(cfg, bridge)
        logger = asyncio.create_task(agent.log_events())
        try:
            while await agent.on_message(await websocket.receive_text()):
                pass
        except WebSocketDisconnect:
            pass
        finally:
            if agent.talking is not None:
                agent.talking.cancel()
            await bridge.aclose()
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(logger, 5)

    return Starlette(routes=[Route("/twiml", twiml, methods=["GET", "POST"]), WebSocketRoute("/media", media)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gateway", default=AgentConfig.gateway_url, help="gateway WebSocket URL (/v1/tts/stream)")
    p.add_argument("--api-key", default=None, help="gateway API key, if it requires one")
    p.add_argument("--voice", default=None, help="registered voice id (default: the gateway's default voice)")
    p.add_argument("--greeting", default=GREETING)
    p.add_argument("--tokens-per-second", type=float, default=AgentConfig.tokens_per_second)
    p.add_argument("--twilio-auth-token", default=os.environ.get("TWILIO_AUTH_TOKEN"),
                   help="the Twilio account's auth token: only requests Twilio signed are taken "
                        "(default: $TWILIO_AUTH_TOKEN; unset: no check, for local trials only)")
    p.add_argument("--public-url", default=None, help="the base URL Twilio calls (https://...), when this "
                   "server sees another one (a tunnel, a TLS proxy): the URL Twilio signs")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=5050)
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = AgentConfig(a.gateway, a.api_key, a.voice, a.greeting, a.tokens_per_second,
                      twilio_auth_token=a.twilio_auth_token or None, public_url=a.public_url)
    if cfg.twilio_auth_token is None:
        log.warning("no --twilio-auth-token: anyone who finds this server's URL can use it as Twilio")
    uvicorn.run(create_agent_app(cfg), host=a.host, port=a.port, log_level="info")


if __name__ == "__main__":
    main()
