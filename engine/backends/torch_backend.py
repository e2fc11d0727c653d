"""Plain-PyTorch LM backend: one decode loop that batches every active request.

Structure
---------
* An asyncio task (`_run`) owns the schedule. Each iteration it admits waiting
  requests (up to `max_batch` rows) and hands one *step* to a worker thread with
  `asyncio.to_thread`, so the event loop never blocks on tensor math.
* A step (`_step`, worker thread, under `torch.inference_mode`) drops rows of
  finished/aborted requests, runs ONE batched decode step for every remaining row,
  then prefills the newly admitted requests one by one (each prefill samples that
  request's first token). All KV-cache and row bookkeeping happens only there, so it
  is never touched by two threads at once.
* Tokens travel back as `_Event`s and are pushed into each request's asyncio.Queue
  on the event-loop thread.

Per-request state (`_Request`) holds the sampling generator, generated tokens and
limits; the backend object holds only the schedule. Row order in the KV cache is
mirrored by `self._rows` (swap-remove on both sides).

Every row carries `feed`, the ids to append before its next sample: one token in
steady decoding (batched together), several for a prompt or a text block (run alone
at that row), none while a text-streaming request waits for text (it keeps its KV
row but takes no part in the step -- the batched forward gives it zero new inputs).

Text-in streaming (`generate_streaming`): the interleaving rules live in
`engine.bistream.BistreamState`. A pump task moves text arrivals into the request's
`inbox` on the loop thread; between steps, still on the loop thread, the inbox is
handed to the state machine and a waiting request gets its next run. The worker only
calls `token_rule`/`on_token`, so the state machine is never touched by two threads.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from engine.backends.base import LMRequest, SamplingParams
from engine.bistream import BistreamRequest, BistreamSpec, BistreamState, SpeechLimitReached
from engine.models.lm import CosyVoice3LM
from engine.models.qwen2 import KVCache
from engine.models.sampling import greedy, ras_sample_batch, suppress_stop_ids_, window_tensor
from engine.models.vocab import UnifiedVocab

_END = object()  # queue sentinel: the stream is over


@dataclass(eq=False)
class _Request:
    request: LMRequest | BistreamRequest
    queue: asyncio.Queue
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)
    feed: list[int] = field(default_factory=list)  # ids to append before the next sample
    finished: bool = False  # set by the worker (stop id / length limit / error)
    aborted: bool = False  # set on the loop thread (abort, aclose, cancel, close)
    # Text-in streaming only: the interleaving state and text not yet handed to it
    # (a list of arrivals; None marks the end of the text).
    stream: BistreamState | None = None
    inbox: list[list[int] | None] = field(default_factory=list)

    @property
    def params(self) -> SamplingParams:
        return self.request.sampling

    @property
    def limit(self) -> int:
        if self.stream is not None:
            return self.stream.limits.hard_max
        p = self.params
        return p.fixed_length if p.fixed_length is not None else p.max_tokens

    def stop_allowed(self) -> bool:
        p = self.params
        return p.fixed_length is None and len(self.tokens) >= p.min_tokens


@dataclass
class _Event:
    req: _Request
    token: int | None = None
    finished: bool = False
    error: BaseException | None = None


def _make_generator(seed: int | None) -> torch.Generator:
    gen = torch.Generator()
    if seed is None:
        gen.seed()  # fresh entropy from the OS; the global RNG is untouched
    else:
        gen.manual_seed(seed)
    return gen


class TorchLMBackend:
    name = "torch"

    def __init__(
        self,
        lm: CosyVoice3LM,
        vocab: UnifiedVocab,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        max_batch: int = 64,
    ) -> None:
        self._lm = lm
        self._vocab = vocab
        self._device = torch.device(device)
        self._dtype = dtype
        self.max_batch = max_batch
        self._pending: collections.deque[_Request] = collections.deque()
        self._active: dict[str, _Request] = {}  # admitted, not yet finished or aborted
        self._known: dict[str, _Request] = {}  # pending or active, by request id
        self._rows: list[_Request] = []  # worker-owned: request in each cache row
        self._cache: KVCache | None = None  # worker-owned
        self._wake = asyncio.Event()
        self._start_lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    # ------------------------------------------------------------------ public API

    async def start(self) -> None:
        async with self._start_lock:
            if self._task is not None:
                return
            # Moving weights can take seconds on a GPU: keep it off the event loop.
            await asyncio.to_thread(self._lm.to, device=self._device, dtype=self._dtype)
            self._lm.eval()
            self._closing = False
            self._task = asyncio.create_task(self._run(), name="torch-lm-decode-loop")

    async def generate(self, request: LMRequest) -> AsyncIterator[int]:
        """Async iterator of speech tokens. The request is submitted on the first
        `__anext__`; closing the iterator (aclose / consumer cancelled) aborts it."""
        await self.start()
        if request.request_id in self._known:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        req = _Request(request, asyncio.Queue(), _make_generator(request.sampling.seed))
        req.feed = list(request.prompt)
        self._known[request.request_id] = req
        self._pending.append(req)
        self._wake.set()
        try:
            async for item in self._drain(req):
                yield item
        finally:
            self._abort(req)

    @staticmethod
    async def _drain(req: _Request) -> AsyncIterator[int]:
        """Tokens the decode loop queued for `req`, until its end or its error."""
        while True:
            item = await req.queue.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    async def generate_streaming(
        self, request: BistreamRequest, text_source: AsyncIterator[list[int]]
    ) -> AsyncIterator[int]:
        """Speech tokens of one utterance whose raw text ids arrive from `text_source`
        (each item is one arrival; the end of the iterator is the end of the text).

        The request holds a KV row from admission to the end; while it waits for text
        it is left out of the decode steps. Closing this iterator aborts it and stops
        reading `text_source`."""
        await self.start()
        if request.request_id in self._known:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        state = request.new_state(BistreamSpec.from_lm_config(self._lm.cfg))
        req = _Request(request, asyncio.Queue(), _make_generator(request.sampling.seed), stream=state)
        self._known[request.request_id] = req
        pump = asyncio.create_task(self._pump_text(req, text_source), name=f"text-{request.request_id}")
        self._pending.append(req)
        self._wake.set()
        try:
            async for item in self._drain(req):
                yield item
        finally:
            pump.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await pump
            self._abort(req)

    async def _pump_text(self, req: _Request, text_source: AsyncIterator[list[int]]) -> None:
        try:
            async for ids in text_source:
                if req.aborted or req.finished:
                    return
                req.inbox.append([int(t) for t in ids])
                self._wake.set()
        except Exception as exc:  # a failing text source fails its utterance only
            if not (req.aborted or req.finished):
                # `aborted`, not `finished`: a step may be running in the worker thread,
                # which sets `finished` from the stream's state after its token; a
                # `finished` set here was overwritten, and the row held for good.
                req.aborted = True
                with contextlib.suppress(ValueError):
                    self._pending.remove(req)
                req.queue.put_nowait(exc)
                self._forget(req)
                self._wake.set()
            return
        req.inbox.append(None)
        self._wake.set()

    async def abort(self, request_id: str) -> None:
        req = self._known.get(request_id)
        if req is not None:
            self._abort(req)

    def num_active(self) -> int:
        return len(self._active)

    def server_times(self) -> None:
        return None  # its requests' times are the engine's own

    def num_pending(self) -> int:
        return len(self._pending)

    def blocked_on_text(self) -> bool:
        """Requests are queued while every row is held by a stream waiting for its next
        text: they wait on the clients' text, not on the LM (`Engine._watch_lm`). A view
        from the event loop while a step may run; a stale answer costs one check period."""
        rows = list(self._rows)
        return (bool(self._pending) and len(rows) >= self.max_batch
                and all(r.stream is not None and not r.feed and not r.stream.in_run for r in rows))

    async def close(self) -> None:
        for req in list(self._known.values()):
            self._abort(req)
        if self._task is not None:
            self._closing = True
            self._wake.set()
            await self._task  # lets an in-flight step finish; the thread cannot be killed
            self._task = None
        self._rows.clear()
        self._cache = None

    # ------------------------------------------------------------------ loop thread

    def _abort(self, req: _Request) -> None:
        """Idempotent: end `req`'s stream now; its row is freed before the next step."""
        if req.aborted or req.finished:
            self._forget(req)
            return
        req.aborted = True
        try:
            self._pending.remove(req)
        except ValueError:
            pass
        self._forget(req)
        while not req.queue.empty():  # tokens not yet consumed are dropped too
            req.queue.get_nowait()
        req.queue.put_nowait(_END)
        self._wake.set()  # its row is freed at the next step, even if nothing else runs

    def _forget(self, req: _Request) -> None:
        rid = req.request.request_id
        if self._active.get(rid) is req:
            del self._active[rid]
        if self._known.get(rid) is req:
            del self._known[rid]

    def _prepare_streams(self, reqs: list[_Request]) -> None:
        """Loop thread, between steps: hand text to the state machines and give each
        waiting stream its next run (or finish it)."""
        for req in reqs:
            st = req.stream
            if st is None or req.finished or req.aborted:
                continue
            for item in req.inbox:
                if item is None:
                    st.close_text()
                else:
                    st.push_text(item)
            req.inbox.clear()
            if req.feed or st.in_run or st.done:
                continue
            run = st.next_run()
            if run is not None:
                req.feed = list(run.feed)
            elif st.done:  # e.g. a fixed length already reached by the streamed part
                req.finished = True
                self._deliver([_Event(req, finished=True)])

    async def _run(self) -> None:
        while not self._closing:
            self._prepare_streams([*self._rows, *self._pending])
            runnable = any(r.feed or r.finished or r.aborted for r in self._rows)
            if not runnable and (not self._pending or len(self._rows) >= self.max_batch):
                self._wake.clear()
                await self._wake.wait()
                continue
            admit: list[_Request] = []
            while self._pending and len(self._rows) + len(admit) < self.max_batch:
                req = self._pending.popleft()
                if req.finished or req.aborted:
                    continue  # ended while it waited for a row (e.g. its text never came)
                self._active[req.request.request_id] = req
                admit.append(req)
            try:
                events = await asyncio.to_thread(self._step, admit)
            except Exception as exc:  # a bookkeeping bug: fail everyone, start clean
                events = [_Event(r, error=exc) for r in {*self._rows, *admit}]
                self._rows.clear()
                self._cache = None
            self._deliver(events)

    def _deliver(self, events: list[_Event]) -> None:
        for ev in events:
            req = ev.req
            if req.aborted:
                continue  # the consumer is gone; its stream already ended
            if ev.token is not None:
                req.queue.put_nowait(ev.token)
            if ev.error is not None:
                req.queue.put_nowait(ev.error)
            if ev.finished or ev.error is not None:
                if ev.error is None:
                    req.queue.put_nowait(_END)
                self._forget(req)

    # ------------------------------------------------------------------ worker thread

    @torch.inference_mode()
    def _step(self, admit: list[_Request]) -> list[_Event]:
        events: list[_Event] = []
        if self._cache is None:
            self._cache = self._lm.new_cache(rows=max(1, min(self.max_batch, 8)), length=256)
        self._drop_rows(lambda r: r.finished or r.aborted)

        for req in admit:
            if req.aborted:
                continue
            if req.limit <= 0:
                req.finished = True
                events.append(_Event(req, finished=True))
                continue
            self._cache.add_row()
            self._rows.append(req)

        rows = list(self._rows)
        # Steady decoding: every row with one id to feed, in ONE batched forward. Rows
        # with nothing (waiting for text) or several ids take no part (0 new inputs).
        singles = [i for i, r in enumerate(rows) if len(r.feed) == 1]
        if singles:
            try:
                everyone = len(singles) == len(rows)
                ids = torch.tensor([[r.feed[0] if len(r.feed) == 1 else 0] for r in rows], device=self._device)
                num_new = None if everyone else [1 if len(r.feed) == 1 else 0 for r in rows]
                hidden = self._lm(ids, self._cache, start_row=0, num_new=num_new)
                picked = [rows[i] for i in singles]
                sel = torch.tensor(singles, device=hidden.device)
                tokens = self._sample(self._lm.speech_logits(hidden[sel, -1]), picked)
                events += [self._advance(r, t) for r, t in zip(picked, tokens)]
            except Exception as exc:
                # The batch shares one forward pass: every row in it has failed, and
                # the cache may be half-written, so it is emptied.
                for r in rows:
                    r.finished = True
                events += [_Event(r, error=exc) for r in rows]
                self._rows.clear()
                self._cache.clear()
                return events

        # Prompts and text blocks: one row at a time (a prefill each).
        for row, req in enumerate(rows):
            if len(req.feed) < 2 or req.finished:
                continue
            try:
                prompt = torch.tensor([req.feed], dtype=torch.long, device=self._device)
                hidden = self._lm(prompt, self._cache, start_row=row)
                token = self._sample(self._lm.speech_logits(hidden[:, -1]), [req])[0]
                events.append(self._advance(req, token))
            except Exception as exc:
                req.finished = True  # its row (maybe half-written) is dropped below
                events.append(_Event(req, error=exc))

        self._drop_rows(lambda r: r.finished)
        return events

    def _drop_rows(self, should_drop: Callable[[_Request], bool]) -> None:
        assert self._cache is not None
        for row in range(len(self._rows) - 1, -1, -1):
            if should_drop(self._rows[row]):
                self._cache.remove_row(row)
                self._rows[row] = self._rows[-1]
                self._rows.pop()

    def _advance(self, req: _Request, token: int) -> _Event:
        if req.stream is not None:
            return self._advance_stream(req, token)
        if token >= self._vocab.speech_token_size:
            req.finished = True
            req.feed = []
            return _Event(req, finished=True)  # stop ids are never yielded
        req.tokens.append(token)
        req.feed = [token]
        req.finished = len(req.tokens) >= req.limit
        return _Event(req, token=token, finished=req.finished)

    def _advance_stream(self, req: _Request, token: int) -> _Event:
        st = req.stream
        assert st is not None
        emitted = st.on_token(token)
        # A speech token inside a run is fed back; after a fill the request waits
        # for its next run (set on the loop thread), after the end it is done.
        req.feed = [emitted] if (emitted is not None and st.in_run) else []
        if emitted is not None:
            req.tokens.append(emitted)
        req.finished = st.done
        if st.cut_short:
            return _Event(req, token=emitted, error=SpeechLimitReached(st.limits.hard_max))
        return _Event(req, token=emitted, finished=st.done)

    def _sample(self, logits: Tensor, reqs: list[_Request]) -> list[int]:
        """Per-row sampling on the CPU with each request's own generator (a few
        KB per row to copy; keeps results identical across devices for a seed)."""
        logits = logits.float().cpu()
        rules = [r.stream.token_rule() if r.stream is not None else None for r in reqs]
        no_stop = torch.tensor([not r.stop_allowed() if rule is None else not rule.allow_stop
                                for r, rule in zip(reqs, rules)])
        # Streams may sample `fill` (a request for more text) while stops are masked.
        fill_rows = [i for i, rule in enumerate(rules) if rule is not None and rule.allow_fill and not rule.allow_stop]
        fill_id = self._lm.cfg.fill_token
        kept = logits[fill_rows, fill_id].clone() if fill_rows else None
        suppress_stop_ids_(logits, self._vocab.speech_token_size, no_stop)
        if kept is not None:
            logits[fill_rows, fill_id] = kept
        out = greedy(logits)
        ras = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if ras:
            ps = [reqs[i].params for i in ras]
            # The RAS window: generated tokens (streams: fills included, as officially).
            recent = [reqs[i].stream.history if reqs[i].stream is not None else reqs[i].tokens for i in ras]
            windows = window_tensor(
                [h[-p.win_size :] if p.win_size > 0 else [] for h, p in zip(recent, ps)],
                max(p.win_size for p in ps),
            )
            uniforms = torch.stack([torch.rand(2, generator=reqs[i].generator) for i in ras])
            out[ras] = ras_sample_batch(
                logits[ras],
                windows,
                uniforms,
                top_p=torch.tensor([p.top_p for p in ps]),
                top_k=torch.tensor([p.top_k for p in ps]),
                repeat_threshold=torch.tensor([p.win_size * p.tau_r for p in ps]),
            )
        for i, rule in enumerate(rules):
            if rule is not None and rule.forced is not None:
                out[i] = rule.forced
        return out.tolist()
