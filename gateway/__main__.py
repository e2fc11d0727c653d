"""`python -m gateway` / `cosyvoice-gateway`: serve the gateway with uvicorn."""

from __future__ import annotations

import json
import logging
import sys
import time

import uvicorn
import yaml

from engine.models.loader import ModelDirError

from .settings import load_settings, settings_to_dict

log = logging.getLogger("gateway")


class DrainingServer(uvicorn.Server):
    """uvicorn, but SIGTERM/SIGINT first drains instead of cutting streams.

    Plain uvicorn closes every WebSocket with 1012 the moment a signal arrives. Here the
    first signal only turns readiness off (`/ready` answers 503, new sockets are refused
    with 1013 and new HTTP speech with 503, so a load balancer moves traffic away) and
    waits until the engine has no session left or `drain_timeout` passes; then uvicorn
    shuts down as usual. A second signal exits at once.
    """

    def __init__(self, config: uvicorn.Config, app: object, drain_timeout: float) -> None:
        super().__init__(config)
        self._app = app
        self.drain_timeout = drain_timeout
        self.drain_deadline: float | None = None

    def _gw(self) -> object | None:
        return getattr(getattr(self._app, "state", None), "gw", None)

    def handle_exit(self, sig: int, frame: object) -> None:
        gw = self._gw()
        if self.drain_deadline is not None or not self.started or gw is None:
            super().handle_exit(sig, frame)  # a second signal, or nothing to drain yet
            return
        self.drain_deadline = time.monotonic() + self.drain_timeout
        gw.engine.ready = False  # type: ignore[attr-defined]
        log.info("signal %s: draining (up to %.0f s) before shutdown", sig, self.drain_timeout)

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        if self.drain_deadline is None:
            return False
        gw = self._gw()
        busy = gw.engine.stats().active_sessions if gw is not None else 0  # type: ignore[attr-defined]
        if busy and time.monotonic() < self.drain_deadline:
            return False
        if busy:
            log.warning("drain timeout: %d session(s) still running", busy)
        else:
            log.info("drained")
        return True


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


def setup_logging(level: str, as_json: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if as_json else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def main(argv: list[str] | None = None) -> None:
    try:
        settings, args = load_settings(argv)
    except ValueError as exc:
        print(f"cosyvoice-gateway: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.print_config:
        print(yaml.safe_dump(settings_to_dict(settings), sort_keys=False), end="")
        return
    setup_logging(settings.log_level, settings.log_json)
    from dataclasses import replace
    from pathlib import Path

    from engine.hub import resolve_model

    from .app import create_app

    # Resolve (and download, with a progress bar) before uvicorn starts, so that a
    # missing model is one clear line on stderr rather than a failed lifespan.
    try:
        model_dir = resolve_model(settings.model, Path(settings.data_dir) / "models")
    except ModelDirError as exc:
        print(f"cosyvoice-gateway: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    settings = replace(settings, model=str(model_dir))

    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,
        ws_max_size=settings.ws.max_message_bytes,
        timeout_graceful_shutdown=settings.shutdown_timeout,
        limit_concurrency=settings.max_sessions + 64,
    )
    server = DrainingServer(config, app, settings.shutdown_timeout)
    server.run()
    if not server.started:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
