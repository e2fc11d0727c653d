"""The audio stage in a process of its own, behind the interface the engine uses.

Why: PyTorch's Python bindings release the interpreter lock around every operator call,
and a loaded stage round makes thousands of them outside its CUDA graphs. In the
gateway's process the other holder of the lock is the event loop (WebSockets, the LM's
outputs, chunk planning). On the H200 a 64-chunk opening round took 128 ms alone, 138 ms
beside a thread running Python half of every 10 ms and 479 ms beside one running it 90%
of the time (`bench.stage_syncs --busy`, round 18 of docs/benchmarks.md), the range the
gateway's own opening rounds were in (456-581 ms). A process of its own gives the stage
an interpreter of its own; vLLM keeps its engine core apart for the same reason.

`RemoteStage` (the engine's process) offers what `Engine` uses of an `AudioStage`, and
the child (`stage_main`) runs an ordinary `AudioStage`, built from the same model
directory and `EngineConfig`. They talk over one duplex pipe; every send is a list of
messages (tuples, pickled):

engine -> stage
    ("tensor", key, array)          a voice's prompt mel or embedding, sent once; chunks
                                    name it by key (the stage's prompt cache keys on it)
    ("release", sids, keys)         vocoder streams and tensors the engine dropped
    ("stream", sid)                 a new vocoder stream (one per utterance)
    ("submit", jid, sid, chunk, speed, index, urgent, deadline, deadline_from, spare, patient)
                                    spare: the tokens the chunk may grow into
                                    (`flow_fill_padding`, `chunking.SpareTokens`) or None;
                                    patient: `ChunkJob.patient`
    ("cancel", jids)                queued chunks of cancelled utterances
    ("expect", sid, due, round_s, urgent)   `AudioStage.expect_first_chunk`
    ("call", cid, method, args)     warm_graphs / warm_prompt / warm_context / started / tune;
                                    cid None: no reply
    ("close",)

stage -> engine
    ("ready", info) / ("fatal", text)           once, after the stage is built (or not)
    ("events", started, done, failed, rounds, stats, memory)
        started: (jid, at, rows, past_due, grown) per chunk whose batch was taken
        (`BatchStart`; grown: the (end, finalize) the stage grew the chunk to, None if it
        did not); done:
        (jid, pcm); failed: (jid, message); rounds: the (work, wall) pairs the stage's
        `RoundTimes` observed, replayed into the engine's copy (`round_estimate` is
        answered here, synchronously); stats: `StageStats` as a dict; memory: CUDA bytes
    ("reply", cid, ok, value)
    ("alive", busy_for)             every `heartbeat_period(config)` seconds: how long the
                                    device work running now has run (None: idle)

The clocks agree: `time.monotonic` is the system's monotonic clock on Linux, one for
every process, so deadlines and batch starts cross the pipe as they are.

A chunk's `grow` (`flow_fill_padding`) reads its utterance's tokens, which live in the
engine's process; here a chunk grows into the tokens generated when it was queued, sent
with it (`grow_from_spare`), and the engine learns the end it grew to with its start. At
the loads where the padding is large the LM runs ahead of the stage, so those are most
of what the chunk could take. With `stage_devices`
the engine starts one such process per device, behind a `StagePool`. If the stage's process
exits, every chunk and call waiting on it fails with `StageProcessError` and later submits
raise it: an utterance ends with an error, never a hang. A process that is alive but stuck
(a GPU hang) is killed by the engine's watchdog (`EngineConfig.stage_stall_timeout_s`) when
it has sent nothing, or its heartbeat has reported the same piece of device work, for that
long; its chunks then fail the same way.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import itertools
import logging
import math
import multiprocessing
import os
import signal
import socket
import threading
import time
import traceback
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from .chunking import SpareTokens, grown_end
from .config import EngineConfig
from .first_chunk import RoundTimes
from .flow_graphs import GraphPolicy
from .heap import freeze_startup_objects
from .models.flow import FlowChunk
from .mps import MPS_PERCENT_ENV, MPS_PRIORITY_ENV, mps_client_env
from .token2wav import (AudioStage, BatchStart, ChunkJob, StageStats, check_stage_knobs, cuda_memory, estimate_round,
                        mark_patience)

log = logging.getLogger(__name__)

# The stage's warm-up calls the engine makes, and `started`; nothing else is called by name.
CALLS = frozenset({"warm_graphs", "warm_prompt", "warm_context", "started", "tune"})
START_TIMEOUT_S = 900.0  # model load, compile and vocoder graph capture in the child
CLOSE_TIMEOUT_S = 30.0


class StageProcessError(RuntimeError):
    """The stage's process failed or exited."""


