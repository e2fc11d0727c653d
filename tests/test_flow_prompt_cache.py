"""The flow prompt cache (engine/flow_prompt_cache.py): cached decoding gives the frames of
the ordinary `decode_chunks`, the cache is bounded, and the engine option changes only
the work done, not the audio. Tiny random-weight model, float32, CPU."""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import replace

import numpy as np
import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.flow_prompt_cache import (
    PromptCache,
    build_prompt_kv,
    cacheable_frames,
    decode_with_prompt_cache,
    prompt_frames,
)
from engine.models.config import ModelConfig
from engine.models.dit import CausalConvPositionEmbedding, CONV_CONTEXT
from engine.models.flow import CausalMaskedDiffWithDiT, FlowChunk, init_random_
from engine.types import SessionOptions

TOL = 1e-5
LOOK = 3


@pytest.fixture(scope="module")
def flow() -> CausalMaskedDiffWithDiT:
    torch.set_num_threads(1)
    model = CausalMaskedDiffWithDiT(ModelConfig.tiny().flow)
    init_random_(model, seed=4321)
    return model.eval()


@dataclasses.dataclass
class Voice:
    tokens: torch.Tensor
    feat: torch.Tensor
    emb: torch.Tensor
    speech: torch.Tensor  # the utterance's speech tokens

    @property
    def p(self) -> int:
        return int(self.tokens.numel())


def make_voice(p: int, seed: int) -> Voice:
    g = torch.Generator().manual_seed(seed)
    return Voice(torch.randint(0, 6561, (p,), generator=g), torch.randn(2 * p, 80, generator=g),
                 torch.randn(192, generator=g), torch.randint(0, 6561, (200,), generator=g))


