"""`engine.stage_profile_dir`: the audio stage profiles a window of its own batches while
serving and writes a per-batch report and an operator table (CPU here: no GPU busy figures)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.stage_profile import (
    PHASES,
    StageProfiler,
    batch_ranges,
    graph_launch_ranges,
    kernel_intervals,
    launch_delays,
    phase_split,
    union_within,
)
from engine.token2wav import StageStats
from engine.types import SessionOptions


async def _speak(cfg: EngineConfig, stats: list[StageStats] | None = None) -> int:
    """One utterance at a time (each chunk then is a batch of its own); the stage's batches
    (and its stats, appended to `stats`)."""
    engine = await Engine.create(cfg)
    try:
        sr = engine.sample_rate
        wav = (0.1 * np.sin(2 * np.pi * 180 * np.arange(2 * sr) / sr)).astype(np.float32)
        voice = await engine.prepare_voice("v", wav, sr, "A prompt.")
        opts = SessionOptions(tokens_per_text_token=3.0, seed=0)
        for text in ("Hello there, my friend, how are you?", "One two three four five six seven."):
            await engine.synthesize(text, voice, opts)
        if stats is not None:
            stats.append(engine.stage.stats)
        return engine.stage.stats.batches
    finally:
        await engine.close()


def _config(tiny_model_dir, out, start: int, count: int) -> EngineConfig:  # noqa: ANN001
    return EngineConfig(model_dir=tiny_model_dir, device="cpu", lm_backend="torch", warmup=False, initial_hop=5,
                        max_hop=25, seed=0, stage_profile_dir=str(out), stage_profile_start=start,
                        stage_profile_batches=count)


def test_the_stage_writes_a_profile_of_its_batches(tiny_model_dir, tmp_path) -> None:  # noqa: ANN001
    batches = asyncio.run(_speak(_config(tiny_model_dir, tmp_path / "prof", start=1, count=2)))
    assert batches >= 4  # two utterances of at least two chunks each, one after the other
    report = json.loads((tmp_path / "prof" / "stage0" / "stage_profile.json").read_text())
    assert [b["batch"] for b in report["batches"]] == [1, 2]
    assert all(b["chunks"] == 1 and b["wall_ms"] > 0 for b in report["batches"])
    assert "gpu_busy_ms" not in report  # CPU: no kernel timeline
    for b in report["batches"]:  # each batch split by its phases: the flow, the vocoder, the copy out
        assert set(b["phases"]) == set(PHASES)
        assert all(p["host_ms"] > 0 and "gpu_idle_ms" not in p for p in b["phases"].values())
        assert sum(p["host_ms"] for p in b["phases"].values()) <= b["wall_ms"]
    table = (tmp_path / "prof" / "stage0" / "stage_profile.txt").read_text()
    assert "stage_batch_1" in table and "aten::" in table


def test_the_window_counts_batches_from_the_end_of_the_start(tiny_model_dir, tmp_path) -> None:  # noqa: ANN001
    """The warm-up's batches come before index 0: `stage_profile_start` 0 profiles the first
    batches that serve requests, whatever the warm-up ran."""
    cfg = replace(_config(tiny_model_dir, tmp_path / "prof", start=0, count=1), warmup=True, warmup_concurrency=2)
    stats: list[StageStats] = []
    batches = asyncio.run(_speak(cfg, stats))
    report = json.loads((tmp_path / "prof" / "stage0" / "stage_profile.json").read_text())
    (profiled,) = [b["batch"] for b in report["batches"]]
    assert 0 < profiled < batches  # after the warm-up's batches (counted from the stage's first)


def test_a_window_cut_short_by_closing_is_written(tiny_model_dir, tmp_path) -> None:  # noqa: ANN001
    """The engine closes before the window is full: the profiler is stopped on the worker
    thread (a profiler left running crashes the interpreter at exit) and what it holds is
    written."""
    batches = asyncio.run(_speak(_config(tiny_model_dir, tmp_path / "prof", start=0, count=1000)))
    report = json.loads((tmp_path / "prof" / "stage0" / "stage_profile.json").read_text())
    assert [b["batch"] for b in report["batches"]] == list(range(batches))


def test_profiled_batches_are_not_rounds(tiny_model_dir, tmp_path) -> None:  # noqa: ANN001
    """Batches run under the profiler (its start and stop inside them) are not what a
    round takes: the first-chunk planner's round times leave them out."""
    async def observed(cfg: EngineConfig) -> tuple[int, int]:
        engine = await Engine.create(cfg)
        try:
            sr = engine.sample_rate
            wav = (0.1 * np.sin(2 * np.pi * 180 * np.arange(2 * sr) / sr)).astype(np.float32)
            voice = await engine.prepare_voice("v", wav, sr, "A prompt.")
            await engine.synthesize("Hello there, my friend.", voice, SessionOptions(tokens_per_text_token=3.0, seed=0))
            return engine.stage.stats.batches, engine.stage.rounds.observed
        finally:
            await engine.close()

    cfg = _config(tiny_model_dir, tmp_path / "prof", start=1, count=1)
    batches, rounds = asyncio.run(observed(cfg))
    assert batches >= 2 and rounds == batches - 1  # all but the profiled one
    batches, rounds = asyncio.run(observed(replace(cfg, stage_profile_dir="")))
    assert rounds == batches


