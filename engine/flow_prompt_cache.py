"""Cache of a voice prompt's DiT keys/values for the CosyVoice3 flow (issue #12; on by
default, `engine.flow_prompt_cache`).

Every streaming chunk re-runs the flow's ODE over prompt + left context + new frames,
and the prompt is usually the larger part. With block-causal (streaming) attention most
of the prompt's work is the same in every chunk of every utterance of a voice:

* the DiT's attention is block-causal over 50-frame blocks counted from frame 0 (the
  prompt comes first), its position convolutions are causal, everything else works
  frame by frame, and so does the Euler update;
* a prompt frame's inputs are the prompt mel (`cond`), the fixed noise column of the same
  index (no noise offset inside the prompt), the speaker vector and the flow time, and
  `mu`, which for token j reads tokens j-2 .. j+3 (the lookahead layer). So the frames of
  prompt tokens 0 .. P-4 depend on the prompt alone.

Hence for the first C = 50 * floor(2 (P - 3) / 50) frames (whole blocks of prompt-only
frames) every Euler step, CFG row and DiT block sees the same hidden states, keys and
values in every chunk of that voice. `PromptKV` records them once (an ordinary DiT run
over those C frames with a `DiTRecord` per step); `decode_with_prompt_cache` then runs the
ODE over frames [C, T) only, with the cached keys/values prepended in every attention and
the last 60 frames of the input projection before C fed to the position convolutions
(`DiTPrefix`). Rotary angles are absolute (cached keys were rotated at their own
positions) and C is a whole number of blocks, so the block-causal rule carries over
unchanged. Rows without an entry (prompts too short for one block: C = 0) simply run
from frame 0 in the same batch.

Memory: steps x 2 CFG rows x layers x (K + V) x dim per cached frame, 1.8 MB per frame
at full size in bf16 (10 x 2 x 22 x 2 x 1024 x 2 bytes; a 106-token prompt caches 200
frames, 360 MB); `PromptCache` bounds the total with LRU eviction. One cache per audio stage (entries live on its device, in its flow
dtype), used only from the stage's worker thread.

One voice per batch (the usual case): its prefix is passed once per CFG half
(`DiTPrefix.shared`) and broadcast to the rows inside the compiled attention, so no
per-row copy of it is made (those copies were 6% of a loaded stage's kernel time on the
H200, round 6). Batches mixing voices, or rows without an entry, get per-row prefixes.

CUDA graphs: a captured solve cannot follow per-batch Python lists of tensors, so
`PrefixBuffers` gives the cached prefixes a fixed address: the graph runner
(`engine.flow_graphs`) copies the batch's entries in before each replay and the captured
attention reads them from there. A one-voice batch needs one copy of its voice (~0.36 GB
for a 4 s prompt, whatever the rows); a mixed batch one per row and CFG half.
"""

from __future__ import annotations

import hashlib
import logging
import math
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Collection, Protocol, Sequence

import torch

from .device_copy import tensor_on
from .ragged import row_ranges
from .models.dit import CONV_CONTEXT, DiT, DiTPrefix, DiTRecord
from .models.flow import CausalMaskedDiffWithDiT, FlowBatchShape, FlowChunk

log = logging.getLogger(__name__)

DEFAULT_BUDGET_BYTES = 4 << 30


def cacheable_frames(num_prompt_tokens: int, token_mel_ratio: int, lookahead: int, block: int) -> int:
    """C: the whole attention blocks of frames whose inputs come from the prompt alone
    (tokens 0 .. P - lookahead - 1, whose lookahead stays inside the prompt)."""
    prompt_only = token_mel_ratio * max(0, num_prompt_tokens - lookahead)
    return block * (prompt_only // block)


@dataclass
class PromptKV:
    """One voice's cached prefix: frames [0, frames) at every Euler step.

    keys, values: [steps, layers, 2, heads, frames, dim_head] (CFG row 0 = conditional,
                  1 = unconditional), keys already rotated at their positions.
    conv_context: [steps, 2, CONV_CONTEXT, dim], the input projection over frames
                  [frames - 60, frames) (zeros before frame 0).
    """

    frames: int
    keys: torch.Tensor
    values: torch.Tensor
    conv_context: torch.Tensor

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.conv_context))


