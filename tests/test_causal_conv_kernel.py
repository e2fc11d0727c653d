"""The Triton kernel for the DiT's position convolution (`engine.models.causal_conv_kernel`).

The kernel's own arithmetic runs here under Triton's interpreter (`TRITON_INTERPRET=1`, on
the CPU in float32), which has to be set before Triton is imported: those checks run in a
fresh interpreter process. The GPU's bf16 runs are checked by `bench.position_conv`
(docs/benchmarks.md, round 38)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from engine.config import EngineConfig
from engine.models import causal_conv_kernel
from engine.models.dit import CausalConvPositionEmbedding, DiT
from engine.models.triton_support import is_kernel_error

ROOT = Path(__file__).resolve().parents[1]


def run_interpreted(code: str) -> str:
    if importlib.util.find_spec("triton") is None and not os.environ.get("CI"):
        pytest.skip("Triton is not installed (the dev extras install it on Linux)")
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_kernel_is_the_padded_convolution_and_mish() -> None:
    """Rows of lengths below, at and above a tile and the kernel's reach (frames before a
    row's start read as the causal padding's zeros), with and without the Mish."""
    out = run_interpreted("""
        import copy
        import torch, torch.nn.functional as F
        from torch import nn
        from engine.models import causal_conv_kernel as ck
        torch.manual_seed(0)
        conv = nn.Conv1d(128, 128, 31, groups=4)
        weight = ck.packed_weight(conv)
        worst = 0.0
        for batch, frames in ((1, 5), (3, 64), (2, 97)):
            x = torch.randn(batch, frames, 128)
            assert ck.available(x, conv)
            plain = conv(F.pad(x.transpose(1, 2), (30, 0))).transpose(1, 2)
            for mish, want in ((True, F.mish(plain)), (False, plain)):
                got = ck.grouped_causal_conv_mish(x, conv, weight, mish=mish)
                assert got.shape == want.shape
                worst = max(worst, float((got - want).abs().max()))
        # Large activations: the Mish's factor saturates to 1 without overflowing.
        # Weights of another dtype than the input (autocast) go to the torch path.
        assert not ck.available(torch.randn(1, 8, 128), copy.deepcopy(conv).double())
        big = torch.full((1, 40, 128), 60.0)
        got = ck.grouped_causal_conv_mish(big, conv, weight)
        want = F.mish(conv(F.pad(big.transpose(1, 2), (30, 0)))).transpose(1, 2)
        assert torch.isfinite(got).all()
        worst = max(worst, float(((got - want).abs() / want.abs().clamp(min=1)).max()))
        print(worst)
    """)
    assert float(out.strip()) < 1e-4


def test_the_dit_position_embedding_gives_the_same_frames_with_either_kernel() -> None:
    """`CausalConvPositionEmbedding` with the Triton kernel against its torch path, with
    cached context frames (some before the utterance's start) and without."""
    out = run_interpreted("""
        import torch
        from engine.models.dit import CONV_CONTEXT, CausalConvPositionEmbedding
        torch.manual_seed(0)
        embed = CausalConvPositionEmbedding(256)
        x = torch.randn(2, 37, 256)
        context = torch.randn(2, CONV_CONTEXT, 256)
        valid = torch.arange(CONV_CONTEXT)[None, :] >= torch.tensor([[0], [45]])
        worst = 0.0
        for args in ((x,), (x, context, valid)):
            embed.kernel = "torch"
            want = embed(*args)
            embed.kernel = "triton"
            got = embed(*args)
            assert all(d._value is not None for d in embed._packed.values())  # both packed
            worst = max(worst, float((got - want).abs().max()))
        print(worst)
    """)
    assert float(out.strip()) < 1e-4


def test_without_the_interpreter_the_cpu_keeps_the_torch_path() -> None:
    conv = nn.Conv1d(128, 128, 31, groups=4)
    x = torch.randn(1, 10, 128)
    if os.environ.get("TRITON_INTERPRET") != "1":
        assert not causal_conv_kernel.available(x, conv)
    assert causal_conv_kernel.supports(conv)
    assert not causal_conv_kernel.supports(nn.Conv1d(64, 64, 31, groups=16))  # 4 channels a group
    assert not causal_conv_kernel.supports(nn.Conv1d(128, 128, 31, groups=4, bias=False))
    assert not causal_conv_kernel.supports(nn.Conv1d(128, 128, 31, groups=4, dilation=2))


def test_the_packed_weight_follows_the_convolution() -> None:
    """Tap j's [in, out] block of group g is weight[g*out : (g+1)*out, :, j] transposed, and
    the position embedding packs again after the weight changes in place or is cast."""
    conv = nn.Conv1d(64, 64, 5, groups=2)
    packed = causal_conv_kernel.packed_weight(conv)
    assert packed.shape == (2, 5, 32, 32)
    assert torch.equal(packed[1, 3], conv.weight[32:64, :, 3].t())
    embed = CausalConvPositionEmbedding(64, kernel_size=5, groups=2)
    conv1 = embed.conv1[0]
    first = embed._packed_weight("conv1", conv1)
    assert embed._packed_weight("conv1", conv1) is first
    with torch.no_grad():
        conv1.weight.add_(1.0)
    again = embed._packed_weight("conv1", conv1)
    assert again is not first and torch.equal(again, causal_conv_kernel.packed_weight(conv1))
    embed.to(torch.float64)
    assert embed._packed_weight("conv1", conv1).dtype == torch.float64
    conv1.weight = nn.Parameter(conv1.weight.detach().clone() * 2)  # a new tensor, maybe at a freed address
    assert torch.equal(embed._packed_weight("conv1", conv1), causal_conv_kernel.packed_weight(conv1))
    with torch.inference_mode():
        frozen = CausalConvPositionEmbedding(64, kernel_size=5, groups=2)
    conv = frozen.conv1[0]
    assert torch.equal(frozen._packed_weight("conv1", conv), causal_conv_kernel.packed_weight(conv))


def test_the_setting_reaches_the_dit_and_is_validated() -> None:
    from engine.models.config import ModelConfig
    from engine.models.flow import CausalMaskedDiffWithDiT
    from engine.token2wav import AudioStage

    flow = CausalMaskedDiffWithDiT(ModelConfig.tiny().flow)
    embed = flow.decoder.estimator.input_embed.conv_pos_embed
    AudioStage(flow, nn.Linear(1, 1), torch.device("cpu"), flow_conv_kernel="torch")
    assert embed.kernel == "torch"
    AudioStage(flow, nn.Linear(1, 1), torch.device("cpu"))
    assert embed.kernel == "triton"
    assert EngineConfig(model_dir=Path(".")).flow_conv_kernel == "triton"
    with pytest.raises(ValueError, match="flow_conv_kernel"):
        EngineConfig(model_dir=Path("."), flow_conv_kernel="cuda")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="conv kernel"):
        DiT.use_conv_kernel(flow.decoder.estimator, "cudnn")


