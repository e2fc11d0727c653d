"""CosyVoice2's flow-matching estimator: the causal 1-D U-Net `CausalConditionalDecoder`.

The official class (cosyvoice/flow/decoder.py) is assembled from Matcha-TTS blocks
(matcha/models/components/decoder.py: SinusoidalPosEmb, TimestepEmbedding, ResnetBlock1D)
and Matcha's copy of diffusers' `BasicTransformerBlock` (matcha/models/components/
transformer.py, with diffusers' `Attention`). Parameter names here equal that nesting:

    time_mlp.linear_1/linear_2                     timestep MLP (sinusoid of 1000 t, 320-d)
    down_blocks.0.{0: resnet, 1: transformers, 2: causal conv}
    mid_blocks.{i}.{0: resnet, 1: transformers}    x12
    up_blocks.0.{0: resnet, 1: transformers, 2: causal conv}   (skip connection: 2x channels)
    final_block.block.{0: causal conv, 2: LayerNorm}, final_proj (1x1 conv)

A resnet block: causal conv(k=3) -> LayerNorm -> Mish, twice, plus the projected time
embedding in between and a 1x1 residual conv. A transformer block: pre-LayerNorm
self-attention (no q/k/v bias) and a GELU feed-forward (4x), both residual.

cosyvoice2.yaml uses one U-Net level (`channels: [256]`), so no stage changes the frame
rate; deeper variants (stride-2 down/up sampling) are not supported here.

Streaming: every conv is causal and attention is block-causal over `static_chunk_size`
(50) frames counted from the first frame, so a frame depends on nothing after the end of
its block.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .conformer import attention_mask
from .cv2_config import CV2FlowConfig

# Additive attention bias of a hidden key (official mask_to_bias: (1 - mask) * -1e10).
MASK_BIAS = -1.0e10
TIME_SCALE = 1000.0  # Matcha's SinusoidalPosEmb multiplies t in [0, 1] by this
FF_MULT = 4


def timestep_sinusoid(t: torch.Tensor, dim: int) -> torch.Tensor:
    """[B] -> [B, dim]: sin then cos of 1000 t times geometric frequencies (Matcha)."""
    half = dim // 2
    freq = torch.exp(torch.arange(half, device=t.device).float() * -(math.log(10000) / (half - 1)))
    angle = TIME_SCALE * t.reshape(-1, 1) * freq[None, :]
    return torch.cat((angle.sin(), angle.cos()), dim=-1)


class CausalConv1d(nn.Conv1d):
    """Stride-1 conv padded with kernel-1 zeros on the left only."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.pad(x, (self.kernel_size[0] - 1, 0)))


