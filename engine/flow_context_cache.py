"""Per-utterance cache of the flow's recent keys/values (`engine.flow_context_cache`, off by
default, issue #12).

With the voice prompt cached (`engine.flow_prompt_cache`) a chunk still recomputes its left
context, the last `flow_left_context` speech tokens before it, at every Euler step: most of
the ~135 frames a chunk computed in the round-3 load benchmark. The argument that makes the prompt cache exact
holds for those frames too: attention is block-causal over 50-frame blocks, so once a block
is complete and its tokens' lookahead is known, its keys and values at every step never
change. This cache keeps, per utterance, the keys/values of its latest complete blocks after
the prompt's cached ones (at most `max_frames`, oldest dropped) and the input projection the
position convolutions read before its end; a chunk then runs the ODE only over the frames
after them.

What a chunk attends to. Prompt blocks [0, C), then this cache's frames [end - F, end), then
its own frames, all at their absolute positions (rotary angles of cached keys were applied
when they were computed). With `flow_left_context = -1` nothing is dropped (up to 60 s of
frames; longer utterances slide) and every chunk equals the whole-prefix recomputation (the
official streaming decode) up to rounding: `tests/test_flow_context_cache.py` checks it in
float64, windows that drop blocks and mixed batches included. A bounded context is a
*different approximation* from the recomputing path's: the cache keeps F = 2 x left
frames (whole blocks), each computed with its own full past, while the recomputing window
holds left to left + 24 tokens, recomputed, plus the whole prompt tail [C, 2P). So with a
bounded context, turning the cache on changes the audio (by ~2-3% of the mel in float64 on
the tiny model, even in chunks where the recomputing path is still exact); with -1 it does
not.

When it is used. Batches that run eagerly (more chunks than the prefix graphs take: the
high-load case this is for); final chunks record nothing. A chunk decoded any other way (a
CUDA graph) does not record,
so its utterance's cache can no longer continue; it starts again only while the utterance's
window still begins at its first token (no frames dropped yet), and otherwise that utterance
recomputes its context as without this cache. Memory: 1.8 MB per cached frame at full size
in bf16 (two CFG rows x 10 steps x 22 blocks x keys and values), ~180 MB per utterance for
100 frames. `flow_context_cache_bytes` bounds the caches a stage holds: a cache that would
grow past it is freed and its utterance recomputes. (A batch's newly recorded frames are
held once more until they are committed: up to rows x F x 1.8 MB.)
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from .flow_prompt_cache import PromptKV
from .models.dit import CONV_CONTEXT, DiT, DiTRecord


@dataclass(eq=False)
class ContextKV:
    """One utterance's cached frames [end - frames, end) (absolute frame indices).

    keys, values: [steps, layers, 2, heads, frames, dim_head] (CFG rows conditional, unconditional);
    conv_context: [steps, 2, CONV_CONTEXT, dim], the input projection over [end - 60, end).
    """

    max_frames: int
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    conv_context: torch.Tensor | None = None
    end: int = 0  # 0: nothing cached yet
    stopped: bool = False  # a chunk ran without recording and the window has moved on

    @property
    def frames(self) -> int:
        return 0 if self.keys is None else int(self.keys.shape[4])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.conv_context) if t is not None)

    @staticmethod
    def bytes_per_frame(dit: DiT, n_steps: int) -> int:
        """Keys + values of one frame at every step, CFG row and block."""
        attn = dit.transformer_blocks[0].attn
        itemsize = next(dit.parameters()).element_size()
        return 2 * n_steps * 2 * len(dit.transformer_blocks) * attn.heads * attn.dim_head * itemsize

    def stop(self) -> None:
        """The cache can no longer serve this utterance: free it; the utterance recomputes."""
        self.keys = self.values = self.conv_context = None
        self.stopped = True


@dataclass
class ContextPrefix:
    """A row's prefix for `decode_with_prompt_cache`: the prompt's cached blocks, then the
    utterance's cached frames (the row-prefix interface `PromptKV` has too)."""

    prompt: PromptKV
    context: ContextKV
    start: int  # the row's first computed frame in its chunk's window
    position: int  # its absolute position (= context.end)

    @property
    def prompt_frames(self) -> int:
        return self.prompt.frames

    @property
    def frames(self) -> int:
        return self.prompt.frames + self.context.frames

    @property
    def conv_context(self) -> torch.Tensor:
        assert self.context.conv_context is not None
        return self.context.conv_context

    @property
    def parts(self) -> tuple[tuple[torch.Tensor, torch.Tensor, int], ...]:
        assert self.context.keys is not None and self.context.values is not None
        return (*self.prompt.parts, (self.context.keys, self.context.values, self.prompt.frames))


