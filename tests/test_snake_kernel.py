"""The Triton kernel for the vocoder's Snake activation (`engine.models.snake_kernel`).

Its arithmetic runs here under Triton's interpreter (`TRITON_INTERPRET=1`, on the CPU in
float32, in a fresh interpreter process: the variable must be set before Triton is
imported), through `run_interpreted` of the convolution kernel's tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.models import snake_kernel
from engine.models.config import ModelConfig
from engine.models.cv2_config import cv2_model_config
from engine.models.cv2_hift import HiFTGenerator
from engine.models.hift import CausalHiFTGenerator, Snake, init_random_, use_snake_kernel
from tests.test_causal_conv_kernel import run_interpreted


def test_the_kernel_is_the_snake_formula() -> None:
    """Lengths below, at and above a tile (a masked tail), several rows and channels, a
    transposed input (made contiguous first) and an empty one."""
    out = run_interpreted("""
        import torch
        from engine.models import snake_kernel as sk
        torch.manual_seed(0)
        worst = 0.0
        for batch, channels, length, block in ((1, 3, 5, 1024), (2, 4, 64, 32), (3, 2, 97, 32)):
            alpha = torch.rand(1, channels, 1) * 3 + 0.1
            inverse = 1.0 / (alpha + 1e-9)
            x = torch.randn(batch, channels, length) * 4
            assert sk.available(x)
            want = x + inverse * torch.sin(x * alpha).pow(2)
            got = sk.snake(x, alpha, inverse, block=block)
            assert got.shape == want.shape
            worst = max(worst, float((got - want).abs().max()))
            t = torch.randn(batch, length, channels).transpose(1, 2)
            worst = max(worst, float((sk.snake(t, alpha, inverse, block=block)
                                      - (t + inverse * torch.sin(t * alpha).pow(2))).abs().max()))
        assert sk.snake(torch.randn(2, channels, 0), alpha, inverse).shape == (2, channels, 0)
        print(worst)
    """)
    assert float(out.strip()) < 1e-5


def test_a_vocoder_with_the_kernel_streams_the_same_audio() -> None:
    """The tiny CosyVoice3 vocoder's streaming steps with every Snake on the kernel against
    the same steps with torch's operators (same streams' inputs)."""
    out = run_interpreted("""
        import torch
        from engine.models.config import ModelConfig
        from engine.models.hift import CausalHiFTGenerator, init_random_, use_snake_kernel
        hift = init_random_(CausalHiFTGenerator(ModelConfig.tiny().hift), 0).eval()
        torch.manual_seed(1)
        mels = [[torch.randn(80, n) * 2 - 5 for n in (30, 12)] for _ in range(2)]
        pcm = {}
        for name in ("torch", "triton"):
            use_snake_kernel(hift, name)
            streams = [hift.new_stream() for _ in range(2)]
            with torch.inference_mode():
                steps = [hift.stream_step(streams, [m[i] for m in mels], [i == 1] * 2) for i in range(2)]
            pcm[name] = torch.cat([p for step in steps for p in step])
        assert pcm["torch"].numel() > 1000
        print(float((pcm["torch"] - pcm["triton"]).abs().max()))
    """)
    assert float(out.strip()) < 1e-4


def test_without_the_interpreter_the_cpu_keeps_the_torch_path() -> None:
    x = torch.randn(1, 4, 10)
    if os.environ.get("TRITON_INTERPRET") != "1":
        assert not snake_kernel.available(x)
    assert not snake_kernel.available(torch.randn(4, 10))  # [B, C, T] only
    snake = Snake(4)
    with torch.no_grad():
        snake.alpha.uniform_(0.5, 2.0)
    want = snake(x)
    snake.kernel.name = "triton"
    assert torch.equal(snake(x), want)


def test_every_snake_of_a_vocoder_shares_one_choice_and_the_setting_reaches_it() -> None:
    from engine.models.flow import CausalMaskedDiffWithDiT
    from engine.token2wav import AudioStage

    cfg = ModelConfig.tiny()
    for vocoder in (CausalHiFTGenerator(cfg.hift), HiFTGenerator(cv2_model_config("tiny").hift)):
        snakes = [m for m in vocoder.modules() if isinstance(m, Snake)]
        assert len(snakes) > 10
        use_snake_kernel(vocoder, "triton")
        assert {id(s.kernel) for s in snakes} == {id(snakes[0].kernel)} and snakes[0].kernel.name == "triton"
    hift = CausalHiFTGenerator(cfg.hift)
    snakes = [m for m in hift.modules() if isinstance(m, Snake)]
    AudioStage(CausalMaskedDiffWithDiT(cfg.flow), hift, torch.device("cpu"), vocoder_snake_kernel="torch")
    assert all(s.kernel.name == "torch" for s in snakes)
    AudioStage(CausalMaskedDiffWithDiT(cfg.flow), hift, torch.device("cpu"))
    assert all(s.kernel.name == "triton" for s in snakes)
    assert EngineConfig(model_dir=Path(".")).vocoder_snake_kernel == "triton"
    with pytest.raises(ValueError, match="vocoder_snake_kernel"):
        EngineConfig(model_dir=Path("."), vocoder_snake_kernel="cuda")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="snake kernel"):
        use_snake_kernel(hift, "cuda")


@pytest.mark.parametrize("channels_last", [False, True], ids=["channels-first", "channels-last"])
def test_a_kernel_that_cannot_run_here_sends_every_snake_back_to_torch(monkeypatch, caplog,  # noqa: ANN001
                                                                       channels_last: bool) -> None:
    """A Triton error (an older Triton, an unsupported GPU) costs the speed, not the audio:
    the first Snake to meet it logs it once and all of the vocoder's Snakes serve from
    torch's operators from then on. Other errors (out of memory) are the caller's. In either
    layout of the decode (`CausalHiFTGenerator.channels_last`), each with its own kernel."""
    triton_error = type("CompilationError", (Exception,), {"__module__": "triton.compiler.errors"})
    calls: list[int] = []

    def failing(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        raise triton_error("no such kwarg")

    hift = init_random_(CausalHiFTGenerator(ModelConfig.tiny().hift), 0).eval()
    hift.channels_last = channels_last
    kernel = "snake_channels_last" if channels_last else "snake"
    mel = torch.randn(80, 20) * 2 - 5

    def audio() -> torch.Tensor:
        with torch.inference_mode():
            return hift.stream_step([hift.new_stream()], [mel], [True])[0]

    want = audio()
    monkeypatch.setattr(snake_kernel, "available", lambda x, channels_last=False: True)
    monkeypatch.setattr(snake_kernel, kernel, failing)
    use_snake_kernel(hift, "triton")
    with caplog.at_level("ERROR", logger="engine.models.hift"):
        assert torch.equal(audio(), want)
        assert torch.equal(audio(), want)
    assert calls == [1]
    assert all(m.kernel.name == "torch" for m in hift.modules() if isinstance(m, Snake))
    assert sum("cannot run here" in r.getMessage() for r in caplog.records) == 1

    def out_of_memory(*args: object, **kwargs: object) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(snake_kernel, kernel, out_of_memory)
    use_snake_kernel(hift, "triton")
    with pytest.raises(torch.OutOfMemoryError):
        audio()


def test_snake_kernel_alpha_size_must_match_the_channels() -> None:
    with pytest.raises(ValueError, match="alpha"):
        snake_kernel.snake(torch.randn(1, 4, 8), torch.ones(3), torch.ones(3))

