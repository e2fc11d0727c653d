"""The speech-token LM on vLLM (v1 `AsyncLLM`), over the unified-vocabulary export.

vLLM runs the exported Qwen2 (`vllm_export.py`) on plain token-id prompts; the
CosyVoice specifics live in one batch logits processor (`ras_logits.py`) that masks
text ids and early stops and turns the logits into RAS's exact distribution, after
which vLLM samples plainly (temperature 1, no top-k/top-p of its own). Greedy
requests get the same masks and temperature 0.

vLLM is imported only inside `start()`: its engine core runs in a child process,
so the engine must be built from running code (`main()`), never at import, and CPU
installs without vLLM can still import this module.

Text-in streaming needs vLLM's *synchronous* scheduler (`async_scheduling=False`,
this backend's default). With async scheduling (vLLM 0.26's default) the engine
core schedules step N+1 of a request before step N's token is known
(v1/engine/core.py `step_with_batch_queue`). When step N samples a chunk's stop id
(fill), the request pauses for more input, which vLLM does not count as finished
(v1/request.py `RequestStatus`: WAITING_FOR_STREAMING_REQ < PREEMPTED), so the
already scheduled step N+1 still runs: it feeds fill to the model, and its token is
appended and streamed (v1/core/sched/scheduler.py `update_from_output`, which only
skips *finished* requests), and because fill's position is then counted as
computed, `_update_request_as_session` keeps fill in the context. Both break the
bistream layout (fill is never fed); that was the "expected forced id 6564, got
3942" on the H200: the leaked token shifted the client's count by one.
"""

from __future__ import annotations

import asyncio
import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, get_args

from engine.backends.base import LMRequest, SamplingParams
from engine.backends.lm_times import LMServerTimes, vllm_stat_logger
from engine.backends.ras_logits import COMPILE_ENV, RASArgs
from engine.bistream import BistreamRequest, BistreamSpec, BistreamState, Run, SpeechLimitReached
from engine.config import VLLMGraphMode
from engine.models.vocab import UnifiedVocab
from engine.mps import MPSPriority, child_env, mps_client_env

LOGITS_PROCESSOR_FQCN = "engine.backends.ras_logits:CosyVoiceLogitsProcessor"
CUDAGRAPH_MODES: tuple[str, ...] = get_args(VLLMGraphMode)


@dataclass(frozen=True)
class VLLMEngineSettings:
    """Engine-wide knobs (one engine per process serves every request)."""

    gpu_memory_utilization: float = 0.3
    max_model_len: int = 4096
    max_num_seqs: int = 128
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # True skips torch.compile + CUDA graphs (faster start, slower decode)
    dtype: str = "bfloat16"
    seed: int = 0
    # False: text-in streaming is exact (see the module docstring). True (vLLM's own
    # default) overlaps scheduling with the GPU step; generate_streaming then refuses.
    async_scheduling: bool = False
    # Keep vLLM's engine-core timings of every request (`engine.backends.lm_times`).
    timing: bool = False
    # Build AsyncLLM in a worker thread, so that the event loop runs other start-up work
    # while vLLM's engine core starts (EngineConfig.overlap_start). AsyncLLM starts its
    # output tasks on first use when built outside a running loop.
    start_in_thread: bool = False
    # Under an NVIDIA MPS daemon: the share of the GPU's SMs (percent) the engine core may
    # use, leaving the rest to the audio stage (None: no limit; without a
    # daemon it does nothing). See `engine.mps`.
    mps_thread_percent: int | None = None
    # Under an NVIDIA MPS daemon: the engine core's scheduling priority as an MPS client
    # ("below_normal": when both have kernels waiting, the GPU runs the audio stage's
    # first; None: MPS's default, normal). See `engine.mps`.
    mps_priority: MPSPriority | None = None
    # AsyncEngineArgs fields set over the ones above (benchmarks: vLLM's profiler, or no
    # logits processor to price it); empty in the product.
    engine_args: tuple[tuple[str, Any], ...] = ()
    # The RAS logits processor's per-step function compiled in the engine core
    # (`ras_logits.COMPILE_ENV`); False: eager.
    compile_sampling: bool = False
    # vLLM's CUDA graph mode (one of CUDAGRAPH_MODES; None: vLLM's own default,
    # full_and_piecewise: decode-only batches replay one graph a step, a batch with a
    # prefill runs the model piecewise with its attention eager between the pieces).
    # "full" graphs prefills and mixed batches too, up to vLLM's largest capture size
    # (FlashAttention 3 allows it): the engine's default (EngineConfig.vllm_cudagraph_mode).
    cudagraph_mode: str | None = None


