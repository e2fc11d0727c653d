"""The GPU stage: speech tokens -> mel (flow) -> 24 kHz PCM (vocoder), batched across sessions.

Every scheduling step takes the ready chunks of *all* utterances (first chunks first,
or by playback deadline: see `deadline_batch`), runs them through one flow batch and
one vocoder batch, and resolves each chunk's future. One utterance has at most one
chunk in flight (its chunker awaits the result), so the vocoder's per-utterance
stream state is always advanced in order.

The stage runs its tensor work on one dedicated worker thread, so the event loop
never blocks on it and the LM backend (its own thread or process) overlaps with it.

On CUDA the flow runs in bf16 by default (`flow_dtype`): its weights are cast once and
every activation stays bf16, like the official code's fp16 flow. (Autocast, used before,
kept the DiT's LayerNorms, residual stream and modulations in float32 and re-cast each
matrix product's input: the H200 profile showed those memory-bound passes at ~65% of a
large batch's time, GEMMs at 20%.) The ODE state `x` and the flow time stay float32, and
the vocoder stays float32 (its F0 net float64) because phase errors are audible.

On CUDA the CosyVoice3 flow's ODE solve also runs as CUDA graphs (`engine.flow_graphs`):
batches are padded to (rows, frames) buckets, exactly, and one graph per bucket replays
the 10 x 22 DiT blocks' kernels in one launch. Per batch the stage makes a handful of
host->device copies (index planes, not per-chunk pieces), queued from pinned memory so
the host never waits for the GPU mid-batch (`engine.device_copy`), and one device->host
copy for all of the batch's PCM: the batch's one wait.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import logging
import math
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Protocol, Sequence, TypeVar, get_args

import numpy as np
import torch
from torch.profiler import record_function

from .chunking import SpareTokens
from .config import DEADLINE_MARGIN_S, MAX_FIRST_CHUNK_HOLD_MS, MAX_PIPELINE_LEAD_MS, StagePolicy
from .errors import released
from .first_chunk import RoundTimes
from .flow_context_cache import ContextCache, ContextPlan, decode_with_context, warmup_chunks
from .flow_graphs import FlowGraphRunner, GraphPolicy
from .flow_prompt_cache import (PromptCache, PromptKV, decode_with_prompt_cache, prefix_width, prompt_frames,
                                shared_entry, supports_prompt_cache)
from .mel_stretch import MelStretch
from .models import split_attention_kernel
from .models.dit import DiT, attention_kernel_for, split_prefix_rows_for
from .models.flow import FlowChunk
from .models.hift import CausalHiFTGenerator, use_snake_kernel
from .stage_profile import PHASES, StageProfiler
from .vocoder_graphs import VocoderGraphPolicy, VocoderGraphRunner

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class BatchStart:
    """When the stage took a chunk's batch (time.monotonic), how many chunks it held, and
    whether the chunk's deadline as the deadline cut judges it (`cut_shift_s`, before any
    `rescue`) had passed by then: a cut gives such a row up as a stall in progress."""

    at: float
    rows: int
    past_due: bool = False


@dataclass
class ChunkJob:
    flow: FlowChunk
    hift_stream: object  # the vocoder's per-utterance stream state
    speed: float
    chunk_index: int
    is_cancelled: Callable[[], bool]
    future: asyncio.Future[np.ndarray] = field(repr=False, default=None)  # type: ignore[assignment]
    seq: int = 0
    # When this chunk's audio is needed, less the engine's margin (time.monotonic seconds);
    # the "deadline" policy and the deadline cut read it. Unset = as urgent as can be.
    deadline: float = -math.inf
    # Set when `deadline` counted the audio of its utterance's earlier chunks still being
    # made as if delivered at this time (time.monotonic; the engine cannot know when their
    # round ends). The stage moves the deadline by how much later their round ends
    # (`AudioStage._refresh_deadlines`). None: nothing of the utterance was in the making.
    deadline_from: float | None = None
    # How far the stage has moved `deadline` so far (seconds, never negative): a pipelined
    # round's predicted end moves it first, its delivery sets it right, earlier or later.
    deadline_moved: float = 0.0
    # A first chunk (chunk_index 0) whose audio the listener waits for in silence; the
    # "first_chunks" policy lets only these jump the queue. The engine clears it for an
    # utterance queued behind its session's audio still playing (`chunk_due`).
    urgent: bool = True
    # Resolved when the stage takes the batch holding this chunk: from then its flow chunk
    # (grown or not) is final, so the utterance can queue its next chunk, and the caller
    # can tell waiting in the queue from computing.
    started: asyncio.Future[BatchStart] = field(repr=False, default=None)  # type: ignore[assignment]
    # `engine.flow_fill_padding`: grow(n) returns this chunk lengthened by at most n speech
    # tokens of flow window, with tokens its utterance has already generated, or None to
    # keep it. The stage calls it before the batch runs, with the padding the batch would
    # compute for this row anyway, and runs the returned chunk instead (on the job it
    # holds: `StagePool` queues a copy). None: fixed length.
    grow: Callable[[int], FlowChunk | None] | None = None
    # For a stage in a process of its own, which cannot call `grow`: the tokens it may grow
    # into (`engine.stage_process` grows the chunk there), and where the end it grew to
    # (end, finalize) is told before `started` resolves.
    spare: SpareTokens | None = None
    grown_to: Callable[[int, bool], None] | None = None
    # Cut big because its audio is not due soon (`engine.chunk_patience_s`): its utterance
    # waits patiently until it queues a chunk that is not (`AudioStage.round_estimate`).
    patient: bool = False


STAGE_POLICIES: tuple[str, ...] = get_args(StagePolicy)

# The stage's settings `AudioStage.tune` may change while it serves (`POST /debug/planner`
# with `debug_tuning`: a benchmark's A/B, level by level on one gateway, which saves a
# gateway start per setting), and their types.
STAGE_TUNABLE: dict[str, type] = {"fill_padding": bool, "split_call_cost": int, "first_cut": bool,
                                  "second_cut": bool, "rescue": bool, "pipeline_lead_ms": float,
                                  "hold_ms": float, "burst_hold_ms": float, "burst_rows": int}
# The bounds of the float settings (milliseconds; a knob is at least 0).
_STAGE_KNOB_MAX: dict[str, float] = {"pipeline_lead_ms": MAX_PIPELINE_LEAD_MS, "hold_ms": MAX_FIRST_CHUNK_HOLD_MS,
                                     "burst_hold_ms": MAX_FIRST_CHUNK_HOLD_MS}
# The least an integer setting may be, where not 0 (as `EngineConfig` checks it).
_STAGE_KNOB_MIN: dict[str, int] = {"burst_rows": 1}


def check_stage_knobs(knobs: dict[str, object]) -> dict[str, object]:
    """`knobs` as `AudioStage.tune` sets them; ValueError names the first one it refuses."""
    for name, value in knobs.items():
        kind = STAGE_TUNABLE.get(name)
        if kind is None:
            raise ValueError(f"{name!r} is not a tunable stage setting (one of {', '.join(sorted(STAGE_TUNABLE))})")
        if kind is bool and not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false, got {value!r}")
        least = _STAGE_KNOB_MIN.get(name, 0)
        if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value < least):
            raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not 0 <= value <= _STAGE_KNOB_MAX[name]):  # also refuses NaN
            raise ValueError(f"{name} must be a number in 0..{_STAGE_KNOB_MAX[name]:g}, got {value!r}")
    return {name: float(value) if STAGE_TUNABLE[name] is float else value  # type: ignore[arg-type]
            for name, value in knobs.items()}


@dataclass(frozen=True)
class BatchCandidate:
    """What the deadline policy looks at in one queued chunk."""

    deadline: float  # time.monotonic seconds
    window: int  # flow window in speech tokens (the batch is padded to its longest)
    seq: int  # queue order: breaks deadline ties first-come first-served


def deadline_batch(candidates: Sequence[BatchCandidate], max_batch: int, window_tolerance: float = 0.25) -> list[int]:
    """Indices of the candidates to run as the next batch, most urgent first.

    The most urgent candidate always runs, so a chunk waits at most until it is the most
    urgent one. Others join in deadline order while the batch's longest window stays within
    (1 + window_tolerance) x its shortest: a batch is padded to its longest window, so this
    bounds every row's padding by that fraction. A candidate that does not fit is skipped,
    not a stop: a later, fitting one may still join. The rest wait for a later batch.
    """
    if max_batch < 1:
        raise ValueError("max_batch must be at least 1")
    order = sorted(range(len(candidates)), key=lambda i: (candidates[i].deadline, candidates[i].seq))
    chosen: list[int] = []
    shortest = longest = 0
    for i in order:
        if len(chosen) == max_batch:
            break
        w = candidates[i].window
        if chosen:
            lo, hi = min(shortest, w), max(longest, w)
            if hi > (1.0 + window_tolerance) * lo:
                continue
            shortest, longest = lo, hi
        else:
            shortest = longest = w
        chosen.append(i)
    return chosen


def deadline_cut(deadlines: Sequence[float], now: float,
                 round_s: Callable[[Sequence[int]], float | None]) -> list[int] | None:
    """The rows of a batch to run first, in a smaller round of their own, or None to run
    the batch whole. `deadlines`: when each row's audio is needed (time.monotonic
    seconds); `round_s(rows)`: the predicted seconds of a round of those rows (None:
    no prediction yet).

    Every row of a round is done when the round is. A row due before a long round ends,
    say a session whose first chunk went alone and that has only that chunk's audio
    ahead, runs its listener dry although a small round would have made it in time. So
    the rows due before the whole round's end (rows already past due with them: they
    only gain) run first, and the rest, due later, go to the next round, when that
    leaves fewer rows with a deadline still ahead missing it: the first round by its own
    end, the rest by the end of both. Rows already past due do not count as misses
    either way; the rest never includes one."""
    rows = range(len(deadlines))
    whole = round_s(rows)
    if whole is None:
        return None
    end = now + whole
    first = [i for i in rows if deadlines[i] < end]
    rest = [i for i in rows if deadlines[i] >= end]
    missed = sum(1 for i in first if deadlines[i] > now)
    if not missed or not rest:
        return None
    first_s, rest_s = round_s(first), round_s(rest)
    if first_s is None or rest_s is None:
        return None
    missed_cut = (sum(1 for i in first if now < deadlines[i] < now + first_s)
                  + sum(1 for i in rest if deadlines[i] < now + first_s + rest_s))
    return first if missed_cut < missed else None


def first_chunk_cut(firsts: Sequence[bool], deadlines: Sequence[float], now: float,
                    round_s: Callable[[Sequence[int]], float | None]) -> list[int] | None:
    """The rows of a batch to run first, in a round of their own, when it carries first
    chunks that listeners wait for in silence (`firsts`), or None to run it whole.
    `deadlines` and `round_s` as in `deadline_cut`.

    Under arrivals spread over time a round mixes a few first chunks (~30 mel frames)
    with other utterances' big chunks (~190, most of them cut big because their audio is
    not due for a second or more, `engine.chunking.patient_target`), and every row is
    done when the whole round is. On an H100 at 224 sessions over 16 s (round 40 of
    docs/benchmarks.md) first chunks rode in rounds of 18 rows and took 229 ms there,
    after 131 waiting for the round before. Here the first chunks go first, with every
    row that would miss its deadline waiting for the round after them; the rest wait.
    Only when the first chunks gain more than the stage loses: the whole round's time
    less the first chunks' round against the second round's time past the whole one (a
    round has a fixed cost, and at capacity the stage's time is everyone's).

    A row is judged late against a next round of `rest` alone, right after the first. That
    round may start later (the first-chunk hold, up to `engine.first_chunk_hold_ms`) or be
    cut again for newer first chunks; each cut judges its rows again from the time it is
    made, and the deadlines keep the engine's margin (250 ms) for such errors."""
    rows = range(len(deadlines))
    first = [i for i in rows if firsts[i]]
    if not first or len(first) == len(deadlines):
        return None
    whole = round_s(rows)
    if whole is None:
        return None
    for _ in range(FIRST_CUT_PASSES):
        chosen = set(first)
        rest = [i for i in rows if i not in chosen]
        if not rest:
            return None
        first_s, rest_s = round_s(first), round_s(rest)
        if first_s is None or rest_s is None:
            return None
        late = [i for i in rest if deadlines[i] < now + first_s + rest_s]
        if not late:
            return first if whole - first_s > first_s + rest_s - whole else None
        first = sorted(chosen.union(late))
    return None