def supports_prompt_cache(flow: torch.nn.Module) -> bool:
    """Only the CosyVoice3 flow (DiT estimator) has the block structure the cache needs."""
    estimator = getattr(getattr(flow, "decoder", None), "estimator", None)
    return isinstance(flow, CausalMaskedDiffWithDiT) and isinstance(estimator, DiT)


def prompt_frames(flow: CausalMaskedDiffWithDiT, chunk: FlowChunk) -> int:
    """C for this chunk's prompt (0: nothing to cache)."""
    return cacheable_frames(chunk.num_prompt_tokens, flow.token_mel_ratio, flow.pre_lookahead_len,
                            flow.decoder.estimator.static_chunk_size)


@torch.inference_mode()
def build_prompt_kv(flow: CausalMaskedDiffWithDiT, chunk: FlowChunk) -> PromptKV | None:
    """Run the ODE over the prompt's first C frames once and keep what later chunks need
    (in the flow's dtype, which the cached tensors keep)."""
    frames = prompt_frames(flow, chunk)
    if frames == 0:
        return None
    p = chunk.num_prompt_tokens
    # The prompt alone, its last `lookahead` tokens as right context: frames
    # [0, 2 (P - 3)) >= C, computed exactly as inside any chunk of this voice.
    prompt = FlowChunk(tokens=chunk.tokens[:p], prompt_feat=chunk.prompt_feat, embedding=chunk.embedding,
                       num_prompt_tokens=p, out_start=p, finalize=False)
    inputs = flow.prepare_batch([prompt], streaming=True)

    def head(t: torch.Tensor) -> torch.Tensor:
        return t[..., :frames].contiguous()

    steps: list[DiTRecord] = []
    flow.decoder.solve(head(inputs.noise), head(inputs.mask), head(inputs.mu), inputs.spks, head(inputs.cond),
                       True, record=steps)
    return PromptKV(
        frames=frames,
        keys=torch.stack([torch.stack(r.keys) for r in steps]),
        values=torch.stack([torch.stack(r.values) for r in steps]),
        conv_context=torch.stack([r.conv_context for r in steps if r.conv_context is not None]),
    )


def shared_entry(entries: Sequence[PromptKV | None] | None) -> PromptKV | None:
    """The entry every row of the batch has (one voice, all rows cached), else None."""
    if not entries or entries[0] is None or any(e is not entries[0] for e in entries):
        return None
    return entries[0]


class StepPrefixes:
    """`DiTPrefix` of each Euler step for one batch, built when the solver asks for it.

    Row layout follows the solver's CFG doubling: rows [0, B) conditional, [B, 2B)
    unconditional. One shared entry is handed over as it is (`DiTPrefix.shared`);
    otherwise cached keys are padded to the batch's largest C with key mask False, one
    layer at a time (`_LayerKV`: only the block being run holds its padded copy).
    """

    def __init__(self, entries: list[PromptKV | None], device: torch.device) -> None:
        self.entries = entries
        self.batch = len(entries)
        self.shared = shared_entry(entries)
        starts = [0 if e is None else e.frames for e in entries]
        self.width = max(starts)
        # Rows sharing an entry (one voice) are filled together: by broadcast slice copies
        # when they form a few runs (the usual case), else by one indexed copy per CFG half.
        # (The indexed copy was 10% of the GPU time of a loaded stage on the H200.)
        groups: dict[int, tuple[PromptKV, list[int]]] = {}
        for i, e in enumerate(entries):
            if e is not None:
                groups.setdefault(id(e), (e, []))[1].append(i)
        self.groups = [(e, _row_selectors(rows, 0, device), _row_selectors(rows, self.batch, device))
                       for e, rows in groups.values()]
        self.ragged = any(s < self.width for s in starts)
        c = tensor_on(starts, torch.long, device)
        self.positions = torch.cat((c, c))
        self.key_mask = torch.arange(self.width, device=device).unsqueeze(0) < self.positions.unsqueeze(1)
        some = self.groups[0][0]
        self.n_steps, self.n_layers = some.keys.shape[0], some.keys.shape[1]

    def __len__(self) -> int:
        return self.n_steps

    def __getitem__(self, step: int) -> DiTPrefix:
        e = self.shared
        if e is not None:
            return DiTPrefix(layer_kv=[(e.keys[step, layer], e.values[step, layer]) for layer in range(self.n_layers)],
                             key_mask=self.key_mask, positions=self.positions, conv_context=e.conv_context[step],
                             shared=True)
        some = self.groups[0][0].conv_context
        context = some.new_zeros(2 * self.batch, CONV_CONTEXT, some.shape[-1])
        for e, cond_rows, uncond_rows in self.groups:
            for rows in cond_rows:
                context[rows] = e.conv_context[step, 0]
            for rows in uncond_rows:
                context[rows] = e.conv_context[step, 1]
        return DiTPrefix(layer_kv=_LayerKV(self, step), key_mask=self.key_mask, positions=self.positions,
                         conv_context=context)

    def padded(self, step: int, layer: int, which: str) -> torch.Tensor:
        """All rows' cached keys or values of one step and layer, [2B, H, width, dh]."""
        some = getattr(self.groups[0][0], which)
        _, _, _, heads, _, dim = some.shape
        # Zeros under the key mask where rows' prefixes are shorter: a masked value must
        # still be finite (0 x NaN would poison the attention output).
        alloc = torch.zeros if self.ragged else torch.empty
        out = alloc(2 * self.batch, heads, self.width, dim, dtype=some.dtype, device=some.device)
        for e, cond_rows, uncond_rows in self.groups:
            cached = getattr(e, which)[step, layer]  # [2, H, C, dh]
            for rows in cond_rows:
                out[rows, :, : e.frames] = cached[0]
            for rows in uncond_rows:
                out[rows, :, : e.frames] = cached[1]
        return out


