"""The streaming WebSocket protocol without any I/O (see docs/protocol.md).

Two layers, both pure:

* `parse_client_message(raw, limits)` turns one client frame into a typed message or a
  `ProtocolError` (never raises);
* `ConnectionState` is the per-socket state machine: it owns the contexts' settings,
  segmenters and counters, and answers each message with a list of *commands*
  (`Send`, `StartContext`, `Speak`, `FlushMark`, `EndContext`, `CancelContext`,
  `CloseAfterDrain`, `SetStatsInterval`) that the I/O layer (`gateway.ws`) executes in
  order. This keeps every protocol rule unit-testable without a socket or an engine.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, Union

from engine.types import SPEED_RANGE  # WebSocket and HTTP speech alike, as the engine

from .audio import OPUS_RATES, PCM_RATES, AudioFormat, AudioFormatError, resolve_format
from .segmenter import MIN_MAX_CHARS, Segment, SegmentReason, Segmenter, SegmenterConfig, _is_cjk


@dataclass(frozen=True)
class WsLimits:
    """Per-socket limits and transport options of the streaming endpoint (wired into `gateway.settings`)."""

    max_message_bytes: int = field(
        default=65536,
        metadata={"help": "largest client frame; larger ones get message_too_large (over twice this, at least "
                          "+64 KiB: close 1009)"},
    )
    max_contexts: int = field(default=16, metadata={"help": "concurrently active contexts per socket"})
    max_text_chars: int = field(default=20000, metadata={"help": "total text per context"})
    max_pending_bytes: int = field(default=4 << 20, metadata={"help": "encoded audio bytes queued per socket before producers wait"})
    max_lag_s: float = field(default=10.0, metadata={"help": "close a socket (4001) whose oldest queued frame waited this long"})
    idle_timeout_s: float = field(default=300.0, metadata={"help": "close (4000) after this long without client messages or active contexts"})
    keepalive_interval_s: float = field(default=20.0, metadata={"help": "server keepalive event after this much silence (0 = off)"})
    stream_idle_s: float = field(
        default=10.0,
        metadata={"help": "stream mode: end the open streamed utterance after this long without new text (its "
                          "LM request holds a batch slot while it waits); the sentence's later words start the "
                          "next one (0 = never)"},
    )
    per_message_deflate: bool = field(
        default=False,
        metadata={"help": "accept permessage-deflate compression (off: audio does not compress, and deflating "
                          "every frame took most of the event loop's send time)"},
    )

    def __post_init__(self) -> None:
        # A 0 or negative limit would not switch a check off: it would refuse or close every
        # socket at its first frame (`not x > 0` also refuses NaN).
        for name in ("max_message_bytes", "max_contexts", "max_text_chars", "max_pending_bytes", "max_lag_s",
                     "idle_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ws.{name} must be > 0, not {getattr(self, name)}")
        for name in ("keepalive_interval_s", "stream_idle_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"ws.{name} must be >= 0 (0 = off), not {getattr(self, name)}")


# ---- close codes and error codes ------------------------------------------------------

CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001
CLOSE_POLICY = 1008
CLOSE_INTERNAL = 1011
CLOSE_SERVICE_RESTART = 1012
CLOSE_TRY_LATER = 1013
CLOSE_IDLE = 4000
CLOSE_SLOW_CONSUMER = 4001

ERROR_CODES = frozenset(
    {
        "invalid_json",
        "invalid_message",
        "unknown_type",
        "binary_not_supported",
        "message_too_large",
        "unsupported_format",
        "invalid_speed",
        "voice_not_found",
        "voice_store_unavailable",
        "too_many_contexts",
        "text_too_long",
        "context_exists",
        "context_ended",
        "synthesis_failed",
        "not_ready",
        "too_many_sessions",
        "unauthorized",
        "internal_error",
        "engine_failed",
    }
)


@dataclass(frozen=True)
class ProtocolError:
    code: str
    message: str
    context_id: str | None = None

    def event(self) -> dict[str, Any]:
        ev: dict[str, Any] = {"type": "error", "code": self.code, "message": self.message}
        if self.context_id is not None:
            ev["context_id"] = self.context_id
        return ev


# ---- settings -------------------------------------------------------------------------

Mode = Literal["zero_shot", "instruct", "cross_lingual"]
MODES = ("zero_shot", "instruct", "cross_lingual")
# How a context's text reaches the LM: "segment" waits for each segment (sentence) and
# speaks it as one request; "stream" feeds text to the LM as it arrives (bistream),
# the segmenter only deciding where one LM request ends and the next begins.
TextMode = Literal["segment", "stream"]
TEXT_MODES = ("segment", "stream")
TRANSPORTS = ("binary", "base64")
MAX_INSTRUCTION_CHARS = 500
# Every rate some format allows lies within this; the exact check is `resolve_format`'s.
SAMPLE_RATE_RANGE = (min(PCM_RATES + OPUS_RATES), max(PCM_RATES + OPUS_RATES))
# A segment is one LM request: lengths past this are no tuning, only a way to send
# numbers that later arithmetic cannot take.
MAX_SEGMENT_CHARS = 100_000
# Client strings quoted back in errors (a bad id, an unknown type or voice) are cut to
# this, so a refusal never costs the server as much as the frame that caused it.
MAX_ECHO_CHARS = 128
_CONTEXT_ID = re.compile(r"^[A-Za-z0-9_.:\-]{1,64}$")
# A `"context_id": "..."` pair in a frame too large to parse, so that its refusal names the
# context whose text it held. Quotes inside a JSON string are escaped: an unescaped one
# starts a key or a value, not a piece of text.
_CONTEXT_ID_FIELD = re.compile(r'(?<!\\)"context_id"\s*:\s*"([A-Za-z0-9_.:\-]{1,64})"')


@dataclass(frozen=True)
class SegmentationPatch:
    """The `segmentation` fields a message sets (None = unset): laid over the socket's
    settings field by field, so a context that sets `max_chars` keeps the socket's
    `first_min_chars`."""

    first_min_chars: int | None = None
    min_chars: int | None = None
    max_chars: int | None = None
    eager_ends: bool | None = None

    def over(self, base: SegmenterConfig) -> SegmenterConfig:
        """`base` with this patch's fields; ValueError when the result is inconsistent."""
        return replace(base, **{f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not None})


