"""Qwen2 decoder with a batched, padded KV cache (the CosyVoice3 LM backbone).

Module nesting mirrors the Hugging Face classes so the official `llm.pt` loads with
no key renaming:

    Qwen2Encoder.model            -> Qwen2ForCausalLM
    Qwen2ForCausalLM.model        -> Qwen2Model (embed_tokens, layers, norm)
    Qwen2ForCausalLM.lm_head      -> Linear(hidden, vocab)   (loaded, unused by CosyVoice)

Numerics follow HF Qwen2 (RMSNorm in fp32, rotary cos/sin computed in fp32 and cast
to the activation dtype, `rotate_half` convention, GQA where query head h reads
kv head h // group).

KV cache layout: one tensor per K and V, shaped [layers, rows, kv_heads, length, head_dim].
Every sequence owns one row; rows may hold different lengths. A forward call appends
`S` new positions to a contiguous range of rows (prefill: S = prompt length, decode:
S = 1) and attends over `[0, max_len)` with a mask that hides each row's unused tail,
so sequences of different lengths decode together without copying the cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.models.config import Qwen2Config


# --------------------------------------------------------------------------- cache


@dataclass
class KVCache:
    """Padded per-row key/value storage for a batch of independent sequences.

    `lengths[r]` is how many positions row r holds. Rows are used densely
    (0 .. num_rows-1); `remove_row` swaps the last row into the hole so the batch
    stays contiguous and a decode step can take a plain slice.
    """

    k: Tensor  # [layers, row_capacity, kv_heads, length_capacity, head_dim]
    v: Tensor
    lengths: list[int] = field(default_factory=list)

    @classmethod
    def empty(
        cls,
        cfg: Qwen2Config,
        rows: int = 1,
        length: int = 256,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> "KVCache":
        shape = (cfg.num_hidden_layers, rows, cfg.num_key_value_heads, length, cfg.head_dim)
        k = torch.zeros(shape, device=device, dtype=dtype)
        return cls(k=k, v=torch.zeros_like(k), lengths=[])

    @property
    def num_rows(self) -> int:
        return len(self.lengths)

    @property
    def row_capacity(self) -> int:
        return self.k.shape[1]

    @property
    def length_capacity(self) -> int:
        return self.k.shape[3]

    def reserve(self, rows: int, length: int) -> None:
        """Grow storage (geometrically, so appends stay amortised O(1))."""
        new_rows = self.row_capacity
        while new_rows < rows:
            new_rows *= 2
        new_len = self.length_capacity
        while new_len < length:
            new_len *= 2
        if new_rows == self.row_capacity and new_len == self.length_capacity:
            return
        layers, old_rows, heads, old_len, dim = self.k.shape
        for name in ("k", "v"):
            old = getattr(self, name)
            grown = old.new_zeros((layers, new_rows, heads, new_len, dim))
            grown[:, :old_rows, :, :old_len] = old
            setattr(self, name, grown)

    def add_row(self) -> int:
        """Append an empty row; returns its index."""
        self.reserve(self.num_rows + 1, 1)
        self.lengths.append(0)
        return self.num_rows - 1

    def remove_row(self, row: int) -> None:
        """Drop `row` by moving the last row into its place (swap-remove).

        Callers that keep a per-row list must mirror this: `items[row] = items[-1]; items.pop()`.
        """
        last = self.num_rows - 1
        if row != last:
            n = self.lengths[last]
            self.k[:, row, :, :n] = self.k[:, last, :, :n]
            self.v[:, row, :, :n] = self.v[:, last, :, :n]
            self.lengths[row] = n
        self.lengths.pop()

    def clear(self) -> None:
        self.lengths.clear()


# --------------------------------------------------------------------------- layers


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in fp32 even for bf16 activations, as HF does.
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rotary_cos_sin(
    positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """cos/sin tables [B, 1, S, head_dim] for integer positions [B, S].

    Computed on the fly (a few KFLOPs) rather than kept as a buffer: nothing extra
    appears in the state dict and meta-device construction needs no special care.
    """
    exponents = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.int64).float()
    inv_freq = 1.0 / (theta ** (exponents / head_dim))
    freqs = positions.float()[..., None] * inv_freq  # [B, S, head_dim/2]
    angles = torch.cat([freqs, freqs], dim=-1)[:, None]  # [B, 1, S, head_dim]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Qwen2Attention(nn.Module):
    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        hidden = cfg.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=True)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)

    def forward(
        self,
        x: Tensor,  # [B, S, hidden]
        cos: Tensor,
        sin: Tensor,
        mask: Tensor,  # [B, 1, group*S, T] bool, True = may attend
        k_cache: Tensor,  # [B, kv_heads, length_capacity, head_dim] (view into KVCache)
        v_cache: Tensor,
        positions: Tensor,  # [B, S] long: where the new keys go
    ) -> Tensor:
        b, s, _ = x.shape
        hd, h, hkv = self.head_dim, self.num_heads, self.num_kv_heads
        q = self.q_proj(x).view(b, s, h, hd).transpose(1, 2)
        k = self.k_proj(x).view(b, s, hkv, hd).transpose(1, 2)
        v = self.v_proj(x).view(b, s, hkv, hd).transpose(1, 2)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)

        # Write the new keys/values first, then attend over the cache prefix: prefill
        # and decode become the same code path.
        where = positions[:, None, :, None].expand(b, hkv, s, hd)
        k_cache.scatter_(2, where, k)
        v_cache.scatter_(2, where, v)
        t = mask.shape[-1]
        keys, values = k_cache[:, :, :t], v_cache[:, :, :t]

        # GQA without repeating K/V: the `group` query heads that share one kv head are
        # folded into the query axis, so SDPA sees kv_heads heads of group*S queries.
        group = h // hkv
        q = q.reshape(b, hkv, group * s, hd)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        out = out.reshape(b, h, s, hd).transpose(1, 2).reshape(b, s, h * hd)
        return self.o_proj(out)


class Qwen2MLP(nn.Module):
    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen2DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.self_attn = Qwen2Attention(cfg)
        self.mlp = Qwen2MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        positions: Tensor,
    ) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, k_cache, v_cache, positions)
        return x + self.mlp(self.post_attention_layernorm(x))


# --------------------------------------------------------------------------- models


class Qwen2Model(nn.Module):
    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen2DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def new_cache(self, rows: int = 1, length: int = 256) -> KVCache:
        p = self.norm.weight
        return KVCache.empty(self.cfg, rows=rows, length=length, device=p.device, dtype=p.dtype)

    def forward(
        self,
        inputs_embeds: Tensor,  # [B, S, hidden]
        cache: KVCache | None = None,
        start_row: int = 0,
        num_new: list[int] | None = None,
    ) -> Tensor:
        """Run S new positions for cache rows [start_row, start_row + B); returns the
        final-norm hidden states [B, S, hidden] (= HF `hidden_states[-1]`).

        `num_new[b]` (default S) is how many of row b's S inputs are real; the rest is
        right padding whose outputs are garbage and whose cache writes are never
        visible to real positions. Without a cache a temporary one is used (plain
        full-sequence causal forward).
        """
        b, s, _ = inputs_embeds.shape
        if cache is None:
            cache = self.new_cache(rows=b, length=s)
            for _ in range(b):
                cache.add_row()
        if start_row + b > cache.num_rows:
            raise ValueError(f"rows {start_row}..{start_row + b} not allocated ({cache.num_rows})")
        counts = [s] * b if num_new is None else list(num_new)
        if len(counts) != b or any(not 0 <= n <= s for n in counts):
            raise ValueError(f"num_new {counts} does not fit batch {b} x {s}")
        lengths = cache.lengths[start_row : start_row + b]
        total = max(lengths) + s
        cache.reserve(cache.num_rows, total)

        device = inputs_embeds.device
        positions = torch.tensor(lengths, device=device, dtype=torch.long)[:, None] + torch.arange(
            s, device=device
        )
        cos, sin = rotary_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, inputs_embeds.dtype)
        # Causal over absolute positions: a query at position p sees keys 0..p of its row.
        keys = torch.arange(total, device=device)
        mask = (keys[None, None, :] <= positions[:, :, None])[:, None]  # [B, 1, S, T]
        group = self.cfg.num_attention_heads // self.cfg.num_key_value_heads
        mask = mask.repeat(1, 1, group, 1)  # matches the head-group fold in attention

        rows = slice(start_row, start_row + b)
        x = inputs_embeds
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, cache.k[i, rows], cache.v[i, rows], positions)
        for j, n in enumerate(counts):
            cache.lengths[start_row + j] += n
        return self.norm(x)


class Qwen2ForCausalLM(nn.Module):
    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.model = Qwen2Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, inputs_embeds: Tensor, cache: KVCache | None = None) -> Tensor:
        """Text logits (kept for completeness/parity checks; CosyVoice uses its own head)."""
        return self.lm_head(self.model(inputs_embeds, cache))


class Qwen2Encoder(nn.Module):
    """Thin holder that gives the official `llm.model.model.*` key prefix."""

    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.model = Qwen2ForCausalLM(cfg)

    @property
    def backbone(self) -> Qwen2Model:
        return self.model.model

    def forward(
        self,
        inputs_embeds: Tensor,
        cache: KVCache | None = None,
        start_row: int = 0,
        num_new: list[int] | None = None,
    ) -> Tensor:
        return self.model.model(inputs_embeds, cache, start_row, num_new)

