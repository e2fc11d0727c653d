"""HTTP API errors: one exception type and one JSON shape for every failure.

Every error the HTTP API returns has the body
``{"error": {"code": ..., "message": ..., "type": ...}}``, ``type`` repeating ``code``
(the shape OpenAI's clients read: they look for ``error.message``). Codes are stable,
snake_case strings that clients may branch on; the message is for humans. README.md
("HTTP API") lists them for users.

Documented codes (status):

===========================  ======  ===============================================
code                         status  when
===========================  ======  ===============================================
invalid_request              400     malformed JSON / form, wrong field type, transcript / name too long
invalid_voice_id             400     voice id outside ``^[A-Za-z0-9_-]{1,64}$``
missing_audio                400     registration without an audio file
missing_transcript           400     registration without a transcript
invalid_audio                400     upload is not decodable audio (or silent, or bad base64)
audio_too_short              400     prompt shorter than the minimum duration
audio_too_long               400     prompt longer than the maximum duration
sample_rate_too_low          400     prompt sample rate below the minimum
input_too_long               400     speech ``input`` over the character limit
invalid_speed                400     ``speed`` outside 0.25..4
instructions_too_long        400     speech ``instructions`` over 500 characters
unsupported_format           400     unknown ``response_format`` / ``stream_format``
unauthorized                 401     API keys configured and none / a wrong one sent
tuning_off                   403     ``POST /debug/planner`` without ``--debug-tuning true``
voice_not_found              404     unknown voice id
voice_store_unavailable      503     the shared voice store (PostgreSQL) cannot be reached
model_not_found              404     ``model`` is not one of the served aliases
not_available                404     ``/debug/planner``: this engine has no first-chunk planner
not_found                    404     no such route
method_not_allowed           405     the route exists but not for this method
voice_exists                 409     registering an id that is already taken
too_many_voices              409     registering a new id with ``voices.max_voices`` voices registered
audio_too_large              413     upload over the byte limit (stopped while reading)
request_too_large            413     a JSON speech request over max(256 KiB, 12 bytes x ``max_input_chars`` + 64 KiB)
too_many_registrations       429     ``voices.max_concurrent_registrations`` registrations already running
not_ready                    503     engine draining, failed, or not loaded yet (``/ready``; the server
                                     opens its port only after the load, so HTTP clients see the first two)
engine_failed                503     ``/health``: the engine can serve no more (stage process dead or stalled)
too_many_sessions            503     ``max_sessions`` sessions (WebSockets and syntheses) already open
synthesis_failed             500     the engine reported an error for the utterance
internal_error               500     anything unexpected
===========================  ======  ===============================================
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

log = logging.getLogger(__name__)


class ApiError(Exception):
    """An error with an HTTP status and a stable machine-readable code."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message

    def __repr__(self) -> str:
        return f"ApiError({self.status}, {self.code!r}, {self.message!r})"


def error_body(code: str, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "type": code}}


def error_response(status: int, code: str, message: str,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(code, message), status_code=status, headers=headers)


def _count_error(request: Request, code: str) -> None:
    # Metrics live on the per-app state object; an app assembled without them
    # (some tests) simply does not count.
    gw = getattr(request.app.state, "gw", None)
    metrics = getattr(gw, "metrics", None)
    if metrics is not None:
        metrics.error(code)


async def api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """Starlette exception handler for `ApiError` (register with ``{ApiError: ...}``)."""
    assert isinstance(exc, ApiError)
    _count_error(request, exc.code)
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return error_response(exc.status, exc.code, exc.message, headers)


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "audio_too_large"}


async def http_exception_handler(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own HTTPExceptions (404 route, 405 method) in the same JSON shape."""
    assert isinstance(exc, HTTPException)
    code = _HTTP_CODES.get(exc.status_code, "invalid_request" if exc.status_code < 500 else "internal_error")
    _count_error(request, code)
    return error_response(exc.status_code, code, str(exc.detail), dict(exc.headers or {}) or None)


def not_ready_reason(gw: Any) -> str:
    """Why the gateway refuses new speech while its engine is not ready: a failed engine,
    a drain for shutdown, or the model's load."""
    engine = getattr(gw, "engine", None)
    failure = getattr(engine, "failure", None)
    return failure or ("draining for shutdown" if getattr(gw, "draining", False) else "model is loading")


class ReportedError(RuntimeError):
    """Raised on purpose out of a response already under way, to break its transfer,
    after the failure was counted and logged where it happened: not an unhandled error."""


async def unhandled_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """Last resort (register under ``Exception``): log the traceback, answer 500 JSON."""
    if isinstance(exc, ReportedError):
        # Starlette calls this even once the response has started (nothing of it is sent).
        return error_response(500, "internal_error", "internal server error")
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    _count_error(request, "internal_error")
    return error_response(500, "internal_error", "internal server error")


# What the lead's app factory passes as ``Starlette(exception_handlers=...)``.
exception_handlers = {
    ApiError: api_error_handler,
    HTTPException: http_exception_handler,
    Exception: unhandled_error_handler,
}