def test_a_kernel_that_cannot_run_here_falls_back_to_the_torch_path(monkeypatch, caplog) -> None:  # noqa: ANN001
    """A Triton error (an older Triton, an unsupported GPU) costs the speed, not the audio:
    the embedding logs it once and serves from the torch path from then on. Other errors
    (out of memory) are the caller's."""
    triton_error = type("CompilationError", (Exception,), {"__module__": "triton.compiler.errors"})
    calls: list[int] = []

    def failing(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        raise triton_error("no such kwarg")

    torch.manual_seed(0)
    embed = CausalConvPositionEmbedding(128)
    x = torch.randn(1, 12, 128)
    want = embed(x)
    monkeypatch.setattr(causal_conv_kernel, "available", lambda x, conv: True)
    monkeypatch.setattr(causal_conv_kernel, "grouped_causal_conv_mish", failing)
    embed.kernel = "triton"
    with caplog.at_level("ERROR", logger="engine.models.dit"):
        assert torch.equal(embed(x), want)
        assert torch.equal(embed(x), want)
    assert embed.kernel == "torch" and calls == [1]
    assert sum("cannot run here" in r.getMessage() for r in caplog.records) == 1

    def out_of_memory(*args: object, **kwargs: object) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(causal_conv_kernel, "grouped_causal_conv_mish", out_of_memory)
    embed.kernel = "triton"
    with pytest.raises(torch.OutOfMemoryError):
        embed(x)
    assert is_kernel_error(triton_error("x"))
    assert not is_kernel_error(RuntimeError("x"))
