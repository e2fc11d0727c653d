"""EnginePool: one real tiny engine per device ("cpu" twice here), least-loaded placement,
readiness of every worker, summed stats, and the gateway serving through a pool."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import numpy as np
import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import EngineError
from engine.stats import EngineStats
from engine.pool import EnginePool, combined_stats, create_engine, pool_configs
from engine.types import AudioChunk, SessionOptions

OPTS = SessionOptions(tokens_per_text_token=2.0, seed=3)


def base_config(model_dir: Path) -> EngineConfig:
    return EngineConfig(model_dir=model_dir, device="cpu", lm_backend="torch", warmup=False)


def prompt_wav(seconds: float = 3.0, sr: int = 24000) -> np.ndarray:
    t = np.arange(int(seconds * sr)) / sr
    return (0.3 * np.sin(2 * np.pi * 210 * t)).astype(np.float32)


async def speak(session, text: str) -> np.ndarray:
    await session.submit(text)
    await session.finish()
    parts = [ev.pcm async for ev in session.events() if isinstance(ev, AudioChunk)]
    return np.concatenate(parts)


def test_sessions_go_to_the_least_loaded_worker(tiny_model_dir: Path) -> None:
    async def main() -> None:
        pool = await create_engine(base_config(tiny_model_dir), ("cpu", "cpu"))
        assert isinstance(pool, EnginePool) and len(pool.engines) == 2
        try:
            voice = await pool.prepare_voice("v", prompt_wav(), 24000, "A prompt.")
            s1 = pool.open_session(voice, OPTS)
            s2 = pool.open_session(voice, OPTS)
            s3 = pool.open_session(voice, OPTS)
            e0, e1 = pool.engines
            # Even fill, ties to the lower index.
            assert (s1.engine, s2.engine, s3.engine) == (e0, e1, e0)
            assert pool.loads() == [(2, 0), (1, 0)]
            await s1.abort()
            await s3.abort()
            assert pool.loads() == [(0, 0), (1, 0)]
            s4 = pool.open_session(voice, OPTS)  # now worker 0 is the idle one
            assert s4.engine is e0

            # Both workers really synthesise; same weights and seed give the same audio.
            a0, a1 = await asyncio.gather(speak(s4, "Hello pool."), speak(s2, "Hello pool."))
            assert a0.size > 0 and np.array_equal(a0, a1)
            st = pool.stats()
            assert st.lm_tokens == e0.stats().lm_tokens + e1.stats().lm_tokens > 0
            assert st.chunks == sum(s.chunks for s in pool.worker_stats())
            for s in (s2, s4):
                await s.abort()
        finally:
            await pool.close()
        assert not pool.ready and pool.workers_ready == [False, False]

    asyncio.run(main())


def test_readiness_needs_every_worker(tiny_model_dir: Path) -> None:
    async def main() -> None:
        pool = await create_engine(base_config(tiny_model_dir), ("cpu", "cpu"))
        try:
            voice = await pool.prepare_voice("v", prompt_wav(), 24000, "A prompt.")
            assert pool.ready and pool.workers_ready == [True, True]
            pool.engines[1].ready = False  # one worker still loading (or lost)
            assert not pool.ready and pool.workers_ready == [True, False]
            with pytest.raises(EngineError) as exc:
                pool.open_session(voice, OPTS)
            assert exc.value.code == "not_ready"
            pool.engines[1].ready = True
            pool.open_session(voice, OPTS)
            # SIGTERM's drain sets the pool not ready (it once raised: `ready` had no setter).
            pool.ready = False
            assert pool.workers_ready == [False, False]
            pool.ready = True
            # A worker whose LM died is not ready, says why, and takes no session.
            pool.engines[0].backend.failure = "the vLLM engine core died"  # type: ignore[misc]
            assert pool.workers_ready == [False, True] and pool.failure == "worker 0: the vLLM engine core died"
            del pool.engines[0].backend.failure
        finally:
            await pool.close()

    asyncio.run(main())


def test_pool_configs() -> None:
    base = EngineConfig(model_dir=Path("m"), device="cpu", lm_backend="torch")
    assert pool_configs(base, ()) == [base]
    assert [c.device for c in pool_configs(base, ("cuda:0", "cuda:1"))] == ["cuda:0", "cuda:1"]
    with pytest.raises(EngineError):
        pool_configs(base, ("cuda:0", "cuda:0"))
    with pytest.raises(EngineError) as exc:
        pool_configs(dataclasses.replace(base, lm_backend="vllm"), ("cuda:0", "cuda:1"))
    assert "one gateway per GPU" in str(exc.value)


def test_gateway_serves_through_a_pool(tiny_model_dir: Path, tmp_path: Path) -> None:
    from starlette.testclient import TestClient

    from gateway.app import create_app
    from gateway.settings import EngineSettings, Settings

    settings = Settings(
        model=str(tiny_model_dir), data_dir=tmp_path / "data", assets_dir=Path(__file__).parent.parent / "assets",
        engine=EngineSettings(device="cpu", lm_backend="torch", devices=("cpu", "cpu"), warmup=True),
    )
    with TestClient(create_app(settings)) as client:
        gw = client.app.state.gw
        assert isinstance(gw.engine, EnginePool) and gw.engine.workers_ready == [True, True]
        assert client.get("/ready").status_code == 200
        r = client.post("/v1/audio/speech", json={"model": "tts-1", "input": "Pooled speech.", "voice": "default",
                                                   "response_format": "wav", "tokens_per_text_token": 2.0})
        assert r.status_code == 200 and r.content[:4] == b"RIFF"
        gw.engine.engines[1].ready = False
        assert client.get("/ready").status_code == 503  # readiness reflects every worker
        gw.engine.engines[1].ready = True
        # Each worker plans its own first chunks: /debug/planner shows them all, and tunes them
        # all (with --debug-tuning), or none.
        assert [w["limit"] for w in client.get("/debug/planner").json()["workers"]] == [40, 40]
        gw.settings = dataclasses.replace(gw.settings, debug_tuning=True)
        assert client.post("/debug/planner", json={"min_hop": 99}).status_code == 400
        r = client.post("/debug/planner", json={"min_hop": 8})
        assert r.status_code == 200 and [w["min_hop"] for w in r.json()["workers"]] == [8, 8]
        assert [e.first_chunks.min_hop for e in gw.engine.engines] == [8, 8]


def test_pooled_stats_add_counts_but_not_latest_values() -> None:
    """Two workers' counters add up; a latest plan, a learnt holdback or a start time is the
    largest of the workers', not their sum (a gauge N workers high)."""
    required = dict(active_sessions=0, active_utterances=0, lm_active=0, flow_queue=0, last_batch_size=0, batches=0,
                    dropped_chunks=0, stage_busy_seconds=0.0)
    a = EngineStats(**required, chunks=3, lm_tokens=10, first_chunk_holdback_seconds=0.08, first_chunk_plan_round_seconds=0.03,
                    opening_chunk_plan_lm_step_seconds=0.002, start_lm_seconds=90.0, max_batch_size=4)
    b = dataclasses.replace(a, chunks=5, lm_tokens=1, first_chunk_plan_round_seconds=0.05, start_lm_seconds=80.0,
                            max_batch_size=9)
    st = combined_stats([a, b])
    assert (st.chunks, st.lm_tokens) == (8, 11)
    assert st.first_chunk_holdback_seconds == 0.08 and st.first_chunk_plan_round_seconds == 0.05
    assert st.opening_chunk_plan_lm_step_seconds == 0.002 and st.start_lm_seconds == 90.0 and st.max_batch_size == 9