def heartbeat_period(stall_timeout_s: float) -> float:
    """How often the stage's process says it is alive, and the engine looks: a few times per
    stall timeout, at most once a second and at least every 50 ms."""
    return max(0.05, min(1.0, stall_timeout_s / 4))


@dataclass(frozen=True)
class ChunkWire:
    """A `FlowChunk` on the pipe: its voice tensors by key (`("tensor", ...)` messages)."""

    tokens: np.ndarray
    prompt_feat: int
    embedding: int
    num_prompt_tokens: int
    out_start: int
    finalize: bool
    noise_offset: int


def grow_from_spare(chunk: FlowChunk, end: int, spare: SpareTokens, room: int) -> tuple[FlowChunk, int, bool] | None:
    """The chunk (ending at token `end`) grown by up to `room` tokens of flow window into
    its spare tokens, as the engine's own grower would with the same tokens generated
    (`chunking.grown_end`): (chunk, end, finalize), or None to stay. The window keeps its
    start (and so its output start and noise offset) and takes tokens up to the new end's
    lookahead, or to the new end when it becomes the last chunk."""
    grown = grown_end(spare.prompt_tokens, spare.offset, end, spare.available, spare.lm_done, spare.lookahead,
                      room, spare.max_hop)
    if grown is None:
        return None
    new_end, finalize = grown
    prompt = chunk.num_prompt_tokens
    window_start = spare.offset - (chunk.out_start - prompt)
    have = window_start + len(chunk.tokens) - prompt  # the utterance's tokens the window holds
    stop = new_end if finalize else min(spare.available, new_end + spare.lookahead)
    extra = spare.after[have - spare.after_start: stop - spare.after_start]
    if have < spare.after_start or len(extra) != stop - have:
        raise ValueError(f"spare tokens [{spare.after_start}, {spare.after_start + len(spare.after)}) do not "
                         f"reach from the window's end {have} to {stop}")
    tokens = torch.cat([chunk.tokens, torch.tensor(extra, dtype=chunk.tokens.dtype)])
    return dataclasses.replace(chunk, tokens=tokens, finalize=finalize), new_end, finalize


class RemoteStream:
    """The engine's handle on a vocoder stream that lives in the stage's process."""

    __slots__ = ("sid", "__weakref__")

    def __init__(self, sid: int) -> None:
        self.sid = sid


