"""Voice a Twilio phone call with the gateway: a bridge between Twilio Media Streams
and the streaming WebSocket protocol (docs/telephony.md, docs/protocol.md).

Who holds which socket. Twilio allows one bidirectional Media Stream per call, and the
voice agent needs that stream's *inbound* audio for its speech recogniser, so the
agent's server accepts Twilio's WebSocket. The bridge is a small object the agent
creates inside that handler: it opens one WebSocket to the gateway (`/v1/tts/stream`,
format `ulaw_8000`, which already yields exact 20 ms G.711 frames) and does the rest:

* `say(text)` streams text (LLM tokens of any size) into the current turn,
  `end_turn()` ends it, `barge_in()` interrupts it;
* the turn's audio goes to Twilio as `media` messages of exactly 160 μ-law bytes;
* after each segment's last frame a `mark` named ``"<turn>/<segment>"`` is sent;
  Twilio echoes a mark once the audio before it was *played*, so `SegmentPlayed`
  events tell the agent what the caller really heard;
* `barge_in()` cancels the gateway context (no more synthesis) and sends `clear`
  (Twilio drops what it buffered). Marks Twilio returns after a clear were not played,
  and are not reported as played.

Glue in the agent (any framework whose socket has ``send_text``/``receive_text``):

    bridge = await TwilioBridge.connect(twilio_ws.send_text, "ws://gw:8080/v1/tts/stream", voice="alice")
    async for raw in twilio_messages:
        msg = await bridge.handle_twilio(raw)       # start / mark / stop handled here
        if msg.event == "media": stt.feed(msg.pcm16())
    ...
    await bridge.say("Hello"); await bridge.say(" there!"); await bridge.end_turn()
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterable

import numpy as np

from .audio import ulaw_decode
from .client import Context, GatewayClient

FRAME_BYTES = 160  # 20 ms of 8 kHz μ-law: the frame size Twilio plays
ULAW_SILENCE = 0xFF  # μ-law code of a zero sample

# What Twilio plays: 8 kHz μ-law in binary frames (the bridge base64s them itself).
TURN_FORMAT: dict[str, Any] = {"format": "ulaw_8000", "sample_rate": 8000, "audio": "binary"}

SendText = Callable[[str], Awaitable[None]]


# ---- is it Twilio? -----------------------------------------------------------------------


def twilio_signature(auth_token: str, url: str, params: Iterable[tuple[str, str]] = ()) -> str:
    """The `X-Twilio-Signature` Twilio sends with a request to `url` (exactly as Twilio
    called it: scheme, host, path and query) with these form parameters (a POST's; none
    for a GET or a Media Streams WebSocket): base64 of HMAC-SHA1, keyed with the account's
    auth token, of the URL followed by each parameter's name and value in sorted order."""
    data = url + "".join(name + value for name, value in sorted(set(params)))
    return base64.b64encode(hmac.new(auth_token.encode(), data.encode(), hashlib.sha1).digest()).decode()


def is_from_twilio(auth_token: str, url: str, signature: str | None, params: Iterable[tuple[str, str]] = ()) -> bool:
    """Whether `signature` (the request's `X-Twilio-Signature`, None when absent) is Twilio's
    for this request: anyone who finds an agent's URL could otherwise start calls' worth
    of synthesis on it, or feed it audio as a caller."""
    return signature is not None and hmac.compare_digest(twilio_signature(auth_token, url, params), signature)


# ---- what the agent receives ----------------------------------------------------------


@dataclass(frozen=True)
class TwilioMessage:
    """One message from Twilio, parsed. ``payload`` holds inbound μ-law for `media`."""

    event: str
    data: dict[str, Any]
    payload: bytes = b""

    def pcm16(self) -> np.ndarray:
        """Inbound audio as int16 samples at 8 kHz (what a speech recogniser wants)."""
        return ulaw_decode(self.payload)


@dataclass(frozen=True)
class CallInfo:
    stream_sid: str
    call_sid: str = ""
    account_sid: str = ""
    custom_parameters: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class SegmentPlayed:
    """Twilio confirmed the caller heard this segment to its end."""

    turn_id: str
    segment_index: int
    text: str
    text_end: int  # character offset into the turn's text, end of this segment
    last: bool  # the turn's final segment: the whole reply was heard


