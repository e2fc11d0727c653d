"""The CosyVoice3 vocoder's channels-last decode (`CausalHiFTGenerator.channels_last`): the
same audio as the channels-first one, every convolution on channels-last tensors with no
layout change between them, weights converted once, and the setting reaching the stage."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.config import EngineConfig
from engine.models.config import ModelConfig
from engine.models.flow import CausalMaskedDiffWithDiT
from engine.models.hift import CausalHiFTGenerator, LeftCausalConv1d, init_random_, reflect_first
from engine.token2wav import AudioStage
from engine.vocoder_graphs import VocoderGraphPolicy, VocoderGraphRunner
from tests.test_causal_conv_kernel import run_interpreted

CL = torch.channels_last


@pytest.fixture(scope="module")
def gen() -> CausalHiFTGenerator:
    g = init_random_(CausalHiFTGenerator(ModelConfig.tiny().hift), seed=5)
    g.fold_weight_norm()
    return g.eval()


def _streamed(gen: CausalHiFTGenerator, channels_last: bool, runner: bool = False) -> list[torch.Tensor]:
    """Three streams, ragged new frames per step, the last step finalizing."""
    gen.channels_last = channels_last
    decode = VocoderGraphRunner(gen, VocoderGraphPolicy(), capture=False) if runner else None
    g = torch.Generator().manual_seed(2)
    streams = [gen.new_stream() for _ in range(3)]
    pcm: list[list[torch.Tensor]] = [[] for _ in streams]
    try:
        with torch.inference_mode():
            for n, fin in ((30, False), (13, False), (41, False), (9, True)):
                mels = [torch.randn(80, n + 4 * i, generator=g) * 1.5 - 4.0 for i in range(3)]
                for out, piece in zip(pcm, gen.stream_step(streams, mels, [fin] * 3, decode=decode)):
                    out.append(piece)
    finally:
        gen.channels_last = False
    return [torch.cat(p) for p in pcm]


@pytest.mark.parametrize("runner", [False, True], ids=["eager", "graph-runner"])
def test_the_channels_last_decode_is_the_channels_first_one(gen: CausalHiFTGenerator, runner: bool) -> None:
    want = _streamed(gen, channels_last=False)
    got = _streamed(gen, channels_last=True, runner=runner)
    for w, x in zip(want, got):
        assert w.shape == x.shape and w.numel() > 20_000
        # The same sums in another order (2-D against 1-D convolution kernels): float32 rounding.
        torch.testing.assert_close(x, w, rtol=0, atol=1e-5 * float(w.abs().max()))


class _Convolutions(TorchDispatchMode):
    """Every convolution's input, weight and output, and a count of each operator."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket).removeprefix("aten.")
        self.ops[name] += 1
        if name in ("conv1d", "conv2d", "convolution"):
            self.calls.append((args[0], args[1], out))
        return out


def test_every_convolution_runs_channels_last_with_no_layout_change_between(gen: CausalHiFTGenerator) -> None:
    """A decode's convolutions all get channels-last inputs and weights and give channels-last
    outputs, and the only layout change of the whole decode is the mel's, on the way in: the
    copies cuDNN would make (or a `.contiguous()` of ours) are what this path removes."""
    convs = sum(isinstance(m, torch.nn.Conv1d) for m in gen.modules()) - len(gen.f0_predictor.condnet) // 2
    mel, source = torch.randn(2, 80, 40), torch.randn(2, 480 * 36 + 16)
    valid = torch.tensor([145, 120])
    seen = {}
    for channels_last in (False, True):
        gen.channels_last = channels_last
        try:
            with torch.inference_mode():
                gen._decode(mel, source, valid)  # the weights' channels-last copies, made once
                with _Convolutions() as mode:
                    gen._decode(mel, source, valid)
        finally:
            gen.channels_last = False
        seen[channels_last] = mode
    cf, cl = seen[False], seen[True]
    assert len(cf.calls) == len(cl.calls) == convs
    for x, w, y in cl.calls:
        assert x.dim() == w.dim() == y.dim() == 4 and x.shape[2] == 1
        assert x.is_contiguous(memory_format=CL) and not x.is_contiguous(), x.stride()
        assert w.is_contiguous(memory_format=CL) and y.is_contiguous(memory_format=CL)
    assert all(x.dim() == 3 for x, _, _ in cf.calls)
    copies = ("contiguous", "clone", "copy_", "_to_copy")
    assert sum(cl.ops[c] for c in copies) == 1  # the mel into channels-last
    assert cl.ops["repeat_interleave"] == 0  # upsampling by interpolation keeps the layout


def test_the_channels_last_weight_is_made_once_and_follows_the_weight() -> None:
    torch.manual_seed(0)
    conv = LeftCausalConv1d(6, 4, 3, dilation=2)
    x = torch.randn(2, 6, 1, 11).contiguous(memory_format=CL)

    def want() -> torch.Tensor:
        return conv(x.squeeze(2)).unsqueeze(2)

    with torch.no_grad():
        first = conv.forward_channels_last(x)
        cached = conv.weight_channels_last._value
        torch.testing.assert_close(first, want())
        conv.forward_channels_last(x)
        assert conv.weight_channels_last._value is cached  # no new copy per call
        conv.weight.mul_(-2.0)  # in place: the copy must follow
        torch.testing.assert_close(conv.forward_channels_last(x), want())
        conv.load_state_dict({"weight": torch.randn(4, 6, 3), "bias": torch.zeros(4)})
        torch.testing.assert_close(conv.forward_channels_last(x), want())
        conv.double()
        xd = x.double()
        torch.testing.assert_close(conv.forward_channels_last(xd), conv(xd.squeeze(2)).unsqueeze(2))