def test_the_window_opens_at_the_first_batch_of_the_requested_size(tmp_path) -> None:  # noqa: ANN001
    """`min_chunks` skips the small batches before a load level; once open, the window
    takes every batch, small ones too."""
    prof = StageProfiler(tmp_path, start=1, count=3, min_chunks=4)
    sizes = [8, 1, 2, 5, 1, 9, 7]
    assert [prof.run(i, n, lambda n=n: n * 10) for i, n in enumerate(sizes)] == [n * 10 for n in sizes]
    prof.close()  # waits for the writer thread
    report = json.loads((tmp_path / "stage_profile.json").read_text())
    assert [(b["batch"], b["chunks"]) for b in report["batches"]] == [(3, 5), (4, 1), (5, 9)]


def test_the_stage_counts_its_handoffs_inside_its_busy_time(tiny_model_dir, tmp_path) -> None:  # noqa: ANN001
    """Each batch's busy time = worker pickup + compute + event-loop resume; the two
    hand-offs are counted apart (the wait for a busy loop or interpreter, not the device)."""
    seen: list[StageStats] = []
    cfg = EngineConfig(model_dir=tiny_model_dir, device="cpu", lm_backend="torch", warmup=False, initial_hop=5,
                       max_hop=25, seed=0)
    batches = asyncio.run(_speak(cfg, seen))
    (st,) = seen
    assert batches >= 4 and st.batches == batches
    assert 0 < st.handoff_seconds < st.busy_seconds


def test_profile_settings_are_validated(tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match="stage_profile"):
        EngineConfig(model_dir=tmp_path, stage_profile_batches=0)
    with pytest.raises(ValueError, match="stage_profile"):
        EngineConfig(model_dir=tmp_path, stage_profile_min_chunks=-1)


def test_gpu_busy_is_the_union_of_kernel_intervals() -> None:
    kernels = [(0.0, 10.0), (5.0, 12.0), (20.0, 25.0), (30.0, 40.0)]
    assert union_within(kernels, 0.0, 100.0) == 12.0 + 5.0 + 10.0  # overlaps counted once
    assert union_within(kernels, 8.0, 35.0) == 4.0 + 5.0 + 5.0  # clipped to the batch
    assert union_within([], 0.0, 1.0) == 0.0