MAX_SLICE_RUNS = 4


def _row_selectors(rows: list[int], offset: int, device: torch.device) -> list[slice | torch.Tensor]:
    """How to address `rows` (+ `offset`) of a batch tensor: one slice per contiguous run
    when there are at most MAX_SLICE_RUNS of them, else one index tensor."""
    runs: list[list[int]] = []
    for r in rows:
        if runs and runs[-1][1] == r:
            runs[-1][1] = r + 1
        else:
            runs.append([r, r + 1])
    if len(runs) <= MAX_SLICE_RUNS:
        return [slice(a + offset, b + offset) for a, b in runs]
    return [tensor_on(rows, torch.long, device) + offset]


class _LayerKV(Sequence[tuple[torch.Tensor, torch.Tensor]]):
    """`DiTPrefix.layer_kv` of one step, padded on demand (one layer's copy alive at a time)."""

    def __init__(self, prefixes: StepPrefixes, step: int) -> None:
        self.prefixes, self.step = prefixes, step

    def __len__(self) -> int:
        return self.prefixes.n_layers

    def __getitem__(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        p = self.prefixes
        return p.padded(self.step, layer, "keys"), p.padded(self.step, layer, "values")


def prefix_width(entries: Sequence[PromptKV | None] | None) -> int:
    """The batch's longest cached prefix in frames (0: nothing cached)."""
    return max((e.frames for e in entries or () if e is not None), default=0)


@dataclass
class PrefixViews:
    """Fixed-address home of one batch's cached prefixes (views of `PrefixBuffers`), so a
    CUDA graph captured over them replays with whatever batch was copied in last.

    keys, values: [steps, layers, 2R, heads, W, dim_head] (rows [0, R) conditional,
                  [R, 2R) unconditional), or [steps, layers, 2, heads, W, dim_head] when
                  `shared` (one voice for every row, see `DiTPrefix.shared`);
    key_mask [2R, W]; positions [2R]; conv_context [steps, 2R (shared: 2), CONV_CONTEXT, dim].
    """

    keys: torch.Tensor
    values: torch.Tensor
    key_mask: torch.Tensor
    positions: torch.Tensor
    conv_context: torch.Tensor
    shared: bool = False

    def fill(self, entries: Sequence[PromptKV | None]) -> None:
        """Copy the batch's entries in (rows past len(entries) get none, or the shared
        entry). Slots past a row's C keep older finite values: the key mask hides them."""
        rows = self.key_mask.shape[0] // 2
        if len(entries) > rows:
            raise ValueError(f"{len(entries)} entries for {rows} prefix rows")
        if self.shared:
            self._fill_shared(entries)
            return
        self.conv_context.zero_()
        starts = [0] * rows
        for i, e in enumerate(entries):
            if e is None:
                continue
            if e.frames > self.keys.shape[4]:
                raise ValueError(f"prefix of {e.frames} frames exceeds the buffer's {self.keys.shape[4]}")
            starts[i] = e.frames
            for dst, src in ((self.keys, e.keys), (self.values, e.values)):
                dst[:, :, i, :, : e.frames].copy_(src[:, :, 0])
                dst[:, :, rows + i, :, : e.frames].copy_(src[:, :, 1])
            self.conv_context[:, i].copy_(e.conv_context[:, 0])
            self.conv_context[:, rows + i].copy_(e.conv_context[:, 1])
        # Built on the device from a pinned copy: a copy from pageable host memory made the
        # host wait for the GPU before every small-batch replay (bench.stage_syncs, H200).
        device = self.positions.device
        c = tensor_on(starts + starts, torch.long, device)
        self.positions.copy_(c)
        self.key_mask.copy_(torch.arange(self.key_mask.shape[1], device=device).unsqueeze(0) < c.unsqueeze(1))

    def _fill_shared(self, entries: Sequence[PromptKV | None]) -> None:
        e = shared_entry(entries)
        if e is None:
            raise ValueError("shared prefix buffers take a batch of one voice, every row cached")
        if e.frames > self.keys.shape[4]:
            raise ValueError(f"prefix of {e.frames} frames exceeds the buffer's {self.keys.shape[4]}")
        self.keys[:, :, :, :, : e.frames].copy_(e.keys)
        self.values[:, :, :, :, : e.frames].copy_(e.values)
        self.conv_context.copy_(e.conv_context)
        # Padding rows get the voice too: their outputs are dropped, and a finite prefix
        # keeps their attention finite.
        self.positions.fill_(e.frames)
        device = self.positions.device
        self.key_mask.copy_((torch.arange(self.key_mask.shape[1], device=device) < e.frames).expand_as(self.key_mask))

    def steps(self) -> list[DiTPrefix]:
        """One `DiTPrefix` per Euler step over these buffers (what a captured solve reads)."""
        return [DiTPrefix(layer_kv=[(self.keys[step, layer], self.values[step, layer])
                                    for layer in range(self.keys.shape[1])],
                          key_mask=self.key_mask, positions=self.positions, conv_context=self.conv_context[step],
                          shared=self.shared)
                for step in range(self.keys.shape[0])]


class PrefixBuffers:
    """Flat static tensors sized for `max_rows` chunks x `max_frames` cached frames, from
    which `views` cuts every (rows, width) bucket (allocated once: captured graphs must
    never see them move). Memory: 2 x steps x 2 x layers x heads x dim_head per row and
    frame, 1.8 MB at full size in bf16, so 8 rows x 300 frames take 4.3 GB. `shared`
    buffers hold one voice for all rows (`PrefixViews.shared`): 0.54 GB for 300 frames,
    whatever `max_rows`."""

    def __init__(self, dit: DiT, steps: int, max_rows: int, max_frames: int,
                 device: torch.device, dtype: torch.dtype, shared: bool = False) -> None:
        attn = dit.transformer_blocks[0].attn
        self.shape = (steps, len(dit.transformer_blocks), attn.heads, attn.dim_head)
        self.dim = attn.heads * attn.dim_head
        self.max_rows, self.max_frames, self.shared = max_rows, max_frames, shared
        kv_rows = 1 if shared else max_rows
        n_kv = steps * self.shape[1] * 2 * kv_rows * attn.heads * max_frames * attn.dim_head
        self._keys = torch.zeros(n_kv, device=device, dtype=dtype)
        self._values = torch.zeros(n_kv, device=device, dtype=dtype)
        self._mask = torch.zeros(2 * max_rows * max_frames, device=device, dtype=torch.bool)
        self._positions = torch.zeros(2 * max_rows, device=device, dtype=torch.long)
        self._conv = torch.zeros(steps * 2 * kv_rows * CONV_CONTEXT * self.dim, device=device, dtype=dtype)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self._keys, self._values, self._mask, self._conv))

    def views(self, rows: int, width: int) -> PrefixViews:
        if rows > self.max_rows or width > self.max_frames:
            raise ValueError(f"prefix bucket {rows} x {width} exceeds {self.max_rows} x {self.max_frames}")
        steps, layers, heads, dh = self.shape

        def cut(flat: torch.Tensor, *shape: int) -> torch.Tensor:
            return flat[: math.prod(shape)].view(*shape)

        kv_rows = 2 if self.shared else 2 * rows
        return PrefixViews(keys=cut(self._keys, steps, layers, kv_rows, heads, width, dh),
                           values=cut(self._values, steps, layers, kv_rows, heads, width, dh),
                           key_mask=cut(self._mask, 2 * rows, width), positions=cut(self._positions, 2 * rows),
                           conv_context=cut(self._conv, steps, kv_rows, CONV_CONTEXT, self.dim), shared=self.shared)


