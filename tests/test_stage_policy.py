"""The audio stage's opt-in batching options (issue #12), on CPU with the tiny model:

* `deadline_batch`, the pure selection of the "deadline" policy (order, window grouping,
  max_batch, ties);
* the stage picking its batches with it (and still dropping cancelled chunks), while the
  default policy keeps "first chunks first, then FIFO";
* the engine under `stage_policy="deadline"`: the same audio as the default policy, every
  chunk present and in order, deadlines as documented;
* `flow_graph_max_rows`: batches above the cap skip the graph path;
* both options through Settings (YAML, env, flags) into the EngineConfig.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.config import DEADLINE_MARGIN_S, EngineConfig
from engine.first_chunk import RoundTimes
from helpers import assert_same_audio
from engine.playback import chunk_due
from engine.stage_pool import build_stage
from engine.flow_graphs import FlowGraphRunner, GraphPolicy
from engine.models.config import ModelConfig
from engine.models.flow import CausalMaskedDiffWithDiT, FlowChunk, init_random_
from engine.models.hift import CausalHiFTGenerator
from engine.models.hift import init_random_ as hift_init_random_
from engine.token2wav import (AudioStage, BatchCandidate, BatchStart, ChunkJob, call_work, check_stage_knobs,
                              deadline_batch, deadline_cut, estimate_round, first_chunk_cut,
                              padding_room, split_by_length)
from engine.types import AudioChunk, SessionOptions
from gateway.app import engine_config
from gateway.settings import load_settings
from tests.test_engine import TOKEN_SAMPLES, collect, default_voice, run
from tests.test_flow_graphs import _chunks, _max_diff

# ----------------------------------------------------------------------------- selection


def _cands(*rows: tuple[float, int]) -> list[BatchCandidate]:
    """(deadline, window) per candidate; seq = position (queue order)."""
    return [BatchCandidate(deadline=d, window=w, seq=i) for i, (d, w) in enumerate(rows)]


def test_deadline_batch_orders_by_deadline_then_queue_order() -> None:
    cands = _cands((5.0, 100), (1.0, 100), (3.0, 100), (1.0, 100), (-2.0, 100))
    # -2 first; the two 1.0 ties in queue order (1 before 3); then 3.0, 5.0.
    assert deadline_batch(cands, max_batch=8) == [4, 1, 3, 2, 0]
    assert deadline_batch(cands, max_batch=2) == [4, 1]
    assert deadline_batch(cands, max_batch=1) == [4]
    assert deadline_batch([], max_batch=4) == []
    with pytest.raises(ValueError):
        deadline_batch(cands, max_batch=0)


def test_deadline_batch_groups_windows_within_the_tolerance() -> None:
    cands = _cands(
        (0.0, 100),  # most urgent: always taken, whatever its window
        (1.0, 130),  # 130 > 1.25 x 100: skipped
        (2.0, 110),  # fits (110 / 100)
        (3.0, 90),  # fits: longest 110 <= 1.25 x 90 = 112.5
        (4.0, 80),  # 110 > 1.25 x 80 = 100: skipped
        (5.0, 125),  # 125 > 1.25 x 90: skipped (the band only narrows)
        (6.0, 95),
    )
    assert deadline_batch(cands, max_batch=8) == [0, 2, 3, 6]
    assert deadline_batch(cands, max_batch=3) == [0, 2, 3]
    # A looser tolerance takes everything; a zero tolerance only equal windows.
    assert deadline_batch(cands, max_batch=8, window_tolerance=1.0) == [0, 1, 2, 3, 4, 5, 6]
    assert deadline_batch(_cands((0.0, 50), (1.0, 51), (2.0, 50)), max_batch=8, window_tolerance=0.0) == [0, 2]
    # The long window skipped above anchors the next batch once it is the most urgent left.
    rest = [c for i, c in enumerate(cands) if i not in (0, 2, 3, 6)]
    assert [rest[i].seq for i in deadline_batch(rest, max_batch=8)] == [1, 5]


def test_chunk_due() -> None:
    inf = float("inf")
    assert chunk_due(100.0, -inf, 0.0) == (100.0, True)  # nothing heard, nothing ahead: needed now
    # Audio delivered plays until t=102: due a margin before, not urgent yet.
    assert chunk_due(100.0, 102.0, 0.0) == (pytest.approx(102.0 - DEADLINE_MARGIN_S), False)
    assert chunk_due(100.0, 102.0, 0.0, margin=0.0) == (102.0, False)
    # About to run out, or already silent: urgent, and the longer the silence the earlier.
    assert chunk_due(100.0, 100.1, 0.0, margin=0.25) == (pytest.approx(99.85), True)
    assert chunk_due(100.0, 97.0, 0.0, margin=0.0) == (97.0, True)
    # 3 s of earlier audio still to come (queued, or tokens not yet audio) play first.
    assert chunk_due(100.0, 102.0, 3.0, margin=0.0) == (105.0, False)
    assert chunk_due(100.0, -inf, 3.0, margin=0.0) == (103.0, False)  # ... even before any is heard
    assert chunk_due(100.0, 97.0, 3.0, margin=0.0) == (103.0, False)  # silent now: it starts from now


def _linear_round(fixed: float, per_row: float):  # noqa: ANN202
    return lambda rows: fixed + per_row * len(rows)


def test_deadline_cut_runs_a_row_due_before_the_round_ends_first() -> None:
    """A burst's second round: one session (row 0) has only its lone first chunk's audio
    ahead, the 63 others a second more. A 64-row round (0.34 s) would end after row 0's
    deadline; a one-row round first (0.025 s) saves it and the rest still end in time."""
    now = 100.0
    deadlines = [now + 0.3] + [now + 1.0] * 63
    assert deadline_cut(deadlines, now, _linear_round(0.02, 0.005)) == [0]
    # Rows already past due (listeners waiting in silence) go with it: they only gain.
    deadlines = [now + 0.3, now - 0.1, float("-inf")] + [now + 1.0] * 61
    assert deadline_cut(deadlines, now, _linear_round(0.02, 0.005)) == [0, 1, 2]


def test_deadline_cut_keeps_a_round_whole_when_cutting_makes_more_rows_late() -> None:
    now = 100.0
    # The 63 would miss 0.35 s behind a one-row round: 63 late against 1.
    assert deadline_cut([now + 0.3] + [now + 0.35] * 63, now, _linear_round(0.02, 0.005)) is None
    # Row 0 would be late even alone (due in 10 ms): cutting saves nobody.
    assert deadline_cut([now + 0.01] + [now + 1.0] * 63, now, _linear_round(0.02, 0.005)) is None
    # Nothing due before the round ends, or only rows already past due: nothing to save.
    assert deadline_cut([now + 1.0] * 8, now, _linear_round(0.02, 0.005)) is None
    assert deadline_cut([now - 1.0] + [now + 1.0] * 7, now, _linear_round(0.02, 0.005)) is None
    # Every row due before the end: no rest to defer.
    assert deadline_cut([now + 0.01, now + 0.02], now, _linear_round(0.02, 0.005)) is None
    # No round measured yet: no prediction, no cut.
    assert deadline_cut([now + 0.3] + [now + 1.0] * 63, now, lambda rows: None) is None


# ----------------------------------------------------------------------------- the stage


@pytest.fixture(scope="module")
def flow() -> CausalMaskedDiffWithDiT:
    torch.set_num_threads(1)
    return init_random_(CausalMaskedDiffWithDiT(ModelConfig.tiny().flow), seed=1234).eval()


@pytest.fixture(scope="module")
def hift() -> CausalHiFTGenerator:
    return hift_init_random_(CausalHiFTGenerator(ModelConfig.tiny().hift), seed=3).eval()


class _RecordingStage(AudioStage):
    """The real stage, noting which queued jobs (by seq) each batch ran."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.batches: list[list[int]] = []

    def _compute(self, batch: list[ChunkJob]):  # noqa: ANN202
        self.batches.append([j.seq for j in batch])
        return super()._compute(batch)


def _serve(stage: AudioStage, make_jobs, return_exceptions: bool = False) -> list[object]:  # noqa: ANN001
    """Queue the jobs `make_jobs()` builds before the stage's loop first runs (its task is
    created after theirs, so it finds them all queued), run them, close the stage; each
    job's PCM (or exception)."""
    async def go() -> list[object]:
        tasks = [asyncio.create_task(stage.run(j)) for j in make_jobs()]
        await stage.start()
        try:
            return list(await asyncio.gather(*tasks, return_exceptions=return_exceptions))
        finally:
            await stage.close()

    return asyncio.run(go())


def _chunk(window: int, seed: int) -> FlowChunk:
    g = torch.Generator().manual_seed(seed)
    tp = 13
    return FlowChunk(tokens=torch.randint(0, 6561, (window,), generator=g), prompt_feat=torch.randn(2 * tp, 80, generator=g),
                     embedding=torch.randn(192, generator=g), num_prompt_tokens=tp, out_start=tp, finalize=True)


def _run_queued(stage: AudioStage, specs: list[tuple[int, int, float, bool]]) -> list[object]:
    """One job per (window, chunk_index, deadline, cancelled), all queued before the stage
    runs (`_serve`); each job's PCM or exception."""
    return _serve(stage, lambda: [ChunkJob(flow=_chunk(w, seed=i), hift_stream=stage.new_stream(), speed=1.0,
                                           chunk_index=idx, is_cancelled=lambda c=cancelled: c, deadline=deadline)
                                  for i, (w, idx, deadline, cancelled) in enumerate(specs)], return_exceptions=True)


SPECS = [  # (window tokens, chunk index, deadline, cancelled)
    (60, 3, 5.0, False),  # seq 0: a later chunk, not due for a while
    (30, 0, 1.0, False),  # seq 1: a first chunk
    (60, 2, 0.5, False),  # seq 2: a later chunk about to underrun
    (30, 0, 2.0, True),  # seq 3: cancelled before the stage saw it
    (32, 0, 3.0, False),  # seq 4: a first chunk, window close to seq 1's
]