def vllm_sampling_kwargs(sp: SamplingParams, vocab: UnifiedVocab) -> dict[str, Any]:
    """Map our SamplingParams onto vllm.SamplingParams keyword arguments.

    Kept free of vLLM imports so the mapping is tested on CPU.
    """
    stop_ids = list(range(vocab.speech_token_size, vocab.speech_vocab_size))
    fixed = sp.fixed_length is not None
    max_tokens = int(sp.fixed_length) if fixed else int(sp.max_tokens)
    min_tokens = max_tokens if fixed else min(int(sp.min_tokens), max_tokens)
    ras = RASArgs(
        speech_token_size=vocab.speech_token_size,
        speech_vocab_size=vocab.speech_vocab_size,
        greedy=sp.greedy,
        top_p=sp.top_p,
        top_k=sp.top_k,
        win_size=sp.win_size,
        tau_r=sp.tau_r,
        min_tokens=min_tokens,
        mask_stops=fixed,
    )
    return dict(
        # RAS is done by our logits processor; vLLM only draws from its output.
        temperature=0.0 if sp.greedy else 1.0,
        top_p=1.0,
        top_k=0,
        seed=sp.seed,
        max_tokens=max_tokens,
        # Our processor masks every stop id before min_tokens (`RASArgs.min_tokens`), so
        # vLLM's own min-tokens processor would only repeat that mask, at ~3% of a
        # decode step's host time (round 33 of docs/benchmarks.md): it stays idle.
        min_tokens=0,
        # Fixed-length requests never stop early: no stop ids, eos ignored, and the
        # processor masks every stop id. Otherwise any reserved id ends the stream.
        stop_token_ids=None if fixed else stop_ids,
        ignore_eos=fixed,
        detokenize=False,
        extra_args=ras.to_extra(),
    )


def bistream_spec(vocab: UnifiedVocab) -> BistreamSpec:
    """The interleaving ids of the exported LM (CosyVoice3, or CosyVoice2 when the
    vocabulary has its two extra prompt rows for sos/task_id)."""
    sts = vocab.speech_token_size
    if getattr(vocab, "extra_rows", 0):
        return BistreamSpec(sos=vocab.speech_vocab_size, task_id=vocab.speech_vocab_size + 1, fill=sts + 2,
                            speech_token_size=sts, text_offset=vocab.text_offset, end_of_prompt=None)
    return BistreamSpec(sos=sts, task_id=sts + 2, fill=sts + 3, speech_token_size=sts, text_offset=vocab.text_offset)


def eos_id(vocab: UnifiedVocab) -> int:
    """The id that ends an utterance: CosyVoice2's first reserved row; CosyVoice3's second
    (its first is sos)."""
    sts = vocab.speech_token_size
    return sts if getattr(vocab, "extra_rows", 0) else sts + 1


def desync_id(vocab: UnifiedVocab) -> int:
    """A reserved row the model never needs (not eos, fill, sos or task_id; CosyVoice2 has
    three reserved rows, the last of them fill): the logits processor draws it when a
    bistream chunk does not fit its context, and the client raises."""
    spec = bistream_spec(vocab)
    used = {eos_id(vocab), spec.fill, spec.sos, spec.task_id}
    return max(i for i in range(vocab.speech_token_size, vocab.speech_vocab_size) if i not in used)


