"""The LM server's own account of where its requests' time went, summed.

The engine times an utterance's first speech token from its text's arrival
(`EngineStats.first_chunk_lm_first_token_seconds`). Under load on the H200 that time
varied 71-532 ms for the same burst (docs/benchmarks.md, round 9), and the engine alone
cannot say whether the wait was inside vLLM (queued behind other requests, then the
prefill) or around it (the request's way into vLLM's engine core, the token's way back
to the gateway's event loop). vLLM's engine core stamps each request when it is queued,
scheduled and makes its first and last token; `LMServerTimes` sums those intervals.

vLLM reports them only with its statistics on (`EngineConfig.lm_timing`, off by default):
its output handler then also does per-step bookkeeping in the gateway process, and keeps
its own Prometheus histograms there.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class LMServerTimes:
    """Sums over the requests the LM server finished (aborted ones count once they had a
    first token)."""

    requests: int = 0
    queued_seconds: float = 0.0  # engine core: queued -> first scheduled
    prefill_seconds: float = 0.0  # first scheduled -> first token made
    decode_seconds: float = 0.0  # first token -> last token
    decode_tokens: int = 0  # tokens after the first
    # vLLM's own time to first token (its front end: the request's arrival -> the first
    # token handled there), summed over the requests whose first token came. A text-in
    # streaming request may count once per text chunk it resumes with (each is a prefill).
    first_tokens: int = 0
    first_token_seconds: float = 0.0

    def add(self, iteration: Any) -> None:
        """One vLLM `IterationStats` (read by attribute: vLLM calls its layout unstable)."""
        ttfts = list(getattr(iteration, "time_to_first_tokens_iter", ()) or ())
        self.first_tokens += len(ttfts)
        self.first_token_seconds += float(sum(ttfts))
        for req in getattr(iteration, "finished_requests", ()) or ():
            # A request aborted before it was scheduled or made a token has zero
            # timestamps, hence negative intervals: no complete timeline to count.
            if req.num_generation_tokens < 1 or req.queued_time < 0 or req.prefill_time < 0:
                continue
            self.requests += 1
            self.queued_seconds += float(req.queued_time)
            self.prefill_seconds += float(req.prefill_time)
            self.decode_seconds += float(max(0.0, req.decode_time))
            self.decode_tokens += int(req.num_generation_tokens) - 1

    def stats_fields(self) -> dict[str, float | int]:
        """As EngineStats fields (`lm_server_*`)."""
        return {"lm_server_requests": self.requests, "lm_server_queued_seconds": self.queued_seconds,
                "lm_server_prefill_seconds": self.prefill_seconds, "lm_server_decode_seconds": self.decode_seconds,
                "lm_server_decode_tokens": self.decode_tokens, "lm_server_first_tokens": self.first_tokens,
                "lm_server_first_token_seconds": self.first_token_seconds}


def vllm_stat_logger(times: LMServerTimes) -> type:
    """A vLLM per-engine stat logger class (a `StatLoggerFactory`) that adds every
    iteration's statistics to `times`. Needs vLLM importable."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class ServerTimesLogger(StatLoggerBase):  # type: ignore[misc]
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.broken = False

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None:
            # This runs in vLLM's output handler: an error here must not stop the tokens.
            if iteration_stats is None or self.broken:
                return
            try:
                times.add(iteration_stats)
            except Exception:
                self.broken = True
                log.exception("the LM server's timings are not counted from here on")

        def log_engine_initialized(self) -> None:
            pass

    return ServerTimesLogger
