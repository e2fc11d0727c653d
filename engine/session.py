"""A session's utterances, each text -> speech tokens -> audio chunks, delivered in order.

Per utterance three things run concurrently: the LM request (tokens in), the chunker
(turns tokens into flow/vocoder jobs on the shared `AudioStage`, one at a time), and
the session's delivery loop (forwards chunks in order). The next utterance's LM request
starts as soon as the previous one's LM finishes, so its tokens are ready before the
previous audio ends (no gap between segments).

The `Engine` (`engine.engine`) owns what sessions share: the LM backend, the audio stage,
the first-chunk planner and the counters behind `Engine.stats`; a session reads and
updates those through its `engine`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Callable, cast

import torch

from .backends.base import LMRequest, SamplingParams
from .bistream import BistreamRequest, LengthLimits, SpeechLimitReached, TextInLM
from .chunking import ChunkSchedule, SpareTokens, chunk_frames, grown_end, patient_target, window_start
from .errors import EngineError, released
from .first_chunk import SPEECH_TOKENS_PER_S
from .frontend.text import detect_grammar, language_grammar
from .models.flow import FlowChunk
from .models.lm import build_prompt, length_limits
from .playback import PlaybackClock, chunk_due
from .stats import is_slow_opening
from .text_stream import TextFeed
from .token2wav import BatchStart, ChunkJob
from .types import AudioChunk, SessionOptions, UtteranceError, UtteranceStats, VoicePrompt

if TYPE_CHECKING:  # engine.py imports this module: the type only, not at run time
    from .engine import Engine

log = logging.getLogger(__name__)

# FSQ codes of silence and breath (CosyVoice3Model.silent_tokens); runs longer than
# MAX_SILENT are dropped so the model cannot stall in silence.
SILENT_TOKENS = frozenset({1, 2, 28, 29, 55, 248, 494, 2241, 2242, 2322, 2323})
MAX_SILENT = 5
# An utterance's LM rate, for its first chunk's size, is measured over this many first tokens
# at most (`_lm_step`).
RATE_TOKENS = 64
# ... and for the planner's `LMSteps`, from this token on (`_learn_lm_step`): past the
# prompt's prefill and a burst's first steps, which share the GPU with the others' prefills.
STEP_FROM = 8


async def _next_handed(handed: asyncio.Queue[_Queued], producer: asyncio.Task) -> _Queued | None:
    """The next chunk the chunker queued, or None once it has ended without queueing more
    (a cancelled utterance); raises the chunker's error."""
    if handed.empty() and not producer.done():
        getter = asyncio.ensure_future(handed.get())
        try:
            await asyncio.wait({getter, producer}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            getter.cancel()  # a getter woken but not yet run leaves its item in the queue
        if getter.done() and not getter.cancelled():
            return getter.result()
    if not handed.empty():
        return handed.get_nowait()
    if not producer.cancelled() and producer.exception() is not None:
        raise producer.exception()  # type: ignore[misc]
    return None


async def _held_to(tokens: AsyncIterator[int], limit: int) -> AsyncIterator[int]:
    """`tokens`, a stream whose length was capped at `limit` below the model's own maximum
    (the LM's context window): reaching it cut the speech short of its text, which raises
    `SpeechLimitReached` instead of ending the stream as if the speech were whole."""
    count = 0
    async with contextlib.aclosing(tokens):
        async for tok in tokens:
            count += 1
            yield tok
    if count >= limit:
        raise SpeechLimitReached(limit, streaming=False)


def _lm_step(utt: "_Utterance") -> float:
    """Seconds per speech token the LM gives this utterance now (inf: unknown), over the
    later half of its first tokens: in a burst of new sessions the first steps share the
    GPU with the others' prompts and are slower than the rest will be."""
    times = utt.token_times
    if len(times) < 4:
        return math.inf
    half = len(times) // 2
    return (times[-1] - times[half]) / (len(times) - 1 - half)


def _learn_lm_step(eng: "Engine", utt: "_Utterance") -> None:
    """Tell the first-chunk planner this utterance's LM rate from its STEP_FROM-th token to
    its latest timed one, with the utterances decoding then (the mean of that count at both
    ends). Not for text-in streaming, whose LM waits for its text; nor over fewer tokens
    than STEP_FROM, where one output bringing several tokens at once would make the rate."""
    times = utt.token_times
    steps = len(times) - 1 - STEP_FROM
    if utt.feed is not None or utt.lm_streams_from is None or steps < STEP_FROM:
        return
    eng.first_chunks.learn_lm_step((utt.lm_streams_from + eng.lm_streams) / 2,
                                   (times[-1] - times[STEP_FROM]) / steps, utt.opening)


@dataclass
class _Wake:
    """When an utterance's LM consumer wakes its chunker: once this many tokens exist."""

    at: int = 0


@dataclass
class _Extent:
    """A queued chunk's last token (exclusive) and whether it is the utterance's last
    chunk: set by the chunker, possibly grown by the stage (`ChunkJob.grow`) before the
    chunk runs."""

    end: int
    finalize: bool

    def grown_to(self, end: int, finalize: bool) -> None:
        """`ChunkJob.grown_to`: what a stage in another process grew the chunk to."""
        self.end, self.finalize = end, finalize


@dataclass
class _Queued:
    """A chunk handed to the audio stage, as its utterance's deliverer needs it: the job
    (whose future brings the audio), its place in the utterance, and what it was queued
    with (`extent` may still grow until the stage takes the chunk)."""

    job: ChunkJob
    index: int
    extent: _Extent
    queued_at: float
    queued_end: int
    queued_final: bool
    staged: int  # utterances on its stage when it was queued (`SecondRounds`)
    patient: bool = False  # cut big, its audio not due soon (`engine.chunk_patience_s`)


@dataclass
class _Utterance:
    uid: str
    text: str
    options: SessionOptions
    queue: asyncio.Queue  # AudioChunk | UtteranceError | None (end)
    stats: UtteranceStats
    cancelled: bool = False
    # Failed: its chunks still queued on the stage are dropped like a cancelled one's
    # (`ChunkJob.is_cancelled`), but its error is still delivered.
    failed: bool = False
    lm_done: asyncio.Event = None  # type: ignore[assignment]
    task: asyncio.Task | None = None
    request_id: str = ""
    feed: TextFeed | None = None  # text-in streaming: the text arrives through this
    language: str | None = None  # its normalisation's language hint (`Session._submit`)
    opening: bool = False  # its session's first utterance
    # What of it is still to be heard, for the deadlines of the session's later chunks
    # (`Session._audio_ahead`): its speech tokens so far (the LM consumer's list), and the
    # samples delivered and made but not yet delivered.
    tokens: list[int] = field(default_factory=list)
    # When each of its first RATE_TOKENS speech tokens came (`_lm_step`), and how many
    # utterances were decoding when its STEP_FROM-th came (`_learn_lm_step`).
    token_times: list[float] = field(default_factory=list)
    lm_streams_from: int | None = None
    # When each speech token came, kept for an opening utterance only (until its second
    # chunk is done: `SecondChunkTimes`).
    arrivals: list[float] | None = None
    delivered: int = 0
    undelivered: int = 0
    made_tokens: int = 0  # speech tokens whose audio is made (queued for delivery or delivered)
    first_chunk_pending: bool = False  # counted in Engine.first_chunks_pending (`_first_chunk_awaited`)


class Session:
    """One stream of utterances with one voice; audio comes out in submission order."""

    def __init__(self, engine: Engine, voice: VoicePrompt, options: SessionOptions, session_id: str):
        self.engine = engine
        self.voice = voice
        self.options = options
        self.session_id = session_id
        self._utts: dict[str, _Utterance] = {}
        self._stats: dict[str, UtteranceStats] = {}
        self._order: asyncio.Queue[_Utterance | None] = asyncio.Queue()
        self._events: asyncio.Queue[AudioChunk | UtteranceError | None] = asyncio.Queue(maxsize=256)
        self._prev_lm_done: asyncio.Event | None = None
        # The grammar its last text with letters was read with: a segment without letters
        # ("42", "1999") is read like the text around it, not by a guess of its own.
        self._grammar: str | None = None
        # The listener's playback of this session's audio, as delivered in order: a later
        # utterance's first chunk is not urgent while earlier audio is still playing.
        self.playback = PlaybackClock(engine.sample_rate)
        self._finished = False
        self._closed = False
        # Audio made and not yet taken by `events()`'s consumer is held here: an utterance
        # with `max_unread_audio_s` of it ahead makes no more (`_held_back`), so a consumer
        # that reads slowly does not have the whole text made.
        self._events_samples = 0  # audio in `_events`
        self._room = asyncio.Event()
        self._deliver = asyncio.create_task(self._deliver_loop(), name=f"deliver-{session_id}")

    def active_utterances(self) -> int:
        return sum(1 for u in self._utts.values() if u.task is not None and not u.task.done())

    async def submit(self, text: str, options: SessionOptions | None = None, utterance_id: str | None = None) -> str:
        return self._submit(text, None, options, utterance_id)

    async def submit_stream(
        self, options: SessionOptions | None = None, utterance_id: str | None = None
    ) -> tuple[str, TextFeed]:
        """An utterance whose text arrives while it is spoken: `feed.append(text)` as
        it comes, `feed.close()` at its end. The LM starts on the first words
        (`engine.bistream`); audio comes out in submission order like `submit`'s."""
        if not hasattr(self.engine.backend, "generate_streaming"):  # not a `TextInLM`
            raise EngineError("unsupported", f"the {self.engine.backend.name} backend has no text-in streaming")
        refusal = getattr(self.engine.backend, "streaming_input_refusal", lambda: None)()
        if refusal is not None:
            raise EngineError("unsupported", refusal)
        feed = TextFeed(self.engine.tokenizer.encode)
        return self._submit("", feed, options, utterance_id), feed

    def _submit(self, text: str, feed: TextFeed | None, options: SessionOptions | None, utterance_id: str | None) -> str:
        if self._finished or self._closed:
            raise EngineError("session_closed", "session no longer accepts text")
        uid = utterance_id or uuid.uuid4().hex[:12]
        if uid in self._stats:
            raise EngineError("duplicate_utterance", f"utterance id {uid!r} already used in this session")
        opts = options or self.options
        utt = _Utterance(uid, text, opts, asyncio.Queue(maxsize=64), UtteranceStats(submitted_at=time.monotonic()))
        utt.feed = feed
        utt.language = opts.language
        if feed is None and language_grammar(opts.language) is None:
            found = detect_grammar(text)
            utt.language = found or self._grammar
            self._grammar = found or self._grammar
        utt.opening = not self._stats
        utt.arrivals = [] if utt.opening else None
        utt.lm_done = asyncio.Event()
        self._utts[uid] = utt
        self._stats[uid] = utt.stats
        prev = self._prev_lm_done
        self._prev_lm_done = utt.lm_done
        utt.task = asyncio.create_task(self._run(utt, prev), name=f"utt-{uid}")
        self._order.put_nowait(utt)
        return uid

    def utterance_stats(self, uid: str) -> UtteranceStats | None:
        return self._stats.get(uid)

    async def events(self) -> AsyncIterator[AudioChunk | UtteranceError]:
        while True:
            ev = await self._events.get()
            if ev is None:
                return
            if isinstance(ev, AudioChunk):
                self._events_samples -= len(ev.pcm)
                self._room.set()
            yield ev

    async def cancel(self, utterance_id: str | None = None) -> None:
        targets = list(self._utts.values()) if utterance_id is None else [self._utts[utterance_id]] if utterance_id in self._utts else []
        requests: list[str] = []
        # Every target is marked and its task cancelled before the first await: an LM abort
        # that raises (a dead vLLM engine core) or a cancel of the caller must not leave
        # later utterances running.
        for u in targets:
            if u.cancelled:
                continue
            u.cancelled = True
            u.lm_done.set()  # let a following utterance start its LM at once
            if u.task is not None and not u.task.done():
                u.task.cancel()
            if u.request_id:
                requests.append(u.request_id)
        # Queued GPU work of cancelled utterances goes now, not at the next batch.
        self.engine.stage.drop_cancelled()
        self._room.set()  # their audio no longer holds later utterances back
        for request_id in requests:
            try:
                await self.engine.backend.abort(request_id)
            except Exception:
                log.exception("aborting LM request %s failed", request_id)

    async def finish(self) -> None:
        """No more text; events() ends after the last submitted utterance is delivered."""
        if not self._finished:
            self._finished = True
            self._order.put_nowait(None)

    async def abort(self) -> None:
        self._closed = True  # no submit from here on: nothing would cancel or deliver it
        try:
            await self.cancel(None)
        finally:
            self._end_after_abort()
        await asyncio.wait([self._deliver])  # let the delivery loop unwind; never raises

    def _end_after_abort(self) -> None:
        """What an abort must do even when cancelling failed part-way: no more text, no
        more delivery, the end marker for events(), the engine's count."""
        if not self._finished:
            self._finished = True
            self._order.put_nowait(None)
        # A cancelled delivery loop runs no statement past its current await (its `finally`
        # only counts the session ended), so nothing is put after the end marker below.
        self._deliver.cancel()
        # events() consumers must see the end even when the delivery loop was mid-put.
        while True:
            try:
                self._events.put_nowait(None)
                break
            except asyncio.QueueFull:
                self._events.get_nowait()
        self.engine._session_ended(self)

    # ------------------------------------------------------------ internals
    async def _deliver_loop(self) -> None:
        try:
            while True:
                utt = await self._order.get()
                if utt is None:
                    break
                while True:
                    if utt.cancelled:
                        break
                    item = await utt.queue.get()
                    if item is None or utt.cancelled:
                        break
                    await self._events.put(item)
                    if isinstance(item, AudioChunk):
                        self._events_samples += len(item.pcm)
                        utt.undelivered -= len(item.pcm)
                        utt.delivered += len(item.pcm)
                        self.playback.deliver(len(item.pcm), time.monotonic())
                    # The last chunk or an error ends the utterance, sentinel or not.
                    if isinstance(item, UtteranceError) or item.is_last:
                        break
                self._utts.pop(utt.uid, None)
            await self._events.put(None)
        finally:
            self.engine._session_ended(self)

    async def _run(self, utt: _Utterance, prev_lm_done: asyncio.Event | None) -> None:
        eng = self.engine
        try:
            if prev_lm_done is not None:
                await prev_lm_done.wait()
            await self._synthesize(utt)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not utt.cancelled and task is not None and not task.cancelling():
                # Not this utterance's cancel: a chunk's future cancelled under it (the stage
                # closing), which must not end it as if it were whole.
                await self._fail(utt, UtteranceError(utt.uid, "engine_closed", "the engine closed before the "
                                                     "utterance was done"))
        # The error's traceback is dropped once reported: it holds the chunker's frames, which
        # hold the task (or the chunk's future) holding the error, a cycle that kept the
        # utterance's vocoder stream (`live_utterances`, its state) until a full collection.
        except EngineError as exc:
            await self._fail(utt, UtteranceError(utt.uid, exc.code, str(released(exc))))
        except SpeechLimitReached as exc:
            await self._fail(utt, UtteranceError(utt.uid, "speech_too_long", str(released(exc))))
        except Exception as exc:  # one utterance fails; the session and engine go on
            log.exception("utterance %s failed", utt.uid)
            await self._fail(utt, UtteranceError(utt.uid, "engine_error", f"{type(exc).__name__}: {released(exc)}"))
        finally:
            utt.lm_done.set()
            if utt.request_id:
                with contextlib.suppress(Exception):
                    await eng.backend.abort(utt.request_id)
            with contextlib.suppress(asyncio.QueueFull):
                utt.queue.put_nowait(None)
            if utt.cancelled:
                # unblock a deliverer waiting on this queue
                with contextlib.suppress(asyncio.QueueFull):
                    utt.queue.put_nowait(None)

    async def _fail(self, utt: _Utterance, error: UtteranceError) -> None:
        """End `utt` with `error`: its chunks still queued on the stage (the chunker queues
        the next one as the stage takes the one before) go now rather than run for nobody."""
        utt.failed = True
        self.engine.stage.drop_cancelled()
        await self._put(utt, error)

    async def _put(self, utt: _Utterance, item: AudioChunk | UtteranceError) -> None:
        if not utt.cancelled:
            if isinstance(item, AudioChunk):
                utt.undelivered += len(item.pcm)
            await utt.queue.put(item)

    def _audio_ahead(self, utt: _Utterance) -> float:
        """Seconds of this session's audio that play before `utt`'s next chunk and are not
        delivered yet: its own audio made and still queued, and every earlier utterance's
        whole audio less what was delivered of it (an earlier utterance's LM is done before
        this one's starts, so its length is known: 1 / SPEECH_TOKENS_PER_S s a token at
        speed 1). Cancelled ones are never heard."""
        rate = self.engine.sample_rate
        samples = 0.0
        for u in self._utts.values():  # submission order: the order they play in
            if u is utt:
                samples += u.undelivered
                break
            if not u.cancelled:
                samples += max(0.0, len(u.tokens) * rate / SPEECH_TOKENS_PER_S / u.options.speed - u.delivered)
        return samples / rate

    def _sampling(self, opts: SessionOptions, min_tokens: int = 0, max_tokens: int = 2000, fixed: int | None = None) -> SamplingParams:
        eng = self.engine
        samp = eng.model.config.lm.sampling
        return SamplingParams(
            top_p=samp.top_p,
            top_k=samp.top_k,
            win_size=samp.win_size,
            tau_r=samp.tau_r,
            greedy=opts.greedy,
            seed=opts.seed if opts.seed is not None else eng.config.seed,
            min_tokens=min_tokens,
            max_tokens=max_tokens,
            fixed_length=fixed,
        )

    async def _synthesize_stream(self, utt: _Utterance) -> None:
        """Text-in streaming: one LM generation fed with text as it arrives."""
        eng, opts, voice = self.engine, utt.options, self.voice
        assert utt.feed is not None
        try:
            prompt_text, prompt_speech = eng.lm_prefix(voice, opts)
        except ValueError as exc:
            raise EngineError("bad_options", str(exc)) from exc
        lm_cfg = eng.model.config.lm
        ratio = opts.tokens_per_text_token if opts.tokens_per_text_token is not None else eng.config.tokens_per_text_token
        limits = LengthLimits(
            min_ratio=lm_cfg.min_token_text_ratio,
            max_ratio=lm_cfg.max_token_text_ratio,
            fixed_ratio=ratio,
            # vLLM must fit prompt + text + speech into its context window.
            hard_max=max(1, eng.config.vllm_max_model_len - len(prompt_text) - len(prompt_speech) - 512),
        )
        utt.request_id = f"{self.session_id}-{utt.uid}"
        request = BistreamRequest(utt.request_id, tuple(prompt_text), tuple(prompt_speech), self._sampling(opts), limits)
        feed = utt.feed
        backend = cast(TextInLM, eng.backend)  # `submit_stream` checked it
        try:
            await self._speak(utt, lambda: backend.generate_streaming(request, eng.lm_watch.text(feed.arrivals())))
        except ValueError as exc:  # e.g. no <|endofprompt|> in the prompt
            raise EngineError("bad_options", str(exc)) from exc
        if feed.first_text_at is not None:
            utt.stats.extra["first_text_at"] = feed.first_text_at

    async def _synthesize(self, utt: _Utterance) -> None:
        if utt.feed is not None:
            return await self._synthesize_stream(utt)
        eng, opts, voice = self.engine, utt.options, self.voice
        text_ids = await asyncio.to_thread(eng.text_ids, utt.text, utt.language)
        if not text_ids:
            raise EngineError("empty_text", "nothing to speak after normalisation")
        utt.stats.num_text_tokens = len(text_ids)
        try:
            prompt_text, prompt_speech = eng.lm_prefix(voice, opts)
        except ValueError as exc:  # e.g. an empty instruction
            raise EngineError("bad_options", str(exc)) from exc
        lm_cfg = eng.model.config.lm
        prompt = build_prompt(lm_cfg, prompt_text, text_ids, prompt_speech)
        counted = len(text_ids)
        if opts.mode == "cross_lingual" and eng.model.config.version == "cosyvoice3":
            # The official cross-lingual call carries "You are a helpful assistant.
            # <|endofprompt|>" in the text to speak, so its length limits count it.
            counted += len(prompt_text)
        min_tokens, max_tokens = length_limits(lm_cfg, counted)
        fixed = None
        ratio = opts.tokens_per_text_token if opts.tokens_per_text_token is not None else eng.config.tokens_per_text_token
        if ratio is not None:
            fixed = max(1, int(round(ratio * len(text_ids))))
        # vLLM must fit the prompt and the speech into its context window, and stops a
        # request quietly at its edge ("length"): a segment that cannot be spoken whole is
        # refused, and one whose speech may run past the edge is cut there with an error,
        # never as a complete utterance. The torch backend is held to the same bound.
        room = eng.config.vllm_max_model_len - len(prompt)
        need = fixed if fixed is not None else min_tokens
        if need > room:
            raise EngineError("text_too_long", f"its {len(text_ids)} text tokens need at least {need} speech tokens, "
                              f"and {max(room, 0)} fit the LM's context of {eng.config.vllm_max_model_len} tokens "
                              "beside the voice's prompt; send shorter segments")
        capped = fixed is None and max_tokens > room
        max_tokens = min(max_tokens, room)
        sampling = self._sampling(opts, min_tokens, max_tokens, fixed)
        utt.request_id = f"{self.session_id}-{utt.uid}"
        request = LMRequest(utt.request_id, tuple(prompt), sampling)
        if capped:
            await self._speak(utt, lambda: _held_to(eng.backend.generate(request), max_tokens))
        else:
            await self._speak(utt, lambda: eng.backend.generate(request))

    async def _speak(self, utt: _Utterance, lm_stream) -> None:
        """Speech tokens from `lm_stream()` -> chunker -> audio stage, concurrently."""
        eng = self.engine
        tokens = utt.tokens
        more = asyncio.Event()
        # The chunker sleeps until `wake.at` tokens exist (its next chunk's need), not one
        # wake-up per token: at 64 sessions that is thousands of task switches a second on
        # the event loop the audio stage and every WebSocket share.
        wake = _Wake()

        async def consume() -> None:
            silent_run = 0
            eng.lm_streams += 1
            eng.lm_watch.opened()
            try:
                async for tok in lm_stream():
                    eng.lm_watch.token()
                    if utt.stats.first_token_at is None:
                        utt.stats.first_token_at = time.monotonic()
                    if len(utt.token_times) < RATE_TOKENS:
                        utt.token_times.append(time.monotonic())
                        if len(utt.token_times) == STEP_FROM + 1:
                            utt.lm_streams_from = eng.lm_streams
                        elif len(utt.token_times) == RATE_TOKENS:
                            _learn_lm_step(eng, utt)
                    eng.lm_tokens += 1
                    if tok in eng.silent_tokens:
                        silent_run += 1
                        if silent_run > MAX_SILENT:
                            continue
                    else:
                        silent_run = 0
                    if utt.arrivals is not None:  # token i of `tokens` came at arrivals[i]
                        utt.arrivals.append(time.monotonic())
                    tokens.append(tok)
                    if len(tokens) >= wake.at:
                        more.set()
            finally:
                if len(utt.token_times) < RATE_TOKENS:  # it ended before: learn from what it gave
                    _learn_lm_step(eng, utt)
                eng.lm_streams -= 1
                eng.lm_watch.closed()
                utt.lm_done.set()
                more.set()

        lm_task = asyncio.create_task(consume(), name=f"lm-{utt.uid}")
        try:
            await self._chunk_loop(utt, tokens, more, wake, lm_task)
        finally:
            if not lm_task.done():
                lm_task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await lm_task

    async def _chunk_loop(self, utt: _Utterance, tokens: list[int], more: asyncio.Event, wake: "_Wake",
                          lm_task: asyncio.Task) -> None:
        """Speech tokens -> chunks on the audio stage (`_queue_chunks`) and, concurrently,
        their audio in order -> the utterance's queue (`_deliver_chunks`). A chunk is queued
        once the stage took the one before it and its tokens are generated, not once the
        one before it has its audio back: in a burst, the round after the first chunks
        then holds every session's second chunk instead of starting without them."""
        stream = self.engine.stage.new_stream()
        # One chunk between the two: the stage holds at most two of the utterance's chunks
        # beyond the one being delivered, however slow the listener.
        handed: asyncio.Queue[_Queued] = asyncio.Queue(maxsize=1)
        producer = asyncio.create_task(self._queue_chunks(utt, tokens, more, wake, lm_task, stream, handed),
                                       name=f"chunks-{utt.uid}")
        try:
            await self._deliver_chunks(utt, handed, producer)
        finally:
            self._first_chunk_queued(utt)
            if not producer.done():  # no await otherwise: the utterance ends as its last chunk goes out
                producer.cancel()
                await asyncio.wait({producer})
            if not producer.cancelled():
                producer.exception()  # raised by the deliverer already, if it was one

    def _first_chunk_awaited(self, utt: _Utterance) -> None:
        """Count the utterance among those whose listener waits for their first chunk
        (`Engine.first_chunks_pending`), once. Not from its start: a session's next
        utterance begins while the one before it plays, and its first chunk waits for
        more tokens (`chunk_patience_s`) rather than competing for the next round. Counted
        from its start, such chunks kept the crowd gate (`min_hop_crowd`) shut for 58-61
        of 64 sessions arriving over 16 s (round 29 of docs/benchmarks.md)."""
        if not utt.first_chunk_pending:
            utt.first_chunk_pending = True
            self.engine.first_chunks_pending += 1

    def _first_chunk_queued(self, utt: _Utterance) -> None:
        if utt.first_chunk_pending:
            utt.first_chunk_pending = False
            self.engine.first_chunks_pending -= 1

    async def _queue_chunks(self, utt: _Utterance, tokens: list[int], more: asyncio.Event, wake: "_Wake",
                            lm_task: asyncio.Task, stream: object, handed: asyncio.Queue[_Queued]) -> None:
        """Cut the utterance's tokens into chunks as they come (`ChunkSchedule`) and queue
        each on the stage, once the stage has taken the previous one (from then its
        extent is final: the stage grows a chunk only before it runs)."""
        eng, voice, opts = self.engine, self.voice, utt.options
        cfg = eng.config
        flow_cfg = eng.model.config.flow
        P = voice.num_tokens
        sched = ChunkSchedule(
            prompt_tokens=P,
            initial_hop=opts.initial_hop if opts.initial_hop is not None else cfg.initial_hop,
            max_hop=opts.max_hop if opts.max_hop is not None else cfg.max_hop,
            lookahead=flow_cfg.pre_lookahead_len,
        )
        prompt_tokens = voice.speech_tokens
        first_planned = opts.initial_hop is not None  # a request's own first hop is kept
        announced_again = False  # the first chunk's announcement renewed (`hold_refresh`)
        # ... and so is a request's own schedule: no chunk cut by timing (patience) then.
        may_wait = opts.initial_hop is None and opts.max_hop is None
        look = flow_cfg.pre_lookahead_len
        # Whether nothing else is on the engine is known when the first chunk is sized, and
        # the planner may go below the floor then (`first_chunk_min_hop`): until then the
        # schedule waits for the fewest tokens the first chunk may take.
        # ... as the utterance starts (`tune`), and so is whether its first chunk is planned:
        # a limit tuned to the floor or below is a fixed first chunk, as one configured so.
        busy_floor, idle_floor = None, eng.first_chunks.idle_hop
        if not first_planned and 0 < cfg.initial_hop < eng.first_chunks.limit:
            lowest = min(h for h in (idle_floor, eng.first_chunks.min_hop, cfg.initial_hop) if h > 0)
            if lowest < cfg.initial_hop:
                busy_floor, sched.initial_hop = cfg.initial_hop, lowest
        while not utt.cancelled:
            if self._held_back(utt):
                self._room.clear()
                await self._room.wait()
                continue
            lm_finished = lm_task.done()
            # A failed LM has not ended the utterance: no patient final chunk then. The
            # schedule's chunks use the tokens made, and its error goes out after them.
            lm_failed = lm_finished and (lm_task.cancelled() or lm_task.exception() is not None)
            spare = self._patience_left(utt, sched.offset) if may_wait and not lm_failed else None
            if spare is None and sched.index == 0:
                self._first_chunk_awaited(utt)
            patient = spare is not None and len(tokens) > sched.offset
            if patient:
                end, finalize, need = patient_target(P, sched.offset, len(tokens), lm_finished, look,
                                                     sched.max_hop, cfg.flow_left_context)
                if len(tokens) < need:
                    if lm_finished:  # cannot be: with the LM done the chunk goes at once
                        patient = False
                    else:
                        # Wait for the big chunk's tokens (or the LM's end), or until its audio
                        # is due within the patience: then the schedule's own chunk goes.
                        wake.at = need
                        more.clear()
                        # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a
                        # cancel that lands as the wait completes, and the chunker would run on.
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(spare):
                                await more.wait()
                        continue
                first_planned = True  # no first-chunk plan for a chunk that is not awaited
                if busy_floor is not None:
                    sched.initial_hop = busy_floor
            hop = None if patient else sched.ready(len(tokens))
            if hop is not None and not first_planned:
                # The first chunk could go now: size it for the load it goes into.
                first_planned = True
                low = sched.initial_hop
                if busy_floor is not None:
                    alone = 0 < idle_floor < cfg.initial_hop and eng.alone()
                    sched.initial_hop = idle_floor if alone else busy_floor
                cached = eng._cached_prompt_frames(P)  # once: the planner asks for many chunks
                first = eng.first_chunks.first_hop(
                    sched, _lm_step(utt),
                    lambda at, n: eng.stage.round_estimate(stream, self._chunk_frames(at, n, cached, flow_cfg), cached,
                                                           eng.first_chunks.skip_patient,
                                                           eng.first_chunks.due_rounds),
                    opts.speed, opening=utt.opening, streams=eng.lm_streams,
                    staged=eng.stage.live_utterances(stream), sizing=eng.first_chunks_pending - 1,
                    due=eng.stage.live_utterances(stream, skip_patient=True))
                sched.initial_hop = first
                if first != low:  # `hop` was for the fewest tokens: wait for this many
                    utt.stats.extra["first_hop"] = first
                    continue
            if hop is None and not lm_finished and not patient:
                need = wake.at = sched.tokens_needed()
                if sched.index == 0 and first_planned:  # its size is final: say when it comes
                    round_s = None
                    if cfg.first_chunk_hold_share > 0:  # and what missing a round would cost it
                        cached = eng._cached_prompt_frames(P)
                        frames = self._chunk_frames(0, sched.initial_hop, cached, flow_cfg)
                        round_s = eng.stage.round_estimate(stream, frames, cached, eng.first_chunks.skip_patient,
                                                           eng.first_chunks.due_rounds)
                    step = _lm_step(utt)
                    if math.isfinite(step):  # no rate yet before the LM's fourth token
                        at = time.monotonic() + (need - len(tokens)) * step
                        # Urgent as the chunk will be when queued then (`ChunkJob.urgent`):
                        # a later segment's first chunk behind audio still to play is not.
                        _, urgent = chunk_due(at, self.playback.runs_out(), self._audio_ahead(utt))
                        eng.stage.expect_first_chunk(stream, at, round_s, urgent)
                        if eng.first_chunks.hold_refresh and not announced_again and need - len(tokens) >= 4:
                            # Once more halfway, from a later rate: a burst's first steps
                            # share the GPU with the others' prefills, and a rate from them
                            # announces the chunk late, past the hold of a round about to start.
                            wake.at = len(tokens) + (need - len(tokens)) // 2
                            announced_again = True
                more.clear()
                await more.wait()
                continue
            if patient:
                eng.patient_chunks += 1
                eng.patient_tokens += end - sched.offset
            elif hop is None:  # LM done: finalize with everything left
                if lm_task.cancelled():
                    # Not by us (that comes after this loop): the LM stream raised
                    # CancelledError itself, which ended the utterance quietly, cut short.
                    raise EngineError("engine_error", "the LM stream ended cancelled before the utterance was done")
                if lm_task.exception() is not None:
                    raise lm_task.exception()  # type: ignore[misc]
                if not tokens:  # e.g. a streamed utterance whose text was empty
                    raise EngineError("empty_text", "nothing to speak")
                end, finalize = len(tokens), True
            else:
                end, finalize = sched.offset + hop, False
            extent = _Extent(end, finalize)
            job = self._flow_job(tokens, prompt_tokens, sched.offset, end, finalize, stream, opts.speed, sched.index, utt, flow_cfg)
            job.patient = patient
            if not finalize:
                job.grow = self._grower(extent, tokens, sched.offset, sched.max_hop, lm_task, flow_cfg)
                if eng.fill_padding and eng.remote_stage:  # it grows the chunk there
                    job.spare = self._spare(tokens, sched.offset, end, job.flow, sched.max_hop, lm_task, flow_cfg)
                    job.grown_to = extent.grown_to
            queued_at = time.monotonic()
            # The chunks queued before this one and not yet made play before it too.
            pending = sched.offset - utt.made_tokens
            in_flight = eng.first_chunks.audio_in_flight(utt.made_tokens, pending, opts.speed)
            runs_out = self.playback.runs_out()
            job.deadline, job.urgent = chunk_due(queued_at, runs_out, self._audio_ahead(utt) + in_flight)
            if pending > 0:  # taken as delivered now: the stage corrects by when it is
                job.deadline_from = max(queued_at, runs_out)
            eng.stage.submit(job)
            self._first_chunk_queued(utt)
            await handed.put(_Queued(job, sched.index, extent, queued_at, end, finalize,
                                     eng.stage.live_utterances(stream), patient))
            await asyncio.wait({job.started})  # cancelled with the utterance: the loop ends
            if extent.finalize or job.started.cancelled():
                return
            sched.advance(extent.end - sched.offset)  # the stage may have grown the chunk

    def _held_back(self, utt: _Utterance) -> bool:
        """Whether `utt` waits before its next chunk: `max_unread_audio_s` of the session's
        audio made before it is still to be taken by the consumer. Only audio ahead of it
        counts: the consumer can take that without `utt`, so the wait always ends."""
        cap_s = self.engine.config.max_unread_audio_s
        if cap_s <= 0:
            return False
        ahead = self._events_samples
        for u in self._utts.values():  # submission order, the order they are delivered in
            if u is utt:
                break
            if not u.cancelled:
                ahead += u.undelivered
        return ahead > cap_s * self.engine.sample_rate

    def _patience_left(self, utt: _Utterance, offset: int) -> float | None:
        """Seconds the utterance's next chunk (its tokens from `offset`) may wait for more
        tokens before its audio is due within `chunk_patience_s`; None when it is due
        sooner, or patience is off. Due as the stage's deadline policy reckons it
        (`chunk_due`): after the audio delivered and the audio ahead of it have played."""
        patience = self.engine.config.chunk_patience_s
        if patience <= 0:
            return None
        now = time.monotonic()
        in_flight = self.engine.first_chunks.audio_in_flight(utt.made_tokens, offset - utt.made_tokens,
                                                             utt.options.speed)
        due, urgent = chunk_due(now, self.playback.runs_out(), self._audio_ahead(utt) + in_flight)
        spare = due - now - patience
        return spare if not urgent and spare > 0 else None

    async def _deliver_chunks(self, utt: _Utterance, handed: asyncio.Queue[_Queued], producer: asyncio.Task) -> None:
        """Each queued chunk's audio, in order, into the utterance's queue, with the
        first chunks' timings; returns after the last chunk, raises what the stage or the
        chunker raised."""
        eng = self.engine
        emitted = 0
        first_samples, first_rows = 0, 0  # the first chunk's audio, the chunks of its batch
        first_back = 0.0  # when the first chunk's audio came back
        # Chunks cut big because they were not awaited (`chunk_patience_s`) are not what the
        # first-chunk planner sizes and learns from, nor a first audio anyone waits for.
        planned = True
        while True:
            item = await _next_handed(handed, producer)
            if item is None or utt.cancelled:
                return
            job = item.job
            pcm = await job.future
            if utt.cancelled:
                return
            end, finalize = item.extent.end, item.extent.finalize
            batch = job.started.result()  # a chunk with audio was taken by the stage
            if item.index == 0 and not finalize:
                eng.first_chunks.observe(end, int(pcm.size), eng.sample_rate, utt.options.speed,
                                         eng.model.config.flow.token_mel_ratio)
            planned = planned and not item.patient
            # Not the warm-up's: its first chunks wait behind graph captures (seconds), and
            # /metrics users average these sums since the start.
            if item.index == 0 and planned and utt.stats.first_token_at is not None and eng.ready:
                phases = (utt.stats.submitted_at, utt.stats.first_token_at, item.queued_at, batch.at, time.monotonic())
                eng.first_chunk_times.add(*phases, tokens=end, planned_tokens=item.queued_end, batch_rows=batch.rows)
                if utt.opening:
                    eng.opening_chunk_times.add(*phases, tokens=end, planned_tokens=item.queued_end, batch_rows=batch.rows)
                    if is_slow_opening(phases):
                        eng.slow_opening_chunk_times.add(*phases, tokens=end, planned_tokens=item.queued_end,
                                                         batch_rows=batch.rows)
            if item.index == 1 and planned and eng.ready:
                # Not from the warm-up: its first syntheses may wait behind graph captures (seconds).
                eng.first_chunks.learn_second_round(item.staged, time.monotonic() - max(item.queued_at, first_back))
            if item.index == 1 and planned and utt.arrivals is not None and eng.ready:
                self._second_chunk_done(utt, item.queued_at, batch, item.queued_end, item.queued_final, first_samples,
                                        first_rows, eng.model.config.flow.pre_lookahead_len)
            if item.index == 0:
                first_samples, first_rows, first_back = int(pcm.size), batch.rows, time.monotonic()
            if utt.stats.first_audio_at is None and pcm.size:
                utt.stats.first_audio_at = time.monotonic()
            utt.stats.num_samples += int(pcm.size)
            utt.made_tokens = end
            await self._put(utt, AudioChunk(utt.uid, pcm, emitted, finalize, item.index))
            emitted += int(pcm.size)
            utt.stats.chunks += 1
            if finalize:
                utt.stats.num_speech_tokens = len(utt.tokens)
                utt.stats.speech_tokens = tuple(utt.tokens)
                utt.stats.finished_at = time.monotonic()
                return

    def _second_chunk_done(self, utt: _Utterance, queued: float, batch: BatchStart, queued_end: int,
                           finalize: bool, first_samples: int, first_rows: int, lookahead: int) -> None:
        """Record an opening utterance's second chunk (`SecondChunkTimes`) from its batch's
        start: ready when the LM had the tokens it was queued with (and their lookahead),
        due when the first chunk's audio, from its arrival here, has played out. A first
        chunk that gave no audio (all of it held back) covers nothing: not recorded."""
        arrivals, utt.arrivals = utt.arrivals or [], None  # no longer needed
        first_at = utt.stats.first_audio_at
        need = queued_end if finalize else queued_end + lookahead
        if first_at is None or not arrivals:
            return
        ready = arrivals[min(need, len(arrivals)) - 1]
        due = first_at + first_samples / self.engine.sample_rate
        self.engine.opening_second_chunk_times.add(ready, queued, batch.at, time.monotonic(), due, first_rows,
                                                   first_at, batch.rows, batch.past_due)

    def _grower(self, extent: "_Extent", tokens: list[int], offset: int, max_hop: int, lm_task: asyncio.Task,
                flow_cfg) -> Callable[[int], FlowChunk | None]:
        """`ChunkJob.grow`: the queued chunk lengthened with tokens the LM has already
        generated (`chunking.grown_end`), its `extent` updated for the chunk loop; the
        stage runs the returned FlowChunk."""
        def grow(room: int) -> FlowChunk | None:
            lm_done = lm_task.done() and not lm_task.cancelled() and lm_task.exception() is None
            grown = grown_end(self.voice.num_tokens, offset, extent.end, len(tokens), lm_done,
                              flow_cfg.pre_lookahead_len, room, max_hop)
            if grown is None:
                return None
            extent.end, extent.finalize = grown
            return self._flow_chunk(tokens, self.voice.speech_tokens, offset, extent.end, extent.finalize, flow_cfg)

        return grow

    def _spare(self, tokens: list[int], offset: int, end: int, chunk: FlowChunk, max_hop: int, lm_task: asyncio.Task,
               flow_cfg) -> SpareTokens:
        """`ChunkJob.spare`: what `_grower` would grow the chunk into, for a stage in a
        process of its own (the tokens generated by now)."""
        lm_done = lm_task.done() and not lm_task.cancelled() and lm_task.exception() is None
        window_end = self._window_start(offset) + len(chunk.tokens) - chunk.num_prompt_tokens
        return SpareTokens.of(tokens, self.voice.num_tokens, offset, end, window_end, lm_done,
                              flow_cfg.pre_lookahead_len, max_hop)

    def _flow_job(self, tokens, prompt_tokens, offset, end, finalize, stream, speed, index, utt, flow_cfg) -> ChunkJob:
        return ChunkJob(
            flow=self._flow_chunk(tokens, prompt_tokens, offset, end, finalize, flow_cfg),
            hift_stream=stream,
            speed=speed,
            chunk_index=index,
            is_cancelled=lambda: utt.cancelled or utt.failed,
        )

    def _window_start(self, offset: int) -> int:
        """The first generated token a chunk at `offset` re-reads as left context."""
        return window_start(offset, self.engine.config.flow_left_context)

    def _chunk_frames(self, offset: int, hop: int, cached: int, flow_cfg) -> int:
        """`chunking.chunk_frames` for this session's voice (`AudioStage._window_frames`)."""
        return chunk_frames(self.voice.num_tokens, offset, hop, self.engine.config.flow_left_context,
                            flow_cfg.token_mel_ratio, cached)

    def _flow_chunk(self, tokens, prompt_tokens, offset, end, finalize, flow_cfg) -> FlowChunk:
        win_start = self._window_start(offset)
        stop = end if finalize else min(len(tokens), end + flow_cfg.pre_lookahead_len)
        seq = torch.cat([prompt_tokens, torch.tensor(tokens[win_start:stop], dtype=torch.long)])
        P = int(prompt_tokens.numel())
        return FlowChunk(
            # CPU tensors: the stage moves a whole batch to its device in one copy each.
            tokens=seq,
            prompt_feat=self.voice.speech_feat,
            embedding=self.voice.embedding,
            num_prompt_tokens=P,
            out_start=P + offset - win_start,
            finalize=finalize,
            noise_offset=2 * win_start,
        )
