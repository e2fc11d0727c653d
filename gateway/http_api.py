"""HTTP routes: OpenAI-compatible speech, voices, models, health/ready and metrics.

Handlers read everything shared from ``request.app.state.gw``, an object with
``engine``, ``voices`` (`VoiceStore`), ``settings``, ``metrics`` (`Metrics`) and
``auth`` (`Auth`). Per-request state stays in the handler (its engine session, its
encoder), so concurrent requests never share anything mutable but those objects.

Every handler goes through `_endpoint`, which checks the API key, turns `ApiError`
into the JSON error shape and counts the request, so the routes behave the same in
any app that mounts `routes`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import math
import re
import time
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any, AsyncIterator, Awaitable, Callable

import anyio
import numpy as np
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from engine.types import AudioChunk, SessionOptions, UtteranceError, VoicePrompt
from gateway.audio_files import (
    MEDIA_TYPES,
    AvEncoder,
    RESPONSE_FORMATS,
    bounded_stream,
    make_encoder,
    read_body_bounded,
)
from gateway.errors import ApiError, ReportedError, error_response, not_ready_reason, unhandled_error_handler
from gateway.protocol import MAX_INSTRUCTION_CHARS, SPEED_RANGE, echo
from gateway.segmenter import Segmenter
from gateway.voices import VoiceLimits

log = logging.getLogger(__name__)

# OpenAI's built-in voice names: stock clients send these; with a configured default
# voice they are served by it instead of failing.
OPENAI_VOICES: frozenset[str] = frozenset({
    "alloy", "ash", "ballad", "coral", "echo", "fable", "onyx", "nova", "sage",
    "shimmer", "verse", "marin", "cedar",
})
DEFAULT_ALIASES: tuple[str, ...] = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts", "cosyvoice3")
# A pinned snapshot of a served name ("gpt-4o-mini-tts-2025-12-15", "tts-1-1106"), which
# OpenAI's documentation and clients name as often as the name itself.
_SNAPSHOT = re.compile(r"-(?:\d{4}-\d{2}-\d{2}|\d{4})")
MAX_JSON_BYTES = 256 * 1024  # a speech request is 4096 characters of text plus a few fields
MAX_SEED = 2**63 - 1  # the widest seed every backend's torch.Generator takes


# Bodies and fields from this size on are parsed and decoded in a thread (`_json_body`).
OFF_LOOP_BYTES = 256 << 10


async def _off_loop_if_large(size: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    if size < OFF_LOOP_BYTES:
        return fn(*args, **kwargs)
    return await asyncio.to_thread(fn, *args, **kwargs)


def speech_body_limit(max_input_chars: int) -> int:
    """The largest JSON speech request read: room for `max_input_chars` characters each
    spelt as the longest JSON escape (a surrogate pair, 12 bytes) and the other fields, so
    an input within the configured limit is never refused for its bytes first."""
    return max(MAX_JSON_BYTES, 12 * max_input_chars + 64 * 1024)


# --------------------------------------------------------------------------------------
# Plumbing
# --------------------------------------------------------------------------------------


def _gw(request: Request) -> Any:
    return request.app.state.gw


def _setting(request: Request, name: str, default: Any) -> Any:
    return getattr(_gw(request).settings, name, default)


def _limits(request: Request) -> VoiceLimits:
    return _setting(request, "voices", None) or VoiceLimits()


Handler = Callable[[Request], Awaitable[Response]]


def _endpoint(route_name: str, *, open_route: bool = False) -> Callable[[Handler], Handler]:
    def wrap(fn: Handler) -> Handler:
        async def handler(request: Request) -> Response:
            gw = _gw(request)
            try:
                auth = getattr(gw, "auth", None)
                if not open_route and auth is not None and not auth.check_request(request):
                    raise ApiError(401, "unauthorized", "missing or invalid API key")
                response = await fn(request)
            except ApiError as exc:
                if gw.metrics is not None:
                    gw.metrics.error(exc.code)
                headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else {}
                if exc.status == 413:
                    # The rest of an oversized body is still on the wire: hang up rather
                    # than let the server drain it.
                    headers["Connection"] = "close"
                response = error_response(exc.status, exc.code, exc.message, headers or None)
            except ClientDisconnect:
                # The client hung up while its body was still coming: no bug of ours and
                # nobody to answer; counted as a client that left (499), not a 500.
                log.info("%s: client disconnected before its request body was read", route_name)
                response = Response(status_code=CLIENT_CLOSED_REQUEST)
            except Exception as exc:  # a bug: the same 500 as the app's last resort, but counted per route
                response = await unhandled_error_handler(request, exc)
            if gw.metrics is not None:
                gw.metrics.observe_request(route_name, response.status_code)
            return response

        handler.__name__ = fn.__name__
        handler.__doc__ = fn.__doc__
        return handler

    return wrap


async def _json_body(request: Request, limit: int, too_large: str = "request_too_large") -> dict[str, Any]:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, too_large, f"request body exceeds {limit} bytes")
    try:
        raw = await read_body_bounded(request.stream(), limit)
    except ApiError as exc:
        raise ApiError(413, too_large, exc.message) from exc
    # A voice upload's body is up to ~27 MB of base64: parsing and checking it held the event
    # loop (every stream's audio) ~100 ms per 20 MB; large bodies go to a thread.
    return await _off_loop_if_large(len(raw), _parse_json_object, raw)


def _parse_json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        # ValueError: malformed JSON, bad UTF-8, or an integer past Python's digit limit;
        # RecursionError: arrays nested thousands deep (both fit in a small body).
        raise ApiError(400, "invalid_request", f"body is not valid JSON: {exc.__class__.__name__}: "
                       f"{str(exc)[:200]}") from exc
    if not isinstance(body, dict):
        raise ApiError(400, "invalid_request", "body must be a JSON object")
    try:
        # JSON escapes can spell lone UTF-16 surrogates ("\ud800"): not text, and they
        # would fail later wherever the string is encoded (SQLite, tokenizer, responses).
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(400, "invalid_request", "body contains a lone surrogate, which is not valid Unicode text") from exc
    return body


# --------------------------------------------------------------------------------------
# Health, readiness, metrics, models
# --------------------------------------------------------------------------------------


@_endpoint("/health", open_route=True)
async def health(request: Request) -> Response:
    """Liveness: the process serves HTTP and its engine has not failed for good (a dead or
    stalled stage process, a dead vLLM engine core: nothing in this process brings them
    back, so a liveness probe should restart it). Loading and draining are alive."""
    failure = getattr(getattr(_gw(request), "engine", None), "failure", None)
    if failure is not None:
        raise ApiError(503, "engine_failed", f"the engine can serve no more: {failure}")
    return JSONResponse({"status": "ok"})


@_endpoint("/ready")
async def ready(request: Request) -> Response:
    """Readiness: the model is loaded and warmed (load balancers route on this)."""
    gw = _gw(request)
    _require_ready(gw)
    return JSONResponse({"status": "ready", "model": gw.engine.model_name})


def _require_ready(gw: Any) -> None:
    """503 `not_ready` with the real reason (a failed engine, a drain, the model's load)."""
    if gw.engine is None or not getattr(gw.engine, "ready", False):
        raise ApiError(503, "not_ready", not_ready_reason(gw))


@_endpoint("/metrics")
async def metrics(request: Request) -> Response:
    gw = _gw(request)
    stats = gw.engine.stats() if gw.engine is not None and hasattr(gw.engine, "stats") else None
    text = gw.metrics.render(stats)
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")


def _planning_engine(request: Request) -> Any:
    """The engine (or pool) whose first-chunk planners `/debug/planner` shows and tunes."""
    engine = _gw(request).engine
    if engine is None:
        raise ApiError(503, "not_ready", "model is loading")
    if getattr(engine, "planner_state", None) is None or getattr(engine, "tune_planner", None) is None:
        raise ApiError(404, "not_available", "this engine has no first-chunk planner")
    return engine


@_endpoint("/debug/planner")
async def planner(request: Request) -> Response:
    """The first-chunk planner's learnt inputs: the stage's round times per size of batch
    and the LM rates per number of utterances decoding (`Engine.planner_state`)."""
    return JSONResponse(_planning_engine(request).planner_state())


@_endpoint("/debug/planner")
async def tune_planner(request: Request) -> Response:
    """Set first-chunk planner knobs while serving (`FirstChunkPlanner.tune`), with
    `debug_tuning` on only: a benchmark alternates settings level by level on one gateway.
    Answers the planner's state as GET does."""
    if not _setting(request, "debug_tuning", False):
        raise ApiError(403, "tuning_off", "live tuning is off (start the gateway with --debug-tuning true)")
    engine = _planning_engine(request)
    knobs = await _json_body(request, MAX_JSON_BYTES)
    try:
        engine.tune_planner(knobs)
    except ValueError as exc:
        raise ApiError(400, "invalid_request", str(exc)) from exc
    return JSONResponse(engine.planner_state())


def serves_model(model: str, aliases: tuple[str, ...]) -> bool:
    """Whether `model` is a served name, or a dated snapshot of one."""
    return model in aliases or any(model.startswith(a) and _SNAPSHOT.fullmatch(model, len(a)) for a in aliases)


def model_aliases(request: Request) -> tuple[str, ...]:
    aliases = tuple(_setting(request, "openai_model_aliases", DEFAULT_ALIASES))
    name = getattr(_gw(request).engine, "model_name", None)
    return aliases + ((name,) if name and name not in aliases else ())


def _model_json(model_id: str) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "cosyvoice-gateway"}


