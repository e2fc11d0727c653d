"""engine/vocoder_graphs.py on the CPU: the padded static-buffer path a CUDA graph replays
(capture off) gives the vocoder's own samples, through `stream_step` and through the stage."""

from __future__ import annotations

import torch

from engine.models import hift as hift_mod
from engine.models.config import ModelConfig
from engine.vocoder_graphs import VocoderGraphPolicy, VocoderGraphRunner

POLICY = VocoderGraphPolicy(batch_buckets=(1, 2, 4), frame_multiple=32, max_frames=96)


def _vocoder() -> hift_mod.CausalHiFTGenerator:
    gen = hift_mod.init_random_(hift_mod.CausalHiFTGenerator(ModelConfig.tiny().hift), 0).eval()
    gen.fold_weight_norm()
    return gen


def test_buckets() -> None:
    assert POLICY.bucket(1, 1) == (1, 32) and POLICY.bucket(3, 33) == (4, 64)
    assert POLICY.bucket(5, 10) is None and POLICY.bucket(2, 97) is None  # too many rows / frames
    assert len(POLICY.shapes()) == 3 * 3 and (4, 96) in POLICY.shapes()


def test_padded_decode_gives_the_vocoders_samples() -> None:
    """Ragged streams (different new frames per stream and step, a finalizing step, a batch
    too long for any bucket) give the same samples with and without the runner."""
    gen = _vocoder()
    runner = VocoderGraphRunner(gen, POLICY, capture=False)
    assert runner.warm() == 0  # nothing to capture off CUDA
    g = torch.Generator().manual_seed(0)
    plain = [gen.new_stream() for _ in range(3)]
    graphed = [gen.new_stream() for _ in range(3)]
    steps = [(30, False), (41, False), (17, False), (90, False), (9, True)]
    produced = 0
    for n, fin in steps:
        mels = [torch.randn(80, n + 3 * i, generator=g) for i in range(3)]
        want = gen.stream_step(plain, mels, [fin] * 3)
        got = gen.stream_step(graphed, mels, [fin] * 3, decode=runner)
        for w, x in zip(want, got):
            assert w.shape == x.shape
            assert torch.allclose(w, x, atol=1e-6, rtol=0)
            produced += w.numel()
    assert produced > 0
    # The 90-frame step's windows (+ context) exceed max_frames: decoded eagerly.
    assert runner.stats.replays == len(steps) - 1 and runner.stats.eager == 1


def test_the_stage_decodes_through_the_runner(tiny_model_dir) -> None:  # noqa: ANN001
    from engine.models.flow import FlowChunk
    from engine.models.loader import load_model
    from engine.token2wav import AudioStage, ChunkJob

    model = load_model(tiny_model_dir, load_lm=False)
    stages = [AudioStage(model.flow, model.hift, torch.device("cpu")) for _ in range(2)]
    assert all(s.vocoder_graphs is None for s in stages)  # CPU: off unless given
    stages[1].vocoder_graphs = VocoderGraphRunner(model.hift, capture=False)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 100, (20,), generator=g)
    feat, emb = torch.randn(40, 80, generator=g), torch.randn(192, generator=g)
    tokens = torch.randint(0, 100, (60,), generator=g)
    pcm = []
    for stage in stages:
        stream = stage.new_stream()
        out = []
        for start, end, fin in ((0, 15, False), (15, 40, False), (40, 60, True)):
            chunk = FlowChunk(tokens=torch.cat((prompt, tokens[: end + (0 if fin else 3)])), prompt_feat=feat,
                              embedding=emb, num_prompt_tokens=20, out_start=20 + start, finalize=fin)
            job = ChunkJob(flow=chunk, hift_stream=stream, speed=1.0, chunk_index=0, is_cancelled=lambda: False)
            out.extend(stage._compute([job])[0])
        pcm.append(out)
    assert stages[1].vocoder_graphs.stats.replays == 3
    for a, b in zip(*pcm):
        assert a.shape == b.shape and abs(a - b).max() <= 1e-6


def test_the_row_buckets_are_a_setting(tmp_path) -> None:  # noqa: ANN001
    """--engine.vocoder-graph-rows reaches the stage's vocoder graph policy (and its runner
    where there is one); buckets must increase."""
    import pytest

    from engine.config import EngineConfig
    from engine.models.config import ModelConfig
    from engine.models.flow import CausalMaskedDiffWithDiT
    from engine.token2wav import AudioStage
    from gateway.app import engine_config
    from gateway.settings import load_settings

    assert engine_config(load_settings([], environ={})[0], tmp_path).vocoder_graph_rows == (1, 2, 4, 8)
    s, _ = load_settings(["--engine.vocoder-graph-rows", "1,2,4,8,16,32,64"], environ={})
    cfg = engine_config(s, tmp_path)
    assert cfg.vocoder_graph_rows == (1, 2, 4, 8, 16, 32, 64)
    stage = AudioStage(CausalMaskedDiffWithDiT(ModelConfig.tiny().flow), _vocoder(), torch.device("cpu"),
                       vocoder_graph_rows=cfg.vocoder_graph_rows)
    try:
        assert stage.vocoder_graph_policy.bucket(40, 50) == (64, 64)
        assert VocoderGraphPolicy().bucket(40, 50) is None  # the default stops at 8 streams
    finally:
        stage._pool.shutdown(wait=True)
    with pytest.raises(ValueError, match="vocoder_graph_rows"):
        EngineConfig(model_dir=tmp_path, vocoder_graph_rows=(8, 4))


