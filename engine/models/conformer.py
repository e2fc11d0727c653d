"""CosyVoice2's token encoder: `UpsampleConformerEncoder` (inference only).

Token embeddings (512-d) ->

    embed         Linear + LayerNorm, x sqrt(d)        (official LinearNoSubsampling +
                                                        EspnetRelPositionalEncoding)
    pre_lookahead_layer                                 sees 3 future tokens (shared with CV3)
    encoders      6 Conformer layers (self-attention with relative positions + FFN;
                  no macaron FFN, no conv module: cosyvoice2.yaml turns both off)
    up_layer      nearest x2 in time, then a causal conv (k=5)   -> 50 Hz
    up_embed      Linear + LayerNorm, x sqrt(d)
    up_encoders   4 Conformer layers
    after_norm    LayerNorm

Streaming: with `streaming=True` attention is block-causal over 25-token blocks (50
frames after the upsampling), counted from the first token of the sequence (prompt
included). Positions enter only as *relative* offsets, so a block's output depends on
the tokens up to the end of its block (+3 look-ahead), never on what follows: decoding a
growing prefix reproduces earlier blocks.

Parameter names equal the official checkpoint's (`encoder.*` in flow.pt). The positional
table has no parameters: the official `pe` is a plain attribute, not in the state dict.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .flow import PreLookaheadLayer

# LayerNorm eps inside the Conformer layers (wenet/espnet convention) and after the stacks.
LAYER_EPS = 1e-12
OUTER_EPS = 1e-5
UPSAMPLE_STRIDE = 2


def block_causal_mask(length: int, block: int, device: torch.device) -> torch.Tensor:
    """[T, T] bool: query i may see keys j < (i // block + 1) * block (official
    subsequent_chunk_mask with all left chunks)."""
    idx = torch.arange(length, device=device)
    return idx[None, :] < (idx[:, None] // block + 1) * block


def attention_mask(valid: torch.Tensor, block: int | None) -> torch.Tensor:
    """valid [B, T] bool -> [B, T, T] bool key mask (pad mask, & block-causal if `block`).
    Rows that would see nothing (queries in batch padding) see everything instead, like the
    official add_optional_chunk_mask; their outputs are never used."""
    mask = valid[:, None, :].expand(-1, valid.shape[1], -1)
    if block is not None:
        mask = mask & block_causal_mask(valid.shape[1], block, valid.device)
    empty = ~mask.any(dim=-1, keepdim=True)
    return mask | empty


def relative_sinusoids(length: int, dim: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[2T-1, dim] sinusoids of the relative offsets T-1, T-2, ..., -(T-1) (that order, as
    the official EspnetRelPositionalEncoding slices its table). Computed in float32 exactly
    like the official table (sin/cos of offset x frequency)."""
    offsets = torch.arange(length - 1, -length, -1, dtype=torch.float32, device=device)
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32, device=device) * -(math.log(10000.0) / dim))
    angle = offsets[:, None] * freq[None, :]
    pe = torch.zeros(2 * length - 1, dim, dtype=torch.float32, device=device)
    pe[:, 0::2] = torch.sin(angle)
    pe[:, 1::2] = torch.cos(angle)
    return pe.to(dtype)


class LinearEmbed(nn.Module):
    """Official LinearNoSubsampling: `out` = Linear, LayerNorm (dropout is a no-op here);
    the positional encoding then scales by sqrt(d) and supplies the relative table."""

    def __init__(self, idim: int, odim: int) -> None:
        super().__init__()
        self.out = nn.Sequential(nn.Linear(idim, odim), nn.LayerNorm(odim, eps=OUTER_EPS))
        self.xscale = math.sqrt(odim)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, idim] -> (x [B, T, odim], pos_emb [2T-1, odim])."""
        x = self.out(x) * self.xscale
        return x, relative_sinusoids(x.shape[1], x.shape[2], x.device, x.dtype)


class RelPositionAttention(nn.Module):
    """Multi-head self-attention with Transformer-XL relative positions (official
    RelPositionMultiHeadedAttention): score(i, j) = (q_i + u).k_j + (q_i + v).P(i - j)."""

    def __init__(self, heads: int, dim: int) -> None:
        super().__init__()
        self.h, self.d_k = heads, dim // heads
        self.linear_q = nn.Linear(dim, dim)
        self.linear_k = nn.Linear(dim, dim)
        self.linear_v = nn.Linear(dim, dim)
        self.linear_out = nn.Linear(dim, dim)
        self.linear_pos = nn.Linear(dim, dim, bias=False)
        self.pos_bias_u = nn.Parameter(torch.zeros(heads, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.zeros(heads, self.d_k))

    def forward(self, x: torch.Tensor, mask: torch.Tensor, pos_emb: torch.Tensor) -> torch.Tensor:
        """x [B, T, D], mask [B, T, T] bool (True = may attend), pos_emb [2T-1, D]."""
        b, t, _ = x.shape
        q = self.linear_q(x).view(b, t, self.h, self.d_k)
        k = self.linear_k(x).view(b, t, self.h, self.d_k).transpose(1, 2)
        v = self.linear_v(x).view(b, t, self.h, self.d_k).transpose(1, 2)
        p = self.linear_pos(pos_emb).view(-1, self.h, self.d_k).transpose(0, 1)  # [h, 2T-1, d]
        content = torch.matmul((q + self.pos_bias_u).transpose(1, 2), k.transpose(-2, -1))
        position = torch.matmul((q + self.pos_bias_v).transpose(1, 2), p.transpose(-2, -1))  # [B, h, T, 2T-1]
        # Column (T-1) - i + j of row i holds offset i - j (the official rel_shift).
        rows = torch.arange(t, device=x.device)
        index = (t - 1 - rows[:, None] + rows[None, :]).expand(b, self.h, t, t)
        position = torch.gather(position, -1, index)
        scores = (content + position) / math.sqrt(self.d_k)
        hidden = ~mask[:, None]
        attn = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1).masked_fill(hidden, 0.0)
        out = torch.matmul(attn, v).transpose(1, 2).reshape(b, t, self.h * self.d_k)
        return self.linear_out(out)


class FeedForward(nn.Module):
    """Official PositionwiseFeedForward with the swish activation."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w_1 = nn.Linear(dim, hidden)
        self.w_2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_2(F.silu(self.w_1(x)))