def bistream_chunk_kwargs(st: BistreamState, run: Run, sp: SamplingParams, vocab: UnifiedVocab) -> dict[str, Any]:
    """vllm.SamplingParams keyword arguments for one input chunk (= one bistream run),
    built right after `st.next_run()` returned `run`.

    Run lengths are enforced by the logits processor (`force_at`), not by
    `max_tokens`: vLLM 0.26 keeps the first chunk's max_tokens for the whole
    resumable request (`_update_request_as_session` never updates
    `Request.max_tokens`), so every chunk gets the same, request-wide cap.
    Streaming runs stop on `fill` (the synchronous scheduler then drops that last
    token from the context, exactly as the official bistream never feeds fill); the
    final run stops on any reserved id, with the unistream min/max lengths.
    `context_len` / `fill_period` let the processor check the chunk against the
    context it arrives with. CPU-testable (no vLLM import).
    """
    spec = st.spec
    cap = max(1, st.limits.hard_max + 1)
    history = tuple(st.history[-sp.win_size:]) if sp.win_size > 0 else ()
    bad = desync_id(vocab)
    common = dict(speech_token_size=vocab.speech_token_size, speech_vocab_size=vocab.speech_vocab_size,
                  greedy=sp.greedy, top_p=sp.top_p, top_k=sp.top_k, win_size=sp.win_size, tau_r=sp.tau_r,
                  history=history, context_len=len(st.context), desync_id=bad)
    if not run.final:
        ras = RASArgs(**common, min_tokens=0, mask_stops=True, keep_id=spec.fill,
                      force_at=run.fill_at if run.fill_at is not None else -1, force_id=spec.fill,
                      fill_period=spec.mix_speech)
        stops, min_tokens, ignore_eos = [spec.fill, bad], 0, True
    else:
        low, high = st.remaining_limits()
        fixed = st.limits.fixed_ratio is not None
        min_tokens = high if fixed else min(low, high)
        ras = RASArgs(**common, min_tokens=min_tokens, mask_stops=fixed,
                      force_at=high, force_id=eos_id(vocab))  # eos at the length limit
        stops, ignore_eos = list(range(vocab.speech_token_size, vocab.speech_vocab_size)), False
    # vLLM 0.26 keeps the first chunk's torch.Generator for the whole request (a re-added
    # streaming row is not re-seeded), so only the first chunk's seed matters there;
    # moving it on with the position keeps chunks independent where a version re-seeds.
    seed = None if sp.seed is None else (sp.seed + 7919 * len(st.history)) % (1 << 31)
    return dict(
        temperature=0.0 if sp.greedy else 1.0,
        top_p=1.0,
        top_k=0,
        seed=seed,
        max_tokens=cap,
        min_tokens=min(min_tokens, cap),
        stop_token_ids=stops,
        ignore_eos=ignore_eos,
        detokenize=False,
        extra_args=ras.to_extra(),
    )


