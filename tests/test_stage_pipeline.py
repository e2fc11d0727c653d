"""Pipelined stage rounds (`AudioStage.pipeline_lead_ms`): the next round is taken and its
kernels queued before the running round's audio is on the host.

On the CPU every copy is complete when the round returns, so these tests stand a gate in for
the CUDA event the copy records (`HostCopy.done`): the round is "on the device" until the
test opens its gate. Everything else is the real stage on the tiny model."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.config import EngineConfig
from engine.token2wav import AudioStage, ChunkJob, HostCopy, check_stage_knobs
from gateway.app import engine_config
from gateway.settings import load_settings
from tests.test_stage_policy import _chunk, flow, hift  # noqa: F401 (the tiny flow and vocoder fixtures)

GUARD_S = 60.0  # a failure guard only: every wait below ends on an event


class Gate:
    """Stands in for a copy's CUDA event: `synchronize` blocks until the test opens it."""

    def __init__(self, fail: bool = False) -> None:
        self.opened = threading.Event()
        self.fail = fail

    def synchronize(self) -> None:
        assert self.opened.wait(GUARD_S), "gate never opened"
        if self.fail:
            raise RuntimeError("device fault")


class GatedStage(AudioStage):
    """The real stage; each asynchronous copy gets a gate, in launch order, and each launch
    is told to the test (`launched`, resolved on the event loop)."""

    def __init__(self, *args, gates: list[Gate], measured: bool = True, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        if measured:
            # A round measured already (as after the engine's warm-up), at 1 ms: each round
            # is predicted to end within the lead, so the next is taken at once.
            self.rounds.observe(10**9, 0.001)
        self.gates = gates
        self.launches: list[int] = []  # seq of each launched batch's first job
        self.launched: dict[int, asyncio.Future[None]] = {}
        self.landing: dict[int, asyncio.Future[None]] = {}  # its delivery task is under way

    async def _land(self, batch: list[ChunkJob], *args) -> None:  # noqa: ANN002
        fut = self.landing.get(batch[0].seq)
        if fut is not None:
            fut.set_result(None)
        await super()._land(batch, *args)

    def _launch(self, batch: list[ChunkJob], asynchronous: bool = False) -> tuple[HostCopy, int, int]:
        copy, flow_work, frames = super()._launch(batch, asynchronous)
        if asynchronous:
            copy.done = self.gates[len(self.launches)]
        seq = batch[0].seq
        self.launches.append(seq)
        fut = self.launched.get(seq)
        if fut is not None:
            fut.get_loop().call_soon_threadsafe(fut.set_result, None)
        return copy, flow_work, frames


def _jobs(stage: AudioStage, n: int) -> list[ChunkJob]:
    return [ChunkJob(flow=_chunk(30 + 4 * i, seed=i), hift_stream=stage.new_stream(), speed=1.0, chunk_index=0,
                     is_cancelled=lambda: False) for i in range(n)]


def _reference(flow, hift, n: int) -> list[np.ndarray]:  # noqa: ANN001
    """The same jobs, one a round, without pipelining."""
    stage = AudioStage(flow, hift, torch.device("cpu"), max_batch=1)

    async def go() -> list[np.ndarray]:
        tasks = [asyncio.create_task(stage.run(j)) for j in _jobs(stage, n)]
        await stage.start()
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            await stage.close()

    return asyncio.run(go())


def test_the_next_round_is_launched_while_the_last_is_on_the_device(flow, hift) -> None:
    gates = [Gate(), Gate(), Gate()]
    stage = GatedStage(flow, hift, torch.device("cpu"), max_batch=1, pipeline_lead_ms=1000.0, gates=gates)

    wall: list[float] = []

    async def go() -> tuple[list[object], list[int]]:
        loop = asyncio.get_running_loop()
        jobs = _jobs(stage, 3)
        stage.launched = {i: loop.create_future() for i in range(3)}
        tasks = [asyncio.create_task(stage.run(j)) for j in jobs]
        wall.append(time.perf_counter())
        await stage.start()
        try:
            # Round 2 is launched while round 1's audio has not reached the host.
            await asyncio.wait_for(stage.launched[1], GUARD_S)
            assert not tasks[0].done() and stage.launches == [0, 1]
            # Round 3 would be two rounds ahead: it waits until round 1 has landed.
            assert not stage.launched[2].done()
            gates[0].opened.set()
            await asyncio.wait_for(stage.launched[2], GUARD_S)
            assert tasks[0].done() and not tasks[1].done()
            gates[1].opened.set()
            gates[2].opened.set()
            out = list(await asyncio.wait_for(asyncio.gather(*tasks), GUARD_S))
            wall.append(time.perf_counter())
            return out, list(stage.launches)
        finally:
            for gate in gates:
                gate.opened.set()
            await stage.close()

    out, launches = asyncio.run(go())
    assert launches == [0, 1, 2]
    # The same audio as one round after another.
    for got, want in zip(out, _reference(flow, hift, 3)):
        assert isinstance(got, np.ndarray) and got.dtype == np.float32
        np.testing.assert_array_equal(got, want)
    st = stage.stats
    assert (st.batches, st.chunks) == (3, 3)
    # Rounds overlapped (each ran from its take until the test opened its gate), but busy
    # time counts each stretch once: within the run's wall.
    assert 0 < st.busy_seconds <= wall[1] - wall[0]
    assert not stage._landing or all(t.done() for t in stage._landing)


def test_pipelining_starts_once_a_round_was_measured(flow, hift) -> None:
    """Before any round was measured there is no prediction: the first round is waited for
    whole. From the second on the next round is taken while the last one is in flight."""
    gates = [Gate(), Gate(), Gate()]
    stage = GatedStage(flow, hift, torch.device("cpu"), max_batch=1, pipeline_lead_ms=1000.0, gates=gates,
                       measured=False)

    async def go() -> None:
        loop = asyncio.get_running_loop()
        stage.launched = {i: loop.create_future() for i in range(3)}
        tasks = [asyncio.create_task(stage.run(j)) for j in _jobs(stage, 3)]
        await stage.start()
        try:
            await asyncio.wait_for(stage.launched[0], GUARD_S)
            gates[0].opened.set()
            await asyncio.wait_for(stage.launched[1], GUARD_S)
            # Round 2 is in flight (its gate shut): round 3 is launched all the same.
            await asyncio.wait_for(stage.launched[2], GUARD_S)
            assert not tasks[1].done()
            gates[1].opened.set()
            gates[2].opened.set()
            await asyncio.wait_for(asyncio.gather(*tasks), GUARD_S)
        finally:
            for gate in gates:
                gate.opened.set()
            await stage.close()

    asyncio.run(go())
    assert stage.stats.batches == 3


def test_a_round_whose_copy_fails_fails_its_chunks_and_the_stage_goes_on(flow, hift) -> None:
    gates = [Gate(fail=True), Gate()]
    stage = GatedStage(flow, hift, torch.device("cpu"), max_batch=1, pipeline_lead_ms=1000.0, gates=gates)

    async def go() -> list[object]:
        tasks = [asyncio.create_task(stage.run(j)) for j in _jobs(stage, 2)]
        await stage.start()
        for gate in gates:
            gate.opened.set()
        try:
            return list(await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), GUARD_S))
        finally:
            await stage.close()

    out = asyncio.run(go())
    assert isinstance(out[0], RuntimeError) and "device fault" in str(out[0])
    assert isinstance(out[1], np.ndarray) and out[1].size > 0
    assert stage.stats.batches == 1  # the failed round delivered nothing


