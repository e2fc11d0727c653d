"""`engine.stage_profile_dir`: the audio stage profiles a window of its own batches while
serving and writes a per-batch report and an operator table (CPU here: no GPU busy figures)."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.stage_profile import _union_within
from engine.types import SessionOptions


async def _speak(cfg: EngineConfig) -> int:
    engine = await Engine.create(cfg)
    try:
        sr = engine.sample_rate
        wav = (0.1 * np.sin(2 * np.pi * 180 * np.arange(2 * sr) / sr)).astype(np.float32)
        voice = await engine.prepare_voice("v", wav, sr, "A prompt.")
        opts = SessionOptions(tokens_per_text_token=3.0, seed=0)
        await asyncio.gather(*(engine.synthesize(t, voice, opts) for t in ("Hello there, friend.", "One two three.")))
        return engine.stage.stats.batches
    finally:
        await engine.close()


def test_the_stage_writes_a_profile_of_its_batches(tiny_model_dir, tmp_path) -> None:  # noqa: ANN001
    cfg = EngineConfig(model_dir=tiny_model_dir, device="cpu", lm_backend="torch", warmup=False, initial_hop=5,
                       max_hop=25, seed=0, stage_profile_dir=str(tmp_path / "prof"), stage_profile_start=1,
                       stage_profile_batches=2)
    batches = asyncio.run(_speak(cfg))
    assert batches >= 3  # the window (batches 1 and 2) was reached
    report = json.loads((tmp_path / "prof" / "stage0" / "stage_profile.json").read_text())
    assert [b["batch"] for b in report["batches"]] == [1, 2]
    assert all(b["chunks"] >= 1 and b["wall_ms"] > 0 for b in report["batches"])
    assert "gpu_busy_ms" not in report  # CPU: no kernel timeline
    table = (tmp_path / "prof" / "stage0" / "stage_profile.txt").read_text()
    assert "stage_batch_1" in table and "aten::" in table


def test_profile_settings_are_validated(tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match="stage_profile"):
        EngineConfig(model_dir=tmp_path, stage_profile_batches=0)


def test_gpu_busy_is_the_union_of_kernel_intervals() -> None:
    kernels = [(0.0, 10.0), (5.0, 12.0), (20.0, 25.0), (30.0, 40.0)]
    assert _union_within(kernels, 0.0, 100.0) == 12.0 + 5.0 + 10.0  # overlaps counted once
    assert _union_within(kernels, 8.0, 35.0) == 4.0 + 5.0 + 5.0  # clipped to the batch
    assert _union_within([], 0.0, 1.0) == 0.0
