"""CUDA graphs for the flow's ODE solve (CosyVoice3 DiT): 10 Euler steps x 22 DiT blocks
are ~10k small kernels per chunk batch, so at small batches the GPU waits on the CPU
launching them. Replaying a captured graph launches them all at once.

A graph has fixed shapes, so `FlowGraphRunner` pads every batch up to a bucket:

* rows (chunks, before the guidance doubling) to the next of `GraphPolicy.batch_buckets`;
* frames to the next multiple of `GraphPolicy.frame_multiple`, or to a smaller one of
  `GraphPolicy.frame_buckets` when one holds them.

The padding is exact (see `CausalMaskedDiffWithDiT.decode_chunks`): padded rows and frames
carry mask 0 and zero inputs, the estimator works row by row, its convolutions only look
left and attention never reads a masked key, so the real frames are the same numbers as
without padding (up to kernel choice for the different GEMM/attention sizes).

One graph per (rows, frames, streaming) bucket, captured lazily on first use (or ahead of
time with `warm`), at most `max_graphs` kept (least recently used dropped) and none above
`max_frames` (those batches run eagerly). All graphs read from and write to one set of
static buffers (views of the same flat tensors: replays are sequential, and every replay
copies its inputs in first) and allocate their intermediates from one shared memory pool.

With `capture=False` (the default off CUDA) the runner keeps all of this except the graph
itself: it pads, copies into the static buffers, solves eagerly on them and copies out.
That path is what the CPU tests check against the plain `inference_chunks`.

Autocast (`autocast_dtype`, for a float32 flow run in bf16 this way; the stage itself now
casts the flow's weights instead, `engine.flow_dtype`). Autocast caches the bf16 copy of
each weight for the length of its region; a copy cached *before* a capture would be baked
into the graph as an address whose memory is later freed. So the cache is cleared right
before and right after each capture: inside the capture the first DiT call records the
weight casts (into the graph's pool) and the other nine reuse them, as in eager mode.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Iterable, Iterator, Sequence

import torch
from torch import nn

from .config import GRAPH_ROW_BUCKETS
from .flow_context_cache import ContextCache, ContextPlan, RingKV, RingWriter
from .flow_prompt_cache import PrefixBuffers, PrefixViews, PromptKV, StepPrefixes, prefix_width, shared_entry
from .graph_capture import CAPTURE_LOCK, copy_padded
from .models.dit import DiTPrefix, per_row

log = logging.getLogger(__name__)

BATCH_BUCKETS: tuple[int, ...] = GRAPH_ROW_BUCKETS


@dataclass(frozen=True)
class GraphPolicy:
    """Which shapes get a graph. 50 frames is the DiT's attention block (and 1 s of mel),
    so a padded batch never starts a new block just for padding."""

    batch_buckets: tuple[int, ...] = BATCH_BUCKETS
    frame_multiple: int = 50
    # More frame sizes with graphs of their own (`flow_graph_frames`): a batch takes the
    # smallest of these that holds it when that is below its next multiple. A burst's
    # first chunks of 20-34 tokens compute 52-80 frames after a 4.25 s voice's cached
    # prompt, padded to 100 by the multiples alone (nearly twice the work at 52). Each one
    # is captured at every row bucket and prefix kind, for start time and graph slots.
    frame_buckets: tuple[int, ...] = ()
    max_frames: int = 1500  # 30 s of mel; longer windows (e.g. unbounded left context) run eagerly
    # A voice needs 11 row x up to 11 frame buckets of the one-voice prefix kind and 6 x up
    # to 11 of the per-row one (187 at the default buckets and max_hop), per prefix width
    # bucket. Graphs share one memory pool for their intermediates; each one beyond it held
    # ~13 MiB on the H200 (round 37).
    max_graphs: int = 600
    warmup_iters: int = 1  # eager runs before a capture (lazy init of cuBLAS/SDPA kernels)
    # Batches decoded from the flow prompt cache get graphs up to this many rows and this
    # many cached frames per row (static prefix buffers: 1.8 MB per row and frame at full
    # size, so the defaults reserve 4.3 GB, at warm-up or the first such batch) ...
    prefix_max_rows: int = 8
    prefix_max_frames: int = 300
    # ... and up to this many rows when every row has the same voice (the prefix is held
    # once, 0.54 GB for 300 frames: `PrefixViews.shared`); a one-voice batch above it
    # falls back to the per-row graphs.
    shared_prefix_max_rows: int = 64
    # Prefix widths are padded up to a multiple of this (masked slots, exact), so voices
    # with different prompt lengths share graphs: 100, 200 or 300 frames.
    prefix_multiple: int = 100
    # A bucket of more than `fill_free_rows` rows serves a batch only when the batch fills
    # at least `min_fill` of it; otherwise the batch runs eagerly at its exact rows. An
    # eager batch pays the host for every compiled block call (~2 ms each, 220 a batch):
    # on the H200 (round 13, in the gateway) 40 first chunks took 434 ms eagerly and 266 ms
    # in the 64-row graph. So a graph serves down to half its rows.
    min_fill: float = 0.5
    fill_free_rows: int = 16

    def with_max_rows(self, max_rows: int) -> "GraphPolicy":
        """This policy with no graph above `max_rows` rows: larger batches run eagerly at
        their exact row count. Graphs pay mostly at small batches (launch-bound), while a
        large batch padded to its bucket can cost up to ~2x the compute, so
        capping the buckets trades the small graph gain for no row padding. `max_rows`
        itself becomes a bucket (batches that fill too little of a bucket above
        `fill_free_rows` still run eagerly); 0 means no graphs at all."""
        if max_rows < 0:
            raise ValueError("max_rows must be >= 0")
        kept = {b for b in self.batch_buckets if b <= max_rows}
        if max_rows > 0:
            kept.add(max_rows)
        return replace(self, batch_buckets=tuple(sorted(kept)))

    def prefix_bucket(self, width: int) -> int:
        """The cached-prefix width a graph is captured at (0 for none)."""
        return -(-width // self.prefix_multiple) * self.prefix_multiple if width > 0 else 0

    def bucket(self, rows: int, frames: int, width: int = 0, shared: bool = False) -> tuple[int, int] | None:
        """(padded rows, padded frames) for a batch, or None when no graph may serve it;
        `width`: the longest cached prompt prefix of its rows in frames (0 = none);
        `shared`: all rows have the same cached prefix (one voice)."""
        padded_rows, padded_frames = self.padded_rows(rows, width, shared), self.padded_frames(frames)
        return None if padded_rows is None or padded_frames is None else (padded_rows, padded_frames)

    def padded_rows(self, rows: int, width: int = 0, shared: bool = False) -> int | None:
        """The row bucket of a batch of `rows` (None: no graph for that many; `bucket`)."""
        fitting = [b for b in self.batch_buckets if b >= rows]
        if not fitting or rows < 1:
            return None
        padded_rows = min(fitting)
        if padded_rows > self.fill_free_rows and rows < self.min_fill * padded_rows:
            return None
        max_rows = self.shared_prefix_max_rows if shared else self.prefix_max_rows
        if width and (padded_rows > max_rows or self.prefix_bucket(width) > self.prefix_max_frames):
            return None
        return padded_rows

    def padded_frames(self, frames: int) -> int | None:
        """The frame bucket of a batch whose longest row has `frames` (None: too long; `bucket`)."""
        padded = -(-frames // self.frame_multiple) * self.frame_multiple
        padded = min([b for b in self.frame_buckets if frames <= b < padded], default=padded)
        return None if frames < 1 or padded > self.max_frames else padded


@dataclass
class GraphStats:
    captures: int = 0
    replays: int = 0  # solves served by a graph (or by the static buffers when capture is off)
    eager: int = 0  # solves with no bucket (too many rows or frames) or after a capture failure
    evictions: int = 0


@dataclass
class _Views:
    """The static tensors of one bucket (views into the runner's flat buffers)."""

    noise: torch.Tensor  # [R, C, T]
    mask: torch.Tensor  # [R, 1, T]
    mu: torch.Tensor  # [R, C, T]
    spks: torch.Tensor  # [R, C]
    cond: torch.Tensor  # [R, C, T]
    out: torch.Tensor  # [R, C, T]
    prefix: PrefixViews | None = None  # cached prompt prefixes (width > 0 buckets)
    context: "_ContextViews | None" = None  # the rows' rings (one-voice prefix buckets, with a context cache)


@dataclass
class _ContextViews:
    """Static tensors through which a captured one-voice solve reads and writes the rows'
    rings in the context cache's pool (`engine.flow_context_cache`), R padded rows:

    key_mask [2R, W + L]: the prompt prefix's slots, then the ring's;
    ring_rows [2R]: the pool row each row reads; reading [2R, 1, 1]: whether it reads one;
    writes [3, 2R x L / block], conv [3, 2R]: the plan's writes, padded with copies of
    its own entries (the same data to the same place again), or aimed at the scratch slot
    when it has none."""

    key_mask: torch.Tensor
    ring_rows: torch.Tensor
    reading: torch.Tensor
    writes: torch.Tensor
    conv: torch.Tensor

    def fill(self, plan: ContextPlan | None, prefix: PrefixViews, rows: int, scratch_row: int, blocks: int) -> None:
        """Copy one batch's plan in (`rows` real rows of the R; None: no row reads or keeps;
        `blocks`: the ring's blocks)."""
        width, R = prefix.key_mask.shape[1], self.ring_rows.shape[0] // 2
        self.key_mask[:, :width].copy_(prefix.key_mask)
        self.key_mask[:, width:].fill_(False)
        self.ring_rows.zero_()
        self.idle(scratch_row, blocks)
        if plan is not None:
            for half in (0, 1):  # the plan's rows [half * rows, ...) are rows [half * R, ...) here
                dst, src = slice(half * R, half * R + rows), slice(half * rows, (half + 1) * rows)
                prefix.positions[dst].copy_(plan.positions[src])
                if plan.reads:
                    self.key_mask[dst, width:].copy_(plan.ring_mask[src])
                    self.ring_rows[dst].copy_(plan.ring_rows[src])
            for entries, static in ((plan.writes, self.writes), (plan.conv, self.conv)):
                if entries is not None:
                    moved = entries.clone()
                    moved[0] = torch.where(moved[0] >= rows, moved[0] - rows + R, moved[0])
                    # Padding repeats the real entries: many writes aimed at one scratch place
                    # would queue on the same memory.
                    repeat = torch.arange(static.shape[1], device=moved.device) % moved.shape[1]
                    static.copy_(moved[:, repeat])
        self.reading.copy_(self.key_mask[:, width:].any(dim=1).view(-1, 1, 1))

    def idle(self, scratch_row: int, blocks: int) -> None:
        """Aim every write at the scratch slot (the solve then changes no utterance's ring),
        spread over its blocks."""
        dev = self.writes.device
        spread = torch.arange(self.writes.shape[1], device=dev) % (2 * blocks)
        self.writes.copy_(torch.stack((torch.zeros_like(spread), torch.zeros_like(spread), scratch_row * blocks + spread)))
        self.conv.copy_(torch.tensor([0, 0, scratch_row], device=dev).unsqueeze(1).expand_as(self.conv))

    def saved(self) -> tuple[torch.Tensor, ...]:
        return tuple(t.clone() for t in (self.writes, self.conv))

    def restore(self, saved: tuple[torch.Tensor, ...]) -> None:
        for t, s in zip((self.writes, self.conv), saved):
            t.copy_(s)

    def steps(self, prompt: list[DiTPrefix], cache: ContextCache) -> list[DiTPrefix]:
        """The prompt prefix's steps with the rings added (what a captured solve reads)."""
        keys, values, conv = cache.pool()
        out = []
        for step, p in enumerate(prompt):
            rows = self.ring_rows.shape[0]
            context = p.conv_context if p.conv_context.shape[0] == rows else per_row(p.conv_context, rows)
            context = torch.where(self.reading, conv[step].index_select(0, self.ring_rows).to(context.dtype), context)
            out.append(DiTPrefix(layer_kv=p.layer_kv, key_mask=self.key_mask, positions=p.positions,
                                 conv_context=context, shared=p.shared,
                                 ring_kv=RingKV(keys[step], values[step], self.ring_rows, cache.heads),
                                 sink=RingWriter(keys[step], values[step], conv[step], self.writes, self.conv,
                                                 cache.block)))
        return out


class FlowGraphRunner:
    """Drop-in `solver` for `CausalMaskedDiffWithDiT.decode_chunks` (see `FlowSolver`)."""

    def __init__(
        self,
        decoder: nn.Module,
        policy: GraphPolicy | None = None,
        autocast_dtype: torch.dtype | None = None,
        capture: bool | None = None,
        context: ContextCache | None = None,
    ) -> None:
        self.decoder = decoder  # a CausalConditionalCFM (has .solve and .rand_noise)
        # With a context cache each one-voice prefix shape has a second graph that also
        # reads and writes the rows' rings, for the batches with a plan; the others (every
        # first chunk: nothing to read or keep) replay the plain one and pay nothing for it.
        self.context = context
        self.policy = policy or GraphPolicy()
        self.autocast_dtype = autocast_dtype
        self.device = decoder.rand_noise.device
        self.capture = (self.device.type == "cuda") if capture is None else capture
        if self.capture and self.device.type != "cuda":
            raise ValueError("CUDA graph capture needs the decoder on a CUDA device")
        if self.policy.max_graphs < 1:
            raise ValueError("GraphPolicy.max_graphs must be at least 1")
        self.stats = GraphStats()
        self._channels = int(decoder.rand_noise.shape[1])
        self._flat: dict[str, torch.Tensor] = {}
        self._graphs: OrderedDict[tuple[int, int, bool, int, bool, bool], object] = OrderedDict()
        self._prefix: dict[bool, PrefixBuffers] = {}  # by `shared`
        self._context_flat: dict[str, torch.Tensor] = {}
        # Kinds whose allocation failed (out of memory): their prefix batches run eagerly.
        self._no_prefix_buffers: set[bool] = set()
        self._pool: object | None = None
        self._stream: torch.cuda.Stream | None = None  # warm-up and capture stream (CUDA only)
        self._broken = False  # a capture failed: run eagerly from then on

    # ------------------------------------------------------------------ public
    def padded_shape(self, rows: int, frames: int, width: int = 0, shared: bool = False) -> tuple[int, int]:
        """The shape a batch of `rows` x `frames` is solved at (itself when no bucket fits)."""
        return self.plan(rows, frames, width, shared)[0] or (rows, frames)

    def plan(self, rows: int, frames: int, width: int = 0, shared: bool = False,
             dtype: torch.dtype | None = None) -> tuple[tuple[int, int] | None, bool]:
        """The graph bucket for a batch (None: it runs eagerly) and whether it uses the
        one-voice prefix buffers: those when the batch has one voice (`shared`) and a bucket
        and the buffers are there for it, else the per-row ones. `dtype`: of the cached keys
        and values (default: the flow's)."""
        if self._broken:  # eager from now on, at the batch's own size, not a bucket's
            return None, False
        dtype = dtype or self.autocast_dtype or self.decoder.rand_noise.dtype
        if width and shared:
            shape = self.policy.bucket(rows, frames, width, shared=True)
            if shape is not None and self._prefix_buffers(dtype, True) is not None:
                return shape, True
        shape = self.policy.bucket(rows, frames, width)
        if width and shape is not None and self._prefix_buffers(dtype, False) is None:
            shape = None
        return shape, False

    def carries(self, shape: tuple[int, int] | None, shared: bool) -> bool:
        """Whether a batch solved at this plan (`plan`'s result) can read and keep rings:
        eagerly, or in a one-voice prefix graph when this runner has a context cache."""
        return shape is None or (shared and self.context is not None)

    @property
    def prefix_bytes(self) -> int:
        """Memory held by the static prompt-prefix buffers (0 until a prefix batch ran)."""
        return sum(b.nbytes for b in self._prefix.values())

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    @torch.inference_mode()
    def __call__(
        self,
        noise: torch.Tensor,
        mask: torch.Tensor,
        mu: torch.Tensor,
        spks: torch.Tensor,
        cond: torch.Tensor,
        streaming: bool,
        prefix: Sequence[PromptKV | None] | None = None,
        context: ContextPlan | None = None,
    ) -> torch.Tensor:
        """Same contract as `CausalConditionalCFM.solve`: mel [B, C, T] float32. With
        `prefix` (one flow prompt cache entry or None per row, streaming only) the inputs are
        each row's frames after its cached prefix, as in `decode_with_prompt_cache`, and with
        `context` (a plan of this runner's context cache) after each row's start."""
        rows, _, frames = noise.shape
        width = prefix_width(prefix)
        shape, shared = self.plan(rows, frames, width, shared_entry(prefix) is not None,
                                  self.autocast_dtype or noise.dtype)
        if context is not None and not self.carries(shape, shared):
            shape = None  # only the one-voice graphs read rings

        def eager() -> torch.Tensor:
            self.stats.eager += 1
            steps = StepPrefixes(list(prefix), noise.device) if width else None  # type: ignore[arg-type]
            if context is not None:
                assert self.context is not None and steps is not None
                steps = self.context.prefixes(steps, context)
            with self._autocast():
                return self.decoder.solve(noise, mask, mu, spks, cond, streaming, prefix=steps)

        if shape is None or self._broken:
            return eager()
        views = self._views(*shape, dtype=noise.dtype, width=self.policy.prefix_bucket(width), shared=shared,
                            ring=context is not None)
        for dst, src in ((views.noise, noise), (views.mask, mask), (views.mu, mu), (views.spks, spks), (views.cond, cond)):
            copy_padded(dst, src)
        if views.prefix is not None:
            views.prefix.fill(prefix)  # type: ignore[arg-type]
            if views.context is not None:
                assert self.context is not None
                views.context.fill(context, views.prefix, rows, 2 * self.context.scratch, self.context.blocks)
        if not self._run(shape, views, streaming):
            return eager()
        self.stats.replays += 1
        # A copy: the next replay overwrites the static output.
        return views.out[:rows, :, :frames].clone()

    @torch.inference_mode()
    def warm(self, shapes: Iterable[tuple[int, ...]], streaming: bool = True) -> int:
        """Capture the graphs for these (rows, frames) or (rows, frames, prefix width) batch
        shapes now (e.g. at engine start, so no request pays for a capture); returns how many
        were captured. Prefix shapes are captured both for one-voice batches (`shared`; with a
        context cache also their ring kind) and, up to `prefix_max_rows`, for batches mixing
        voices. A no-op without capture."""
        if not self.capture:
            return 0
        captured, evicted = 0, self.stats.evictions
        dtype = self.decoder.rand_noise.dtype
        for rows, frames, *rest in shapes:
            width = self.policy.prefix_bucket(rest[0] if rest else 0)
            kinds = [(True, False), (False, False)] if width else [(False, False)]
            if width and self.context is not None:
                kinds.insert(1, (True, True))
            for shared, ring in kinds:
                shape, kind = self.plan(rows, frames, width, shared, self.autocast_dtype or dtype)
                if shape is None or kind != shared or (*shape, streaming, width, shared, ring) in self._graphs \
                        or self._broken:
                    continue
                if not shared and rows == 1 and self.plan(1, frames, width, True, self.autocast_dtype or dtype)[1]:
                    continue  # one row is one voice: it takes the one-voice kind, never this one
                # Zero-filled prefix buffers (finite, key mask off) serve the warm-up runs.
                views = self._views(*shape, dtype=dtype, width=width, shared=shared, ring=ring)
                if views.context is not None and views.prefix is not None:
                    assert self.context is not None  # the warm-up run writes: only to the scratch slot
                    views.context.fill(None, views.prefix, 0, 2 * self.context.scratch, self.context.blocks)
                # Inputs only need to be finite for the warm-up runs; every replay copies its own.
                for t in (views.noise, views.mu, views.spks, views.cond):
                    t.zero_()
                views.mask.fill_(1.0)
                before = self.stats.captures
                self._run(shape, views, streaming, replay=False)
                captured += self.stats.captures - before
        if self.stats.evictions > evicted:
            # Graphs warmed for earlier voices (prompt lengths) are gone again: their batches
            # capture while serving (0.5-0.8 s a round on the H200).
            log.warning("warming evicted %d flow graphs (GraphPolicy.max_graphs %d): some batches will "
                        "capture while serving", self.stats.evictions - evicted, self.policy.max_graphs)
        return captured

    # ------------------------------------------------------------------ internals
    def _autocast(self) -> contextlib.AbstractContextManager[object]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _views(self, rows: int, frames: int, dtype: torch.dtype, width: int = 0, shared: bool = False,
               ring: bool = False) -> _Views:
        """Views of the flat static buffers for one bucket; the buffers are allocated once
        at the largest bucket so captured graphs never see them move."""
        c = self._channels
        big_rows, big_frames = max(self.policy.batch_buckets), self.policy.max_frames
        if not self._flat or self._flat["noise"].dtype != dtype:
            self._graphs.clear()  # graphs point into the old buffers
            sizes = {"noise": big_rows * c * big_frames, "mu": big_rows * c * big_frames,
                     "cond": big_rows * c * big_frames, "out": big_rows * c * big_frames,
                     "mask": big_rows * big_frames, "spks": big_rows * c}
            # The output is float32 whatever the input dtype: `solve` returns float32.
            self._flat = {k: torch.zeros(n, device=self.device, dtype=dtype if k != "out" else torch.float32)
                          for k, n in sizes.items()}

        def view(name: str, *shape: int) -> torch.Tensor:
            n = 1
            for s in shape:
                n *= s
            return self._flat[name][:n].view(*shape)

        prefix = context = None
        if width:
            buffers = self._prefix_buffers(self.autocast_dtype or dtype, shared)
            assert buffers is not None  # callers check first
            prefix = buffers.views(rows, width)
            if ring and shared and self.context is not None:
                context = self._context_views(rows, width)
        return _Views(noise=view("noise", rows, c, frames), mask=view("mask", rows, 1, frames),
                      mu=view("mu", rows, c, frames), spks=view("spks", rows, c),
                      cond=view("cond", rows, c, frames), out=view("out", rows, c, frames), prefix=prefix,
                      context=context)

    def _context_views(self, rows: int, width: int) -> _ContextViews:
        """Views of the flat static context buffers (allocated once, at the largest one-voice
        bucket and prefix width) for one bucket."""
        assert self.context is not None
        ring = self.context.frames
        if not self._context_flat:
            big_rows = 2 * self.policy.shared_prefix_max_rows
            big_width = self.policy.prefix_max_frames + ring
            self._context_flat = {
                "key_mask": torch.zeros(big_rows * big_width, dtype=torch.bool, device=self.device),
                "ring_rows": torch.zeros(big_rows, dtype=torch.long, device=self.device),
                "reading": torch.zeros(big_rows, dtype=torch.bool, device=self.device),
                "writes": torch.zeros(3 * big_rows * self.context.blocks, dtype=torch.long, device=self.device),
                "conv": torch.zeros(3 * big_rows, dtype=torch.long, device=self.device),
            }
            self.context.pool()  # before any capture: the graphs address it

        def view(name: str, *shape: int) -> torch.Tensor:
            return self._context_flat[name][: math.prod(shape)].view(*shape)

        return _ContextViews(key_mask=view("key_mask", 2 * rows, width + ring), ring_rows=view("ring_rows", 2 * rows),
                             reading=view("reading", 2 * rows, 1, 1), writes=view("writes", 3, 2 * rows * self.context.blocks),
                             conv=view("conv", 3, 2 * rows))

    def _prefix_buffers(self, dtype: torch.dtype, shared: bool) -> PrefixBuffers | None:
        """The static prompt-prefix buffers of one kind (per row, or one voice for all rows;
        allocated on first use, in the cached K/V's dtype), or None when they do not fit
        in memory: those prefix batches then run eagerly."""
        if shared not in self._prefix and shared not in self._no_prefix_buffers:
            rows = self.policy.shared_prefix_max_rows if shared else self.policy.prefix_max_rows
            try:
                self._prefix[shared] = PrefixBuffers(self.decoder.estimator, self.decoder.n_timesteps, rows,
                                                     self.policy.prefix_max_frames, self.device, dtype, shared)
            except torch.OutOfMemoryError:
                log.warning("no memory for the flow's prompt-prefix graph buffers (%d rows x %d frames%s); "
                            "those cached-prefix batches run eagerly", rows, self.policy.prefix_max_frames,
                            ", one voice" if shared else "")
                self._no_prefix_buffers.add(shared)
        return self._prefix.get(shared)

    def _solve_into(self, views: _Views, streaming: bool) -> None:
        steps = None if views.prefix is None else views.prefix.steps()
        if steps is not None and views.context is not None:
            assert self.context is not None
            steps = views.context.steps(steps, self.context)
        x = self.decoder.solve(views.noise, views.mask, views.mu, views.spks, views.cond, streaming, prefix=steps)
        views.out.copy_(x)

    def _run(self, shape: tuple[int, int], views: _Views, streaming: bool, replay: bool = True) -> bool:
        """Fill views.out for the inputs already in the static buffers; False = not done
        (capture failed), the caller solves eagerly."""
        if not self.capture:
            with self._autocast():
                self._solve_into(views, streaming)
            return True
        # Capture and replay on the decoder's device (a stage on cuda:1 runs its worker
        # thread with cuda:0 current otherwise).
        on_device = torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()
        with on_device:
            prefix = views.prefix
            key = (*shape, streaming, 0 if prefix is None else prefix.key_mask.shape[1],
                   prefix is not None and prefix.shared, views.context is not None)
            graph = self._graphs.get(key)
            if graph is None:
                # The warm-up run before a capture executes the solve, and the replay runs it
                # again: its ring writes would land twice, the second time over frames the
                # replay reads. So the capture writes to the scratch slot only.
                context = views.context
                saved = None
                if context is not None:
                    assert self.context is not None
                    saved = context.saved()
                    context.idle(2 * self.context.scratch, self.context.blocks)
                try:
                    with CAPTURE_LOCK:
                        graph = self._capture(views, streaming)
                except Exception:  # a capture problem must not take the stage down
                    log.exception("CUDA graph capture failed for %s; the flow runs eagerly from now on", key)
                    self._broken = True
                    self._graphs.clear()
                    return False
                finally:
                    if context is not None and saved is not None:
                        context.restore(saved)
                self._graphs[key] = graph
                self.stats.captures += 1
                while len(self._graphs) > self.policy.max_graphs:
                    self._graphs.popitem(last=False)
                    self.stats.evictions += 1
            self._graphs.move_to_end(key)
            if replay:
                graph.replay()  # type: ignore[attr-defined]
        return True

    def _capture(self, views: _Views, streaming: bool) -> object:
        """Warm up on a side stream, then capture one solve into a new graph (on this
        runner's own capture stream and shared pool, both on the decoder's device)."""
        current = torch.cuda.current_stream(self.device)
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
            self._pool = torch.cuda.graph_pool_handle()
        side = self._stream
        side.wait_stream(current)
        with torch.cuda.stream(side), self._autocast():
            for _ in range(self.policy.warmup_iters):
                self._solve_into(views, streaming)
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        torch.clear_autocast_cache()
        try:
            with self._autocast():
                # thread_local: the LM backend may use the GPU from other threads meanwhile.
                with torch.cuda.graph(graph, pool=self._pool, stream=side, capture_error_mode="thread_local"):
                    self._solve_into(views, streaming)
        finally:
            torch.clear_autocast_cache()
        return graph


def prompt_shapes(
    prompt_tokens: int,
    hops: Iterable[int],
    left_context: int = 50,
    rows: Iterable[int] = BATCH_BUCKETS,
    block: int = 25,
    ratio: int = 2,
) -> list[tuple[int, int]]:
    """Batch shapes the engine's chunks of one voice produce, to `warm` at start.

    A chunk's flow window is prompt + left context + hop tokens (the lookahead makes no
    frames). The context is everything before the chunk until it reaches `left_context`
    tokens, then, because the engine starts the window on a whole `block`, anywhere in
    [left_context, left_context + block); so a voice meets these frame counts, for every
    row bucket.
    """
    frames = set()
    for hop in hops:
        frames.add(ratio * (prompt_tokens + hop))  # first chunk: no context yet
        if left_context >= 0:
            for ctx in range(1, left_context + block):
                frames.add(ratio * (prompt_tokens + ctx + hop))
    return [(r, f) for r in rows for f in sorted(frames)]


def iter_shapes(rows: Iterable[int], frames: Iterable[int]) -> Iterator[tuple[int, int]]:
    """All (rows, frames) pairs, for `FlowGraphRunner.warm`."""
    frames = list(frames)
    for r in rows:
        for f in frames:
            yield r, f