@dataclass(frozen=True)
class TurnError:
    turn_id: str
    code: str
    message: str


@dataclass(frozen=True)
class CallEnded:
    reason: str  # "stop" (Twilio hung up) or "closed"


@dataclass(frozen=True)
class GatewayLost:
    """The gateway socket closed under the call (a deploy drained it, its engine failed,
    the network broke): nothing more can be spoken on this bridge; `say` raises."""

    code: int | None
    reason: str


BridgeEvent = SegmentPlayed | TurnError | CallEnded | GatewayLost

# Under the gateway's idle timeout (300 s by default): a call may be silent for minutes.
KEEPALIVE_S = 60.0


@dataclass(frozen=True)
class BargeInResult:
    """What the caller heard of the interrupted turn."""

    turn_id: str | None
    heard_text: str  # segments confirmed played, in order
    interrupted_text: str  # the segment that was playing when cut (may be partly heard)
    frames_sent: int  # media frames of this turn handed to Twilio


# ---- per-turn state --------------------------------------------------------------------


@dataclass
class _Segment:
    index: int
    text: str
    text_end: int
    start_sample: int  # audio_offset at 8 kHz: first sample of this segment
    end_sample: int | None = None  # known when the next segment starts or the turn ends
    text_start: int = 0  # character offset into the turn's text
    marked: bool = False
    played: bool = False


def _field(data: dict[str, Any], key: str) -> dict[str, Any]:
    """A nested object of a Twilio message; {} when missing or not an object."""
    value = data.get(key)
    return value if isinstance(value, dict) else {}


@dataclass
class _Turn:
    turn_id: str
    ctx: Context
    segments: list[_Segment] = field(default_factory=list)
    samples_sent: int = 0
    frames_sent: int = 0
    remainder: bytes = b""
    finished: bool = False  # the gateway sent done/cancelled: nothing more will come
    completed: bool = False  # ended with `done`: its last segment ends the whole reply
    cleared: bool = False  # barge-in: nothing more goes to Twilio
    ended: bool = False  # the agent called end_turn()
    forwarder: asyncio.Task | None = None
    text: str = ""  # everything `say` sent in this turn
    flush_ends: list[int] = field(default_factory=list)  # len(text) at each flush, by flush_id - 1

    def settle_text(self, seg: "_Segment", end: int | None) -> None:
        """The segment's whole text once its end is known: in stream mode the gateway's
        `segment_started` carries only the text received when its audio began."""
        if end is not None and seg.text_start <= end <= len(self.text):
            seg.text, seg.text_end = self.text[seg.text_start : end], end

    def mark_name(self, seg: _Segment) -> str:
        return f"{self.turn_id}/{seg.index}"

    @property
    def playing(self) -> bool:
        """Audio of this turn may still be audible: not all its marks came back."""
        if self.cleared:
            return False
        return not self.finished or any(s.marked and not s.played for s in self.segments)


# ---- the bridge ---------------------------------------------------------------------------


