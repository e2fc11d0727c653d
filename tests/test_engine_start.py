"""The engine's start: its steps are timed, and with `overlap_start` the LM starts while
the audio stage is built and the flow warmed, to the same engine."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

import engine.engine as engine_mod
from engine.backends.torch_backend import TorchLMBackend
from engine.config import EngineConfig
from engine.engine import Engine
from engine.types import SessionOptions
from tests.test_engine import default_voice


def start_and_speak(model_dir: Path, overlap: bool) -> tuple[list[str], np.ndarray]:
    async def main() -> tuple[list[str], np.ndarray]:
        engine = await Engine.create(EngineConfig(model_dir=model_dir, device="cpu", lm_backend="torch",
                                                  initial_hop_max=0, chunk_patience_s=0.0, warmup_concurrency=0,
                                                  overlap_start=overlap))
        try:
            assert engine.ready
            voice = await default_voice(engine)
            audio = await engine.synthesize("Two short sentences. Then one more.", voice,
                                            SessionOptions(tokens_per_text_token=3.0, seed=7))
            stats = engine.stats()
            assert stats.start_load_seconds > 0 and stats.start_voice_seconds > 0  # exported as they are
            return list(engine.start_seconds), audio
        finally:
            await engine.close()

    return asyncio.run(main())


def test_overlapped_start_gives_the_same_engine(tiny_model_dir: Path) -> None:
    steps, audio = start_and_speak(tiny_model_dir, overlap=False)
    assert steps == ["load", "lm", "stage", "voice", "warmup"]
    overlapped_steps, overlapped_audio = start_and_speak(tiny_model_dir, overlap=True)
    # The LM is waited for after the stage and the warm-up voice: "lm" is what was left.
    assert overlapped_steps == ["load", "stage", "voice", "lm", "warmup"]
    assert audio.size > 0 and np.array_equal(audio, overlapped_audio)


def test_a_failed_overlapped_start_closes_the_started_lm(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    closed: list[bool] = []
    real_close = TorchLMBackend.close

    async def close(self: TorchLMBackend) -> None:
        closed.append(True)
        await real_close(self)

    def broken_stage(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no stage today")

    monkeypatch.setattr(TorchLMBackend, "close", close)
    monkeypatch.setattr(engine_mod, "build_stage", broken_stage)
    with pytest.raises(RuntimeError, match="no stage today"):
        asyncio.run(Engine.create(EngineConfig(model_dir=tiny_model_dir, device="cpu", lm_backend="torch",
                                               overlap_start=True)))
    assert closed == [True]


def test_a_cancelled_overlapped_start_closes_the_lm_once_it_is_up(tiny_model_dir: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Cancelled while the LM is still starting (vLLM: built in a worker thread that cannot
    be stopped), the start waits for it and closes it rather than leave it running."""
    closed: list[bool] = []
    real_start, real_close = TorchLMBackend.start, TorchLMBackend.close
    real_voice = Engine._warmup_voice

    async def main() -> None:
        began, release, warmed = asyncio.Event(), asyncio.Event(), asyncio.Event()

        async def warmup_voice(self: Engine):  # type: ignore[no-untyped-def]
            voice = await real_voice(self)
            warmed.set()  # from here `create` runs on to its wait for the LM, and stops there
            return voice

        async def slow_start(self: TorchLMBackend) -> None:
            began.set()
            await release.wait()
            await real_start(self)

        async def close(self: TorchLMBackend) -> None:
            closed.append(self._task is not None)  # it had started
            await real_close(self)

        monkeypatch.setattr(TorchLMBackend, "start", slow_start)
        monkeypatch.setattr(TorchLMBackend, "close", close)
        monkeypatch.setattr(Engine, "_warmup_voice", warmup_voice)
        create = asyncio.create_task(Engine.create(EngineConfig(
            model_dir=tiny_model_dir, device="cpu", lm_backend="torch", overlap_start=True)))
        await began.wait()
        await warmed.wait()
        create.cancel()
        release.set()  # the LM comes up only after the cancellation
        with pytest.raises(asyncio.CancelledError):
            await create

    asyncio.run(main())
    assert closed == [True]


@pytest.mark.parametrize("max_rows", [10, 64])
def test_a_voice_warms_every_row_bucket_of_the_policy(tiny_model_dir: Path, max_rows: int) -> None:
    """Registering a voice captures its graphs at the policy's own row buckets, so a cap
    that is no default bucket (10) is warmed too, not first captured under load."""
    async def main() -> set[int]:
        engine = await Engine.create(EngineConfig(model_dir=tiny_model_dir, device="cpu", lm_backend="torch",
                                                  warmup=False, flow_graph_max_rows=max_rows))
        shapes: list[tuple[int, ...]] = []

        async def warm_graphs(batch: list[tuple[int, ...]]) -> int:
            shapes.extend(batch)
            return len(batch)

        engine.stage.warm_graphs = warm_graphs  # type: ignore[method-assign]
        try:
            await default_voice(engine)
        finally:
            await engine.close()
        return {s[0] for s in shapes}

    rows = asyncio.run(main())
    assert rows == set(engine_mod.graph_policy(EngineConfig(model_dir=tiny_model_dir,
                                                             flow_graph_max_rows=max_rows)).batch_buckets)
    assert max_rows in rows
