"""Each utterance's own earlier frames, kept as DiT keys/values for its next chunk (issue
#12; off by default, `engine.flow_context_cache_bytes`).

Without it a streaming chunk recomputes its left context: the flow re-runs the ODE over a
window of earlier tokens (`engine.flow_left_context`, 50-74 tokens), which a 64-session
load showed as 147-190 flow frames per chunk for ~60 frames of audio (round 9). The frames
of a whole attention block whose tokens and lookahead are all known are final: under
block-causal attention and causal position convolutions, no later frame changes them. So
a chunk that ends on the 25-token grid (every chunk after the first two does) may keep
what its final frames produced, at every Euler step, CFG half and block: their rotated
keys and their values, and the input projection of its last `CONV_CONTEXT` frames. The
utterance's next chunk, starting at exactly that frame, then runs the ODE over its new
frames (and lookahead) only, attending to

    the voice's cached prompt blocks (`engine.flow_prompt_cache`)
    + the last L frames this utterance kept (L = 2 x flow_left_context)
    + its own frames, block-causally,

with every rotary position absolute. That is a sliding window over the official
whole-prefix decode: with L at least the utterance's length it computes exactly the
official frames (`tests/test_flow_context_cache.py` checks it against the uncached,
unbounded decode). With a finite L it is not the recomputing window's arithmetic either
(that one shifts positions and keeps the prompt's last partial block), so turning this on
changes the audio slightly, like changing `flow_left_context` does.

Memory: steps x 2 CFG rows x layers x (K + V) x dim per kept frame, 1.8 MB at full size in
bf16: 180 MB per utterance for L = 100 frames. The keys and values of all utterances live in
one pool allocated on first use (`ContextCache`), sized by a byte budget; an utterance
takes a slot when a chunk of it first records, and gives it back with its final chunk,
when a chunk of it runs without the cache, or, least recently used first, when the pool
is full. An utterance without a slot recomputes its window as before.

Where it runs: in eager flow calls, and in the one-voice prompt-prefix CUDA graphs, which
come in two kinds per shape when the cache is on (`engine.flow_graphs`): plain, for the
batches with nothing to read or keep (every first chunk), and one that also gathers the
rows' rings and copies the kept blocks into the pool, through static index buffers. A
batch mixing voices below `engine.flow_context_min_rows` chunks takes a per-row prefix
graph, which has no rings: it runs as before and ends its utterances' chains (the rest of
each recomputes its window). Touched only from the stage's worker thread.

On the H200 (`bench/context_bench.py`, docs/benchmarks.md round 10): 64 utterances of 105
tokens through the stage in 0.84x the time, the chunks after the first two in 0.62-0.89x.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
import torch.nn.functional as F

from .device_copy import tensor_on, to_device
from .flow_prompt_cache import (PromptKV, StepPrefixes, check_entries, outputs, prefix_width, prompt_frames, run_from,
                                shared_entry, shifted_inputs)
from .models.dit import CONV_CONTEXT, DiT, DiTPrefix, per_row
from .models.flow import CausalMaskedDiffWithDiT, FlowBatchShape, FlowChunk


def slot_bytes(dit: DiT, steps: int, frames: int, dtype: torch.dtype) -> int:
    """Bytes one utterance's slot takes: keys, values and conv context of both CFG halves."""
    attn = dit.transformer_blocks[0].attn
    width = attn.heads * attn.dim_head
    per_half = 2 * steps * len(dit.transformer_blocks) * frames * width + steps * CONV_CONTEXT * width
    return 2 * per_half * torch.empty((), dtype=dtype).element_size()


@dataclass
class _Slot:
    key: weakref.ref[object]
    ident: int  # id() of the key when it got the slot: its `_by_key` entry, dead key or not
    end: int = 0  # absolute frame where the kept history ends: the next chunk's first frame
    count: int = 0  # valid ring frames (at most the ring's length)
    head: int = 0  # ring position of the next frame written
    used: int = 0  # batch number of the last use (least recently used goes first)


