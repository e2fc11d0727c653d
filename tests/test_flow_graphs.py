"""The flow's CUDA-graph runner (engine/flow_graphs.py) and the audio stage around it, on CPU.

CUDA graphs themselves need a GPU (bench/stage_bench.py checks graph == eager there).
Everything around them runs here with capture off, through the same code: bucket choice,
padding to the bucket (which must not change a single real frame beyond float noise),
copy into and out of the shared static buffers, the eager fallback, the graph cache
(with a stand-in "graph" that replays by solving eagerly on the static buffers), and the
stage's counters and single host copy.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np
import pytest
import torch

from engine.config import EngineConfig
from engine.stage_build import graph_policy, voice_graph_shapes
from engine.flow_graphs import FlowGraphRunner, GraphPolicy, iter_shapes, prompt_shapes
from engine.flow_prompt_cache import cacheable_frames
from engine.models.config import ModelConfig
from engine.models.flow import CausalMaskedDiffWithDiT, FlowChunk, init_random_
from engine.models.hift import CausalHiFTGenerator
from engine.models.hift import init_random_ as hift_init_random_
from engine.token2wav import AudioStage, ChunkJob, _start_host_copy

# Small buckets so the tiny model exercises row and frame padding in every test.
POLICY = GraphPolicy(batch_buckets=(1, 2, 4, 8), frame_multiple=50, max_frames=200, max_graphs=3)
TOL = 1e-5


@pytest.fixture(scope="module")
def flow() -> CausalMaskedDiffWithDiT:
    torch.set_num_threads(1)
    return init_random_(CausalMaskedDiffWithDiT(ModelConfig.tiny().flow), seed=1234).eval()


def _chunks(n: int, seed: int) -> list[FlowChunk]:
    """n chunks of two voices with mixed lengths, offsets and finalize flags."""
    g = torch.Generator().manual_seed(seed)
    voices = []
    for tp in (13, 21):
        voices.append((torch.randint(0, 6561, (tp,), generator=g), torch.randn(2 * tp, 80, generator=g),
                       torch.randn(192, generator=g)))
    out = []
    for i in range(n):
        pt, pf, emb = voices[i % 2]
        tp = len(pt)
        new = int(torch.randint(5, 30, (1,), generator=g))
        ctx = int(torch.randint(0, 2, (1,), generator=g)) * 25
        finalize = i % 3 == 2
        look = 0 if finalize else 3
        toks = torch.randint(0, 6561, (ctx + new + look,), generator=g)
        out.append(FlowChunk(torch.cat((pt, toks)), pf, emb, tp, out_start=tp + ctx, finalize=finalize,
                             noise_offset=2 * 25 * (i % 4)))
    return out


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert [x.shape for x in a] == [y.shape for y in b]
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


# ----------------------------------------------------------------------------- buckets


def test_row_buckets_are_an_option(tmp_path) -> None:  # noqa: ANN001
    """`--engine.flow-graph-rows`: the graphs' row buckets (say, 48 between 32 and 64, for
    33-48 chunks at 3/4 of the 64-row graph's work); they must increase from 1 up."""
    from gateway.app import engine_config
    from gateway.settings import load_settings

    s, _ = load_settings(["--engine.flow-graph-rows", "1,2,4,8,16,32,48,64"], environ={})
    policy = graph_policy(engine_config(s, tmp_path))
    assert policy.batch_buckets == (1, 2, 4, 8, 16, 32, 48, 64)
    assert policy.bucket(40, 100) == (48, 100) and policy.bucket(49, 100) == (64, 100)
    assert graph_policy(EngineConfig(model_dir=tmp_path)).batch_buckets == GraphPolicy().batch_buckets  # default
    assert load_settings([], environ={})[0].engine.flow_graph_rows == EngineConfig(model_dir=tmp_path).flow_graph_rows
    for bad in ((), (0, 4), (4, 2), (2, 2)):
        with pytest.raises(ValueError, match="flow_graph_rows"):
            EngineConfig(model_dir=tmp_path, flow_graph_rows=bad)