def test_the_frame_buckets_hold_the_widest_chunk_the_engine_cuts(tiny_model_dir, tmp_path) -> None:  # noqa: ANN001
    """The stage's vocoder graphs reach the widest decode window a chunk can ask for: a
    patient last chunk as wide as `patient_target` lets it be, after a first chunk of any
    length (or none), the vocoder's context and held-back frames included. Measured on the
    vocoder itself (the windows its steps decode), at the default max_hop (150) and 200;
    25 tokens keep the default 256 frames, and no setting gets more than 640."""
    from engine.chunking import patient_target
    from engine.config import EngineConfig
    from engine.models.loader import load_model
    from engine.stage_build import audio_stage, vocoder_graph_frames

    model = load_model(tiny_model_dir, load_lm=False)
    gen = model.hift
    flow = model.config.flow
    assert vocoder_graph_frames(gen, model.config, EngineConfig(model_dir=tmp_path, max_hop=25)) == 256
    # A wide left context would ask for hundreds of graphs: capped, wider windows run eagerly.
    assert vocoder_graph_frames(gen, model.config, EngineConfig(model_dir=tmp_path, flow_left_context=1000)) == 640
    widest: dict[int, int] = {}
    for hop in (150, 200):
        cfg = EngineConfig(model_dir=tmp_path, max_hop=hop)
        limit = vocoder_graph_frames(gen, model.config, cfg)
        windows: list[int] = []

        def decode(mel: torch.Tensor, source: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
            windows.append(mel.shape[-1] - gen.cfg.conv_pre_look_right)
            return gen._decode(mel, source, valid)

        for offset in (0, 6, 10, 17, 25, 40, 50, 75, 100):
            # The last chunk once the LM is done, as wide as patient_target lets it be.
            last = max(n for n in range(offset + 1, offset + 1000)
                       if patient_target(106, offset, n, True, flow.pre_lookahead_len, hop, cfg.flow_left_context)[1])
            stream = gen.new_stream()
            if offset:
                gen.stream_step([stream], [torch.zeros(80, flow.token_mel_ratio * offset)], [False], decode=decode)
            gen.stream_step([stream], [torch.zeros(80, flow.token_mel_ratio * (last - offset))], [True], decode=decode)
        widest[hop] = max(windows)
        assert widest[hop] <= limit < widest[hop] + 64  # a bound, not far above
        stage = audio_stage(model, torch.device("cpu"), cfg)
        try:
            assert stage.vocoder_graph_policy.bucket(8, widest[hop]) is not None
        finally:
            stage._pool.shutdown(wait=True)
    assert VocoderGraphPolicy().bucket(8, widest[150]) is None  # past the default's 256 frames


def test_the_stage_counts_its_vocoder_replays_and_eager_decodes(tiny_model_dir) -> None:  # noqa: ANN001
    """`StageStats.vocoder_graph_replays` / `vocoder_eager_decodes` (the load bench's
    `server.vocoder_graph_replays` / `vocoder_eager_decodes`): what the stage's runner did,
    a window past its buckets counted eager. Without a runner (the CPU's default) both stay 0."""
    import asyncio

    from engine.models.flow import FlowChunk
    from engine.models.loader import load_model
    from engine.token2wav import AudioStage, ChunkJob

    model = load_model(tiny_model_dir, load_lm=False)
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, 100, (20,), generator=g)
    feat, emb = torch.randn(40, 80, generator=g), torch.randn(192, generator=g)
    tokens = torch.randint(0, 100, (90,), generator=g)

    async def speak(stage: AudioStage) -> None:
        await stage.start()
        try:
            stream = stage.new_stream()
            for index, (start, end, fin) in enumerate(((0, 15, False), (15, 90, True))):  # the last: 150 new frames
                chunk = FlowChunk(tokens=torch.cat((prompt, tokens[: end + (0 if fin else 3)])), prompt_feat=feat,
                                  embedding=emb, num_prompt_tokens=20, out_start=20 + start, finalize=fin)
                await stage.run(ChunkJob(flow=chunk, hift_stream=stream, speed=1.0, chunk_index=index,
                                         is_cancelled=lambda: False))
        finally:
            await stage.close()

    plain, graphed = (AudioStage(model.flow, model.hift, torch.device("cpu")) for _ in range(2))
    graphed.vocoder_graphs = VocoderGraphRunner(model.hift, POLICY, capture=False)  # windows up to 96 frames
    for stage in (plain, graphed):
        asyncio.run(speak(stage))
    assert (plain.stats.vocoder_graph_replays, plain.stats.vocoder_eager_decodes) == (0, 0)
    runner = graphed.vocoder_graphs.stats
    assert (graphed.stats.vocoder_graph_replays, graphed.stats.vocoder_eager_decodes) == (runner.replays, runner.eager)
    assert runner.replays >= 1 and runner.eager >= 1