def test_busy_time_counts_kernels_not_the_gpu_copies_of_annotations() -> None:
    """On CUDA the profiler also puts each `stage_batch_N` range on the GPU timeline; counted
    as a kernel it made every batch look 100% busy (the first H200 profile)."""
    from types import SimpleNamespace

    def event(name: str, start: float, end: float, cuda: bool = True, annotation: bool = False) -> SimpleNamespace:
        device = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), device_type=device,
                               is_user_annotation=annotation)

    events = [event("stage_batch_3", 0, 100, annotation=True), event("stage_batch_4", 100, 200),
              event("stage.flow", 0, 60), event("gemm", 30, 40), event("aten::mm", 0, 100, cuda=False),
              event("attn", 10, 20)]
    assert kernel_intervals(events) == [(10, 20), (30, 40)]  # nor those of the phases


def test_a_batch_lasts_as_long_as_its_host_range() -> None:
    """The GPU copy of a batch's range starts later than the host range: the wall time
    is the host's (the first H200 profile read the GPU copies)."""
    from types import SimpleNamespace

    def event(name: str, start: float, end: float, cuda: bool) -> SimpleNamespace:
        device = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), device_type=device,
                               is_user_annotation=True)

    events = [event("stage_batch_1", 0, 100, cuda=False), event("stage_batch_1", 30, 90, cuda=True),
              event("stage_batch_2", 100, 180, cuda=False), event("stage_batch_2", 150, 170, cuda=True)]
    assert batch_ranges(events) == {"stage_batch_1": (0, 100), "stage_batch_2": (100, 180)}


def test_phase_split_counts_the_gpu_idle_inside_each_phase() -> None:
    """Host ranges of the phases against a kernel timeline (us): idle = the phase's time
    with no kernel running, a repeated phase summed, ranges clipped to the batch."""
    phases = [("stage.flow", 0.0, 1000.0), ("stage.flow", 1500.0, 2000.0), ("stage.vocoder", 2000.0, 2600.0),
              ("stage.to_host", 2600.0, 3200.0)]
    kernels = [(200.0, 900.0), (1700.0, 2300.0), (2500.0, 3000.0)]
    split = phase_split(phases, kernels, 100.0, 3100.0)
    assert split["stage.flow"] == pytest.approx({"host_ms": 1.4, "gpu_idle_ms": 0.2 + 0.2})
    assert split["stage.vocoder"] == pytest.approx({"host_ms": 0.6, "gpu_idle_ms": 0.2})
    assert split["stage.to_host"] == pytest.approx({"host_ms": 0.5, "gpu_idle_ms": 0.1})
    assert phase_split(phases, None, 0.0, 500.0) == {"stage.flow": {"host_ms": 0.5}}


def test_graph_launches_say_when_the_gpu_started() -> None:
    """Each cudaGraphLaunch call inside the batch (us): its host time and how long after
    it began the GPU started a kernel; a kernel already running before it does not count."""
    from types import SimpleNamespace

    def event(name: str, start: float, end: float) -> SimpleNamespace:
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end),
                               device_type=torch.autograd.DeviceType.CPU)

    launches = graph_launch_ranges([event("cudaGraphLaunch_v10000", 1000.0, 3700.0), event("aten::mm", 0.0, 50.0),
                                    event("cudaGraphLaunch", 6000.0, 6100.0), event("cudaGraphLaunch", 9000.0, 9100.0)])
    assert launches == [(1000.0, 3700.0), (6000.0, 6100.0), (9000.0, 9100.0)]
    kernels = [(500.0, 1200.0), (3600.0, 3650.0), (6300.0, 7000.0)]
    got = launch_delays(launches, kernels, 0.0, 8000.0)  # the third launch is after the batch
    assert got == [pytest.approx({"host_ms": 2.7, "gpu_start_ms": 2.6}),
                   pytest.approx({"host_ms": 0.1, "gpu_start_ms": 0.3})]
    assert launch_delays(launches[1:2], kernels[:2], 0.0, 8000.0) == [{"host_ms": pytest.approx(0.1), "gpu_start_ms": None}]
