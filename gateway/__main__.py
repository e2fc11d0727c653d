"""`python -m gateway` / `cosyvoice-gateway`: serve the gateway with uvicorn."""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import os
import re
import sys
import threading
import time
from typing import Any, Callable

import uvicorn
import yaml

from engine.models.loader import ModelDirError

from .errors import ReportedError
from .settings import Settings, load_settings, redacted, settings_to_dict

log = logging.getLogger("gateway")

EXIT_ENGINE_FAILED = 3  # the engine failed for good (DrainingServer); 1: the server never started
EXIT_GRACE_S = 60.0  # after the drain, for uvicorn's shutdown and the engine's close
# After the drain (up to shutdown_timeout), how long uvicorn still waits for open
# connections before it cancels their tasks. Not shutdown_timeout again: the drain has
# waited already, and twice that outlasts an orchestrator's stop grace (compose's 40 s).
AFTER_DRAIN_GRACE_S = 5.0


def _exit_now(status: int) -> None:
    """Leave without the interpreter's exit handlers: multiprocessing joins its children
    there without a bound, and a stage process stuck in the GPU driver may not be reaped."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None on other C libraries."""
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


class DrainingServer(uvicorn.Server):
    """uvicorn, but SIGTERM/SIGINT first drains instead of cutting streams.

    Plain uvicorn closes every WebSocket with 1012 the moment a signal arrives. Here the
    first signal only turns readiness off (`/ready` answers 503, new sockets are refused
    with 1013 and new HTTP speech with 503, so a load balancer moves traffic away) and
    waits until the engine has no session left or `drain_timeout` passes; then uvicorn
    shuts down as usual. A second signal exits at once.

    An engine that fails for good (`Settings.exit_on_engine_failure`) drains the same way,
    its own sessions ending with errors at once, and the process then exits with status
    `EXIT_ENGINE_FAILED` for its supervisor to start a fresh one.

    It also hands freed heap back to the OS when the engine goes idle after work: glibc
    keeps pages that tensors of many shapes were freed into, so RSS after a burst stays
    at its high-water mark although the memory is unused (bench/soak.py measures this).
    """

    TRIM_EVERY_TICKS = 50  # on_tick runs every 0.1 s

    def __init__(self, config: uvicorn.Config, app: object, drain_timeout: float,
                 exit_on_engine_failure: bool = True) -> None:
        super().__init__(config)
        self._app = app
        self.drain_timeout = drain_timeout
        self.drain_deadline: float | None = None
        self.exit_on_engine_failure = exit_on_engine_failure
        self.engine_failure: str | None = None  # why the engine failed, once this server drains for it
        self._trim = _malloc_trim()
        self._tokens_at_trim = -1

    def _gw(self) -> object | None:
        return getattr(getattr(self._app, "state", None), "gw", None)

    def handle_exit(self, sig: int, frame: object) -> None:
        gw = self._gw()
        if self.drain_deadline is not None or not self.started or gw is None:
            super().handle_exit(sig, frame)  # a second signal, or nothing to drain yet
            return
        self.drain_deadline = time.monotonic() + self.drain_timeout
        gw.engine.ready = False  # type: ignore[attr-defined]
        gw.draining = True  # type: ignore[attr-defined]
        log.info("signal %s: draining (up to %.0f s) before shutdown", sig, self.drain_timeout)

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        if self.drain_deadline is None:
            if self.exit_on_engine_failure:
                self._check_engine()
            if counter % self.TRIM_EVERY_TICKS == 0:
                await self._trim_if_idle()
            return False
        gw = self._gw()
        # Engine sessions, and the connections and streams still sending their audio: a
        # WebSocket context's engine session ends once its last audio and `done` are queued
        # for the socket, and stopping then cut them off before they were sent. And voice
        # registrations under way (featurising, on a GPU a new prompt width's graph
        # captures): uvicorn cuts them off 5 s after the drain.
        busy = (max(gw.engine.stats().active_sessions, gw.metrics.sessions_active)  # type: ignore[attr-defined]
                + getattr(gw, "registrations", 0) if gw is not None else 0)
        if busy and time.monotonic() < self.drain_deadline:
            return False
        if busy:
            log.warning("drain timeout: %d session(s) or registration(s) still running", busy)
        else:
            log.info("drained")
        return True

    def _check_engine(self) -> None:
        gw = self._gw()
        failure = None if gw is None else gw.engine.failure  # type: ignore[attr-defined]
        if failure is None:
            return
        self.engine_failure = failure
        self.drain_deadline = time.monotonic() + self.drain_timeout
        gw.engine.ready = False  # type: ignore[union-attr]
        gw.engine_failure = failure  # type: ignore[union-attr]
        gw.draining = True  # type: ignore[union-attr]
        log.error("the engine can serve no more (%s): draining (up to %.0f s), then exiting with status %d for a "
                  "restart", failure, self.drain_timeout, EXIT_ENGINE_FAILED)
        # A backstop: the orderly way out can wait on threads a hung GPU holds (asyncio.run
        # joins its worker threads without a bound on Python 3.11).
        backstop = threading.Timer(self.drain_timeout + EXIT_GRACE_S, _exit_now, (EXIT_ENGINE_FAILED,))
        backstop.daemon = True
        backstop.start()

    async def _trim_if_idle(self) -> None:
        gw = self._gw()
        if self._trim is None or gw is None:
            return
        stats = gw.engine.stats()  # type: ignore[attr-defined]
        if stats.active_sessions == 0 and stats.lm_tokens != self._tokens_at_trim:
            self._tokens_at_trim = stats.lm_tokens
            await asyncio.to_thread(self._trim, 0)


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