def test_prepare_voice_featurises_once_and_warms_every_worker(tiny_model_dir: Path) -> None:
    """A registered voice is warmed (graphs, prompt cache) on every worker, not only on the
    one that featurised it: the others would capture and fill their cache while serving."""
    async def main() -> None:
        pool = await create_engine(base_config(tiny_model_dir), ("cpu", "cpu"))
        try:
            calls: list[int] = []

            def counted(featurize, worker: int):
                def featurize_counted(*args):
                    calls.append(worker)
                    return featurize(*args)
                return featurize_counted

            for i, e in enumerate(pool.engines):
                e.featurizer.featurize = counted(e.featurizer.featurize, i)
            voice = await pool.prepare_voice("v", prompt_wav(), 24000, "A prompt.")
            assert len(calls) == 1  # the features once: they are the same on every worker
            for e in pool.engines:
                assert voice.num_tokens in e._warmed_prompts
                assert e.stats().prompt_cache_bytes > 0
        finally:
            await pool.close()

    asyncio.run(main())


def test_pool_refusal_says_why(tiny_model_dir: Path) -> None:
    """A pool that takes no session says why, as a single engine does: a failed worker and
    its failure, or a drain; not "still loading" for both."""
    async def main() -> None:
        pool = await create_engine(base_config(tiny_model_dir), ("cpu", "cpu"))
        try:
            voice = await pool.prepare_voice("v", prompt_wav(), 24000, "A prompt.")
            pool.engines[1].backend.failure = "the LM died"  # type: ignore[attr-defined]
            with pytest.raises(EngineError, match="^worker 1: the LM died$") as exc:
                pool.open_session(voice, OPTS)
            assert exc.value.code == "not_ready"
            del pool.engines[1].backend.failure
            pool.ready = False  # SIGTERM's drain
            with pytest.raises(EngineError, match=r"^engine is not serving \(draining\)$"):
                pool.open_session(voice, OPTS)
            with pytest.raises(EngineError, match="draining"):
                await pool.prepare_voice("w", prompt_wav(), 24000, "A prompt.")
        finally:
            await pool.close()

    asyncio.run(main())


