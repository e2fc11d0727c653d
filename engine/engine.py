"""The streaming engine: sessions of utterances, each text -> speech tokens -> audio chunks.

    engine = await Engine.create(EngineConfig(model_dir=...))
    voice  = await engine.prepare_voice("alice", wav, 24000, "transcript")
    sess   = engine.open_session(voice, SessionOptions())
    uid    = await sess.submit("Hello there.")
    uid, feed = await sess.submit_stream()    # text-in streaming: feed.append(...); feed.close()
    async for ev in sess.events(): ...        # AudioChunk | UtteranceError, in submission order
    await sess.cancel(uid)                    # barge-in

Per utterance three things run concurrently: the LM request (tokens in), the chunker
(turns tokens into flow/vocoder jobs on the shared `AudioStage`, one at a time), and
the session's delivery loop (forwards chunks in order). The next utterance's LM request
starts as soon as the previous one's LM finishes, so its tokens are ready before the
previous audio ends (no gap between segments).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import AsyncIterator, Callable, Literal, cast

import numpy as np
import torch

from .backends.base import LMBackend, LMRequest, SamplingParams
from .bistream import BistreamRequest, LengthLimits, SpeechLimitReached, TextInLM
from .chunking import ChunkSchedule, SpareTokens, chunk_frames, grown_end, patient_target, window_start
from .config import DEADLINE_MARGIN_S, EngineConfig
from .first_chunk import SPEECH_TOKENS_PER_S, TUNABLE, FirstChunkPlanner, PlanInputs
from .frontend.prompt import lm_prompt_text
from .frontend.text import detect_grammar
from .lm_watch import LMWatch
from .models.flow import FlowChunk
from .models.lm import build_prompt, length_limits, unified_vocab
from .flow_prompt_cache import cacheable_frames, supports_prompt_cache
from .models.loader import LoadedModel, family, load_model
from .stage_build import graph_policy, voice_graph_shapes
from .stage_pool import StagePool, build_stage
from .stage_process import RemoteStage
from .text_stream import TextFeed
from .token2wav import STAGE_TUNABLE, AudioStage, ChunkJob, check_stage_knobs, cuda_memory
from .types import AudioChunk, SessionOptions, UtteranceError, UtteranceStats, VoicePrompt

log = logging.getLogger(__name__)

# FSQ codes of silence and breath (CosyVoice3Model.silent_tokens); runs longer than
# MAX_SILENT are dropped so the model cannot stall in silence.
SILENT_TOKENS = frozenset({1, 2, 28, 29, 55, 248, 494, 2241, 2242, 2322, 2323})
MAX_SILENT = 5
PREFIX_CACHE_SIZE = 4096
# An utterance's LM rate, for its first chunk's size, is measured over this many first tokens
# at most (`_lm_step`).
RATE_TOKENS = 64
# ... and for the planner's `LMSteps`, from this token on (`_learn_lm_step`): past the
# prompt's prefill and a burst's first steps, which share the GPU with the others' prefills.
STEP_FROM = 8
# Speech tokens of each concurrent warm-up utterance: a sentence (~4 s), like the
# WebSocket load's segments (105 tokens), so the warm-up's batches span a burst's sizes.
WARMUP_SPEECH_TOKENS = 100
CPU_WARMUP_CONCURRENCY = 4  # EngineConfig.warmup_concurrency None on the CPU
WARMUP_VOICE_ID = "__warmup__"  # the voice the engine warms up with before it is ready
# Its prompt's length. The flow graphs captured at start serve every voice whose cached
# prompt prefix pads to the same width (`GraphPolicy.prefix_multiple`, 100 frames); a voice
# of another width captures its own (~90) at registration, one stage job each, while the
# stage serves. 4.25 s (a 200-frame prefix) is the middle of the 3-5 s prompts voices are
# registered with, and the load benchmark's voice: on the H200 its registration took 47-76 s
# after a warm-up with a 3-s prompt (100 frames; round 22 of docs/benchmarks.md).
WARMUP_PROMPT_SECONDS = 4.25


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


def chunk_due(now: float, runs_out: float, ahead_s: float, margin: float = DEADLINE_MARGIN_S) -> tuple[float, bool]:
    """(deadline, urgent) of a chunk: when its audio is needed (time.monotonic seconds, for
    the stage's "deadline" policy) and whether the listener is, or is about to be, waiting
    for it in silence (what lets a first chunk jump the "first_chunks" queue).

    The listener plays what it was delivered until `runs_out` (`PlaybackClock`; -inf:
    nothing yet), then the `ahead_s` seconds of audio that play before this chunk and are
    not delivered yet: made but still queued, or generated speech tokens of earlier
    utterances not yet made into audio. The chunk is due when all of that has played, less
    `margin`. With nothing delivered and nothing ahead it is needed now: first-audio
    latency. A due time already past is a stall in progress, and the older it is the
    longer the listener has waited."""
    if ahead_s <= 0:
        if runs_out == -math.inf:
            return now, True
        due = runs_out - margin
    else:
        due = max(now, runs_out) + ahead_s - margin
    return (due, True) if due <= now else (due, False)


@dataclass
class PlaybackClock:
    """When a session's listener runs out of audio, from what was delivered and when.
    Playback starts at a delivery into silence and then runs at the sample rate; audio
    delivered after the previous audio ran out starts it again (what a client that plays
    on arrival does)."""

    sample_rate: int
    started_at: float | None = None
    samples: int = 0

    def runs_out(self) -> float:
        """time.monotonic seconds at which the delivered audio ends (-inf: none yet)."""
        return -math.inf if self.started_at is None else self.started_at + self.samples / self.sample_rate

    def deliver(self, samples: int, now: float) -> None:
        if self.started_at is None or now >= self.runs_out():
            self.started_at, self.samples = now, 0
        self.samples += samples


class EngineError(RuntimeError):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class EngineStats:
    active_sessions: int
    active_utterances: int
    lm_active: int
    flow_queue: int
    last_batch_size: int
    max_batch_size: int
    batches: int
    chunks: int
    dropped_chunks: int
    lm_tokens: int
    stage_busy_seconds: float
    # Of stage_busy_seconds: thread and event-loop hand-offs around the batches (StageStats).
    stage_handoff_seconds: float = 0.0
    # Work actually done by the audio stage (benchmarks turn these into FLOP/s):
    # flow = padded batch rows x padded mel frames summed over batches (CFG doubling not
    # included), vocoder = mel frames vocoded. 0 when the stage does not count them.
    flow_frames: int = 0
    vocoder_frames: int = 0
    # Of flow_frames, the rows' own frames before any padding, the frames of rows added to
    # fill a graph's row bucket, and of rows padded past their call's longest to a graph's
    # frame bucket (StageStats).
    flow_exact_frames: int = 0
    flow_row_padding_frames: int = 0
    flow_bucket_padding_frames: int = 0
    # engine.flow_fill_padding: chunks grown into their batch's padding, tokens they took.
    flow_grown_chunks: int = 0
    flow_grown_tokens: int = 0
    # Stage batches whose flow or vocoder step failed and ran again chunk by chunk
    # (StageStats.batches_retried_apart).
    stage_batches_retried_apart: int = 0
    # engine.chunk_patience_s: chunks cut big because their audio was not due soon, and
    # their speech tokens (left out of the first-chunk fields below).
    patient_chunks: int = 0
    patient_tokens: int = 0
    # engine.first_chunk_hold_ms: rounds held for expected first chunks, the seconds they
    # waited, and the first chunks that made a round by it (StageStats).
    first_chunk_holds: int = 0
    first_chunk_hold_seconds: float = 0.0
    first_chunk_hold_caught: int = 0
    # ... and the expected first chunks a round started without, with how much later than
    # expected they came, summed (StageStats; a gauge: the sum falls when they came sooner).
    first_chunk_passed_over: int = 0
    first_chunk_passed_over_late_seconds: float = 0.0
    # engine.first_chunk_min_hop: first chunks planned below the floor, and decisions a
    # crowd of first chunks kept from it (FirstChunkPlanner).
    first_chunk_below_floor: int = 0
    first_chunk_crowded: int = 0
    # engine.stage_deadline_cut: rounds cut short for rows due before they would end.
    deadline_cuts: int = 0
    # The flow's voice-prompt K/V cache (engine.flow_prompt_cache): batches served from it
    # and the bytes it holds.
    prompt_cache_hits: int = 0
    prompt_cache_bytes: int = 0
    # The flow's per-utterance context cache (engine.flow_context_cache): chunks that read
    # their kept frames, chunks whose frames were kept, and the bytes of its pool.
    context_reads: int = 0
    context_records: int = 0
    context_bytes: int = 0
    # Where the first chunk of each utterance spends its time (sums of seconds over
    # `first_chunks` utterances): text in -> first speech token (text processing, LM
    # queue and prefill), -> the chunk's tokens decoded and queued to the stage, -> the
    # stage starts its batch, -> its audio is back. (With text_mode "stream" the first
    # phase includes waiting for the text.)
    first_chunks: int = 0
    first_chunk_lm_first_token_seconds: float = 0.0
    first_chunk_lm_decode_seconds: float = 0.0
    first_chunk_stage_wait_seconds: float = 0.0
    first_chunk_stage_seconds: float = 0.0
    # Speech tokens in those first chunks (their sum) as they ran, and as the chunker
    # queued them: what `engine.first_chunk` chose (the stage may grow a queued chunk by
    # the tokens that came meanwhile, `ChunkJob.grow`).
    first_chunk_tokens: int = 0
    first_chunk_planned_tokens: int = 0
    # The same for the first chunks of sessions' first utterances only (the first audio a
    # listener waits for in silence; a later utterance's first chunk usually plays after
    # earlier audio and shares its batches with other sessions' long chunks).
    opening_chunks: int = 0
    opening_chunk_lm_first_token_seconds: float = 0.0
    opening_chunk_lm_decode_seconds: float = 0.0
    opening_chunk_stage_wait_seconds: float = 0.0
    opening_chunk_stage_seconds: float = 0.0
    opening_chunk_tokens: int = 0
    opening_chunk_planned_tokens: int = 0
    # The chunks in the batches those first chunks ran in (summed per chunk): a burst's
    # first chunks split over a small round and a full one show as a mean below the burst.
    first_chunk_batch_rows: int = 0
    opening_chunk_batch_rows: int = 0
    # The second chunk of sessions' first utterances, the one a short first chunk must
    # cover (sums over `opening_second_chunks`): from the LM having its tokens to its queueing
    # (once the stage has taken the first chunk), to the stage's batch start, to its audio;
    # and by how much it came after the first chunk's audio had run out (a stall, as the
    # engine sees it: `_late_seconds` over `_lates`), with the chunks in the batch the
    # late ones' first chunks ran in (`_late_first_rows`, summed: a first chunk that ran in
    # a small round ahead of its burst starts its listener's clock a round early).
    opening_second_chunks: int = 0
    opening_second_chunk_ready_wait_seconds: float = 0.0
    opening_second_chunk_stage_wait_seconds: float = 0.0
    opening_second_chunk_stage_seconds: float = 0.0
    opening_second_chunk_lates: int = 0
    opening_second_chunk_late_seconds: float = 0.0
    opening_second_chunk_late_first_rows: int = 0
    # What the first-chunk planner takes a first chunk's audio to fall short of its tokens
    # by (the vocoder's held-back frames; the largest seen, `FirstChunkPlanner.holdback_s`).
    first_chunk_holdback_seconds: float = 0.0
    # The latest planned first chunk's inputs (`FirstChunkPlanner.last`; 0 before any, or
    # when a round was not predicted): the LM's seconds per token (the slower of the
    # utterance's own, `_own_`, and what `LMSteps` learnt for as many utterances decoding)
    # and the predicted rounds of that first chunk and of the chunk after it.
    first_chunk_plan_lm_step_seconds: float = 0.0
    first_chunk_plan_lm_step_own_seconds: float = 0.0
    first_chunk_plan_round_seconds: float = 0.0
    first_chunk_plan_second_round_seconds: float = 0.0
    # The same for the latest session's first utterance (`FirstChunkPlanner.last_opening`):
    # what a burst's opening chunks were planned on, to set against `opening_chunk_*` and
    # `opening_second_chunk_*` (what their two rounds took).
    opening_chunk_plan_lm_step_seconds: float = 0.0
    opening_chunk_plan_lm_step_own_seconds: float = 0.0
    opening_chunk_plan_round_seconds: float = 0.0
    opening_chunk_plan_second_round_seconds: float = 0.0
    # The LM server's own timings, summed (`engine.backends.lm_times`; vLLM with
    # EngineConfig.lm_timing, else zeros).
    lm_server_requests: int = 0
    lm_server_queued_seconds: float = 0.0
    lm_server_prefill_seconds: float = 0.0
    lm_server_decode_seconds: float = 0.0
    lm_server_decode_tokens: int = 0
    lm_server_first_tokens: int = 0
    lm_server_first_token_seconds: float = 0.0
    # How long the engine's start took, by step (`Engine.create`): loading the model
    # directory, starting the LM backend (vLLM: its engine core's compile and graphs; with
    # EngineConfig.overlap_start the wait left after the stage and voice steps), building
    # and starting the audio stage, the warm-up voice (the flow's compile and its graphs)
    # and the warm-up syntheses.
    start_load_seconds: float = 0.0
    start_lm_seconds: float = 0.0
    start_stage_seconds: float = 0.0
    start_voice_seconds: float = 0.0
    start_warmup_seconds: float = 0.0
    # torch's CUDA allocator on the engine's device (0 on CPU): what the flow, vocoder
    # and an in-process LM hold now and at most since start. A vLLM engine core in its
    # own process is not included.
    cuda_memory_allocated_bytes: int = 0
    cuda_max_memory_allocated_bytes: int = 0
    # Audio stages whose process died or stalled. With several stages the engine serves on
    # the others (still ready), at that much less capacity.
    stages_failed: int = 0


@dataclass
class FirstChunkTimes:
    """Running sums of the first-chunk phases (see EngineStats); one per engine."""

    count: int = 0
    lm_first_token: float = 0.0
    lm_decode: float = 0.0
    stage_wait: float = 0.0
    stage: float = 0.0
    tokens: int = 0
    planned_tokens: int = 0
    batch_rows: int = 0

    def add(self, submitted: float, first_token: float, queued: float, started: float, done: float,
            tokens: int, planned_tokens: int, batch_rows: int) -> None:
        self.count += 1
        self.tokens += tokens
        self.planned_tokens += planned_tokens
        self.batch_rows += batch_rows
        self.lm_first_token += first_token - submitted
        self.lm_decode += queued - first_token
        self.stage_wait += max(0.0, started - queued)
        self.stage += done - max(started, queued)

    def stats_fields(self, name: str = "first_chunk") -> dict[str, float | int]:
        """These sums as EngineStats fields named `name`s, `name`_lm_first_token_seconds, ..."""
        return {f"{name}s": self.count, f"{name}_lm_first_token_seconds": self.lm_first_token,
                f"{name}_lm_decode_seconds": self.lm_decode, f"{name}_stage_wait_seconds": self.stage_wait,
                f"{name}_stage_seconds": self.stage, f"{name}_tokens": self.tokens,
                f"{name}_planned_tokens": self.planned_tokens, f"{name}_batch_rows": self.batch_rows}


@dataclass
class SecondChunkTimes:
    """Running sums of the opening second chunks' phases (see EngineStats); one per engine."""

    count: int = 0
    ready_wait: float = 0.0
    stage_wait: float = 0.0
    stage: float = 0.0
    lates: int = 0
    late: float = 0.0
    late_first_rows: int = 0

    def add(self, ready: float, queued: float, started: float, done: float, due: float, first_rows: int) -> None:
        """`first_rows`: the chunks in the batch the first chunk ran in."""
        self.count += 1
        self.ready_wait += max(0.0, queued - ready)
        self.stage_wait += max(0.0, started - queued)
        self.stage += done - max(started, queued)
        if done > due:
            self.lates += 1
            self.late += done - due
            self.late_first_rows += first_rows

    def stats_fields(self, name: str = "opening_second_chunk") -> dict[str, float | int]:
        return {f"{name}s": self.count, f"{name}_ready_wait_seconds": self.ready_wait,
                f"{name}_stage_wait_seconds": self.stage_wait, f"{name}_stage_seconds": self.stage,
                f"{name}_lates": self.lates, f"{name}_late_seconds": self.late,
                f"{name}_late_first_rows": self.late_first_rows}


@dataclass
class StartClock:
    """Seconds per step of an engine's start, in order (the steps' names are the keys)."""

    laps: dict[str, float] = field(default_factory=dict)
    _last: float = field(default_factory=time.monotonic)

    def lap(self, name: str) -> None:
        now = time.monotonic()
        self.laps[name] = now - self._last
        self._last = now


async def spawn_stages(config: EngineConfig, device: torch.device) -> RemoteStage | StagePool:
    """`build_stage`, each stage in a process of its own (`engine.stage_process`), started
    together."""
    policy = graph_policy(config)
    if not config.stage_devices:
        return await RemoteStage.spawn(config, device, policy)
    spawns = [RemoteStage.spawn(_one_stage_config(config, i), torch.device(name), policy)
              for i, name in enumerate(config.stage_devices)]
    started = await asyncio.gather(*spawns, return_exceptions=True)
    stages = [s for s in started if isinstance(s, RemoteStage)]
    failed = [s for s in started if isinstance(s, BaseException)]
    if failed:  # none may outlive a failed start
        await asyncio.gather(*(s.close() for s in stages), return_exceptions=True)
        raise failed[0]
    return StagePool(stages)


def _one_stage_config(config: EngineConfig, index: int) -> EngineConfig:
    """The configuration of stage `index` of `stage_devices`, as its own process builds it."""
    profile = str(Path(config.stage_profile_dir) / f"stage{index}") if config.stage_profile_dir else ""
    return replace(config, stage_devices=(), stage_profile_dir=profile)


def _grammar(language: str | None) -> Literal["zh", "en"] | None:
    """The normalisation grammar a language hint picks: Chinese ("zh", "yue", "cmn" ...) or
    English ("en..."); None (detect from the text) for anything else."""
    tag = (language or "").lower().replace("_", "-").split("-")[0]
    if tag in ("zh", "yue", "cmn", "wuu"):
        return "zh"
    return "en" if tag == "en" else None


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        model: LoadedModel,
        backend: LMBackend,
        stage: AudioStage | StagePool | RemoteStage,
        tokenizer,
        featurizer,
        device: torch.device,
    ):
        self.config = config
        self.model = model
        self.backend = backend
        self.stage = stage
        self.tokenizer = tokenizer
        self.featurizer = featurizer
        self.device = device
        mc = model.config
        self.sample_rate = mc.sample_rate
        self.model_name = model.model_dir.name
        self.vocab = unified_vocab(mc.lm)
        # Only CosyVoice3's runtime drops long silence runs (CosyVoice2Model has none).
        self.silent_tokens = SILENT_TOKENS if mc.version == "cosyvoice3" else frozenset()
        self.ready = False
        self.lm_tokens = 0
        self.lm_streams = 0  # utterances whose LM is generating now
        # Whether the LM still makes tokens for the streams waiting on it (`_watch_lm`).
        self.lm_watch = LMWatch(config.lm_stall_timeout_s)
        self._lm_stall: str | None = None
        self._lm_watcher: asyncio.Task[None] | None = None
        self.first_chunks_pending = 0  # utterances whose awaited first chunk is not on the stage yet
        self.patient_chunks = 0  # chunks cut big, their audio not due soon (chunk_patience_s) ...
        self.patient_tokens = 0  # ... and their speech tokens
        self.first_chunk_times = FirstChunkTimes()
        # How long each step of `create` took (StartClock.laps); empty for an engine built
        # another way (tests).
        self.start_seconds: dict[str, float] = {}
        self.opening_chunk_times = FirstChunkTimes()  # of sessions' first utterances only
        self.opening_second_chunk_times = SecondChunkTimes()
        self.first_chunks = FirstChunkPlanner(config.initial_hop_max, config.first_chunk_margin,
                                              opening_rate=config.first_chunk_opening_rate,
                                              learn_second_rounds=config.first_chunk_second_rounds,
                                              min_hop=config.first_chunk_min_hop,
                                              min_hop_crowd=config.first_chunk_min_hop_crowd,
                                              idle_hop=config.idle_initial_hop)
        # `flow_fill_padding` as it stands (`tune_planner` may change it): chunks carry their
        # spare tokens to a stage in its own process while it is on.
        self.fill_padding = config.flow_fill_padding
        self.remote_stage = config.resolved_stage_process()
        self._sessions: set[Session] = set()
        self._prefix_cache: dict[tuple[str, str | None, str | None], tuple[int, ...]] = {}
        self._warmed_prompts: set[int] = set()  # prompt lengths whose flow graphs are captured
        self._warming: set[int] = set()  # prompt lengths with a background warm-up in flight
        self._started = False  # `create` finished: not ready since means draining or failed
        self._background: set[asyncio.Task[int]] = set()
        self._ids = itertools.count()

    # ----------------------------------------------------------------- lifecycle
    @classmethod
    async def create(cls, config: EngineConfig) -> "Engine":
        """Load the model directory, start the LM backend and the audio stage, warm up."""
        from .frontend.onnx_models import SpeakerEncoder, SpeechTokenizer
        from .frontend.prompt import PromptFeaturizer
        from .frontend.tokenizer import TextTokenizer

        device = config.resolved_device()
        backend_name = config.resolved_backend()
        model_dir = Path(config.model_dir)
        clock = StartClock()

        def build() -> tuple[LoadedModel, object, object]:
            model = load_model(model_dir, load_lm=(backend_name == "torch"))
            if not config.resolved_stage_process():  # else the stage's process loads its own
                model.flow.to(device)
                model.hift.to(device)
            version = model.config.version
            tok = TextTokenizer.from_dir(model_dir / "CosyVoice-BlankEN", version=version)
            feat = PromptFeaturizer(
                SpeechTokenizer(model_dir / family(version).speech_tokenizer),
                SpeakerEncoder(model_dir / "campplus.onnx"),
                model.config.mel,
            )
            _ = feat.fingerprint  # reads the networks' files: here, not on the event loop
            return model, tok, feat

        model, tok, feat = await asyncio.to_thread(build)
        clock.lap("load")
        vocab = unified_vocab(model.config.lm)
        backend: LMBackend
        if backend_name == "torch":
            from .backends.torch_backend import TorchLMBackend

            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
            backend = TorchLMBackend(model.lm, vocab, device=device, dtype=dtype, max_batch=config.lm_max_batch)
        elif backend_name == "vllm":
            # CosyVoice2 too: its export carries llm_embedding's sos/task_id rows and the
            # llm_decoder bias (speech-head plugin class); prompts are the same unified ids.
            from .backends.vllm_backend import VLLMBackend
            from .backends.vllm_export import ensure_vllm_export

            lm_cfg = model.config.lm
            export_dir = await asyncio.to_thread(ensure_vllm_export, model_dir, lm_cfg.qwen, lm_cfg, vocab)
            backend = VLLMBackend(
                export_dir,
                vocab,
                gpu_memory_utilization=config.vllm_gpu_memory_utilization,
                max_model_len=config.vllm_max_model_len,
                max_num_seqs=config.lm_max_batch,
                async_scheduling=config.vllm_async_scheduling,
                timing=config.lm_timing,
                start_in_thread=config.overlap_start,
                mps_thread_percent=config.vllm_mps_thread_percent,
                mps_priority=config.vllm_mps_priority,
                compile_sampling=config.vllm_compile_sampling,
                cudagraph_mode=config.vllm_cudagraph_mode,
            )
        else:
            raise EngineError("bad_config", f"unknown LM backend {backend_name!r}")
        if not config.overlap_start:
            await backend.start()
            clock.lap("lm")
        # With overlap_start the LM starts (vLLM: its engine core compiles and captures in
        # its own process) while the audio stage is built and the flow warmed on the
        # warm-up voice, which need no LM; "lm" is then the wait left after those.
        lm_start = asyncio.create_task(backend.start()) if config.overlap_start else None
        stage: AudioStage | StagePool | RemoteStage | None = None
        engine: Engine | None = None
        try:
            if config.resolved_stage_process():
                stage = await spawn_stages(config, device)
            else:
                stage = build_stage(model, device, config)
            await stage.start()
            clock.lap("stage")
            engine = cls(config, model, backend, stage, tok, feat, device)
            voice = await engine._warmup_voice() if config.warmup else None
            clock.lap("voice")
            if lm_start is not None:
                # Shielded: cancelling the start must not cancel the wait for vLLM's
                # engine core, which a worker thread builds whatever happens here.
                await asyncio.shield(lm_start)
                clock.lap("lm")
            if voice is not None:
                await engine._warmup(voice)
            clock.lap("warmup")
        except BaseException:
            # What started must not outlive a failed start (vLLM: a child process).
            if lm_start is not None:
                with contextlib.suppress(BaseException):
                    await lm_start
            with contextlib.suppress(Exception):
                if engine is not None:
                    await engine.close()
                else:
                    if stage is not None:
                        await stage.close()
                    await backend.close()
            raise
        engine.stage.started()
        engine.ready = engine._started = True
        if config.lm_stall_timeout_s > 0:
            engine._lm_watcher = asyncio.create_task(engine._watch_lm(), name="lm-watch")
        engine.start_seconds = clock.laps
        log.info("engine ready in %.1f s (%s)", sum(clock.laps.values()),
                 ", ".join(f"{k} {v:.1f} s" for k, v in clock.laps.items()))
        return engine

    async def _warmup_voice(self) -> VoicePrompt:
        """The warm-up voice; preparing it compiles the flow and captures its graphs."""
        sr = self.sample_rate
        t = np.arange(int(WARMUP_PROMPT_SECONDS * sr)) / sr
        wav = (0.1 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
        return await self.prepare_voice(WARMUP_VOICE_ID, wav, sr, "Warm up.")

    async def _warmup(self, voice: VoicePrompt) -> None:
        """Syntheses with the warm-up voice through the whole engine."""
        text = "Warm up."
        await self.synthesize(text, voice, SessionOptions(tokens_per_text_token=4.0, seed=0))
        # Several at once too (EngineConfig.warmup_concurrency), each as long as a sentence:
        # their batches are the sizes a burst makes (first chunks, then long chunks with
        # their left context), which the stage's round times keep for the first-chunk
        # planner. Short utterances taught it rounds cheaper than the load's (round 9).
        together = self.config.warmup_concurrency
        if together is None:
            together = self.config.max_gpu_batch if self.device.type == "cuda" else CPU_WARMUP_CONCURRENCY
        together = min(together, self.config.max_gpu_batch)
        if together < 1:
            return
        ratio = WARMUP_SPEECH_TOKENS / max(1, len(await asyncio.to_thread(self.text_ids, text)))
        opts = SessionOptions(tokens_per_text_token=ratio, seed=0)
        # One such utterance alone, twice: one-row rounds for the planner too, so the first
        # session after a start is not planned on the full batch's round times (round 12:
        # its first chunk got 9 tokens). The first run's rounds capture graphs, which do
        # not count (`AudioStage` skips them); the second's do.
        for _ in range(2):
            await self.synthesize(text, voice, opts)
        if together > 1:
            await asyncio.gather(*(self.synthesize(text, voice, opts) for _ in range(together)))

    async def _watch_lm(self) -> None:
        """Report the LM failed (`failure`) once streams have waited on it for
        `lm_stall_timeout_s` without a token (`LMWatch`): a vLLM engine core alive but stuck
        raises nothing. A check that itself ran late (the process or its event loop stood
        still, and with it the tokens' delivery) judges nothing and counts from then."""
        watch = self.lm_watch
        period = min(5.0, watch.timeout_s / 4)
        last = time.monotonic()
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            if now - last > 2 * period + 1.0:
                watch.pause()
            blocked = getattr(self.backend, "blocked_on_text", None)
            if blocked is not None and blocked():
                watch.pause()  # the queue waits on clients' text (every row holds a stream)
            last = now
            why = watch.stalled()
            if why is not None:
                log.error("%s: the engine can serve no more", why)
                self._lm_stall = why
                return

    async def close(self) -> None:
        if self._lm_watcher is not None:
            self._lm_watcher.cancel()
        for task in list(self._background):
            task.cancel()
        try:
            for s in list(self._sessions):
                await s.abort()
            await self.stage.close()
        finally:
            # The LM stops whatever the stage's close did (a stage process that would not
            # close): left running, vLLM's engine core keeps its GPU memory and process.
            # The stage's error, if any, is raised after it.
            try:
                await self.backend.close()
            finally:
                self.ready = False

    # ----------------------------------------------------------------- voices
    async def prepare_voice(self, voice_id: str, wav: np.ndarray, sample_rate: int, transcript: str) -> VoicePrompt:
        """Compute a voice's prompt features (speech tokens, mel, speaker embedding) once,
        and warm the stage for it (`warm_voice`)."""
        voice = await self.featurize_voice(voice_id, wav, sample_rate, transcript)
        await self.warm_voice(voice)
        return voice

    async def featurize_voice(self, voice_id: str, wav: np.ndarray, sample_rate: int, transcript: str) -> VoicePrompt:
        """A voice's prompt features (speech tokens, mel, speaker embedding), off the event loop."""
        wav = np.asarray(wav, dtype=np.float32)
        if wav.ndim == 2:
            wav = wav.mean(axis=1 if wav.shape[1] <= 8 else 0)
        tokens, feat, emb = await asyncio.to_thread(self.featurizer.featurize, wav, int(sample_rate))
        return self.voice_from_arrays(voice_id, transcript, tokens, feat, emb)

    async def warm_voice(self, voice: VoicePrompt) -> int:
        """Capture the flow's CUDA graphs for every batch shape this voice's chunks can
        produce, so no request pays for a capture (tens of graphs, once per prompt length:
        plain, one-voice and per-row prefix ones); returns how many were captured (0 off
        CUDA or when done before).
        With `flow_prompt_cache` also builds the voice's prompt K/V cache entry on every stage
        (per voice, not per prompt length; a later chunk would otherwise build it on first use)."""
        P = voice.num_tokens
        prompt = FlowChunk(tokens=voice.speech_tokens, prompt_feat=voice.speech_feat, embedding=voice.embedding,
                           num_prompt_tokens=P, out_start=P, finalize=True)
        if self.config.flow_prompt_cache and voice.voice_id != WARMUP_VOICE_ID:
            await self.stage.warm_prompt(prompt)
        if self.config.flow_prompt_cache and self.config.flow_context_cache_bytes:
            # Once per stage, with the first voice that has a cached block (warm-up's included):
            # the compiled DiT's context-cache calls, before any load meets them.
            await self.stage.warm_context(prompt)
        if P in self._warmed_prompts or not hasattr(self.stage, "warm_graphs"):
            return 0
        shapes = voice_graph_shapes(self.config, self.model.config.flow.pre_lookahead_len, P,
                                    self._cached_prompt_frames(P))
        captured = await self.stage.warm_graphs(shapes)
        self._warmed_prompts.add(P)  # only once captured: a failed capture is tried again with the next voice
        return captured

    def alone(self) -> bool:
        """Whether at most one utterance is decoding and at most one is on the stages: the
        one asking, sizing its first chunk (`EngineConfig.idle_initial_hop`)."""
        return self.lm_streams <= 1 and self.stage.live_utterances() <= 1

    def _cached_prompt_frames(self, num_prompt_tokens: int) -> int:
        """C of a P-token prompt when the flow prompt cache serves this model, else 0."""
        flow = self.model.flow
        if not self.config.flow_prompt_cache or not supports_prompt_cache(flow):
            return 0
        return cacheable_frames(num_prompt_tokens, flow.token_mel_ratio, flow.pre_lookahead_len,
                                flow.decoder.estimator.static_chunk_size)

    @property
    def features_id(self) -> str:
        """What a voice's stored features depend on (`PromptFeaturizer.fingerprint`)."""
        return self.featurizer.fingerprint

    def voice_from_arrays(self, voice_id: str, transcript: str, speech_tokens, speech_feat, embedding) -> VoicePrompt:
        return VoicePrompt(
            voice_id=voice_id,
            transcript=transcript,
            speech_tokens=torch.as_tensor(np.asarray(speech_tokens), dtype=torch.long).reshape(-1),
            speech_feat=torch.as_tensor(np.asarray(speech_feat), dtype=torch.float32).reshape(-1, 80),
            embedding=torch.as_tensor(np.asarray(embedding), dtype=torch.float32).reshape(-1),
        )

    # ----------------------------------------------------------------- health
    @property
    def ready(self) -> bool:
        """Loaded and warmed, not draining, and its stage and LM still able to serve (a
        dead stage process or vLLM engine core fails every request: /ready says so, and a
        pool places no session here)."""
        return self._ready and self.failure is None

    @ready.setter
    def ready(self, value: bool) -> None:
        self._ready = value

    @property
    def failure(self) -> str | None:
        """Why this engine can serve no more; None while it can."""
        if self._lm_stall is not None:
            return self._lm_stall
        for part in (getattr(self, "stage", None), getattr(self, "backend", None)):
            why = getattr(part, "failure", None)
            if why is not None:
                return str(why)
        return None

    # ----------------------------------------------------------------- sessions
    def open_session(self, voice: VoicePrompt, options: SessionOptions | None = None) -> "Session":
        if not self.ready and voice.voice_id != WARMUP_VOICE_ID:
            # Loading, draining (SIGTERM), or failed: with warm-up on or off alike.
            raise EngineError("not_ready", self.failure or ("engine is still loading" if not self._started
                                                            else "engine is not serving (draining)"))
        P = voice.num_tokens
        if P not in self._warmed_prompts and P not in self._warming:
            # A voice from the store (featurised before this process started): warm its
            # graphs in the background, once per prompt length however many sessions open
            # meanwhile; until then new shapes are captured on first use.
            self._warming.add(P)
            task = asyncio.get_running_loop().create_task(self.warm_voice(voice), name=f"warm-{voice.voice_id}")
            self._background.add(task)
            task.add_done_callback(lambda t: self._warmed(t, P))
        s = Session(self, voice, options or SessionOptions(), f"s{next(self._ids)}")
        self._sessions.add(s)
        return s

    def _warmed(self, task: asyncio.Task, prompt_tokens: int) -> None:
        self._background.discard(task)
        self._warming.discard(prompt_tokens)
        if not task.cancelled() and task.exception() is not None:
            log.error("warming a voice's graphs failed; its shapes are captured on first use",
                      exc_info=task.exception())

    def _session_ended(self, s: "Session") -> None:
        self._sessions.discard(s)

    async def synthesize(self, text: str, voice: VoicePrompt, options: SessionOptions | None = None) -> np.ndarray:
        """Whole utterance as one float32 array (24 kHz)."""
        sess = self.open_session(voice, options)
        await sess.submit(text)
        await sess.finish()
        parts: list[np.ndarray] = []
        async for ev in sess.events():
            if isinstance(ev, UtteranceError):
                raise EngineError(ev.code, ev.message)
            parts.append(ev.pcm)
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)

    def tune_planner(self, knobs: dict[str, object]) -> None:
        """`FirstChunkPlanner.tune` and `AudioStage.tune` (`POST /debug/planner`), each with
        its own knobs; all or none."""
        unknown = [name for name in knobs if name not in TUNABLE and name not in STAGE_TUNABLE]
        if unknown:
            raise ValueError(f"{unknown[0]!r} is not tunable (one of {', '.join(sorted({*TUNABLE, *STAGE_TUNABLE}))})")
        stage = check_stage_knobs({k: v for k, v in knobs.items() if k in STAGE_TUNABLE})
        self.first_chunks.tune({k: v for k, v in knobs.items() if k in TUNABLE})
        if stage:
            self.stage.tune(stage)
            self.fill_padding = bool(stage.get("fill_padding", self.fill_padding))

    def planner_state(self) -> dict[str, object]:
        """The first-chunk planner's learnt inputs (`FirstChunkPlanner.snapshot`) and the
        stage's round times (`RoundTimes.snapshot`): what sized the first chunks, beside
        what `stats` says they took.

        With `stage_devices` (a `StagePool`) each stage learns its own round times (its own
        GPU, its own load) and a first chunk is planned on those of the stage its utterance
        is bound to, so there is no one table: `stage_round_times` has one per stage, in
        `stage_devices` order, and `stage_live_utterances` each one's utterances, in place
        of `round_times` (a merge of the tables would be a curve no plan used).
        `live_utterances` is the stages' sum."""
        state = self.first_chunks.snapshot() | {"initial_hop": self.config.initial_hop,
                                                "live_utterances": self.stage.live_utterances()}
        if isinstance(self.stage, StagePool):
            return state | {"stage_round_times": [s.rounds.snapshot() for s in self.stage.stages],
                            "stage_live_utterances": self.stage.load()}
        return state | {"round_times": self.stage.rounds.snapshot()}

    def stats(self) -> EngineStats:
        st = self.stage.stats
        return EngineStats(
            active_sessions=len(self._sessions),
            active_utterances=sum(s.active_utterances() for s in self._sessions),
            lm_active=self.backend.num_active(),
            flow_queue=st.queued,
            last_batch_size=st.last_batch_size,
            max_batch_size=st.max_batch_size,
            batches=st.batches,
            chunks=st.chunks,
            dropped_chunks=st.dropped,
            lm_tokens=self.lm_tokens,
            stage_busy_seconds=st.busy_seconds,
            stage_handoff_seconds=st.handoff_seconds,
            flow_frames=st.flow_frames,
            flow_exact_frames=st.flow_exact_frames,
            flow_row_padding_frames=st.flow_row_padding_frames,
            flow_bucket_padding_frames=st.flow_bucket_padding_frames,
            vocoder_frames=st.vocoder_frames,
            flow_grown_chunks=st.grown_chunks,
            flow_grown_tokens=st.grown_tokens,
            stage_batches_retried_apart=st.batches_retried_apart,
            patient_chunks=self.patient_chunks,
            patient_tokens=self.patient_tokens,
            first_chunk_holds=st.first_chunk_holds,
            first_chunk_hold_seconds=st.first_chunk_hold_seconds,
            first_chunk_hold_caught=st.first_chunk_hold_caught,
            first_chunk_passed_over=st.first_chunk_passed_over,
            first_chunk_passed_over_late_seconds=st.first_chunk_passed_over_late_seconds,
            first_chunk_below_floor=self.first_chunks.below_floor,
            first_chunk_crowded=self.first_chunks.crowded,
            deadline_cuts=st.deadline_cuts,
            prompt_cache_hits=st.prompt_cache_hits,
            prompt_cache_bytes=st.prompt_cache_bytes,
            context_reads=st.context_reads,
            context_records=st.context_records,
            context_bytes=st.context_bytes,
            **self.first_chunk_times.stats_fields(),
            first_chunk_holdback_seconds=self.first_chunks.holdback_s,
            **_plan_fields(self.first_chunks.last),
            **_plan_fields(self.first_chunks.last_opening, "opening_chunk"),
            **self.opening_chunk_times.stats_fields("opening_chunk"),
            **self.opening_second_chunk_times.stats_fields(),
            **(lm_times.stats_fields() if (lm_times := self.backend.server_times()) is not None else {}),
            **{f"start_{step}_seconds": s for step, s in self.start_seconds.items()},
            **self._cuda_memory(),
            stages_failed=sum(getattr(s, "failure", None) is not None for s in getattr(self.stage, "stages", [self.stage])),
        )

    def _cuda_memory(self) -> dict[str, int]:
        """The CUDA allocator's bytes on this engine's device, the stage's process's included."""
        ours = cuda_memory(self.device)
        theirs = getattr(self.stage, "cuda_memory", None)
        if isinstance(theirs, dict):
            return {k: ours.get(k, 0) + theirs.get(k, 0) for k in ours.keys() | theirs.keys()}
        return ours

    # ----------------------------------------------------------------- prompts
    def text_ids(self, text: str, language: str | None = None) -> list[int]:
        """The text ids of one utterance's text, normalised (`language`: a BCP-47-ish hint;
        "zh..." or "en..." picks that grammar, anything else detects it)."""
        if self.config.text_normalization:
            from .frontend.text import normalize

            text = normalize(text, _grammar(language))
        return self.tokenizer.encode(text)

    def lm_prefix(self, voice: VoicePrompt, opts: SessionOptions) -> tuple[list[int], list[int]]:
        """(prompt text ids, prompt speech tokens) for the LM, cached per voice and mode."""
        # Keyed by the prompt's parts themselves, so a re-registered voice never sees a stale
        # prefix.
        key = (opts.mode, voice.transcript if opts.mode == "zero_shot" else None,
               opts.instruction if opts.mode == "instruct" else None)
        ids = self._prefix_cache.get(key)
        if ids is None:
            transcript = voice.transcript
            if self.model.config.version == "cosyvoice2" and opts.mode == "zero_shot" and self.config.text_normalization:
                # CosyVoice2's transcript is normalised like the text (unsplit, as officially);
                # CosyVoice3's carries <|endofprompt|>, which the official frontend leaves alone.
                from .frontend.text import normalize

                transcript = normalize(transcript, terminal=False)
            text = lm_prompt_text(opts.mode, transcript, opts.instruction, self.model.config.version)
            if len(self._prefix_cache) >= PREFIX_CACHE_SIZE:
                self._prefix_cache.pop(next(iter(self._prefix_cache)))
            ids = self._prefix_cache[key] = tuple(self.tokenizer.encode(text))
        speech = voice.speech_tokens.tolist() if opts.mode == "zero_shot" else []
        return list(ids), speech


