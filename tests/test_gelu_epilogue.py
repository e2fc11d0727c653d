"""The DiT's feed-forward GELU in its product's epilogue (`engine.flow_gelu_epilogue`).

On CUDA `torch._addmm_activation` applies the tanh GELU in cuBLASLt's epilogue; its GPU
timing and PCM are the GPU bench's (`bench.stage_syncs --config flow_gelu_epilogue=true`).
Here: the wiring (shapes, weight orientation, bias) against the module's own path, with
the CUDA operator stood in for by its definition, and that the CPU keeps the module (its
`_addmm_activation` applies the exact GELU, which this model does not use)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.config import EngineConfig
from engine.models import dit
from engine.models.config import ModelConfig
from engine.models.dit import FeedForward


def test_the_cpu_keeps_the_module_path() -> None:
    torch.manual_seed(0)
    ff = FeedForward(32, 2)
    x = torch.randn(3, 7, 32)
    want = ff(x)
    ff.gelu_epilogue = True
    assert torch.equal(ff(x), want)
    # What the module path avoids: the CPU operator's GELU is the exact one.
    up = ff.ff[0][0]
    exact = torch._addmm_activation(up.bias, x.reshape(-1, 32), up.weight.t(), use_gelu=True)
    assert not torch.allclose(exact, F.gelu(up(x), approximate="tanh").reshape(-1, 64), atol=1e-7)


def test_the_epilogue_path_is_the_feed_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows x frames flattened for the product and back, weight transposed, bias added
    before the (tanh) GELU: the same numbers as the module."""
    calls: list[tuple[int, ...]] = []

    def cuda_like(bias: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor, use_gelu: bool = False) -> torch.Tensor:
        calls.append(tuple(mat1.shape))
        assert use_gelu and mat1.dim() == 2
        return F.gelu(torch.addmm(bias, mat1, mat2), approximate="tanh")

    monkeypatch.setattr(dit, "_gelu_epilogue_runs", lambda x: True)
    monkeypatch.setattr(torch, "_addmm_activation", cuda_like)
    torch.manual_seed(0)
    ff = FeedForward(32, 2)
    x = torch.randn(3, 7, 32)
    want = ff(x)
    ff.gelu_epilogue = True
    got = ff(x)
    assert calls == [(21, 32)] and got.shape == want.shape
    torch.testing.assert_close(got, want)


def test_the_setting_reaches_every_block_and_defaults_off() -> None:
    from engine.models.flow import CausalMaskedDiffWithDiT
    from engine.token2wav import AudioStage

    flow = CausalMaskedDiffWithDiT(ModelConfig.tiny().flow)
    blocks = flow.decoder.estimator.transformer_blocks
    AudioStage(flow, torch.nn.Linear(1, 1), torch.device("cpu"), flow_gelu_epilogue=True)
    assert all(b.ff.gelu_epilogue for b in blocks)
    AudioStage(flow, torch.nn.Linear(1, 1), torch.device("cpu"))
    assert not any(b.ff.gelu_epilogue for b in blocks)
    assert EngineConfig(model_dir=Path(".")).flow_gelu_epilogue is False