@torch.inference_mode()
def decode_with_prompt_cache(
    flow: CausalMaskedDiffWithDiT, chunks: list[FlowChunk], entries: list[PromptKV | None],
    solver: PrefixSolver | None = None,
) -> tuple[list[torch.Tensor], FlowBatchShape]:
    """Same frames as `flow.decode_chunks(chunks, streaming=True)`, computing only frames
    [C_i, T_i) of each row (C_i = entries[i].frames, 0 for None). The shape returned is
    the one the ODE ran at: rows x the longest row's new frames, or the solver's padded
    shape (`solver`: e.g. the CUDA-graph runner, which takes the entries itself)."""
    if not chunks:
        return [], FlowBatchShape(0, 0, 0)
    check_entries(flow, chunks, entries)
    if all(e is None for e in entries):
        return flow.decode_chunks(chunks, streaming=True, solver=solver)
    starts = [0 if e is None else e.frames for e in entries]
    if solver is None:
        return run_from(flow, chunks, starts, StepPrefixes(entries, flow.input_embedding.weight.device))
    args, frames, length = shifted_inputs(flow, chunks, starts)
    mel = solver(*args, prefix=entries)
    shape = FlowBatchShape(*solver.padded_shape(len(chunks), length, prefix_width(entries),
                                                shared_entry(entries) is not None), length)
    return outputs(flow, chunks, starts, frames, mel), shape


