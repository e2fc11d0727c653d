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
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from engine.backends.base import LMRequest, SamplingParams
from engine.models.lm import CosyVoice3LM
from engine.models.qwen2 import KVCache
from engine.models.sampling import greedy, ras_sample_batch, suppress_stop_ids_, window_tensor
from engine.models.vocab import UnifiedVocab

_END = object()  # queue sentinel: the stream is over


@dataclass(eq=False)
class _Request:
    request: LMRequest
    queue: asyncio.Queue
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)
    next_input: int | None = None  # last sampled token, fed at the next decode step
    finished: bool = False  # set by the worker (stop id / length limit / error)
    aborted: bool = False  # set on the loop thread (abort, aclose, cancel, close)

    @property
    def params(self) -> SamplingParams:
        return self.request.sampling

    @property
    def limit(self) -> int:
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
        self._known[request.request_id] = req
        self._pending.append(req)
        self._wake.set()
        try:
            while True:
                item = await req.queue.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self._abort(req)

    async def abort(self, request_id: str) -> None:
        req = self._known.get(request_id)
        if req is not None:
            self._abort(req)

    def num_active(self) -> int:
        return len(self._active)

    def num_pending(self) -> int:
        return len(self._pending)

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

    def _forget(self, req: _Request) -> None:
        rid = req.request.request_id
        if self._active.get(rid) is req:
            del self._active[rid]
        if self._known.get(rid) is req:
            del self._known[rid]

    async def _run(self) -> None:
        while not self._closing:
            if not self._rows and not self._pending:
                self._wake.clear()
                await self._wake.wait()
                continue
            admit: list[_Request] = []
            while self._pending and len(self._rows) + len(admit) < self.max_batch:
                req = self._pending.popleft()
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

        if self._rows:
            rows = list(self._rows)
            try:
                ids = torch.tensor([[r.next_input] for r in rows], device=self._device)
                hidden = self._lm(ids, self._cache, start_row=0)
                tokens = self._sample(self._lm.speech_logits(hidden[:, -1]), rows)
                events += [self._advance(r, t) for r, t in zip(rows, tokens)]
            except Exception as exc:
                # The batch shares one forward pass: every row in it has failed, and
                # the cache may be half-written, so it is emptied.
                for r in rows:
                    r.finished = True
                events += [_Event(r, error=exc) for r in rows]
                self._rows.clear()
                self._cache.clear()

        for req in admit:
            if req.aborted:
                continue
            if req.limit <= 0:
                req.finished = True
                events.append(_Event(req, finished=True))
                continue
            row = self._cache.add_row()
            self._rows.append(req)
            try:
                prompt = torch.tensor([req.request.prompt], dtype=torch.long, device=self._device)
                hidden = self._lm(prompt, self._cache, start_row=row)
                token = self._sample(self._lm.speech_logits(hidden[:, -1]), [req])[0]
                events.append(self._advance(req, token))
            except Exception as exc:
                req.finished = True
                events.append(_Event(req, error=exc))
                self._cache.remove_row(row)
                self._rows.pop()

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
        if token >= self._vocab.speech_token_size:
            req.finished = True
            return _Event(req, finished=True)  # stop ids are never yielded
        req.tokens.append(token)
        req.next_input = token
        req.finished = len(req.tokens) >= req.limit
        return _Event(req, token=token, finished=req.finished)

    def _sample(self, logits: Tensor, reqs: list[_Request]) -> list[int]:
        """Per-row sampling on the CPU with each request's own generator (a few
        KB per row to copy; keeps results identical across devices for a seed)."""
        logits = logits.float().cpu()
        no_stop = torch.tensor([not r.stop_allowed() for r in reqs])
        suppress_stop_ids_(logits, self._vocab.speech_token_size, no_stop)
        out = greedy(logits)
        ras = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if ras:
            ps = [reqs[i].params for i in ras]
            windows = window_tensor(
                [reqs[i].tokens[-p.win_size :] if p.win_size > 0 else [] for i, p in zip(ras, ps)],
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
        return out.tolist()
