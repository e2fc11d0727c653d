"""Runtime options of the engine (what to load, where, and how to stream).

Model hyper-parameters live in `engine.models.config`; these are the knobs an operator
turns. The gateway's `Settings` embeds one of these, so every option has one typed home.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

LMBackendName = Literal["auto", "torch", "vllm"]


@dataclass(frozen=True)
class EngineConfig:
    model_dir: Path
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    lm_backend: LMBackendName = "auto"  # auto = vllm on CUDA when importable, else torch
    # Chunk schedule in speech tokens (25 tokens = 1 s of audio).
    initial_hop: int = 15  # first chunk after this many tokens (+ lookahead); 0 = official 25-grid start
    max_hop: int = 100
    # Earlier speech tokens the flow re-reads as left context per chunk, rounded down
    # to whole 25-token blocks; bounds per-chunk cost. -1 = unbounded (exact, O(n) per chunk).
    flow_left_context: int = 50
    max_gpu_batch: int = 64  # chunks per flow/vocoder batch
    # CUDA graphs for the CosyVoice3 flow's ODE solve (CUDA only; CPU ignores it).
    flow_cuda_graphs: bool = True
    # Extra GPUs for the flow+vocoder stage (its bottleneck): one stage copy per device,
    # the LM stays on `device`. Empty = one stage on `device`.
    stage_devices: tuple[str, ...] = ()
    text_normalization: bool = True
    warmup: bool = True
    vllm_gpu_memory_utilization: float = 0.35
    vllm_max_model_len: int = 4096
    # vLLM's async scheduling runs one step ahead; a paused streaming-input (bistream)
    # request then leaks one token sampled past its fill, so bistream needs it off.
    vllm_async_scheduling: bool = False
    lm_max_batch: int = 64
    seed: int | None = None
    # Random weights never emit eos; benchmarks and the random demo models fix the
    # speech length instead (25 tokens = 1 s). Used when a request does not set it.
    tokens_per_text_token: float | None = None

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolved_backend(self) -> str:
        if self.lm_backend != "auto":
            return self.lm_backend
        if self.resolved_device().type == "cuda":
            try:
                import vllm  # noqa: F401
            except ImportError:
                return "torch"
            return "vllm"
        return "torch"