class ChannelLayerNorm(nn.LayerNorm):
    """LayerNorm over channels of a [B, C, T] tensor (official Transpose-LayerNorm-Transpose)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.transpose(1, 2)).transpose(1, 2)


class CausalBlock1D(nn.Module):
    def __init__(self, dim: int, dim_out: int) -> None:
        super().__init__()
        # Indices 1 and 3 are the (parameter-free) transposes in the official Sequential.
        self.block = nn.Sequential(
            CausalConv1d(dim, dim_out, 3), nn.Identity(), ChannelLayerNorm(dim_out), nn.Identity(), nn.Mish()
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.block(x * mask) * mask


class CausalResnetBlock1D(nn.Module):
    def __init__(self, dim: int, dim_out: int, time_dim: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Mish(), nn.Linear(time_dim, dim_out))
        self.block1 = CausalBlock1D(dim, dim_out)
        self.block2 = CausalBlock1D(dim_out, dim_out)
        self.res_conv = nn.Conv1d(dim, dim_out, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, t_emb: torch.Tensor) -> torch.Tensor:
        h = self.block1(x, mask) + self.mlp(t_emb)[:, :, None]
        return self.block2(h, mask) + self.res_conv(x * mask)


class TimestepEmbedding(nn.Module):
    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, out_dim)
        self.linear_2 = nn.Linear(out_dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class Attention(nn.Module):
    """diffusers `Attention` as BasicTransformerBlock builds it: q/k/v without bias,
    `to_out` = [Linear with bias, Dropout]."""

    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        inner = heads * head_dim
        self.heads = heads
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim), nn.Dropout(0.0)])

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """x [B, T, dim], bias [B, 1, T, T] additive."""
        b, t, _ = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, self.heads, -1).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.to_q(x)), heads(self.to_k(x)), heads(self.to_v(x)), attn_mask=bias)
        return self.to_out[0](out.transpose(1, 2).reshape(b, t, -1))


class GELUProj(nn.Module):
    """diffusers `GELU` activation module: a Linear followed by exact GELU."""

    def __init__(self, dim: int, inner: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x))


class FeedForward(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.net = nn.ModuleList([GELUProj(dim, FF_MULT * dim), nn.Dropout(0.0), nn.Linear(FF_MULT * dim, dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.net:
            x = layer(x)
        return x


class BasicTransformerBlock(nn.Module):
    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn1 = Attention(dim, heads, head_dim)
        self.norm3 = nn.LayerNorm(dim)
        self.ff = FeedForward(dim)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = self.attn1(self.norm1(x), bias) + x
        return self.ff(self.norm3(x)) + x


class CausalConditionalDecoder(nn.Module):
    def __init__(self, cfg: CV2FlowConfig) -> None:
        super().__init__()
        if len(cfg.unet_channels) != 1:
            raise ValueError("only the one-level U-Net of cosyvoice2.yaml (channels: [C]) is supported")
        ch = cfg.unet_channels[0]
        time_dim = 4 * ch
        self.in_channels = cfg.unet_in_channels
        self.static_chunk_size = cfg.static_chunk_size

        def transformers() -> nn.ModuleList:
            return nn.ModuleList(
                BasicTransformerBlock(ch, cfg.unet_heads, cfg.unet_head_dim) for _ in range(cfg.unet_blocks)
            )

        self.time_mlp = TimestepEmbedding(cfg.unet_in_channels, time_dim)
        self.down_blocks = nn.ModuleList(
            [nn.ModuleList([CausalResnetBlock1D(cfg.unet_in_channels, ch, time_dim), transformers(), CausalConv1d(ch, ch, 3)])]
        )
        self.mid_blocks = nn.ModuleList(
            nn.ModuleList([CausalResnetBlock1D(ch, ch, time_dim), transformers()]) for _ in range(cfg.unet_mid_blocks)
        )
        self.up_blocks = nn.ModuleList(
            [nn.ModuleList([CausalResnetBlock1D(2 * ch, ch, time_dim), transformers(), CausalConv1d(ch, ch, 3)])]
        )
        self.final_block = CausalBlock1D(ch, ch)
        self.final_proj = nn.Conv1d(ch, cfg.output_size, 1)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor,
        mu: torch.Tensor,
        t: torch.Tensor,
        spks: torch.Tensor,
        cond: torch.Tensor,
        streaming: bool = False,
    ) -> torch.Tensor:
        """x, mu, cond [B, 80, T]; mask [B, 1, T]; t [B]; spks [B, 80] -> velocity [B, 80, T]."""
        t_emb = self.time_mlp(timestep_sinusoid(t.float(), self.in_channels).to(self.time_mlp.linear_1.weight.dtype))
        h = torch.cat([x, mu, spks[:, :, None].expand(-1, -1, x.shape[2]), cond], dim=1)
        allowed = attention_mask(mask[:, 0] > 0, self.static_chunk_size if streaming else None)
        bias = ((~allowed).to(h.dtype) * MASK_BIAS)[:, None]  # [B, 1, T, T]

        def attend(y: torch.Tensor, blocks: nn.ModuleList) -> torch.Tensor:
            y = y.transpose(1, 2)
            for block in blocks:
                y = block(y, bias)
            return y.transpose(1, 2)

        resnet, blocks, down = self.down_blocks[0]
        h = attend(resnet(h, mask, t_emb), blocks)
        skip = h
        h = down(h * mask)
        for resnet, blocks in self.mid_blocks:
            h = attend(resnet(h, mask, t_emb), blocks)
        resnet, blocks, up = self.up_blocks[0]
        h = attend(resnet(torch.cat([h, skip], dim=1), mask, t_emb), blocks)
        h = up(h * mask)
        h = self.final_block(h, mask)
        return self.final_proj(h * mask) * mask


__all__ = ["CausalConditionalDecoder"]
