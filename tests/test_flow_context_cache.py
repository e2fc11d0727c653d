"""`engine.flow_context_cache`: each utterance keeps its recent flow keys/values so a chunk
computes only its new frames. With an unbounded left context the audio must equal the
whole-prefix recomputation (exact up to rounding); with a bounded one the cache stays
within its frames and the work drops. Tiny random model, float32, CPU (eager batches)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.flow_context_cache import ContextKV
from engine.types import SessionOptions

TEXTS = ["Hello there, how are you doing on this fine day?", "One two three four five six seven eight nine ten.",
         "A short one.", "Testing the context cache with a longer sentence than the others."]


async def _run(tiny_model_dir, **overrides) -> tuple[list[np.ndarray], object, list[ContextKV]]:  # noqa: ANN001
    cfg = EngineConfig(model_dir=tiny_model_dir, device="cpu", lm_backend="torch", warmup=False,
                       initial_hop=5, max_hop=25, seed=0, **overrides)
    engine = await Engine.create(cfg)
    seen: list[ContextKV] = []
    run = engine.stage.run

    async def spy(job):  # noqa: ANN001, ANN202 (records the caches the stage saw)
        if job.context is not None and all(c is not job.context for c in seen):
            seen.append(job.context)
        return await run(job)

    engine.stage.run = spy  # type: ignore[method-assign]
    try:
        sr = engine.sample_rate
        t = np.arange(int(2.5 * sr)) / sr  # ~2.5 s prompt: 60+ tokens, two cached blocks
        wav = (0.1 * np.sin(2 * np.pi * 180 * t)).astype(np.float32)
        voice = await engine.prepare_voice("v", wav, sr, "A prompt.")
        opts = [SessionOptions(tokens_per_text_token=4.0, seed=i) for i in range(len(TEXTS))]
        outs = await asyncio.gather(*(engine.synthesize(x, voice, o) for x, o in zip(TEXTS, opts)))
        return list(outs), engine.stage.stats, seen
    finally:
        await engine.close()


def test_unbounded_context_cache_equals_whole_prefix_recompute(tiny_model_dir) -> None:  # noqa: ANN001
    base, base_stats, _ = asyncio.run(_run(tiny_model_dir, flow_left_context=-1))
    cached, stats, contexts = asyncio.run(_run(tiny_model_dir, flow_left_context=-1, flow_context_cache=True))
    assert len(base) == len(cached) == len(TEXTS)
    for x, y in zip(base, cached):
        assert x.shape == y.shape and x.size > 0
        # float32 rounding of different matrix sizes, through 10 ODE steps and the vocoder
        # (the float64 test below shows the arithmetic itself is the same).
        assert float(np.abs(x - y).max()) <= 2e-3 * float(np.abs(x).max())
    # The caches were used (all but the shortest utterance, whose only complete blocks come
    # with its final chunk, cached frames) and the flow computed far fewer.
    assert len(contexts) == len(TEXTS) and not any(c.stopped for c in contexts)
    assert sum(c.end > 0 for c in contexts) >= len(TEXTS) - 1
    assert stats.flow_frames < 0.7 * base_stats.flow_frames
    assert stats.vocoder_frames == base_stats.vocoder_frames


def test_bounded_context_cache_keeps_its_window(tiny_model_dir) -> None:  # noqa: ANN001
    base, base_stats, _ = asyncio.run(_run(tiny_model_dir, flow_left_context=25))
    cached, stats, contexts = asyncio.run(_run(tiny_model_dir, flow_left_context=25, flow_context_cache=True))
    for x, y in zip(base, cached):
        assert x.shape == y.shape and np.isfinite(y).all() and np.abs(y).max() > 0
    assert contexts and all(c.max_frames == 50 and c.frames <= 50 for c in contexts)
    assert any(c.end > 0 for c in contexts)
    assert stats.flow_frames < base_stats.flow_frames


def test_context_cache_settings(tiny_model_dir, tmp_path) -> None:  # noqa: ANN001
    from gateway.app import engine_config
    from gateway.settings import load_settings

    assert engine_config(load_settings([], environ={})[0], tmp_path).flow_context_cache is False
    s, _ = load_settings(["--engine.flow-context-cache", "true", "--engine.flow-context-cache-mib", "64"], environ={})
    cfg = engine_config(s, tmp_path)
    assert cfg.flow_context_cache is True and cfg.flow_context_cache_bytes == 64 << 20
    with pytest.raises(ValueError, match="flow_context_cache"):
        EngineConfig(model_dir=tmp_path, flow_context_cache=True, flow_prompt_cache=False)
    with pytest.raises(ValueError, match="flow_context_cache"):
        EngineConfig(model_dir=tmp_path, flow_context_cache=True, flow_left_context=10)


def test_cached_chunks_are_the_same_arithmetic_in_float64() -> None:
    """The stage's plan/decode/commit cycle over one utterance's chunks, in float64 (where
    different matrix sizes leave no rounding noise), equals recomputing the whole prefix for
    every chunk: the cached keys/values are exactly what the recomputation would produce."""
    import torch

    from engine.flow_context_cache import ContextCache
    from engine.flow_prompt_cache import PromptCache, decode_with_prompt_cache
    from engine.models.config import ModelConfig
    from engine.models.flow import CausalMaskedDiffWithDiT, FlowChunk, init_random_

    flow = init_random_(CausalMaskedDiffWithDiT(ModelConfig.tiny().flow), 4321).double().eval()
    g = torch.Generator().manual_seed(1)
    p = 60  # C = 100 cached prompt frames
    prompt = torch.randint(0, 6561, (p,), generator=g)
    feat, emb = torch.randn(2 * p, 80, generator=g).double(), torch.randn(192, generator=g).double()
    speech = torch.randint(0, 6561, (200,), generator=g)
    cache, contexts = PromptCache(), ContextCache(1 << 30, block=50)
    ctx = ContextKV(max_frames=10_000)
    bounds = [(0, 15, False), (15, 40, False), (40, 90, False), (90, 140, False), (140, 163, True)]
    for offset, end, finalize in bounds:
        stop = end if finalize else end + 3
        chunk = FlowChunk(tokens=torch.cat((prompt, speech[:stop])), prompt_feat=feat, embedding=emb,
                          num_prompt_tokens=p, out_start=p + offset, finalize=finalize)
        ref, _ = flow.decode_chunks([chunk])
        entries = cache.entries_for(flow, [chunk])
        before = ctx.end
        plan = contexts.plan(flow.decoder.estimator, flow.decoder.n_timesteps, entries, [ctx], [2 * (p + end)], [0],
                             [2 * p], [finalize])
        got, shape = decode_with_prompt_cache(flow, [chunk], plan.entries, record=plan.records or None)
        plan.commit()
        assert got[0].shape == ref[0].shape
        assert (got[0] - ref[0]).abs().max().item() <= 1e-10, (offset, end)
        # Once frames are cached, the ODE runs only from the end of the cache.
        assert shape.frames == 2 * (p + end) - (before or 100)
    # The cache ends at the last whole block (frame 400 of 446) and holds all frames after
    # the prompt's 100 cached ones (unbounded context).
    assert ctx.end == 400 and ctx.frames == 300


def _f64_flow():  # noqa: ANN202
    import torch

    from engine.models.config import ModelConfig
    from engine.models.flow import CausalMaskedDiffWithDiT, init_random_

    torch.set_num_threads(1)
    return init_random_(CausalMaskedDiffWithDiT(ModelConfig.tiny().flow), 4321).double().eval()


def test_mixed_rows_and_moving_windows_in_float64() -> None:
    """A batch of three utterances decoded together chunk by chunk, each from a window that
    drops whole 25-token blocks behind it (noise_offset > 0 from the third chunk on), one
    with no prompt cache entry (P = 20, C = 0) and one whose prompt ends past its first
    uncached block (P = 77: C = 100, 2P = 154). With caches that keep everything, every cached
    row must equal the whole-prefix recomputation in float64 (the absolute frame and rotary
    arithmetic of cached and new frames is right, whatever the window), and the row without
    a cache its ordinary windowed decode."""
    import torch

    from engine.flow_context_cache import ContextCache
    from engine.flow_prompt_cache import PromptCache, decode_with_prompt_cache
    from engine.models.flow import FlowChunk

    flow = _f64_flow()
    g = torch.Generator().manual_seed(2)
    voices = []
    for p in (60, 20, 77):
        voices.append((p, torch.randint(0, 6561, (p,), generator=g), torch.randn(2 * p, 80, generator=g).double(),
                       torch.randn(192, generator=g).double(), torch.randint(0, 6561, (260,), generator=g)))
    cache, contexts = PromptCache(), ContextCache(1 << 34, block=50)
    ctxs = [ContextKV(max_frames=10_000) for _ in voices]
    offsets = [0, 0, 0]
    left, ran_with_offset = 25, False
    for step in range(6):
        chunks, refs, finals = [], [], []
        for i, (p, prompt, feat, emb, speech) in enumerate(voices):
            offset = offsets[i]
            end = offset + 15 if step == 0 else offset + 25 + (-(p + offset)) % 25 if step == 1 else offset + 50
            final = step == 5
            stop = end if final else end + 3
            win = max(0, (offset - left) // 25 * 25)
            kw = dict(prompt_feat=feat, embedding=emb, num_prompt_tokens=p, finalize=final)
            chunks.append(FlowChunk(tokens=torch.cat((prompt, speech[win:stop])), out_start=p + offset - win,
                                    noise_offset=2 * win, **kw))
            whole = FlowChunk(tokens=torch.cat((prompt, speech[:stop])), out_start=p + offset, **kw)
            refs.append(flow.decode_chunks([whole])[0][0])
            finals.append(final)
            offsets[i] = end
        entries = cache.entries_for(flow, chunks)
        frames = [2 * (len(c.tokens) - (0 if c.finalize else 3)) for c in chunks]
        plan = contexts.plan(flow.decoder.estimator, flow.decoder.n_timesteps, entries, ctxs, frames,
                             [c.noise_offset for c in chunks], [2 * c.num_prompt_tokens for c in chunks], finals)
        ran_with_offset |= any(c.noise_offset > 0 for c, r in zip(chunks, plan.entries) if hasattr(r, "context"))
        got, _ = decode_with_prompt_cache(flow, chunks, plan.entries, record=plan.records or None)
        plan.commit()
        for i, (x, r) in enumerate(zip(got, refs)):
            if entries[i] is None:  # no prompt cache, no context cache: the windowed recompute
                r = flow.decode_chunks([chunks[i]])[0][0]
            assert x.shape == r.shape and (x - r).abs().max().item() <= 1e-10, (step, i)
    assert ran_with_offset
    assert ctxs[1].end == 0 and ctxs[0].end > 0 and ctxs[2].end > 0  # C = 0: nothing to follow


def test_the_budget_bounds_the_caches() -> None:
    """A budget below one utterance's growth stops (and frees) that utterance's cache; the
    chunk is still decoded, from the prompt alone."""
    import torch

    from engine.flow_context_cache import ContextCache
    from engine.flow_prompt_cache import PromptCache, decode_with_prompt_cache
    from engine.models.flow import FlowChunk

    flow = _f64_flow()
    g = torch.Generator().manual_seed(3)
    p = 60
    prompt, speech = torch.randint(0, 6561, (p,), generator=g), torch.randint(0, 6561, (100,), generator=g)
    kw = dict(prompt_feat=torch.randn(2 * p, 80, generator=g).double(),
              embedding=torch.randn(192, generator=g).double(), num_prompt_tokens=p, finalize=False)
    per_frame = ContextKV.bytes_per_frame(flow.decoder.estimator, flow.decoder.n_timesteps)
    contexts, cache = ContextCache(120 * per_frame, block=50), PromptCache()  # room for 120 frames
    ctx = ContextKV(max_frames=10_000)
    for offset, end in ((0, 40), (40, 90)):
        chunk = FlowChunk(tokens=torch.cat((prompt, speech[: end + 3])), out_start=p + offset, **kw)
        entries = cache.entries_for(flow, [chunk])
        plan = contexts.plan(flow.decoder.estimator, flow.decoder.n_timesteps, entries, [ctx], [2 * (p + end)], [0],
                             [2 * p], [False])
        got, _ = decode_with_prompt_cache(flow, [chunk], plan.entries, record=plan.records or None)
        plan.commit()
        ref, _ = flow.decode_chunks([chunk])
        assert (got[0] - ref[0]).abs().max().item() <= 1e-10
        if offset == 0:
            assert ctx.frames == 100 and contexts.nbytes <= 120 * per_frame + ctx.conv_context.numel() * 8
    # The second chunk would have grown the cache to 200 frames: stopped and freed instead.
    assert ctx.stopped and ctx.keys is None and contexts.nbytes == 0