@dataclass(frozen=True)
class SettingsPatch:
    """Fields a client may set in `config`, `open` or a context's first `text`; None = unset."""

    voice: str | None = None
    mode: str | None = None
    instruction: str | None = None
    speed: float | None = None
    language: str | None = None
    format: str | None = None
    sample_rate: int | None = None
    audio: str | None = None
    segmentation: SegmentationPatch | None = None
    text_mode: str | None = None

    def is_empty(self) -> bool:
        return all(getattr(self, f.name) is None for f in fields(self))


@dataclass(frozen=True)
class ContextSettings:
    """Fully resolved settings of one context (or the socket defaults)."""

    voice: str
    mode: Mode | None = None  # None: instruct when an instruction is set, else zero_shot
    instruction: str | None = None
    speed: float = 1.0
    language: str | None = None
    format: AudioFormat = AudioFormat("pcm_s16le", 24000)
    audio: str = "binary"
    segmentation: SegmenterConfig = SegmenterConfig()
    text_mode: TextMode = "segment"

    @property
    def effective_mode(self) -> Mode:
        if self.mode is not None:
            return self.mode
        return "instruct" if self.instruction else "zero_shot"

    def apply(self, patch: SettingsPatch) -> "ContextSettings | ProtocolError":
        """These settings overridden by ``patch``, validated as a whole."""
        fmt, segmentation = self.format, self.segmentation
        if patch.segmentation is not None:
            try:
                segmentation = patch.segmentation.over(segmentation)
            except ValueError as exc:
                return ProtocolError("invalid_message", f"segmentation: {exc}")
        if patch.format is not None or patch.sample_rate is not None:
            # A new format without a rate takes that format's default rate.
            name = patch.format or fmt.name
            rate = patch.sample_rate if patch.sample_rate is not None else (None if patch.format else fmt.sample_rate)
            try:
                fmt = resolve_format(name, rate)
            except AudioFormatError as exc:
                return ProtocolError("unsupported_format", str(exc))
        out = replace(
            self,
            voice=patch.voice if patch.voice is not None else self.voice,
            mode=patch.mode if patch.mode is not None else self.mode,  # type: ignore[arg-type]
            instruction=patch.instruction if patch.instruction is not None else self.instruction,
            speed=patch.speed if patch.speed is not None else self.speed,
            language=patch.language if patch.language is not None else self.language,
            format=fmt,
            audio=patch.audio if patch.audio is not None else self.audio,
            segmentation=segmentation,
            text_mode=patch.text_mode if patch.text_mode is not None else self.text_mode,  # type: ignore[arg-type]
        )
        if out.effective_mode == "instruct" and not out.instruction:
            return ProtocolError("invalid_message", "mode 'instruct' needs an instruction")
        return out

    def describe(self) -> dict[str, Any]:
        return {
            "voice": self.voice,
            "mode": self.effective_mode,
            "instruction": self.instruction,
            "speed": self.speed,
            "language": self.language,
            "format": self.format.name,
            "sample_rate": self.format.sample_rate,
            "audio": self.audio,
            "text_mode": self.text_mode,
        }


