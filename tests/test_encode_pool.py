"""EncodePool: Opus off the event loop, same bytes, order kept, cancellation-safe."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import AsyncIterator

import numpy as np

from gateway.audio import AudioFormat, make_encoder
from gateway.encode_pool import EncodePool

SR = 24000


def speechlike(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * SR)) / SR
    return (0.2 * np.sin(2 * np.pi * 180 * t) * (1 + np.sin(2 * np.pi * 3 * t)) + 0.02 * rng.standard_normal(t.size)).astype(np.float32)


def test_pooled_opus_streams_match_inline_encoding() -> None:
    chunks = {s: np.array_split(speechlike(1.3, s), 5) for s in range(6)}

    def inline(seed: int) -> list[bytes]:
        enc = make_encoder("opus", 48000)
        return [f for c in chunks[seed] for f in enc.encode(c)] + enc.flush()

    async def pooled(pool: EncodePool, seed: int) -> list[bytes]:
        enc = make_encoder("opus", 48000)
        out: list[bytes] = []
        for c in chunks[seed]:
            out += await pool.encode(enc, c)
        return out + await pool.flush(enc)

    async def main() -> list[list[bytes]]:
        pool = EncodePool(3)
        try:
            return await asyncio.gather(*(pooled(pool, s) for s in chunks))
        finally:
            pool.close()

    got = asyncio.run(main())
    assert got == [inline(s) for s in chunks]  # six interleaved streams, each in order, bit-exact


class _GatedEncoder:
    """An encoder whose work blocks until the test opens the gate."""

    format = AudioFormat("opus", 48000)
    inline = False

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.finished = False
        self.threads: list[str] = []

    def encode(self, pcm: np.ndarray) -> list[bytes]:
        self.threads.append(threading.current_thread().name)
        self.entered.set()
        self.gate.wait()
        self.finished = True
        return [b"x"]

    def flush(self) -> list[bytes]:
        return []


@contextlib.asynccontextmanager
async def _pool(threads: int, *gated: _GatedEncoder) -> AsyncIterator[EncodePool]:
    """A pool that is closed, and whose gated encoders are released, however the test ends."""
    pool = EncodePool(threads)
    try:
        yield pool
    finally:
        for enc in gated:
            enc.gate.set()
        pool.close()


ZEROS = np.zeros(10, np.float32)


def test_cancelled_caller_waits_for_the_thread_to_release_the_encoder() -> None:
    async def main() -> None:
        enc = _GatedEncoder()
        async with _pool(1, enc) as pool:
            task = asyncio.create_task(pool.encode(enc, ZEROS))
            await asyncio.to_thread(enc.entered.wait)
            task.cancel()
            done, _ = await asyncio.wait([task], timeout=0.2)
            assert not done  # still owned by the thread: the caller must not clean up yet
            enc.gate.set()
            try:
                await task
                raise AssertionError("the task should end cancelled")
            except asyncio.CancelledError:
                pass
            assert enc.finished
            assert enc.threads[0].startswith("encode")

    asyncio.run(main())


def test_cancelling_a_queued_encode_returns_at_once_and_it_never_runs() -> None:
    async def main() -> None:
        busy, queued = _GatedEncoder(), _GatedEncoder()
        queued.gate.set()
        async with _pool(1, busy) as pool:
            first = asyncio.create_task(pool.encode(busy, ZEROS))
            await asyncio.to_thread(busy.entered.wait)  # the one thread is taken
            second = asyncio.create_task(pool.encode(queued, ZEROS))
            await asyncio.sleep(0)  # let it reach the queue
            second.cancel()
            # Returns while the thread is still blocked: a barge-in does not wait for
            # other streams' queued chunks (a wait here would hang until the timeout).
            done, _ = await asyncio.wait([second], timeout=30)
            assert done and second.cancelled() and not busy.finished
            busy.gate.set()
            assert await first == [b"x"]
            assert queued.threads == []  # cancelled before it started: never ran

    asyncio.run(main())


def test_a_second_cancel_still_waits_for_the_running_encode() -> None:
    async def main() -> None:
        enc = _GatedEncoder()
        async with _pool(1, enc) as pool:
            task = asyncio.create_task(pool.encode(enc, ZEROS))
            await asyncio.to_thread(enc.entered.wait)
            task.cancel()
            await asyncio.sleep(0)
            task.cancel()  # e.g. the pump cancelled by a client cancel and by connection teardown
            done, _ = await asyncio.wait([task], timeout=0.2)
            assert not done
            enc.gate.set()
            await asyncio.wait([task])
            assert task.cancelled() and enc.finished

    asyncio.run(main())


def test_a_closed_pool_encodes_on_the_loop() -> None:
    async def main() -> None:
        pool = EncodePool(2)
        pool.close()
        enc = _GatedEncoder()
        enc.gate.set()
        assert await pool.encode(enc, ZEROS) == [b"x"]
        assert enc.threads == [threading.current_thread().name]

    asyncio.run(main())


def test_zero_threads_and_cheap_formats_stay_on_the_loop() -> None:
    async def main() -> None:
        enc = _GatedEncoder()
        enc.gate.set()
        await EncodePool(0).encode(enc, ZEROS)
        pcm = make_encoder("pcm_s16le", 24000)
        pool = EncodePool(2)
        try:
            assert await pool.encode(pcm, np.full(5, 0.5, np.float32)) == [np.full(5, 16384, "<i2").tobytes()]
        finally:
            pool.close()
        assert enc.threads == [threading.current_thread().name]

    asyncio.run(main())


def test_host_cost_bench_reports_every_format_and_loop_run(tmp_path) -> None:
    from bench.host_cost import FORMATS, main

    out = tmp_path / "cost.json"
    report = main(["--seconds", "2", "--reps", "1", "--complexities", "0,10", "--streams", "3",
                   "--threads", "2", "--loop-seconds", "0.5", "--json", str(out)])
    tp = report["text_path"]
    # "Thanks for calling," (an early first clause), then the three sentence ends
    assert tp["segments_per_context"] == 4 and tp["cpu_us_per_message"] > 0
    assert [(r["format"], r["sample_rate"]) for r in report["formats"]] == list(FORMATS)
    cost = {(r["format"], r["sample_rate"]): r["cpu_ms_per_audio_s"] for r in report["formats"]}
    assert cost[("opus", 48000)] > cost[("pcm_s16le", 24000)] > 0  # a codec costs more than a cast
    assert [r["complexity"] for r in report["opus_complexity"]] == [0, 10]
    assert [(r["streams"], r["threads"]) for r in report["loop"]] == [(3, 0), (3, 2)]
    assert all(r["loop_lag_ms"]["samples"] > 0 and r["wall_s"] >= 0.5 for r in report["loop"])