# `first_chunk_cut` plans two rounds a pass (~0.5 ms each at 64 rows on the CPU machine, on the
# event loop): a row that would be late joins the first round and lengthens it, which can make
# another late, so the passes are bounded and a cut not settled by then is not made.
FIRST_CUT_PASSES = 4


# `engine.flow_split_batches`: the fixed cost of one more flow call, in row-frames of ODE work
# (the H200 stage bench: an eager batch from the prompt cache takes ~36 ms plus ~0.049 ms per
# row x frame, so a call costs about as much as 730 row-frames; a graph replay ~23 ms plus
# ~0.03 ms per padded row x frame, about 770 of its row-frames: one constant serves both).
# Round 39's kernels on an H100 fit ~18 ms plus ~0.03 ms per padded row x frame (~600); the
# setting `engine.flow_split_call_cost` waits for an A/B under load.
SPLIT_CALL_COST = 730
SPLIT_MAX_CALLS = 3


def split_by_length(frames: Sequence[int], call_cost: float = SPLIT_CALL_COST,
                    max_calls: int = SPLIT_MAX_CALLS,
                    solved: Callable[[int, int], int] | None = None) -> list[list[int]]:
    """A flow batch's rows (their computed frames) as at most `max_calls` calls of similar
    length, minimising sum over calls of (call_cost + solved(rows, longest row)): every call
    is padded to its longest row, so one call over chunks of very different lengths computes
    mostly padding (under staggered arrivals, a first chunk of ~50 frames next to later
    ones of ~300). `solved`: the row-frames a call of that shape runs (default rows x
    longest; with CUDA graphs the padded bucket, `call_work`, under which 33 equal rows may
    cost more as one call than as 32 + 1). Returns the calls (row indices, ascending) from
    shortest to longest; one call holding every row when splitting does not pay."""
    if max_calls < 1:
        raise ValueError("max_calls must be at least 1")
    order = sorted(range(len(frames)), key=lambda r: (frames[r], r))
    lengths = [frames[r] for r in order]
    n = len(order)
    # A call ends where the length changes or, with `solved` (padding), anywhere: splitting
    # rows of one length pays only when rows are padded. Without it the search runs over
    # the distinct lengths alone.
    ends = [j for j in range(1, n + 1) if solved is not None or j == n or lengths[j] > lengths[j - 1]]
    starts = [0] + ends[:-1]
    work = solved or (lambda rows, longest: rows * longest)
    # by_length[x][r]: the cost of one call of r rows whose longest row has x frames.
    by_length = {x: [0.0] + [call_cost + work(r, x) for r in range(1, n + 1)] for x in set(lengths)}
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(max_calls + 1)]  # best[k][j]: first j sorted rows in k calls
    cut = [[0] * (n + 1) for _ in range(max_calls + 1)]
    best[0][0] = 0.0
    for k in range(1, max_calls + 1):
        prev, here, cuts = best[k - 1], best[k], cut[k]
        for j in ends:
            row = by_length[lengths[j - 1]]
            for i in starts:
                if i >= j:
                    break
                c = prev[i] + row[j - i]
                if c < here[j]:
                    here[j], cuts[j] = c, i
    calls = min(range(1, max_calls + 1), key=lambda k: (best[k][n], k))
    spans, j = [], n
    for k in range(calls, 0, -1):
        i = cut[k][j]
        spans.append(sorted(order[i:j]))
        j = i
    return spans[::-1]


def call_work(policy: GraphPolicy, width: int, shared: bool) -> Callable[[int, int], int]:
    """`split_by_length`'s `solved` for a stage with flow graphs: a call of (rows, frames)
    runs its graph bucket's padded rows x frames when one serves it, else (eagerly) its
    exact shape. `width`, `shared`: the batch's cached prompt prefix, as `GraphPolicy.bucket`
    takes them (a part of the batch is priced as if it had the whole batch's)."""
    rows_memo: dict[int, int | None] = {}
    frames_memo: dict[int, int | None] = {}

    def solved(rows: int, frames: int) -> int:
        if rows not in rows_memo:
            rows_memo[rows] = policy.padded_rows(rows, width, shared)
        if frames not in frames_memo:
            frames_memo[frames] = policy.padded_frames(frames)
        padded_rows, padded_frames = rows_memo[rows], frames_memo[frames]
        return rows * frames if padded_rows is None or padded_frames is None else padded_rows * padded_frames
    return solved


@dataclass
class _Expected:
    """A first chunk on its way (`AudioStage.expect_first_chunk`): when its tokens should be
    there (time.monotonic), the round it would miss (s, 0 unknown), whether its listener
    will be waiting for it then (`ChunkJob.urgent`), and whether a round of first chunks
    already started without it."""

    due: float
    round_s: float
    urgent: bool = True
    passed: bool = False


@dataclass
class StageStats:
    batches: int = 0
    chunks: int = 0
    dropped: int = 0
    last_batch_size: int = 0
    max_batch_size: int = 0
    busy_seconds: float = 0.0
    # Of busy_seconds: the hand-offs around each batch (the worker thread picking it up, and
    # the event loop resuming once the worker is done). When they grow, the stage waits
    # for a busy event loop or interpreter, not for the GPU. A lower bound: waiting for the
    # interpreter inside a batch counts as the batch's work; waiting behind a graph capture
    # or a prompt cache build on the worker does not count.
    handoff_seconds: float = 0.0
    queued: int = 0
    # Work done, for throughput figures: flow = sum over batches of padded rows x padded
    # frames the ODE ran at (before the guidance doubling; with the prompt cache only the
    # frames after the cached prefix); vocoder = mel frames vocoded.
    flow_frames: int = 0
    vocoder_frames: int = 0
    # Of flow_frames, the rows' own frames before padding (to a call's longest row, to a
    # graph's bucket): flow_frames - this is padding, this - vocoder_frames the left
    # context and prompt frames re-read.
    flow_exact_frames: int = 0
    # Of that padding, the frames of rows added to fill a graph's row bucket, and those that
    # pad a call's own rows past its longest row to a graph's frame bucket (the rest pads
    # rows to the call's longest).
    flow_row_padding_frames: int = 0
    flow_bucket_padding_frames: int = 0
    # Flow prompt cache (off unless enabled): chunks decoded from a cached prompt prefix,
    # and the bytes the cache holds now.
    prompt_cache_hits: int = 0
    prompt_cache_bytes: int = 0
    # Flow context cache (off unless enabled): chunks that read their utterance's kept
    # frames, chunks whose final frames were kept, and the bytes of its pool.
    context_reads: int = 0
    context_records: int = 0
    context_bytes: int = 0
    # The vocoder's CUDA graphs (`engine.vocoder_graphs`, CosyVoice3 on CUDA): decode steps
    # that replayed one, and those that ran eagerly (more rows or frames than any bucket,
    # or no graph). Both 0 without graphs.
    vocoder_graph_replays: int = 0
    vocoder_eager_decodes: int = 0
    # `fill_padding`: chunks that grew into their batch's padding, and the speech tokens
    # they took (audio those chunks delivered early, at no extra flow work).
    grown_chunks: int = 0
    grown_tokens: int = 0
    # Batches that failed and whose chunks then ran one at a time: the whole chunk when the
    # flow failed (`FlowPhaseError`), only its vocoder step when the vocoder did
    # (`VocoderPhaseError`).
    batches_retried_apart: int = 0
    # Batches whose audio came back by an asynchronous copy while the next could be taken
    # (`AudioStage.pipeline_lead_ms`).
    pipelined_batches: int = 0
    # `first_chunk_hold_s`: rounds that waited for expected first chunks, the seconds
    # they waited, and the first chunks queued meanwhile (they made that round).
    first_chunk_holds: int = 0
    first_chunk_hold_seconds: float = 0.0
    first_chunk_hold_caught: int = 0
    # ... of them, the rounds that held for a burst (`first_chunk_burst_hold_s`).
    first_chunk_burst_holds: int = 0
    # With the hold on: expected first chunks that a round of first chunks started without
    # (held or not), and by how much later than expected they came, summed (negative:
    # sooner). Passed over and late: the estimates were short; on time: the hold was.
    first_chunk_passed_over: int = 0
    first_chunk_passed_over_late_seconds: float = 0.0
    # `cut_for_deadlines`: rounds cut short so that rows due before the whole round's end
    # ran first (`deadline_cut`).
    deadline_cuts: int = 0
    # `first_cut`: rounds whose first chunks ran before the rows that could wait
    # (`first_chunk_cut`).
    first_chunk_cuts: int = 0


def solved_work(policy: GraphPolicy | None, rows: int, frames: int, cached: int) -> int:
    """Rows x frames of a batch as the stage solves it, the measure `RoundTimes` learns
    from (`AudioStage._decode`): a graph's bucket when one serves it (taken for one voice,
    the common load; `policy` None: no flow graphs), else the batch itself. Planned on the
    exact rows instead, 40 first chunks in the 64-row graph were planned at 9 tokens as if
    their round were far shorter than its 266 ms (H200, round 13 of docs/benchmarks.md),
    and every session stalled."""
    return rows * frames if policy is None else call_work(policy, cached, cached > 0)(rows, frames)