def _plan_fields(plan: PlanInputs | None, name: str = "first_chunk") -> dict[str, float]:
    """EngineStats' `name`_plan_* gauges of a first-chunk decision."""
    if plan is None:
        return {}
    return {f"{name}_plan_lm_step_seconds": plan.step_s,
            f"{name}_plan_lm_step_own_seconds": plan.own_step_s or 0.0,
            f"{name}_plan_round_seconds": plan.first_round_s or 0.0,
            f"{name}_plan_second_round_seconds": plan.second_round_s or 0.0}


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
        if feed is None and _grammar(opts.language) is None:
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
        except EngineError as exc:
            await self._fail(utt, UtteranceError(utt.uid, exc.code, str(exc)))
        except SpeechLimitReached as exc:
            await self._fail(utt, UtteranceError(utt.uid, "speech_too_long", str(exc)))
        except Exception as exc:  # one utterance fails; the session and engine go on
            log.exception("utterance %s failed", utt.uid)
            await self._fail(utt, UtteranceError(utt.uid, "engine_error", f"{type(exc).__name__}: {exc}"))
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
        # ... and so is a request's own schedule: no chunk cut by timing (patience) then.
        may_wait = opts.initial_hop is None and opts.max_hop is None
        look = flow_cfg.pre_lookahead_len
        # Whether nothing else is on the engine is known when the first chunk is sized, and
        # the planner may go below the floor then (`first_chunk_min_hop`): until then the
        # schedule waits for the fewest tokens the first chunk may take.
        busy_floor, idle_floor = None, eng.first_chunks.idle_hop  # as the utterance starts (`tune`)
        if not first_planned and 0 < cfg.initial_hop < cfg.initial_hop_max:
            lowest = min(h for h in (idle_floor, eng.first_chunks.min_hop, cfg.initial_hop) if h > 0)
            if lowest < cfg.initial_hop:
                busy_floor, sched.initial_hop = cfg.initial_hop, lowest
        while not utt.cancelled:
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
                    lambda at, n: eng.stage.round_estimate(stream, self._chunk_frames(at, n, cached, flow_cfg), cached),
                    opts.speed, opening=utt.opening, streams=eng.lm_streams,
                    staged=eng.stage.live_utterances(stream), sizing=eng.first_chunks_pending - 1)
                sched.initial_hop = first
                if first != low:  # `hop` was for the fewest tokens: wait for this many
                    utt.stats.extra["first_hop"] = first
                    continue
            if hop is None and not lm_finished and not patient:
                wake.at = sched.tokens_needed()
                if sched.index == 0 and first_planned:  # its size is final: say when it comes
                    round_s = None
                    if cfg.first_chunk_hold_share > 0:  # and what missing a round would cost it
                        cached = eng._cached_prompt_frames(P)
                        frames = self._chunk_frames(0, sched.initial_hop, cached, flow_cfg)
                        round_s = eng.stage.round_estimate(stream, frames, cached)
                    step = _lm_step(utt)
                    if math.isfinite(step):  # no rate yet before the LM's fourth token
                        eng.stage.expect_first_chunk(stream, time.monotonic() + (wake.at - len(tokens)) * step,
                                                     round_s)
                more.clear()
                await more.wait()
                continue
            if patient:
                eng.patient_chunks += 1
                eng.patient_tokens += end - sched.offset
            elif hop is None:  # LM done: finalize with everything left
                if lm_task.exception() is not None:
                    raise lm_task.exception()  # type: ignore[misc]
                if not tokens:  # e.g. a streamed utterance whose text was empty
                    raise EngineError("empty_text", "nothing to speak")
                end, finalize = len(tokens), True
            else:
                end, finalize = sched.offset + hop, False
            extent = _Extent(end, finalize)
            job = self._flow_job(tokens, prompt_tokens, sched.offset, end, finalize, stream, opts.speed, sched.index, utt, flow_cfg)
            if not finalize:
                job.grow = self._grower(extent, tokens, sched.offset, sched.max_hop, lm_task, flow_cfg)
                if eng.fill_padding and eng.remote_stage:  # it grows the chunk there
                    job.spare = self._spare(tokens, sched.offset, end, job.flow, sched.max_hop, lm_task, flow_cfg)
                    job.grown_to = extent.grown_to
            queued_at = time.monotonic()
            # The chunks queued before this one and not yet made play before it too.
            in_flight = (sched.offset - utt.made_tokens) / SPEECH_TOKENS_PER_S / opts.speed
            runs_out = self.playback.runs_out()
            job.deadline, job.urgent = chunk_due(queued_at, runs_out, self._audio_ahead(utt) + in_flight)
            if in_flight > 0:  # taken as delivered now: the stage corrects by when it is
                job.deadline_from = max(queued_at, runs_out)
            eng.stage.submit(job)
            self._first_chunk_queued(utt)
            await handed.put(_Queued(job, sched.index, extent, queued_at, end, finalize,
                                     eng.stage.live_utterances(stream), patient))
            await asyncio.wait({job.started})  # cancelled with the utterance: the loop ends
            if extent.finalize or job.started.cancelled():
                return
            sched.advance(extent.end - sched.offset)  # the stage may have grown the chunk

    def _patience_left(self, utt: _Utterance, offset: int) -> float | None:
        """Seconds the utterance's next chunk (its tokens from `offset`) may wait for more
        tokens before its audio is due within `chunk_patience_s`; None when it is due
        sooner, or patience is off. Due as the stage's deadline policy reckons it
        (`chunk_due`): after the audio delivered and the audio ahead of it have played."""
        patience = self.engine.config.chunk_patience_s
        if patience <= 0:
            return None
        now = time.monotonic()
        in_flight = (offset - utt.made_tokens) / SPEECH_TOKENS_PER_S / utt.options.speed
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
            if item.index == 0 and planned and utt.stats.first_token_at is not None:
                phases = (utt.stats.submitted_at, utt.stats.first_token_at, item.queued_at, batch.at, time.monotonic())
                eng.first_chunk_times.add(*phases, tokens=end, planned_tokens=item.queued_end, batch_rows=batch.rows)
                if utt.opening:
                    eng.opening_chunk_times.add(*phases, tokens=end, planned_tokens=item.queued_end, batch_rows=batch.rows)
            if item.index == 1 and planned and eng.ready:
                # Not from the warm-up: its first syntheses may wait behind graph captures (seconds).
                eng.first_chunks.learn_second_round(item.staged, time.monotonic() - max(item.queued_at, first_back))
            if item.index == 1 and planned and utt.arrivals is not None:
                self._second_chunk_done(utt, item.queued_at, batch.at, item.queued_end, item.queued_final, first_samples,
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

    def _second_chunk_done(self, utt: _Utterance, queued: float, started: float, queued_end: int,
                           finalize: bool, first_samples: int, first_rows: int, lookahead: int) -> None:
        """Record an opening utterance's second chunk (`SecondChunkTimes`): ready when the
        LM had the tokens it was queued with (and their lookahead), due when the first
        chunk's audio, from its arrival here, has played out. A first chunk that gave no
        audio (all of it held back) covers nothing: not recorded."""
        arrivals, utt.arrivals = utt.arrivals or [], None  # no longer needed
        first_at = utt.stats.first_audio_at
        need = queued_end if finalize else queued_end + lookahead
        if first_at is None or not arrivals:
            return
        ready = arrivals[min(need, len(arrivals)) - 1]
        due = first_at + first_samples / self.engine.sample_rate
        self.engine.opening_second_chunk_times.add(ready, queued, started, time.monotonic(), due, first_rows)

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
