"""The LM server's timings (`engine.backends.lm_times`): summed from vLLM's per-iteration
statistics, here shaped as vLLM 0.26 hands them over (`IterationStats`,
`FinishedRequestStats`), and absent from the torch backend."""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest

from engine.backends.lm_times import LMServerTimes, vllm_stat_logger
from engine.stats import EngineStats


def finished(tokens: int, queued: float, prefill: float, decode: float) -> SimpleNamespace:
    return SimpleNamespace(num_generation_tokens=tokens, queued_time=queued, prefill_time=prefill, decode_time=decode)


def test_sums_iterations_and_skips_requests_without_a_timeline() -> None:
    times = LMServerTimes()
    times.add(SimpleNamespace(time_to_first_tokens_iter=[0.02, 0.04], finished_requests=[]))
    times.add(SimpleNamespace(time_to_first_tokens_iter=[], finished_requests=[
        finished(51, 0.01, 0.015, 0.25),
        finished(1, 0.002, 0.003, 0.0),  # one token: no decode interval
        finished(0, 0.01, -5.0, 0.0),  # aborted while queued: timestamps of 0
        finished(3, -1.0, 0.01, 0.01),  # never scheduled
    ]))
    times.add(SimpleNamespace(time_to_first_tokens_iter=None, finished_requests=None))  # an idle step
    assert (times.first_tokens, times.requests, times.decode_tokens) == (2, 2, 50)
    assert times.first_token_seconds == pytest.approx(0.06)
    assert times.queued_seconds == pytest.approx(0.012) and times.prefill_seconds == pytest.approx(0.018)
    assert times.decode_seconds == pytest.approx(0.25)
    fields = times.stats_fields()
    assert set(fields) <= {f.name for f in EngineStats.__dataclass_fields__.values()}  # exported as they are
    assert fields["lm_server_requests"] == 2 and fields["lm_server_decode_tokens"] == 50


def test_vllm_stat_logger_counts_and_never_raises_into_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    # vLLM is not installed on the CPU machine: stand in its base class, which is all the
    # logger takes from it (an abstract record / log_engine_initialized interface).
    fake = types.ModuleType("vllm.v1.metrics.loggers")
    fake.StatLoggerBase = type("StatLoggerBase", (), {})  # type: ignore[attr-defined]
    for name in ("vllm", "vllm.v1", "vllm.v1.metrics"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.v1.metrics.loggers", fake)

    times = LMServerTimes()
    cls = vllm_stat_logger(times)
    assert issubclass(cls, fake.StatLoggerBase)
    logger = cls(object(), 0)  # how vLLM's per-engine adapter builds it: (vllm_config, engine_index)
    logger.log_engine_initialized()
    logger.record(None, SimpleNamespace(time_to_first_tokens_iter=[0.01], finished_requests=[]), engine_idx=0)
    logger.record(SimpleNamespace(), None)  # scheduler stats only
    assert times.first_tokens == 1
    # A layout this code does not know must not break vLLM's output handler: counting stops.
    logger.record(None, SimpleNamespace(time_to_first_tokens_iter=[], finished_requests=[object()]))
    logger.record(None, SimpleNamespace(time_to_first_tokens_iter=[0.5], finished_requests=[]))
    assert times.first_tokens == 1 and logger.broken