def test_deadline_stage_batches_by_deadline_and_window(flow, hift) -> None:
    stage = _RecordingStage(flow, hift, torch.device("cpu"), max_batch=8, policy="deadline")
    out = _run_queued(stage, SPECS)
    # Most urgent (seq 2, 60 tokens) with the other 60-token chunk; then the two ~30s.
    assert stage.batches == [[2, 0], [1, 4]]
    assert isinstance(out[3], asyncio.CancelledError) and stage.stats.dropped == 1
    assert all(isinstance(out[i], np.ndarray) and out[i].size == 2 * (SPECS[i][0] - 13) * 480 for i in (0, 1, 2, 4))
    assert stage.stats.chunks == 4 and stage.stats.queued == 0

    # The default policy on the same queue: first chunks first, then FIFO, one batch,
    # deadlines ignored; the audio is the same (padding is exact).
    default = _RecordingStage(flow, hift, torch.device("cpu"), max_batch=8)
    assert default.policy == "first_chunks"
    base = _run_queued(default, SPECS)
    assert default.batches == [[1, 4, 0, 2]]
    for i in (0, 1, 2, 4):
        assert float(np.abs(out[i] - base[i]).max()) <= 1e-4

    # max_batch still caps a deadline batch.
    capped = _RecordingStage(flow, hift, torch.device("cpu"), max_batch=1, policy="deadline")
    _run_queued(capped, SPECS)
    assert capped.batches == [[2], [1], [4], [0]]

    with pytest.raises(ValueError, match="stage policy"):
        AudioStage(flow, hift, torch.device("cpu"), policy="shortest_first")


# ----------------------------------------------------------------------------- graph rows


def test_graph_policy_max_rows(flow) -> None:
    assert GraphPolicy().with_max_rows(64) == GraphPolicy()  # the default changes nothing
    assert GraphPolicy().with_max_rows(8).batch_buckets == (1, 2, 3, 4, 5, 6, 8)
    assert GraphPolicy().with_max_rows(10).batch_buckets == (1, 2, 3, 4, 5, 6, 8, 10)  # the cap is a bucket
    assert GraphPolicy().with_max_rows(0).batch_buckets == ()
    capped = dataclasses.replace(GraphPolicy(), batch_buckets=(1, 2, 4, 8, 16, 32, 64)).with_max_rows(8)
    assert capped.bucket(8, 120) == (8, 150) and capped.bucket(3, 120) == (4, 150)
    assert capped.bucket(9, 120) is None  # more rows than the cap: eager, exact rows
    assert GraphPolicy().with_max_rows(0).bucket(1, 50) is None
    with pytest.raises(ValueError):
        GraphPolicy().with_max_rows(-1)

    # Through the runner (capture off on CPU, same padding path): <= 3 rows padded into a
    # bucket, 4 rows solved as they are; both equal the plain decoding.
    policy = GraphPolicy(batch_buckets=(1, 2, 4, 8), frame_multiple=50, max_frames=200).with_max_rows(3)
    runner = FlowGraphRunner(flow.decoder, policy)
    three, four = _chunks(3, seed=51), _chunks(4, seed=52)
    out, shape = flow.decode_chunks(three, solver=runner)
    assert runner.stats.replays == 1 and runner.stats.eager == 0 and shape.rows == 3 and shape.frames % 50 == 0
    assert _max_diff(out, flow.inference_chunks(three)) <= 1e-5
    out, shape = flow.decode_chunks(four, solver=runner)
    assert runner.stats.replays == 1 and runner.stats.eager == 1 and shape.rows == 4
    assert _max_diff(out, flow.inference_chunks(four)) == 0.0


# ----------------------------------------------------------------------------- engine


def test_build_stage_takes_both_options(tiny_model_dir) -> None:
    async def fn(engine):
        return build_stage(engine.model, torch.device("cpu"),
                           EngineConfig(model_dir=tiny_model_dir, stage_policy="deadline", flow_graph_max_rows=8))

    stage = run(tiny_model_dir, fn, warmup=False)
    assert stage.policy == "deadline" and stage.graph_policy.batch_buckets == (1, 2, 3, 4, 5, 6, 8)
    with pytest.raises(ValueError, match="stage_policy"):
        EngineConfig(model_dir=tiny_model_dir, stage_policy="fastest")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="flow_graph_max_rows"):
        EngineConfig(model_dir=tiny_model_dir, flow_graph_max_rows=-1)


def _four_sessions(seen: list[tuple[object, int, float]]):
    async def go(engine):
        original = engine.stage.submit

        def spy(job: ChunkJob) -> asyncio.Future[np.ndarray]:  # notes each job's deadline, runs it unchanged
            seen.append((job.hift_stream, job.chunk_index, job.deadline))
            return original(job)

        engine.stage.submit = spy
        voice = await default_voice(engine)
        sessions = []
        for i in range(4):
            s = engine.open_session(voice, SessionOptions(tokens_per_text_token=3.0, seed=i))
            uid = await s.submit(f"Caller {i} would like to hear this sentence.")
            await s.finish()
            sessions.append((s, uid))
        results = await asyncio.gather(*(collect(s) for s, _ in sessions))
        return [(events, s.utterance_stats(uid)) for (s, uid), events in zip(sessions, results)], engine.stage.policy

    return go


def test_deadline_policy_gives_the_same_audio_in_order(tiny_model_dir) -> None:
    base_seen: list[tuple[object, int, float]] = []
    seen: list[tuple[object, int, float]] = []
    # 12-token first chunks: audio that outlasts DEADLINE_MARGIN_S even less the 160 ms the
    # vocoder holds back, so a second chunk is due after its first was queued (a shorter
    # first chunk makes the second due at once, possibly before the first's queueing time).
    base, base_policy = run(tiny_model_dir, _four_sessions(base_seen), warmup=False, initial_hop=12)
    got, policy = run(tiny_model_dir, _four_sessions(seen), warmup=False, stage_policy="deadline", initial_hop=12)
    assert (base_policy, policy) == ("first_chunks", "deadline")
    for (events, st), (base_events, _) in zip(got, base):
        assert all(isinstance(e, AudioChunk) for e in events), events
        assert [c.chunk_index for c in events] == list(range(len(events))) and len(events) >= 2
        assert events[-1].is_last and not any(c.is_last for c in events[:-1])
        assert [c.start_sample for c in events] == list(np.cumsum([0] + [c.pcm.size for c in events[:-1]]))
        assert sum(c.pcm.size for c in events) == len(st.speech_tokens) * TOKEN_SAMPLES
        pcm, want = np.concatenate([c.pcm for c in events]), np.concatenate([c.pcm for c in base_events])
        assert_same_audio(pcm, want)
    # Deadlines: each utterance's later chunks are due after its first chunk was queued and
    # strictly later chunk by chunk (each delivered chunk adds its playing time).
    by_utt: dict[int, list[tuple[int, float]]] = {}
    for stream, index, deadline in seen:
        by_utt.setdefault(id(stream), []).append((index, deadline))
    assert len(by_utt) == 4
    for chunks in by_utt.values():
        assert [i for i, _ in chunks] == list(range(len(chunks)))
        deadlines = [d for _, d in chunks]
        assert all(b > a for a, b in zip(deadlines, deadlines[1:])), deadlines


# ----------------------------------------------------------------------------- settings


def test_settings_reach_the_engine_config(tmp_path) -> None:
    s, _ = load_settings([], environ={})
    cfg = engine_config(s, tmp_path)
    assert (cfg.stage_policy, cfg.flow_graph_max_rows) == ("first_chunks", 64)  # today's behaviour
    s, _ = load_settings(["--engine.stage-policy", "deadline", "--engine.flow-graph-max-rows", "8"], environ={})
    cfg = engine_config(s, tmp_path)
    assert (cfg.stage_policy, cfg.flow_graph_max_rows) == ("deadline", 8)
    env = {"COSYVOICE_GW_ENGINE__STAGE_POLICY": "deadline", "COSYVOICE_GW_ENGINE__FLOW_GRAPH_MAX_ROWS": "16"}
    s, _ = load_settings([], environ=env)
    assert (s.engine.stage_policy, s.engine.flow_graph_max_rows) == ("deadline", 16)
    yml = tmp_path / "gw.yaml"
    yml.write_text("engine:\n  stage_policy: deadline\n  flow_graph_max_rows: 4\n")
    s, _ = load_settings(["--config", str(yml), "--engine.stage-policy", "first_chunks"], environ={})
    assert (s.engine.stage_policy, s.engine.flow_graph_max_rows) == ("first_chunks", 4)  # flag beats YAML
    s, _ = load_settings(["--engine.stage-policy", "nope"], environ={})
    with pytest.raises(ValueError, match="stage_policy"):
        engine_config(s, tmp_path)
    s, _ = load_settings(["--engine.stage-window-tolerance", "1000"], environ={})
    assert engine_config(s, tmp_path).stage_window_tolerance == 1000.0
    assert cfg.stage_deadline_cut_margin_ms == 250.0
    s, _ = load_settings(["--engine.stage-deadline-cut-margin-ms", "50"], environ={})
    assert engine_config(s, tmp_path).stage_deadline_cut_margin_ms == 50.0
    for bad in ("-1", "nan", "2000"):
        s, _ = load_settings(["--engine.stage-deadline-cut-margin-ms", bad], environ={})
        with pytest.raises(ValueError, match="stage_deadline_cut_margin_ms"):
            engine_config(s, tmp_path)
    for bad in ("-0.5", "nan"):
        s, _ = load_settings(["--engine.stage-window-tolerance", bad], environ={})
        with pytest.raises(ValueError, match="stage_window_tolerance"):
            engine_config(s, tmp_path)
    assert (cfg.first_chunk_hold_ms, cfg.first_chunk_hold_share, cfg.vllm_mps_priority) == (25.0, 0.0, None)
    assert cfg.stage_mps_priority is None
    s, _ = load_settings(["--engine.first-chunk-hold-ms", "20", "--engine.vllm-mps-priority", "below_normal",
                          "--engine.first-chunk-hold-share", "0.15"], environ={})
    cfg = engine_config(s, tmp_path)
    assert (cfg.first_chunk_hold_ms, cfg.first_chunk_hold_share, cfg.vllm_mps_priority) == (20.0, 0.15, "below_normal")
    s, _ = load_settings(["--engine.stage-mps-priority", "below_normal"], environ={})
    assert engine_config(s, tmp_path).stage_mps_priority == "below_normal"
    assert cfg.chunk_patience_s == 1.0 and not cfg.vllm_compile_sampling
    s, _ = load_settings(["--engine.vllm-compile-sampling", "true"], environ={})
    assert engine_config(s, tmp_path).vllm_compile_sampling
    s, _ = load_settings(["--engine.chunk-patience-s", "1.5"], environ={})
    assert engine_config(s, tmp_path).chunk_patience_s == 1.5
    for flag, bad, name in (("--engine.first-chunk-hold-ms", "-1", "first_chunk_hold_ms"),
                            ("--engine.first-chunk-hold-ms", "nan", "first_chunk_hold_ms"),
                            ("--engine.first-chunk-hold-share", "0.6", "first_chunk_hold_share"),
                            ("--engine.first-chunk-hold-share", "nan", "first_chunk_hold_share"),
                            ("--engine.chunk-patience-s", "-1", "chunk_patience_s"),
                            ("--engine.chunk-patience-s", "nan", "chunk_patience_s"),
                            ("--engine.vllm-mps-priority", "high", "vllm_mps_priority"),
                            ("--engine.stage-mps-priority", "high", "stage_mps_priority"),
                            ("--engine.max-hop", "0", "max_hop"),  # zero-token chunks, forever
                            ("--engine.max-hop", "60", "max_hop"),  # chunks off the attention blocks
                            ("--engine.max-gpu-batch", "0", "max_gpu_batch")):  # a stage loop that never waits
        s, _ = load_settings([flag, bad], environ={})
        with pytest.raises(ValueError, match=name):
            engine_config(s, tmp_path)


