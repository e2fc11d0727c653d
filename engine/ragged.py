"""Ragged rows of a batch: per-row windows and ranges with a fixed number of operator calls.

A batch of B utterances often needs a different slice of each one's tensor (a vocoder
stream's window, a chunk's new frames). Slicing and padding row by row costs a few
operator calls per row, and every call from Python gives up the interpreter lock, which a
busy event loop then holds (round 17 of docs/benchmarks.md: at 64 streams a vocoder step
dispatched 2726 operators). These build the whole batch with one gather from the rows'
concatenation (`ragged_rows`, `row_windows`), or hand out views from one split
(`row_ranges`), whatever B. Exact: pure data movement.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from .device_copy import tensor_on


# From this many rows `ragged_rows` and `row_windows` gather (a fixed ~15 operators) instead
# of slicing and padding each row (~3 a row): a vocoder step (`bench.dispatch_count --tiny`)
# at 1 / 2 / 8 / 64 streams dispatched 704 / 730 / 886 / 2342 operators sliced and 784 / 791 /
# 821 / 1101 gathered.
GATHER_MIN_ROWS = 4


def ragged_rows(parts: list[torch.Tensor], starts: list[int], lengths: list[int], width: int,
                reflect: int = 0) -> torch.Tensor:
    """Row b: parts[b][..., starts[b] : starts[b] + lengths[b]] (time last, the same leading
    shape in every part), reflect-padded by `reflect` on both sides like F.pad's "reflect",
    then zero-padded on the right to `width`: [B, *leading, width], from one gather over
    the parts' concatenation, however many parts."""
    if reflect and min(lengths) <= reflect:
        raise ValueError(f"reflect padding of {reflect} needs windows longer than that, got {min(lengths)}")
    if len(parts) < GATHER_MIN_ROWS:
        return torch.stack([_window(p[..., s : s + n], width, reflect) for p, s, n in zip(parts, starts, lengths)])
    zero = parts[0].new_zeros(*parts[0].shape[:-1], 1)
    offsets = np.cumsum([0] + [p.shape[-1] for p in parts])
    return gather_windows(torch.cat([*parts, zero], dim=-1), [int(o) + s for o, s in zip(offsets, starts)],
                          lengths, width, reflect)


def row_windows(rows: torch.Tensor, starts: list[int], lengths: list[int], width: int) -> torch.Tensor:
    """rows[b, starts[b] : starts[b] + lengths[b]] zero-padded to `width`, [B, width], from one gather."""
    batch, length = rows.shape
    if batch < GATHER_MIN_ROWS:
        return torch.stack([_window(r[s : s + n], width) for r, s, n in zip(rows, starts, lengths)])
    return gather_windows(F.pad(rows.reshape(-1), (0, 1)), [b * length + s for b, s in enumerate(starts)],
                          lengths, width)


def _window(x: torch.Tensor, width: int, reflect: int = 0) -> torch.Tensor:
    """One window as `gather_windows` makes it, by slicing and padding (few rows)."""
    if reflect:
        x = F.pad(x[None, None], (reflect, reflect), mode="reflect")[0, 0]
    return F.pad(x, (0, width - x.shape[-1]))


def gather_windows(flat: torch.Tensor, first: list[int], lengths: list[int], width: int,
                    reflect: int = 0) -> torch.Tensor:
    """Windows [first[b], first[b] + lengths[b]) of flat's last axis, whose last element is a
    zero: reflect-padded by `reflect` on both sides (windows longer than it), then zero-padded
    to `width`."""
    device = flat.device
    start = tensor_on(first, torch.long, device)[:, None]
    n = tensor_on(lengths, torch.long, device)[:, None]
    pos = torch.arange(width, device=device)
    j = (pos - reflect).expand(len(first), width)
    if reflect:  # -j left of the window, 2 (n - 1) - j right of it
        j = j.abs()
        j = torch.where(j >= n, 2 * (n - 1) - j, j)
    idx = torch.where(pos < n + 2 * reflect, start + j, flat.shape[-1] - 1)  # past the window: the zero
    out = flat[..., idx]  # [*leading, B, width]
    return out if flat.dim() == 1 else out.movedim(-2, 0).contiguous()


def row_ranges(rows: torch.Tensor, starts: list[int], lengths: list[int]) -> list[torch.Tensor]:
    """rows[b, starts[b] : starts[b] + lengths[b]] for every row ([B, L, *rest]), from one
    split of rows as [B x L, *rest]: views when rows is contiguous, else of one copy."""
    batch, width = rows.shape[:2]
    sizes, cursor = [], 0
    for b, (s, n) in enumerate(zip(starts, lengths)):
        at = b * width + s
        sizes += [at - cursor, n]
        cursor = at + n
    sizes.append(batch * width - cursor)
    return list(rows.reshape(batch * width, *rows.shape[2:]).split(sizes)[1::2])