def mark_patience(patient: weakref.WeakSet[object], job: ChunkJob) -> None:
    """Keep `patient` (vocoder streams) as the stage's `live_utterances` reads it: a
    stream is in it from a patient chunk of its utterance to the next chunk that is not."""
    if job.patient:
        patient.add(job.hift_stream)
    else:
        patient.discard(job.hift_stream)


def estimate_round(rounds: RoundTimes, live: int, max_batch: int, policy: GraphPolicy | None,
                   frames: int, cached: int, due: int | None = None) -> float | None:
    """`AudioStage.round_estimate` from its parts: `live` utterances in progress, each
    with a chunk like this one in the same round, in batches of at most `max_batch`;
    with `due`, as many batches as those utterances fill, each still as wide as `live`."""
    live = max(1, live)
    one = rounds.predict(solved_work(policy, min(live, max_batch), frames, cached))
    return None if one is None else one * math.ceil(max(1, live if due is None else due) / max_batch)


def cuda_memory(device: torch.device) -> dict[str, int]:
    """The CUDA allocator's current and peak bytes on `device` (none elsewhere). Nothing in a
    process that has not used CUDA: asking would create a context (hundreds of MB) in the
    engine's process when the stage runs in its own."""
    if device.type != "cuda" or not torch.cuda.is_initialized():
        return {}
    return {
        "cuda_memory_allocated_bytes": int(torch.cuda.memory_allocated(device)),
        "cuda_max_memory_allocated_bytes": int(torch.cuda.max_memory_allocated(device)),
    }