@dataclass
class _RowPlan:
    context: ContextKV | None
    start: int  # first computed frame (window)
    offset: int  # absolute frame = window frame + offset (for frames past the prompt)
    block_end: int  # the run's last complete block ends here (window); cache up to it
    keep: int  # frames to keep from this run (the newest complete ones, <= max_frames)


@dataclass
class ContextBatch:
    """The plan of one eager batch: each row's prefix (prompt only, or prompt + context),
    and what to record so every participating utterance's cache moves forward."""

    entries: list[PromptKV | ContextPrefix | None]
    plans: list[_RowPlan]
    records: list[DiTRecord] = field(default_factory=list)
    # What the records keep, all steps at once: [steps, layers, 2B, H, n, dh] (the records
    # write views of these, so the commit needs no second copy of the batch's keys/values).
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None

    def commit(self) -> None:
        """After the solve: append each row's newly completed frames to its cache."""
        if not self.records:
            return
        batch = len(self.plans)
        keys, values = self.keys, self.values
        assert keys is not None and values is not None
        convs = torch.stack([r.conv_context for r in self.records])  # [steps, 2B, 60, D]
        for i, plan in enumerate(self.plans):
            ctx = plan.context
            if ctx is None or plan.keep == 0:
                continue
            rows = [i, batch + i]
            new_k, new_v = keys[:, :, rows, :, : plan.keep], values[:, :, rows, :, : plan.keep]
            if ctx.keys is not None and ctx.end == plan.start + plan.offset:
                old = max(0, min(ctx.frames, ctx.max_frames - plan.keep))
                new_k = torch.cat((ctx.keys[..., ctx.frames - old :, :], new_k), dim=4)
                new_v = torch.cat((ctx.values[..., ctx.frames - old :, :], new_v), dim=4)
            ctx.keys, ctx.values = new_k.contiguous(), new_v.contiguous()
            ctx.conv_context = convs[:, rows].contiguous()
            ctx.end = plan.block_end + plan.offset
        # The batch's recorded keys/values are in the caches now; do not hold them longer.
        self.records, self.keys, self.values = [], None, None