def test_frame_buckets_are_an_option(tmp_path) -> None:  # noqa: ANN001
    """`--engine.flow-graph-frames`: frame sizes with graphs besides the multiples of 50; a
    batch takes the smallest that holds it when that is below its next multiple."""
    from gateway.app import engine_config
    from gateway.settings import load_settings

    s, _ = load_settings(["--engine.flow-graph-frames", "60,70,80"], environ={})
    policy = graph_policy(engine_config(s, tmp_path))
    assert policy.frame_buckets == (60, 70, 80)
    assert policy.bucket(64, 52) == (64, 60) and policy.bucket(64, 61) == (64, 70)
    assert policy.bucket(64, 80) == (64, 80) and policy.bucket(64, 81) == (64, 100)
    assert policy.bucket(64, 40) == (64, 50)  # the multiple is the smaller: taken
    assert policy.bucket(1, 120) == (1, 150)
    default = graph_policy(EngineConfig(model_dir=tmp_path))
    assert default.frame_buckets == () and default.bucket(64, 52) == (64, 100)
    assert load_settings([], environ={})[0].engine.flow_graph_frames == ()
    for bad in ((0, 60), (70, 60), (60, 60)):
        with pytest.raises(ValueError, match="flow_graph_frames"):
            EngineConfig(model_dir=tmp_path, flow_graph_frames=bad)


def test_graph_limit_is_an_option(tmp_path) -> None:  # noqa: ANN001
    """`--engine.flow-graph-limit`: how many flow graphs a stage keeps (a voice's prefix
    width's voices warm up to 187 of their own; the default, 600, holds all three widths'); at
    least 1."""
    from gateway.app import engine_config
    from gateway.settings import load_settings

    s, _ = load_settings(["--engine.flow-graph-limit", "400"], environ={})
    assert graph_policy(engine_config(s, tmp_path)).max_graphs == 400
    assert graph_policy(EngineConfig(model_dir=tmp_path)).max_graphs == GraphPolicy().max_graphs
    assert load_settings([], environ={})[0].engine.flow_graph_limit == EngineConfig(model_dir=tmp_path).flow_graph_limit
    with pytest.raises(ValueError, match="flow_graph_limit"):
        EngineConfig(model_dir=tmp_path, flow_graph_limit=0)


def test_default_buckets_hold_the_rounds_under_load_unpadded_and_the_limit_every_width(tmp_path) -> None:  # noqa: ANN001
    """Under load the stage's rounds hold 3-6 chunks (round 48 of docs/benchmarks.md), which
    powers of two ran as 4 or 8 rows: the default buckets take every count up to 6 as it
    is, one-voice or not. And the default graph limit holds what `FlowGraphRunner.warm`
    captures for voices of every prompt length of all three prefix widths (a one-voice graph
    per bucket, a per-row one for 2 to `prefix_max_rows` rows: this mirrors its loop), so
    registering voices never evicts one another's graphs into captures while serving. At
    the default max_hop (150 tokens) the voices of one width reach 11 frame buckets, their
    windows up to 550 frames."""
    config = EngineConfig(model_dir=tmp_path)
    policy = graph_policy(config)
    for rows in range(1, 7):
        assert policy.padded_rows(rows, 200, shared=True) == rows
        assert policy.padded_rows(rows, 200) == rows
    assert policy.padded_rows(7, 200, shared=True) == 8
    by_width: dict[int, set[tuple]] = {}
    for prompt_tokens in range(1, 400):
        cached = cacheable_frames(prompt_tokens, 2, 3, 50)  # the full-size flow's ratio, lookahead, block
        width = policy.prefix_bucket(cached)
        if not 0 < width <= policy.prefix_max_frames:
            continue
        keys = by_width.setdefault(width, set())
        for rows, frames, cached_frames in voice_graph_shapes(config, 3, prompt_tokens, cached):
            keys.add((policy.bucket(rows, frames, cached_frames, shared=True), True))
            if 1 < rows <= policy.prefix_max_rows:
                keys.add((policy.bucket(rows, frames, cached_frames), False))
    assert sorted(by_width) == [100, 200, 300]
    assert all(None not in {k[0] for k in keys} for keys in by_width.values())
    assert [len(keys) for keys in by_width.values()] == [(11 + 6) * 11] * 3
    assert sum(len(keys) for keys in by_width.values()) <= policy.max_graphs


def test_voice_graph_shapes(tmp_path) -> None:  # noqa: ANN001
    """The shapes warmed for a voice: every window its chunks can have, at every row bucket;
    from the prompt cache the frames after the cached prefix, with the prefix's width; a
    prefix too wide for the prefix graphs keeps the plain shapes of small batches only."""
    cfg = EngineConfig(model_dir=tmp_path)
    policy = graph_policy(cfg)
    plain = voice_graph_shapes(cfg, 3, 106, 0)
    assert {r for r, *_ in plain} == set(policy.batch_buckets) and all(len(s) == 2 for s in plain)
    hops = range(1, max(cfg.max_hop, cfg.initial_hop) + 3 + 1)
    assert plain == prompt_shapes(106, hops=hops, left_context=cfg.flow_left_context, rows=policy.batch_buckets)
    cached = voice_graph_shapes(cfg, 3, 106, 200)
    assert cached == [(r, f - 200, 200) for r, f in plain]
    too_wide = voice_graph_shapes(cfg, 3, 200, 350)
    assert too_wide and {r for r, _ in too_wide} == {r for r in policy.batch_buckets if r <= policy.prefix_max_rows}