class VLLMBackend:
    """LMBackend on vLLM's AsyncLLM: continuous batching, prefix caching, streaming deltas."""

    name = "vllm"

    def __init__(self, export_dir: Path | str, vocab: UnifiedVocab, *,
                 gpu_memory_utilization: float = 0.3, max_model_len: int = 4096,
                 max_num_seqs: int = 128, enforce_eager: bool = False, seed: int = 0,
                 dtype: str = "bfloat16", async_scheduling: bool = False, timing: bool = False,
                 start_in_thread: bool = False, mps_thread_percent: int | None = None,
                 mps_priority: MPSPriority | None = None,
                 engine_args: dict[str, Any] | None = None, compile_sampling: bool = False,
                 cudagraph_mode: str | None = None) -> None:
        # dtype="float32" (exact-parity runs): FlashAttention has no fp32 kernels, so
        # vLLM's selector falls back to TRITON_ATTN; set TRITON_F32_DEFAULT=ieee in the
        # environment too, or Triton's fp32 dots run in TF32.
        if cudagraph_mode is not None and cudagraph_mode not in CUDAGRAPH_MODES:
            raise ValueError(f"cudagraph_mode must be one of {', '.join(CUDAGRAPH_MODES)}, not {cudagraph_mode!r}")
        self.export_dir = Path(export_dir)
        self.vocab = vocab
        self.settings = VLLMEngineSettings(gpu_memory_utilization=gpu_memory_utilization,
                                           max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                           enforce_eager=enforce_eager, seed=seed, dtype=dtype,
                                           async_scheduling=async_scheduling, timing=timing,
                                           start_in_thread=start_in_thread,
                                           mps_thread_percent=mps_thread_percent, mps_priority=mps_priority,
                                           engine_args=tuple((engine_args or {}).items()),
                                           compile_sampling=compile_sampling, cudagraph_mode=cudagraph_mode)
        self._times = LMServerTimes() if timing else None
        self._llm: Any = None
        self._active: set[str] = set()
        self._aborted: set[str] = set()
        # Text-in streams whose run ended and that wait for their client's next text: vLLM
        # keeps such a paused request's slot (its scheduler counts WAITING_FOR_STREAMING_REQ
        # against max_num_seqs), so they can hold every slot (`blocked_on_text`).
        self._paused_for_text: set[str] = set()

    @property
    def failure(self) -> str | None:
        """Why the LM can serve no more (vLLM's engine core died); None while it can."""
        if self._llm is not None and getattr(self._llm, "errored", False):
            return "the vLLM engine core died"
        return None

    async def start(self) -> None:
        if self._llm is not None:
            return
        # FlashInfer's sampler is not in the GPU bundle; vLLM's torch sampler is used.
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        # vLLM forks its engine core unless CUDA is initialised already. A fork after torch
        # ran CPU work on its OpenMP pool hangs the child in its first parallel region (seen
        # on the H200 with the LM built on the CPU first), so always spawn.
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        s = self.settings
        fields: dict[str, Any] = dict(
            model=str(self.export_dir),
            skip_tokenizer_init=True,
            dtype=s.dtype,
            gpu_memory_utilization=s.gpu_memory_utilization,
            max_model_len=s.max_model_len,
            max_num_seqs=s.max_num_seqs,
            enable_prefix_caching=s.enable_prefix_caching,
            enforce_eager=s.enforce_eager,
            seed=s.seed,
            async_scheduling=s.async_scheduling,
            # By name: the engine core (a child process) imports it itself.
            logits_processors=[LOGITS_PROCESSOR_FQCN],
            # With `timing` our logger is the only one (vLLM's periodic log lines stay off).
            disable_log_stats=True,
        )
        if s.cudagraph_mode is not None:
            fields["compilation_config"] = {"cudagraph_mode": s.cudagraph_mode.upper()}
        args = AsyncEngineArgs(**{**fields, **dict(s.engine_args)})
        loggers = [vllm_stat_logger(self._times)] if self._times is not None else None
        build = functools.partial(AsyncLLM.from_engine_args, args, stat_loggers=loggers)
        env = mps_client_env(s.mps_thread_percent, s.mps_priority)
        if s.compile_sampling:
            env[COMPILE_ENV] = "inductor"
        with child_env(env):
            self._llm = await asyncio.to_thread(build) if s.start_in_thread else build()

    def _params(self, sp: SamplingParams) -> Any:
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        return VSamplingParams(output_kind=RequestOutputKind.DELTA, **vllm_sampling_kwargs(sp, self.vocab))

    async def generate(self, request: LMRequest) -> AsyncIterator[int]:  # type: ignore[override]
        if self._llm is None:
            raise RuntimeError("VLLMBackend.start() was not awaited")
        rid = request.request_id
        if rid in self._active:
            raise ValueError(f"request id {rid!r} is already running")
        prompt = {"prompt_token_ids": [int(t) for t in request.prompt]}
        stream = self._llm.generate(prompt, self._params(request.sampling), rid)
        self._active.add(rid)
        finished = False
        try:
            async for out in stream:
                if rid in self._aborted:
                    break
                for tok in out.outputs[0].token_ids:
                    if tok >= self.vocab.speech_token_size:  # a stop id ends the stream, unseen
                        finished = True
                        break
                    yield int(tok)
                if finished or out.finished:
                    reason = getattr(out.outputs[0], "finish_reason", None)
                    if not finished and reason not in (None, "stop", "length"):
                        # An abort we did not ask for, or an error: the speech is not whole,
                        # and ending quietly would deliver it as if it were.
                        raise RuntimeError(f"vLLM ended the request before its speech was done ({reason})")
                    finished = True
                    break
        finally:
            self._active.discard(rid)
            self._aborted.discard(rid)
            # Closing vLLM's generator early makes it abort the request (frees the slot).
            await stream.aclose()

    def _chunk_params(self, kwargs: dict[str, Any]) -> Any:
        """vllm.SamplingParams of one streaming-input chunk (a method so CPU tests can
        drive `generate_streaming` against a simulation of vLLM's streaming input)."""
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        return VSamplingParams(output_kind=RequestOutputKind.DELTA, **kwargs)

    def _streaming_input(self, ids: list[int], params: Any) -> Any:
        try:
            from vllm.engine.protocol import StreamingInput
        except ImportError:  # older layouts
            from vllm.inputs.data import StreamingInput  # type: ignore[no-redef]
        return StreamingInput(prompt={"prompt_token_ids": ids}, sampling_params=params)

    def _async_scheduling_on(self) -> bool:
        """What the running engine actually does (vLLM resolves None to on)."""
        cfg = getattr(self._llm, "vllm_config", None)
        sched = getattr(cfg, "scheduler_config", None)
        return bool(getattr(sched, "async_scheduling", self.settings.async_scheduling))

    def streaming_input_refusal(self) -> str | None:
        """Why this engine cannot take text-in streaming requests, or None when it can."""
        if self._async_scheduling_on():
            return ("text-in streaming needs the vLLM engine's async scheduling off "
                    "(engine.vllm_async_scheduling: false)")
        return None

    async def generate_streaming(  # type: ignore[override]
        self, request: BistreamRequest, text_source: AsyncIterator[list[int]]
    ) -> AsyncIterator[int]:
        """Text-in streaming as ONE resumable vLLM request fed through an async
        generator of `StreamingInput`s: each bistream run (engine.bistream) is one
        input chunk, sent when the previous run has ended and its text is there.
        Semantics equal `TorchLMBackend.generate_streaming` (bench/bistream_parity.py).

        Every token is checked against the state machine's rule; a token the rule
        forbids (a wrong forced id, a stop where none may be, the processor's desync
        id, a token between runs) raises instead of becoming audio."""
        if self._llm is None:
            raise RuntimeError("VLLMBackend.start() was not awaited")
        if self._async_scheduling_on():
            raise RuntimeError("text-in streaming on vLLM needs async_scheduling=False: with async scheduling "
                               "a paused streaming request decodes one extra step past its fill token")
        import asyncio

        rid = request.request_id
        if rid in self._active:
            raise ValueError(f"request id {rid!r} is already running")
        st = request.new_state(bistream_spec(self.vocab))
        sts, bad = self.vocab.speech_token_size, desync_id(self.vocab)
        text_changed, need_run = asyncio.Event(), asyncio.Event()
        failure: list[BaseException] = []

        async def pump() -> None:
            # Everything here runs on the event loop, like the consumer below, so the
            # state machine is never touched concurrently.
            try:
                async for ids in text_source:
                    st.push_text(ids)
                    text_changed.set()
                st.close_text()
            except Exception as exc:
                failure.append(exc)
            text_changed.set()

        async def next_run() -> Run | None:
            """The next run once its text is there; None: the utterance is over."""
            while True:
                if failure:
                    raise failure[0]
                if st.done:
                    return None
                run = st.next_run()
                if run is not None or st.done:
                    return run
                text_changed.clear()
                await text_changed.wait()

        async def inputs(run: Run) -> AsyncIterator[Any]:
            while True:
                kw = bistream_chunk_kwargs(st, run, request.sampling, self.vocab)
                yield self._streaming_input(list(run.feed), self._chunk_params(kw))
                if run.final:
                    return  # the end of this generator is vLLM's end-of-input signal
                await need_run.wait()  # the run ended on fill
                need_run.clear()
                self._paused_for_text.add(rid)
                try:
                    following = await next_run()
                finally:
                    self._paused_for_text.discard(rid)
                if following is None:
                    return
                run = following

        def check(tok: int) -> None:
            if tok == bad:
                raise RuntimeError("the CosyVoice logits processor found a streaming-input chunk that does not fit "
                                   "its context (see the engine log); unsupported vLLM behaviour")
            if not st.in_run:
                raise RuntimeError(f"vLLM produced token {tok} between bistream runs")
            rule = st.token_rule()
            if rule.forced is not None and tok != rule.forced:
                raise RuntimeError("vLLM did not apply a streaming-input chunk's sampling params "
                                   f"(expected forced id {rule.forced}, got {tok}); unsupported vLLM version")
            if tok >= sts and not (rule.allow_stop or (rule.allow_fill and tok == st.spec.fill)):
                raise RuntimeError(f"vLLM sampled reserved id {tok} where the bistream rule forbids it")

        pump_task = asyncio.create_task(pump(), name=f"text-{rid}")
        try:
            first = await next_run()
        except BaseException:
            pump_task.cancel()
            raise
        if first is None:  # no text at all: no request (vLLM would start one from its base params)
            pump_task.cancel()
            return
        base = self._chunk_params(dict(max_tokens=max(1, st.limits.hard_max + 1), detokenize=False))
        stream = self._llm.generate(inputs(first), base, rid)
        self._active.add(rid)
        try:
            async for out in stream:
                if rid in self._aborted:
                    break
                for tok in out.outputs[0].token_ids:
                    if st.done:
                        break
                    check(int(tok))
                    emitted = st.on_token(int(tok))
                    if emitted is not None:
                        yield emitted
                    if st.cut_short:
                        raise SpeechLimitReached(st.limits.hard_max)
                    if not st.in_run and not st.done:
                        need_run.set()  # the run ended on fill: send the next chunk
                if st.done:
                    break
                reason = getattr(out.outputs[0], "finish_reason", None)
                if out.finished:
                    # The input generator ends only once the state machine is done: a request
                    # vLLM finished before that (an abort we did not ask for, an error) is
                    # not whole speech, and ending quietly would deliver it as if it were.
                    raise RuntimeError(f"vLLM ended the text-in streaming request before its speech was done "
                                       f"({reason})")
                if reason is not None and st.in_run:
                    # vLLM stopped the run short of its fill token (its context reached
                    # max_model_len): a resumable request then pauses for input that, with
                    # no fill seen, would never be sent.
                    raise RuntimeError(f"vLLM ended a text-in streaming run early ({reason}): the utterance's "
                                       "context reached the LM's max_model_len")
        finally:
            pump_task.cancel()
            self._active.discard(rid)
            self._aborted.discard(rid)
            await stream.aclose()

    async def abort(self, request_id: str) -> None:
        if self._llm is None or request_id not in self._active:
            return
        self._aborted.add(request_id)
        await self._llm.abort(request_id)

    def num_active(self) -> int:
        return len(self._active)

    def blocked_on_text(self) -> bool:
        """Every slot vLLM has is held by a text-in stream paused for its client's next
        text, and other requests wait behind them: they wait on the clients' text, not on
        the LM (`Engine._watch_lm`), as on the torch backend. Without this a gateway whose
        `max_num_seqs` streams all paused declared its LM stalled and exited."""
        paused = len(self._paused_for_text)
        return paused >= self.settings.max_num_seqs and len(self._active) > paused

    def server_times(self) -> LMServerTimes | None:
        return self._times

    async def close(self) -> None:
        if self._llm is None:
            return
        for rid in list(self._active):
            await self.abort(rid)
        self._llm.shutdown()
        self._llm = None
