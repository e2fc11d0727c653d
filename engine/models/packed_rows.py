"""The CosyVoice3 DiT with a call's rows laid end to end (packed), not padded to the longest.

A flow call of the stage pads every row to its call's longest. Under staggered arrivals a
call mixes new utterances' first chunks (~24 frames) with patient later ones (~140), and
at 176-192 sessions over 16 s on an H100 a fifth of the frames the DiT computed were such
padding (round 40 of docs/benchmarks.md). Packed, each block's matrix products and
elementwise passes run over the real frames only. Its attention runs as in a padded call
(the same kernels, masks and prompt prefix): q, k and v are gathered into the padded rows
and the output scattered back, three gathers and a scatter a block more than the padded
call, whose cost is not measured yet. (A first form ran flex attention over the packed
sequence itself: its kernel took 5-8x cuDNN's time at these shapes, round 40.)

Same maths as `DiT.forward` in streaming mode, row for row. What stays padded: the input
embedding (its causal position convolutions restart at each row; a small share of a call).

Not yet used by the stage: `bench.packed_rows` measures it against the padded call first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .dit import (CONV_CONTEXT, DiT, DiTPrefix, PackedMask, TimeConditioning, attention_mask, per_row,
                  prefixed_attention_mask)


@dataclass(frozen=True, eq=False)  # tensors do not compare to one bool
class PackedRows:
    """Where each packed frame comes from: rows [0, R) are the conditional CFG half and
    rows [R, 2R) the unconditional one, each `lengths[i]` real frames of a padded
    `length`."""

    lengths: tuple[int, ...]
    length: int
    row_of: torch.Tensor  # [N] long: the row of each packed frame
    local: torch.Tensor  # [N] long: its frame within that row
    gather: torch.Tensor  # [B, length] long: the packed frame in each padded slot (0 past a row's end)
    scatter: torch.Tensor  # [N] long: each packed frame's slot in the flattened [B x length]

    @classmethod
    def of(cls, lengths: Sequence[int], device: torch.device | str, length: int | None = None) -> "PackedRows":
        if not lengths or len(lengths) % 2 or min(lengths) < 1:
            raise ValueError("packed rows come in two CFG halves of non-empty rows")
        length = max(lengths) if length is None else length
        if max(lengths) > length:
            raise ValueError("a row is longer than the padded length")
        sizes = torch.tensor(list(lengths), dtype=torch.long)
        row_of = torch.repeat_interleave(torch.arange(len(lengths)), sizes)
        starts = torch.cumsum(sizes, 0) - sizes
        local = torch.arange(int(sizes.sum())) - starts[row_of]
        slot = torch.arange(length)
        gather = torch.where(slot < sizes[:, None], starts[:, None] + slot, torch.zeros((), dtype=torch.long))
        scatter = row_of * length + local
        return cls(tuple(int(n) for n in lengths), length, *(t.to(device) for t in (row_of, local, gather, scatter)))

    @property
    def frames(self) -> int:
        return int(self.row_of.shape[0])

    def pack(self, padded: torch.Tensor) -> torch.Tensor:
        """[B, length, C] -> [N, C]: each row's real frames, one row after another."""
        return padded.reshape(-1, padded.shape[-1])[self.scatter]

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """[N, C] -> [B, length, C], zeros past each row's end."""
        out = packed.new_zeros(len(self.lengths) * self.length, packed.shape[-1])
        out[self.scatter] = packed
        return out.view(len(self.lengths), self.length, -1)

    def pad_mask(self) -> torch.Tensor:
        """[B, length] bool, True on real frames."""
        slot = torch.arange(self.length, device=self.row_of.device)
        return slot < torch.tensor(self.lengths, device=self.row_of.device)[:, None]


def packed_mask(dit: DiT, rows: PackedRows, prefix: DiTPrefix | None, dtype: torch.dtype) -> PackedMask:
    """The blocks' `PackedMask` for one call (its steps share it): the padded call's own
    attention masks (`DiT.block_masks`) with the gather and scatter of `rows`."""
    pad = rows.pad_mask()
    if prefix is None:
        attn = attention_mask(pad, dit.static_chunk_size)
    else:
        attn = prefixed_attention_mask(prefix.key_mask, pad, dit.static_chunk_size)
    return PackedMask(rows.gather, rows.scatter, dit.block_masks(attn, prefix, dtype))


def forward_packed(dit: DiT, x: torch.Tensor, *, mu: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor,
                   rows: PackedRows, time: TimeConditioning, prefix: DiTPrefix | None = None,
                   mask: PackedMask | None = None) -> torch.Tensor:
    """`DiT.forward(x, mask, mu, t, spks, cond, streaming=True, prefix=prefix, time=time)`
    with each row's frames past `rows.lengths` left out of the blocks' matrix products:
    x, mu, cond [B, 80, rows.length] (padded as for `DiT.forward`), spks [B, 80]; the
    velocity [B, 80, rows.length], zeros past each row's end. `time`: one flow time for
    every row. `prefix`: none or one voice's (`shared`), without rings or sinks. `mask`:
    `packed_mask`, made once for a call's steps."""
    if time.blocks.shape[1] != 1:
        raise ValueError("packed rows share one flow time")
    if prefix is not None and (not prefix.shared or prefix.ring_kv is not None or prefix.sink is not None):
        # What the stage would pack first: one voice's batches. Mixed voices and the
        # context cache's rings would run too, but are not tested packed; a sink keeps
        # keys in the padded layout.
        raise ValueError("packed rows take no prefix or one voice's, without rings or sinks")
    if (x.shape[0], x.shape[2]) != (len(rows.lengths), rows.length):
        raise ValueError("the packed rows do not fit the padded inputs")
    if mask is not None and mask.gather.shape != rows.gather.shape:
        raise ValueError("the packed mask was made for other rows")
    context = context_valid = None
    if prefix is not None:
        context = prefix.conv_context
        if context.shape[0] != x.shape[0]:
            context = per_row(context, x.shape[0])
        before = torch.arange(-CONV_CONTEXT, 0, device=prefix.positions.device)
        context_valid = (prefix.positions.unsqueeze(1) + before) >= 0
    embedded = dit.input_embed(x.transpose(1, 2), cond.transpose(1, 2), mu.transpose(1, 2), spks,
                               context, context_valid)
    h = rows.pack(embedded).unsqueeze(0)  # [1, N, D]
    start = rows.local if prefix is None else prefix.positions[rows.row_of] + rows.local
    angles = dit.rotary_embed.at(start)  # [N, dh]
    rope = (angles.cos(), angles.sin())
    if mask is None:
        mask = packed_mask(dit, rows, prefix, h.dtype)
    every = torch.ones(1, rows.frames, dtype=torch.bool, device=h.device)  # not read by a packed attention
    h = dit.run_blocks(h, time.blocks, mask, every, rope, prefix)
    out = dit.proj_out(dit.norm_out(h, time.final))  # [1, N, 80]
    return rows.unpack(out[0]).transpose(1, 2)