def chunk(v: Voice, offset: int, end: int, finalize: bool, left: int = 50) -> FlowChunk:
    """A chunk the way `Session._flow_job` builds it (left-context window on the 25 grid)."""
    win = max(0, (offset - left) // 25 * 25)
    stop = end if finalize else end + LOOK
    return FlowChunk(tokens=torch.cat((v.tokens, v.speech[win:stop])), prompt_feat=v.feat, embedding=v.emb,
                     num_prompt_tokens=v.p, out_start=v.p + offset - win, finalize=finalize, noise_offset=2 * win)


# P = 60 -> C = 100, P = 38 -> C = 50, P = 20 -> C = 0 (too short for a prompt-only block).
@pytest.fixture(scope="module")
def voices() -> list[Voice]:
    return [make_voice(60, 1), make_voice(38, 2), make_voice(20, 3)]


def test_cacheable_frames_are_whole_prompt_only_blocks(flow: CausalMaskedDiffWithDiT) -> None:
    assert cacheable_frames(106, 2, 3, 50) == 200  # 206 prompt-only frames -> 4 blocks
    assert cacheable_frames(28, 2, 3, 50) == 50
    assert cacheable_frames(27, 2, 3, 50) == 0  # 48 prompt-only frames: no whole block
    assert cacheable_frames(2, 2, 3, 50) == 0
    v = make_voice(60, 1)
    assert prompt_frames(flow, chunk(v, 0, 15, False)) == 100


def test_conv_context_reproduces_the_full_convolution() -> None:
    torch.manual_seed(0)
    conv = CausalConvPositionEmbedding(32).eval()
    x = torch.randn(2, 170, 32)
    full = conv(x)
    for c in (0, 50, 100):
        context = x[:, max(0, c - CONV_CONTEXT) : c]
        context = torch.nn.functional.pad(context, (0, 0, CONV_CONTEXT - context.shape[1], 0))
        valid = (torch.arange(-CONV_CONTEXT, 0) + c >= 0).expand(2, -1)
        assert torch.allclose(conv(x[:, c:], context, valid), full[:, c:], atol=1e-6)
    # Without the validity mask a row starting at frame 0 would see Mish(bias) where the
    # full run has conv2's zero padding: the mask is what makes C == 0 rows exact.
    assert not torch.allclose(conv(x, torch.zeros(2, CONV_CONTEXT, 32)), full, atol=1e-6)


def test_cached_decode_equals_decode_chunks(flow: CausalMaskedDiffWithDiT, voices: list[Voice]) -> None:
    a, b, z = voices
    chunks = [
        chunk(a, 0, 15, False),  # first chunk
        chunk(b, 40, 90, False),  # middle chunk with a left-context window (noise offset)
        chunk(a, 90, 140, False),  # middle chunk of the longer prompt, different length
        chunk(z, 15, 40, False),  # C == 0: runs from frame 0 in the same batch
        chunk(b, 140, 163, True),  # final chunk
        chunk(a, 0, 7, True),  # a short whole utterance (final first chunk)
    ]
    ref, ref_shape = flow.decode_chunks(chunks)
    cache = PromptCache()
    entries = cache.entries_for(flow, chunks)
    assert [None if e is None else e.frames for e in entries] == [100, 50, 100, None, 50, 100]
    assert cache.stats.builds == 2 and len(cache) == 2 and cache.stats.hits == 5
    got, shape = decode_with_prompt_cache(flow, chunks, entries)
    assert len(got) == len(ref)
    for r, g in zip(ref, got):
        assert g.shape == r.shape and r.shape[0] > 0
        assert (g - r).abs().max().item() <= TOL
    # Fewer frames computed: the longest row minus its cached prefix, not the longest row.
    assert shape.rows == ref_shape.rows and shape.frames < ref_shape.frames
    # Every row alone gives the same frames as in the padded batch.
    for c, e, g in zip(chunks, entries, got):
        alone, _ = decode_with_prompt_cache(flow, [c], [e])
        assert (alone[0] - g).abs().max().item() <= TOL


def test_one_voice_batch_shares_its_prefix(flow: CausalMaskedDiffWithDiT, voices: list[Voice],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows of one voice get its cached prefix once per CFG half (no per-row copies) and the
    same frames as the per-row layout and as the plain decode, whether the blocks attend to
    it apart (`split_prefix_attention`, from `split_prefix_rows` chunks: the same sums in
    another order) or over a broadcast of it (the same arithmetic as the per-row layout)."""
    from engine.models import dit as dit_mod

    import engine.flow_prompt_cache as fpc

    a = voices[0]
    chunks = [chunk(a, 90, 140, False), chunk(a, 0, 15, False), chunk(a, 40, 90, False), chunk(a, 140, 163, True)]
    entries = PromptCache().entries_for(flow, chunks)
    prefixes = fpc.StepPrefixes(entries, torch.device("cpu"))
    step = prefixes[3]
    assert prefixes.shared is entries[0] and step.shared
    assert step.layer_kv[0][0].shape[0] == 2 and step.conv_context.shape[0] == 2  # per CFG half, not per row
    assert step.layer_kv[0][0].data_ptr() == entries[0].keys[3, 0].data_ptr()  # the cache itself, no copy
    ref, _ = flow.decode_chunks(chunks)
    estimator = flow.decoder.estimator
    calls = []
    real_split = dit_mod.split_prefix_attention
    monkeypatch.setattr(dit_mod, "split_prefix_attention", lambda *a: calls.append(1) or real_split(*a))
    monkeypatch.setattr(estimator, "split_prefix_rows", len(chunks))
    split, _ = decode_with_prompt_cache(flow, chunks, entries)
    assert len(calls) == 10 * len(estimator.transformer_blocks)  # every block of every Euler step
    monkeypatch.setattr(estimator, "split_prefix_rows", len(chunks) + 1)  # fewer chunks than that: no split
    shared, _ = decode_with_prompt_cache(flow, chunks, entries)
    assert len(calls) == 10 * len(estimator.transformer_blocks)
    monkeypatch.setattr(fpc, "shared_entry", lambda entries: None)  # force the per-row layout
    assert not fpc.StepPrefixes(entries, torch.device("cpu"))[0].shared
    per_row, _ = decode_with_prompt_cache(flow, chunks, entries)
    for r, x, s_, p_ in zip(ref, split, shared, per_row):
        assert (s_ - p_).abs().max().item() <= 1e-6
        assert (x - p_).abs().max().item() <= TOL and (x - r).abs().max().item() <= TOL
        assert (s_ - r).abs().max().item() <= TOL


def test_cached_decode_is_the_same_arithmetic_in_float64(voices: list[Voice]) -> None:
    """In float64 the rounding noise of different matrix sizes vanishes: any difference
    left would be a real dependence of the output on the skipped frames."""
    model = CausalMaskedDiffWithDiT(ModelConfig.tiny().flow)
    init_random_(model, seed=4321)
    model = model.double().eval()
    a, b, z = (replace(v, feat=v.feat.double(), emb=v.emb.double()) for v in voices)
    chunks = [chunk(a, 65, 110, False), chunk(z, 0, 15, False), chunk(b, 0, 20, True)]
    ref, _ = model.decode_chunks(chunks)
    got, _ = decode_with_prompt_cache(model, chunks, PromptCache().entries_for(model, chunks))
    for r, g in zip(ref, got):
        assert (g - r).abs().max().item() <= 1e-12


def test_one_entry_per_voice_content(flow: CausalMaskedDiffWithDiT, voices: list[Voice]) -> None:
    a = voices[0]
    cache = PromptCache()
    first = cache.get_or_build(flow, chunk(a, 0, 15, False))
    # Another tensor object with the same prompt (a reloaded voice) finds the same entry.
    copy = FlowChunk(tokens=chunk(a, 15, 40, False).tokens, prompt_feat=a.feat.clone(), embedding=a.emb.clone(),
                     num_prompt_tokens=a.p, out_start=a.p + 15, finalize=False)
    assert cache.get_or_build(flow, copy) is first and cache.stats.builds == 1
    # A different speaker vector is a different voice.
    other = replace(copy, embedding=a.emb + 1.0)
    assert cache.get_or_build(flow, other) is not first and cache.stats.builds == 2
    assert cache.get_or_build(flow, chunk(voices[2], 0, 15, False)) is None  # C == 0


def test_lru_eviction_within_the_byte_budget(flow: CausalMaskedDiffWithDiT, voices: list[Voice]) -> None:
    a, b, _ = voices
    size_a = build_prompt_kv(flow, chunk(a, 0, 15, False)).nbytes
    size_b = build_prompt_kv(flow, chunk(b, 0, 15, False)).nbytes
    assert size_a > size_b  # K/V bytes scale with the cached frames (100 vs 50)
    v3 = make_voice(40, 9)  # C = 50
    cache = PromptCache(budget_bytes=size_a + size_b)
    ea = cache.get_or_build(flow, chunk(a, 0, 15, False))
    cache.get_or_build(flow, chunk(b, 0, 15, False))
    assert cache.nbytes == size_a + size_b and cache.stats.evictions == 0
    assert cache.get(chunk(a, 0, 15, False)) is ea  # a is now the most recently used
    cache.get_or_build(flow, chunk(v3, 0, 15, False))  # evicts b (least recently used)
    assert cache.stats.evictions == 1 and len(cache) == 2
    assert cache.get(chunk(b, 0, 15, False)) is None and cache.get(chunk(a, 0, 15, False)) is ea
    assert cache.nbytes <= cache.budget_bytes
    tiny = PromptCache(budget_bytes=size_b - 1)
    assert tiny.get_or_build(flow, chunk(b, 0, 15, False)) is None  # larger than the whole budget
    assert tiny.stats.too_large == 1 and len(tiny) == 0
    assert cache.refused_frames is None and tiny.refused_frames == prompt_frames(flow, chunk(b, 0, 15, False)) > 0
    assert tiny.get_or_build(flow, chunk(b, 0, 15, False)) is None  # not built again to be refused again
    assert tiny.stats.builds == 1 and tiny.stats.too_large == 1


# ----------------------------------------------------------------------------- engine


async def _run_sessions(tiny_model_dir, **overrides) -> tuple[list[np.ndarray], object]:  # noqa: ANN001
    cfg = EngineConfig(model_dir=tiny_model_dir, device="cpu", lm_backend="torch", warmup=False,
                       initial_hop=5, max_hop=25, flow_left_context=25, seed=0, **overrides)
    engine = await Engine.create(cfg)
    try:
        sr = engine.sample_rate
        t = np.arange(int(2.5 * sr)) / sr  # ~2.5 s prompt: 60+ tokens, at least one whole block
        wav = (0.1 * np.sin(2 * np.pi * 180 * t)).astype(np.float32)
        voice = await engine.prepare_voice("v", wav, sr, "A prompt.")
        short = await engine.prepare_voice("s", wav[: sr // 2], sr, "Short.")
        opts = [SessionOptions(tokens_per_text_token=3.0, seed=i) for i in range(4)]
        texts = ["Hello there, how are you?", "One two three four.", "A short one.", "Testing the cache."]
        voices = [voice, voice, short, voice]
        outs = await asyncio.gather(*(engine.synthesize(x, v, o) for x, v, o in zip(texts, voices, opts)))
        return list(outs), engine.stage.stats
    finally:
        await engine.close()


def test_engine_audio_is_unchanged_by_the_prompt_cache(tiny_model_dir) -> None:  # noqa: ANN001
    base, base_stats = asyncio.run(_run_sessions(tiny_model_dir, flow_prompt_cache=False))
    cached, stats = asyncio.run(_run_sessions(tiny_model_dir, flow_graph_max_rows=0))  # on by default
    assert len(base) == len(cached) == 4
    for x, y in zip(base, cached):
        assert x.shape == y.shape and x.size > 0
        assert float(np.abs(x - y).max()) <= 1e-4
    assert base_stats.prompt_cache_hits == 0 and base_stats.prompt_cache_bytes == 0
    assert stats.prompt_cache_hits > 0 and stats.prompt_cache_bytes > 0
    assert stats.vocoder_frames == base_stats.vocoder_frames
    assert stats.flow_frames < base_stats.flow_frames


def test_settings_reach_the_stage(tiny_model_dir, tmp_path) -> None:  # noqa: ANN001
    from engine.stage_pool import build_stage
    from engine.models.loader import load_model
    from gateway.app import engine_config
    from gateway.settings import load_settings

    s, _ = load_settings([], environ={})
    cfg = engine_config(s, tmp_path)
    assert cfg.flow_prompt_cache is True and cfg.flow_prompt_cache_bytes == 4 << 30  # on by default
    s, _ = load_settings(["--engine.flow-prompt-cache-mib", "64"], environ={})
    cfg = engine_config(s, tmp_path)
    assert cfg.flow_prompt_cache is True and cfg.flow_prompt_cache_bytes == 64 << 20
    env = {"COSYVOICE_GW_ENGINE__FLOW_PROMPT_CACHE": "false"}
    assert load_settings([], environ=env)[0].engine.flow_prompt_cache is False
    with pytest.raises(ValueError, match="flow_prompt_cache_bytes"):
        EngineConfig(model_dir=tmp_path, flow_prompt_cache_bytes=-1)

    model = load_model(tiny_model_dir, load_lm=False)
    on = build_stage(model, torch.device("cpu"), replace(cfg, model_dir=tiny_model_dir))
    off = build_stage(model, torch.device("cpu"), EngineConfig(model_dir=tiny_model_dir, flow_prompt_cache=False))
    assert on.prompt_cache is not None and on.prompt_cache.budget_bytes == 64 << 20
    assert off.prompt_cache is None


def test_stage_bench_checks_the_prompt_cache(tmp_path, capsys) -> None:  # noqa: ANN001
    from bench import stage_bench

    common = ["--tiny", "--device", "cpu", "--batches", "2", "--reps", "0", "--no-graphs", "--prompt-tokens", "40",
              "--context-tokens", "25", "--new-tokens", "10", "--prompt-cache"]
    assert stage_bench.main([*common, "--json", str(tmp_path / "r.json")]) == 0
    import json

    row = json.loads((tmp_path / "r.json").read_text())["rows"][0]
    assert row["cached_ok"] is True and row["prompt_cache_frames"] == 50
    assert row["cached_frames"] == row["frames_per_chunk"] - 50
    assert row["fp32_cached_vs_eager_max_abs"] <= 1e-5
    # A mismatch beyond the tolerance (here: any difference at all is too much) fails the run.
    assert stage_bench.main([*common, "--tol-cache-fp32", "-1"]) == 1
    assert "prompt-cache" in capsys.readouterr().err


def test_one_voice_split_attention_is_the_same_arithmetic_in_float64(voices: list[Voice]) -> None:
    """In float64 the split attention of a one-voice batch (`split_prefix_attention`) gives
    the plain decode's frames to rounding: the merge by log-sum-exp loses nothing."""
    model = CausalMaskedDiffWithDiT(ModelConfig.tiny().flow)
    init_random_(model, seed=4321)
    model = model.double().eval()
    a = replace(voices[0], feat=voices[0].feat.double(), emb=voices[0].emb.double())
    chunks = [chunk(a, 65, 110, False), chunk(a, 0, 15, False), chunk(a, 0, 20, True)]
    entries = PromptCache().entries_for(model, chunks)
    assert all(e is entries[0] for e in entries)
    model.decoder.estimator.split_prefix_rows = 1
    ref, _ = model.decode_chunks(chunks)
    got, _ = decode_with_prompt_cache(model, chunks, entries)
    for r, g in zip(ref, got):
        assert (g - r).abs().max().item() <= 1e-12


def test_graph_runner_with_cached_prefixes_equals_decode_chunks(flow: CausalMaskedDiffWithDiT,
                                                                 voices: list[Voice]) -> None:
    """The static-buffer path a CUDA graph replays (capture off on CPU: same buffers, same
    padding, solved eagerly) gives the frames of the ordinary decode: ragged prefixes (two
    voices and a C == 0 row), rows and frames padded to the bucket, prefixes of 50 and 100
    frames sharing the 100-frame width bucket, buffers poisoned between batches (huge
    keys/values, every slot unmasked, wrong positions: each batch must overwrite or mask
    all of it), one-voice batches through the shared buffers (`PrefixViews.shared`), and a
    batch beyond the prefix bucket limits (eager fallback)."""
    from engine.flow_graphs import FlowGraphRunner, GraphPolicy

    a, b, z = voices
    policy = GraphPolicy(batch_buckets=(1, 2, 4, 8), frame_multiple=50, max_frames=400,
                         prefix_max_rows=4, prefix_max_frames=100, shared_prefix_max_rows=4)
    runner = FlowGraphRunner(flow.decoder, policy, capture=False)
    cache = PromptCache()
    batches = [
        [chunk(a, 90, 140, False), chunk(b, 40, 90, False), chunk(z, 15, 40, False)],  # 3 -> 4 rows
        [chunk(b, 0, 15, False)],  # one voice: shared buffers
        [chunk(a, 90, 140, False), chunk(a, 0, 15, False), chunk(a, 40, 90, False)],  # one voice, 3 -> 4 rows
        [chunk(b, 0, 15, False)],  # narrower prefix after a wider one: stale slots stay masked
        [chunk(b, 0, 15, False), chunk(z, 15, 40, False)],  # mixed, narrower: per-row buffers, poisoned
        [chunk(a, 0, 15, False)] * 5,  # 5 rows > shared_prefix_max_rows: eager
    ]
    for chunks in batches:
        for buffers in runner._prefix.values():
            with torch.inference_mode():  # the buffers are inference tensors
                for t in (buffers._keys, buffers._values, buffers._conv):
                    t.normal_(0.0, 30.0)
                buffers._mask.fill_(True)
                buffers._positions.fill_(77)
        ref, _ = flow.decode_chunks(chunks)
        entries = cache.entries_for(flow, chunks)
        replays, eager = runner.stats.replays, runner.stats.eager
        got, shape = decode_with_prompt_cache(flow, chunks, entries, solver=runner)
        for r, g in zip(ref, got):
            assert g.shape == r.shape and (g - r).abs().max().item() <= TOL
        if len(chunks) <= 4:
            assert runner.stats.replays == replays + 1 and shape.frames % 50 == 0
            assert shape.rows == {1: 1, 2: 2, 3: 4}[len(chunks)]
        else:
            assert runner.stats.eager == eager + 1 and shape.rows == 5
    assert sorted(runner._prefix) == [False, True] and runner.prefix_bytes > 0
    # One voice's buffers hold it once, not once per row.
    assert runner._prefix[True]._keys.numel() * 4 == runner._prefix[False]._keys.numel()
    # Widths share buckets of 100 frames; a prefix wider than the buffers cannot take a graph.
    assert [policy.prefix_bucket(w) for w in (0, 50, 100, 101)] == [0, 100, 100, 200]
    assert policy.bucket(2, 100, width=150) is None and policy.bucket(2, 100, width=50) == (2, 100)


def test_stage_uses_the_cache_with_and_without_graphs(tiny_model_dir) -> None:  # noqa: ANN001
    from engine.flow_graphs import GraphPolicy
    from engine.models.loader import load_model
    from engine.token2wav import AudioStage, ChunkJob

    model = load_model(tiny_model_dir, load_lm=False)
    stage = AudioStage(model.flow, model.hift, torch.device("cpu"), graph_policy=GraphPolicy().with_max_rows(2),
                       prompt_cache_bytes=1 << 30)
    # CPU has no CUDA graphs; the runner's uncaptured padded path stands in for them here.
    stage.flow_cuda_graphs = True
    v = make_voice(60, 5)

    def jobs(n: int) -> list[ChunkJob]:
        return [ChunkJob(flow=chunk(v, 10 * i, 10 * i + 15, False), hift_stream=stage.new_stream(), speed=1.0,
                         chunk_index=0, is_cancelled=lambda: False) for i in range(n)]

    try:
        small = jobs(2)
        full = 2 * max(len(j.flow.tokens) - LOOK for j in small)
        pcm, frames, _ = stage._compute(small)
        # A graph bucket (2 rows) over the cached prefixes: the frames after the 100 cached
        # ones, padded to the 50-frame bucket.
        assert stage.graph_runner().stats.replays == 1 and stage.prompt_cache.stats.hits == 2
        assert frames == 2 * (-(-(full - 100) // 50) * 50)
        big = jobs(3)
        pcm_big, frames_big, _ = stage._compute(big)
        # More rows than the largest graph bucket: eager, exact rows, still from the cache.
        assert stage.graph_runner().stats.replays == 1 and stage.prompt_cache.stats.hits == 5
        full = 2 * max(len(j.flow.tokens) - LOOK for j in big)
        assert frames_big == 3 * (full - 100)
        # Same audio as the stage without the cache (fresh vocoder streams).
        plain = AudioStage(model.flow, model.hift, torch.device("cpu"))
        try:
            ref, _, _ = plain._compute([replace(j, hift_stream=plain.new_stream()) for j in big])
            ref_small, _, _ = plain._compute([replace(j, hift_stream=plain.new_stream()) for j in small])
        finally:
            plain._pool.shutdown(wait=True)
        for a, b in zip(pcm_big + pcm, ref + ref_small):
            assert a.shape == b.shape and float(np.abs(a - b).max()) <= 1e-4
    finally:
        stage._pool.shutdown(wait=True)


def test_a_prefix_too_wide_for_the_prefix_graphs_keeps_the_plain_graph(tiny_model_dir) -> None:  # noqa: ANN001
    """Small batches of a voice whose cached prefix exceeds GraphPolicy.prefix_max_frames take
    the plain graph of the whole window (launch-bound: a graph beats the skipped frames);
    batches above prefix_max_rows still run eagerly from the cache."""
    from engine.flow_graphs import GraphPolicy
    from engine.models.loader import load_model
    from engine.token2wav import AudioStage, ChunkJob

    model = load_model(tiny_model_dir, load_lm=False)
    policy = GraphPolicy(batch_buckets=(1, 2, 4), frame_multiple=50, max_frames=400,
                         prefix_max_rows=2, prefix_max_frames=50)
    stage = AudioStage(model.flow, model.hift, torch.device("cpu"), graph_policy=policy, prompt_cache_bytes=1 << 30)
    stage.flow_cuda_graphs = True  # the runner's uncaptured padded path stands in for graphs on CPU
    v = make_voice(60, 5)  # C = 100 > prefix_max_frames

    def jobs(n: int) -> list[ChunkJob]:
        return [ChunkJob(flow=chunk(v, 10 * i, 10 * i + 15, False), hift_stream=stage.new_stream(), speed=1.0,
                         chunk_index=0, is_cancelled=lambda: False) for i in range(n)]

    try:
        small = jobs(2)
        _, frames, _ = stage._compute(small)
        full = 2 * max(len(j.flow.tokens) - LOOK for j in small)
        assert stage.graph_runner().stats.replays == 1 and stage.prompt_cache.stats.hits == 0
        assert frames == 2 * (-(-full // 50) * 50)  # the whole window, padded to the bucket
        _, frames, _ = stage._compute(jobs(3))  # 3 rows > prefix_max_rows: eager from the cache
        assert stage.graph_runner().stats.replays == 1 and stage.prompt_cache.stats.hits == 3
    finally:
        stage._pool.shutdown(wait=True)


def test_rows_of_a_voice_are_addressed_by_slices_or_one_index() -> None:
    from engine.flow_prompt_cache import MAX_SLICE_RUNS, _row_selectors

    cpu = torch.device("cpu")
    assert _row_selectors([0, 1, 2, 3], 0, cpu) == [slice(0, 4)]
    assert _row_selectors([0, 1, 3, 5, 6], 8, cpu) == [slice(8, 10), slice(11, 12), slice(13, 15)]
    scattered = list(range(0, 2 * (MAX_SLICE_RUNS + 1), 2))  # one run more than slices take
    (index,) = _row_selectors(scattered, 3, cpu)
    assert torch.equal(index, torch.tensor(scattered) + 3)


def test_slice_and_index_row_copies_give_identical_prefixes(flow: CausalMaskedDiffWithDiT, voices: list[Voice],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Voices interleaved row by row (index copies past MAX_SLICE_RUNS runs) and in runs
    (slice copies): the same cached prefixes, bit for bit."""
    import engine.flow_prompt_cache as fpc

    a, b, _ = voices
    chunks = [chunk(v, 40, 60 + 5 * i, False) for i, v in enumerate([a, b] * 3)]
    entries = PromptCache().entries_for(flow, chunks)
    sliced, _ = decode_with_prompt_cache(flow, chunks, entries)
    monkeypatch.setattr(fpc, "MAX_SLICE_RUNS", 0)
    indexed, _ = decode_with_prompt_cache(flow, chunks, entries)
    for s, i in zip(sliced, indexed):
        assert torch.equal(s, i)


def test_graph_plan_falls_back_to_per_row_buffers_and_warms_both(flow: CausalMaskedDiffWithDiT) -> None:
    """A one-voice batch takes the one-voice buffers up to shared_prefix_max_rows and the
    per-row ones above it (up to prefix_max_rows); warm-up captures both kinds, but not the
    per-row kind at one row, which no batch takes (one row is one voice)."""
    from engine.flow_graphs import FlowGraphRunner, GraphPolicy

    policy = GraphPolicy(batch_buckets=(1, 2, 4, 8, 16), prefix_max_rows=4, prefix_max_frames=100,
                         shared_prefix_max_rows=2)
    runner = FlowGraphRunner(flow.decoder, policy, capture=False)
    assert runner.plan(2, 60, width=50, shared=True) == ((2, 100), True)
    assert runner.plan(3, 60, width=50, shared=True) == ((4, 100), False)  # above the one-voice limit
    assert runner.plan(3, 60, width=50, shared=False) == ((4, 100), False)
    assert runner.plan(5, 60, width=50, shared=True) == (None, False)  # above both: eager
    assert runner.plan(16, 60) == ((16, 100), False)  # no prefix: the plain graphs
    off = FlowGraphRunner(flow.decoder, GraphPolicy(prefix_max_rows=4, shared_prefix_max_rows=0), capture=False)
    assert off.plan(1, 60, width=50, shared=True) == ((1, 100), False)

    captured: list[tuple[tuple[int, int], bool]] = []

    def fake_run(shape: tuple[int, int], views: object, streaming: bool, replay: bool = True) -> bool:
        captured.append((shape, getattr(views, "prefix").shared))
        return True

    runner.capture = True  # the capture itself is stubbed: which graphs would warm-up make?
    runner._run = fake_run  # type: ignore[method-assign]
    runner.warm([(1, 60, 50), (4, 60, 50)])
    assert captured == [((1, 100), True), ((4, 100), False)]


def test_a_chunks_cache_key_makes_few_operator_calls(voices: list[Voice]) -> None:
    """The key is asked for every chunk of every batch: after a voice's first chunk it
    costs a few operator calls (each one gives up the interpreter lock), not ~17, and it
    still tells voices apart."""
    from bench.dispatch_count import count

    a, b, _ = voices
    cache = PromptCache()
    first = chunk(a, 0, 15, False)
    key = cache.key(first)
    later = chunk(a, 40, 90, False)  # another chunk of the same voice: new token tensor
    calls = count(lambda: cache.key(later), top=10)
    assert calls["dispatches"] <= 4, calls
    assert cache.key(later) == key and cache.key(chunk(b, 0, 15, False)) != key


def test_a_batch_of_more_voices_than_the_budget_holds_builds_each_voice_once() -> None:
    """Entries were got row by row, and a later row's build evicted the entry an earlier
    row of the same batch had got: the batch held several copies of a voice, the cache
    went over its budget, and every row of a batch cycling through more voices than the
    budget holds was a build. Now each voice of a batch is resolved once, the batch's own
    entries are not evicted for it, and the cache stays within its budget (its byte count
    kept as entries come and go, which the stage's event loop reads)."""
    from engine.flow_prompt_cache import PromptCache, build_prompt_kv
    from engine.models.config import ModelConfig
    from engine.models.flow import CausalMaskedDiffWithDiT, FlowChunk, init_random_

    flow = CausalMaskedDiffWithDiT(ModelConfig.tiny().flow)
    init_random_(flow, seed=1)
    flow.eval()

    def voice(seed: int, p: int = 60) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return (torch.randint(0, 6561, (p,), generator=g), torch.randn(2 * p, 80, generator=g),
                torch.randn(192, generator=g))

    def chunk(v: tuple[torch.Tensor, torch.Tensor, torch.Tensor], seed: int) -> FlowChunk:
        toks, feat, emb = v
        speech = torch.randint(0, 6561, (30,), generator=torch.Generator().manual_seed(seed))
        return FlowChunk(tokens=torch.cat((toks, speech)), prompt_feat=feat, embedding=emb,
                         num_prompt_tokens=len(toks), out_start=len(toks), finalize=False)

    voices = [voice(s) for s in range(3)]
    with torch.inference_mode():
        one = build_prompt_kv(flow, chunk(voices[0], 0)).nbytes
        cache = PromptCache(budget_bytes=2 * one)  # room for two voices
        batch = [chunk(voices[i % 3], i) for i in range(12)]  # three voices, interleaved
        found = cache.entries_for(flow, batch)
        assert cache.stats.builds == 3
        for v in range(3):  # every row of a voice shares its one entry
            assert len({id(found[i]) for i in range(v, 12, 3)}) == 1
        assert cache.nbytes <= cache.budget_bytes and len(cache) == 2
        assert cache.nbytes == 2 * one
        cache.entries_for(flow, batch)
        assert cache.stats.builds == 4  # the one voice the budget could not keep