def _failing_stage_close(engine: Engine) -> list[bool]:
    """Make the engine's stage close raise (after closing) and record its LM backend's close."""
    stage_close, backend_close = engine.stage.close, engine.backend.close
    closed: list[bool] = []

    async def failing_stage_close() -> None:
        await stage_close()
        raise RuntimeError("stage close failed")

    async def spied_backend_close() -> None:
        closed.append(True)
        await backend_close()

    engine.stage.close = failing_stage_close  # type: ignore[method-assign]
    engine.backend.close = spied_backend_close  # type: ignore[method-assign]
    return closed


def test_close_logs_a_worker_failure_and_still_stops_its_lm(tiny_model_dir: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """A worker whose stage close raises still closes its LM backend (vLLM's engine core would
    keep running), and the pool says which worker failed instead of dropping the error."""
    async def main() -> list[bool]:
        pool = await create_engine(base_config(tiny_model_dir), ("cpu", "cpu"))
        worker = pool.engines[1]
        closed = _failing_stage_close(worker)
        await pool.close()
        assert not worker.ready and not pool.ready
        return closed

    with caplog.at_level("ERROR", logger="engine.pool"):
        assert asyncio.run(main()) == [True]
    failed = [r for r in caplog.records if r.name == "engine.pool"]
    assert len(failed) == 1 and "worker 1" in failed[0].getMessage()
    assert "stage close failed" in str(failed[0].exc_info[1])


def test_engine_close_raises_the_stage_error_after_closing_the_lm(tiny_model_dir: Path) -> None:
    async def main() -> None:
        engine = await Engine.create(base_config(tiny_model_dir))
        closed = _failing_stage_close(engine)
        with pytest.raises(RuntimeError, match="stage close failed"):
            await engine.close()
        assert closed == [True] and not engine.ready

    asyncio.run(main())


def test_pool_configs_compare_devices_not_spellings() -> None:
    """`cuda` is `cuda:0`: two engines there would share one GPU."""
    base = EngineConfig(model_dir=Path("m"), device="cpu", lm_backend="torch")
    for same in (("cuda", "cuda:0"), ("cuda:0", "cuda"), ("cuda:1", "cuda:0", "cuda:1")):
        with pytest.raises(EngineError, match="only one engine") as exc:
            pool_configs(base, same)
        assert exc.value.code == "bad_config"
    assert [c.device for c in pool_configs(base, ("cuda", "cuda:1"))] == ["cuda", "cuda:1"]
    assert len(pool_configs(base, ("cpu", "cpu"))) == 2  # CPU workers share the CPU
    with pytest.raises(EngineError, match="not a device"):
        pool_configs(base, ("cuda:01", "cuda:1"))


def test_pool_configs_refuse_devices_with_stage_devices() -> None:
    """Each worker would put a stage copy on every stage device."""
    base = EngineConfig(model_dir=Path("m"), device="cpu", lm_backend="torch", stage_devices=("cuda:2", "cuda:3"))
    with pytest.raises(EngineError, match="does not combine with engine.stage_devices"):
        pool_configs(base, ("cuda:0", "cuda:1"))
    # One engine on one device with its stage copies is the stage pool's own layout.
    assert [c.stage_devices for c in pool_configs(base, ("cuda:0",))] == [("cuda:2", "cuda:3")]


def test_pool_configs_refuse_vllm_off_the_first_gpu() -> None:
    """vLLM runs on the first GPU the process sees whatever the device says: cuda:1 is refused
    (CUDA_VISIBLE_DEVICES picks its GPU), not silently served from GPU 0."""
    base = EngineConfig(model_dir=Path("m"), device="cuda:1", lm_backend="vllm")
    with pytest.raises(EngineError, match="CUDA_VISIBLE_DEVICES=1"):
        pool_configs(base, ())
    with pytest.raises(EngineError, match="CUDA_VISIBLE_DEVICES=2"):
        pool_configs(dataclasses.replace(base, device="cpu"), ("cuda:2",))
    for device in ("cuda", "cuda:0"):
        assert pool_configs(dataclasses.replace(base, device=device), ()) == [dataclasses.replace(base, device=device)]
    torch_lm = dataclasses.replace(base, lm_backend="torch")
    assert pool_configs(torch_lm, ()) == [torch_lm]  # the torch backend runs on the device it is given


def test_each_worker_profiles_into_its_own_folder(tiny_model_dir: Path, tmp_path: Path) -> None:
    """With several workers every stage counts from stage0: per worker folders keep their
    profiles apart instead of overwriting each other in <dir>/stage0."""
    base = dataclasses.replace(base_config(tiny_model_dir), stage_profile_dir=str(tmp_path))
    assert [c.stage_profile_dir for c in pool_configs(base, ("cpu", "cpu"))] == \
        [str(tmp_path / "worker0"), str(tmp_path / "worker1")]
    assert pool_configs(base, ("cpu",))[0].stage_profile_dir == str(tmp_path)  # one engine: as before

    async def main() -> list[Path]:
        pool = await create_engine(base, ("cpu", "cpu"))
        try:
            return [e.stage.profiler.out_dir for e in pool.engines]
        finally:
            await pool.close()

    assert asyncio.run(main()) == [tmp_path / "worker0" / "stage0", tmp_path / "worker1" / "stage0"]
