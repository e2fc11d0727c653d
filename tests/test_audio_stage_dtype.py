"""The audio stage's flow precision: bf16 weights and activations on CUDA by default,
float32 on CPU; the stage casts the flow it is given."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from engine.config import EngineConfig

from engine.token2wav import AudioStage


def test_flow_dtype_defaults_by_device_and_casts_the_flow() -> None:
    hift = nn.Linear(1, 1)  # not run: only the stage's choice is checked
    flow = nn.Linear(1, 1)
    assert AudioStage(flow, hift, torch.device("cpu")).flow_dtype is torch.float32
    assert flow.weight.dtype is torch.float32
    assert AudioStage(flow, hift, torch.device("cuda")).flow_dtype is torch.bfloat16
    assert flow.weight.dtype is torch.bfloat16
    assert AudioStage(flow, hift, torch.device("cuda:1"), flow_dtype=torch.float16).flow_dtype is torch.float16
    assert flow.weight.dtype is torch.float16


def test_flow_dtype_is_validated() -> None:
    with pytest.raises(ValueError, match="flow_dtype"):
        AudioStage(nn.Linear(1, 1), nn.Linear(1, 1), torch.device("cpu"), flow_dtype=torch.int8)
    with pytest.raises(ValueError, match="flow_dtype"):
        EngineConfig(model_dir=Path("."), flow_dtype="float64")  # type: ignore[arg-type]
    assert EngineConfig(model_dir=Path("."), flow_dtype="float16").resolved_flow_dtype() is torch.float16


def test_flow_attention_reaches_the_dit_and_is_validated() -> None:
    """EngineConfig.flow_attention is the stage's DiT's attention kernel (set before any
    compile, so the compiled blocks keep it); an unknown kernel is refused up front."""
    from engine.models.config import ModelConfig
    from engine.models.flow import CausalMaskedDiffWithDiT

    flow = CausalMaskedDiffWithDiT(ModelConfig.tiny().flow)
    AudioStage(flow, nn.Linear(1, 1), torch.device("cpu"), flow_attention="sdpa")
    assert flow.decoder.estimator.attention_kernel == "sdpa"
    AudioStage(flow, nn.Linear(1, 1), torch.device("cpu"))  # "triton", which off its interpreter the CPU
    assert flow.decoder.estimator.attention_kernel == "cudnn"  # cannot run: cuDNN's calls (the torch formula)
    assert EngineConfig(model_dir=Path(".")).flow_attention == "triton"
    with pytest.raises(ValueError, match="flow_attention"):
        EngineConfig(model_dir=Path("."), flow_attention="flash")  # type: ignore[arg-type]


def test_flow_split_prefix_rows_reaches_the_dit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--engine.flow-split-prefix-rows is the stage's DiT's `split_prefix_rows`; by default 1
    (every one-voice batch) where its attention is the split kernel, and 8 with cuDNN's or
    SDPA's two calls, which pay only in larger batches: the CPU's (round 48 of
    docs/benchmarks.md)."""
    from engine.models.dit import split_prefix_rows_for

    from engine.models.config import ModelConfig
    from engine.models.flow import CausalMaskedDiffWithDiT
    from gateway.app import engine_config
    from gateway.settings import load_settings

    assert engine_config(load_settings([], environ={})[0], tmp_path).flow_split_prefix_rows is None
    assert EngineConfig(model_dir=tmp_path).flow_split_prefix_rows is None
    assert [split_prefix_rows_for(k) for k in ("triton", "cudnn", "sdpa")] == [1, 8, 8]
    off = engine_config(load_settings(["--engine.flow-split-prefix-rows", "0"], environ={})[0], tmp_path)
    assert off.flow_split_prefix_rows == 0
    flow = CausalMaskedDiffWithDiT(ModelConfig.tiny().flow)
    AudioStage(flow, nn.Linear(1, 1), torch.device("cpu"), flow_split_prefix_rows=0)
    assert flow.decoder.estimator.split_prefix_rows == 0
    AudioStage(flow, nn.Linear(1, 1), torch.device("cpu"), flow_split_prefix_rows=1)
    assert flow.decoder.estimator.split_prefix_rows == 1
    AudioStage(flow, nn.Linear(1, 1), torch.device("cpu"))  # no split kernel on the CPU outside Triton's interpreter
    assert flow.decoder.estimator.attention_kernel != "triton" and flow.decoder.estimator.split_prefix_rows == 8
    import engine.token2wav as token2wav

    monkeypatch.setattr(token2wav, "attention_kernel_for", lambda *args, **kwargs: "triton")  # as on a GPU
    AudioStage(flow, nn.Linear(1, 1), torch.device("cpu"))
    assert flow.decoder.estimator.attention_kernel == "triton" and flow.decoder.estimator.split_prefix_rows == 1
    with pytest.raises(ValueError, match="flow_split_prefix_rows"):
        EngineConfig(model_dir=Path("."), flow_split_prefix_rows=-1)


def test_cudnn_attention_falls_back_where_it_does_not_run() -> None:
    """The "cudnn" default is kept on a GPU where cuDNN's kernel runs, and becomes SDPA's
    pick on one where it does not (no fallback of PyTorch's stands behind a direct call);
    off CUDA nothing is tried (the bias goes through SDPA there)."""
    from engine.models.dit import attention_kernel_for

    tried: list[torch.device] = []

    def runs(ok: bool):  # noqa: ANN202
        def probe(device: torch.device, dtype: torch.dtype) -> bool:
            tried.append(device)
            return ok
        return probe

    gpu = torch.device("cuda", 1)
    assert attention_kernel_for("cudnn", gpu, torch.bfloat16, runs(True)) == "cudnn"
    assert attention_kernel_for("cudnn", gpu, torch.bfloat16, runs(False)) == "sdpa"
    assert tried == [gpu, gpu]
    assert attention_kernel_for("sdpa", gpu, torch.bfloat16, runs(True)) == "sdpa"
    assert attention_kernel_for("cudnn", torch.device("cpu"), torch.float32, runs(False)) == "cudnn"
    assert len(tried) == 2