class TwilioBridge:
    """One phone call: Twilio's Media Stream on one side, a gateway socket on the other.

    All state is per call (this object). Turns are sequential: `say` after a finished
    or interrupted turn opens the next one (``turn-1``, ``turn-2``, ... unless named).
    """

    def __init__(self, send_twilio: SendText, gateway: GatewayClient, *, owns_gateway: bool = False,
                 keepalive_s: float = KEEPALIVE_S) -> None:
        self._send_twilio = send_twilio
        self.gateway = gateway
        self._owns_gateway = owns_gateway
        # Context ids on the gateway socket: unique per bridge, so calls that share one
        # client never take each other's turns ("turn-1" is every call's first turn).
        self._context_prefix = f"{uuid.uuid4().hex[:8]}-"
        self.call: CallInfo | None = None
        self.events: asyncio.Queue[BridgeEvent] = asyncio.Queue()
        self._started = asyncio.Event()
        # One lock for every frame to Twilio, so a `clear` can never be overtaken by a
        # media frame of the turn it interrupts.
        self._send_lock = asyncio.Lock()
        self._turn: _Turn | None = None  # the latest turn
        self._turns: list[_Turn] = []  # turns that may still be audible
        self._contexts: dict[str, Context] = {}  # every turn of the call, for `gateway_events`
        self._turn_count = 0
        self._marks: dict[str, tuple[_Turn, _Segment]] = {}
        self.closed = False
        self._keepalive = asyncio.create_task(self._keep_alive(keepalive_s), name="twilio-keepalive")
        gateway._reader.add_done_callback(self._gateway_closed)

    @classmethod
    async def connect(
        cls, send_twilio: SendText, gateway_url: str, api_key: str | None = None, **settings: Any
    ) -> "TwilioBridge":
        """Open a gateway socket for one call. ``settings`` are socket defaults of the
        protocol (`voice`, `speed`, `instruction`, `language`, `segmentation`, ...)."""
        gateway = await GatewayClient.connect(gateway_url, api_key=api_key)
        try:
            await gateway.configure(**settings, **TURN_FORMAT)
        except Exception:
            await gateway.aclose()
            raise
        return cls(send_twilio, gateway, owns_gateway=True)

    # -- Twilio side -----------------------------------------------------------------

    async def handle_twilio(self, raw: str | bytes | dict[str, Any]) -> TwilioMessage:
        """Feed one message received from Twilio; returns it parsed for the agent.

        A frame that is not a JSON object comes back as event "invalid" and changes
        nothing: one garbled frame must not end the call."""
        data: Any = raw
        if not isinstance(raw, dict):
            try:
                data = json.loads(raw)
            except (ValueError, RecursionError):
                data = None
        if not isinstance(data, dict):
            return TwilioMessage("invalid", {})
        event = str(data.get("event", ""))
        payload = b""
        if event == "start":
            start = _field(data, "start")
            params = start.get("customParameters")
            self.call = CallInfo(
                stream_sid=str(data.get("streamSid") or start.get("streamSid") or ""),
                call_sid=str(start.get("callSid", "")),
                account_sid=str(start.get("accountSid", "")),
                custom_parameters=dict(params) if isinstance(params, dict) else {},
            )
            self._started.set()
        elif event == "media":
            with contextlib.suppress(ValueError, TypeError):
                payload = base64.b64decode(_field(data, "media").get("payload", ""))
        elif event == "mark":
            self._on_mark(str(_field(data, "mark").get("name", "")))
        elif event == "stop":
            await self._shutdown("stop")
        return TwilioMessage(event, data, payload)

    def _on_mark(self, name: str) -> None:
        entry = self._marks.pop(name, None)
        if entry is None:
            return  # not ours, or a mark returned by a `clear`
        turn, seg = entry
        if turn.cleared:
            return  # echoed because of a clear: it was never played
        seg.played = True
        # Not for a turn cut off (a final error, the gateway socket gone): its last mark
        # ends what was sent, not the reply.
        last = turn.completed and seg is turn.segments[-1]
        self.events.put_nowait(SegmentPlayed(turn.turn_id, seg.index, seg.text, seg.text_end, last))

    async def _send(self, message: dict[str, Any]) -> None:
        await self._send_twilio(json.dumps(message, separators=(",", ":")))

    # -- agent side: text in -------------------------------------------------------------

    @property
    def speaking(self) -> bool:
        """True while the current turn is synthesising or still playing at Twilio."""
        return self._turn is not None and self._turn.playing

    @property
    def turn_id(self) -> str | None:
        return self._turn.turn_id if self._turn is not None else None

    async def say(self, text: str, turn_id: str | None = None, **overrides: Any) -> str:
        """Append text to the current turn (opening one if needed); returns its id.

        ``overrides`` (voice, speed, instruction, ...) apply when this opens a turn.
        Raises ValueError for a `turn_id` the gateway cannot take as a context id (1..64
        characters of ``[A-Za-z0-9_.:-]`` with the bridge's prefix).
        """
        if self.closed:
            raise RuntimeError("the call has ended")
        if not self.gateway.connected:
            raise ConnectionError("the gateway connection is closed")
        turn = self._turn
        # A turn the gateway ended (a final error: an unknown voice, too many contexts) takes
        # no more text: it would be synthesised for a forwarder that is gone.
        # (`ctx.finished`: the client may know of a refusal before this turn's forwarder,
        # which waits behind the previous turn's, has read it.)
        open_now = (turn is not None and not turn.ended and not turn.cleared and not turn.finished
                    and not turn.ctx.finished)
        if turn_id is not None and turn_id in self._contexts and not (open_now and turn_id == turn.turn_id):
            # Text for a turn that was interrupted or ended (a piece in flight at a
            # barge-in): nobody wants it spoken, and its id must not open a second
            # gateway context, whose events the old turn's forwarder would never see.
            return turn_id
        if not open_now or (turn_id is not None and turn_id != turn.turn_id):
            if open_now:  # a new turn named while one is open: that one has no more text
                await self.end_turn()
            turn = self._open_turn(turn_id)
            try:
                # Pinned per turn, so a shared or differently configured client works too.
                await turn.ctx.send_text(text, **{**overrides, **TURN_FORMAT})
                turn.text += text
            except BaseException:
                # Never opened on the gateway: no audio will come, and the next turn must
                # not wait behind this one (nor get this one's text without its overrides).
                turn.ended = turn.finished = True
                if turn.forwarder is not None:
                    turn.forwarder.cancel()
                raise
        else:
            await turn.ctx.send_text(text)
            turn.text += text
        return turn.turn_id

    def _current(self, turn_id: str | None) -> _Turn | None:
        """The open turn, if `turn_id` (when given) names it: a late call for a turn that was
        interrupted must not act on the turn after it."""
        turn = self._turn
        if turn is None or turn.ended or turn.cleared or (turn_id is not None and turn_id != turn.turn_id):
            return None
        return turn

    async def flush(self, turn_id: str | None = None) -> None:
        """Speak what is buffered now (e.g. the LLM paused mid-sentence)."""
        turn = self._current(turn_id)
        if turn is not None and not turn.finished and not turn.ctx.finished:
            turn.flush_ends.append(len(turn.text))
            await turn.ctx.flush()

    async def end_turn(self, turn_id: str | None = None) -> None:
        """No more text for this turn (the open one, or only `turn_id` if that is still the
        open one): the rest is spoken and the last mark sent."""
        turn = self._current(turn_id)
        if turn is not None:
            turn.ended = True
            if not turn.finished and not turn.ctx.finished:
                await turn.ctx.end()

    async def speak(self, pieces: Any, turn_id: str | None = None, **overrides: Any) -> str:
        """Convenience: stream an (async) iterable of text pieces as one turn and end it."""
        tid: str | None = None
        if hasattr(pieces, "__aiter__"):
            async for piece in pieces:
                tid = await self.say(piece, turn_id if tid is None else tid, **overrides)
        else:
            for piece in pieces:
                tid = await self.say(piece, turn_id if tid is None else tid, **overrides)
        if tid is None:
            return ""
        await self.end_turn(tid)  # not a later turn's, if this one was interrupted meanwhile
        return tid

    async def barge_in(self) -> BargeInResult:
        """The caller interrupted: stop synthesis, empty Twilio's buffer (`clear`)."""
        turn = self._turn
        if turn is None:
            return BargeInResult(None, "", "", 0)
        audible = [t for t in self._turns if t.playing]
        # What the caller was hearing: the oldest turn still audible (a newer one may be
        # queued behind it on the line), else the latest.
        heard_turn = audible[0] if audible else turn
        was_playing = heard_turn.playing
        async with self._send_lock:
            for t in audible:
                t.cleared = True
            turn.cleared = True  # even if silent now: its late audio must not follow
            if audible and self._started.is_set() and not self.closed:
                with contextlib.suppress(Exception):
                    await self._send({"event": "clear", "streamSid": self.call.stream_sid if self.call else ""})
        for t in {id(t): t for t in [*audible, turn]}.values():
            if not t.finished:
                with contextlib.suppress(Exception):
                    await t.ctx.cancel()
        heard = "".join(s.text for s in heard_turn.segments if s.played)
        cut = next((s.text for s in heard_turn.segments if not s.played), "") if was_playing else ""
        return BargeInResult(heard_turn.turn_id, heard, cut, heard_turn.frames_sent)

    def gateway_events(self, turn_id: str) -> list[dict[str, Any]]:
        """The gateway's events of a turn so far (segment_started, done, ...), for logs."""
        ctx = self._contexts.get(turn_id)
        return list(ctx.events) if ctx is not None else []

    async def wait_turn_sent(self, timeout: float | None = None) -> None:
        """Wait until all audio of the current turn has been handed to Twilio."""
        turn = self._turn
        if turn is not None and turn.forwarder is not None:
            await asyncio.wait_for(asyncio.shield(turn.forwarder), timeout)

    async def aclose(self) -> None:
        await self._shutdown("closed")

    async def __aenter__(self) -> "TwilioBridge":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    # -- gateway side: audio out ---------------------------------------------------------

    def _open_turn(self, turn_id: str | None) -> _Turn:
        # A new turn while the last one is still synthesising: the old audio keeps its
        # place in Twilio's queue and the new turn's audio follows it (see `_forward`).
        previous = self._turn
        self._turns = [t for t in self._turns if t.playing]
        self._turn_count += 1
        tid = turn_id or f"turn-{self._turn_count}"
        turn = _Turn(tid, self.gateway.context(self._context_prefix + tid))
        self._contexts[tid] = turn.ctx
        after = previous.forwarder if previous is not None else None
        turn.forwarder = asyncio.create_task(self._forward(turn, after), name=f"twilio-{tid}")
        self._turn = turn
        self._turns.append(turn)
        return turn

    async def _forward(self, turn: _Turn, after: asyncio.Task | None) -> None:
        """Gateway frames/events of one turn -> Twilio media + marks, in order."""
        if after is not None:
            with contextlib.suppress(BaseException):
                await asyncio.shield(after)  # keep turns in order on the phone line
        try:
            async for item in turn.ctx.stream():
                if isinstance(item, bytes):
                    await self._media(turn, item)
                    continue
                kind = item.get("type")
                if kind == "segment_started":
                    offset = int(item.get("audio_offset", turn.samples_sent))
                    start = int(item.get("text_start", 0))
                    if turn.segments and turn.segments[-1].end_sample is None:
                        turn.segments[-1].end_sample = offset
                        turn.settle_text(turn.segments[-1], start)
                    turn.segments.append(_Segment(int(item["segment_index"]), str(item.get("text", "")),
                                                  int(item.get("text_end", 0)), offset, text_start=start))
                    await self._marks_due(turn)
                elif kind == "flushed":
                    k = int(item.get("flush_id", 0))
                    await self._close_open_segment(turn, text_end=turn.flush_ends[k - 1]
                                                   if 0 < k <= len(turn.flush_ends) else None)
                elif kind == "done":
                    # Finished only once the last segment's mark is out: until then its
                    # audio is sent but unmarked, and the turn must count as playing (a
                    # barge-in in between would send no `clear`).
                    await self._close_open_segment(turn, pad=True, text_end=len(turn.text))
                    turn.finished = turn.completed = True
                    last = turn.segments[-1] if turn.segments else None
                    if last is not None and last.played and not turn.cleared:
                        # Heard before the turn was known to end (a flush marked it): the
                        # whole reply was heard, which only `last` says.
                        self.events.put_nowait(SegmentPlayed(turn.turn_id, last.index, last.text, last.text_end, True))
                elif kind == "cancelled":
                    turn.finished = True
                elif kind == "error":
                    self.events.put_nowait(TurnError(turn.turn_id, str(item.get("code")), str(item.get("message"))))
        finally:
            try:
                if not turn.cleared and not self.closed:
                    # Ended without `done` (a final error, the gateway socket gone): what
                    # was sent still plays, so its last segment gets its mark too, and
                    # `speaking` stays true until Twilio says it was played.
                    with contextlib.suppress(Exception):
                        await self._close_open_segment(turn, pad=True)
            finally:
                turn.finished = True  # after the mark, as at `done`

    async def _close_open_segment(self, turn: _Turn, pad: bool = False, text_end: int | None = None) -> None:
        """A flush or the end of the turn: everything sent so far belongs to the
        segments before it, so their marks go out after the last (padded) frame.
        `text_end`: where the turn's text stood at that flush (or its end)."""
        if pad and turn.remainder:
            await self._media(turn, b"", final=True)
        for seg in turn.segments:
            if seg.end_sample is None:
                seg.end_sample = turn.samples_sent
                turn.settle_text(seg, text_end)
        await self._marks_due(turn)

    async def _media(self, turn: _Turn, payload: bytes, final: bool = False) -> None:
        # The gateway already sends exact 160-byte frames for ulaw_8000; re-framing
        # here keeps Twilio's framing exact whatever the payload sizes are.
        data = turn.remainder + payload
        if final and len(data) % FRAME_BYTES:
            data += bytes([ULAW_SILENCE]) * (FRAME_BYTES - len(data) % FRAME_BYTES)
        whole = len(data) - len(data) % FRAME_BYTES
        turn.remainder = data[whole:]
        for i in range(0, whole, FRAME_BYTES):
            frame = data[i : i + FRAME_BYTES]
            await self._started.wait()  # Twilio's streamSid is needed on every message
            async with self._send_lock:
                if turn.cleared or self.closed:
                    return
                await self._send(
                    {"event": "media", "streamSid": self.call.stream_sid if self.call else "",
                     "media": {"payload": base64.b64encode(frame).decode("ascii")}}
                )
                turn.frames_sent += 1
                turn.samples_sent += FRAME_BYTES
            await self._marks_due(turn)

    async def _marks_due(self, turn: _Turn) -> None:
        """Send the mark of every segment whose last sample has been sent."""
        for seg in turn.segments:
            if seg.marked or seg.end_sample is None or turn.samples_sent < seg.end_sample:
                continue
            async with self._send_lock:
                if turn.cleared or self.closed:
                    return
                await self._started.wait()
                name = turn.mark_name(seg)
                seg.marked = True
                self._marks[name] = (turn, seg)
                await self._send({"event": "mark", "streamSid": self.call.stream_sid if self.call else "", "mark": {"name": name}})

    async def _keep_alive(self, period_s: float) -> None:
        """The gateway closes a socket without active contexts after its idle timeout; a
        call may be silent that long (hold, a slow tool)."""
        if period_s <= 0:
            return
        while not self.closed and self.gateway.connected:
            await asyncio.sleep(period_s)
            with contextlib.suppress(Exception):
                await self.gateway.send({"type": "keepalive"})

    def _gateway_closed(self, _reader: asyncio.Task) -> None:
        if self.closed:
            return
        ws = self.gateway.ws
        self.events.put_nowait(GatewayLost(getattr(ws, "close_code", None), str(getattr(ws, "close_reason", "") or "")))

    async def _shutdown(self, reason: str) -> None:
        if self.closed:
            return
        self.closed = True
        self._keepalive.cancel()
        # A shared client's reader outlives the call: its callback would keep this bridge
        # (every turn and event of the call) alive for as long as that socket is open.
        self.gateway._reader.remove_done_callback(self._gateway_closed)
        self._started.set()  # release forwarders waiting for `start`
        # Every context of the call still open on the gateway, by the context's own state:
        # a turn whose forwarder died (a send to a broken Twilio socket) counts as finished
        # while its context still synthesises, and on a shared client nothing else ends it.
        for ctx in list(self._contexts.values()):
            if not ctx.finished:
                with contextlib.suppress(Exception):
                    await ctx.cancel()
        if self._owns_gateway:
            await self.gateway.aclose()
        for t in self._turns:
            if t.forwarder is not None:
                t.forwarder.cancel()
                with contextlib.suppress(BaseException):
                    await t.forwarder
        self.events.put_nowait(CallEnded(reason))
