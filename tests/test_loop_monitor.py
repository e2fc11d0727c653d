"""LoopLagMonitor records how long the event loop was kept from running callbacks."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.loop_monitor import LoopLagMonitor
from gateway.metrics import Metrics


def test_a_busy_loop_shows_up_as_lag_and_cpu() -> None:
    async def main() -> tuple[list[float], list[float]]:
        samples: list[float] = []
        cpu: list[float] = []
        seen = asyncio.Event()

        def observe(lag: float) -> None:
            samples.append(lag)
            seen.set()

        mon = LoopLagMonitor(observe, interval=0.02, add_cpu=cpu.append)
        mon.start()
        await seen.wait()  # the monitor is now asleep, due within 20 ms
        seen.clear()
        cpu.clear()
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.3:  # the load being measured: a callback that hogs the loop
            pass
        await seen.wait()
        await mon.stop()
        return samples, cpu

    samples, cpu = asyncio.run(main())
    assert samples[-1] >= 0.3 - 0.02  # wall time >= the 0.3 s of CPU it burned
    assert all(s >= 0 for s in samples)
    assert sum(cpu) >= 0.3 and all(c >= 0 for c in cpu)
    with pytest.raises(ValueError):
        LoopLagMonitor(lambda _: None, interval=0)


def test_lag_is_measured_finer_than_the_loops_clock() -> None:
    """uvloop's `loop.time()` counts whole milliseconds; the lag must not inherit that
    (sub-millisecond lags would all read 0 or 1 ms)."""
    class MillisecondLoop(asyncio.SelectorEventLoop):
        def time(self) -> float:
            return int(time.monotonic() * 1000) / 1000

    async def main() -> list[float]:
        samples: list[float] = []
        mon = LoopLagMonitor(samples.append, interval=0.005)
        mon.start()
        while len(samples) < 8:
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < 0.0025:  # keep the loop ~2.5 ms from the monitor
                pass
            await asyncio.sleep(0)
        await mon.stop()
        return samples

    loop = MillisecondLoop()
    try:
        samples = loop.run_until_complete(main())
    finally:
        loop.close()
    assert any(abs(s * 1000 - round(s * 1000)) > 1e-6 for s in samples), samples


def test_lag_histogram_is_rendered() -> None:
    m = Metrics()
    assert "event_loop_lag" not in m.render()
    for lag in (0.0005, 0.03, 0.3):
        m.observe_loop_lag(lag)
    text = m.render()
    assert 'cosyvoice_event_loop_lag_seconds_bucket{le="0.001"} 1' in text
    assert 'cosyvoice_event_loop_lag_seconds_bucket{le="0.05"} 2' in text
    assert "cosyvoice_event_loop_lag_seconds_count 3" in text
    m.add_loop_cpu(0.25)
    m.add_loop_cpu(0.5)
    assert "cosyvoice_event_loop_cpu_seconds_total 0.75" in m.render()


def test_load_report_reads_the_rendered_metrics() -> None:
    from bench.ws_load import loop_lag_summary, parse_metrics

    m = Metrics()
    before = parse_metrics(m.render())
    for lag in (0.001, 0.03, 0.2, 0.004):
        m.observe_loop_lag(lag)
    m.add_loop_cpu(0.5)
    async def scrape() -> str:  # rendered on a running loop, like the /metrics route
        return m.render()

    summary = loop_lag_summary(parse_metrics(asyncio.run(scrape())), before, window=2.0, audio_s=10.0)
    assert summary == {"loop": "asyncio", "samples": 4, "mean_ms": 58.75, "share_over_20ms": 0.5, "share_over_100ms": 0.25,
                       "busy_share": 0.25, "cpu_ms_per_audio_s": 50.0}
