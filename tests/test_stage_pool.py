"""Several flow+vocoder stages behind one engine (`engine.stage_devices`), on CPU."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine.config import EngineConfig
from engine.stage_pool import PooledStream, StagePool, build_stage
from engine.token2wav import ChunkJob, _Expected
from engine.types import AudioChunk, SessionOptions
from helpers import assert_same_audio
from tests.test_engine import collect, default_voice, run


def _speak_four(engine):
    async def go():
        voice = await default_voice(engine)
        sessions = []
        for i in range(4):
            s = engine.open_session(voice, SessionOptions(tokens_per_text_token=3.0, seed=i))
            await s.submit(f"Caller {i} would like to hear this sentence.")
            await s.finish()
            sessions.append(s)
        results = await asyncio.gather(*(collect(s) for s in sessions))
        pcm = []
        for events in results:
            assert all(isinstance(e, AudioChunk) for e in events), events
            pcm.append(np.concatenate([e.pcm for e in events]))
        return pcm

    return go()


def test_two_stages_split_the_utterances_and_give_the_same_audio(tiny_model_dir):
    async def pooled(engine):
        assert isinstance(engine.stage, StagePool) and len(engine.stage.stages) == 2
        pcm = await _speak_four(engine)
        per_stage = [s.stats.chunks for s in engine.stage.stages]
        return pcm, per_stage, engine.stats().chunks

    single = run(tiny_model_dir, _speak_four, warmup=False)
    pcm, per_stage, total = run(tiny_model_dir, pooled, warmup=False, stage_devices=("cpu", "cpu"))
    assert all(n > 0 for n in per_stage), per_stage  # both stages did work
    assert total == sum(per_stage)  # the engine's stats add the stages up
    for a, b in zip(single, pcm):
        assert_same_audio(a, b)


def test_pool_places_new_streams_on_the_least_loaded_stage(tiny_model_dir):
    async def fn(engine):
        pool = engine.stage
        first, second = pool.new_stream(), pool.new_stream()
        assert {first.stage_index, second.stage_index} == {0, 1}
        assert pool.load() == [1, 1]
        del first  # its utterance ended: the stage is free again
        third = pool.new_stream()
        assert pool.load() == [1, 1] and third is not None
        with pytest.raises(TypeError):
            await pool.run(ChunkJob(flow=None, hift_stream=object(), speed=1.0, chunk_index=0,  # type: ignore[arg-type]
                                    is_cancelled=lambda: False))
        # A first chunk is expected on the stage its stream is bound to, and only there.
        pool.expect_first_chunk(second, 12.5, 0.3, urgent=False)
        bound, other = pool.stages[second.stage_index], pool.stages[1 - second.stage_index]
        assert dict(bound._coming) == {second.inner: _Expected(12.5, 0.3, urgent=False)} and not other._coming
        with pytest.raises(TypeError):
            pool.expect_first_chunk(object(), 1.0)

    run(tiny_model_dir, fn, warmup=False, stage_devices=("cpu", "cpu"))


def test_a_failed_stage_takes_no_new_streams_and_all_failed_fail_the_engine(tiny_model_dir):
    """A stage whose process died has no live utterances, so by load alone it would take
    every new stream and fail it: placement skips it; with none left the engine is not ready."""
    async def fn(engine):
        pool = engine.stage
        busy = pool.new_stream()  # stage 0 now has one live utterance, stage 1 none
        assert busy.stage_index == 0 and engine.ready
        pool.stages[1].failure = "audio stage process exited (exit code -9)"
        placed = [pool.new_stream() for _ in range(3)]
        assert [s.stage_index for s in placed] == [0, 0, 0]
        assert pool.failure is None and engine.ready  # one stage still serves
        assert engine.stats().stages_failed == 1  # ... and /metrics says at what capacity
        pool.stages[0].failure = "audio stage process exited (exit code -11)"
        assert not engine.ready and "exit code -9" in pool.failure and "exit code -11" in engine.failure
        assert engine.stats().stages_failed == 2
        del pool.stages[0].failure, pool.stages[1].failure  # the engine's close needs them working
        assert engine.ready

    run(tiny_model_dir, fn, warmup=False, stage_devices=("cpu", "cpu"))


def test_registering_a_voice_builds_its_prompt_cache_on_every_stage(tiny_model_dir):
    async def fn(engine):
        await default_voice(engine)
        return [s.prompt_cache.nbytes for s in engine.stage.stages]

    sizes = run(tiny_model_dir, fn, warmup=False, stage_devices=("cpu", "cpu"), flow_prompt_cache=True)
    assert len(sizes) == 2 and all(n > 0 for n in sizes), sizes


def test_a_dead_stage_does_not_fail_a_voice_registration_on_the_others(tiny_model_dir):
    """The engine stays ready with one stage of two dead; registering a voice warms the
    stage that serves and leaves the dead one alone (before, it raised the dead stage's
    error for every registration)."""
    async def fn(engine):
        pool = engine.stage
        dead = pool.stages[1]

        async def refuses(*args, **kwargs):
            raise RuntimeError("audio stage process exited (exit code -9)")

        dead.failure = "audio stage process exited (exit code -9)"
        dead.warm_prompt = dead.warm_graphs = dead.warm_context = refuses
        try:
            await default_voice(engine)
            return engine.ready, pool.stages[0].prompt_cache.nbytes
        finally:
            del dead.failure, dead.warm_prompt, dead.warm_graphs, dead.warm_context

    ready, cached = run(tiny_model_dir, fn, warmup=False, stage_devices=("cpu", "cpu"), flow_prompt_cache=True)
    assert ready and cached > 0


def test_a_stage_whose_close_fails_does_not_leave_the_others_open(tiny_model_dir):
    async def fn(engine):
        pool = engine.stage
        first_close = pool.stages[0].close

        async def fails():
            await first_close()
            raise RuntimeError("the stage's close failed")

        pool.stages[0].close = fails
        with pytest.raises(RuntimeError, match="close failed"):
            await pool.close()
        del pool.stages[0].close  # the engine's own close, after this
        return [s._closed for s in pool.stages]

    assert run(tiny_model_dir, fn, warmup=False, stage_devices=("cpu", "cpu")) == [True, True]


def test_planner_state_gives_each_stage_its_round_times(tiny_model_dir):
    """`GET /debug/planner` with stage_devices (it raised: a StagePool has no one `rounds`):
    each stage's own table, as the first chunks bound to it are planned on it."""
    async def fn(engine):
        engine.stage.stages[1].rounds.observe(4000, 0.05)
        return engine.planner_state(), [s.rounds.snapshot() for s in engine.stage.stages]

    state, tables = run(tiny_model_dir, fn, warmup=False, stage_devices=("cpu", "cpu"))
    assert state["stage_round_times"] == tables and tables[0] == [] and len(tables[1]) == 1
    assert state["stage_live_utterances"] == [0, 0] and state["live_utterances"] == 0
    assert "round_times" not in state  # no one table to show
    json.dumps(state)  # what the endpoint answers


