"""CosyVoice2 token-to-mel decoder: `CausalMaskedDiffWithXvec` (inference only).

Differs from CosyVoice3's `CausalMaskedDiffWithDiT` only in how tokens become the
per-frame condition `mu`:

    tokens -> input_embedding (512-d) -> UpsampleConformerEncoder (look-ahead 3, x2 in
    time, see `engine.models.conformer`) -> encoder_proj (512 -> 80) = mu

and in the estimator inside the same `CausalConditionalCFM` (the causal U-Net of
`engine.models.unet1d` instead of the DiT). Speaker projection, prompt-mel condition,
fixed start noise, the cosine Euler solver with CFG and the chunk batching
(`inference_chunks` over `FlowChunk`s) are inherited unchanged, so the engine drives both
versions the same way.

Streaming exactness: the encoder is block-causal over 25-token blocks and the U-Net over
50-frame blocks, both counted from the first prompt token, so as for CosyVoice3 a chunked
run equals the whole-utterance run as long as chunk ends (prompt included) fall on the
25-token grid (the engine's `ChunkSchedule` keeps them there).
"""

from __future__ import annotations

import torch
from torch import nn

from ..device_copy import to_device
from .config import FlowConfig
from .conformer import UpsampleConformerEncoder
from .cv2_config import CV2FlowConfig
from .flow import CausalConditionalCFM, CausalMaskedDiffWithDiT, FlowChunk
from .unet1d import CausalConditionalDecoder


class CausalMaskedDiffWithXvec(CausalMaskedDiffWithDiT):
    def __init__(self, cfg: FlowConfig) -> None:
        if not isinstance(cfg, CV2FlowConfig):
            raise TypeError("CausalMaskedDiffWithXvec needs a CV2FlowConfig")
        # Skip the DiT flow's constructor (it would build the DiT and a top-level
        # pre_lookahead_layer); everything its inherited methods use is set here.
        nn.Module.__init__(self)
        self.cfg = cfg
        self.pre_lookahead_len = cfg.pre_lookahead_len
        self.token_mel_ratio = cfg.token_mel_ratio
        self.input_embedding = nn.Embedding(cfg.vocab_size, cfg.input_size)
        self.spk_embed_affine_layer = nn.Linear(cfg.spk_embed_dim, cfg.output_size)
        self.encoder = UpsampleConformerEncoder(
            input_size=cfg.input_size,
            output_size=cfg.encoder_output_size,
            heads=cfg.encoder_heads,
            linear_units=cfg.encoder_linear_units,
            num_blocks=cfg.encoder_blocks,
            num_up_blocks=cfg.encoder_up_blocks,
            chunk_size=cfg.encoder_chunk_size,
            pre_lookahead_len=cfg.pre_lookahead_len,
        )
        self.encoder_proj = nn.Linear(cfg.encoder_output_size, cfg.output_size)
        self.decoder = CausalConditionalCFM(cfg, estimator=CausalConditionalDecoder(cfg))

    def token_features(self, chunks: list[FlowChunk], n_main: list[int], streaming: bool) -> torch.Tensor:
        """mu [B, 80, 2 * max(n_main)] from the Conformer encoder (see the base class)."""
        device = self.input_embedding.weight.device
        dtype = self.spk_embed_affine_layer.weight.dtype
        n_max = max(n_main)
        emb = torch.zeros(len(chunks), n_max + self.pre_lookahead_len, self.cfg.input_size, device=device, dtype=dtype)
        totals = []
        for i, c in enumerate(chunks):
            ids = to_device(c.tokens, device, torch.long).clamp(min=0)
            emb[i, : len(ids)] = self.input_embedding(ids)
            totals.append(len(ids))
        h = self.encoder(emb, n_main, totals, streaming)  # [B, 2 * n_max, 512]
        return self.encoder_proj(h).transpose(1, 2)


__all__ = ["CausalMaskedDiffWithXvec"]