class ContextCache:
    """A stage's view of the utterance caches its batches use: the plan of each eager batch
    (`plan`), and their total size against a byte budget (the caches live as long as their
    utterances hold them; the stage only keeps weak references)."""

    def __init__(self, budget_bytes: int, block: int) -> None:
        if budget_bytes < 0:
            raise ValueError("budget_bytes must be >= 0")
        self.budget_bytes = budget_bytes
        self.block = block
        self._live: weakref.WeakSet[ContextKV] = weakref.WeakSet()

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in list(self._live))

    def plan(self, dit: DiT, n_steps: int, entries: list[PromptKV | None], contexts: list[ContextKV | None],
             frames: list[int], offsets: list[int], prompt_frames: list[int], finals: list[bool]) -> ContextBatch:
        """Each row's prefix and recording plan. `frames`: each chunk's main frames in its
        window; `finals`: whether it is its utterance's last chunk; `offsets`: absolute minus
        window index for frames past the prompt (twice the
        first token of the window); `prompt_frames`: 2 x prompt tokens."""
        held = self.nbytes
        rows: list[PromptKV | ContextPrefix | None] = []
        plans: list[_RowPlan] = []
        for e, ctx, t, off, p2, last in zip(entries, contexts, frames, offsets, prompt_frames, finals):
            if e is None or ctx is None or ctx.stopped:
                rows.append(e)
                plans.append(_RowPlan(None, 0 if e is None else e.start, off, 0, 0))
                continue
            self._live.add(ctx)
            # Window frames past the prompt sit `off` frames earlier than their absolute
            # index; the cache serves the chunk if its end falls inside the window's frames.
            start_w = ctx.end - off if ctx.end - off >= p2 else (ctx.end if off == 0 else -1)
            if ctx.end > 0 and ctx.frames > 0 and e.start <= start_w < t:
                rows.append(ContextPrefix(e, ctx, start_w, ctx.end))
            elif off == 0 and ctx.end == 0:
                rows.append(e)  # (re)starting from the prompt's cached blocks
                start_w = e.start
            else:  # the window has moved past what the cache could serve: recompute from now on
                ctx.stop()
                rows.append(e)
                plans.append(_RowPlan(None, e.start, off, 0, 0))
                continue
            block_end = self.block * (t // self.block)
            # A final chunk has no next chunk to serve: nothing to record.
            keep = 0 if last else min(ctx.max_frames, max(0, block_end - start_w))
            grown = min(ctx.max_frames, ctx.frames + keep) - ctx.frames
            if keep and held + grown * ctx.bytes_per_frame(dit, n_steps) > self.budget_bytes:
                # No room: this utterance recomputes its context from now on (frees its cache).
                if isinstance(rows[-1], ContextPrefix):
                    rows[-1] = e
                    start_w = e.start
                ctx.stop()
                plans.append(_RowPlan(None, start_w, off, 0, 0))
                continue
            held += grown * ctx.bytes_per_frame(dit, n_steps)
            plans.append(_RowPlan(ctx, start_w, off, block_end, keep))
        batch = ContextBatch(rows, plans)
        if any(p.keep for p in plans):
            batch.records, batch.keys, batch.values = self._records(dit, n_steps, plans)
        return batch

    @staticmethod
    def reset(contexts: list[ContextKV | None]) -> None:
        """These utterances' chunk ran without recording (a CUDA graph): their caches no
        longer reach their next chunk. They start again from the prompt while the window
        still begins at the first token (`plan`), otherwise those utterances recompute."""
        for ctx in contexts:
            if ctx is not None:
                ctx.keys = ctx.values = ctx.conv_context = None
                ctx.end = 0

    @staticmethod
    def _records(dit: DiT, n_steps: int,
                 plans: list[_RowPlan]) -> tuple[list[DiTRecord], torch.Tensor, torch.Tensor]:
        """One DiTRecord per step that keeps, per row, the `keep` frames before its block end
        (run coordinates) and the 60 projection frames before it."""
        attn = dit.transformer_blocks[0].attn
        batch, n_layers = len(plans), len(dit.transformer_blocks)
        keep_max = max(1, max(p.keep for p in plans))
        some = next(dit.parameters())
        keep = torch.zeros(batch, keep_max, dtype=torch.long)
        conv = torch.zeros(batch, CONV_CONTEXT, dtype=torch.long)
        for i, p in enumerate(plans):
            end = max(0, p.block_end - p.start)  # run frames before the block end
            if p.keep:
                keep[i] = torch.arange(end - p.keep, end - p.keep + keep_max).clamp(0, max(0, end - 1))
            # Indices into [conv context (60 frames) | run projection]: the 60 before `end`.
            conv[i] = torch.arange(end, end + CONV_CONTEXT)
        keep = torch.cat((keep, keep)).to(some.device)
        conv = torch.cat((conv, conv)).to(some.device)
        shape = (n_steps, n_layers, 2 * batch, attn.heads, keep_max, attn.dim_head)
        keys = torch.empty(shape, dtype=some.dtype, device=some.device)
        values = torch.empty(shape, dtype=some.dtype, device=some.device)
        records = [DiTRecord(keep=keep, conv_keep=conv, sink_keys=keys[step], sink_values=values[step])
                   for step in range(n_steps)]
        return records, keys, values