def test_bucket_choice() -> None:
    p = GraphPolicy()
    assert p.bucket(1, 1) == (1, 50)
    assert p.bucket(3, 120) == (3, 150)
    assert p.bucket(7, 150) == (8, 150)  # already a multiple: no extra frames
    assert p.bucket(48, 451) == (64, 500)
    # Above 16 rows a bucket takes only batches that fill half of it (with the default
    # buckets, every batch): the rest run eagerly.
    assert p.bucket(33, 451) == (64, 500) and p.bucket(17, 100) == (32, 100)
    strict = replace(p, min_fill=0.75)
    assert strict.bucket(33, 451) is None and strict.bucket(23, 100) is None and strict.bucket(24, 100) == (32, 100)
    assert p.bucket(9, 100) == (12, 100) and p.bucket(13, 100) == (16, 100)  # small buckets: any fill
    assert p.bucket(64, 1500) == (64, 1500)
    assert p.bucket(65, 100) is None  # more rows than the largest bucket
    assert p.bucket(2, 1501) is None  # longer than max_frames
    assert p.bucket(0, 100) is None
    runner = FlowGraphRunner(init_random_(CausalMaskedDiffWithDiT(ModelConfig.tiny().flow), 0).decoder, p)
    assert runner.padded_shape(7, 120) == (8, 150)
    assert runner.padded_shape(65, 120) == (65, 120)  # no bucket: solved as is
    assert not runner.capture  # CPU: never captures
    assert list(iter_shapes([1, 2], [50, 100])) == [(1, 50), (1, 100), (2, 50), (2, 100)]
    # A 150-token prompt, hops 15 then 25: first chunk 330 frames, later 2 * (150 + 1..74 + hop).
    shapes = prompt_shapes(150, hops=[15, 25], left_context=50, rows=[1])
    assert shapes[0] == (1, 330) and shapes[-1] == (1, 498)
    assert {p.bucket(*s) for s in shapes} == {(1, 350), (1, 400), (1, 450), (1, 500)}  # what warm() would capture


# ----------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("n", [1, 3, 5, 6])
def test_padded_buckets_equal_plain_decoding(flow: CausalMaskedDiffWithDiT, n: int) -> None:
    chunks = _chunks(n, seed=n)
    plain, plain_shape = flow.decode_chunks(chunks)
    runner = FlowGraphRunner(flow.decoder, POLICY)
    padded, shape = flow.decode_chunks(chunks, solver=runner)
    assert _max_diff(plain, padded) <= TOL
    assert runner.stats.replays == 1 and runner.stats.eager == 0
    rows, frames = plain_shape.rows, plain_shape.frames
    assert (shape.rows, shape.frames) == POLICY.bucket(rows, frames)
    assert shape.rows > rows or shape.frames > frames or (rows, frames) == (1, 50)  # padding really happened
    # The plain path is today's inference_chunks.
    assert _max_diff(flow.inference_chunks(chunks), plain) == 0.0


def test_a_frame_bucket_between_multiples_pads_exactly(flow: CausalMaskedDiffWithDiT) -> None:
    chunks = _chunks(3, seed=3)
    plain, plain_shape = flow.decode_chunks(chunks)
    fine = replace(POLICY, frame_buckets=(plain_shape.frames + 3,))  # below the next multiple of 50
    assert plain_shape.frames + 3 < POLICY.bucket(plain_shape.rows, plain_shape.frames)[1]
    runner = FlowGraphRunner(flow.decoder, fine)
    padded, shape = flow.decode_chunks(chunks, solver=runner)
    assert shape.frames == plain_shape.frames + 3
    assert _max_diff(plain, padded) <= TOL


