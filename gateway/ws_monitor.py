"""The watchdog of a `/v1/tts/stream` socket (`gateway.ws`): one task per connection
that closes it when its client stops reading (lag), goes quiet (idle timeout) or the
gateway drains, and otherwise keeps it alive and reports its stats."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from typing import Any, Protocol

from .protocol import CLOSE_GOING_AWAY, CLOSE_IDLE, CLOSE_SERVICE_RESTART, ConnectionState, WsLimits
from .ws_writer import FrameWriter


class MonitorHost(Protocol):
    """What the monitor watches and acts on (`gateway.ws._Connection`)."""

    gw: Any
    limits: WsLimits
    writer: FrameWriter
    state: ConnectionState
    last_client_at: float  # the reader's clock of the client's last frame

    def request_close(self, code: int | None, reason: str = "", drain: bool = False) -> None: ...

    def send_event(self, event: dict[str, Any]) -> None: ...

    def slow_consumer(self, why: str) -> None: ...

    async def check_contexts(self, now: float) -> None: ...


class ConnectionMonitor:
    """Lag, idle timeout, drain, keepalive and periodic stats of one socket."""

    def __init__(self, conn: MonitorHost) -> None:
        self.conn = conn
        self.stats_interval_s = 0.0  # set by a `config` message's `stats_interval_ms`
        self.last_stats_at = time.monotonic()

    async def run(self) -> None:
        conn = self.conn
        limits = conn.limits
        while True:
            periods = [0.5, limits.max_lag_s / 4, limits.idle_timeout_s / 4]
            if limits.keepalive_interval_s > 0:
                periods.append(limits.keepalive_interval_s / 2)
            if limits.stream_idle_s > 0:
                periods.append(limits.stream_idle_s / 4)
            if self.stats_interval_s > 0:
                periods.append(self.stats_interval_s / 2)
            await asyncio.sleep(max(0.02, min(periods)))
            now = time.monotonic()
            if conn.writer.lag() > limits.max_lag_s:
                conn.slow_consumer(f"lag {conn.writer.lag():.1f}s")
                return
            await conn.check_contexts(now)
            if not conn.state.contexts and now - conn.last_client_at > limits.idle_timeout_s:
                conn.request_close(CLOSE_IDLE, "idle timeout", drain=True)
                return
            if not conn.state.contexts and getattr(conn.gw, "draining", False):
                if getattr(conn.gw, "engine_failure", None):
                    conn.request_close(CLOSE_SERVICE_RESTART, "engine failed: the gateway restarts", drain=True)
                else:
                    conn.request_close(CLOSE_GOING_AWAY, "server shutting down", drain=True)
                return
            if limits.keepalive_interval_s > 0 and conn.writer.idle and now - conn.writer.last_sent_at > limits.keepalive_interval_s:
                conn.send_event({"type": "keepalive", "t": round(now, 3)})
            if self.stats_interval_s > 0 and now - self.last_stats_at >= self.stats_interval_s:
                self.last_stats_at = now
                conn.send_event(self._stats())

    def _stats(self) -> dict[str, Any]:
        conn = self.conn
        engine_stats: dict[str, Any] = {}
        with contextlib.suppress(Exception):
            engine_stats = dataclasses.asdict(conn.gw.engine.stats())
        return {
            "type": "stats",
            "contexts": len(conn.state.contexts),
            "queued_bytes": conn.writer.queued_bytes,
            "frames_sent": conn.writer.frames_sent,
            "bytes_sent": conn.writer.bytes_sent,
            "engine": engine_stats,
        }