# A browser cannot set headers on a WebSocket, so the demo page passes its API key in the
# URL (`?token=`, `gateway.auth`), and uvicorn logs every accepted socket with its URL.
_SECRET_IN_URL = re.compile(r"([?&](?:token|api_key)=)[^&\s\"']+")


class _RedactSecrets(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        redacted = _SECRET_IN_URL.sub(r"\1***", message)
        if redacted != message:
            record.msg, record.args = redacted, ()
        return True


class _DropReportedBreaks(logging.Filter):
    """Uvicorn's "Exception in ASGI application" for a `ReportedError`: a response broken
    off on purpose (a synthesis failed mid-stream, a client that stopped reading), logged
    and counted where it happened. Its ERROR record and traceback would read as a bug."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (record.name.startswith("uvicorn") and isinstance(exc, ReportedError))


def setup_logging(level: str, as_json: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if as_json else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(_RedactSecrets())
    handler.addFilter(_DropReportedBreaks())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def server_config(app: Any, settings: Settings) -> uvicorn.Config:
    from .app import transport_options

    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,
        timeout_graceful_shutdown=min(settings.shutdown_timeout, AFTER_DRAIN_GRACE_S),
        **transport_options(settings),  # type: ignore[arg-type]
    )


def main(argv: list[str] | None = None) -> None:
    try:
        settings, args = load_settings(argv)
    except ValueError as exc:
        print(f"cosyvoice-gateway: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.print_config:
        print(yaml.safe_dump(settings_to_dict(redacted(settings)), sort_keys=False), end="")
        return
    setup_logging(settings.log_level, settings.log_json)
    # Process-wide, hence here and not in create_app: the server owns this process.
    sys.setswitchinterval(settings.gil_switch_interval_ms / 1000)
    from dataclasses import replace
    from pathlib import Path

    from engine.errors import EngineError
    from engine.hub import resolve_model
    from engine.pool import pool_configs

    from .app import create_app, engine_config

    try:  # the engine's values and the workers' layout, checked before a download and a model load
        pool_configs(engine_config(settings, Path(settings.model)), settings.engine.devices)
    except (ValueError, EngineError) as exc:
        print(f"cosyvoice-gateway: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    # Resolve (and download, with a progress bar) before uvicorn starts, so that a
    # missing model is one clear line on stderr rather than a failed lifespan.
    try:
        model_dir = resolve_model(settings.model, Path(settings.data_dir) / "models")
    except ModelDirError as exc:
        print(f"cosyvoice-gateway: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    settings = replace(settings, model=str(model_dir))

    app = create_app(settings)
    server = DrainingServer(server_config(app, settings), app, settings.shutdown_timeout,
                            settings.exit_on_engine_failure)
    try:
        server.run()
    except SystemExit:
        # uvicorn ends a start whose lifespan failed with its STARTUP_FAILURE, 3: this
        # gateway's status for an engine that failed while serving (restart me).
        if not server.started:
            raise SystemExit(1) from None
        raise
    if not server.started:
        raise SystemExit(1)
    if server.engine_failure is not None:
        _exit_now(EXIT_ENGINE_FAILED)


if __name__ == "__main__":
    main()