def test_the_reflection_is_torchs() -> None:
    """The last upsampling stage's one-sample reflection, in both layouts (CosyVoice2 shares it)."""
    x = torch.randn(2, 5, 9)
    assert torch.equal(reflect_first(x, 2), torch.nn.functional.pad(x, (1, 0), mode="reflect"))
    cl = x.unsqueeze(2).contiguous(memory_format=CL)
    got = reflect_first(cl, 3)
    assert got.is_contiguous(memory_format=CL)
    assert torch.equal(got.squeeze(2), torch.nn.functional.pad(x, (1, 0), mode="reflect"))


def test_the_setting_reaches_the_vocoder(tmp_path: Path, tiny_model_dir: Path) -> None:
    from engine.models.loader import load_model
    from engine.stage_build import audio_stage
    from gateway.app import engine_config
    from gateway.settings import load_settings

    cfg = ModelConfig.tiny()
    assert engine_config(load_settings([], environ={})[0], tmp_path).vocoder_channels_last is True
    settings, _ = load_settings(["--engine.vocoder-channels-last", "false"], environ={})
    assert engine_config(settings, tmp_path).vocoder_channels_last is False
    assert EngineConfig(model_dir=tmp_path).vocoder_channels_last is True
    model = load_model(tiny_model_dir, load_lm=False)
    for on in (True, False):
        stage = audio_stage(model, torch.device("cpu"), EngineConfig(model_dir=tiny_model_dir,
                                                                      vocoder_channels_last=on))
        try:
            assert model.hift.channels_last is on
        finally:
            stage._pool.shutdown(wait=True)
    hift = CausalHiFTGenerator(cfg.hift)
    stage = AudioStage(CausalMaskedDiffWithDiT(cfg.flow), hift, torch.device("cpu"))
    try:
        assert hift.channels_last is True  # the stage's own default
    finally:
        stage._pool.shutdown(wait=True)


def test_the_channels_last_snake_kernel_is_the_snake_formula() -> None:
    """Under Triton's interpreter: tails shorter than a tile, a channels-first input (made
    channels-last first), with and without a bias and zero frames in front, an empty one;
    then a whole channels-last decode with every Snake on the kernel against torch's
    operators."""
    out = run_interpreted("""
        import torch
        from engine.models import snake_kernel as sk
        from engine.models.config import ModelConfig
        from engine.models.hift import CausalHiFTGenerator, init_random_, use_snake_kernel
        torch.manual_seed(0)
        cl = torch.channels_last
        worst = 0.0
        for batch, channels, length, block in ((1, 3, 5, 1024), (2, 4, 64, 32), (3, 5, 97, 64)):
            alpha = torch.rand(1, channels, 1, 1) * 3 + 0.1
            inverse = 1.0 / (alpha + 1e-9)
            bias = torch.randn(channels)
            for x in (torch.randn(batch, channels, 1, length).contiguous(memory_format=cl) * 4,
                      torch.randn(batch, channels, 1, length) * 4):
                assert sk.available(x, channels_last=True)
                for b, pad in ((None, 0), (bias, 0), (None, 3), (bias, 7)):
                    got = sk.snake_channels_last(x, alpha, inverse, b, pad, block=block)
                    assert got.shape == (batch, channels, 1, pad + length) and got.is_contiguous(memory_format=cl)
                    assert torch.equal(got[..., :pad], torch.zeros(batch, channels, 1, pad))
                    v = x if b is None else x + b[:, None, None]
                    want = v + inverse * torch.sin(v * alpha).pow(2)
                    worst = max(worst, float((got[..., pad:] - want).abs().max()))
        assert sk.snake_channels_last(torch.randn(2, 3, 1, 0), alpha[:, :3], inverse[:, :3]).shape == (2, 3, 1, 0)
        empty = sk.snake_channels_last(torch.randn(2, 3, 1, 0), alpha[:, :3], inverse[:, :3], pad_left=2)
        assert torch.equal(empty, torch.zeros(2, 3, 1, 2))
        hift = init_random_(CausalHiFTGenerator(ModelConfig.tiny().hift), 0).eval()
        hift.channels_last = True
        mel, source, valid = torch.randn(2, 80, 30) * 2 - 5, torch.randn(2, 480 * 26 + 16), torch.tensor([105, 90])
        pcm = {}
        for name in ("torch", "triton"):
            use_snake_kernel(hift, name)
            with torch.inference_mode():
                pcm[name] = hift._decode(mel, source, valid)
        assert pcm["torch"].abs().max() > 1e-3
        print(worst, float((pcm["torch"] - pcm["triton"]).abs().max()))
    """)
    formula, decode = map(float, out.split())
    assert formula < 1e-5 and decode < 1e-5


def test_the_channels_last_snake_kernel_wants_four_dimensions() -> None:
    from engine.models import snake_kernel

    with pytest.raises(ValueError, match="channels-last"):
        snake_kernel.snake_channels_last(torch.randn(1, 4, 8), torch.ones(4), torch.ones(4))
    with pytest.raises(ValueError, match="channels-last"):
        snake_kernel.snake_channels_last(torch.randn(1, 4, 2, 8), torch.ones(4), torch.ones(4))
    with pytest.raises(ValueError, match="bias"):
        snake_kernel.snake_channels_last(torch.randn(1, 4, 1, 8), torch.ones(4), torch.ones(4), torch.ones(3))