def test_close_delivers_the_rounds_in_flight(flow, hift) -> None:
    gates = [Gate()]
    stage = GatedStage(flow, hift, torch.device("cpu"), max_batch=1, pipeline_lead_ms=1000.0, gates=gates)

    async def go() -> object:
        loop = asyncio.get_running_loop()
        stage.landing = {0: loop.create_future()}
        task = asyncio.create_task(stage.run(_jobs(stage, 1)[0]))
        await stage.start()
        await asyncio.wait_for(stage.landing[0], GUARD_S)
        closing = asyncio.create_task(stage.close())
        gates[0].opened.set()
        await asyncio.wait_for(closing, GUARD_S)
        return task.result()

    pcm = asyncio.run(go())
    assert isinstance(pcm, np.ndarray) and pcm.size > 0


def test_a_delivery_leaves_the_end_of_a_later_round_in_flight(flow, hift) -> None:
    """An utterance's chunk taken into round 2 while its previous chunk's round 1 is in
    flight: round 2's predicted end is where its next chunk's deadline moves from, and round
    1's delivery does not put it back to round 1's end."""
    async def go() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        stage = AudioStage(flow, hift, torch.device("cpu"), pipeline_lead_ms=5.0)
        job = _jobs(stage, 1)[0]
        job.future = loop.create_future()
        stream = job.hift_stream
        stage._latest_round[stream] = 2  # taken again, into round 2
        stage._done_at[stream] = predicted = time.monotonic() + 1.0  # round 2's predicted end
        pcm = np.zeros(4, np.float32)
        now = time.perf_counter()
        stage._deliver([job], [pcm], now, now, now, 0, 0, True, round_id=1)
        kept = stage._done_at[stream]
        stage._deliver([job], [pcm], now, now, now, 0, 0, True, round_id=2)  # round 2's own delivery
        await stage.close()
        assert job.future.result() is pcm
        return kept - predicted, stage._done_at[stream] - predicted

    kept, replaced = asyncio.run(go())
    assert kept == 0.0 and replaced < 0  # round 2 landed before its predicted end


async def _yield_a_few() -> None:
    """Let ready callbacks run (no time passes: `asyncio.sleep(0)` only yields)."""
    for _ in range(5):
        await asyncio.sleep(0)