def check_entries(flow: CausalMaskedDiffWithDiT, chunks: list[FlowChunk], entries: Sequence[PromptKV | None]) -> None:
    """Refuse entries that do not belong to their chunks, and chunks with no output frames."""
    if len(entries) != len(chunks):
        raise ValueError("one prompt cache entry (or None) per chunk")
    for c, e in zip(chunks, entries):
        n = len(c.tokens) - (0 if c.finalize else flow.pre_lookahead_len)
        if not c.num_prompt_tokens <= c.out_start <= n:
            raise ValueError(f"out_start {c.out_start} outside [{c.num_prompt_tokens}, {n}]")
        if e is not None and e.frames != prompt_frames(flow, c):
            raise ValueError("prompt cache entry does not match the chunk's prompt length")


def shifted_inputs(flow: CausalMaskedDiffWithDiT, chunks: list[FlowChunk],
                    starts: list[int]) -> tuple[tuple[object, ...], list[int], int]:
    """The solver's inputs for rows that begin at window frame starts[i]: row i's frames
    [s_i, T_i) shifted to the front; padding past each row's end gets mask 0 and zero
    inputs, exactly like ordinary batch padding. Also each row's window frames and the
    shifted length."""
    inputs = flow.prepare_batch(chunks, streaming=True)
    device, t_full = inputs.noise.device, inputs.noise.shape[2]
    new_frames = [f - s for f, s in zip(inputs.frames, starts)]
    length = max(new_frames)
    offsets = torch.arange(length, device=device).unsqueeze(0)
    index = (tensor_on(starts, torch.long, device).unsqueeze(1) + offsets).clamp(max=t_full - 1)
    valid = (offsets < tensor_on(new_frames, torch.long, device).unsqueeze(1)).to(inputs.mask.dtype)

    def shift(t: torch.Tensor) -> torch.Tensor:
        picked = t.gather(2, index.unsqueeze(1).expand(-1, t.shape[1], -1))
        return picked * valid.unsqueeze(1)

    args = (shift(inputs.noise), valid.unsqueeze(1), shift(inputs.mu), inputs.spks, shift(inputs.cond), True)
    return args, inputs.frames, length