def test_static_buffers_carry_nothing_between_batches(flow: CausalMaskedDiffWithDiT) -> None:
    """A big batch then a small one through the same flat buffers: the small one must not
    see the big one's leftovers, whether it arrives padded or not."""
    runner = FlowGraphRunner(flow.decoder, POLICY)
    big, small = _chunks(7, seed=11), _chunks(2, seed=12)
    assert _max_diff(flow.inference_chunks(big, solver=runner), flow.inference_chunks(big)) <= TOL
    assert _max_diff(flow.inference_chunks(small, solver=runner), flow.inference_chunks(small)) <= TOL
    # Unpadded inputs handed straight to the runner: it zero-pads into its buffers itself.
    g = torch.Generator().manual_seed(3)
    rows, frames = 3, 70
    noise, mu, cond = (torch.randn(rows, 80, frames, generator=g) for _ in range(3))
    spks = torch.randn(rows, 80, generator=g)
    mask = torch.ones(rows, 1, frames)
    mask[1, :, 40:] = 0
    with torch.inference_mode():
        want = flow.decoder.solve(noise, mask, mu, spks, cond, True)
    got = runner(noise, mask, mu, spks, cond, True)
    assert got.shape == want.shape
    real = mask.expand_as(want).bool()
    assert float((got - want)[real].abs().max()) <= TOL


def test_no_bucket_falls_back_to_eager(flow: CausalMaskedDiffWithDiT) -> None:
    chunks = _chunks(9, seed=5)  # 9 rows > the largest bucket (8)
    runner = FlowGraphRunner(flow.decoder, POLICY)
    out, shape = flow.decode_chunks(chunks, solver=runner)
    assert runner.stats.eager == 1 and runner.stats.replays == 0
    assert shape.rows == 9 and shape.frames % 2 == 0 and shape.frames % 50 != 0
    assert _max_diff(out, flow.inference_chunks(chunks)) == 0.0
    long = _chunks(1, seed=6)[0]
    extra = torch.randint(0, 6561, (100,), generator=torch.Generator().manual_seed(7))
    tokens = torch.cat((long.tokens, extra))  # > 200 frames
    too_long = replace(long, tokens=tokens)
    assert _max_diff(flow.inference_chunks([too_long], solver=runner), flow.inference_chunks([too_long])) == 0.0
    assert runner.stats.eager == 2


# ----------------------------------------------------------------------------- graph cache


class _EagerGraph:
    """Stands in for torch.cuda.CUDAGraph on CPU: replay() re-runs the recorded solve on the
    static buffers, which is what a real replay computes."""

    def __init__(self, fn) -> None:  # noqa: ANN001
        self.fn = fn
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        self.fn()