def padding_room(frames: Sequence[int], token_mel_ratio: int) -> list[int]:
    """Per row of a flow batch (its computed frames), the speech tokens it could grow by
    without lengthening the batch: every row is padded to the longest."""
    longest = max(frames, default=0)
    return [(longest - f) // token_mel_ratio for f in frames]


class FlowPhaseError(RuntimeError):
    """A batch failed in the flow, before any of it reached the vocoder: its chunks' vocoder
    streams are as they were, so each may run again on its own (its cause: `__cause__`)."""


class VocoderPhaseError(RuntimeError):
    """A batch's flow ran, then its vocoder step (or the copy of its audio to the host)
    failed: its streams were put back as they were before the step (`_stream_checkpoint`),
    so each chunk's step may run again on its own from its mel, without its flow again
    (whose context-cache rings already hold its frames). Cause: `__cause__`."""

    def __init__(self, message: str, mels: list[torch.Tensor], flow_work: int) -> None:
        super().__init__(message)
        self.mels = mels  # per chunk: the mel frames the step was given, [n, 80]
        self.flow_work = flow_work  # the batch's flow work (`StageStats.flow_frames`)


def _stream_checkpoint(streams: Sequence[object]) -> Callable[[], None]:
    """What puts these vocoder streams (objects of tensors, counters, lists and a noise
    generator) back as they are now. A step replaces their tensors rather than writing
    into them, so keeping the references is enough; a list's items are copied, and a
    generator's state is read out (a step past the noise table draws from it). ~2 us a
    stream on the CPU machine."""
    saved = []
    for st in streams:
        values = dict(vars(st))
        items = [(v, list(v)) for v in values.values() if isinstance(v, list)]
        states = [(v, v.get_state()) for v in values.values() if isinstance(v, torch.Generator)]
        saved.append((st, values, items, states))

    def restore() -> None:
        for st, values, items, states in saved:
            for name, value in values.items():
                setattr(st, name, value)
            for kept, before in items:
                kept[:] = before
            for generator, state in states:
                generator.set_state(state)

    return restore


class DeviceWorker(concurrent.futures.ThreadPoolExecutor):
    """The stage's one worker thread, which runs all of its device work, one piece at a
    time; it knows since when the piece it runs now has run (`busy_for`)."""

    def __init__(self) -> None:
        super().__init__(max_workers=1, thread_name_prefix="audio-stage")
        self._since: float | None = None

    def submit(self, fn: Callable[..., T], /, *args: object, **kwargs: object) -> concurrent.futures.Future[T]:
        return super().submit(self._timed, fn, *args, **kwargs)

    def _timed(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        self._since = time.monotonic()
        try:
            return fn(*args, **kwargs)
        finally:
            self._since = None

    def busy_for(self) -> float | None:
        since = self._since
        return None if since is None else time.monotonic() - since


class AudioStage:
    def __init__(self, flow: torch.nn.Module, hift: torch.nn.Module, device: torch.device, max_batch: int = 64,
                 flow_dtype: torch.dtype | str = "auto", flow_compile: bool = False, flow_cuda_graphs: bool = True,
                 graph_policy: GraphPolicy | None = None, policy: str = "first_chunks",
                 window_tolerance: float = 0.25, prompt_cache_bytes: int | None = None,
                 profiler: StageProfiler | None = None, split_batches: bool = False, split_padded: bool = True,
                 split_call_cost: float = SPLIT_CALL_COST,
                 vocoder_cuda_graphs: bool = True, fill_padding: bool = False,
                 vocoder_graph_rows: tuple[int, ...] = (1, 2, 4, 8),
                 vocoder_graph_frames: int = VocoderGraphPolicy.max_frames,
                 context_cache_bytes: int = 0, context_frames: int = 100, context_min_rows: int = 16,
                 flow_attention: str = "triton", flow_attention_rotary: bool = True, flow_conv_kernel: str = "triton",
                 flow_split_prefix_rows: int | None = None,
                 vocoder_snake_kernel: str = "triton", vocoder_channels_last: bool = True,
                 first_chunk_hold_s: float = 0.0, first_chunk_hold_share: float = 0.0,
                 first_chunk_burst_hold_s: float = 0.0, first_chunk_burst_rows: int = 8,
                 cut_for_deadlines: bool = False, cut_shift_s: float = 0.0, final_full_attention: bool = False,
                 first_cut: bool = False, second_cut: bool = False, rescue: bool = False,
                 pipeline_lead_ms: float = 0.0):
        if policy not in STAGE_POLICIES:
            raise ValueError(f"unknown stage policy {policy!r} (one of {', '.join(STAGE_POLICIES)})")
        self.policy = policy
        self.window_tolerance = window_tolerance  # "deadline" policy: see deadline_batch
        self.flow = flow
        # Graphs only where they exist (CUDA) and for the CosyVoice3 DiT (the padding
        # argument is made for it; CosyVoice2's U-Net runs eagerly).
        estimator = getattr(getattr(flow, "decoder", None), "estimator", None)
        self.flow_cuda_graphs = flow_cuda_graphs and torch.device(device).type == "cuda" and isinstance(estimator, DiT)
        self.graph_policy = graph_policy or GraphPolicy()
        self._graphs: FlowGraphRunner | None = None
        # First use may come from the event loop (`warm_graphs`) and the worker thread (a
        # batch) at once: two runners would each capture and keep their own graphs.
        self._graphs_lock = threading.Lock()
        # Prompt K/V cache (`engine.flow_prompt_cache`), None = off. Touched only on the
        # worker thread.
        self.prompt_cache = (PromptCache(prompt_cache_bytes)
                             if prompt_cache_bytes is not None and supports_prompt_cache(flow) else None)
        # "auto": bf16 on CUDA, float32 elsewhere (CPU bf16 matmuls are not faster here).
        if flow_dtype == "auto":
            flow_dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
        if not isinstance(flow_dtype, torch.dtype) or not flow_dtype.is_floating_point:
            raise ValueError(f"flow_dtype must be a floating torch dtype, got {flow_dtype!r}")
        self.flow_dtype: torch.dtype = flow_dtype
        flow.to(dtype=flow_dtype)  # in place: the stage owns its flow
        # Per-utterance K/V of earlier frames (`engine.flow_context_cache`); it builds on the
        # prompt cache (the ring follows the cached prompt). Worker thread only.
        self.context_cache = (ContextCache(flow, context_frames, context_cache_bytes, device, flow_dtype)
                              if context_cache_bytes > 0 and self.prompt_cache is not None else None)
        self.context_min_rows = context_min_rows
        self._context_warmed = False
        if isinstance(estimator, DiT):
            # Before it compiles: its graphs keep the kernel.
            kernel = attention_kernel_for(flow_attention, torch.device(device), self.flow_dtype)
            rotary = flow_attention_rotary and kernel == "triton" and \
                split_attention_kernel.runs_on(torch.device(device), self.flow_dtype, rotary=True)
            estimator.use_attention_kernel(kernel, rotary=rotary)
            estimator.use_conv_kernel(flow_conv_kernel)
            estimator.split_prefix_rows = (split_prefix_rows_for(kernel) if flow_split_prefix_rows is None
                                           else flow_split_prefix_rows)
        # torch.compile of the DiT blocks (CosyVoice3 on CUDA); compiled on the first batch,
        # or when graphs are warmed, on the worker thread.
        self.flow_compile = flow_compile and torch.device(device).type == "cuda" and isinstance(estimator, DiT)
        if self.flow_compile:
            estimator.compile_blocks()
        self.profiler = profiler  # engine.stage_profile_dir: a window of batches under torch.profiler
        self.split_batches = split_batches  # engine.flow_split_batches: see split_by_length
        self.split_padded = split_padded  # engine.flow_split_padded: see _split_pricing
        self.split_call_cost = split_call_cost  # engine.flow_split_call_cost: see split_by_length
        self.fill_padding = fill_padding  # engine.flow_fill_padding: see _fill_padding
        self.final_full_attention = final_full_attention  # engine.flow_final_full_attention: see _flow_calls
        self.hift = hift
        use_snake_kernel(hift, vocoder_snake_kernel)  # before its graphs: they keep the kernel
        if isinstance(hift, CausalHiFTGenerator):
            hift.channels_last = vocoder_channels_last  # before its graphs too: they keep the layout
        # CUDA graphs for the CosyVoice3 vocoder's decode (launch-bound at a few streams).
        self.vocoder_graph_policy = VocoderGraphPolicy(batch_buckets=tuple(vocoder_graph_rows),
                                                       max_frames=vocoder_graph_frames)
        self.vocoder_graphs = (VocoderGraphRunner(hift, self.vocoder_graph_policy)
                               if vocoder_cuda_graphs and torch.device(device).type == "cuda"
                               and isinstance(hift, CausalHiFTGenerator) else None)
        self.device = device
        self.max_batch = max_batch
        self.stats = StageStats()
        self.rounds = RoundTimes()  # batch wall time against flow work, for first-chunk sizes
        # Vocoder streams of utterances in progress: a stream is dropped with its utterance,
        # so the weak set counts them without any bookkeeping on the hot path.
        self._live: weakref.WeakSet[object] = weakref.WeakSet()
        # ... and those whose latest chunk was cut big, not due soon (`ChunkJob.patient`).
        self._patient: weakref.WeakSet[object] = weakref.WeakSet()
        # First chunks on their way (`expect_first_chunk`), by vocoder stream. Weak: an
        # utterance that ends is gone.
        self._coming: weakref.WeakKeyDictionary[object, _Expected] = weakref.WeakKeyDictionary()
        # When each utterance's latest round ended (time.monotonic), by vocoder stream: its
        # queued chunk's deadline moves by it (`_refresh_deadlines`).
        self._done_at: weakref.WeakKeyDictionary[object, float] = weakref.WeakKeyDictionary()
        # ... and the latest round taken with a chunk of it: with pipelined rounds a round's
        # delivery leaves `_done_at` to a later round in flight for the same utterance.
        self._latest_round: weakref.WeakKeyDictionary[object, int] = weakref.WeakKeyDictionary()
        self._round_ids = itertools.count()
        # Each utterance's speaking-rate state (`_stretch`), by vocoder stream.
        self._stretches: weakref.WeakKeyDictionary[object, MelStretch] = weakref.WeakKeyDictionary()
        # Vocoder streams one of whose chunks failed: their later chunks, queued as the stage
        # took the failed one, are dropped at the next round, not run for an utterance that
        # has ended on a stream that never got the chunk before them.
        self._failed_streams: weakref.WeakSet[object] = weakref.WeakSet()
        self.first_chunk_hold_s = first_chunk_hold_s  # engine.first_chunk_hold_ms: see _hold
        self.first_chunk_hold_share = first_chunk_hold_share  # engine.first_chunk_hold_share
        self.first_chunk_burst_hold_s = first_chunk_burst_hold_s  # engine.first_chunk_burst_hold_ms
        self.burst_rows = first_chunk_burst_rows  # engine.first_chunk_burst_rows
        self.cut_for_deadlines = cut_for_deadlines  # engine.stage_deadline_cut: see deadline_cut
        # ... which takes a row as late when its round ends after its deadline plus this
        # (engine.stage_deadline_cut_margin_ms: the chunks' deadline margin less its own).
        self.cut_shift_s = cut_shift_s
        self.rescue = rescue  # engine.stage_deadline_cut_rescue: see _cut_due
        self.first_cut = first_cut  # engine.stage_first_chunk_cut: see first_chunk_cut
        self.second_cut = second_cut  # engine.stage_second_chunk_cut: see _cut_for_first_chunks
        # engine.stage_pipeline_lead_ms: see `_before_round`. 0: a round is taken once the
        # previous one's audio is on the host.
        self.pipeline_lead_ms = pipeline_lead_ms
        self._pending: list[ChunkJob] = []
        self._wake = asyncio.Event()
        self._seq = itertools.count()
        self._task: asyncio.Task[None] | None = None
        self._pool = DeviceWorker()
        # Pipelined rounds: the waits for their audio (`HostCopy.wait`), in launch order, on
        # a thread of their own so that the worker can launch the next round meanwhile; the
        # tasks that deliver each round's audio once it is on the host (`_land`); and when
        # the device is predicted to be done with the last round launched (time.monotonic).
        self._copies = DeviceWorker()
        self._landing: list[asyncio.Task[None]] = []
        self._device_free_at = 0.0
        self._busy_until = 0.0  # perf_counter when the latest round's audio was delivered
        self._closed = False
        self._other_work_until = 0.0  # perf_counter when the worker last finished a non-batch job

    def new_stream(self) -> object:
        stream = self.hift.new_stream()
        self._live.add(stream)
        return stream

    def tune(self, knobs: dict[str, object]) -> None:
        """Set `STAGE_TUNABLE` settings from the next batch on; all or none."""
        for name, value in check_stage_knobs(knobs).items():
            setattr(self, name, value)

    @property
    def hold_ms(self) -> float:
        """`first_chunk_hold_s` in ms: the knob's unit, as `engine.first_chunk_hold_ms`."""
        return self.first_chunk_hold_s * 1000

    @hold_ms.setter
    def hold_ms(self, value: float) -> None:
        self.first_chunk_hold_s = value / 1000

    @property
    def burst_hold_ms(self) -> float:
        """`first_chunk_burst_hold_s` in ms, as `engine.first_chunk_burst_hold_ms`."""
        return self.first_chunk_burst_hold_s * 1000

    @burst_hold_ms.setter
    def burst_hold_ms(self, value: float) -> None:
        self.first_chunk_burst_hold_s = value / 1000

    def started(self) -> None:
        """The engine's start (its warm-up) is over: the profile's window counts batches
        from here."""
        if self.profiler is not None:
            self.profiler.origin = self.stats.batches

    def expect_first_chunk(self, stream: object, due: float, round_s: float | None = None,
                           urgent: bool = True) -> None:
        """The first chunk of `stream`'s utterance should be queued at `due`
        (time.monotonic): a round about to start with other first chunks may wait for it
        (`_hold`), longer when missing a round would cost it `round_s` seconds and
        `first_chunk_hold_share` is set, or when it is `urgent` (its listener will be
        waiting for it) and one of a burst. Its `submit` clears it. Announced again (the
        session's `hold_refresh`), it keeps whether a round already passed it over."""
        before = self._coming.get(stream)
        self._coming[stream] = _Expected(due, round_s or 0.0, urgent, passed=before is not None and before.passed)

    def worker_busy_for(self) -> float | None:
        """Seconds the device work running now (a round, a capture, a warm-up, or the wait
        for a pipelined round's audio) has run; None while the worker is idle. The stage
        process's watchdog reads it."""
        times = [t for t in (self._pool.busy_for(), self._copies.busy_for()) if t is not None]
        return max(times) if times else None

    def live_utterances(self, stream: object | None = None, skip_patient: bool = False) -> int:
        """Utterances in progress here (their vocoder streams still exist), less with
        `skip_patient` those whose latest chunk was patient (`ChunkJob.patient`); `stream`
        is for `StagePool`'s interface (the stage it is bound to)."""
        return max(0, len(self._live) - (len(self._patient) if skip_patient else 0))

    def round_estimate(self, stream: object, frames: int, cached: int = 0,
                       skip_patient: bool = False, due_rounds: bool = False) -> float | None:
        """Predicted seconds until a chunk of `stream`'s utterance that computes `frames`
        flow frames after `cached` prompt frames from the prompt cache is done, when every
        utterance in progress here has one like it in the same round: the batches they
        fill, by the round times measured so far (`RoundTimes`). None before the first
        batch. `skip_patient`: not counting the utterances waiting patiently
        (`live_utterances`), whose chunks are few and big (`engine.chunk_patience_s`);
        `due_rounds`: counting them in a round's width but not in the number of rounds
        (`FirstChunkPlanner.due_rounds`).
        Finished utterances do not count (`_serve_batch`): until round 15 of
        docs/benchmarks.md they did, and that error alone kept bursts from stalling while
        a session queued its next chunk only after the previous one's audio was back
        (`submit` says why it no longer waits)."""
        return estimate_round(self.rounds, self.live_utterances(skip_patient=skip_patient), self.max_batch,
                              self.graph_policy if self.flow_cuda_graphs else None, frames, cached,
                              self.live_utterances(skip_patient=True) if due_rounds else None)

    async def start(self) -> None:
        if self._task is None:
            # The vocoder's device noise table (CausalHiFTGenerator): built here on the worker,
            # not by the first session's `new_stream` on the event loop.
            prepare = getattr(self.hift, "build_noise_table", None)
            if prepare is not None:
                await asyncio.get_running_loop().run_in_executor(self._pool, prepare)
            if self.vocoder_graphs is not None:  # every bucket, so no request pays for a capture
                await asyncio.get_running_loop().run_in_executor(self._pool, self.vocoder_graphs.warm)
            self._task = asyncio.create_task(self._loop(), name="audio-stage")

    async def close(self) -> None:
        self._closed = True
        try:
            if self._task is not None:
                self._task.cancel()
                try:
                    await self._task
                except asyncio.CancelledError:
                    pass
                self._task = None
            # Rounds in flight get their audio. (A round the worker was still launching as
            # the loop was cancelled gets none: its chunks were cancelled, `_serve_batch`.)
            # Not gather: a close cancelled meanwhile must not cancel them.
            if self._landing:
                await asyncio.wait(self._landing)
                self._landing.clear()
        finally:
            for job in self._pending:  # even when this close was cancelled: nobody is left waiting
                _cancel(job)
            self._pending.clear()
            # Whatever went wrong above: a profiler left running crashes the process at exit.
            if self.profiler is not None:
                await asyncio.get_running_loop().run_in_executor(self._pool, self.profiler.close)
            self._pool.shutdown(wait=True)
            self._copies.shutdown(wait=True)

    def submit(self, job: ChunkJob) -> asyncio.Future[np.ndarray]:
        """Queue one chunk; the returned future (also `job.future`) gets its PCM (float32,
        24 kHz), and `job.started` when its batch was taken (`BatchStart`).

        An utterance may queue its next chunk once `job.started` is done, before this
        one's audio is back: batches run one at a time, so the next chunk runs in a later
        batch than this one, after its vocoder state is advanced. Waiting for the audio
        instead made each chunk of a burst miss the round that began as the previous
        round's audio went out (round 15 of docs/benchmarks.md)."""
        if self._closed:
            raise RuntimeError("audio stage is closed")
        loop = asyncio.get_running_loop()
        job.future, job.started = loop.create_future(), loop.create_future()
        job.seq = next(self._seq)
        mark_patience(self._patient, job)
        expected = self._coming.pop(job.hift_stream, None)
        if expected is not None and expected.passed and job.chunk_index == 0:
            self.stats.first_chunk_passed_over += 1
            self.stats.first_chunk_passed_over_late_seconds += time.monotonic() - expected.due
        self._pending.append(job)
        self.stats.queued = len(self._pending)
        self._wake.set()
        return job.future

    async def run(self, job: ChunkJob) -> np.ndarray:
        """Queue one chunk and wait for its PCM (`submit`)."""
        return await self.submit(job)

    def drop_cancelled(self) -> int:
        """Remove queued chunks whose utterance was cancelled or failed; returns how many."""
        keep, dropped = [], 0
        for job in self._pending:
            if job.is_cancelled() or job.future.cancelled() or job.hift_stream in self._failed_streams:
                dropped += 1
                _cancel(job)
            else:
                keep.append(job)
        self._pending = keep
        self.stats.dropped += dropped
        self.stats.queued = len(keep)
        return dropped

    def pending_for(self, is_cancelled: object) -> int:
        """Queued chunks whose cancel check is `is_cancelled` (tests, metrics)."""
        return sum(1 for j in self._pending if j.is_cancelled is is_cancelled)

    def _refresh_deadlines(self, jobs: list[ChunkJob]) -> None:
        """Move each job's deadline by how much later than it assumed its utterance's
        earlier chunk is delivered (`ChunkJob.deadline_from`). An utterance queues its
        next chunk as soon as the stage takes the previous one, so that chunk's audio
        comes back a whole round after the deadline took it as delivered: in a burst a
        second chunk's deadline was a 163-ms opening round early, and every row of the
        second round looked late already. While that round is in flight (pipelined) its
        end is the predicted one; the delivery replaces it, so a round that ends sooner
        than predicted moves the deadline back (never before the engine's own)."""
        for job in jobs:
            if job.deadline_from is None:
                continue
            done = self._done_at.get(job.hift_stream)
            if done is None:
                continue
            moved = max(0.0, done - job.deadline_from)
            job.deadline += moved - job.deadline_moved
            job.deadline_moved = moved

    def _take_batch(self) -> list[ChunkJob]:
        self.drop_cancelled()
        live = self._pending
        self._refresh_deadlines(live)
        if self.policy == "deadline":
            picked = deadline_batch([BatchCandidate(j.deadline, len(j.flow.tokens), j.seq) for j in live],
                                    self.max_batch, self.window_tolerance)
            taken = set(picked)
            batch = [live[i] for i in picked]
            self._pending = [j for i, j in enumerate(live) if i not in taken]
        else:
            # First chunks heard after silence jump the queue: they decide first-audio
            # latency. A later utterance's first chunk waits its turn: the session's
            # earlier audio plays first, and jumping ahead of its next chunks stalls it.
            live.sort(key=lambda j: (not (j.chunk_index == 0 and j.urgent), j.seq))
            batch, self._pending = live[: self.max_batch], live[self.max_batch :]
        taken = batch
        try:
            if self.first_cut and len(batch) > 1:
                batch = self._cut_for_first_chunks(batch)
            if self.cut_for_deadlines and len(batch) > 1:
                batch = self._cut_for_deadlines(batch)
            self.stats.queued = len(self._pending)
            if self.fill_padding:
                self._fill_padding(batch)  # calls the sessions' `grow`
        except Exception as exc:
            # Taken from the queue and in no round, these chunks would wait for ever: they
            # fail (their utterances end with the error), and the stage goes on.
            log.exception("audio stage: a batch could not be made")
            queued = {id(j) for j in self._pending}
            lost = [j for j in taken if id(j) not in queued]
            self._fail_jobs(lost, exc)
            for job in lost:
                if not job.started.done():
                    job.started.cancel()  # the session's producer waits on it
            return []
        return batch

    def _window_frames(self, chunk: FlowChunk) -> int:
        """The mel frames of the chunk's whole window (not its lookahead)."""
        look = 0 if chunk.finalize else self.flow.pre_lookahead_len
        return self.flow.token_mel_ratio * (len(chunk.tokens) - look)

    def _call_plan(self, chunks: list[FlowChunk],
                   split: bool = True) -> tuple[list[list[int]], list[list[int]], int, bool]:
        """How the worker will run these chunks as seen from the event loop: the rows of
        each flow call, the frames each chunk computes by each way the worker may decode
        it (its whole window; with the prompt cache, also the frames after the cached
        prefix, which differ between voices; none for a prompt too long for the cache's
        budget), and the calls' cached prefix width and whether it is one voice's.
        `split=False`: all in one call, whatever `split_batches` says."""
        full = [self._window_frames(c) for c in chunks]
        measures = [full]
        cache = self.prompt_cache
        if cache is not None:
            refused = cache.refused_frames  # an int read from the worker's writes: atomic

            def prefix(chunk: FlowChunk) -> int:
                frames = prompt_frames(self.flow, chunk)
                return 0 if refused is not None and frames >= refused else frames

            measures.append([f - prefix(c) for f, c in zip(full, chunks)])
        width = max((f - m for f, m in zip(full, measures[-1])), default=0)
        shared = all(c.prompt_feat is chunks[0].prompt_feat for c in chunks)  # one voice, as far as seen here
        if self.split_batches and split:
            calls = split_by_length(measures[-1], self.split_call_cost, solved=self._split_pricing(width, shared))
        else:
            calls = [list(range(len(chunks)))]
        return calls, measures, width, shared

    def _padding_rooms(self, chunks: list[FlowChunk]) -> list[int]:
        """Per chunk, the tokens it can grow by without lengthening any flow call of its
        batch, whichever way the worker decodes it (`_call_plan`). With split batches,
        against its own call's longest row."""
        calls, measures, _, _ = self._call_plan(chunks)
        rooms = [0] * len(chunks)
        ratio = self.flow.token_mel_ratio
        for rows in calls:
            per_measure = [padding_room([m[i] for i in rows], ratio) for m in measures]
            for k, i in enumerate(rows):
                rooms[i] = min(r[k] for r in per_measure)
        return rooms

    def _round_seconds(self, chunks: list[FlowChunk], split: bool = True) -> float | None:
        """Predicted wall seconds of a round of these chunks (`RoundTimes`), from the flow
        work the worker would count for it: each call at its graph bucket's padded shape
        (at its exact one without graphs), after the cached prompt prefix where there is
        a cache. `split=False`: as one call, which the worker's split never exceeds."""
        if not chunks:
            return 0.0
        calls, measures, width, shared = self._call_plan(chunks, split)
        frames = measures[-1]
        solved = (call_work(self.graph_policy, width, shared) if self.flow_cuda_graphs
                  else lambda rows, longest: rows * longest)
        return self.rounds.predict(sum(solved(len(rows), max(frames[i] for i in rows)) for rows in calls))

    def _cut_for_deadlines(self, batch: list[ChunkJob]) -> list[ChunkJob]:
        """`deadline_cut` on a batch the policy picked: the rows to run now; the others go
        back to the head of the queue for the next round. A cut plans the calls of three
        rounds (~0.5 ms each at 64 rows on the CPU machine), so first a bound: with no row
        due before an unsplit round would end, no cut can pay."""
        chunks = [j.flow for j in batch]
        now = time.monotonic()
        due = self._cut_due(batch, now)
        bound = self._round_seconds(chunks, split=False)
        if bound is None or not any(now < d < now + bound for d in due):
            return batch
        first = deadline_cut(due, now, lambda rows: self._round_seconds([chunks[i] for i in rows]))
        if first is None:
            return batch
        self.stats.deadline_cuts += 1
        return self._run_first(batch, first)

    def _cut_due(self, batch: list[ChunkJob], now: float) -> list[float]:
        """When each row is due as the deadline cut judges it: its deadline shifted to the
        cut's margin (`cut_shift_s`). With `rescue`, a chunk after its utterance's first
        that is already past that at `now` is judged by when its listener runs out (its
        deadline without the engine's margin, DEADLINE_MARGIN_S), so that the cut still
        counts it as a row it can save. Not a first chunk: one with nothing delivered before
        it is due when queued, and has no audio to run out. (The first-chunk cut takes rows
        past due along with the first chunks as they are.)"""
        due = [j.deadline + self.cut_shift_s for j in batch]
        if self.rescue:
            due = [d if d > now or j.chunk_index == 0 else j.deadline + DEADLINE_MARGIN_S
                   for d, j in zip(due, batch)]
        return due

    def _cut_for_first_chunks(self, batch: list[ChunkJob]) -> list[ChunkJob]:
        """`first_chunk_cut` on a batch the policy picked: the rows to run now. With
        `second_cut` an utterance's second chunk, unless cut big and patient, goes with the
        first chunks too: the first-chunk planner sizes a first chunk to cover the second's
        wait and round as second chunks lately took them (`SecondRounds`), and a second
        chunk riding with long chunks makes that long, so first chunks are made long."""
        firsts = [(j.chunk_index == 0 and j.urgent) or (self.second_cut and j.chunk_index == 1 and not j.patient)
                  for j in batch]
        if not any(firsts) or all(firsts):
            return batch
        chunks = [j.flow for j in batch]
        first = first_chunk_cut(firsts, [j.deadline + self.cut_shift_s for j in batch], time.monotonic(),
                                lambda rows: self._round_seconds([chunks[i] for i in rows]))
        if first is None:
            return batch
        self.stats.first_chunk_cuts += 1
        return self._run_first(batch, first)

    def _run_first(self, batch: list[ChunkJob], first: list[int]) -> list[ChunkJob]:
        """The rows `first` of `batch`, to run now; the others go back to the head of the
        queue, for the next round."""
        kept = set(first)
        self._pending[:0] = [j for i, j in enumerate(batch) if i not in kept]
        return [batch[i] for i in first]

    def _fill_padding(self, batch: list[ChunkJob]) -> None:
        """Grow the batch's shorter chunks into the padding it computes for them anyway.
        Under staggered arrivals a batch mixes first chunks (~36 frames) with later ones
        (~176), so most of a short row is padding; filled with tokens its utterance
        already has, it is audio delivered now instead of by a later chunk of its own
        (which would recompute the left context again). Runs on the event loop, before
        the batch goes to the worker. A row grows by at most its room, so each flow
        call's longest row, and the flow's cost, stay as they were; the vocoder decodes
        the extra frames."""
        if len(batch) < 2:
            return
        rooms = self._padding_rooms([j.flow for j in batch])
        for job, room in zip(batch, rooms):
            if room > 0 and job.grow is not None:
                grown = job.grow(room)
                if grown is not None:
                    taken = (self._window_frames(grown) - self._window_frames(job.flow)) // self.flow.token_mel_ratio
                    job.flow = grown
                    self.stats.grown_chunks += 1
                    self.stats.grown_tokens += taken

    async def _loop(self) -> None:
        while True:
            if not self._pending:
                self._wake.clear()
                await self._wake.wait()
            if self._landing:
                await self._before_round()
            if self.first_chunk_hold_s > 0 or self.first_chunk_hold_share > 0 or self.first_chunk_burst_hold_s > 0:
                await self._hold()
            try:
                await self._serve_batch()
            except Exception:  # a bug in a round's bookkeeping must not end the stage for good
                log.exception("audio stage: a round failed; the stage goes on")

    async def _before_round(self) -> None:
        """With rounds in flight (`pipeline_lead_ms`): wait until the device is predicted to
        be done with the last one launched in `pipeline_lead_ms` or less, or is done, and
        until every earlier one is done. The next round's inputs are then built and its
        kernels queued while the last one's still run, instead of after its audio reached
        the host (~2.5 ms of host work a round before the flow's graph launches, round 37 of
        docs/benchmarks.md, and the hand-off through the event loop). Taken no earlier: a
        chunk queued after the round is taken waits for the round after it. Never more than
        one round ahead of the device."""
        self._landing = [t for t in self._landing if not t.done()]
        if len(self._landing) > 1:
            await asyncio.wait(self._landing[:-1])
        if not self._landing:
            return
        last = self._landing[-1]
        wait = self._device_free_at - self.pipeline_lead_ms / 1000 - time.monotonic()
        if wait > 0 or self.pipeline_lead_ms <= 0:
            # No prediction yet (no round measured), or tuned off meanwhile: the whole round.
            whole = self.pipeline_lead_ms <= 0 or not math.isfinite(wait)
            await asyncio.wait({last}, timeout=None if whole else wait)

    async def _hold(self) -> None:
        """Before a round that starts first chunks: wait, at most `first_chunk_hold_s`,
        for the first chunks expected within that time (`expect_first_chunk`). A burst's
        first chunks come ready over a few LM steps, and the stage starts a round with
        the first one queued: one that misses it waits a whole round (hundreds of ms at
        tens of rows) for its first audio, and its listener's clock started late against
        the others' second chunks. The rows already queued wait at most the hold. An
        expectation more than the hold overdue is dropped from the wait (the LM slowed
        down, or the estimate was off). With `first_chunk_hold_share` the hold is at least
        that share of the longest round an expected first chunk would miss. With
        `first_chunk_burst_hold_s` it is that long, for urgent first chunks only, while a
        burst is under way: at least `burst_rows` urgent first chunks queued or expected
        within it. Only the urgent ones count: in round 58 of docs/benchmarks.md a count of
        every expected first chunk, later segments' too (four a session), took most held
        rounds at 288 sessions over 16 s for burst holds, and lost there."""
        if not any(j.chunk_index == 0 and j.urgent for j in self._pending):
            return
        longest = max((e.round_s for e in self._coming.values()), default=0.0)
        hold = max(self.first_chunk_hold_s, self.first_chunk_hold_share * longest)
        start = time.monotonic()
        # The chunks queued before the hold (`submit` numbers them in order): those queued
        # during it are what it caught, whatever was dropped meanwhile (`drop_cancelled`).
        before = max((j.seq for j in self._pending), default=-1)
        burst = False
        if self.first_chunk_burst_hold_s > hold:
            window = self.first_chunk_burst_hold_s
            urgent = sum(1 for j in self._pending if j.chunk_index == 0 and j.urgent)
            coming = sum(1 for e in self._coming.values() if e.urgent and start - window <= e.due <= start + window)
            if urgent + coming >= self.burst_rows:
                hold, burst = window, True
        until = start + hold
        held = False
        while len(self._pending) < self.max_batch:
            now = time.monotonic()
            if now >= until or not any(now - hold <= e.due <= until and (e.urgent or not burst)
                                       for e in self._coming.values()):
                break
            held = True
            self._wake.clear()
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for returns the woken wait's
            # result when the stage's close cancels it in the same turn, and the loop runs on.
            try:
                async with asyncio.timeout(until - now):
                    await self._wake.wait()
            except TimeoutError:
                break
        for expected in self._coming.values():  # this round starts without them
            expected.passed = True
        if held:
            st = self.stats
            st.first_chunk_holds += 1
            st.first_chunk_burst_holds += burst
            st.first_chunk_hold_seconds += time.monotonic() - start
            st.first_chunk_hold_caught += sum(1 for j in self._pending if j.chunk_index == 0 and j.seq > before)

    async def _serve_batch(self) -> None:
        """Take one batch and run it. Its own frame, so that nothing of the batch outlives
        it: a batch kept in the loop's locals until the next one kept its utterances'
        vocoder streams alive, and `live_utterances` counted them into every round the
        first-chunk planner predicted: with up to `max_batch` finished utterances
        counted, a full burst was planned as two rounds each (round 14 of
        docs/benchmarks.md)."""
        batch = self._take_batch()
        if not batch:
            return
        try:
            await self._serve_taken(batch)
        except asyncio.CancelledError:
            # The stage is closing while this round runs: its chunks will get no audio, and
            # whoever waits on them is told so, as for the chunks still queued (`close`).
            for job in batch:
                _cancel(job)
            raise

    async def _serve_taken(self, batch: list[ChunkJob]) -> None:
        """Run one taken batch: its audio delivered here, or by a landing task when pipelined."""
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        at = time.monotonic()
        round_id = next(self._round_ids)
        for job in batch:
            self._latest_round[job.hift_stream] = round_id
            if not job.started.done():
                job.started.set_result(BatchStart(at, len(batch), job.deadline + self.cut_shift_s < at))
        # The retry of a failed batch runs after the `except` block, its exception's frames
        # released: they hold the failed batch's tensors, the memory a retry needs when the
        # batch was too large for the device.
        retry: Callable[[], Awaitable[None]] | None = None
        try:
            began, (pcm, flow_frames, vocoder_frames), ended, one_off = await loop.run_in_executor(
                self._pool, self._timed_batch, self.stats.batches, [batch])
        except FlowPhaseError as exc:
            if len(batch) == 1:
                log.error("audio stage: a chunk's flow failed: %s", exc, exc_info=exc.__cause__)
                self._fail_jobs(batch, exc.__cause__ or exc)
                return
            # One bad chunk, or a batch too large for the device's memory, would otherwise
            # fail every utterance in it.
            log.warning("audio stage: a flow batch of %d chunks failed (%s); running them one at a time",
                        len(batch), exc, exc_info=exc.__cause__)
            self.stats.batches_retried_apart += 1
            released(exc)
            retry = functools.partial(self._run_apart, batch)
        except VocoderPhaseError as exc:
            self.stats.flow_frames += exc.flow_work  # its flow ran: the padding shares stay whole
            if len(batch) == 1:
                log.error("audio stage: a chunk's vocoder step failed: %s", exc, exc_info=exc.__cause__)
                self._fail_jobs(batch, exc.__cause__ or exc)
                return
            # Its streams are as before the step, and the mels are made: only the vocoder
            # runs again, one chunk at a time.
            log.warning("audio stage: the vocoder step of a batch of %d chunks failed (%s); running it "
                        "one chunk at a time", len(batch), exc, exc_info=exc.__cause__)
            self.stats.batches_retried_apart += 1
            retry = functools.partial(self._vocode_apart, batch, exc.mels)
            released(exc)
        except Exception as exc:  # fail this batch's chunks, keep serving others
            log.exception("audio stage batch failed")
            self._fail_jobs(batch, exc)
            return
        synchronous = retry is not None or isinstance(pcm, list) or pcm.done is None
        if synchronous and self._landing:  # audio goes out in launch order: rounds in flight first
            await asyncio.wait(self._landing)  # not gather: a cancelled loop must not cancel them
        if retry is not None:
            await retry()
            return
        if isinstance(pcm, list) or pcm.done is None:
            self._deliver(batch, pcm if isinstance(pcm, list) else pcm.wait(), t0, began, ended, flow_frames,
                          vocoder_frames, one_off, round_id)
            return
        # In flight (`pipeline_lead_ms`): its audio is delivered by a task of its own, and
        # the next round may be taken before then (`_before_round`). It starts on the device
        # when the round before it ends, if that one is still in flight.
        predicted = self.rounds.predict(flow_frames)
        behind = any(not t.done() for t in self._landing) and math.isfinite(self._device_free_at)
        start = max(at, self._device_free_at) if behind else at
        self._device_free_at = start + predicted if predicted is not None else math.inf
        if predicted is not None:
            # Its utterances' next chunks may be taken before its audio is back: their
            # deadlines move from its predicted end (`_refresh_deadlines`), as they would
            # from its delivery, and again from the delivery itself, earlier or later.
            for job in batch:
                self._done_at[job.hift_stream] = self._device_free_at
        before = self._landing[-1] if self._landing else None
        self._landing.append(asyncio.create_task(
            self._land(batch, pcm, before, t0, began, flow_frames, vocoder_frames, one_off, round_id),
            name="audio-stage-landing"))

    async def _land(self, batch: list[ChunkJob], copy: HostCopy, before: asyncio.Task[None] | None,
                    t0: float, began: float, flow_frames: int, vocoder_frames: int, one_off: bool,
                    round_id: int) -> None:
        """A pipelined round's end: once its audio is on the host, after the round launched
        before it was delivered, `_deliver`. Cancelled first (torn down without `close`, or
        a `close` cancelled meanwhile), it tells whoever waits on its chunks."""
        try:
            await self._land_round(batch, copy, before, t0, began, flow_frames, vocoder_frames, one_off, round_id)
        except asyncio.CancelledError:
            for job in batch:
                _cancel(job)
            raise

    async def _land_round(self, batch: list[ChunkJob], copy: HostCopy, before: asyncio.Task[None] | None,
                          t0: float, began: float, flow_frames: int, vocoder_frames: int, one_off: bool,
                          round_id: int) -> None:
        loop = asyncio.get_running_loop()
        try:
            results, completed = await loop.run_in_executor(self._copies, _waited, copy)
        except Exception as exc:  # the device failed the round: its chunks fail, the stage goes on
            log.exception("audio stage: a round's audio did not reach the host")
            if before is not None:
                await asyncio.wait({before})
            self._fail_jobs(batch, exc)
            self._busy_until = time.perf_counter()  # the next round's time starts here
            return
        if before is not None:
            await asyncio.wait({before})
        try:
            self.stats.pipelined_batches += 1
            self._deliver(batch, results, t0, began, completed, flow_frames, vocoder_frames, one_off, round_id)
        except Exception:
            log.exception("audio stage: a round's bookkeeping failed; the stage goes on")

    def _deliver(self, batch: list[ChunkJob], results: list[np.ndarray], t0: float, began: float,
                 completed: float, flow_frames: int, vocoder_frames: int, one_off: bool, round_id: int) -> None:
        """A round's audio to its chunks, then its bookkeeping. perf_counter readings: `t0`
        the round was taken, `began` the worker started it, `completed` its audio was on the
        host (when the worker was done, but for a pipelined round). A pipelined round may have
        begun while the one before it still ran: its busy time and its round time count
        from that one's delivery (`_busy_until`), not twice."""
        done = time.monotonic()
        for job, pcm in zip(batch, results):  # first: the bookkeeping below cannot strand them
            if self._latest_round.get(job.hift_stream, round_id) <= round_id:  # no later round holds it
                self._done_at[job.hift_stream] = done
            if not job.future.done():
                job.future.set_result(pcm)
        resumed = time.perf_counter()
        st = self.stats
        st.handoff_seconds += (began - max(t0, self._other_work_until)) + (resumed - completed)
        st.batches += 1
        st.chunks += len(batch)
        st.last_batch_size = len(batch)
        st.max_batch_size = max(st.max_batch_size, len(batch))
        st.busy_seconds += resumed - max(t0, self._busy_until)
        if not one_off:
            # From the worker's start: a wait behind a capture job is not a round, and a
            # batch that compiled or captured is not one either. Both would stay in the
            # round times' memory of its size (`RoundTimes`), and a capture takes seconds.
            self.rounds.observe(flow_frames, resumed - max(began, self._busy_until))
        self._busy_until = resumed
        st.flow_frames += flow_frames
        st.vocoder_frames += vocoder_frames
        # Counters the worker writes, read as they are (it may run the next round by now).
        if self.prompt_cache is not None:
            st.prompt_cache_hits = self.prompt_cache.stats.hits
            st.prompt_cache_bytes = self.prompt_cache.nbytes
        if self.context_cache is not None:
            ctx = self.context_cache
            st.context_reads, st.context_records, st.context_bytes = ctx.reads, ctx.records, ctx.nbytes
        if self.vocoder_graphs is not None:
            st.vocoder_graph_replays = self.vocoder_graphs.stats.replays
            st.vocoder_eager_decodes = self.vocoder_graphs.stats.eager

    async def _run_apart(self, batch: list[ChunkJob]) -> None:
        """Each chunk of a batch whose flow failed, alone and in order: the ones that did not
        cause it get their audio, the one that did its error. Later chunks of the same
        utterances wait, as batches run one at a time."""
        loop = asyncio.get_running_loop()
        for job in batch:
            if job.future.done():  # cancelled meanwhile
                continue
            try:
                _, (pcm, flow_frames, vocoder_frames), _, _ = await loop.run_in_executor(
                    self._pool, self._timed_batch, self.stats.batches, [[job]])
                results = pcm if isinstance(pcm, list) else await loop.run_in_executor(self._copies, pcm.wait)
            except Exception as exc:
                log.error("audio stage: a chunk's flow failed on its own too: %s", exc, exc_info=exc)
                self._fail_jobs([job], exc.__cause__ or exc if isinstance(exc, (FlowPhaseError, VocoderPhaseError)) else exc)
                continue
            st = self.stats  # the work, as a batch's (its padding shares stay consistent)
            st.chunks += 1
            st.flow_frames += flow_frames
            st.vocoder_frames += vocoder_frames
            self._done_at[job.hift_stream] = time.monotonic()
            if not job.future.done():
                job.future.set_result(results[0])

    async def _vocode_apart(self, batch: list[ChunkJob], mels: list[torch.Tensor]) -> None:
        """Each chunk's vocoder step of a batch whose step failed, alone and in order, from
        the mel its flow made: the chunks that did not cause the failure get the audio they
        would have got in the batch, the one that did its error."""
        loop = asyncio.get_running_loop()
        for job, mel in zip(batch, mels):
            if job.future.done():  # cancelled meanwhile
                continue
            try:
                pcm, frames = await loop.run_in_executor(self._pool, self._vocode_alone, job, mel)
            except Exception as exc:
                log.error("audio stage: a chunk's vocoder step failed on its own too: %s", exc, exc_info=exc)
                self._fail_jobs([job], exc.__cause__ or exc if isinstance(exc, VocoderPhaseError) else exc)
                continue
            self.stats.chunks += 1
            self.stats.vocoder_frames += frames
            self._done_at[job.hift_stream] = time.monotonic()
            if not job.future.done():
                job.future.set_result(pcm)

    def graph_runner(self) -> FlowGraphRunner | None:
        """The flow's CUDA-graph runner (created on first use), None when graphs are off."""
        if self.flow_cuda_graphs and self._graphs is None:
            with self._graphs_lock:
                if self._graphs is None:
                    self._graphs = FlowGraphRunner(self.flow.decoder, self.graph_policy, context=self.context_cache)
        return self._graphs

    async def warm_graphs(self, shapes: list[tuple[int, ...]]) -> int:
        """Capture the flow graphs for these (chunks, frames[, cached prefix frames]) batch
        shapes now, on the stage's worker thread; returns how many were captured (0 when
        graphs are off)."""
        runner = self.graph_runner()
        if runner is None:
            return 0
        # One worker job per shape, so chunks queued meanwhile run between captures
        # instead of waiting for the whole set (seconds).
        loop, captured = asyncio.get_running_loop(), 0
        for shape in shapes:
            captured += await loop.run_in_executor(self._pool, self._other_work, runner.warm, [shape])
        return captured

    async def warm_prompt(self, chunk: FlowChunk) -> bool:
        """Build the prompt cache entry of this chunk's voice now, on the worker thread
        (in the flow's dtype, like its use); False when the cache is off or the
        prompt has nothing to cache."""
        if self.prompt_cache is None:
            return False
        cache = self.prompt_cache

        def build() -> bool:
            with torch.inference_mode():
                return cache.get_or_build(self.flow, chunk) is not None

        built = await asyncio.get_running_loop().run_in_executor(self._pool, self._other_work, build)
        self.stats.prompt_cache_bytes = cache.nbytes
        return built

    async def warm_context(self, prompt: FlowChunk) -> bool:
        """Run the context cache's three kinds of flow call once with this prompt's voice, on
        the worker thread, so that the compiled DiT's variants for them are built before any
        load meets them (a compile takes seconds). False when the cache is off or the prompt
        has no cached block; once per stage."""
        ctx, cache = self.context_cache, self.prompt_cache
        if ctx is None or cache is None or self._context_warmed:
            return False

        class Utterance:  # a key for one slot
            pass

        def run() -> bool:
            key = Utterance()
            with torch.inference_mode():
                for chunk in warmup_chunks(self.flow, prompt):
                    entries = [cache.get_or_build(self.flow, chunk)]
                    plan = ctx.plan([chunk], entries, [key]) if entries[0] is not None else None
                    if plan is None:
                        return False
                    decode_with_context(self.flow, [chunk], entries, ctx, plan)
            ctx.release([key])
            return True

        warmed = await asyncio.get_running_loop().run_in_executor(self._pool, self._other_work, run)
        self._context_warmed = self._context_warmed or warmed
        return warmed

    def _other_work(self, fn: Callable[..., T], *args: object) -> T:
        """A worker job that is not a batch (a graph capture, a prompt cache entry): a batch
        queued behind it waited for the device, not for a hand-off (see `handoff_seconds`)."""
        try:
            return fn(*args)
        finally:
            self._other_work_until = time.perf_counter()

    def _timed_batch(self, index: int,
                     handed: list[list[ChunkJob]]) -> tuple[float, tuple[list[np.ndarray] | HostCopy, int, int],
                                                             float, bool]:
        """`_run_batch` between two perf_counter readings taken on the worker thread, and
        whether it did one-off work (`_one_off_work`).

        The batch comes inside a list it is taken out of: the executor's work item keeps
        its arguments until the worker thread runs again, which can be after the results
        were delivered, and a batch held there kept its finished utterances' vocoder
        streams alive (counted live by `round_estimate`)."""
        batch = handed.pop()
        before = self._one_off_work()
        began = time.perf_counter()
        out = self._run_batch(index, batch)
        ended = time.perf_counter()
        return began, out, ended, self._one_off_work() != before

    def _one_off_work(self) -> tuple[int, int, int, int]:
        """Counts of the work a batch does once, not every round: graph captures (flow,
        vocoder), torch.compile graphs (any thread: only a signal) and batches run under
        the stage profiler (its start and stop take hundreds of milliseconds inside a
        batch; in round 14, after a profiled level, the planner predicted 1.2 s for a
        40-row round that took ~0.4 s)."""
        flow = self._graphs.stats.captures if self._graphs is not None else 0
        vocoder = self.vocoder_graphs.stats.captures if self.vocoder_graphs is not None else 0
        dynamo = sys.modules.get("torch._dynamo.utils")  # not imported: nothing compiled
        compiled = int(dynamo.counters["stats"]["unique_graphs"]) if dynamo is not None else 0
        return flow, vocoder, compiled, self.profiler.profiled if self.profiler is not None else 0

    def _run_batch(self, index: int, batch: list[ChunkJob]) -> tuple[list[np.ndarray] | HostCopy, int, int]:
        """PCM per chunk, or with `pipeline_lead_ms` its copy to the host under way; and the
        work counts of `_compute`."""
        if self.profiler is None and self.pipeline_lead_ms > 0:
            return self._launch(batch, asynchronous=True)
        if self.profiler is None:
            return self._compute(batch)
        # A profiled batch's window ends with it: never pipelined.
        return self.profiler.run(index, len(batch), lambda: self._compute(batch))

    def _cache_pays(self, chunks: list[FlowChunk], entries: list[PromptKV | None]) -> bool:
        """Whether to decode this batch from the prompt cache. Yes, except for a small batch
        whose prefix is too wide for the prefix graphs (a prompt over ~6 s) but whose whole
        window has a graph: a small batch is launch-bound, so the graph is worth more than
        the skipped frames (H200: ~30 ms graph vs ~170 ms eager from the cache at 1 chunk)."""
        runner = self.graph_runner()
        width = prefix_width(entries)
        if runner is None or width == 0:
            return True
        full = [self._window_frames(c) for c in chunks]
        new = max(f - (0 if e is None else e.frames) for f, e in zip(full, entries))
        policy, rows = runner.policy, len(chunks)
        if runner.plan(rows, new, width, shared_entry(entries) is not None)[0] is not None:
            return True  # a graph over the cached prefixes
        return not (rows <= policy.prefix_max_rows and policy.bucket(rows, max(full)) is not None)

    def _flow_calls(self, chunks: list[FlowChunk], entries: list[PromptKV | None] | None) -> list[list[int]]:
        """The batch's rows per flow call: all in one, or by length (`split_batches`); with
        `final_full_attention` the last chunks of their utterances apart, last
        (`_decode_full`)."""
        if self.final_full_attention and any(c.finalize for c in chunks):
            rest = [i for i, c in enumerate(chunks) if not c.finalize]
            calls = self._flow_calls_of([chunks[i] for i in rest],
                                        None if entries is None else [entries[i] for i in rest]) if rest else []
            return [[rest[j] for j in call] for call in calls] + [[i for i, c in enumerate(chunks) if c.finalize]]
        return self._flow_calls_of(chunks, entries)

    def _flow_calls_of(self, chunks: list[FlowChunk], entries: list[PromptKV | None] | None) -> list[list[int]]:
        if not self.split_batches or len(chunks) < 2:
            return [list(range(len(chunks)))]
        cached = [0] * len(chunks) if entries is None else [0 if e is None else e.frames for e in entries]
        solved = self._split_pricing(prefix_width(entries), shared_entry(entries) is not None)
        return split_by_length([self._window_frames(c) - k for c, k in zip(chunks, cached)], self.split_call_cost,
                               solved=solved)

    def _split_pricing(self, width: int, shared: bool) -> Callable[[int, int], int] | None:
        """How `split_by_length` prices a call: at the graph bucket's padded shape when the
        flow has graphs and `split_padded` is on (`call_work`), else at its exact shape."""
        return call_work(self.graph_policy, width, shared) if self.split_padded and self.flow_cuda_graphs else None

    def _context_plan(self, chunks: list[FlowChunk], entries: list[PromptKV | None],
                      keys: list[object]) -> ContextPlan | None:
        """The context cache's part in one flow call, None when it has none. Eager calls and
        the one-voice prefix graphs read and keep rings; a batch mixing voices below
        `context_min_rows` chunks takes a per-row prefix graph, which has none, so it runs
        as before and ends its utterances' chains (their slots go back)."""
        ctx = self.context_cache
        if ctx is None:
            return None
        if self.graph_runner() is not None and shared_entry(entries) is None and len(chunks) < self.context_min_rows:
            ctx.release(keys)
            return None
        return ctx.plan(chunks, entries, keys)

    def _decode(self, chunks: list[FlowChunk], entries: list[PromptKV | None] | None,
                keys: list[object] | None = None) -> tuple[list[torch.Tensor], int, int, int, int]:
        """One flow call: mel per chunk, the padded rows x frames it ran, the frames its
        rows computed before any padding (each row's window, after its cached prompt prefix
        when decoded from the cache; with the context cache an upper bound: its kept frames
        are read, not computed), the frames of the rows added as padding, and the frames
        its own rows were padded past the longest to the graph's frame bucket. `keys`: the
        chunks' utterances (their vocoder streams), for the context cache."""
        if self.final_full_attention and all(c.finalize for c in chunks):
            return self._decode_full(chunks, keys)
        cache = self.prompt_cache
        cached = sum(0 if e is None else e.frames for e in entries) if entries is not None else 0
        plan = None if cache is None or entries is None or keys is None else self._context_plan(chunks, entries, keys)
        if plan is not None:
            assert cache is not None and entries is not None and self.context_cache is not None
            cache.count(entries)
            mels, shape = decode_with_context(self.flow, chunks, entries, self.context_cache, plan,
                                              solver=self.graph_runner())
        elif cache is not None and entries is not None and self._cache_pays(chunks, entries):
            cache.count(entries)
            # Small batches replay a graph over the cached prefixes (copied into static
            # buffers), larger ones run eagerly: the runner decides, like without the cache.
            mels, shape = decode_with_prompt_cache(self.flow, chunks, entries, solver=self.graph_runner())
        else:
            mels, shape = self.flow.decode_chunks(chunks, solver=self.graph_runner())
            cached = 0  # the whole windows
        return (mels, shape.rows * shape.frames, sum(self._window_frames(c) for c in chunks) - cached,
                (shape.rows - len(chunks)) * shape.frames, len(chunks) * (shape.frames - shape.longest))

    def _decode_full(self, chunks: list[FlowChunk],
                     keys: list[object] | None) -> tuple[list[torch.Tensor], int, int, int, int]:
        """`_decode` of last chunks with full attention (`final_full_attention`): eagerly,
        over their whole windows (the prompt cache and the context cache hold block-causal
        keys, and the graphs are captured block-causal); their utterances' context rings
        end here."""
        if self.context_cache is not None and keys is not None:
            self.context_cache.release(keys)
        mels, shape = self.flow.decode_chunks(chunks, streaming=False)
        return (mels, shape.rows * shape.frames, sum(self._window_frames(c) for c in chunks), 0,
                len(chunks) * (shape.frames - shape.longest))

    def _compute(self, batch: list[ChunkJob]) -> tuple[list[np.ndarray], int, int]:
        """PCM per chunk, the flow's padded rows x frames and the vocoded mel frames."""
        copy, flow_work, vocoder_frames = self._launch(batch)
        return copy.wait(), flow_work, vocoder_frames

    @torch.inference_mode()
    def _launch(self, batch: list[ChunkJob], asynchronous: bool = False) -> tuple[HostCopy, int, int]:
        """`_compute` with the PCM on its way to the host (`HostCopy`; with `asynchronous`
        on a CUDA device, the round's kernels may still run when it returns)."""
        chunks = [j.flow for j in batch]
        cache = self.prompt_cache
        entries = cache.entries_for(self.flow, chunks, count_hits=False) if cache is not None else None
        keys = [j.hift_stream for j in batch]
        out: list[torch.Tensor | None] = [None] * len(chunks)
        flow_work = exact = row_padding = bucket_padding = 0
        # The phases are `record_function` ranges for `engine.stage_profile` (free when no
        # profiler runs).
        try:
            with record_function(PHASES[0]):
                for rows in self._flow_calls(chunks, entries):
                    part, work, unpadded, padded_rows, padded_frames = self._decode(
                        [chunks[i] for i in rows], None if entries is None else [entries[i] for i in rows],
                        [keys[i] for i in rows])
                    flow_work += work
                    exact += unpadded
                    row_padding += padded_rows
                    bucket_padding += padded_frames
                    for i, m in zip(rows, part):
                        out[i] = m
        except BaseException as exc:
            if self.context_cache is not None:  # the rings may be half written
                self.context_cache.release(keys)
            if isinstance(exc, Exception):
                raise FlowPhaseError(f"{type(exc).__name__}: {exc}") from exc
            raise
        decoded = [m for m in out if m is not None]
        assert len(decoded) == len(batch), "every row belongs to exactly one flow call"
        self.stats.flow_exact_frames += exact  # this worker thread is its only writer
        self.stats.flow_row_padding_frames += row_padding
        self.stats.flow_bucket_padding_frames += bucket_padding
        # No operator call that changes nothing: at 64 chunks each one per row is 64 more
        # hand-offs of the interpreter lock (round 17 of docs/benchmarks.md).
        mels = [self._stretch(j, m if m.dtype == torch.float32 else m.float()) for m, j in zip(decoded, batch)]
        pcm, vocoder_frames = self._vocode(batch, mels, flow_work, asynchronous)
        return pcm, flow_work, vocoder_frames

    def _stretch(self, job: ChunkJob, mel: torch.Tensor) -> torch.Tensor:
        """The chunk's mel at its utterance's speaking rate (`MelStretch`, kept per vocoder
        stream: one per utterance)."""
        if job.speed == 1.0:
            return mel
        stretch = self._stretches.get(job.hift_stream)
        if stretch is None:
            stretch = self._stretches[job.hift_stream] = MelStretch(job.speed)
        return stretch.push(mel, job.flow.finalize)

    def _vocode(self, batch: list[ChunkJob], mels: list[torch.Tensor],
                flow_work: int = 0, asynchronous: bool = False) -> tuple[HostCopy, int]:
        """The vocoder step of these chunks' streams from their mels ([n, 80]) and the copy
        of its audio to the host (`_start_host_copy`): PCM per chunk and the mel frames
        vocoded. On a failure before the copy is under way the streams are put back as they
        were and `VocoderPhaseError` is raised."""
        streams = [j.hift_stream for j in batch]
        restore = _stream_checkpoint(streams)
        try:
            with record_function(PHASES[1]):
                graphs = {} if self.vocoder_graphs is None else {"decode": self.vocoder_graphs}
                pcm = self.hift.stream_step(
                    streams,
                    [m.transpose(0, 1) for m in mels],  # [n, 80] -> [80, n] (the stream copies it in)
                    [j.flow.finalize for j in batch],
                    **graphs,
                )
            with record_function(PHASES[2]):
                return _start_host_copy(pcm, asynchronous), sum(int(m.shape[0]) for m in mels)
        except Exception as exc:
            restore()
            raise VocoderPhaseError(f"{type(exc).__name__}: {exc}", mels, flow_work) from exc

    def _fail_jobs(self, jobs: list[ChunkJob], exc: BaseException) -> None:
        """`exc` (logged already) on the jobs' futures, without the frames it was raised
        through: they held the batch (its jobs, their futures, the device's activations) in
        a reference cycle that only a full garbage collection freed."""
        released(exc)
        for job in jobs:
            self._failed_streams.add(job.hift_stream)
            if not job.future.done():
                job.future.set_exception(exc)

    @torch.inference_mode()
    def _vocode_alone(self, job: ChunkJob, mel: torch.Tensor) -> tuple[np.ndarray, int]:
        """One chunk's vocoder step on its own (`_vocode_apart`)."""
        pcm, frames = self._vocode([job], [mel])
        return pcm.wait()[0], frames


def _cancel(job: ChunkJob) -> None:
    """A queued chunk that will not run: whoever waits on it is told."""
    for fut in (job.future, job.started):
        if not fut.done():
            fut.cancel()


class Synchronizes(Protocol):
    def synchronize(self) -> None: ...


@dataclass
class HostCopy:
    """A round's PCM on its way to the host: every chunk's samples in one flat host tensor,
    and each chunk's length. `done` None: the copy is complete. Otherwise the round is
    pipelined (`AudioStage.pipeline_lead_ms`): on a CUDA device the copy into pinned memory
    is queued behind the round's kernels and `done` is a CUDA event recorded after it, so
    the worker returns at once and can launch the next round while this one's kernels still
    run; on the CPU the copy is complete and `done` says so (`_Complete`)."""

    host: torch.Tensor
    sizes: list[int]
    done: Synchronizes | None = None  # a torch.cuda.Event, or _Complete

    def wait(self) -> list[np.ndarray]:
        """The chunks' samples, after the device has copied them (blocks until then)."""
        if not self.sizes:
            return []
        if self.done is not None:
            self.done.synchronize()
        flat = self.host.numpy()
        if self.done is not None:  # the pinned block goes back to its allocator, not to the sessions
            flat = flat.copy()
        return np.split(flat, np.cumsum(self.sizes)[:-1]) if len(self.sizes) > 1 else [flat]


def _waited(copy: HostCopy) -> tuple[list[np.ndarray], float]:
    """`copy`'s samples, and the perf_counter reading when it was complete."""
    return copy.wait(), time.perf_counter()


class _Complete:
    """The `done` of an asynchronous copy that was complete when made (on the CPU)."""

    def synchronize(self) -> None:
        pass


def _start_host_copy(pcm: list[torch.Tensor], asynchronous: bool = False) -> HostCopy:
    """All chunks' samples in one device->host copy (one sync instead of one per chunk);
    with `asynchronous` on a CUDA device, queued behind the round's kernels instead of
    waited for (`HostCopy`). On the CPU an asynchronous copy is complete at once, but is
    delivered as a pipelined round's is: the CPU's tests run that path."""
    flat = [p if p.dim() == 1 and p.dtype == torch.float32 else p.reshape(-1).float() for p in pcm]
    if not flat:
        return HostCopy(torch.empty(0), [])
    sizes = [int(p.numel()) for p in flat]
    joined = torch.cat(flat)
    if not asynchronous:
        return HostCopy(joined.cpu(), sizes)
    if joined.device.type != "cuda":
        return HostCopy(joined.cpu(), sizes, _Complete())
    host = torch.empty(joined.shape, dtype=joined.dtype, pin_memory=True)
    host.copy_(joined, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(joined.device))  # the stage's device, not the current one
    return HostCopy(host, sizes, done)