@_endpoint("/v1/models")
async def list_models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [_model_json(m) for m in model_aliases(request)]})


@_endpoint("/v1/models/{model}")
async def get_model(request: Request) -> Response:
    model_id = request.path_params["model"]
    if not serves_model(model_id, model_aliases(request)):
        raise ApiError(404, "model_not_found", f"model {echo(model_id)!r} does not exist")
    return JSONResponse(_model_json(model_id))


# --------------------------------------------------------------------------------------
# Voices
# --------------------------------------------------------------------------------------

_AUDIO_FIELDS = ("file", "audio", "ref_audio")
_TEXT_FIELDS = ("transcript", "text", "ref_text", "prompt_text")
_ID_FIELDS = ("id", "voice_id")


def _first(form: Any, names: tuple[str, ...]) -> Any:
    for name in names:
        value = form.get(name)
        # An empty file part (a browser's file input left empty) is as empty as "".
        if value is not None and value != "" and not (isinstance(value, UploadFile) and value.size == 0):
            return value
    return None


def _opt_str(value: Any, field: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise ApiError(400, "invalid_request", f"{field} must be a string")
    try:
        # A multipart body's `charset` decodes its fields, and UTF-7 spells lone surrogates
        # ("+2AA-"): refused as in JSON bodies, before they fail in SQLite after featurising.
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(400, "invalid_request",
                       f"{field} contains a lone surrogate, which is not valid Unicode text") from exc
    return value


@_endpoint("/v1/voices")
async def create_voice(request: Request) -> Response:
    """Register a voice from multipart (file + transcript) or JSON (base64 audio)."""
    gw = _gw(request)
    # A drain waits for registrations under way: one begun during it would hold the
    # shutdown back (a new prompt width's graph captures take a minute on a GPU), and its
    # client can register with a replica that stays.
    _require_ready(gw)
    limits = _limits(request)
    if gw.registrations >= limits.max_concurrent_registrations:  # before any of the body is read
        raise ApiError(429, "too_many_registrations",
                       f"{gw.registrations} voice registrations are in progress, the most this gateway runs at "
                       "once (voices.max_concurrent_registrations); try again shortly")
    gw.registrations += 1
    try:
        return await _create_voice(request, gw.voices, limits)
    finally:
        gw.registrations -= 1


async def _create_voice(request: Request, store: Any, limits: VoiceLimits) -> Response:
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    overhead = 64 * 1024  # multipart boundaries and text fields
    if ctype == "multipart/form-data":
        limit = limits.max_upload_bytes + overhead
    elif ctype in ("application/json", ""):
        limit = math.ceil(limits.max_upload_bytes * 4 / 3) + overhead
    else:
        raise ApiError(400, "invalid_request", "use multipart/form-data or application/json")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, "audio_too_large", f"upload exceeds {limits.max_upload_bytes} bytes")

    if ctype == "multipart/form-data":
        parser = MultiPartParser(request.headers, bounded_stream(request.stream(), limit), max_files=2, max_fields=16)
        try:
            form = await parser.parse()
        except MultiPartException as exc:
            raise ApiError(400, "invalid_request", exc.message) from exc
        try:
            upload = _first(form, _AUDIO_FIELDS)
            if not isinstance(upload, UploadFile):
                raise ApiError(400, "missing_audio", "multipart field 'file' with the audio is required")
            audio = await upload.read()
            ext = PurePath(upload.filename or "").suffix or "bin"
            voice_id = _opt_str(_first(form, _ID_FIELDS), "id")
            name = _opt_str(form.get("name"), "name")
            transcript = _opt_str(_first(form, _TEXT_FIELDS), "transcript")
        finally:
            await form.close()
    else:
        body = await _json_body(request, limit, "audio_too_large")
        b64 = body.get("audio")
        if b64 is not None and not isinstance(b64, str):
            raise ApiError(400, "invalid_request", "field 'audio' must be a base64 string")
        if not b64:
            raise ApiError(400, "missing_audio", "field 'audio' (base64) is required")
        audio_format = _opt_str(body.get("format"), "format")
        if b64.startswith("data:"):  # tolerate data URLs from browsers
            b64 = b64.partition(",")[2]
        try:
            audio = await _off_loop_if_large(len(b64), base64.b64decode, b64, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ApiError(400, "invalid_audio", "field 'audio' is not valid base64") from exc
        ext = "." + (audio_format or "bin")
        voice_id = _opt_str(_first(body, _ID_FIELDS), "id")
        name = _opt_str(body.get("name"), "name")
        transcript = _opt_str(_first(body, _TEXT_FIELDS), "transcript")

    if not audio:
        raise ApiError(400, "missing_audio", "the audio file is empty")
    if transcript is None or not transcript.strip():
        raise ApiError(400, "missing_transcript", "field 'transcript' is required")
    if voice_id is not None:
        store.validate_id(voice_id)
    info = await store.register(voice_id, name, transcript, audio, audio_ext=ext)
    return JSONResponse(info.to_json(), status_code=201)


@_endpoint("/v1/voices")
async def list_voices(request: Request) -> Response:
    store = _gw(request).voices
    return JSONResponse({"object": "list", "data": [v.to_json() for v in store.list()]})


@_endpoint("/v1/voices/{voice_id}")
async def get_voice(request: Request) -> Response:
    voice_id = request.path_params["voice_id"]
    info = _gw(request).voices.get(voice_id)
    if info is None:
        raise ApiError(404, "voice_not_found", f"voice {echo(voice_id)!r} not found")
    return JSONResponse(info.to_json())


@_endpoint("/v1/voices/{voice_id}")
async def delete_voice(request: Request) -> Response:
    voice_id = request.path_params["voice_id"]
    if not await _gw(request).voices.delete(voice_id):
        raise ApiError(404, "voice_not_found", f"voice {echo(voice_id)!r} not found")
    return JSONResponse({"id": voice_id, "object": "voice", "deleted": True})


async def resolve_voice(request: Request, voice: Any) -> VoicePrompt:
    """A registered id. No voice, or an OpenAI stock name that is not registered, is
    served by the configured default voice so stock clients work unchanged."""
    if isinstance(voice, dict):  # newer OpenAI clients may send {"id": "..."}
        voice = voice.get("id")
    if voice is not None and not isinstance(voice, str):
        raise ApiError(400, "invalid_request", "field 'voice' must be a string or {\"id\": ...}")
    store = _gw(request).voices
    if voice:
        try:
            return await store.get_prompt(voice)
        except KeyError:
            pass
    default = _setting(request, "default_voice", "")
    if default and (not voice or voice.lower() in OPENAI_VOICES):
        try:
            return await store.get_prompt(default)
        except KeyError:
            pass
    raise ApiError(404, "voice_not_found", f"voice {echo(voice or default)!r} not found; register it with POST /v1/voices")


# --------------------------------------------------------------------------------------
# Speech
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpeechRequest:
    input: str
    voice: Any
    response_format: str
    stream_format: str
    options: SessionOptions


def parse_speech_request(body: dict[str, Any], aliases: tuple[str, ...], max_chars: int) -> SpeechRequest:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "invalid_request", "field 'model' must be a string")
    if model is not None and not serves_model(model, aliases):
        raise ApiError(404, "model_not_found", f"model {echo(model)!r} is not served here; use one of {', '.join(aliases)}")
    text = body.get("input")
    if not isinstance(text, str) or not text.strip():
        raise ApiError(400, "invalid_request", "field 'input' must be a non-empty string")
    if len(text) > max_chars:
        raise ApiError(400, "input_too_long", f"input is {len(text)} characters; the limit is {max_chars}")
    fmt = body.get("response_format") or "mp3"
    if fmt not in RESPONSE_FORMATS:
        raise ApiError(400, "unsupported_format", f"response_format must be one of {', '.join(RESPONSE_FORMATS)}")
    stream_format = body.get("stream_format") or "audio"
    if stream_format not in ("audio", "sse"):
        raise ApiError(400, "unsupported_format", "stream_format must be 'audio' or 'sse'")
    speed = body.get("speed", 1.0)
    if speed is None:
        speed = 1.0
    # Compared as given: float() of a 400-digit integer overflows; NaN compares False.
    if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not (
            SPEED_RANGE[0] <= speed <= SPEED_RANGE[1]):
        raise ApiError(400, "invalid_speed", f"speed must be a number in [{SPEED_RANGE[0]}, {SPEED_RANGE[1]}]")
    instructions = _opt_str(body.get("instructions"), "instructions")
    instructions = instructions.strip() if instructions else None
    if instructions is not None and len(instructions) > MAX_INSTRUCTION_CHARS:
        raise ApiError(400, "instructions_too_long",
                       f"instructions are {len(instructions)} characters; the limit is {MAX_INSTRUCTION_CHARS}")
    # Extensions (OpenAI clients pass them through `extra_body`): a sampling seed, and
    # a fixed speech-token budget per text token for benchmarks and tests.
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED):
        raise ApiError(400, "invalid_request", f"seed must be an integer in [0, {MAX_SEED}]")
    tptt = body.get("tokens_per_text_token")
    if tptt is not None and (isinstance(tptt, bool) or not isinstance(tptt, (int, float)) or not 0 < tptt <= 50):
        raise ApiError(400, "invalid_request", "tokens_per_text_token must be a number in (0, 50]")
    options = SessionOptions(
        mode="instruct" if instructions else "zero_shot",
        instruction=instructions,
        speed=float(speed),
        tokens_per_text_token=float(tptt) if tptt is not None else None,
        seed=seed,
    )
    return SpeechRequest(text, body.get("voice"), fmt, stream_format, options)