def test_before_round_waits_for_all_but_the_last_round_and_the_lead(flow, hift) -> None:
    async def go() -> None:
        loop = asyncio.get_running_loop()
        stage = AudioStage(flow, hift, torch.device("cpu"), pipeline_lead_ms=5.0)
        first, last = loop.create_future(), loop.create_future()
        # Two rounds in flight, the last predicted to end well past the lead: wait for both.
        stage._landing = [first, last]  # type: ignore[list-item]
        stage._device_free_at = time.monotonic() + GUARD_S
        waiter = asyncio.create_task(stage._before_round())
        await _yield_a_few()
        assert not waiter.done()
        first.set_result(None)
        await _yield_a_few()
        assert not waiter.done()  # the last one's end is not within the lead
        last.set_result(None)
        await asyncio.wait_for(waiter, GUARD_S)

        # The last round predicted to end within the lead: only the earlier one is waited for.
        first, last = loop.create_future(), loop.create_future()
        stage._landing = [first, last]  # type: ignore[list-item]
        stage._device_free_at = time.monotonic()
        waiter = asyncio.create_task(stage._before_round())
        await _yield_a_few()
        assert not waiter.done()
        first.set_result(None)
        await asyncio.wait_for(waiter, GUARD_S)
        assert not last.done()

        # No prediction yet (no round measured): the whole round.
        last = loop.create_future()
        stage._landing = [last]  # type: ignore[list-item]
        stage._device_free_at = math.inf
        waiter = asyncio.create_task(stage._before_round())
        await _yield_a_few()
        assert not waiter.done()
        last.set_result(None)
        await asyncio.wait_for(waiter, GUARD_S)
        await stage.close()

    asyncio.run(go())


def test_pipeline_lead_is_a_setting_and_a_knob(tmp_path: Path) -> None:
    assert EngineConfig(model_dir=Path(".")).stage_pipeline_lead_ms == 5.0  # on by default (round 51)
    for bad in (-1.0, 1001.0, math.nan):
        with pytest.raises(ValueError, match="stage_pipeline_lead_ms"):
            EngineConfig(model_dir=Path("."), stage_pipeline_lead_ms=bad)
    assert engine_config(load_settings([], environ={})[0], tmp_path).stage_pipeline_lead_ms == 5.0
    config = engine_config(load_settings(["--engine.stage-pipeline-lead-ms", "6"], environ={})[0], tmp_path)
    assert config.stage_pipeline_lead_ms == 6.0
    assert check_stage_knobs({"pipeline_lead_ms": 5}) == {"pipeline_lead_ms": 5.0}
    for bad in (-1, 1001, True, "5", math.nan):
        with pytest.raises(ValueError, match="pipeline_lead_ms"):
            check_stage_knobs({"pipeline_lead_ms": bad})


@pytest.mark.parametrize("lead_ms", [0.0, 1000.0])
def test_a_round_under_way_when_the_stage_closes_cancels_its_chunks(flow, hift, lead_ms: float) -> None:
    """The stage's loop cancelled while the worker still runs a round (`close`): whoever
    waits on that round's chunks is told (cancelled), not left waiting for audio that will
    not come, pipelined or not."""
    launching = threading.Event()
    release = threading.Event()

    class Slow(AudioStage):
        def _launch(self, batch: list[ChunkJob], asynchronous: bool = False) -> tuple[HostCopy, int, int]:
            launching.set()
            assert release.wait(GUARD_S), "never released"
            return super()._launch(batch, asynchronous)

    stage = Slow(flow, hift, torch.device("cpu"), max_batch=1, pipeline_lead_ms=lead_ms)

    async def go() -> ChunkJob:
        job = _jobs(stage, 1)[0]
        stage.submit(job)
        await stage.start()
        try:
            await asyncio.wait_for(job.started, GUARD_S)
            assert await asyncio.to_thread(launching.wait, GUARD_S)
            loop_task = stage._task
            assert loop_task is not None
            loop_task.cancel()
            await asyncio.wait({loop_task}, timeout=GUARD_S)
            assert job.future.cancelled(), "the round's chunk was left waiting"
        finally:
            release.set()
            await stage.close()
        return job

    job = asyncio.run(go())
    assert job.future.cancelled()


def test_a_pipelined_round_cancelled_before_it_lands_cancels_its_chunks(flow, hift) -> None:
    """A landing task cancelled while its round is still on the device (the stage torn down
    without `close`, or a `close` cancelled meanwhile): whoever waits on its chunks is told."""
    gates = [Gate()]
    stage = GatedStage(flow, hift, torch.device("cpu"), max_batch=1, pipeline_lead_ms=1000.0, gates=gates)

    async def go() -> ChunkJob:
        loop = asyncio.get_running_loop()
        stage.landing = {0: loop.create_future()}
        job = _jobs(stage, 1)[0]
        stage.submit(job)
        await stage.start()
        try:
            await asyncio.wait_for(stage.landing[0], GUARD_S)
            landing = stage._landing[-1]
            landing.cancel()
            await asyncio.wait({landing}, timeout=GUARD_S)
            assert job.future.cancelled(), "the round's chunk was left waiting"
        finally:
            gates[0].opened.set()
            await stage.close()
        return job

    assert asyncio.run(go()).future.cancelled()