# ----------------------------------------------------------------------------- split by length


def _cost(calls: list[list[int]], frames: list[int], call_cost: float) -> float:
    return sum(call_cost + len(c) * max(frames[i] for i in c) for c in calls)


def test_split_by_length_separates_short_chunks_from_long_ones() -> None:
    frames = [300, 50, 300, 50, 300, 50, 50, 300]
    assert split_by_length(frames, call_cost=730) == [[1, 3, 5, 6], [0, 2, 4, 7]]
    assert split_by_length(frames, call_cost=5000) == [list(range(8))]  # a call costs more than the padding
    assert split_by_length([120] * 5, call_cost=0) == [list(range(5))]  # nothing to gain from equal lengths
    assert split_by_length([10, 100, 1000], call_cost=1, max_calls=2) == [[0, 1], [2]]
    assert split_by_length([7], call_cost=730) == [[0]]
    with pytest.raises(ValueError):
        split_by_length(frames, max_calls=0)


@pytest.mark.parametrize("seed", range(12))
def test_split_by_length_is_the_cheapest_partition(seed: int) -> None:
    """Against every partition of the rows into at most three calls (brute force)."""
    import itertools

    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 8))
    frames = [int(x) for x in rng.choice([40, 50, 120, 200, 210, 320], size=n)]
    call_cost = float(rng.choice([0, 100, 730, 3000]))
    calls = split_by_length(frames, call_cost=call_cost)
    assert sorted(i for c in calls for i in c) == list(range(n)) and all(c == sorted(c) for c in calls)
    best = min(
        _cost([[i for i in range(n) if labels[i] == g] for g in set(labels)], frames, call_cost)
        for labels in itertools.product(range(3), repeat=n)
    )
    assert _cost(calls, frames, call_cost) == pytest.approx(best)


