"""The flow context cache (engine/flow_context_cache.py): with a ring as long as the
utterance, chunks that read their own kept keys/values give exactly the frames of the
uncached whole-prefix decode; a shorter ring is a sliding window; slots are bounded,
reused and given back. Tiny random-weight model, CPU."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np
import pytest
import torch

from engine.chunking import ChunkSchedule
from engine.config import EngineConfig
from engine.engine import Engine
from engine.flow_context_cache import ContextCache, decode_with_context, slot_bytes
from engine.flow_prompt_cache import PromptCache, decode_with_prompt_cache
from engine.models.config import ModelConfig
from engine.models.flow import CausalMaskedDiffWithDiT, init_random_
from engine.types import SessionOptions
from tests.test_flow_prompt_cache import LOOK, Voice, chunk, flow, make_voice  # noqa: F401 (a fixture)

TOL = 1e-5
UNBOUNDED = 10**6  # left context (tokens) longer than any utterance here: windows from token 0


class Utterance:
    """A key for the cache's slots (the stage uses each utterance's vocoder stream)."""


def schedule(v: Voice, total: int, initial_hop: int = 8) -> list[tuple[int, int, bool]]:
    """(offset, end, finalize) of an utterance of `total` tokens, as the engine chunks it."""
    s, out = ChunkSchedule(prompt_tokens=v.p, initial_hop=initial_hop, max_hop=100, lookahead=LOOK), []
    while True:
        hop = s.ready(total)
        if hop is None or s.offset + hop + LOOK > total:
            out.append((s.offset, total, True))
            return out
        out.append((s.offset, s.offset + hop, False))
        s.advance(hop)


def cache_for(flow: CausalMaskedDiffWithDiT, frames: int, slots: int = 4,
              dtype: torch.dtype = torch.float32) -> ContextCache:
    per = slot_bytes(flow.decoder.estimator, flow.decoder.n_timesteps, frames, dtype)
    return ContextCache(flow, frames, (slots + 1) * per, torch.device("cpu"), dtype)  # + the scratch slot


def run_utterance(flow: CausalMaskedDiffWithDiT, v: Voice, plan: list[tuple[int, int, bool]],
                  cache: ContextCache | None, left: int, key: Utterance | None = None) -> tuple[list[torch.Tensor], int]:
    """Each chunk alone, in order; the mel frames and the ODE frames computed."""
    prompts = PromptCache()
    key = Utterance() if key is None else key
    mels, work = [], 0
    for offset, end, final in plan:
        c = chunk(v, offset, end, final, left=left)
        entries = prompts.entries_for(flow, [c])
        p = None if cache is None else cache.plan([c], entries, [key])
        if p is None:
            out, shape = decode_with_prompt_cache(flow, [c], entries)
        else:
            out, shape = decode_with_context(flow, [c], entries, cache, p)
        mels.append(out[0])
        work += shape.rows * shape.frames
    return mels, work


def test_schedule_ends_chunks_on_the_grid() -> None:
    v = make_voice(60, 1)
    plan = schedule(v, 200)
    assert plan[:4] == [(0, 8, False), (8, 40, False), (40, 90, False), (90, 190, False)]
    assert plan[-1] == (190, 200, True)
    assert all((v.p + end) % 25 == 0 for _, end, final in plan[1:] if not final)


def test_a_ring_as_long_as_the_utterance_gives_the_whole_prefix_frames(flow: CausalMaskedDiffWithDiT) -> None:
    v = make_voice(60, 1)
    plan = schedule(v, 200)
    exact, exact_work = run_utterance(flow, v, plan, None, left=UNBOUNDED)  # every chunk recomputes from token 0
    cache = cache_for(flow, frames=1000)
    got, work = run_utterance(flow, v, plan, cache, left=50)
    for e, g in zip(exact, got):
        assert g.shape == e.shape and e.shape[0] > 0
        assert (g - e).abs().max().item() <= TOL
    # Chunks 2.. read their ring; chunks 1..3 kept their final frames; the final chunk gave
    # its slot back.
    assert cache.reads == 3 and cache.records == 3 and cache.in_use() == 0
    assert work < exact_work / 2


def test_the_same_in_float64(flow: CausalMaskedDiffWithDiT) -> None:
    """No rounding noise to hide behind: the ring holds what the whole prefix recomputes."""
    model = CausalMaskedDiffWithDiT(ModelConfig.tiny().flow)
    init_random_(model, seed=4321)
    model = model.double().eval()
    v = make_voice(38, 2)
    v = replace(v, feat=v.feat.double(), emb=v.emb.double())
    plan = schedule(v, 150, initial_hop=0)
    exact, _ = run_utterance(model, v, plan, None, left=UNBOUNDED)
    got, _ = run_utterance(model, v, plan, cache_for(model, 1000, dtype=torch.float64), left=25)
    for e, g in zip(exact, got):
        assert (g - e).abs().max().item() <= 1e-12


def test_a_short_ring_is_a_sliding_window(flow: CausalMaskedDiffWithDiT) -> None:
    v = make_voice(60, 1)
    plan = schedule(v, 200)
    exact, _ = run_utterance(flow, v, plan, None, left=UNBOUNDED)
    cache = cache_for(flow, frames=100)
    got, _ = run_utterance(flow, v, plan, cache, left=50)
    # Chunks 0-2 see everything before them either way (chunk 2 starts 100 frames after the
    # cached prompt); chunk 3 no longer sees the first generated block.
    for e, g in zip(exact[:3], got[:3]):
        assert (g - e).abs().max().item() <= TOL
    assert (got[3] - exact[3]).abs().max().item() > 1e-3
    assert all(torch.isfinite(g).all() for g in got)


def test_a_batch_mixes_ring_rows_with_others(flow: CausalMaskedDiffWithDiT) -> None:
    """Rows at different points of their utterances (and another voice, and a row with no
    cached prompt) in one call: each gets the frames it gets alone."""
    a, b, short = make_voice(60, 1), make_voice(38, 2), make_voice(20, 3)
    cache = cache_for(flow, frames=1000)
    prompts = PromptCache()
    ka, kb, kz = Utterance(), Utterance(), Utterance()
    plan_a, plan_b = schedule(a, 200), schedule(b, 150)
    # Bring both utterances to their third chunk one chunk at a time.
    for (oa, ea, fa), (ob, eb, fb) in zip(plan_a[:2], plan_b[:2]):
        cs = [chunk(a, oa, ea, fa), chunk(b, ob, eb, fb)]
        entries = prompts.entries_for(flow, cs)
        p = cache.plan(cs, entries, [ka, kb])
        if p is not None:  # chunk 0 ends between blocks: nothing to keep
            decode_with_context(flow, cs, entries, cache, p)
    assert cache.in_use() == 2
    cs = [chunk(a, *plan_a[2]), chunk(short, 0, 15, False), chunk(b, *plan_b[2])]
    entries = prompts.entries_for(flow, cs)
    p = cache.plan(cs, entries, [ka, kz, kb])
    assert p is not None and p.reads
    got, _ = decode_with_context(flow, cs, entries, cache, p)
    exact = [run_utterance(flow, a, plan_a[:3], None, left=UNBOUNDED)[0][2],
             decode_with_prompt_cache(flow, [cs[1]], [entries[1]])[0][0],
             run_utterance(flow, b, plan_b[:3], None, left=UNBOUNDED)[0][2]]
    for e, g in zip(exact, got):
        assert g.shape == e.shape and (g - e).abs().max().item() <= TOL


def test_slots_are_bounded_reused_and_given_back(flow: CausalMaskedDiffWithDiT) -> None:
    v = make_voice(60, 1)
    cache = cache_for(flow, frames=100, slots=2)
    prompts = PromptCache()
    keys = [Utterance() for _ in range(3)]

    def step(offset: int, end: int, final: bool, which: list[int]) -> None:
        cs = [chunk(v, offset, end, final) for _ in which]
        entries = prompts.entries_for(flow, cs)
        p = cache.plan(cs, entries, [keys[i] for i in which])
        if p is not None:
            decode_with_context(flow, cs, entries, cache, p)

    step(8, 40, False, [0, 1, 2])  # three chunks ending on the grid, two slots
    assert cache.in_use() == 2 and cache.refused == 1
    assert cache.nbytes == 3 * cache.slot_bytes  # and the scratch slot
    step(40, 90, False, [2])  # no slot: recomputes (window from 0) and takes the LRU slot
    assert cache.in_use() == 2 and cache.reads == 0
    step(40, 90, False, [0])  # slot 0 was taken from it: chain ended, recomputes, keeps again
    assert cache.in_use() == 2
    step(90, 140, True, [2])  # final: gives its slot back
    assert cache.in_use() == 1
    step(8, 40, False, [1])  # takes the empty slot: both are held now (by 0 and 1)
    step(90, 140, False, [0])  # 0 reads and keeps again: 1 is now the least recently used
    assert cache.in_use() == 2 and cache._slot_of(keys[0]) is not None and cache.reads == 2
    # An utterance that is gone frees its slot for the next one, before the LRU rule would
    # take 1's; nothing is refused.
    refused, gone = cache.refused, cache._slot_of(keys[0])
    keys[0] = Utterance()
    step(8, 40, False, [2])
    assert cache._slot_of(keys[2]) == gone and cache._slot_of(keys[1]) is not None
    assert cache.refused == refused


def test_a_chunk_off_the_grid_or_from_a_shifted_window_keeps_nothing(flow: CausalMaskedDiffWithDiT) -> None:
    v = make_voice(60, 1)
    cache = cache_for(flow, frames=100)
    prompts = PromptCache()
    for c in (chunk(v, 0, 8, False),  # ends between blocks
              chunk(v, 90, 140, False, left=25),  # window from token 50: positions shifted, no ring
              chunk(v, 0, 40, True)):  # final
        entries = prompts.entries_for(flow, [c])
        assert cache.plan([c], entries, [Utterance()]) is None
    assert cache.in_use() == 0 and cache.nbytes == 0


def test_the_cache_needs_a_bounded_ring(flow: CausalMaskedDiffWithDiT) -> None:
    with pytest.raises(ValueError, match="bounded"):
        ContextCache(flow, 0, 1 << 30, torch.device("cpu"), torch.float32)




async def _synthesize(model_dir, **overrides) -> tuple[list[np.ndarray], object]:  # noqa: ANN001
    # Chunks of fixed sizes (as `helpers.engine_config`): the two runs compare audio.
    cfg = EngineConfig(model_dir=model_dir, device="cpu", lm_backend="torch", warmup=False, initial_hop=5,
                       max_hop=50, seed=0, initial_hop_max=0, chunk_patience_s=0.0, **overrides)
    engine = await Engine.create(cfg)
    try:
        sr = engine.sample_rate
        t = np.arange(int(2.5 * sr)) / sr  # a prompt with whole cached blocks
        voice = await engine.prepare_voice("v", (0.1 * np.sin(2 * np.pi * 180 * t)).astype(np.float32), sr, "A prompt.")
        opts = [SessionOptions(tokens_per_text_token=6.0, seed=i) for i in range(2)]
        texts = ["Hello there, how are you doing on this fine day?", "One two three four five six seven."]
        outs = await asyncio.gather(*(engine.synthesize(x, voice, o) for x, o in zip(texts, opts)))
        return list(outs), engine.stats()
    finally:
        await engine.close()


def test_engine_audio_with_an_unbounded_ring_is_the_whole_prefix_audio(tiny_model_dir) -> None:  # noqa: ANN001
    """Through the engine (chunk schedule, batching, vocoder): an unbounded left context
    recomputed every chunk, against the same window kept in the context cache."""
    exact, base = asyncio.run(_synthesize(tiny_model_dir, flow_left_context=-1))
    kept, stats = asyncio.run(_synthesize(tiny_model_dir, flow_left_context=1000, flow_context_cache_bytes=8 << 30))
    assert len(exact) == len(kept) == 2
    for x, y in zip(exact, kept):
        assert x.shape == y.shape and x.size > 0
        # float32 rounding of different matrix sizes, grown over seconds of audio (the
        # decode-level float64 test above shows the arithmetic is the same).
        assert float(np.abs(x - y).max()) <= 1e-3
        assert float(np.sqrt(np.mean((x - y) ** 2))) <= 1e-3 * float(np.sqrt(np.mean(x**2)))
    assert base.context_reads == 0 and base.context_bytes == 0
    assert stats.context_reads > 0 and stats.context_records > 0 and stats.context_bytes > 0
    assert stats.vocoder_frames == base.vocoder_frames
    assert stats.flow_frames < 0.7 * base.flow_frames


def test_the_context_cache_needs_a_bounded_left_context_and_the_prompt_cache(tiny_model_dir) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match="bounded"):
        EngineConfig(model_dir=tiny_model_dir, flow_left_context=-1, flow_context_cache_bytes=1 << 30)
    with pytest.raises(ValueError, match="flow_prompt_cache"):
        EngineConfig(model_dir=tiny_model_dir, flow_prompt_cache=False, flow_context_cache_bytes=1 << 30)


def test_settings_reach_the_stage(tiny_model_dir, tmp_path) -> None:  # noqa: ANN001
    from engine.stage_pool import build_stage
    from engine.models.loader import load_model
    from gateway.app import engine_config
    from gateway.settings import load_settings

    s, _ = load_settings(["--engine.flow-context-cache-mib", "2048", "--engine.flow-context-min-rows", "4"], environ={})
    cfg = engine_config(s, tmp_path)
    assert cfg.flow_context_cache_bytes == 2 << 30 and cfg.flow_context_min_rows == 4
    stage = build_stage(load_model(tiny_model_dir, load_lm=False), torch.device("cpu"), replace(cfg, device="cpu"))
    try:
        assert stage.context_cache is not None and stage.context_min_rows == 4
        assert stage.context_cache.frames == 2 * cfg.flow_left_context
        assert stage.context_cache.capacity == (2 << 30) // stage.context_cache.slot_bytes - 1
    finally:
        stage._pool.shutdown(wait=True)
    off, _ = load_settings([], environ={})
    assert engine_config(off, tmp_path).flow_context_cache_bytes == 0


def test_the_stage_warms_the_context_calls_once(tiny_model_dir) -> None:  # noqa: ANN001
    from engine.flow_context_cache import warmup_chunks
    from engine.models.loader import load_model
    from engine.token2wav import AudioStage

    model = load_model(tiny_model_dir, load_lm=False)
    stage = AudioStage(model.flow, model.hift, torch.device("cpu"), prompt_cache_bytes=1 << 30,
                       context_cache_bytes=1 << 30, context_frames=100)
    v = make_voice(60, 1)
    prompt = chunk(v, 0, 0, True)
    kinds = warmup_chunks(model.flow, prompt)
    assert [(c.out_start - v.p, c.finalize) for c in kinds] == [(0, False), (15, False), (40, True)]
    try:
        assert asyncio.run(stage.warm_context(prompt)) is True
        ctx = stage.context_cache
        assert ctx is not None and ctx.records == 2 and ctx.reads == 2 and ctx.in_use() == 0
        assert asyncio.run(stage.warm_context(prompt)) is False  # once per stage
    finally:
        stage._pool.shutdown(wait=True)


def test_context_bench_times_both_modes_and_checks_the_ring(tmp_path, capsys) -> None:  # noqa: ANN001
    from bench.context_bench import main

    report = main(["--device", "cpu", "--model", "tiny-random", "--model-cache", str(tmp_path), "--rows", "2",
                   "--reps", "1", "--cache-mib", "256", "--check", "--json", str(tmp_path / "r.json")])
    (r,) = report["results"]
    assert r["on"]["flow_frames"] < 0.7 * r["off"]["flow_frames"]
    assert len(r["on"]["round_ms"]) == r["chunks_per_utterance"] >= 4
    assert r["context_reads"] > 0 and r["context_records"] > 0
    assert all(x < 1e-3 for x in report["check_relative_rms"])  # float32 rounding (see the engine test)
    assert "on/off" in capsys.readouterr().out


def test_context_bench_compares_any_option(tmp_path, capsys) -> None:  # noqa: ANN001
    """`--ab`: the stage without and with an EngineConfig field, the context cache off in both."""
    from bench.context_bench import main

    report = main(["--device", "cpu", "--model", "tiny-random", "--model-cache", str(tmp_path), "--rows", "2",
                   "--reps", "1", "--ab", "flow_prompt_cache=false", "--check", "--json", str(tmp_path / "r.json")])
    assert report["ab"] == {"flow_prompt_cache": False}
    assert report["config"]["flow_context_cache_bytes"] == 0
    (r,) = report["results"]
    # Without the prompt cache every chunk computes the prompt's frames again: same audio.
    assert r["on"]["flow_frames"] > r["off"]["flow_frames"] and "context_reads" not in r
    assert r["pcm_relative_rms"] < 1e-3  # float32 rounding
    assert "check_relative_rms" not in report
    out = capsys.readouterr().out
    assert "on/off" in out and "check: skipped" in out
    # The attention kernel belongs to the DiT both stages share: refused, not half-applied.
    for shared in ("flow_attention=cudnn", "flow_attention_rotary=false"):
        with pytest.raises(SystemExit):
            main(["--device", "cpu", "--model", "tiny-random", "--model-cache", str(tmp_path), "--ab", shared])
        assert f"--ab {shared.split('=')[0]}: both stages share the DiT" in capsys.readouterr().err


def _stage(model, **kw):  # noqa: ANN001, ANN202
    from engine.token2wav import AudioStage

    return AudioStage(model.flow, model.hift, torch.device("cpu"), prompt_cache_bytes=1 << 30, **kw)


class _ReplayedSolve:
    """What a captured graph does on the device, done on the CPU: run the solve again."""

    def __init__(self, run) -> None:  # noqa: ANN001
        self.run = run

    def replay(self) -> None:
        self.run()


@pytest.mark.parametrize("emulate_capture", [False, True])
def test_the_one_voice_graphs_read_and_keep_rings(tiny_model_dir, emulate_capture: bool) -> None:  # noqa: ANN001
    """The graph runner's path (uncaptured on the CPU: the same static buffers and solve a
    captured graph replays) gives the whole-prefix audio, as the eager path does. With
    `emulate_capture` each new bucket's first batch runs the solve twice, as a capture's
    warm-up run and then its replay do on the GPU: its ring writes must not land twice."""
    from bench.context_bench import run_utterances, utterance_chunks
    from engine.models.loader import load_model

    model = load_model(tiny_model_dir, load_lm=False)
    g = torch.Generator().manual_seed(0)
    prompt = (torch.randint(0, 6561, (106,), generator=g), torch.randn(212, 80, generator=g),
              torch.randn(192, generator=g))
    speech = [torch.randint(0, 6561, (130,), generator=g) for _ in range(3)]
    graphs = _stage(model, context_cache_bytes=4 << 30, context_frames=2000)
    graphs.flow_cuda_graphs = True  # the runner's uncaptured path stands in for the graphs
    exact = _stage(model)
    if emulate_capture:
        runner = graphs.graph_runner()
        assert runner is not None
        runner.capture = True

        def capture(views, streaming):  # noqa: ANN001, ANN202
            runner._solve_into(views, streaming)  # the warm-up run
            return _ReplayedSolve(lambda: runner._solve_into(views, streaming))

        runner._capture = capture  # type: ignore[method-assign]
    try:
        _, _, kept = run_utterances(graphs, [utterance_chunks(prompt, s, 8, 100, 1000) for s in speech])
        _, _, ref = run_utterances(exact, [utterance_chunks(prompt, s, 8, 100, -1) for s in speech])
        runner, ctx = graphs.graph_runner(), graphs.context_cache
        assert runner is not None and ctx is not None
        assert runner.stats.replays >= 4 and runner.stats.eager == 0
        assert runner.stats.captures == (runner.num_graphs if emulate_capture else 0)
        if emulate_capture:  # first chunks (nothing to read or keep) replay the plain graphs
            assert {key[-1] for key in runner._graphs} == {False, True}
        assert ctx.reads >= 6 and ctx.records >= 6 and ctx.in_use() == 0
        for a, b in zip(ref, kept):
            assert a.shape == b.shape
            assert float(np.sqrt(np.mean((a - b) ** 2))) <= 1e-3 * float(np.sqrt(np.mean(a**2)))
    finally:
        for st in (graphs, exact):
            st._pool.shutdown(wait=True)


def test_a_slot_given_back_in_a_batch_is_not_taken_in_the_same_batch(flow: CausalMaskedDiffWithDiT) -> None:
    """A final chunk still reads its ring during the call that gives its slot back: another
    row of that call must not write there."""
    v = make_voice(60, 1)
    cache = cache_for(flow, frames=100, slots=1)
    prompts = PromptCache()
    a, b = Utterance(), Utterance()
    first = [chunk(v, 8, 40, False)]
    p = cache.plan(first, prompts.entries_for(flow, first), [a])
    assert p is not None and cache.in_use() == 1
    decode_with_context(flow, first, prompts.entries_for(flow, first), cache, p)
    both = [chunk(v, 40, 70, True), chunk(v, 8, 40, False)]  # a's last chunk, b's first to keep
    p = cache.plan(both, prompts.entries_for(flow, both), [a, b])
    assert p is not None and p.reads and p.writes is None
    assert cache.in_use() == 0 and cache.refused == 1


def test_a_slot_whose_utterance_died_leaves_no_id_behind() -> None:
    """A slot's utterance that died without giving it back (cancelled, failed) left its id in
    `_by_key` when the slot was taken again: the map grew with every such utterance."""
    from engine.models.config import ModelConfig
    from engine.models.flow import CausalMaskedDiffWithDiT, init_random_

    class Key:  # an utterance's vocoder stream, as far as the cache sees it
        pass

    flow = CausalMaskedDiffWithDiT(ModelConfig.tiny().flow)
    init_random_(flow, seed=1)
    ctx = ContextCache(flow, 100, 64 << 20, torch.device("cpu"), torch.float32)
    keep = []  # other objects come and go meanwhile, so the dead keys' ids are not all reused
    for n in range(200):
        key = Key()
        ctx._allocate(key, set())
        del key  # dies holding its slot
        keep += [Key() for _ in range(n % 3)]
    assert len(ctx._by_key) <= ctx.capacity, (len(ctx._by_key), ctx.capacity)
