"""EnginePool: one real tiny engine per device ("cpu" twice here), least-loaded placement,
readiness of every worker, summed stats, and the gateway serving through a pool."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import numpy as np
import pytest

from engine.config import EngineConfig
from engine.engine import EngineError, EngineStats
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