def _pow2_padded(rows: int, frames: int) -> int:
    """A monotone padded pricing like the graphs': rows to a power of two, frames to 50."""
    return (1 << (rows - 1).bit_length()) * -(-frames // 50) * 50


@pytest.mark.parametrize("seed", range(8))
def test_split_by_length_is_the_cheapest_partition_when_padded(seed: int) -> None:
    """With padded pricing rows of one length may go to different calls (brute force over
    every partition into at most three calls)."""
    import itertools

    rng = np.random.default_rng(100 + seed)
    n = int(rng.integers(1, 8))
    frames = [int(x) for x in rng.choice([40, 50, 120, 200, 210], size=n)]
    call_cost = float(rng.choice([0, 50, 200, 730]))
    calls = split_by_length(frames, call_cost=call_cost, solved=_pow2_padded)
    assert sorted(i for c in calls for i in c) == list(range(n)) and all(c == sorted(c) for c in calls)

    def cost(parts: list[list[int]]) -> float:
        return sum(call_cost + _pow2_padded(len(c), max(frames[i] for i in c)) for c in parts if c)

    best = min(cost([[i for i in range(n) if labels[i] == g] for g in range(3)])
               for labels in itertools.product(range(3), repeat=n))
    assert cost(calls) == pytest.approx(best)


def test_padded_pricing_splits_what_the_graphs_would_pad() -> None:
    policy = GraphPolicy(batch_buckets=(1, 2, 4, 8, 16, 32, 64))  # powers of two: 3 rows run as 4
    solved = call_work(policy, width=0, shared=False)
    assert solved(33, 52) == 64 * 100 and solved(3, 300) == 4 * 300 and solved(65, 10) == 65 * 10  # no bucket: exact
    # 33 first chunks of one length: the 64-row graph pads 31 rows; 32 + 1 costs less.
    assert [len(c) for c in split_by_length([52] * 33, solved=solved)] == [1, 32]
    assert split_by_length([52] * 33) == [list(range(33))]  # priced exactly: nothing to split
    # 50, 50, 300: one call of 900 row-frames priced exactly, a 4 x 300 graph as run.
    assert split_by_length([50, 50, 300]) == [[0, 1, 2]]
    assert split_by_length([50, 50, 300], solved=solved) == [[0, 1], [2]]
    # 60 and 95 frames both run at 100: priced exactly, eight of each would be split.
    frames = [60] * 8 + [95] * 8
    assert split_by_length(frames, call_cost=200) == [list(range(8)), list(range(8, 16))]
    assert split_by_length(frames, call_cost=200, solved=solved) == [list(range(16))]
    # A cached prefix too wide for the graphs: every call runs eagerly, priced exactly.
    wide = call_work(policy, width=policy.prefix_max_frames + 1, shared=True)
    assert wide(33, 52) == 33 * 52


def test_the_stage_prices_its_calls_at_its_graphs_shapes(tiny_model_dir) -> None:  # noqa: ANN001
    from engine.models.loader import load_model
    from tests.test_flow_prompt_cache import chunk, make_voice

    model = load_model(tiny_model_dir, load_lm=False)
    chunks = [chunk(make_voice(60, 5), 0, 15, False)] * 33
    stage = AudioStage(model.flow, model.hift, torch.device("cpu"), split_batches=True)
    try:
        assert stage._flow_calls(chunks, None) == [list(range(33))]  # no graphs on the CPU: priced exactly
        stage.flow_cuda_graphs = True  # priced as on CUDA (pricing runs no graph)
        assert [len(c) for c in stage._flow_calls(chunks, None)] == [1, 32]
        stage.split_padded = False
        assert stage._flow_calls(chunks, None) == [list(range(33))]
    finally:
        stage._pool.shutdown(wait=True)


def test_the_call_cost_setting_decides_the_split(tiny_model_dir) -> None:  # noqa: ANN001
    from engine.models.loader import load_model
    from tests.test_flow_prompt_cache import chunk, make_voice

    model = load_model(tiny_model_dir, load_lm=False)
    v = make_voice(60, 5)
    chunks = [chunk(v, 100, 200, False), chunk(v, 0, 15, False)] * 4
    stage = AudioStage(model.flow, model.hift, torch.device("cpu"), split_batches=True)
    try:
        assert stage.split_call_cost == 730 and len(stage._flow_calls(chunks, None)) == 2
        stage.split_call_cost = 10**6  # a call dearer than any padding: one call
        assert stage._flow_calls(chunks, None) == [list(range(8))]
    finally:
        stage._pool.shutdown(wait=True)
    assert EngineConfig(model_dir=Path(".")).flow_split_call_cost == 730
    with pytest.raises(ValueError, match="flow_split_call_cost"):
        EngineConfig(model_dir=Path("."), flow_split_call_cost=-1)


def test_a_split_batch_gives_the_same_audio_with_fewer_frames(tiny_model_dir) -> None:  # noqa: ANN001
    """First chunks (~50 computed frames) interleaved with later ones (~320), two voices, in
    one batch: split, the stage runs two flow calls instead of padding every row to the
    longest, and every chunk still gets its own audio (in batch order)."""
    from dataclasses import replace

    from engine.models.loader import load_model
    from tests.test_flow_prompt_cache import chunk, make_voice

    model = load_model(tiny_model_dir, load_lm=False)
    v, w = make_voice(60, 5), make_voice(60, 6)
    chunks = [chunk(v, 100, 200, False), chunk(v, 0, 15, False), chunk(w, 100, 200, False), chunk(w, 0, 15, False),
              chunk(v, 0, 13, False), chunk(v, 125, 225, False), chunk(w, 0, 12, False), chunk(v, 0, 15, False)]
    short, long = [1, 3, 4, 6, 7], [0, 2, 5]
    stages = {split: AudioStage(model.flow, model.hift, torch.device("cpu"), prompt_cache_bytes=1 << 30,
                                split_batches=split) for split in (False, True)}
    try:
        results = {}
        for split, stage in stages.items():
            entries = stage.prompt_cache.entries_for(stage.flow, chunks)
            assert stage._flow_calls(chunks, entries) == ([short, long] if split else [list(range(8))])
            jobs = [ChunkJob(flow=c, hift_stream=stage.new_stream(), speed=1.0, chunk_index=0,
                             is_cancelled=lambda: False) for c in chunks]
            results[split] = stage._compute([replace(j) for j in jobs])
        row = [stages[True]._decode([c], [e])[1] for c, e in zip(chunks, entries)]  # one row: its frames
        assert max(row[i] for i in long) > 5 * max(row[i] for i in short)
        (pcm, frames, vocoded), (pcm_split, frames_split, vocoded_split) = results[False], results[True]
        assert frames == 8 * max(row)
        assert frames_split == 5 * max(row[i] for i in short) + 3 * max(row[i] for i in long)
        assert vocoded == vocoded_split
        # Float32 on the CPU: other padding, other summation order (measured ~1.5e-4 at most).
        for a, b in zip(pcm, pcm_split):
            assert a.shape == b.shape and a.size > 0 and float(np.abs(a - b).max()) <= 5e-4
        assert float(np.abs(pcm[0] - pcm[2]).max()) > 1e-2  # rows differ: their order matters
    finally:
        for stage in stages.values():
            stage._pool.shutdown(wait=True)


def test_first_chunks_policy_lets_only_urgent_first_chunks_jump(flow, hift) -> None:
    """A first chunk queued behind its session's audio still playing (urgent=False) waits
    its turn; one heard after silence jumps the queue."""
    stage = _RecordingStage(flow, hift, torch.device("cpu"), max_batch=2)

    _serve(stage, lambda: [ChunkJob(flow=_chunk(30, seed=i), hift_stream=stage.new_stream(), speed=1.0,
                                    chunk_index=idx, is_cancelled=lambda: False, urgent=urgent)
                           for i, (idx, urgent) in enumerate([(2, True), (0, False), (3, True), (0, True)])])
    # seq 3 (urgent first chunk) first; seq 1 (a first chunk behind playing audio) in FIFO order.
    assert stage.batches == [[3, 0], [1, 2]]


def test_the_stage_cuts_a_round_for_a_row_due_before_it_ends(flow, hift) -> None:
    """Three like rows; the round times the stage learnt say 1 s for one row and 10 s for
    three. Row 0 is due in 5 s, the others in 100: with the cut, row 0 runs alone first,
    and the audio is the same as in one round."""
    chunks = [_chunk(40, seed=i) for i in range(3)]

    def serve(cut: bool, first_due: float = 5.0, shift: float = 0.0, rescue: bool = False,
              scale: float = 1.0) -> tuple[_RecordingStage, list[np.ndarray]]:
        stage = _RecordingStage(flow, hift, torch.device("cpu"), max_batch=8, cut_for_deadlines=cut,
                                cut_shift_s=shift, rescue=rescue)
        frames = stage._window_frames(chunks[0])
        stage.rounds.observe(frames, 1.0 * scale)
        stage.rounds.observe(3 * frames, 10.0 * scale)

        def jobs() -> list[ChunkJob]:
            now = time.monotonic()
            return [ChunkJob(flow=c, hift_stream=stage.new_stream(), speed=1.0, chunk_index=1,
                             is_cancelled=lambda: False, deadline=now + due)
                    for c, due in zip(chunks, (first_due, 100.0, 100.0))]

        return stage, _serve(stage, jobs)

    whole, pcm_whole = serve(cut=False)
    cut, pcm_cut = serve(cut=True)
    assert whole.batches == [[0, 1, 2]] and whole.stats.deadline_cuts == 0
    assert cut.batches == [[0], [1, 2]] and cut.stats.deadline_cuts == 1
    for a, b in zip(pcm_whole, pcm_cut):
        assert a.size == b.size == 2 * (40 - 13) * 480 and float(np.abs(a - b).max()) <= 1e-4
    # A deadline already past (its margin longer than the audio ahead) is no miss the cut
    # can prevent; with the cut's own margin smaller by 6 s, it is due in 5 s again.
    assert serve(cut=True, first_due=-1.0)[0].batches == [[0, 1, 2]]
    assert serve(cut=True, first_due=-1.0, shift=6.0)[0].batches == [[0], [1, 2]]
    # With the rescue a row past its deadline is judged by when its audio runs out, the
    # engine's margin (0.25 s) later: rounds of 50 and 500 ms, row 0's deadline 10 ms ago,
    # its audio out in 0.24 s: it runs alone first. Without the rescue it is given up; with
    # it, one whose audio ran out already is given up too.
    assert serve(cut=True, first_due=-0.01, scale=0.05)[0].batches == [[0, 1, 2]]
    assert serve(cut=True, first_due=-0.01, scale=0.05, rescue=True)[0].batches == [[0], [1, 2]]
    assert serve(cut=True, first_due=-1.0, scale=0.05, rescue=True)[0].batches == [[0, 1, 2]]


def test_the_rescue_leaves_first_chunks_and_rows_with_time_as_they_are(flow, hift) -> None:  # noqa: ANN001
    """`_cut_due`: the deadline shifted by the cut's margin; with the rescue a later chunk
    past it is judged by when its audio runs out (the engine's margin later), but not a
    first chunk (due when queued: no audio to run out) nor a row not yet past it; and the
    stage reports, per row, whether its shifted deadline had passed when its batch started."""
    stage = AudioStage(flow, hift, torch.device("cpu"), cut_shift_s=0.1)
    try:
        now = 100.0
        rows = [(1, now - 0.15), (0, now - 0.15), (2, now + 1.0), (1, now - 1.0)]
        jobs = [ChunkJob(flow=_chunk(20, seed=i), hift_stream=stage.new_stream(), speed=1.0, chunk_index=index,
                         is_cancelled=lambda: False, deadline=deadline) for i, (index, deadline) in enumerate(rows)]
        shifted = [d + 0.1 for _, d in rows]
        assert stage._cut_due(jobs, now) == pytest.approx(shifted)
        stage.rescue = True
        assert stage._cut_due(jobs, now) == pytest.approx([now + 0.1, shifted[1], shifted[2], now - 0.75])
    finally:
        stage._pool.shutdown(wait=True)

    stage = _RecordingStage(flow, hift, torch.device("cpu"), max_batch=8, cut_shift_s=0.5)
    made: list[ChunkJob] = []

    def jobs() -> list[ChunkJob]:
        now = time.monotonic()
        made.extend(ChunkJob(flow=_chunk(20, seed=i), hift_stream=stage.new_stream(), speed=1.0, chunk_index=1,
                             is_cancelled=lambda: False, deadline=now + due) for i, due in enumerate((-1.0, 60.0)))
        return made

    _serve(stage, jobs)
    starts = [j.started.result() for j in made]
    assert all(isinstance(s, BatchStart) for s in starts)
    assert [s.past_due for s in starts] == [True, False]  # 1 s past, less 0.5; a minute ahead


def test_first_chunk_cut_runs_first_chunks_before_rows_that_can_wait() -> None:
    """A round of 2 first chunks and 10 big chunks due in a second or more: the first
    chunks go alone (0.03 s against 0.07), the others after them (0.07 s) and still in
    time; a row that would be late after the first chunks' round goes with them."""
    now = 100.0
    firsts = [True, False, True] + [False] * 9
    deadlines = [now, now + 2.0, now - 0.5] + [now + 1.0] * 9
    assert first_chunk_cut(firsts, deadlines, now, _linear_round(0.02, 0.005)) == [0, 2]
    # Row 1 is due in 90 ms: after a 30-ms round and its own 70-ms round, too late.
    deadlines[1] = now + 0.09
    assert first_chunk_cut(firsts, deadlines, now, _linear_round(0.02, 0.005)) == [0, 1, 2]
    # ... and a row already past due (a stall in progress) cannot wait either.
    deadlines[1] = now - 1.0
    assert first_chunk_cut(firsts, deadlines, now, _linear_round(0.02, 0.005)) == [0, 1, 2]


def test_first_chunk_cut_keeps_a_round_whole_where_it_cannot_pay() -> None:
    now = 100.0
    late, far = [now] * 2, [now + 5.0] * 2
    # No first chunk, or nothing but first chunks: nothing to cut.
    assert first_chunk_cut([False] * 4, far + far, now, _linear_round(0.02, 0.005)) is None
    assert first_chunk_cut([True] * 4, late + late, now, _linear_round(0.02, 0.005)) is None
    # Every other row would be late after the first chunks' round: no rest.
    assert first_chunk_cut([True, True, False, False], late + [now + 0.01] * 2, now,
                           _linear_round(0.02, 0.005)) is None
    # A fixed cost of 0.1 s a round: the first chunks gain 10 ms (0.12 against 0.11),
    # the stage loses 0.1 s.
    assert first_chunk_cut([True, True, False, False], late + far, now, _linear_round(0.1, 0.005)) is None
    # No round measured yet.
    assert first_chunk_cut([True, True, False, False], late + far, now, lambda rows: None) is None
    # Each row joining the first chunk's round makes the next one late (rows cost 10 ms
    # beside it, 1 ms in the other round): the passes are bounded, and a cut the bound does
    # not settle is not made.
    def stairs_round(rows) -> float:  # noqa: ANN001
        return 0.01 + (0.01 if 0 in rows else 0.001) * len(rows)
    firsts = [True] + [False] * 8
    due = [now] + [now + 0.026 + 0.009 * k for k in range(1, 7)] + [now + 5.0] * 2
    assert first_chunk_cut(firsts, due, now, stairs_round) is None
    assert first_chunk_cut(firsts, due[:4] + [now + 5.0] * 5, now, stairs_round) == [0, 1, 2, 3]


def _cut_run(flow, hift, chunks: list[FlowChunk], wall: float, rows: list[tuple[int, float, bool]],  # noqa: ANN001
             **settings: object) -> tuple[_RecordingStage, list[np.ndarray]]:
    """A stage with these settings that learnt a round of one long chunk (`chunks[0]`) at
    50 ms and of all of them at `wall`, serving the chunks as jobs of (chunk index, seconds
    to their deadline, patient) each: the stage and the PCM."""
    stage = _RecordingStage(flow, hift, torch.device("cpu"), max_batch=8, **settings)
    for n, seconds in ((1, 0.05), (len(chunks), wall)):
        stage.rounds.observe(n * stage._window_frames(chunks[0]), seconds)

    def jobs() -> list[ChunkJob]:
        now = time.monotonic()
        return [ChunkJob(flow=c, hift_stream=stage.new_stream(), speed=1.0, chunk_index=index,
                         is_cancelled=lambda: False, deadline=now + due, patient=patient)
                for c, (index, due, patient) in zip(chunks, rows)]

    return stage, _serve(stage, jobs)


def test_the_stage_runs_first_chunks_before_big_chunks_that_can_wait(flow, hift) -> None:
    """A first chunk queued behind two long chunks with seconds to spare: with the cut it
    runs alone first (the policy alone takes all three), and the audio is the same."""
    chunks = [_chunk(90, seed=1), _chunk(90, seed=2), _chunk(25, seed=0)]
    rows = [(2, 60.0, False), (3, 60.0, False), (0, 0.0, False)]
    whole, pcm_whole = _cut_run(flow, hift, chunks, 0.4, rows, first_cut=False)  # the long ones: ~0.35 s
    cut, pcm_cut = _cut_run(flow, hift, chunks, 0.4, rows, first_cut=True)
    assert whole.batches == [[2, 0, 1]] and whole.stats.first_chunk_cuts == 0
    assert cut.batches == [[2], [0, 1]] and cut.stats.first_chunk_cuts == 1
    _assert_same_pcm(pcm_whole, pcm_cut)


def _assert_same_pcm(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.size == y.size > 0 and float(np.abs(x - y).max()) <= 1e-4


@pytest.mark.parametrize("knob,bad", [("first_cut", 1), ("second_cut", "yes"), ("rescue", 0)])
def test_the_cuts_are_set_while_serving(flow, hift, knob, bad) -> None:  # noqa: ANN001
    """`POST /debug/planner`: the next round cuts (or not)."""
    stage = _RecordingStage(flow, hift, torch.device("cpu"))
    try:
        stage.tune({knob: True})
        assert getattr(stage, knob) is True
        with pytest.raises(ValueError, match=f"{knob} must be true or false"):
            stage.tune({knob: bad})
    finally:
        stage._pool.shutdown(wait=True)


def test_the_second_chunk_cut_sends_second_chunks_with_the_first(flow, hift) -> None:
    """A first chunk, a second chunk with seconds to spare, a patient second chunk and two
    long chunks: the first-chunk cut alone runs the first chunk alone; with the second-chunk
    cut the second chunk joins it, the patient one stays with the long chunks; the audio is
    the same."""
    chunks = [_chunk(90, seed=1), _chunk(90, seed=2), _chunk(25, seed=0), _chunk(40, seed=3), _chunk(40, seed=4)]
    rows = [(2, 60.0, False), (3, 60.0, False), (0, 0.0, False), (1, 30.0, False), (1, 60.0, True)]
    first_only, pcm_first = _cut_run(flow, hift, chunks, 0.5, rows, first_cut=True, second_cut=False)
    both, pcm_both = _cut_run(flow, hift, chunks, 0.5, rows, first_cut=True, second_cut=True)
    assert first_only.batches == [[2], [0, 1, 3, 4]]
    assert both.batches == [[2, 3], [0, 1, 4]] and both.stats.first_chunk_cuts == 1
    _assert_same_pcm(pcm_first, pcm_both)


def test_both_cuts_together_run_every_row_once(flow, hift) -> None:
    """The defaults: the first-chunk cut, then the deadline cut on what it keeps. Two first
    chunks, a row due within 0.3 s and three big rows with a minute to spare: the first
    chunks and the row due soon run first, the big rows after, each row once."""
    chunks = [_chunk(90, seed=1), _chunk(90, seed=2), _chunk(90, seed=3), _chunk(25, seed=4),
              _chunk(25, seed=5), _chunk(40, seed=6)]
    rows = [(2, 60.0, False)] * 3 + [(0, 0.0, False)] * 2 + [(1, 0.3, False)]
    stage, pcm = _cut_run(flow, hift, chunks, 0.6, rows, first_cut=True, cut_for_deadlines=True)
    assert sorted(seq for batch in stage.batches for seq in batch) == list(range(6))  # each once
    assert stage.batches == [[3, 4, 5], [0, 1, 2]]
    assert (stage.stats.first_chunk_cuts, stage.stats.deadline_cuts) == (1, 0)  # row 5 went with the first chunks
    assert all(p.size > 0 for p in pcm)


def test_live_utterances_may_leave_out_those_waiting_patiently(flow, hift) -> None:
    """An utterance counts as patient from a patient chunk until it queues one that is not,
    and not at all once its stream is gone; the round estimate counts what it is told."""
    stage = AudioStage(flow, hift, torch.device("cpu"), max_batch=2)
    stage.rounds.observe(stage._window_frames(_chunk(30, seed=0)), 0.1)

    async def go() -> list[tuple[int, int]]:
        streams = [stage.new_stream() for _ in range(3)]
        counts = [(stage.live_utterances(), stage.live_utterances(skip_patient=True))]
        jobs = [ChunkJob(flow=_chunk(30, seed=i), hift_stream=s, speed=1.0, chunk_index=2, is_cancelled=lambda: False,
                         patient=i < 2) for i, s in enumerate(streams)]
        for job in jobs:
            stage.submit(job)
        counts.append((stage.live_utterances(), stage.live_utterances(skip_patient=True)))
        estimates = (stage.round_estimate(streams[0], 50), stage.round_estimate(streams[0], 50, skip_patient=True),
                     stage.round_estimate(streams[0], 50, due_rounds=True))
        stage.submit(ChunkJob(flow=_chunk(30, seed=5), hift_stream=streams[0], speed=1.0, chunk_index=3,
                              is_cancelled=lambda: False))
        counts.append((stage.live_utterances(), stage.live_utterances(skip_patient=True)))
        stage._pending.clear()
        del jobs, streams, job
        counts.append((stage.live_utterances(), stage.live_utterances(skip_patient=True)))
        assert estimates == (estimate_round(stage.rounds, 3, 2, None, 50, 0), estimate_round(stage.rounds, 1, 2, None, 50, 0),
                             estimate_round(stage.rounds, 3, 2, None, 50, 0, due=1))
        assert estimates[0] > 2 * estimates[1]  # two rounds of 2 rows against one of 1
        assert estimates[2] == estimates[0] / 2  # one round of 2 rows: the patient fill it, not a second
        return counts

    try:
        assert asyncio.run(go()) == [(3, 3), (3, 1), (3, 2), (0, 0)]
    finally:
        stage._pool.shutdown(wait=True)


def test_a_deadline_moves_with_the_end_of_its_utterances_previous_round(flow, hift) -> None:
    """A chunk queued while its utterance's previous chunk is in its round was given a
    deadline as if that audio were delivered when it was queued; once that round is over
    the stage moves the deadline by how much later it ended, once."""
    stage = AudioStage(flow, hift, torch.device("cpu"))

    async def go() -> tuple[ChunkJob, float, float]:
        stream = stage.new_stream()
        await stage.start()
        try:
            first = ChunkJob(flow=dataclasses.replace(_chunk(30, seed=0), finalize=False), hift_stream=stream,
                             speed=1.0, chunk_index=0,
                             is_cancelled=lambda: False)
            pcm = stage.submit(first)
            await first.started
            queued = time.monotonic()
            second = ChunkJob(flow=_chunk(30, seed=1), hift_stream=stream, speed=1.0, chunk_index=1,
                              is_cancelled=lambda: False, deadline=queued + 100.0, deadline_from=queued)
            stage.submit(second)
            await pcm
            done = stage._done_at[stream]
            await second.future
            return second, queued, done
        finally:
            await stage.close()

    second, queued, done = asyncio.run(go())
    assert done > queued and second.deadline_moved == pytest.approx(done - queued)
    assert second.deadline == pytest.approx(queued + 100.0 + (done - queued))

    # No earlier chunk in the making, or its round over before the reckoning: unchanged.
    a, b = stage.new_stream(), stage.new_stream()
    stage._done_at[a] = stage._done_at[b] = 7.0
    plain = ChunkJob(flow=_chunk(30, seed=2), hift_stream=a, speed=1.0, chunk_index=1, is_cancelled=lambda: False,
                     deadline=10.0)
    earlier = ChunkJob(flow=_chunk(30, seed=3), hift_stream=b, speed=1.0, chunk_index=1, is_cancelled=lambda: False,
                       deadline=10.0, deadline_from=8.0)
    stage._refresh_deadlines([plain, earlier])
    assert (plain.deadline, earlier.deadline, earlier.deadline_moved) == (10.0, 10.0, 0.0)


def test_a_deadline_follows_a_pipelined_round_from_its_predicted_end_to_its_delivery(flow, hift) -> None:
    """A pipelined round's predicted end moves its utterances' next deadlines first; its
    delivery then sets them right, back as well when it came sooner than predicted, but
    never before the deadline the engine gave."""
    stage = AudioStage(flow, hift, torch.device("cpu"))
    stream = stage.new_stream()
    job = ChunkJob(flow=_chunk(30, seed=4), hift_stream=stream, speed=1.0, chunk_index=1, is_cancelled=lambda: False,
                   deadline=10.0, deadline_from=8.0)
    seen = []
    for done_at in (8.3, 8.1, 8.1, 7.9):  # predicted end; delivered sooner; again; before the reckoning
        stage._done_at[stream] = done_at
        stage._refresh_deadlines([job])
        seen.append(job.deadline)
    assert seen == pytest.approx([10.3, 10.1, 10.1, 10.0])
    assert job.deadline_from == 8.0


def _held_batches(flow, hift, expected_in: float | None, second_index: int = 0, second_after: float = 0.05,
                  hold_s: float = 5.0, hold_share: float = 0.0, round_s: float | None = None,
                  knobs: dict[str, object] | None = None,
                  urgent: bool = True) -> tuple[_RecordingStage, list[object]]:
    """An urgent first chunk (seq 0) queued at once; a second chunk (seq 1, chunk index
    `second_index`) of another stream queued `second_after` s later, announced as expected
    `expected_in` s from the start (None: not announced), missing a round of `round_s`,
    `urgent` or not; `knobs` tuned (`AudioStage.tune`) before either."""
    stage = _RecordingStage(flow, hift, torch.device("cpu"), max_batch=8, first_chunk_hold_s=hold_s,
                            first_chunk_hold_share=hold_share)
    stage.tune(knobs or {})

    async def go() -> list[object]:
        loop = asyncio.get_running_loop()
        streams = [stage.new_stream(), stage.new_stream()]
        jobs = [ChunkJob(flow=_chunk(30, seed=i), hift_stream=streams[i], speed=1.0, chunk_index=idx,
                         is_cancelled=lambda: False) for i, idx in enumerate([0, second_index])]
        await stage.start()
        if expected_in is not None:
            stage.expect_first_chunk(streams[1], time.monotonic() + expected_in, round_s, urgent)
        first = stage.submit(jobs[0])
        second = loop.create_future()
        loop.call_later(second_after, lambda: second.set_result(stage.submit(jobs[1])))
        try:
            return [await first, await (await second)]
        finally:
            await stage.close()

    return stage, asyncio.run(go())


def test_a_round_of_first_chunks_waits_for_the_first_chunks_expected_within_the_hold(flow, hift) -> None:
    """The round waits for the announced first chunk (queued 50 ms later), and no longer
    than until it came (the hold allows 5 s)."""
    stage, out = _held_batches(flow, hift, expected_in=0.05)
    assert stage.batches == [[0, 1]]
    assert stage.stats.first_chunk_holds == 1 and stage.stats.first_chunk_hold_caught == 1
    assert stage.stats.first_chunk_passed_over == 0  # it made the round
    assert stage.stats.first_chunk_hold_seconds < 5.0
    assert all(isinstance(pcm, np.ndarray) and pcm.size for pcm in out)


@pytest.mark.parametrize("expected_in, second_index, hold_s", [
    (None, 0, 5.0),  # not announced: nothing to wait for
    (60.0, 0, 5.0),  # announced beyond the hold
    (-30.0, 0, 5.0),  # overdue by more than the hold: the estimate was off, not waited for
    (0.05, 0, 0.0),  # the hold is off
])
def test_a_round_does_not_wait_for_what_is_not_expected_within_the_hold(flow, hift, expected_in, second_index,
                                                                         hold_s) -> None:
    stage, out = _held_batches(flow, hift, expected_in=expected_in, second_index=second_index, second_after=1.0,
                               hold_s=hold_s)
    assert stage.batches == [[0], [1]]
    assert stage.stats.first_chunk_holds == 0
    # An announced first chunk the round started without is counted when it comes, with how
    # much later than announced (queued 1 s in: 59 s sooner, 31 s later); with the hold off
    # nothing is.
    passed_over = expected_in is not None and hold_s > 0
    assert stage.stats.first_chunk_passed_over == passed_over
    late = stage.stats.first_chunk_passed_over_late_seconds
    assert late == (pytest.approx(1.0 - expected_in, abs=0.5) if passed_over else 0.0)
    assert all(isinstance(pcm, np.ndarray) and pcm.size for pcm in out)


@pytest.mark.parametrize("round_s, held", [
    (20.0, True),  # 0.25 x 20 s: the hold is 5 s, the chunk comes after 0.5 s
    (0.02, False),  # 0.25 x 20 ms: 5 ms, the fixed 1 ms hold is not longer either
    (None, False),  # the round it would miss is unknown: the fixed hold alone
])
def test_the_hold_grows_with_the_round_an_expected_first_chunk_would_miss(flow, hift, round_s, held) -> None:
    """`first_chunk_hold_share`: a round waits for an expected first chunk as long as that
    share of the round it would otherwise miss, beyond the fixed hold."""
    stage, out = _held_batches(flow, hift, expected_in=0.5, second_after=0.5, hold_s=0.001, hold_share=0.25,
                               round_s=round_s)
    assert stage.batches == ([[0, 1]] if held else [[0], [1]])
    assert stage.stats.first_chunk_hold_caught == (1 if held else 0)
    assert all(isinstance(pcm, np.ndarray) and pcm.size for pcm in out)


@pytest.mark.parametrize("hold_s, hold_ms, second_after, held", [
    (0.0, 1000, 0.05, True),  # off by configuration, on by the knob: the round waits for it
    (5.0, 0, 1.0, False),  # and the other way round: the round has long gone when it comes
])
def test_the_hold_is_a_knob(flow, hift, hold_s, hold_ms, second_after, held) -> None:
    """`hold_ms` (`POST /debug/planner`) sets the hold of `engine.first_chunk_hold_ms` while
    serving, in its unit: a burst's A/B of holds on one gateway."""
    stage, out = _held_batches(flow, hift, expected_in=0.05, second_after=second_after, hold_s=hold_s,
                               knobs={"hold_ms": hold_ms})
    assert (stage.hold_ms, stage.first_chunk_hold_s) == (hold_ms, hold_ms / 1000)
    assert stage.batches == ([[0, 1]] if held else [[0], [1]])
    assert all(isinstance(pcm, np.ndarray) and pcm.size for pcm in out)
    assert check_stage_knobs({"hold_ms": 60}) == {"hold_ms": 60.0}
    for bad in (-1, 1001, True, "60", math.nan):
        with pytest.raises(ValueError, match="hold_ms must be a number in 0..1000"):
            check_stage_knobs({"hold_ms": bad})


@pytest.mark.parametrize("burst_rows, urgent, held", [
    (2, True, True),  # the queued first chunk and the announced one make a burst
    (3, True, False),  # two are not three: the 1-ms hold alone
    (2, False, False),  # a first chunk nobody will be waiting for does not count
])
def test_the_long_hold_is_kept_to_bursts(flow, hift, burst_rows, urgent, held) -> None:
    """`first_chunk_burst_hold_s`: the hold is that long only when `burst_rows` urgent
    first chunks are queued or expected within it; otherwise the fixed hold applies."""
    stage, out = _held_batches(flow, hift, expected_in=0.3, second_after=0.3, hold_s=0.001,
                               knobs={"burst_hold_ms": 1000, "burst_rows": burst_rows}, urgent=urgent)
    assert stage.batches == ([[0, 1]] if held else [[0], [1]])
    assert stage.stats.first_chunk_burst_holds == stage.stats.first_chunk_holds == (1 if held else 0)
    assert stage.stats.first_chunk_hold_caught == (1 if held else 0)
    assert stage.stats.first_chunk_hold_seconds < 1.0  # until the chunk came, not the whole hold
    assert all(isinstance(pcm, np.ndarray) and pcm.size for pcm in out)


def test_the_burst_hold_is_set_up_from_the_config_and_checked(flow, hift, tmp_path) -> None:
    """From the configuration (`--engine.first-chunk-burst-hold-ms`, `-rows`) to the stage,
    and the knobs' bounds."""
    stage = AudioStage(flow, hift, torch.device("cpu"), first_chunk_burst_hold_s=0.08, first_chunk_burst_rows=12)
    assert (stage.burst_hold_ms, stage.burst_rows) == (pytest.approx(80.0), 12)
    s, _ = load_settings([], environ={})
    cfg = engine_config(s, tmp_path)
    assert (cfg.first_chunk_burst_hold_ms, cfg.first_chunk_burst_rows) == (0.0, 8)
    s, _ = load_settings(["--engine.first-chunk-burst-hold-ms", "80", "--engine.first-chunk-burst-rows", "16"],
                         environ={})
    cfg = engine_config(s, tmp_path)
    assert (cfg.first_chunk_burst_hold_ms, cfg.first_chunk_burst_rows) == (80.0, 16)
    for flag, bad, name in (("--engine.first-chunk-burst-hold-ms", "1001", "first_chunk_burst_hold_ms"),
                            ("--engine.first-chunk-burst-hold-ms", "nan", "first_chunk_burst_hold_ms"),
                            ("--engine.first-chunk-burst-rows", "0", "first_chunk_burst_rows")):
        s, _ = load_settings([flag, bad], environ={})
        with pytest.raises(ValueError, match=name):
            engine_config(s, tmp_path)
    assert check_stage_knobs({"burst_hold_ms": 80, "burst_rows": 16}) == {"burst_hold_ms": 80.0, "burst_rows": 16}
    with pytest.raises(ValueError, match="burst_hold_ms must be a number in 0..1000"):
        check_stage_knobs({"burst_hold_ms": 1001})
    for bad in (1.5, 0):  # as the configuration: a burst is at least one first chunk
        with pytest.raises(ValueError, match="burst_rows must be an integer >= 1"):
            check_stage_knobs({"burst_rows": bad})


def _two_first_chunks(stage: AudioStage) -> tuple[list[object], list[ChunkJob]]:
    """Two utterances' streams and a first chunk of each."""
    streams = [stage.new_stream(), stage.new_stream()]
    return streams, [ChunkJob(flow=_chunk(30, seed=i), hift_stream=streams[i], speed=1.0, chunk_index=0,
                              is_cancelled=lambda: False) for i in range(2)]


async def _until_waiting(stage: AudioStage) -> None:
    """Until the stage's loop, woken by a submit, waits again (here: in the hold)."""
    while stage._wake.is_set():
        await asyncio.sleep(0)


def test_a_close_as_a_held_round_wakes_ends_the_stage(flow, hift) -> None:
    """A close that lands as the hold's wait is woken (a chunk queued in the same turn of
    the loop) still ends the stage's loop: on Python 3.11 `asyncio.wait_for` returns the
    woken wait's result and swallows the cancel, and the loop then waits for work for ever."""
    stage = _RecordingStage(flow, hift, torch.device("cpu"), max_batch=8, first_chunk_hold_s=5.0)

    async def go() -> bool:
        streams, jobs = _two_first_chunks(stage)
        await stage.start()
        stage.expect_first_chunk(streams[1], time.monotonic() + 0.5)
        stage.submit(jobs[0])
        await _until_waiting(stage)  # the loop is in the hold, waiting for the announced chunk
        stage.submit(jobs[1])  # wakes the hold's wait ...
        await asyncio.sleep(0)  # ... whose inner wait ends before the hold resumes
        closing = asyncio.create_task(stage.close())
        done, _ = await asyncio.wait({closing}, timeout=3.0)
        if not done:  # let the test end: the second cancel reaches the loop's idle wait
            stage._task.cancel()
            await closing
        return bool(done)

    assert asyncio.run(go()), "the stage's close hung: the hold swallowed its cancel"


@pytest.mark.parametrize("comes", [True, False])
def test_the_hold_counts_the_first_chunks_it_caught_when_a_queued_one_is_dropped(flow, hift, comes) -> None:
    """`first_chunk_hold_caught` counts the first chunks queued during the hold: a queued
    first chunk whose utterance is cancelled meanwhile (`drop_cancelled`) takes none off it,
    and the counter never falls."""
    stage = _RecordingStage(flow, hift, torch.device("cpu"), max_batch=8, first_chunk_hold_s=0.4)
    cancelled = [False]

    async def go() -> None:
        streams = [stage.new_stream(), stage.new_stream()]
        jobs = [ChunkJob(flow=_chunk(30, seed=0), hift_stream=streams[0], speed=1.0, chunk_index=0,
                         is_cancelled=lambda: cancelled[0]),
                ChunkJob(flow=_chunk(30, seed=1), hift_stream=streams[1], speed=1.0, chunk_index=0,
                         is_cancelled=lambda: False)]
        await stage.start()
        stage.expect_first_chunk(streams[1], time.monotonic() + 0.2)
        stage.submit(jobs[0])
        await _until_waiting(stage)  # held for the announced chunk
        cancelled[0] = True  # the first utterance is cancelled (`Session.cancel`)
        stage.drop_cancelled()
        try:
            if comes:
                await asyncio.sleep(0.1)
                await stage.run(jobs[1])
            else:
                await asyncio.sleep(0.6)
        finally:
            await stage.close()

    asyncio.run(go())
    assert stage.stats.first_chunk_holds == 1
    assert stage.stats.first_chunk_hold_caught == (1 if comes else 0)


def test_a_first_chunk_announced_again_after_a_round_passed_it_over_counts_as_passed_over(flow, hift) -> None:
    """`first_chunk_passed_over` counts a first chunk that a round of first chunks started
    without, also when its session announced it again meanwhile (`hold_refresh`)."""
    stage = _RecordingStage(flow, hift, torch.device("cpu"), max_batch=8, first_chunk_hold_s=0.001)

    async def go() -> None:
        streams, jobs = _two_first_chunks(stage)
        await stage.start()
        try:
            stage.expect_first_chunk(streams[1], time.monotonic() + 60.0)  # beyond the hold
            await stage.run(jobs[0])  # a round of first chunks starts without it
            stage.expect_first_chunk(streams[1], time.monotonic())  # announced again
            await stage.run(jobs[1])
        finally:
            await stage.close()

    asyncio.run(go())
    assert stage.batches == [[0], [1]]
    assert stage.stats.first_chunk_passed_over == 1


def test_a_round_without_first_chunks_does_not_wait(flow, hift) -> None:
    """Only a round that starts someone's first audio waits: later chunks are due to
    sessions already playing."""
    stage = _RecordingStage(flow, hift, torch.device("cpu"), max_batch=8, first_chunk_hold_s=5.0)

    async def go() -> None:
        streams = [stage.new_stream(), stage.new_stream()]
        await stage.start()
        stage.expect_first_chunk(streams[1], time.monotonic() + 0.05)
        job = ChunkJob(flow=_chunk(30, seed=0), hift_stream=streams[0], speed=1.0, chunk_index=2,
                       is_cancelled=lambda: False)
        try:
            await stage.run(job)
        finally:
            await stage.close()

    asyncio.run(go())
    assert stage.batches == [[0]] and stage.stats.first_chunk_holds == 0


def test_playback_clock() -> None:
    from engine.playback import PlaybackClock

    clock = PlaybackClock(sample_rate=100)
    assert clock.runs_out() == -np.inf
    clock.deliver(100, now=10.0)  # 1 s of audio from t=10
    clock.deliver(50, now=10.2)  # arrives while playing: the audio runs on
    assert clock.runs_out() == 11.5
    clock.deliver(100, now=12.0)  # after silence: playback starts again
    assert (clock.started_at, clock.samples, clock.runs_out()) == (12.0, 100, 13.0)


def test_a_session_clocks_its_delivered_audio(tiny_model_dir) -> None:
    """The session's playback clock follows the audio it delivers, and the first chunk of
    its first utterance (nothing playing yet) is urgent."""
    jobs: list[ChunkJob] = []

    async def go(engine):
        original = engine.stage.submit

        def spy(job: ChunkJob) -> asyncio.Future[np.ndarray]:
            jobs.append(job)
            return original(job)

        engine.stage.submit = spy
        voice = await default_voice(engine)
        s = engine.open_session(voice, SessionOptions(tokens_per_text_token=3.0, seed=0))
        before = s.playback.runs_out()
        await s.submit("A first sentence to speak.")
        await s.submit("And a second one after it.")
        await s.finish()
        events = await collect(s)
        return before, s.playback, sum(e.pcm.size for e in events if isinstance(e, AudioChunk))

    before, clock, delivered = run(tiny_model_dir, go, warmup=False)
    assert before == -np.inf and clock.started_at is not None
    assert 0 < clock.samples <= delivered  # a restart after silence counts from there
    firsts = [j for j in jobs if j.chunk_index == 0]
    assert len(firsts) == 2 and firsts[0].urgent


def test_a_later_utterance_is_due_after_the_audio_before_it(tiny_model_dir) -> None:
    """Every chunk's deadline counts the session's audio that plays before it and is not
    delivered yet, measured from outside: each earlier utterance's whole audio (its LM is
    done before the next one starts, so its length is known) less what was delivered of it,
    the chunk's own utterance's audio made but not delivered, and its chunks queued
    before it and not made yet (a chunk is queued once the stage took the one before it),
    less what the vocoder keeps back of its first chunk while none of it is made.
    Before, a later utterance's chunks were due by their own clock, as if they played on
    arrival: seconds early, ahead of the playing utterance's next chunks in the "deadline"
    policy."""
    seen: list[tuple[int, int, float, float, float, list[int], list[int], int, int, float]] = []
    first_samples: dict[int, int] = {}  # each utterance's first chunk's audio

    async def go(engine):
        s = engine.open_session(await default_voice(engine), SessionOptions(tokens_per_text_token=3.0, seed=0))
        made: dict[int, int] = {}  # samples handed to the session's delivery, per utterance in order
        made_chunks: dict[int, int] = {}
        made_order: dict[str, int] = {}
        queued_tokens: dict[int, list[int]] = {}  # each queued chunk's tokens
        delivered: dict[int, int] = {}
        order: list[int] = []
        deliver = s.playback.deliver
        original = engine.stage.submit
        put = s._put

        def counted(samples: int, now: float) -> None:  # the session delivers in order
            for i in range(len(order)):
                if delivered.get(i, 0) < made.get(i, 0):
                    delivered[i] = delivered.get(i, 0) + samples
                    break
            deliver(samples, now)

        async def made_audio(utt, item) -> None:  # noqa: ANN001
            if isinstance(item, AudioChunk):
                i = made_order.setdefault(utt.uid, len(made_order))  # utterances make audio in order
                made[i] = made.get(i, 0) + item.pcm.size
                first_samples.setdefault(i, item.pcm.size)
                made_chunks[i] = made_chunks.get(i, 0) + 1
            await put(utt, item)

        def spy(job: ChunkJob) -> asyncio.Future[np.ndarray]:
            key = id(job.hift_stream)
            if key not in order:
                order.append(key)
            i = order.index(key)
            chunks = queued_tokens.setdefault(i, [])
            made_tokens = sum(chunks[:made_chunks.get(i, 0)])
            in_flight = sum(chunks[made_chunks.get(i, 0):])  # queued before it, not made yet
            seen.append((i, job.chunk_index, job.deadline, time.monotonic(), s.playback.runs_out(),
                         [made.get(k, 0) for k in range(len(order))], [delivered.get(k, 0) for k in range(len(order))],
                         made_tokens, in_flight, engine.first_chunks.holdback_s))
            f = job.flow
            chunks.append(len(f.tokens) - f.out_start - (0 if f.finalize else 3))
            return original(job)

        s.playback.deliver = counted
        s._put = made_audio
        engine.stage.submit = spy
        uids = [await s.submit("The first sentence is a long one, so that it takes several chunks to speak."),
                await s.submit("A second one follows it.")]
        await s.finish()
        await collect(s)
        return [len(s.utterance_stats(u).speech_tokens) * TOKEN_SAMPLES for u in uids], queued_tokens

    totals, queued_tokens = run(tiny_model_dir, go, warmup=False)
    sr = 24000

    def delivers(tokens: int, holdback: float) -> float:  # an utterance's audio for its first tokens, until its last chunk
        return max(0.0, tokens * TOKEN_SAMPLES - holdback * sr)

    ahead_seen, short = [], []
    for utt, index, deadline, now, runs_out, made, delivered, made_tokens, in_flight, holdback in seen:
        # Earlier utterances: all their audio not yet delivered; this one: made, not
        # delivered, and what its chunks queued before it and not made yet will deliver.
        coming = delivers(made_tokens + in_flight, holdback) - delivers(made_tokens, holdback) if in_flight else 0.0
        ahead = sum(totals[u] - delivered[u] for u in range(utt)) + made[utt] - delivered[utt] + coming
        want, _ = chunk_due(now, runs_out, ahead / sr)
        assert deadline == pytest.approx(want, abs=0.01), (utt, index)
        if utt == 1:
            ahead_seen.append(ahead)
        if index == 1 and not made_tokens and holdback:
            short.append(in_flight * TOKEN_SAMPLES - coming)
    assert len(ahead_seen) >= 2 and ahead_seen[0] > 0  # the second utterance began behind the first
    # The second utterance's second chunk counted its first chunk's audio as delivered, not
    # its tokens' worth (the first utterance's came before any first chunk was made, when
    # nothing was learnt of the holdback yet).
    assert short == [pytest.approx(queued_tokens[1][0] * TOKEN_SAMPLES - first_samples[1])]
    assert short[0] == pytest.approx(0.16 * sr)


# ----------------------------------------------------------------------------- fill padding


def test_padding_room_is_each_rows_distance_to_the_longest() -> None:
    assert padding_room([114, 54, 84], token_mel_ratio=2) == [0, 30, 15]
    assert padding_room([55, 50], token_mel_ratio=2) == [0, 2]  # whole tokens only
    assert padding_room([], token_mel_ratio=2) == []


def _open_chunk(window: int, seed: int) -> FlowChunk:
    """A chunk that is not the last (its final 3 tokens are lookahead)."""
    return dataclasses.replace(_chunk(window, seed), finalize=False)


def _grow_run(stage: AudioStage, windows: list[int], take: dict[int, int]) -> tuple[list[list[int]], list[np.ndarray]]:
    """Queue one open chunk per window (all in one batch); job i's grow(room) notes room,
    and takes `take[i]` tokens (at most room) by replacing its chunk with a longer one.
    Returns the rooms seen per job and the PCM."""
    rooms: list[list[int]] = [[] for _ in windows]

    def grower(i: int):  # noqa: ANN202
        def grow(room: int) -> FlowChunk | None:
            rooms[i].append(room)
            n = min(take.get(i, 0), room)
            return _open_chunk(windows[i] + n, seed=i) if n else None
        return grow

    return rooms, _serve(stage, lambda: [ChunkJob(flow=_open_chunk(w, seed=i), hift_stream=stage.new_stream(),
                                                  speed=1.0, chunk_index=1, is_cancelled=lambda: False,
                                                  grow=grower(i)) for i, w in enumerate(windows)])


def test_fill_padding_grows_short_chunks_within_the_batch_length(flow, hift) -> None:
    windows = [60, 30, 45]  # computed frames 2 x (window - 3): 114, 54, 84
    stage = _RecordingStage(flow, hift, torch.device("cpu"), max_batch=8, fill_padding=True)
    rooms, pcm = _grow_run(stage, windows, take={1: 25, 2: 40})
    assert stage.batches == [[0, 1, 2]]
    # Asked once each, before the batch ran; job 0 is the longest: no room, not asked.
    assert rooms == [[], [30], [15]]
    assert stage.stats.grown_chunks == 2 and stage.stats.grown_tokens == 25 + 15
    # The grown chunks' audio came out of the same batch: jobs 0 and 2 are now 60 tokens,
    # job 1 55 (the vocoder holds back the same few frames of every open chunk).
    assert pcm[2].size == pcm[0].size and pcm[0].size - pcm[1].size == 2 * 5 * 480
    # What the batch padded to did not grow: the longest row is still the 60-token one.
    assert stage.stats.flow_frames == 3 * 2 * (60 - 3)

    # Off (the default), or alone in its batch: nothing is asked.
    off = _RecordingStage(flow, hift, torch.device("cpu"), max_batch=8)
    assert off.fill_padding is False
    rooms, _ = _grow_run(off, windows, take={1: 25})
    assert rooms == [[], [], []] and off.stats.grown_chunks == 0
    alone = _RecordingStage(flow, hift, torch.device("cpu"), max_batch=1, fill_padding=True)
    rooms, _ = _grow_run(alone, [60, 30], take={1: 25})
    assert alone.batches == [[0], [1]] and rooms == [[], []]


def test_a_batch_that_cannot_be_made_fails_its_chunks_and_the_stage_goes_on(flow, hift) -> None:
    """A chunk's `grow` raising while the batch is made (after its chunks left the queue)
    left them in no round: whoever waited on them waited for ever. They fail with the
    error, and the next chunk is served."""
    stage = _RecordingStage(flow, hift, torch.device("cpu"), max_batch=8, fill_padding=True)

    def broken(room: int) -> FlowChunk | None:
        raise ValueError("no spare tokens")

    async def go() -> tuple[list[object], list[bool], object]:
        jobs = [ChunkJob(flow=_open_chunk(w, seed=i), hift_stream=stage.new_stream(), speed=1.0, chunk_index=1,
                         is_cancelled=lambda: False, grow=broken if i == 1 else None)
                for i, w in enumerate([60, 30])]
        tasks = [asyncio.create_task(stage.run(j)) for j in jobs]
        await stage.start()
        try:
            got = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=30)
            later = await stage.run(ChunkJob(flow=_open_chunk(30, seed=5), hift_stream=stage.new_stream(), speed=1.0,
                                             chunk_index=1, is_cancelled=lambda: False))
        finally:
            await stage.close()
        return got, [j.started.cancelled() for j in jobs], later

    got, started_cancelled, later = asyncio.run(go())
    assert all(isinstance(g, ValueError) for g in got) and started_cancelled == [True, True]
    assert isinstance(later, np.ndarray) and later.size and stage.batches == [[2]]


def test_fill_padding_through_a_stage_pool(flow, hift) -> None:
    """`StagePool` queues a copy of each job: the grown chunk is what its stage runs, and
    the original job learns when its batch started."""
    from engine.stage_pool import StagePool

    stage = AudioStage(flow, hift, torch.device("cpu"), max_batch=8, fill_padding=True)
    pool = StagePool([stage])
    windows = [60, 30]

    async def go() -> tuple[list[ChunkJob], list[np.ndarray]]:
        jobs = [ChunkJob(flow=_open_chunk(w, seed=i), hift_stream=pool.new_stream(), speed=1.0, chunk_index=1,
                         is_cancelled=lambda: False) for i, w in enumerate(windows)]
        jobs[1].grow = lambda room: _open_chunk(30 + room, seed=1)
        tasks = [asyncio.create_task(pool.run(j)) for j in jobs]
        await stage.start()
        try:
            return jobs, list(await asyncio.gather(*tasks))
        finally:
            await stage.close()

    jobs, pcm = asyncio.run(go())
    assert stage.stats.grown_chunks == 1 and stage.stats.grown_tokens == 30
    assert pcm[0].size == pcm[1].size  # the grown 60-token chunk ran, not the 30-token one
    assert all(j.started.result().at > 0 and j.started.result().rows == 2 for j in jobs)


def _prompted(prompt_tokens: int, window: int, seed: int) -> FlowChunk:
    """An open chunk after a `prompt_tokens` prompt, `window` tokens after the prompt."""
    g = torch.Generator().manual_seed(seed)
    return FlowChunk(tokens=torch.randint(0, 6561, (prompt_tokens + window,), generator=g),
                     prompt_feat=torch.randn(2 * prompt_tokens, 80, generator=g), embedding=torch.randn(192, generator=g),
                     num_prompt_tokens=prompt_tokens, out_start=prompt_tokens, finalize=False)


def test_padding_rooms_hold_whichever_way_the_worker_decodes(flow, hift) -> None:
    """With the prompt cache a batch runs either over the frames after each voice's cached
    prefix or (when the cache does not pay) over whole windows; voices' prefixes differ,
    so a row's room is the smaller of the two. With split batches, a row grows only to
    its own call's longest row."""
    cached = AudioStage(flow, hift, torch.device("cpu"), prompt_cache_bytes=1 << 30, fill_padding=True)
    assert cached.prompt_cache is not None
    # Prompts of 103 and 28 tokens: 200 and 50 cached frames (whole 50-frame blocks).
    long_voice, short_voice = _prompted(103, 30, seed=1), _prompted(28, 60, seed=2)
    full = [cached._window_frames(c) for c in (long_voice, short_voice)]
    assert full == [2 * (133 - 3), 2 * (88 - 3)]  # 260, 170
    # After the cached prefix: 60 and 120 frames, so by that measure the long-prompt row
    # has 30 tokens of room; but a whole-window batch would then grow from 260 to 320.
    assert padding_room([60, 120], 2) == [30, 0]
    assert cached._padding_rooms([long_voice, short_voice]) == [0, 0]
    same_voice = [_prompted(103, 30, seed=1), _prompted(103, 60, seed=3)]
    assert cached._padding_rooms(same_voice) == [30, 0]
    # A prompt too long for the cache's budget decodes over its whole window: measured so.
    long_voice, short_voice = _prompted(103, 30, seed=1), _prompted(28, 120, seed=2)  # full 260 and 290
    assert cached._padding_rooms([long_voice, short_voice]) == [15, 0]  # after the prefixes: 60 and 240
    cached.prompt_cache.refused_frames = 200  # as `get_or_build` records a refusal
    assert cached._padding_rooms([long_voice, short_voice]) == [0, 0]  # 260 after "no prefix" vs 240

    split = AudioStage(flow, hift, torch.device("cpu"), split_batches=True, fill_padding=True)
    rows = [_open_chunk(w, seed=i) for i, w in enumerate([43, 43, 43, 43, 202, 202, 202, 190])]
    frames = [split._window_frames(c) for c in rows]  # 80 x 4, 398 x 3, 374
    assert split_by_length(frames) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert split._padding_rooms(rows) == [0, 0, 0, 0, 0, 0, 0, 12]  # not the short call's 159
    for stage in (cached, split):
        stage._pool.shutdown(wait=True)


# Split calls are on by default (round 23 of docs/benchmarks.md), padding filling off.
@pytest.mark.parametrize("flag,name,attr,default", [
    ("--engine.flow-split-batches", "flow_split_batches", "split_batches", True),
    ("--engine.flow-split-padded", "flow_split_padded", "split_padded", True),
    ("--engine.flow-fill-padding", "flow_fill_padding", "fill_padding", False),
    ("--engine.stage-deadline-cut", "stage_deadline_cut", "cut_for_deadlines", True),
    ("--engine.stage-first-chunk-cut", "stage_first_chunk_cut", "first_cut", True),
    ("--engine.stage-second-chunk-cut", "stage_second_chunk_cut", "second_cut", False),
    ("--engine.stage-deadline-cut-rescue", "stage_deadline_cut_rescue", "rescue", False)])
def test_stage_switches_reach_the_stage(tiny_model_dir, tmp_path, flag, name, attr, default) -> None:  # noqa: ANN001
    s, _ = load_settings([], environ={})
    assert getattr(engine_config(s, tmp_path), name) is default
    s, _ = load_settings([flag, str(not default).lower(), "--engine.stage-window-tolerance", "3"], environ={})
    cfg = engine_config(s, tmp_path)
    assert getattr(cfg, name) is not default
    from engine.models.loader import load_model

    stage = build_stage(load_model(tiny_model_dir, load_lm=False), torch.device("cpu"),
                        dataclasses.replace(cfg, model_dir=tiny_model_dir, device="cpu"))
    try:
        assert getattr(stage, attr) is not default and stage.window_tolerance == 3.0
        assert stage.cut_shift_s == pytest.approx(DEADLINE_MARGIN_S - 0.25)  # the default cut margin
    finally:
        stage._pool.shutdown(wait=True)


def test_the_round_estimate_counts_rounds_for_the_utterances_due_and_width_for_all() -> None:
    """Past `max_batch` the whole-crowd estimate adds a round per `max_batch` utterances in
    progress; with `due` it adds them for those utterances alone, and every round stays
    as wide as the crowd (not narrower when few are due)."""
    rounds = RoundTimes()
    for work, wall in ((50, 0.02), (64 * 50, 0.2)):
        rounds.observe(work, wall)
    crowd = estimate_round(rounds, 80, 64, None, 50, 0)
    assert crowd == pytest.approx(0.4)  # two 64-row rounds
    assert estimate_round(rounds, 80, 64, None, 50, 0, due=16) == pytest.approx(0.2)
    assert estimate_round(rounds, 80, 64, None, 50, 0, due=0) == pytest.approx(0.2)  # at least its own round
    assert estimate_round(rounds, 80, 64, None, 50, 0, due=80) == crowd  # a burst: nobody patient
    assert estimate_round(rounds, 200, 64, None, 50, 0, due=100) == pytest.approx(0.4)
    assert estimate_round(rounds, 1, 64, None, 50, 0, due=1) == pytest.approx(0.02)