def outputs(flow: CausalMaskedDiffWithDiT, chunks: list[FlowChunk], starts: list[int], frames: list[int],
             mel: torch.Tensor) -> list[torch.Tensor]:
    ratio = flow.token_mel_ratio
    first = [ratio * c.out_start - s for c, s in zip(chunks, starts)]
    # [n_i, 80] each, from one split (not three operator calls a row: `engine.ragged`).
    return row_ranges(mel.transpose(1, 2), first, [f - s - a for s, f, a in zip(starts, frames, first)])


@torch.inference_mode()
def run_from(flow: CausalMaskedDiffWithDiT, chunks: list[FlowChunk], starts: list[int],
             prefix: Sequence[DiTPrefix]) -> tuple[list[torch.Tensor], FlowBatchShape]:
    """Decode the chunks eagerly, row i's ODE over window frames [starts[i], T_i) with
    `prefix[step]` standing for the frames before (its positions say where each row
    begins)."""
    for c, s in zip(chunks, starts):
        if s > flow.token_mel_ratio * c.out_start:
            raise ValueError(f"a row starting at frame {s} would skip output frames")
    args, frames, length = shifted_inputs(flow, chunks, starts)
    mel = flow.decoder.solve(*args, prefix=prefix)
    return outputs(flow, chunks, starts, frames, mel), FlowBatchShape(len(chunks), length, length)


class PrefixSolver(Protocol):
    """A `FlowSolver` that also takes the batch's prompt cache entries (the graph runner)."""

    def padded_shape(self, rows: int, frames: int, width: int = 0, shared: bool = False) -> tuple[int, int]: ...

    def __call__(self, noise: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, spks: torch.Tensor,
                 cond: torch.Tensor, streaming: bool,
                 prefix: Sequence[PromptKV | None] | None = None) -> torch.Tensor: ...


@dataclass
class PromptCacheStats:
    hits: int = 0  # chunks decoded from a cached prefix
    builds: int = 0
    evictions: int = 0
    too_large: int = 0  # entries bigger than the whole budget (not kept, not used)