def test_normalised_device_names_the_hardware():
    from engine.stage_pool import normalised_device

    assert normalised_device("cuda") == normalised_device(torch.device("cuda:0")) == torch.device("cuda:0")
    assert normalised_device("cuda:1") == torch.device("cuda:1")
    assert normalised_device("cpu") == normalised_device("cpu:0") == torch.device("cpu")
    for bad in ("cuda:01", "auto", "gpu"):
        with pytest.raises(ValueError, match="not a device"):
            normalised_device(bad)


class _Net:
    """A stand-in for the flow or the vocoder: where `.to` put it (no GPU needed)."""

    def __init__(self) -> None:
        self.device: torch.device | None = None

    def to(self, device: torch.device) -> "_Net":
        self.device = device
        return self


@pytest.mark.parametrize("engine_device, stage_devices, own_on", [
    ("cuda", ("cuda:0", "cuda:1"), 0),  # cuda is cuda:0: the first stage takes the model's own
    ("cuda:0", ("cuda:1", "cuda"), 1),
    ("cuda:1", ("cuda:0", "cuda:1"), 1),  # the model sits on the engine's device, wherever that stage is
    ("cpu", ("cpu", "cpu"), 0),
    ("cuda:2", ("cuda:0", "cuda:1"), None),  # no stage there: copies only
])
def test_a_stage_on_the_engine_device_takes_the_model_own_flow(monkeypatch, engine_device, stage_devices, own_on):
    """No stage copy beside the model's own flow and vocoder on the engine's device, which
    would stay there unused (`cuda:0` and `cuda` compared unequal as torch devices)."""
    import engine.stage_pool as stage_pool

    built = []
    monkeypatch.setattr(stage_pool, "audio_stage",
                        lambda model, dev, config, flow, hift, index: built.append((dev, flow, hift)) or index)
    model = SimpleNamespace(flow=_Net(), hift=_Net())
    config = EngineConfig(model_dir=Path("m"), device=engine_device, lm_backend="torch", stage_devices=stage_devices)
    pool = build_stage(model, torch.device(engine_device), config)
    assert isinstance(pool, StagePool) and pool.stages == list(range(len(stage_devices)))
    for i, (dev, flow, hift) in enumerate(built):
        assert dev == torch.device(stage_devices[i])
        if i == own_on:
            assert flow is model.flow and hift is model.hift
        else:
            assert flow is not model.flow and hift is not model.hift and flow.device == hift.device == dev


def test_the_pools_round_estimate_is_the_bound_stages_with_what_it_was_asked():
    """`StagePool.round_estimate` asks the stage the stream is bound to, passing the
    stream's own handle and how to count the utterances waiting patiently."""
    asked: list[tuple] = []

    class Stage:
        def __init__(self, answer: float) -> None:
            self.answer = answer

        def round_estimate(self, stream, frames, cached=0, skip_patient=False, due_rounds=False):
            asked.append((self.answer, stream, frames, cached, skip_patient, due_rounds))
            return self.answer

    pool = StagePool([Stage(0.1), Stage(0.2)])  # type: ignore[list-item]
    inner = object()
    assert pool.round_estimate(PooledStream(1, inner), 50, 8, False, True) == 0.2
    assert pool.round_estimate(PooledStream(0, inner), 40, skip_patient=True) == 0.1
    assert asked == [(0.2, inner, 50, 8, False, True), (0.1, inner, 40, 0, True, False)]


def test_the_warm_up_teaches_every_stage_its_one_row_rounds(tiny_model_dir):
    """The warm-up's syntheses alone (one-row rounds, so that the first sessions are not planned
    on a burst's round times) ran one after another, so each went to the least-loaded stage,
    the first one on a tie: only stage 0 learnt them, and the first session on another stage
    was planned on the burst's rounds or on none. Each stage gets its own."""
    async def fn(engine):
        return [(s.rounds.observed, s.stats.max_batch_size) for s in engine.stage.stages]

    per_stage = run(tiny_model_dir, fn, warmup=True, warmup_concurrency=1, stage_devices=("cpu", "cpu"))
    assert all(observed > 0 and widest == 1 for observed, widest in per_stage), per_stage