# ---- client messages ------------------------------------------------------------------


@dataclass(frozen=True)
class ConfigMessage:
    patch: SettingsPatch
    stats_interval_ms: int | None = None


@dataclass(frozen=True)
class OpenMessage:
    context_id: str
    patch: SettingsPatch


@dataclass(frozen=True)
class TextMessage:
    context_id: str
    text: str
    patch: SettingsPatch = SettingsPatch()
    flush: bool = False
    end: bool = False


@dataclass(frozen=True)
class FlushMessage:
    context_id: str


@dataclass(frozen=True)
class EndMessage:
    context_id: str


@dataclass(frozen=True)
class CancelMessage:
    context_id: str | None  # None = every context


@dataclass(frozen=True)
class KeepaliveMessage:
    pass


@dataclass(frozen=True)
class CloseMessage:
    pass


ClientMessage = Union[
    ConfigMessage, OpenMessage, TextMessage, FlushMessage, EndMessage, CancelMessage, KeepaliveMessage, CloseMessage
]


class _Invalid(Exception):
    """Internal: a validation failure while parsing (converted to ProtocolError)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def _opt(obj: dict[str, Any], key: str, kind: type | tuple[type, ...], what: str) -> Any:
    value = obj.get(key)
    if value is None:
        return None
    # bool is an int subclass: never accept true as a number.
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise _Invalid("invalid_message", f"'{key}' must be {what}")
    if not isinstance(value, kind):
        raise _Invalid("invalid_message", f"'{key}' must be {what}")
    return value


def echo(value: str) -> str:
    """A client-supplied string as quoted back in an error event."""
    return value[:MAX_ECHO_CHARS]


def _number(obj: dict[str, Any], key: str, lo: float, hi: float, code: str = "invalid_message",
            integer: bool = False) -> int | float | None:
    """An optional numeric field within [lo, hi].

    Compared as given, never through float(): float() of a 400-digit integer raises
    OverflowError, and NaN/Infinity (which Python's JSON reader accepts) fail every
    comparison, so the range test also rejects non-finite values.
    """
    value = _opt(obj, key, int if integer else (int, float), "an integer" if integer else "a number")
    if value is not None and not lo <= value <= hi:
        raise _Invalid(code, f"'{key}' must be within {lo}..{hi}")
    return value


def _parse_segmentation(obj: Any) -> SegmentationPatch | None:
    """Each field's own range here; whether they fit together is known only over the
    settings they are laid on (`ContextSettings.apply`)."""
    if obj is None:
        return None
    if not isinstance(obj, dict):
        raise _Invalid("invalid_message", "'segmentation' must be an object")
    counts = {name: _number(obj, name, lo, MAX_SEGMENT_CHARS, integer=True)
              for name, lo in (("first_min_chars", 0), ("min_chars", 0), ("max_chars", MIN_MAX_CHARS))}
    return SegmentationPatch(**counts, eager_ends=_opt(obj, "eager_ends", bool, "a boolean"))


_PATCH_KEYS = frozenset(f.name for f in fields(SettingsPatch))  # the JSON keys are the field names
_NO_PATCH = SettingsPatch()


def _parse_patch(obj: dict[str, Any]) -> SettingsPatch:
    if _PATCH_KEYS.isdisjoint(obj):
        return _NO_PATCH  # the common case: a text message carrying text only
    voice = _opt(obj, "voice", str, "a string")
    if voice is not None and not voice:
        raise _Invalid("invalid_message", "'voice' must not be empty")
    mode = _opt(obj, "mode", str, "a string")
    if mode is not None and mode not in MODES:
        raise _Invalid("invalid_message", f"'mode' must be one of {', '.join(MODES)}")
    instruction = _opt(obj, "instruction", str, "a string")
    if instruction is not None and len(instruction) > MAX_INSTRUCTION_CHARS:
        raise _Invalid("invalid_message", f"'instruction' longer than {MAX_INSTRUCTION_CHARS} characters")
    if instruction is not None and not instruction.strip():
        # No instruction, as over HTTP: accepted as one, it failed every segment later
        # (`synthesis_failed` `bad_options`) instead of the open.
        instruction = ""
    speed = _number(obj, "speed", *SPEED_RANGE, code="invalid_speed")
    language = _opt(obj, "language", str, "a string")
    if language is not None and len(language) > 16:
        raise _Invalid("invalid_message", "'language' is at most 16 characters")
    fmt = _opt(obj, "format", str, "a string")
    rate = _number(obj, "sample_rate", *SAMPLE_RATE_RANGE, code="unsupported_format", integer=True)
    if fmt is not None or rate is not None:
        try:  # validate now so the error names the message that was wrong
            resolve_format(fmt or "pcm_s16le", rate) if fmt is not None else None
        except AudioFormatError as exc:
            raise _Invalid("unsupported_format", str(exc)) from None
    audio = _opt(obj, "audio", str, "a string")
    if audio is not None and audio not in TRANSPORTS:
        raise _Invalid("invalid_message", "'audio' must be 'binary' or 'base64'")
    text_mode = _opt(obj, "text_mode", str, "a string")
    if text_mode is not None and text_mode not in TEXT_MODES:
        raise _Invalid("invalid_message", "'text_mode' must be 'segment' or 'stream'")
    return SettingsPatch(
        text_mode=text_mode,
        voice=voice,
        mode=mode,
        instruction=instruction,
        speed=float(speed) if speed is not None else None,
        language=language,
        format=fmt,
        sample_rate=rate,
        audio=audio,
        segmentation=_parse_segmentation(obj.get("segmentation")),
    )


def _context_id(obj: dict[str, Any], required: bool = True) -> str | None:
    cid = obj.get("context_id")
    if cid is None and not required:
        return None
    if not isinstance(cid, str) or not _CONTEXT_ID.match(cid):
        raise _Invalid("invalid_message", "'context_id' must be 1..64 characters of [A-Za-z0-9_.:-]")
    return cid


def _flag(obj: dict[str, Any], key: str) -> bool:
    v = obj.get(key, False)
    if not isinstance(v, bool):
        raise _Invalid("invalid_message", f"'{key}' must be a boolean")
    return v


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _is_unicode(obj: Any) -> bool:
    """True when every string in ``obj`` is encodable as UTF-8 (no lone surrogates).

    Walked with a list, not recursively: an object nested as deep as `json.loads` just took
    made a recursive walk (`json.dumps`, a call deeper) raise RecursionError."""
    todo = [obj]
    while todo:
        item = todo.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return False
        elif isinstance(item, dict):
            todo.extend(item)  # the keys
            todo.extend(item.values())
        elif isinstance(item, list):
            todo.extend(item)
    return True


def parse_client_message(raw: str | bytes, limits: WsLimits) -> ClientMessage | ProtocolError:
    """Parse and validate one client frame. Never raises."""
    if isinstance(raw, bytes):
        return ProtocolError("binary_not_supported", "send JSON text frames; binary frames are not accepted")
    # len(str) <= len(utf8): only encode when the cheap bound cannot decide.
    if len(raw) > limits.max_message_bytes or (
        len(raw) * 4 > limits.max_message_bytes and len(raw.encode("utf-8", "surrogatepass")) > limits.max_message_bytes
    ):
        found = _CONTEXT_ID_FIELD.search(raw)
        return ProtocolError("message_too_large", f"message over {limits.max_message_bytes} bytes",
                             found.group(1) if found else None)
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):
        return ProtocolError("invalid_json", "message is not valid JSON")
    if not isinstance(obj, dict):
        return ProtocolError("invalid_json", "message must be a JSON object")
    if _SURROGATE_ESCAPE.search(raw) and not _is_unicode(obj):
        # "\ud800" is legal JSON but not text: it would fail the tokenizer and any echo.
        return ProtocolError("invalid_message", "message contains a lone surrogate, which is not valid Unicode text")
    cid_hint = echo(obj["context_id"]) if isinstance(obj.get("context_id"), str) else None
    try:
        return _parse_object(obj)
    except _Invalid as exc:
        return ProtocolError(exc.code, str(exc), cid_hint)


def _parse_object(obj: dict[str, Any]) -> ClientMessage:
    kind = obj.get("type")
    if not isinstance(kind, str):
        raise _Invalid("invalid_message", "'type' (string) is required")
    if kind == "text":
        cid = _context_id(obj)
        text = obj.get("text")
        if not isinstance(text, str):
            raise _Invalid("invalid_message", "'text' must be a string")
        return TextMessage(cid, text, _parse_patch(obj), _flag(obj, "flush"), _flag(obj, "end"))  # type: ignore[arg-type]
    if kind == "flush":
        return FlushMessage(_context_id(obj))  # type: ignore[arg-type]
    if kind == "end":
        return EndMessage(_context_id(obj))  # type: ignore[arg-type]
    if kind == "cancel":
        if obj.get("context_id") == "*":
            return CancelMessage(None)
        return CancelMessage(_context_id(obj, required=False))
    if kind == "open":
        return OpenMessage(_context_id(obj), _parse_patch(obj))  # type: ignore[arg-type]
    if kind == "config":
        interval = _opt(obj, "stats_interval_ms", int, "an integer")
        if interval is not None and interval != 0 and not 100 <= interval <= 3_600_000:
            raise _Invalid("invalid_message", "'stats_interval_ms' must be 0 or 100..3600000")
        return ConfigMessage(_parse_patch(obj), interval)
    if kind == "keepalive":
        return KeepaliveMessage()
    if kind == "close":
        return CloseMessage()
    raise _Invalid("unknown_type", f"unknown message type {echo(kind)!r}")


# ---- commands for the I/O layer -------------------------------------------------------


@dataclass(frozen=True)
class Send:
    """Send this JSON event."""

    event: dict[str, Any]


@dataclass(frozen=True)
class StartContext:
    """Resolve the voice, open an engine session, then send `context_started`."""

    context_id: str
    settings: ContextSettings


@dataclass(frozen=True)
class Speak:
    """Submit these segments (in order) to the context's engine session."""

    context_id: str
    segments: tuple[Segment, ...]


@dataclass(frozen=True)
class StreamText:
    """Stream mode: append `text` (context offset `start`) to streamed utterance
    `index` of the context, opening it first if needed; `close` ends its text."""

    context_id: str
    index: int
    start: int
    text: str
    close: bool = False
    reason: str = "stream"  # the segmenter's reason when closing at a segment end


@dataclass(frozen=True)
class FlushMark:
    """Send `flushed` once everything spoken before it has been delivered."""

    context_id: str
    flush_id: int


@dataclass(frozen=True)
class EndContext:
    """No more text: send `done` after the context's last audio."""

    context_id: str


@dataclass(frozen=True)
class CancelContext:
    """Stop the context now (engine abort, drop queued frames) and send `cancelled`."""

    context_id: str


@dataclass(frozen=True)
class CloseAfterDrain:
    """Close the socket with 1000 once every context has finished."""


@dataclass(frozen=True)
class SetStatsInterval:
    interval_ms: int


Command = Union[
    Send, StartContext, Speak, StreamText, FlushMark, EndContext, CancelContext, CloseAfterDrain, SetStatsInterval
]


def _word_end(text: str) -> int:
    """Where the complete words of `text` end (<= 0: none yet): at its last whitespace, or
    after its last CJK character, which is a word of its own for this purpose: Chinese
    and Japanese put no spaces between words, and waiting for a mark would hold a whole
    sentence back from the LM."""
    space = max(text.rfind(c) for c in (" ", "\n", "\t", "\r"))
    for i in range(len(text) - 1, space, -1):
        if _is_cjk(text[i]):
            return i + 1
    return space


@dataclass
class StreamCutter:
    """Stream mode: which characters go to which streamed utterance (pure).

    Text is handed out as soon as a word is complete (`_word_end`), so the LM reads it
    at once. The segmenter's segments still end utterances; since a
    forced cut (an over-long sentence cut back at a clause mark) may fall before text
    already handed out, an utterance ends at the later of the two -- always on a word
    boundary -- and text the previous utterance already took is not given out twice.
    """

    fed: int = 0  # context characters handed out so far
    index: int = 0  # the open (or next) utterance
    open: bool = False

    def advance(self, cid: str, text: str, segments: list[Segment], final: bool = False) -> list[StreamText]:
        out: list[StreamText] = []
        for seg in segments:
            end = max(seg.end, self.fed)
            piece = text[self.fed : end]
            if self.open or any(ch.isalnum() for ch in piece):
                out.append(StreamText(cid, self.index, self.fed, piece, close=True, reason=seg.reason))
                self.index += 1
                self.open = False
            self.fed = end
        rest = text[self.fed :]
        if final:
            if self.open:  # flush/end with only whitespace left: close what is open
                out.append(StreamText(cid, self.index, self.fed, rest, close=True, reason="flush"))
                self.index += 1
                self.open = False
            self.fed = len(text)
            return out
        cut = _word_end(rest)
        if cut > 0 and any(ch.isalnum() for ch in rest[:cut]):
            out.append(StreamText(cid, self.index, self.fed, rest[:cut]))
            self.open = True
            self.fed += cut
        return out

    def close_open(self, cid: str, reason: SegmentReason) -> list[StreamText]:
        """End the open utterance where the text handed out ends (its client went quiet
        mid-sentence); the rest of the sentence opens the next one when it comes."""
        if not self.open:
            return []
        self.open = False
        self.index += 1
        return [StreamText(cid, self.index - 1, self.fed, "", close=True, reason=reason)]


@dataclass
class ContextState:
    """Protocol-side state of one context (the audio side lives in gateway.ws_context and
    gateway.ws_pump)."""

    context_id: str
    settings: ContextSettings
    segmenter: Segmenter
    text_chars: int = 0
    flushes: int = 0
    ended: bool = False
    text: str = ""  # stream mode: the context's text so far
    cutter: StreamCutter | None = None  # stream mode only

    def speak(self, segments: list[Segment], final: bool = False) -> list[Command]:
        """Commands that voice these new segments (and, in stream mode, new words)."""
        if self.cutter is not None:
            return list(self.cutter.advance(self.context_id, self.text, segments, final))
        return [Speak(self.context_id, tuple(segments))] if segments else []


class ConnectionState:
    """Per-socket protocol state machine. `handle(msg)` -> commands to execute in order."""

    def __init__(self, defaults: ContextSettings, limits: WsLimits) -> None:
        self.defaults = defaults
        self.limits = limits
        self.contexts: dict[str, ContextState] = {}
        self.closing = False

    # -- entry points ------------------------------------------------------------------

    def handle(self, msg: ClientMessage | ProtocolError) -> list[Command]:
        if isinstance(msg, ProtocolError):
            return [Send(msg.event())]
        if self.closing and not isinstance(msg, (KeepaliveMessage, CancelMessage, CloseMessage)):
            return [Send(ProtocolError("invalid_message", "socket is closing").event())]
        if isinstance(msg, ConfigMessage):
            return self._config(msg)
        if isinstance(msg, OpenMessage):
            if msg.context_id in self.contexts:
                return [Send(ProtocolError("context_exists", "context already active", msg.context_id).event())]
            return self._open(msg.context_id, msg.patch)[1]
        if isinstance(msg, TextMessage):
            return self._text(msg)
        if isinstance(msg, FlushMessage):
            return self._flush(msg.context_id)
        if isinstance(msg, EndMessage):
            return self._end(msg.context_id)
        if isinstance(msg, CancelMessage):
            return self._cancel(msg.context_id)
        if isinstance(msg, CloseMessage):
            self.closing = True
            out: list[Command] = []
            for cid in list(self.contexts):
                if not self.contexts[cid].ended:
                    out += self._end(cid)
            return out + [CloseAfterDrain()]
        return []  # keepalive

    def stream_idle(self, context_id: str) -> list[Command]:
        """The I/O layer reports that a stream-mode context's open utterance got no text
        for `stream_idle_s`: end that utterance (its words so far are spoken)."""
        ctx = self.contexts.get(context_id)
        if ctx is None or ctx.ended or ctx.cutter is None:
            return []
        return list(ctx.cutter.close_open(context_id, "idle"))

    def context_finished(self, context_id: str) -> None:
        """The I/O layer reports that a context is over (done, cancelled or failed to start)."""
        self.contexts.pop(context_id, None)

    # -- handlers ----------------------------------------------------------------------

    def _config(self, msg: ConfigMessage) -> list[Command]:
        resolved = self.defaults.apply(msg.patch)
        if isinstance(resolved, ProtocolError):
            return [Send(resolved.event())]
        self.defaults = resolved
        return [SetStatsInterval(msg.stats_interval_ms)] if msg.stats_interval_ms is not None else []

    def _open(self, cid: str, patch: SettingsPatch) -> tuple[ContextState | None, list[Command]]:
        if len(self.contexts) >= self.limits.max_contexts:
            return None, [Send(ProtocolError("too_many_contexts", f"at most {self.limits.max_contexts} active contexts", cid).event())]
        resolved = self.defaults.apply(patch)
        if isinstance(resolved, ProtocolError):
            return None, [Send(replace(resolved, context_id=cid).event())]
        ctx = ContextState(cid, resolved, Segmenter(resolved.segmentation))
        if resolved.text_mode == "stream":
            ctx.cutter = StreamCutter()
        self.contexts[cid] = ctx
        return ctx, [StartContext(cid, resolved)]

    def _text(self, msg: TextMessage) -> list[Command]:
        out: list[Command] = []
        ctx = self.contexts.get(msg.context_id)
        if ctx is None:
            ctx, out = self._open(msg.context_id, msg.patch)
            if ctx is None:
                return out
        if ctx.ended:
            return [Send(ProtocolError("context_ended", "context already ended", ctx.context_id).event())]
        if ctx.text_chars + len(msg.text) > self.limits.max_text_chars:
            # The text is refused, but the message's end or flush still applies: dropping it
            # would leave the text before it unspoken and the client waiting for `done`.
            out.append(Send(ProtocolError(
                "text_too_long", f"context text over {self.limits.max_text_chars} characters: this message's "
                "text was not taken", ctx.context_id).event()))
        else:
            ctx.text_chars += len(msg.text)
            if ctx.cutter is not None:
                ctx.text += msg.text
            segs = ctx.segmenter.push(msg.text) if msg.text else []
            out += ctx.speak(segs)
        if msg.end:
            out += self._end(ctx.context_id)
        elif msg.flush:
            out += self._flush(ctx.context_id)
        return out

    def _flush(self, cid: str) -> list[Command]:
        ctx = self.contexts.get(cid)
        if ctx is None:
            # Nothing buffered for an unknown context: acknowledge at once (idempotent).
            return [Send({"type": "flushed", "context_id": cid, "flush_id": 0})]
        if ctx.ended:
            return [Send(ProtocolError("context_ended", "context already ended", cid).event())]
        out: list[Command] = ctx.speak(ctx.segmenter.flush(), final=True)
        ctx.flushes += 1
        out.append(FlushMark(cid, ctx.flushes))
        return out

    def _end(self, cid: str) -> list[Command]:
        ctx = self.contexts.get(cid)
        if ctx is None:
            return [Send(ProtocolError("invalid_message", "unknown context", cid).event())]
        if ctx.ended:
            return []
        out: list[Command] = ctx.speak(ctx.segmenter.end(), final=True)
        ctx.ended = True
        out.append(EndContext(cid))
        return out

    def _cancel(self, cid: str | None) -> list[Command]:
        if cid is None:
            return [CancelContext(c) for c in list(self.contexts)]
        if cid not in self.contexts:
            return [Send({"type": "cancelled", "context_id": cid, "active": False, "audio_samples": 0, "text_end": 0, "segments_started": 0})]
        return [CancelContext(cid)]
