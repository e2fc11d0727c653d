"""Model FLOPs for the load benchmark: how much arithmetic the served models really did.

The gateway counts work, not FLOPs (`/metrics`: LM tokens sampled, flow frames computed,
mel frames vocoded). This module turns those counters into FLOPs with per-unit costs
measured once on networks of the served model's dimensions (random weights: the cost
of a matrix product does not depend on its values):

* LM: 2 x (parameters outside embedding tables) per sampled token. Prefill and
  attention over the context are not counted, so this is a lower bound.
* flow: one `inference_chunks` call (all ODE steps, the CFG-doubled batch) on one row
  of F frames is counted with `torch.utils.flop_counter.FlopCounterMode` at two
  lengths and fitted as a*F + b*F^2 (the quadratic part is attention). The gateway's
  `flow_frames` are padded rows x padded frames *without* the CFG doubling, which is
  what `a*F + b*F^2` per row (divided by F per frame) already includes.
* vocoder: `inference` on a fixed number of mel frames, per frame (linear in length).

The device peak is measured with a bf16 matmul loop (CUDA only).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class ModelFlops:
    """Per-unit costs of one model directory's networks."""

    lm_params: int  # matmul parameters (embedding tables excluded)
    flow_linear: float  # a in flops(row of F frames) = a*F + b*F^2
    flow_quadratic: float  # b
    vocoder_per_frame: float
    kv_bytes_per_token: int  # K and V of every layer, bf16
    measured_on: str

    @property
    def lm_per_token(self) -> float:
        return 2.0 * self.lm_params

    def flow_per_frame(self, mean_row_frames: float) -> float:
        return self.flow_linear + self.flow_quadratic * max(0.0, mean_row_frames)

    def total(self, lm_tokens: int, flow_frames: int, flow_rows: int, vocoder_frames: int) -> dict[str, float]:
        """FLOPs of a run from the gateway's counter deltas (rows = flow chunks)."""
        mean_frames = flow_frames / flow_rows if flow_rows else 0.0
        lm = lm_tokens * self.lm_per_token
        flow = flow_frames * self.flow_per_frame(mean_frames)
        voc = vocoder_frames * self.vocoder_per_frame
        return {"lm": lm, "flow": flow, "vocoder": voc, "total": lm + flow + voc}

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "lm_per_token": self.lm_per_token}


def matmul_params(module: nn.Module) -> int:
    """Parameters used in matrix products per sampled speech token: all but embedding
    tables (lookups) and Qwen2's text `lm_head`, which the checkpoint carries but speech
    decoding never runs (`llm_decoder` scores the speech vocabulary instead)."""
    skip = {id(p) for m in module.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    skip |= {id(p) for name, p in module.named_parameters() if "lm_head" in name.split(".")}
    return sum(p.numel() for p in module.parameters() if id(p) not in skip)


def _count(fn: Any) -> int:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    # The math attention kernel is plain matmuls, which the counter sees on every
    # device; fused CPU kernels would be missed (and the attention FLOPs with them).
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter, torch.inference_mode():
        fn()
    return int(counter.get_total_flops())


def _flow_row_flops(flow: nn.Module, n_tokens: int, device: torch.device) -> int:
    """FLOPs of decoding one row of `n_tokens` tokens (half of them prompt)."""
    from engine.models.flow import FlowChunk

    cfg = flow.cfg
    prompt = n_tokens // 2
    gen = torch.Generator().manual_seed(0)
    chunk = FlowChunk(
        tokens=torch.randint(0, cfg.vocab_size, (n_tokens,), generator=gen).to(device),
        prompt_feat=torch.randn(cfg.token_mel_ratio * prompt, cfg.output_size, generator=gen).to(device),
        embedding=torch.randn(cfg.spk_embed_dim, generator=gen).to(device),
        num_prompt_tokens=prompt,
        out_start=prompt,
        finalize=True,
    )
    return _count(lambda: flow.inference_chunks([chunk]))


def count_model_flops(model_dir: Path, device: str | torch.device = "cpu",
                      flow_tokens: tuple[int, int] = (50, 150), vocoder_frames: int = 200) -> ModelFlops:
    """Measure the per-unit costs on freshly built networks of `model_dir`'s dimensions."""
    from engine.models.loader import module_classes, read_model_config

    dev = torch.device(device)
    cfg = read_model_config(Path(model_dir))
    lm_cls, flow_cls, hift_cls = module_classes(cfg.version)
    with torch.device("meta"):  # parameter count only: no memory, no init cost
        lm_params = matmul_params(lm_cls(cfg.lm))

    flow = flow_cls(cfg.flow).to(dev).eval()
    n1, n2 = flow_tokens
    ratio = cfg.flow.token_mel_ratio
    f1, f2 = ratio * n1, ratio * n2
    c1, c2 = _flow_row_flops(flow, n1, dev), _flow_row_flops(flow, n2, dev)
    # Solve c = a*F + b*F^2 through both points.
    b = (c2 / f2 - c1 / f1) / (f2 - f1)
    a = c1 / f1 - b * f1
    if b < 0:  # numerically linear: keep the mean per-frame cost
        a, b = (c1 + c2) / (f1 + f2), 0.0
    del flow

    hift = hift_cls(cfg.hift).to(dev).eval()
    if hasattr(hift, "fold_weight_norm"):
        hift.fold_weight_norm()
    mel = torch.randn(1, cfg.hift.in_channels, vocoder_frames, generator=torch.Generator().manual_seed(0)).to(dev)
    voc = _count(lambda: hift.inference(mel, finalize=True)) / vocoder_frames
    del hift

    if dev.type == "cuda":
        torch.cuda.empty_cache()  # leave the GPU to the gateway
    q = cfg.lm.qwen
    kv = 2 * q.num_hidden_layers * q.num_key_value_heads * q.head_dim * 2
    return ModelFlops(lm_params=lm_params, flow_linear=float(a), flow_quadratic=float(b),
                      vocoder_per_frame=float(voc), kv_bytes_per_token=kv, measured_on=str(dev))


def measure_peak_flops(device: str = "cuda", n: int = 8192, iters: int = 30) -> float | None:
    """Sustained bf16 matmul FLOP/s of a CUDA device (None without CUDA)."""
    if not torch.cuda.is_available():
        return None
    dev = torch.device(device)
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    for _ in range(3):  # clocks up, cuBLAS picks its kernel
        a @ b
    torch.cuda.synchronize(dev)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        a @ b
    stop.record()
    torch.cuda.synchronize(dev)
    seconds = start.elapsed_time(stop) / 1e3
    del a, b
    torch.cuda.empty_cache()
    return 2.0 * n**3 * iters / seconds if seconds > 0 else None