def _sse(payload: dict[str, Any]) -> bytes:
    # Data-only events, exactly as OpenAI sends them; the SDK reads `type` from the JSON.
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _utterance_error(ev: UtteranceError) -> ApiError:
    # The request's own faults: its text, or options the engine cannot build a prompt from
    # (`bad_options`: instructions that are only the system sentence or `<|endofprompt|>`).
    if ev.code in ("empty_text", "text_too_long", "bad_options"):
        return ApiError(400, "invalid_request", ev.message)
    return ApiError(500, "synthesis_failed", f"{ev.code}: {ev.message}")


class _ClientGone(Exception):
    """The client disconnected before its response started."""


# nginx's status for a request its client abandoned: logged and counted, sent to nobody.
CLIENT_CLOSED_REQUEST = 499


async def _unless_disconnected(request: Request, pending: Awaitable[Any]) -> Any:
    """`pending`'s result, or `_ClientGone` as soon as the client disconnects first. The
    request body is read by now, so the next ASGI message is the disconnect; waiting for it
    costs nothing while the client stays."""
    async def left() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work, watch = asyncio.ensure_future(pending), asyncio.ensure_future(left())
    try:
        await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone = not work.done()
        for task in (work, watch):
            task.cancel()  # no-op when done; not awaited, so a cancel of this task stays one
            task.add_done_callback(_retrieve)
    if gone:
        raise _ClientGone
    return work.result()