class ConformerLayer(nn.Module):
    """Pre-norm layer: x + MHA(norm_mha(x)), then x + FFN(norm_ff(x))."""

    def __init__(self, dim: int, heads: int, linear_units: int) -> None:
        super().__init__()
        self.self_attn = RelPositionAttention(heads, dim)
        self.feed_forward = FeedForward(dim, linear_units)
        self.norm_ff = nn.LayerNorm(dim, eps=LAYER_EPS)
        self.norm_mha = nn.LayerNorm(dim, eps=LAYER_EPS)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, pos_emb: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.norm_mha(x), mask, pos_emb)
        return x + self.feed_forward(self.norm_ff(x))


class Upsample1D(nn.Module):
    """Nearest-neighbour x`stride` in time, then a causal conv (kernel 2*stride+1)."""

    def __init__(self, channels: int, stride: int = UPSAMPLE_STRIDE) -> None:
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv1d(channels, channels, 2 * stride + 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, T] -> [B, C, stride*T]
        x = torch.repeat_interleave(x, self.stride, dim=2)
        return self.conv(F.pad(x, (2 * self.stride, 0)))


class UpsampleConformerEncoder(nn.Module):
    def __init__(
        self,
        input_size: int,
        output_size: int,
        heads: int,
        linear_units: int,
        num_blocks: int,
        num_up_blocks: int,
        chunk_size: int,
        pre_lookahead_len: int,
    ) -> None:
        super().__init__()
        if input_size != output_size:
            # The official up_embed is also Linear(input_size, ...) fed with output_size features.
            raise ValueError("UpsampleConformerEncoder needs input_size == output_size")
        self.chunk_size = chunk_size
        self.pre_lookahead_len = pre_lookahead_len
        self.embed = LinearEmbed(input_size, output_size)
        self.pre_lookahead_layer = PreLookaheadLayer(output_size, output_size, pre_lookahead_len)
        self.encoders = nn.ModuleList(ConformerLayer(output_size, heads, linear_units) for _ in range(num_blocks))
        self.up_layer = Upsample1D(output_size)
        self.up_embed = LinearEmbed(input_size, output_size)
        self.up_encoders = nn.ModuleList(
            ConformerLayer(output_size, heads, linear_units) for _ in range(num_up_blocks)
        )
        self.after_norm = nn.LayerNorm(output_size, eps=OUTER_EPS)

    def forward(self, tokens: torch.Tensor, num_main: list[int], num_total: list[int], streaming: bool) -> torch.Tensor:
        """tokens [B, N + look, D]: token embeddings, right-padded. Row b holds num_main[b]
        tokens to encode followed by look-ahead tokens up to num_total[b] (= num_main[b] when
        the utterance is final: then the look-ahead is zeros *after* `embed`, as in the
        official code). Returns [B, 2N, D] (N = max(num_main)); rows past 2*num_main[b] are
        padding."""
        b = tokens.shape[0]
        n = max(num_main)
        device = tokens.device
        x, _ = self.embed(tokens)
        keep = torch.arange(x.shape[1], device=device)[None, :] < torch.tensor(num_total, device=device)[:, None]
        x = x * keep[..., None].to(x.dtype)
        x = self.pre_lookahead_layer(x[:, : n + self.pre_lookahead_len])  # [B, N, D]
        lengths = torch.tensor(num_main, device=device)

        valid = torch.arange(n, device=device)[None, :] < lengths[:, None]
        pos = relative_sinusoids(n, x.shape[2], device, x.dtype)
        mask = attention_mask(valid, self.chunk_size if streaming else None)
        for layer in self.encoders:
            x = layer(x, mask, pos)

        x = self.up_layer(x.transpose(1, 2)).transpose(1, 2)  # [B, 2N, D]
        x, pos = self.up_embed(x)
        up = UPSAMPLE_STRIDE
        valid = torch.arange(up * n, device=device)[None, :] < (up * lengths)[:, None]
        mask = attention_mask(valid, up * self.chunk_size if streaming else None)
        for layer in self.up_encoders:
            x = layer(x, mask, pos)
        assert x.shape[0] == b
        return self.after_norm(x)


__all__ = ["UpsampleConformerEncoder", "block_causal_mask", "attention_mask", "relative_sinusoids"]