class PromptCache:
    """Bounded LRU of `PromptKV` by voice prompt content (tokens, mel, speaker vector).

    Keys are content digests, so every `VoicePrompt` object of one voice finds the same
    entry; the digest of a prompt mel tensor is remembered per live tensor object, so a
    chunk costs hashing only its few hundred prompt tokens and the speaker vector."""

    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        if budget_bytes < 0:
            raise ValueError("budget_bytes must be >= 0")
        self.budget_bytes = budget_bytes
        self.stats = PromptCacheStats()
        # The fewest prefix frames of an entry refused for the budget (an entry's size grows
        # with its frames): prompts that long or longer decode without the cache. Written on
        # the worker thread; the stage's event loop reads it (`AudioStage._padding_rooms`).
        self.refused_frames: int | None = None
        self._entries: OrderedDict[bytes, PromptKV] = OrderedDict()
        # Their bytes, kept as entries come and go: the stage's event loop reads `nbytes`
        # while the worker thread may be inserting or evicting (iterating the entries there
        # raised "OrderedDict mutated during iteration" and ended the stage's loop).
        self._bytes = 0
        self._digests: dict[int, tuple[weakref.ref[torch.Tensor], bytes]] = {}

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def key(self, chunk: FlowChunk) -> bytes:
        """The voice's identity: its prompt mel, prompt tokens and speaker embedding. Asked
        for every chunk of every batch, so it makes few operator calls: the mel's and the
        embedding's digests are remembered per tensor (a voice's chunks share them), and the
        tokens are read through numpy (a batch of 64 chunks made ~1100 calls here before
        round 17 of docs/benchmarks.md)."""
        p = chunk.num_prompt_tokens
        h = hashlib.blake2b(digest_size=16)
        h.update(self._digest(chunk.prompt_feat))
        tokens = chunk.tokens
        if tokens.device.type == "cpu" and tokens.dtype == torch.long and tokens.dim() == 1:
            h.update(tokens.numpy()[:p].tobytes())
        else:
            h.update(_tensor_bytes(tokens.reshape(-1)[:p].to(torch.long)))
        h.update(self._digest(chunk.embedding))
        return h.digest()

    def _digest(self, t: torch.Tensor) -> bytes:
        """Digest of a tensor's values as float32, remembered while the tensor lives."""
        known = self._digests.get(id(t))
        if known is not None and known[0]() is t:
            return known[1]
        digest = hashlib.blake2b(_tensor_bytes(t.reshape(-1).float()), digest_size=16).digest()
        key = id(t)
        # Forget the digest with its tensor (before the id can be reused).
        ref = weakref.ref(t, lambda _r, k=key, d=self._digests: d.pop(k, None))
        self._digests[key] = (ref, digest)
        return digest

    def get(self, chunk: FlowChunk) -> PromptKV | None:
        key = self.key(chunk)
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def get_or_build(self, flow: CausalMaskedDiffWithDiT, chunk: FlowChunk) -> PromptKV | None:
        """The chunk's entry, built (and the least recently used ones evicted) if missing;
        None when its prompt has no whole block to cache or the entry exceeds the budget."""
        key = self._cacheable_key(flow, chunk)
        return None if key is None else self._get_or_build(flow, chunk, key, ())

    def _cacheable_key(self, flow: CausalMaskedDiffWithDiT, chunk: FlowChunk) -> bytes | None:
        frames = prompt_frames(flow, chunk)
        if frames == 0 or (self.refused_frames is not None and frames >= self.refused_frames):
            return None  # nothing to cache, or an entry this long was already too large
        return self.key(chunk)

    def _get_or_build(self, flow: CausalMaskedDiffWithDiT, chunk: FlowChunk, key: bytes,
                      pinned: Collection[bytes]) -> PromptKV | None:
        """`get_or_build` of a chunk whose key is known; `pinned`: the keys of entries its
        batch uses already, which are not evicted for it (a batch holds them whatever the
        cache does, so evicting them freed nothing and rebuilt them for its later rows)."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            return entry
        entry = build_prompt_kv(flow, chunk)
        if entry is None:
            return None
        self.stats.builds += 1
        if entry.nbytes > self.budget_bytes:
            self.stats.too_large += 1
            self.refused_frames = min(entry.frames, self.refused_frames or entry.frames)
            log.warning("flow prompt cache entry of %d bytes exceeds the budget (%d); not cached",
                        entry.nbytes, self.budget_bytes)
            return None
        self._entries[key] = entry
        self._bytes += entry.nbytes
        for old_key in list(self._entries):  # least recently used first
            if self._bytes <= self.budget_bytes:
                break
            if old_key != key and old_key not in pinned:
                self._bytes -= self._entries.pop(old_key).nbytes
                self.stats.evictions += 1
        if self._bytes > self.budget_bytes:
            # The batch's own entries fill the budget: this one serves the batch and goes.
            self._bytes -= self._entries.pop(key).nbytes
        return entry

    def entries_for(self, flow: CausalMaskedDiffWithDiT, chunks: list[FlowChunk],
                    count_hits: bool = True) -> list[PromptKV | None]:
        """Per chunk its entry (built when missing) or None; counts the hits unless told
        not to (the caller may decide not to use them: `count`)."""
        # One entry per voice of the batch, all of them kept while it is resolved: a batch of
        # more voices than the budget holds had evicted, for a later row, the entry an
        # earlier row had got, and built it again for its voice's next row (a batch of 12
        # rows and 3 voices over a budget of 2: 12 builds, 6x the budget held).
        resolved: dict[bytes, PromptKV | None] = {}
        found: list[PromptKV | None] = []
        for chunk in chunks:
            key = self._cacheable_key(flow, chunk)
            if key is not None and key not in resolved:
                resolved[key] = self._get_or_build(flow, chunk, key, resolved.keys())
            found.append(None if key is None else resolved[key])
        if count_hits:
            self.count(found)
        return found

    def count(self, entries: Sequence[PromptKV | None]) -> None:
        """Record that these entries served a batch."""
        self.stats.hits += sum(e is not None for e in entries)


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().cpu().numpy().tobytes()