class _CpuGraphRunner(FlowGraphRunner):
    def __init__(self, *args, fail: bool = False, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.capture = True  # take the graph path with the stand-in graph
        self.fail = fail
        self.made: list[_EagerGraph] = []

    def _capture(self, views, streaming):  # noqa: ANN001, ANN202
        if self.fail:
            raise RuntimeError("capture invalidated")
        graph = _EagerGraph(lambda: self._solve_into(views, streaming))
        self.made.append(graph)
        return graph


def test_graph_cache_captures_once_per_bucket_and_evicts_lru(flow: CausalMaskedDiffWithDiT) -> None:
    runner = _CpuGraphRunner(flow.decoder, POLICY)
    a, b = _chunks(3, seed=21), _chunks(2, seed=22)  # rows 3 -> 4, rows 2 -> 2
    for _ in range(2):
        assert _max_diff(flow.inference_chunks(a, solver=runner), flow.inference_chunks(a)) <= TOL
    assert runner.stats.captures == 1 and runner.stats.replays == 2 and runner.made[0].replays == 2
    assert _max_diff(flow.inference_chunks(b, solver=runner), flow.inference_chunks(b)) <= TOL
    assert runner.stats.captures == 2 and runner.num_graphs == 2
    # Non-streaming is a different graph (different attention mask).
    flow.inference_chunks(b, streaming=False, solver=runner)
    assert runner.stats.captures == 3
    # warm() captures missing buckets only; max_graphs = 3 evicts the least recently used.
    _, shape_b = flow.decode_chunks(b, solver=runner)  # a replay, and b is now the most recent
    assert runner.stats.captures == 3
    assert runner.warm([(shape_b.rows, shape_b.frames)]) == 0  # cached already
    captured = runner.warm([(1, 50), (1, 40)])  # both map to (1, 50): one capture
    assert captured == 1 and runner.stats.evictions == 1 and runner.num_graphs == 3
    # a's graph was the least recently used: using it again recaptures.
    before = runner.stats.captures
    assert _max_diff(flow.inference_chunks(a, solver=runner), flow.inference_chunks(a)) <= TOL
    assert runner.stats.captures == before + 1


def test_capture_failure_disables_graphs_but_serves_the_batch(flow: CausalMaskedDiffWithDiT) -> None:
    runner = _CpuGraphRunner(flow.decoder, POLICY, fail=True)
    chunks = _chunks(3, seed=31)
    assert runner.padded_shape(3, 60) == (4, 100)
    out = flow.inference_chunks(chunks, solver=runner)
    assert _max_diff(out, flow.inference_chunks(chunks)) <= TOL
    assert runner.stats.captures == 0 and runner.stats.eager == 1
    # From then on batches run eagerly at their own size, not padded to a graph's bucket.
    assert runner.plan(3, 60) == (None, False) and runner.padded_shape(3, 60) == (3, 60)
    flow.inference_chunks(chunks, solver=runner)
    assert runner.stats.eager == 2 and runner.num_graphs == 0


# ----------------------------------------------------------------------------- stage


def _stage_run(stage: AudioStage, chunks: list[FlowChunk]) -> list[np.ndarray]:
    async def go() -> list[np.ndarray]:
        await stage.start()
        try:
            jobs = [ChunkJob(flow=c, hift_stream=stage.new_stream(), speed=1.0, chunk_index=0,
                             is_cancelled=lambda: False) for c in chunks]
            return list(await asyncio.gather(*(stage.run(j) for j in jobs)))
        finally:
            await stage.close()

    return asyncio.run(go())


def test_stage_counts_frames_and_pads_exactly(flow: CausalMaskedDiffWithDiT) -> None:
    hift = hift_init_random_(CausalHiFTGenerator(ModelConfig.tiny().hift), seed=3).eval()
    chunks = _chunks(3, seed=41)
    plain_stage = AudioStage(flow, hift, torch.device("cpu"))
    assert not plain_stage.flow_cuda_graphs and plain_stage.graph_runner() is None  # CPU: off
    plain = _stage_run(plain_stage, chunks)
    st = plain_stage.stats
    assert st.batches == 1 and st.chunks == 3
    _, shape = flow.decode_chunks(chunks)
    assert st.flow_frames == shape.rows * shape.frames == 3 * shape.frames
    mel_frames = sum(2 * (len(c.tokens) - (0 if c.finalize else 3) - c.out_start) for c in chunks)
    assert st.vocoder_frames == mel_frames
    windows = [2 * (len(c.tokens) - (0 if c.finalize else 3)) for c in chunks]
    assert st.flow_exact_frames == sum(windows) < st.flow_frames  # the shorter rows were padded
    assert shape.longest == shape.frames == max(windows)
    assert st.flow_row_padding_frames == 0  # eager: no row added
    assert st.flow_bucket_padding_frames == 0  # ... and no frame bucket: the longest row's frames

    # The same batch through the padded static-buffer path (what CUDA replays).
    padded_stage = AudioStage(flow, hift, torch.device("cpu"), graph_policy=POLICY)
    padded_stage.flow_cuda_graphs = True
    padded_stage._graphs = FlowGraphRunner(flow.decoder, POLICY)
    padded = _stage_run(padded_stage, chunks)
    assert padded_stage.stats.flow_frames == 4 * POLICY.bucket(3, shape.frames)[1]
    assert padded_stage.stats.vocoder_frames == mel_frames
    assert padded_stage.stats.flow_exact_frames == sum(windows)  # the same rows, padded further
    assert padded_stage.stats.flow_row_padding_frames == POLICY.bucket(3, shape.frames)[1]  # a 4th row
    assert padded_stage.stats.flow_bucket_padding_frames == 3 * (POLICY.bucket(3, shape.frames)[1] - shape.frames) > 0
    assert [p.shape for p in padded] == [p.shape for p in plain]
    assert all(p.size > 0 for p in plain)
    assert max(float(np.abs(a - b).max()) for a, b in zip(plain, padded)) <= 1e-4


def test_to_host_splits_one_copy_per_chunk() -> None:
    parts = [torch.arange(5.0), torch.zeros(0), torch.arange(3.0).reshape(1, 3) + 10, torch.tensor([7.0])]
    copy = _start_host_copy(parts)
    assert copy.done is None  # complete
    # Asked for asynchronous on the CPU: complete too, but delivered as a pipelined round's.
    later = _start_host_copy(parts, asynchronous=True)
    assert later.done is not None
    for host in (copy.wait(), later.wait()):
        assert [h.tolist() for h in host] == [[0, 1, 2, 3, 4], [], [10, 11, 12], [7]]
        assert all(h.dtype == np.float32 for h in host)
    assert _start_host_copy([]).wait() == []