def _retrieve(task: asyncio.Task[Any]) -> None:
    """A task nobody awaits: read its exception, so asyncio does not log it as lost."""
    if not task.cancelled():
        task.exception()


class SpeechStreamFailed(ReportedError):
    """Synthesis failed after an audio response had started: raised out of the body so
    the server drops the connection instead of ending the transfer cleanly."""


class SpeechClientStalled(ReportedError):
    """A speech client took none of its response's bytes for `speech_send_timeout_s`:
    raised out of the body to drop the connection, as for a failed synthesis."""


class _ClosingStreamingResponse(StreamingResponse):
    """StreamingResponse that always closes its body generator, and breaks off when its
    client stops reading.

    When the client goes away Starlette stops iterating but leaves the async generator
    to the garbage collector; closing it here runs the generator's `finally` at once,
    which aborts the engine session (the LM request and queued GPU work are dropped).
    A client that stays connected but stops reading makes the server's `send` wait for
    ever (flow control), holding a session of `max_sessions`: after `send_timeout_s`
    without progress the transfer is broken off (0: never).
    """

    def __init__(self, content: AsyncIterator[bytes], *, send_timeout_s: float = 0.0,
                 on_stall: Callable[[], None] | None = None, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.send_timeout_s = send_timeout_s
        self.on_stall = on_stall

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[override]
        async def timed_send(message: Any) -> None:
            with anyio.move_on_after(self.send_timeout_s) as waited:
                await send(message)
            if waited.cancelled_caught:
                if self.on_stall is not None:
                    self.on_stall()
                raise SpeechClientStalled(f"the client took no bytes for {self.send_timeout_s:g} s")

        try:
            await super().__call__(scope, receive, timed_send if self.send_timeout_s > 0 else send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()


@_endpoint("/v1/audio/speech")
async def create_speech(request: Request) -> Response:
    """OpenAI `POST /v1/audio/speech`: audio bytes streamed as produced, or SSE."""
    t0 = time.monotonic()
    gw = _gw(request)
    max_chars = int(_setting(request, "max_input_chars", 4096))
    body = await _json_body(request, speech_body_limit(max_chars))
    req = parse_speech_request(body, model_aliases(request), max_chars)
    _require_ready(gw)
    engine = gw.engine
    prompt = await resolve_voice(request, req.voice)
    encoder = make_encoder(req.response_format, engine.sample_rate)

    refusal = gw.metrics.session_refusal(_setting(request, "max_sessions", None))
    if refusal is not None:
        raise ApiError(503, "too_many_sessions", refusal)
    try:
        session = engine.open_session(prompt, req.options)
    except Exception as exc:  # EngineError("not_ready") and friends
        code = getattr(exc, "code", "internal_error")
        raise ApiError(503 if code == "not_ready" else 500, code, str(exc)) from exc
    gw.metrics.session_opened()
    events: AsyncIterator[AudioChunk | UtteranceError] | None = None
    try:
        uids = [await session.submit(text) for text in speech_pieces(req.input)]
        stats = [session.utterance_stats(uid) for uid in uids] if hasattr(session, "utterance_stats") else []
        await session.finish()
        events = session.events().__aiter__()
        # Wait for the first event before answering: a failure that happens before any
        # audio exists still gets a proper HTTP status instead of a truncated 200. A client
        # that leaves meanwhile frees the engine at once, not when that audio is ready.
        first = await _unless_disconnected(request, anext(events, None))
        if isinstance(first, UtteranceError):
            raise _utterance_error(first)
    except BaseException as exc:
        with anyio.CancelScope(shield=True):
            await session.abort()
        gw.metrics.session_closed()
        if isinstance(exc, _ClientGone):
            log.info("speech client disconnected before its first audio")
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        raise

    sample_rate = engine.sample_rate

    # Compressed formats cost a few ms per second of audio (LAME, AAC, Opus): run them
    # off the event loop so many concurrent streams cannot stall it. Raw formats are
    # cheaper than the thread hop.
    offload = isinstance(encoder, AvEncoder)

    async def encode(pcm: Any, last: bool) -> bytes:
        def work() -> bytes:
            out = encoder.encode(pcm)
            return out + encoder.close() if last else out

        return await asyncio.to_thread(work) if offload else work()

    async def produce() -> AsyncIterator[bytes]:
        samples = 0
        sent_any = False
        failed = False
        pieces_left = len(uids)  # the pieces come out in order; the encoder ends with the last
        try:
            ev: AudioChunk | UtteranceError | None = first
            while ev is not None:
                if isinstance(ev, UtteranceError):
                    failed = True
                    gw.metrics.error(_utterance_error(ev).code)
                    log.warning("speech utterance failed mid-stream: %s %s", ev.code, ev.message)
                    if req.stream_format != "sse":
                        # Headers and part of the audio are out: only a broken transfer can
                        # tell the client the file is incomplete (a clean end would pass a
                        # truncated file off as the whole).
                        raise SpeechStreamFailed(f"{ev.code}: {ev.message}")
                    yield _sse({"type": "error", "error": {"code": "synthesis_failed", "message": ev.message}})
                    break
                samples += int(ev.pcm.size)
                pieces_left -= int(ev.is_last)
                data = await encode(ev.pcm, pieces_left == 0)
                if data:
                    if not sent_any:
                        sent_any = True
                        gw.metrics.observe_first_audio(time.monotonic() - t0)
                    yield _sse({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()}) \
                        if req.stream_format == "sse" else data
                # Handed to the connection (an encoder may hold a few ms back until its end).
                gw.metrics.add_audio_seconds(ev.pcm.size / sample_rate)
                if pieces_left == 0:
                    break
                ev = await anext(events, None)
            if failed:
                return
            # Flush (a no-op when the last chunk already closed the encoder).
            tail = await encode(np.zeros(0, np.float32), True)
            if tail:
                yield _sse({"type": "speech.audio.delta", "audio": base64.b64encode(tail).decode()}) \
                    if req.stream_format == "sse" else tail
            if req.stream_format == "sse":
                # What the engine read for each piece; normalised again only if it cannot say.
                input_tokens = (sum(s.num_text_tokens for s in stats if s is not None)
                                or await asyncio.to_thread(_count_text_tokens, engine, req.input))
                counted = sum(s.num_speech_tokens or 0 for s in stats if s is not None)
                output_tokens = counted or round(samples * 25 / sample_rate)
                yield _sse({
                    "type": "speech.audio.done",
                    "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens,
                              "total_tokens": input_tokens + output_tokens},
                })
        finally:
            # The encoder is not closed here: after a cancelled `to_thread` a worker may
            # still be inside it, and an unfinished encoder is simply garbage-collected.
            with anyio.CancelScope(shield=True):
                await session.abort()
            gw.metrics.session_closed()

    if req.stream_format == "sse":
        media_type, headers = "text/event-stream", {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    else:
        media_type, headers = MEDIA_TYPES[req.response_format], {"Cache-Control": "no-store"}
    timeout = float(_setting(request, "speech_send_timeout_s", 60.0))

    def stalled() -> None:
        gw.metrics.error("client_stalled")
        log.warning("speech client took no bytes for %g s: response broken off", timeout)

    return _ClosingStreamingResponse(produce(), media_type=media_type, headers=headers, send_timeout_s=timeout,
                                     on_stall=stalled)


def speech_pieces(text: str) -> list[str]:
    """The input as the WebSocket path would speak it: one utterance per segment (sentences;
    the first may end at a clause, none longer than the segmenter's limit). One utterance
    for a whole 4096-character input would overrun the LM's context (prompt, text and
    minutes of speech tokens in one request). Text with nothing speakable stays whole, so
    the engine names the problem (`empty_text`)."""
    segmenter = Segmenter()
    pieces = [seg.text.strip() for seg in segmenter.push(text) + segmenter.end() if seg.speakable]
    return pieces or [text]


def _count_text_tokens(engine: Any, text: str) -> int:
    """Text tokens the LM sees (for `usage`): those of the pieces it is given, each
    normalised apart (`speech_pieces`); character count if the engine cannot say."""
    try:
        return sum(len(engine.text_ids(piece)) for piece in speech_pieces(text))
    except Exception:
        return len(text)


routes: list[Route] = [
    Route("/health", health, methods=["GET"]),
    Route("/ready", ready, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
    Route("/debug/planner", planner, methods=["GET"]),
    Route("/debug/planner", tune_planner, methods=["POST"]),
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/models/{model}", get_model, methods=["GET"]),
    Route("/v1/audio/speech", create_speech, methods=["POST"]),
    Route("/v1/voices", create_voice, methods=["POST"]),
    Route("/v1/voices", list_voices, methods=["GET"]),
    Route("/v1/voices/{voice_id}", get_voice, methods=["GET"]),
    Route("/v1/voices/{voice_id}", delete_voice, methods=["DELETE"]),
]


class _MethodNotAllowed:
    """ASGI endpoint for a known path asked with a method it does not serve."""

    def __init__(self, allowed: list[str]) -> None:
        self.allow = ", ".join(allowed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raise HTTPException(405, f"{scope.get('method')} is not allowed here; allowed: {self.allow}",
                            headers={"Allow": self.allow})


def method_fallbacks(api_routes: list[Route]) -> list[Route]:
    """A route for each path of `api_routes` taking any method, to go after them: 405 and
    `Allow` for a method the path does not serve. Starlette's router answers that itself
    only when no later route matches the path fully, and the demo page's static mount at
    `/` matches every path (a `GET /v1/audio/speech` was a 404)."""
    allowed: dict[str, set[str]] = {}
    for route in api_routes:
        allowed.setdefault(route.path, set()).update(route.methods or ())
    return [Route(path, _MethodNotAllowed(sorted(methods))) for path, methods in allowed.items()]
