"""The speech-token LM on vLLM (v1 `AsyncLLM`), over the unified-vocabulary export.

vLLM runs the exported Qwen2 (`vllm_export.py`) on plain token-id prompts; the
CosyVoice specifics live in one batch logits processor (`ras_logits.py`) that masks
text ids and early stops and turns the logits into RAS's exact distribution, after
which vLLM samples plainly (temperature 1, no top-k/top-p of its own). Greedy
requests get the same masks and temperature 0.

vLLM is imported only inside `start()`: its engine core runs in a child process,
so the engine must be built from running code (`main()`), never at import, and CPU
installs without vLLM can still import this module.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator

from engine.backends.base import LMRequest, SamplingParams
from engine.backends.ras_logits import RASArgs
from engine.bistream import BistreamRequest, BistreamSpec, BistreamState, Run
from engine.models.vocab import UnifiedVocab

LOGITS_PROCESSOR_FQCN = "engine.backends.ras_logits:CosyVoiceLogitsProcessor"


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
        min_tokens=min_tokens,
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


def bistream_chunk_kwargs(st: BistreamState, run: Run, sp: SamplingParams, vocab: UnifiedVocab) -> dict[str, Any]:
    """vllm.SamplingParams keyword arguments for one input chunk (= one bistream run).

    Run lengths are enforced by the logits processor (`force_at`), not by
    `max_tokens`: some vLLM versions keep the first chunk's max_tokens for the
    whole resumable request, so every chunk gets the same, request-wide cap.
    Streaming runs stop on `fill` (vLLM then drops that last token from the context,
    exactly as the official bistream never feeds fill); the final run stops on any
    reserved id, with the unistream min/max lengths. CPU-testable (no vLLM import).
    """
    spec = st.spec
    cap = max(1, st.limits.hard_max + 1)
    history = tuple(st.history[-sp.win_size:]) if sp.win_size > 0 else ()
    common = dict(speech_token_size=vocab.speech_token_size, speech_vocab_size=vocab.speech_vocab_size,
                  greedy=sp.greedy, top_p=sp.top_p, top_k=sp.top_k, win_size=sp.win_size, tau_r=sp.tau_r,
                  history=history)
    if not run.final:
        ras = RASArgs(**common, min_tokens=0, mask_stops=True, keep_id=spec.fill,
                      force_at=run.fill_at if run.fill_at is not None else -1, force_id=spec.fill)
        stops, min_tokens, ignore_eos = [spec.fill], 0, True
    else:
        low, high = st.remaining_limits()
        fixed = st.limits.fixed_ratio is not None
        min_tokens = high if fixed else min(low, high)
        ras = RASArgs(**common, min_tokens=min_tokens, mask_stops=fixed,
                      force_at=high, force_id=vocab.speech_token_size + 1)  # eos at the length limit
        stops, ignore_eos = list(range(vocab.speech_token_size, vocab.speech_vocab_size)), False
    # Each chunk is a fresh vLLM sampling request: a seeded request would replay the
    # same random stream in every chunk, so the seed moves on with the position.
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
                 dtype: str = "bfloat16") -> None:
        # dtype="float32" (exact-parity runs): FlashAttention has no fp32 kernels, so
        # vLLM's selector falls back to TRITON_ATTN; set TRITON_F32_DEFAULT=ieee in the
        # environment too, or Triton's fp32 dots run in TF32.
        self.export_dir = Path(export_dir)
        self.vocab = vocab
        self.settings = VLLMEngineSettings(gpu_memory_utilization=gpu_memory_utilization,
                                           max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                           enforce_eager=enforce_eager, seed=seed, dtype=dtype)
        self._llm: Any = None
        self._active: set[str] = set()
        self._aborted: set[str] = set()

    async def start(self) -> None:
        if self._llm is not None:
            return
        # FlashInfer's sampler is not in the GPU bundle; vLLM's torch sampler is used.
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        s = self.settings
        args = AsyncEngineArgs(
            model=str(self.export_dir),
            skip_tokenizer_init=True,
            dtype=s.dtype,
            gpu_memory_utilization=s.gpu_memory_utilization,
            max_model_len=s.max_model_len,
            max_num_seqs=s.max_num_seqs,
            enable_prefix_caching=s.enable_prefix_caching,
            enforce_eager=s.enforce_eager,
            seed=s.seed,
            # By name: the engine core (a child process) imports it itself.
            logits_processors=[LOGITS_PROCESSOR_FQCN],
            disable_log_stats=True,
        )
        self._llm = AsyncLLM.from_engine_args(args)

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
                    finished = True
                    break
        finally:
            self._active.discard(rid)
            self._aborted.discard(rid)
            # Closing vLLM's generator early makes it abort the request (frees the slot).
            await stream.aclose()

    async def generate_streaming(  # type: ignore[override]
        self, request: BistreamRequest, text_source: AsyncIterator[list[int]]
    ) -> AsyncIterator[int]:
        """Text-in streaming as ONE resumable vLLM request fed through an async
        generator of `StreamingInput`s: each bistream run (engine.bistream) is one
        input chunk, sent when the previous run has ended and its text is there.
        Semantics equal `TorchLMBackend.generate_streaming` (bench/bistream_parity.py)."""
        if self._llm is None:
            raise RuntimeError("VLLMBackend.start() was not awaited")
        import asyncio

        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        try:
            from vllm.engine.protocol import StreamingInput
        except ImportError:  # older layouts
            from vllm.inputs.data import StreamingInput  # type: ignore[no-redef]

        rid = request.request_id
        if rid in self._active:
            raise ValueError(f"request id {rid!r} is already running")
        st = request.new_state(bistream_spec(self.vocab))
        text_changed, need_run = asyncio.Event(), asyncio.Event()
        need_run.set()
        failure: list[BaseException] = []

        def params(run: Run) -> Any:
            kw = bistream_chunk_kwargs(st, run, request.sampling, self.vocab)
            return VSamplingParams(output_kind=RequestOutputKind.DELTA, **kw)

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

        async def inputs() -> AsyncIterator[Any]:
            while True:
                await need_run.wait()
                need_run.clear()
                while True:
                    if failure:
                        raise failure[0]
                    if st.done:
                        return
                    run = st.next_run()
                    if run is not None:
                        break
                    if st.done:
                        return
                    text_changed.clear()
                    await text_changed.wait()
                yield StreamingInput(prompt={"prompt_token_ids": list(run.feed)}, sampling_params=params(run))
                if run.final:
                    return  # the end of this generator is vLLM's end-of-input signal

        pump_task = asyncio.create_task(pump(), name=f"text-{rid}")
        base = VSamplingParams(output_kind=RequestOutputKind.DELTA, max_tokens=max(1, st.limits.hard_max + 1),
                               detokenize=False)
        stream = self._llm.generate(inputs(), base, rid)
        self._active.add(rid)
        try:
            async for out in stream:
                if rid in self._aborted:
                    break
                for tok in out.outputs[0].token_ids:
                    if st.done:
                        break
                    if not st.in_run:
                        raise RuntimeError(f"vLLM produced token {tok} between bistream runs")
                    rule = st.token_rule()
                    if rule.forced is not None and int(tok) != rule.forced:
                        raise RuntimeError(
                            "vLLM did not apply a streaming-input chunk's sampling params "
                            f"(expected forced id {rule.forced}, got {tok}); unsupported vLLM version")
                    emitted = st.on_token(int(tok))
                    if emitted is not None:
                        yield emitted
                    if not st.in_run and not st.done:
                        need_run.set()  # the run ended on fill: send the next chunk
                if st.done or out.finished:
                    break
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

    async def close(self) -> None:
        if self._llm is None:
            return
        for rid in list(self._active):
            await self.abort(rid)
        self._llm.shutdown()
        self._llm = None