@dataclass
class ContextPlan:
    """What one flow call reads from and writes to the pool (built by `ContextCache.plan`).

    starts:    per chunk, the window frame its ODE run begins at (after the cached prompt,
               or at its first new frame when it reads its ring);
    positions: [2B] absolute position of each row's first input frame;
    ring_rows: [2B] pool row each batch row reads (slot x 2 + CFG half; any row where
               ring_mask is all False);
    ring_mask: [2B, L] which ring frames each row attends to;
    writes:    (batch row, input block, pool block) [3, M] of the kept keys and values, whole
               attention blocks: a pool block is (pool row) x L / block + ring block;
    conv:      (batch row, first input frame of the 60, pool row) [3, R] of the kept conv contexts.
    """

    starts: list[int]
    positions: torch.Tensor
    ring_rows: torch.Tensor
    ring_mask: torch.Tensor
    reads: bool
    writes: torch.Tensor | None
    conv: torch.Tensor | None


class ContextCache:
    """A pool of per-utterance rings of DiT keys/values (see the module docstring)."""

    def __init__(self, flow: CausalMaskedDiffWithDiT, frames: int, budget_bytes: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        dit = flow.decoder.estimator
        if not isinstance(dit, DiT):
            raise ValueError("the context cache needs the CosyVoice3 flow (a DiT estimator)")
        if frames <= 0:
            raise ValueError("the context cache needs a bounded left context (frames > 0)")
        if frames % dit.static_chunk_size:
            raise ValueError(f"the ring holds whole attention blocks ({dit.static_chunk_size} frames), not {frames}")
        self.flow, self.frames, self.device, self.dtype = flow, frames, torch.device(device), dtype
        self.block = dit.static_chunk_size
        self.steps = flow.decoder.n_timesteps
        attn = dit.transformer_blocks[0].attn
        self._shape = (self.steps, len(dit.transformer_blocks), attn.heads, attn.dim_head)
        self.slot_bytes = slot_bytes(dit, self.steps, frames, dtype)
        # One slot of the budget is scratch: where a CUDA graph's unused write entries go.
        self.capacity = max(0, budget_bytes // self.slot_bytes - 1)
        self.scratch = self.capacity  # its pool rows: 2 * scratch (+ 1)
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None
        self._conv: torch.Tensor | None = None
        self._slots: list[_Slot | None] = [None] * self.capacity
        self._by_key: dict[int, int] = {}
        self._batches = 0
        # Chunks that read their ring / kept frames for a later one / found no free slot.
        self.reads = self.records = self.refused = 0

    @property
    def nbytes(self) -> int:
        """Bytes allocated (the whole pool once any chunk has used it)."""
        return 0 if self._keys is None else (self.capacity + 1) * self.slot_bytes

    def in_use(self) -> int:
        return sum(s is not None for s in self._slots)

    def pool(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """keys, values [steps, layers, 2 x slots, L, D] and conv contexts [steps, 2 x slots,
        CONV_CONTEXT, D] (row 2s + h: slot s, CFG half h; D = heads x dim_head, a frame's
        heads side by side as the projections make them, so that a kept frame is one
        contiguous row), allocated on first use and never moved (CUDA graphs read and
        write them in place)."""
        if self._keys is None:
            steps, layers, heads, dh = self._shape
            rows = 2 * (self.capacity + 1)
            shape = (steps, layers, rows, self.frames, heads * dh)
            # Zeros: rows read under an all-False mask must still be finite.
            self._keys = torch.zeros(shape, device=self.device, dtype=self.dtype)
            self._values = torch.zeros(shape, device=self.device, dtype=self.dtype)
            self._conv = torch.zeros(steps, rows, CONV_CONTEXT, heads * dh, device=self.device, dtype=self.dtype)
        assert self._values is not None and self._conv is not None
        return self._keys, self._values, self._conv

    def _slot_of(self, key: object) -> int | None:
        index = self._by_key.get(id(key))
        if index is None:
            return None
        slot = self._slots[index]
        if slot is None or slot.key() is not key:  # the id was reused by another object
            return None
        return index

    def release(self, keys: Sequence[object]) -> None:
        """Give back the slots of these utterances (their chains end). Safe right before a
        batch is queued on the device: later batches run after it on the same stream."""
        for key in keys:
            index = self._slot_of(key)
            if index is not None:
                self._free(index)

    def _free(self, index: int) -> None:
        slot = self._slots[index]
        if slot is not None and self._by_key.get(slot.ident) == index:
            del self._by_key[slot.ident]  # also a dead key's: its id stayed behind
        self._slots[index] = None

    def _allocate(self, key: object, busy: set[int]) -> int | None:
        """A free slot for `key`: an empty one, one whose utterance is gone, or the least
        recently used one, none of them one this batch reads or writes (`busy`, which
        includes slots given back while planning it)."""
        free = [i for i, s in enumerate(self._slots) if (s is None or s.key() is None) and i not in busy]
        if not free:
            idle = [i for i in range(self.capacity) if i not in busy]
            if not idle:
                return None
            free = [min(idle, key=lambda i: self._slots[i].used)]  # type: ignore[union-attr]
        index = free[0]
        self._free(index)
        self._slots[index] = _Slot(key=weakref.ref(key), ident=id(key))
        self._by_key[id(key)] = index
        return index

    def plan(self, chunks: Sequence[FlowChunk], entries: Sequence[PromptKV | None],
             keys: Sequence[object]) -> ContextPlan | None:
        """Decide each chunk's part in one flow call (eager or a ring graph) and update the
        slots' state (the call's device work then makes it true). None: nothing to read or
        keep."""
        self._batches += 1
        flow, ratio, look, L = self.flow, self.flow.token_mel_ratio, self.flow.pre_lookahead_len, self.frames
        n = len(chunks)
        starts = [0 if e is None else e.frames for e in entries]
        positions = list(starts)
        ring_rows, counts = [0] * n, [0] * n
        kept_rows: list[tuple[int, int, int, int, int]] = []  # (row, final frames, kept, ring head, slot)
        busy = {i for i in (self._slot_of(k) for k in keys) if i is not None}
        reads = False
        for i, (c, e, key) in enumerate(zip(chunks, entries, keys)):
            index = self._slot_of(key)
            if e is None or e.frames != prompt_frames(flow, c):
                if index is not None:
                    self._free(index)
                continue
            first = ratio * c.out_start  # window frame of the first new frame
            end = ratio * (len(c.tokens) - (0 if c.finalize else look))  # window end of the final frames
            slot = None if index is None else self._slots[index]
            use = (slot is not None and slot.count > 0 and slot.end == first + c.noise_offset
                   and (first + c.noise_offset) % self.block == 0)
            if use:
                assert slot is not None
                starts[i], positions[i] = first, first + c.noise_offset
                ring_rows[i], counts[i] = index, slot.count  # type: ignore[assignment]
                reads = True
            # Keep this chunk's final frames when they end on a block and their positions
            # are absolute (a recomputed window from token 0, or the ring itself).
            keep = (not c.finalize and (end + c.noise_offset) % self.block == 0 and end > starts[i]
                    and (use or c.noise_offset == 0))
            if not keep:
                if index is not None:
                    self._free(index)
                continue
            if not use:
                if index is not None:
                    self._free(index)
                index = self._allocate(key, busy)
                if index is None:
                    self.refused += 1
                    continue
                busy.add(index)
            slot = self._slots[index]
            assert slot is not None
            if not use:
                slot.count = slot.head = 0
            final = end - starts[i]  # input frames of this row that are final: whole blocks
            kept = min(final, L)
            assert final % self.block == 0 and slot.head % self.block == 0
            kept_rows.append((i, final, kept, slot.head, index))
            slot.head = (slot.head + kept) % L
            slot.count = min(L, slot.count + kept)
            slot.end = end + c.noise_offset
            slot.used = self._batches
            self.records += 1
        if not reads and not kept_rows:
            return None
        self.reads += sum(c > 0 for c in counts)
        dev = self.device
        rows2 = ring_rows + ring_rows
        halves = [0] * n + [1] * n
        ring_index = tensor_on([2 * r + h for r, h in zip(rows2, halves)], torch.long, dev)
        c2 = tensor_on(counts + counts, torch.long, dev)
        ring_mask = torch.arange(L, device=dev).unsqueeze(0) < c2.unsqueeze(1)
        return ContextPlan(
            starts=starts,
            positions=tensor_on(positions + positions, torch.long, dev),
            ring_rows=ring_index,
            ring_mask=ring_mask,
            reads=reads,
            writes=_write_plan(kept_rows, n, L, self.block, dev) if kept_rows else None,
            conv=_conv_plan(kept_rows, n, dev) if kept_rows else None,
        )

    @property
    def heads(self) -> int:
        return self._shape[2]

    @property
    def blocks(self) -> int:
        """Attention blocks a ring holds."""
        return self.frames // self.block

    def prefixes(self, base: StepPrefixes, plan: ContextPlan) -> "ContextPrefixes":
        return ContextPrefixes(base, plan, *self.pool(), self.heads, self.block)


def _write_plan(kept_rows: list[tuple[int, int, int, int, int]], n: int, ring: int, block: int,
                device: torch.device) -> torch.Tensor:
    """(batch row, input block, pool block) [3, M] of every kept block: row i keeps its last
    `kept` final frames, whole attention blocks (its start and end are on blocks), written
    from its ring head on, in both CFG halves; a pool block is (pool row) x L / block + the
    ring's block."""
    blocks = ring // block
    entries = [(i + h * n, (final - kept) // block + b, (2 * slot + h) * blocks + (head // block + b) % blocks)
               for i, final, kept, head, slot in kept_rows for b in range(kept // block) for h in (0, 1)]
    return to_device(torch.tensor(entries, dtype=torch.long).T.contiguous(), device)


def _conv_plan(kept_rows: list[tuple[int, int, int, int, int]], n: int, device: torch.device) -> torch.Tensor:
    """(batch row, first of the 60 frames in cat(context, input), pool row) [3, R]: the input
    projection's 60 frames before each kept row's end."""
    rows = [(i + h * n, final, 2 * slot + h) for h in (0, 1) for i, final, _, _, slot in kept_rows]
    return to_device(torch.tensor(rows, dtype=torch.long).T.contiguous(), device)


def warmup_chunks(flow: CausalMaskedDiffWithDiT, prompt: FlowChunk) -> list[FlowChunk]:
    """Three chunks of one made-up utterance of the prompt's voice (its own tokens again)
    that take the cache's three kinds of call in turn: keep only (the first chunk that
    ends on the grid), read and keep, read only (a final chunk)."""
    p, look, grid = prompt.num_prompt_tokens, flow.pre_lookahead_len, flow.decoder.estimator.static_chunk_size
    grid //= flow.token_mel_ratio
    first = (-p) % grid or grid
    ends = [(first, False), (first + grid, False), (first + grid + grid // 2, True)]
    speech = prompt.tokens[:p].repeat(-(-(ends[-1][0] + look) // p))
    chunks, offset = [], 0
    for end, final in ends:
        stop = end if final else end + look
        chunks.append(FlowChunk(tokens=torch.cat((prompt.tokens[:p], speech[:stop])), prompt_feat=prompt.prompt_feat,
                                embedding=prompt.embedding, num_prompt_tokens=p, out_start=p + offset,
                                finalize=final))
        offset = end
    return chunks


class RingWriter:
    """`PrefixSink` of one Euler step: copies the kept blocks into the pool.

    writes: (batch row, input block, pool block) [3, M];
    conv:   (batch row, first of the 60 frames in cat(context, input), pool row) [3, R].
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, conv: torch.Tensor, writes: torch.Tensor,
                 conv_writes: torch.Tensor, block: int) -> None:
        self.keys, self.values, self.conv = keys, values, conv
        self.writes, self.conv_writes, self.block = writes, conv_writes, block

    def projection(self, h: torch.Tensor) -> None:
        row, first, dst = self.conv_writes
        frames = first.unsqueeze(1) + torch.arange(CONV_CONTEXT, device=first.device)
        self.conv[dst] = h[row.unsqueeze(1), frames]

    def keys_values(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        row, block, dst = self.writes
        rows, frames, width = keys.shape
        blocks = -(-frames // self.block)
        src = row * blocks + block
        for new, pool in ((keys, self.keys[layer]), (values, self.values[layer])):
            if frames % self.block:  # an eager call's exact length: the last block is partial
                new = F.pad(new, (0, 0, 0, blocks * self.block - frames))
            # Whole blocks as rows of 8-byte words: index kernels copy element by element, so
            # 2-byte elements made these copies ~4x slower (H200 profile).
            rows_of = lambda t: t.reshape(-1, self.block * width).view(torch.int64)  # noqa: E731
            rows_of(pool).index_copy_(0, dst, rows_of(new).index_select(0, src))


class ContextPrefixes:
    """Per Euler step, the prompt cache's `DiTPrefix` extended by the rows' rings."""

    def __init__(self, base: StepPrefixes, plan: ContextPlan, keys: torch.Tensor, values: torch.Tensor,
                 conv: torch.Tensor, heads: int, block: int) -> None:
        self.base, self.plan = base, plan
        self.keys, self.values, self.conv = keys, values, conv
        self.heads = heads
        self.block = block
        self.key_mask = torch.cat((base.key_mask, plan.ring_mask), dim=1) if plan.reads else base.key_mask
        reading = plan.ring_mask.any(dim=1)
        self.reading = reading.view(-1, 1, 1)

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, step: int) -> DiTPrefix:
        p, plan = self.base[step], self.plan
        context = p.conv_context
        rows = plan.positions.shape[0]
        if context.shape[0] != rows:
            context = per_row(context, rows)
        ring_kv = None
        if plan.reads:
            context = torch.where(self.reading, self.conv[step].index_select(0, plan.ring_rows).to(context.dtype),
                                  context)
            ring_kv = RingKV(self.keys[step], self.values[step], plan.ring_rows, self.heads)
        sink = None
        if plan.writes is not None and plan.conv is not None:
            sink = RingWriter(self.keys[step], self.values[step], self.conv[step], plan.writes, plan.conv,
                              self.block)
        return DiTPrefix(layer_kv=p.layer_kv, key_mask=self.key_mask, positions=plan.positions, conv_context=context,
                         shared=p.shared, ring_kv=ring_kv, sink=sink)


class RingKV(Sequence[tuple[torch.Tensor, torch.Tensor]]):
    """`DiTPrefix.ring_kv` of one step, gathered per layer when the block asks: the rows'
    rings [2B, L, D] seen as [2B, H, L, dh]."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor, heads: int) -> None:
        self.keys, self.values, self.rows, self.heads = keys, values, rows, heads

    def __len__(self) -> int:
        return self.keys.shape[0]

    def _rows(self, pool: torch.Tensor) -> torch.Tensor:
        rings = pool.index_select(0, self.rows)
        b, frames, width = rings.shape
        return rings.view(b, frames, self.heads, width // self.heads).transpose(1, 2)

    def __getitem__(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        return self._rows(self.keys[layer]), self._rows(self.values[layer])


class ContextSolver(Protocol):
    """A `PrefixSolver` that also takes a plan of its context cache (the graph runner)."""

    def padded_shape(self, rows: int, frames: int, width: int = 0, shared: bool = False) -> tuple[int, int]: ...

    def __call__(self, noise: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, spks: torch.Tensor,
                 cond: torch.Tensor, streaming: bool, prefix: Sequence[PromptKV | None] | None = None,
                 context: ContextPlan | None = None) -> torch.Tensor: ...


@torch.inference_mode()
def decode_with_context(flow: CausalMaskedDiffWithDiT, chunks: list[FlowChunk], entries: list[PromptKV | None],
                        cache: ContextCache, plan: ContextPlan,
                        solver: ContextSolver | None = None) -> tuple[list[torch.Tensor], FlowBatchShape]:
    """`decode_with_prompt_cache` with each row's ODE run beginning at `plan.starts` and
    its ring in every attention: eagerly, or by `solver` (a graph runner with this cache)."""
    check_entries(flow, chunks, entries)
    if solver is None:
        return run_from(flow, chunks, plan.starts, cache.prefixes(StepPrefixes(entries, cache.device), plan))
    args, frames, length = shifted_inputs(flow, chunks, plan.starts)
    mel = solver(*args, prefix=entries, context=plan)
    shape = FlowBatchShape(*solver.padded_shape(len(chunks), length, prefix_width(entries),
                                                shared_entry(entries) is not None), length)
    return outputs(flow, chunks, plan.starts, frames, mel), shape