class RemoteStage:
    """An `AudioStage` in a child process (`spawn`); see the module docstring."""

    def __init__(self, conn: Connection, process: multiprocessing.process.BaseProcess, info: dict[str, Any],
                 policy: GraphPolicy, stall_timeout_s: float = 0.0) -> None:
        self._conn = conn
        self._process = process
        self.max_batch: int = info["max_batch"]
        self.device = info["device"]
        self.mps_env: dict[str, str] = info["mps"]  # the child's MPS client settings
        # Graph buckets decide a round's work (`solved_work`) only where the child has graphs.
        self.graph_policy: GraphPolicy | None = policy if info["flow_cuda_graphs"] else None
        self.rounds = RoundTimes()
        self.stats = StageStats()
        self.cuda_memory: dict[str, int] = {}
        self._live: weakref.WeakSet[RemoteStream] = weakref.WeakSet()
        self._patient: weakref.WeakSet[RemoteStream] = weakref.WeakSet()  # `AudioStage._patient`
        self._jobs: dict[int, ChunkJob] = {}  # submitted, audio not yet back
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._tensors: dict[int, int] = {}  # id(tensor) -> key, while the tensor lives
        # Written by weakref callbacks, which run wherever the last reference goes (the
        # garbage collector may run on the reader thread): sent with the next message from
        # the event loop, so only the loop's thread ever writes to the pipe.
        self._released_streams: collections.deque[int] = collections.deque()
        self._released_tensors: collections.deque[int] = collections.deque()
        self._ids = itertools.count()
        self._closed = False
        self._error: StageProcessError | None = None
        self._loop = asyncio.get_running_loop()
        # The watchdog's inputs, written by the reader thread as messages arrive (so a busy
        # event loop does not read as a silent stage): when it last received anything, and
        # the last heartbeat's report of the device work running (seconds, at monotonic time).
        self._heard = time.monotonic()
        self._busy: tuple[float, float] | None = None
        self._stall_timeout_s = stall_timeout_s
        # The engine's start (warm-up) is over (`started`): only then is a long piece of
        # device work a stall. Its cold compiles and graph captures may legitimately run
        # long (64-156 s for the warm-up voice's in all on the H200), and a start that
        # hangs is its orchestrator's to time out.
        self._serving = False
        self._stalled: str | None = None  # why the watchdog killed the process
        self._reader = threading.Thread(target=self._read, name="audio-stage-reader", daemon=True)
        self._reader.start()
        if stall_timeout_s:
            # A thread, not a task: a child that stops reading fills the pipe, and the event
            # loop then blocks in `_send` until the child is killed.
            threading.Thread(target=self._watch, name="audio-stage-watchdog", daemon=True).start()

    # ----------------------------------------------------------------- lifecycle
    @classmethod
    async def spawn(cls, config: EngineConfig, device: torch.device, policy: GraphPolicy) -> "RemoteStage":
        """Start the stage's process and wait until its stage is built and started."""
        ctx = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
        ours, theirs = ctx.Pipe(duplex=True)
        # The MPS settings go as an argument, set in the child before its CUDA context: set in
        # this process's environment around the start, they raced vLLM's own (set around its
        # engine core's start, `overlap_start`), and stages started then took vLLM's.
        mps_env = mps_client_env(config.stage_mps_thread_percent, config.resolved_stage_mps_priority())
        process = ctx.Process(target=stage_main, name="audio-stage", args=(theirs, config, str(device), mps_env))
        process.start()
        theirs.close()  # the child's end: with it closed here, the child's exit reads as EOF
        try:
            first = await asyncio.wait_for(asyncio.to_thread(_recv_first, ours), START_TIMEOUT_S)
        except BaseException as exc:
            # Off the event loop: `_stop` may wait up to a minute for a child stuck in the
            # driver, and other stages' starts and the shutdown run on the loop meanwhile.
            await asyncio.shield(asyncio.to_thread(_stop, process, ours))
            if isinstance(exc, (EOFError, OSError)):
                raise StageProcessError(f"audio stage process exited while starting (exit code "
                                        f"{process.exitcode})") from None
            raise
        kind, payload = first
        if kind != "ready":
            _stop(process, ours)
            raise StageProcessError(f"audio stage process failed to start:\n{payload}")
        log.info("audio stage process %s ready on %s%s", payload["pid"], payload["device"],
                 f" (MPS client: {payload['mps']})" if payload["mps"] else "")
        return cls(ours, process, payload, policy, config.stage_stall_timeout_s)

    async def start(self) -> None:
        """Started by `spawn` (the child starts its stage before it says it is ready)."""

    def started(self) -> None:
        self._serving = True
        self._tell(("call", None, "started", ()))

    def tune(self, knobs: dict[str, object]) -> None:
        """`AudioStage.tune`, checked here (a refusal is the caller's), set in the stage's
        process before the next message it reads (a batch it has taken runs as it was)."""
        self._tell(("call", None, "tune", (check_stage_knobs(knobs),)))

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(StageProcessError):
            self._send(("close",))
        await asyncio.to_thread(self._process.join, CLOSE_TIMEOUT_S)
        await asyncio.to_thread(_stop, self._process, self._conn)
        self._fail_all(StageProcessError("audio stage closed"))

    # ----------------------------------------------------------------- the stage interface
    def new_stream(self) -> RemoteStream:
        stream = RemoteStream(next(self._ids))
        self._live.add(stream)
        weakref.finalize(stream, self._released_streams.append, stream.sid)
        self._tell(("stream", stream.sid))
        return stream

    def live_utterances(self, stream: object | None = None, skip_patient: bool = False) -> int:
        """`AudioStage.live_utterances`: the streams are this process's handles."""
        return max(0, len(self._live) - (len(self._patient) if skip_patient else 0))

    @property
    def failure(self) -> str | None:
        """Why the stage can serve no more (its process exited); None while it can."""
        return str(self._error) if self._error is not None else None

    def submit(self, job: ChunkJob) -> asyncio.Future[np.ndarray]:
        """`AudioStage.submit`: the chunk goes to the stage's process; its futures are
        resolved from the stage's events."""
        self._check_open()
        stream = job.hift_stream
        if not isinstance(stream, RemoteStream):
            raise TypeError("job.hift_stream must come from RemoteStage.new_stream()")
        job.future, job.started = self._loop.create_future(), self._loop.create_future()
        jid = next(self._ids)
        job.seq = jid
        mark_patience(self._patient, job)
        chunk = self._wire(job.flow)
        self._send(("submit", jid, stream.sid, chunk, job.speed, job.chunk_index, job.urgent, job.deadline,
                    job.deadline_from, job.spare if job.grow is not None else None, job.patient))
        self._jobs[jid] = job
        return job.future

    async def run(self, job: ChunkJob) -> np.ndarray:
        return await self.submit(job)

    def round_estimate(self, stream: object, frames: int, cached: int = 0,
                       skip_patient: bool = False, due_rounds: bool = False) -> float | None:
        """`AudioStage.round_estimate`, from the round times the stage reported."""
        return estimate_round(self.rounds, self.live_utterances(skip_patient=skip_patient), self.max_batch,
                              self.graph_policy, frames, cached,
                              self.live_utterances(skip_patient=True) if due_rounds else None)

    def expect_first_chunk(self, stream: object, due: float, round_s: float | None = None,
                           urgent: bool = True) -> None:
        if isinstance(stream, RemoteStream):
            self._tell(("expect", stream.sid, due, round_s, urgent))

    def drop_cancelled(self) -> int:
        """Cancel the queued chunks of cancelled utterances here, and tell the stage."""
        gone = [jid for jid, job in self._jobs.items()
                if not job.started.done() and (job.is_cancelled() or job.future.cancelled())]
        for jid in gone:
            _cancel(self._jobs.pop(jid))
        if gone:
            self._tell(("cancel", gone))
        return len(gone)

    def pending_for(self, is_cancelled: object) -> int:
        """Chunks not yet taken by the stage whose cancel check is `is_cancelled`."""
        return sum(1 for j in self._jobs.values() if j.is_cancelled is is_cancelled and not j.started.done())

    async def warm_graphs(self, shapes: list[tuple[int, ...]]) -> int:
        return await self._call("warm_graphs", shapes)

    async def warm_prompt(self, chunk: FlowChunk) -> bool:
        self._check_open()  # before its tensors go to a stage that is gone
        return await self._call("warm_prompt", self._wire(chunk))

    async def warm_context(self, prompt: FlowChunk) -> bool:
        self._check_open()
        return await self._call("warm_context", self._wire(prompt))

    # ----------------------------------------------------------------- the pipe
    def _check_open(self) -> None:
        if self._error is not None:
            # A new exception each time: one raised again and again grows its traceback by
            # each raise's frames, and keeps their locals (utterances' streams) alive.
            raise StageProcessError(str(self._error))
        if self._closed:
            raise StageProcessError("audio stage is closed")

    def _send(self, *messages: tuple[Any, ...]) -> None:
        """Send from the event loop's thread (the only writer), with what was released."""
        batch: list[tuple[Any, ...]] = []
        if self._released_streams or self._released_tensors:
            # popleft, not a swap of lists: an append from another thread lands either in
            # this message or in the next one, never in a list already sent.
            sids = [self._released_streams.popleft() for _ in range(len(self._released_streams))]
            keys = [self._released_tensors.popleft() for _ in range(len(self._released_tensors))]
            batch.append(("release", sids, keys))
        batch.extend(messages)
        try:
            self._conn.send(batch)
        except (OSError, ValueError) as exc:
            # The child is gone. Its reader would say so too, but maybe after this caller
            # has failed and someone asks `failure`: say it now, once.
            self._on_exit(f"its pipe broke ({type(exc).__name__})")
            # A new exception, as `_check_open` raises: the stage's own, raised again and
            # again, would grow its traceback by each raise's frames and keep their locals.
            raise StageProcessError(str(self._error) if self._error is not None
                                    else "audio stage is closed") from None

    def _tell(self, *messages: tuple[Any, ...]) -> None:
        """`_send` for what nobody waits on: dropped once the stage is gone."""
        if self._error is None and not self._closed:
            with contextlib.suppress(StageProcessError):
                self._send(*messages)

    def _wire(self, chunk: FlowChunk) -> ChunkWire:
        return ChunkWire(chunk.tokens.numpy(), self._tensor_key(chunk.prompt_feat), self._tensor_key(chunk.embedding),
                         chunk.num_prompt_tokens, chunk.out_start, chunk.finalize, chunk.noise_offset)

    def _tensor_key(self, t: torch.Tensor) -> int:
        """A voice tensor's key in the stage's process, sent there on first use."""
        key = self._tensors.get(id(t))
        if key is None:
            key = next(self._ids)
            self._send(("tensor", key, t.detach().cpu().numpy()))
            self._tensors[id(t)] = key
            weakref.finalize(t, self._forget_tensor, id(t), key)
        return key

    def _forget_tensor(self, ident: int, key: int) -> None:
        self._tensors.pop(ident, None)
        self._released_tensors.append(key)

    async def _call(self, method: str, *args: object) -> Any:
        self._check_open()
        cid = next(self._ids)
        future: asyncio.Future[Any] = self._loop.create_future()
        self._send(("call", cid, method, args))  # first: a send that fails leaves no future behind
        self._calls[cid] = future  # its reply is handled on this loop, so not before this
        return await future

    def _read(self) -> None:
        """The reader thread."""
        reason = _pump(self._conn, self._loop, self._on_batch, self._received)
        with contextlib.suppress(RuntimeError):  # the loop closed first: nobody waits anymore
            self._loop.call_soon_threadsafe(self._on_exit, reason)

    def _received(self, batch: list[tuple[Any, ...]]) -> None:
        """On the reader thread: what the watchdog reads."""
        now = self._heard = time.monotonic()
        for message in batch:
            if message[0] == "alive":
                self._busy = None if message[1] is None else (message[1], now)

    def _on_batch(self, batch: list[tuple[Any, ...]]) -> None:
        for message in batch:
            kind = message[0]
            if kind == "events":
                self._on_events(*message[1:])
            elif kind == "reply":
                _, cid, ok, value = message
                future = self._calls.pop(cid, None)
                if future is not None and not future.done():
                    if ok:
                        future.set_result(value)
                    else:
                        future.set_exception(StageProcessError(value))

    def _on_events(self, started: list[tuple[int, float, int, bool, tuple[int, bool] | None]],
                   done: list[tuple[int, np.ndarray]],
                   failed: list[tuple[int, str]], rounds: list[tuple[int, float]], stats: dict[str, Any],
                   memory: dict[str, int]) -> None:
        for work, wall in rounds:
            self.rounds.observe(work, wall)
        self.stats = StageStats(**stats)
        self.cuda_memory = memory
        for jid, at, rows, past_due, grown in started:
            job = self._jobs.get(jid)
            if job is not None and not job.started.done():
                if grown is not None and job.grown_to is not None:
                    job.grown_to(*grown)  # before the start: the engine reads it then
                job.started.set_result(BatchStart(at, rows, past_due))
        for jid, pcm in done:
            job = self._jobs.pop(jid, None)
            if job is not None and not job.future.done():
                job.future.set_result(pcm)
        for jid, text in failed:
            job = self._jobs.pop(jid, None)
            if job is not None:
                _fail(job, StageProcessError(text))

    def _watch(self) -> None:
        """The watchdog thread: kill the stage's process when it is stuck, silent or one piece
        of its device work running for longer than the stall timeout (module docstring).
        The kill closes the pipe; the reader (or a blocked `_send`) then fails everything
        with the reason `_stall` left."""
        timeout = self._stall_timeout_s
        period = heartbeat_period(timeout)
        resumed = -math.inf  # when this process last ran again after such a gap
        while not self._closed and self._error is None and self._stalled is None:
            before = time.monotonic()
            time.sleep(period)
            now = time.monotonic()
            if now - before > period + timeout / 2:
                # This process did not run for a while either (SIGSTOP of the group, a
                # paused VM or container, a debugger): the stage's heartbeats may still be
                # in the pipe. Give it a full timeout again rather than judge on that gap,
                # for the device work under way too: its time, as the stage reports it and
                # as extrapolated here, counts the pause.
                self._heard = resumed = now
                continue
            # The piece of work running now began (monotonic) at the heartbeat less its time.
            busy = None if self._busy is None else now - max(self._busy[1] - self._busy[0], resumed)
            if now - self._heard > timeout:
                self._stall(f"no word from it for {now - self._heard:.1f} s")
            elif self._serving and busy is not None and busy > timeout:
                self._stall(f"one piece of its device work has run for {busy:.1f} s")

    def _stall(self, why: str) -> None:
        self._stalled = (f"audio stage process {self._process.pid} stalled ({why}) and was killed "
                         f"(engine.stage_stall_timeout_s {self._stall_timeout_s:g})")
        log.error("%s", self._stalled)
        self._process.kill()
        # A process stuck in the GPU driver may not die for a long time, and its pipe stays
        # open until it does: shut the pipe down now, so the reader sees its end and a send
        # blocked on a full pipe returns, and fail the stage's work at once.
        with contextlib.suppress(OSError, ValueError):
            sock = socket.fromfd(self._conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.shutdown(socket.SHUT_RDWR)
            finally:
                sock.close()  # the duplicate only; the connection keeps its own descriptor
        with contextlib.suppress(RuntimeError):  # a loop already closed: nothing waits
            self._loop.call_soon_threadsafe(self._on_exit, "")

    def _on_exit(self, reason: str) -> None:
        if self._closed or self._error is not None:
            return
        if self._stalled is not None:
            text = self._stalled
        else:
            code = self._process.exitcode
            text = f"audio stage process exited (exit code {code})" + (f": {reason}" if reason else "")
            log.error("%s", text)
        self._error = StageProcessError(text)
        # The dead process's last report stays for its counters (they must not go back),
        # but what it held now (queue, caches, CUDA memory) it holds no more.
        self.stats = dataclasses.replace(self.stats, queued=0, last_batch_size=0, prompt_cache_bytes=0,
                                         context_bytes=0)
        self.cuda_memory = {k: (0 if k == "cuda_memory_allocated_bytes" else n) for k, n in self.cuda_memory.items()}
        self._fail_all(self._error)

    def _fail_all(self, error: StageProcessError) -> None:
        jobs, self._jobs = self._jobs, {}
        for job in jobs.values():
            _fail(job, StageProcessError(str(error)))
        calls, self._calls = self._calls, {}
        for future in calls.values():
            if not future.done():
                future.set_exception(StageProcessError(str(error)))


def _pump(conn: Connection, loop: asyncio.AbstractEventLoop, handle: Callable[[list[tuple[Any, ...]]], None],
          received: Callable[[list[tuple[Any, ...]]], None] | None = None) -> str:
    """A reader thread's loop: every message batch onto the event loop, in order, until the
    other side closes ("") or a message cannot be read (why: nothing after it can be
    trusted). `received` is called on this thread as each batch arrives."""
    while True:
        try:
            batch = conn.recv()
        except (EOFError, OSError):
            return ""
        except Exception as exc:
            log.exception("audio stage pipe failed")
            return f"{type(exc).__name__}: {exc}"
        if received is not None:
            received(batch)
        try:
            loop.call_soon_threadsafe(handle, batch)
        except RuntimeError:  # the loop is closed: nobody is left to tell
            return ""


def _recv_first(conn: Connection) -> tuple[str, Any]:
    batch = conn.recv()
    return batch[0]


def _stop(process: multiprocessing.process.BaseProcess, conn: Connection) -> None:
    """Make sure the child is gone (it exits by itself on "close" or on EOF). Bounded: a
    process stuck in the GPU driver may outlive even SIGKILL for a while, and whoever stops
    the engine must not wait for it for ever."""
    with contextlib.suppress(OSError):
        conn.close()
    process.join(CLOSE_TIMEOUT_S if process.is_alive() else 0)
    if process.is_alive():
        process.kill()
        process.join(CLOSE_TIMEOUT_S)
    if process.is_alive():
        log.error("audio stage process %s did not exit after SIGKILL", process.pid)


def _fail(job: ChunkJob, error: StageProcessError) -> None:
    """A chunk the stage will not answer: both of its futures carry the error."""
    for future in (job.started, job.future):
        if not future.done():
            future.set_exception(error)
    if not job.started.cancelled():
        job.started.exception()  # retrieved: the chunk's future is what its utterance reports


def _cancel(job: ChunkJob) -> None:
    for future in (job.future, job.started):
        if not future.done():
            future.cancel()


# --------------------------------------------------------------------- the stage's process
def stage_main(conn: Connection, config: EngineConfig, device: str, mps_env: dict[str, str] | None = None) -> None:
    """The child's entry point: load the flow and the vocoder, build the stage the engine
    would build in-process, serve the pipe until "close" or EOF. `mps_env`: this process's
    MPS client settings, whatever the parent's environment held when it was spawned."""
    for name in (MPS_PERCENT_ENV, MPS_PRIORITY_ENV):
        os.environ.pop(name, None)
    os.environ.update(mps_env or {})
    # Ctrl-C in a terminal, and a supervisor's SIGTERM to the whole group (systemd's
    # default), reach this process too: the engine decides when the stage closes (it sends
    # "close" once its sessions drained, or its end of the pipe closes when it dies).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        from .stage_build import audio_stage
        from .models.loader import load_model

        dev = torch.device(device)
        model = load_model(Path(config.model_dir), load_lm=False)
        model.flow.to(dev)
        model.hift.to(dev)
        # This process is the stage's process (its SM share and priority were set when it
        # was spawned).
        stage = audio_stage(model, dev, dataclasses.replace(config, stage_process=False, stage_devices=(),
                                                             stage_mps_thread_percent=None, stage_mps_priority=None))
    except BaseException:
        with contextlib.suppress(OSError):
            conn.send([("fatal", traceback.format_exc())])
        conn.close()
        raise SystemExit(1)
    asyncio.run(_serve(conn, stage, config.stage_stall_timeout_s))


class _ReportedRounds(RoundTimes):
    """The stage's round times, each observation also queued for the engine's copy."""

    def __init__(self, sink: Callable[[tuple[int, float]], None]) -> None:
        super().__init__()
        self._sink = sink

    def observe(self, work: int, wall_s: float) -> None:
        super().observe(work, wall_s)
        self._sink((work, wall_s))


class _StageServer:
    """The child's side: messages -> the `AudioStage`; its results -> one "events"
    message per turn of the event loop."""

    def __init__(self, conn: Connection, stage: AudioStage) -> None:
        self.conn = conn
        self.stage = stage
        self.loop = asyncio.get_running_loop()
        self.closing = asyncio.Event()
        self.streams: dict[int, object] = {}
        self.tensors: dict[int, torch.Tensor] = {}
        self.cancelled: set[int] = set()
        self.live: set[int] = set()  # submitted, not yet done
        self.started: list[tuple[int, float, int, tuple[int, bool] | None]] = []
        # Chunks that may grow (`flow_fill_padding`): their job and end now, by id, until
        # their batch starts; and the (end, finalize) of those that grew.
        self.growing: dict[int, tuple[ChunkJob, int, SpareTokens]] = {}
        self.grown: dict[int, tuple[int, bool]] = {}
        self.done: list[tuple[int, np.ndarray]] = []
        self.failed: list[tuple[int, str]] = []
        self.rounds: list[tuple[int, float]] = []
        self.flush_due = False
        self.tasks: set[asyncio.Task[None]] = set()
        stage.rounds = _ReportedRounds(self._round)

    def read(self) -> None:
        """The reader thread."""
        _pump(self.conn, self.loop, self.handle)
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.closing.set)

    def handle(self, batch: list[tuple[Any, ...]]) -> None:
        for message in batch:
            try:
                getattr(self, "on_" + message[0])(*message[1:])
            except Exception as exc:  # one bad message must not leave a chunk unanswered
                log.exception("audio stage message %r failed", message[0])
                if message[0] == "submit":
                    self.failed.append((message[1], f"{type(exc).__name__}: {exc}"))
                    self._flush_soon()

    def on_tensor(self, key: int, array: np.ndarray) -> None:
        self.tensors[key] = torch.from_numpy(array)

    def on_release(self, sids: list[int], keys: list[int]) -> None:
        for sid in sids:
            self.streams.pop(sid, None)
        for key in keys:
            self.tensors.pop(key, None)

    def on_stream(self, sid: int) -> None:
        self.streams[sid] = self.stage.new_stream()

    def on_submit(self, jid: int, sid: int, wire: ChunkWire, speed: float, index: int, urgent: bool,
                  deadline: float, deadline_from: float | None, spare: SpareTokens | None = None,
                  patient: bool = False) -> None:
        job = ChunkJob(self.chunk(wire), self.streams[sid], speed, index,
                       functools.partial(self.cancelled.__contains__, jid), deadline=deadline, urgent=urgent,
                       deadline_from=deadline_from, patient=patient)
        if spare is not None:
            job.grow = functools.partial(self._grow, jid)
        self.stage.submit(job)
        if spare is not None:  # only now: a submit that fails leaves nothing here
            self.growing[jid] = (job, spare.end, spare)
        self.live.add(jid)
        job.started.add_done_callback(functools.partial(self._started, jid))
        job.future.add_done_callback(functools.partial(self._done, jid))

    def on_cancel(self, jids: list[int]) -> None:
        # A chunk that finished here while its cancel was on the way has no job left to
        # check the id, so the id would stay in the set for good.
        self.cancelled.update(j for j in jids if j in self.live)
        if self.stage.drop_cancelled():
            # The queue shrank with no event to carry the counters (`queued`, `dropped`):
            # without a report of its own, the engine kept the last one while the stage idled.
            self._flush_soon()

    def on_expect(self, sid: int, due: float, round_s: float | None, urgent: bool) -> None:
        stream = self.streams.get(sid)
        if stream is not None:
            self.stage.expect_first_chunk(stream, due, round_s, urgent)

    def on_call(self, cid: int | None, method: str, args: tuple[Any, ...]) -> None:
        task = self.loop.create_task(self.call(cid, method, args))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def on_close(self) -> None:
        self.closing.set()

    async def call(self, cid: int | None, method: str, args: tuple[Any, ...]) -> None:
        try:
            if method not in CALLS:
                raise ValueError(f"unknown stage call {method!r}")
            args = tuple(self.chunk(a) if isinstance(a, ChunkWire) else a for a in args)
            value = getattr(self.stage, method)(*args)
            if asyncio.iscoroutine(value):
                value = await value
            reply = ("reply", cid, True, value)
        except Exception as exc:
            log.exception("audio stage call %s failed", method)
            reply = ("reply", cid, False, f"{method}: {type(exc).__name__}: {exc}")
        if cid is not None:
            self.send([reply])

    def chunk(self, wire: ChunkWire) -> FlowChunk:
        return FlowChunk(torch.from_numpy(wire.tokens), self.tensors[wire.prompt_feat], self.tensors[wire.embedding],
                         wire.num_prompt_tokens, wire.out_start, wire.finalize, wire.noise_offset)

    # Results: the stage resolves a batch's futures together; their callbacks run in the
    # next turn of the loop, and the flush scheduled by the first runs after them all.
    def _grow(self, jid: int, room: int) -> FlowChunk | None:
        """`ChunkJob.grow` of a chunk sent with its spare tokens."""
        job, end, spare = self.growing[jid]
        grown = grow_from_spare(job.flow, end, spare, room)
        if grown is None:
            return None
        chunk, end, finalize = grown
        self.growing[jid] = (job, end, spare)
        self.grown[jid] = (end, finalize)
        return chunk

    def _started(self, jid: int, future: asyncio.Future[BatchStart]) -> None:
        self.growing.pop(jid, None)  # its chunk is final now
        if not future.cancelled():
            start = future.result()
            self.started.append((jid, start.at, start.rows, start.past_due, self.grown.pop(jid, None)))
            self._flush_soon()

    def _done(self, jid: int, future: asyncio.Future[np.ndarray]) -> None:
        self.cancelled.discard(jid)
        self.live.discard(jid)
        self.growing.pop(jid, None)  # dropped before its batch started
        self.grown.pop(jid, None)
        if future.cancelled():
            return  # cancelled by the engine, which no longer waits for it
        exc = future.exception()
        if exc is None:
            self.done.append((jid, future.result()))
        else:
            self.failed.append((jid, f"{type(exc).__name__}: {exc}"))
        self._flush_soon()

    def _round(self, point: tuple[int, float]) -> None:
        self.rounds.append(point)
        self._flush_soon()

    def _flush_soon(self) -> None:
        if not self.flush_due:
            self.flush_due = True
            self.loop.call_soon(self.flush)

    def flush(self) -> None:
        self.flush_due = False
        events = ("events", self.started, self.done, self.failed, self.rounds, dict(vars(self.stage.stats)),
                  cuda_memory(torch.device(self.stage.device)))
        self.started, self.done, self.failed, self.rounds = [], [], [], []
        self.send([events])

    def send(self, batch: list[tuple[Any, ...]]) -> None:
        with contextlib.suppress(OSError):  # the engine is gone: the reader sees EOF and closes
            self.conn.send(batch)

    async def heartbeat(self, period: float) -> None:
        """Say, from this loop, that the process lives and how long its device work has run:
        a GPU hang stops the worker thread, not this loop, and shows as a growing time."""
        while True:
            await asyncio.sleep(period)
            self.send([("alive", self.stage.worker_busy_for())])


async def _serve(conn: Connection, stage: AudioStage, stall_timeout_s: float) -> None:
    server = _StageServer(conn, stage)
    try:
        await stage.start()
    except BaseException:
        server.send([("fatal", traceback.format_exc())])
        raise
    info = {"max_batch": stage.max_batch, "flow_cuda_graphs": stage.flow_cuda_graphs, "device": str(stage.device),
            "pid": os.getpid(),
            "mps": {k: os.environ[k] for k in (MPS_PERCENT_ENV, MPS_PRIORITY_ENV) if k in os.environ}}
    server.send([("ready", info)])
    freeze_startup_objects()  # this process serves until it is stopped: see `engine.heap`
    reader = threading.Thread(target=server.read, name="audio-stage-pipe", daemon=True)
    reader.start()
    beat = asyncio.create_task(server.heartbeat(heartbeat_period(stall_timeout_s))) if stall_timeout_s else None
    try:
        await server.closing.wait()
    finally:
        if beat is not None:
            beat.cancel()
        for task in list(server.tasks):
            task.cancel()
        await stage.close()
        with contextlib.suppress(OSError):
            conn.close()
