"""The streaming engine: start-up, voices, warm-up and the state its sessions share.

    engine = await Engine.create(EngineConfig(model_dir=...))
    voice  = await engine.prepare_voice("alice", wav, 24000, "transcript")
    sess   = engine.open_session(voice, SessionOptions())
    uid    = await sess.submit("Hello there.")
    uid, feed = await sess.submit_stream()    # text-in streaming: feed.append(...); feed.close()
    async for ev in sess.events(): ...        # AudioChunk | UtteranceError, in submission order
    await sess.cancel(uid)                    # barge-in

A session's utterances run in `engine.session` (LM -> chunk schedule -> audio stage ->
delivery), the statistics it reports are `engine.stats`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from .backends.base import LMBackend
from .config import EngineConfig
from .errors import EngineError
from .first_chunk import TUNABLE, FirstChunkPlanner
from .frontend.prompt import lm_prompt_text
from .frontend.text import language_grammar
from .lm_watch import LMWatch
from .models.flow import FlowChunk
from .models.lm import unified_vocab
from .flow_prompt_cache import cacheable_frames, supports_prompt_cache
from .models.loader import LoadedModel, family, load_model
from .session import SILENT_TOKENS, Session
from .stage_build import graph_policy, voice_graph_shapes
from .stage_pool import StagePool, build_stage
from .stage_process import RemoteStage
from .stats import EngineStats, FirstChunkTimes, SecondChunkTimes, StartClock, plan_fields, plan_sum_fields
from .token2wav import STAGE_TUNABLE, AudioStage, check_stage_knobs, cuda_memory
from .types import SessionOptions, UtteranceError, VoicePrompt

log = logging.getLogger(__name__)

PREFIX_CACHE_SIZE = 4096
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
        self.slow_opening_chunk_times = FirstChunkTimes()  # ... of those, the slow ones (SLOW_OPENING_S)
        self.opening_second_chunk_times = SecondChunkTimes()
        self.first_chunks = FirstChunkPlanner(config.initial_hop_max, config.first_chunk_margin,
                                              opening_rate=config.first_chunk_opening_rate,
                                              learn_second_rounds=config.first_chunk_second_rounds,
                                              min_hop=config.first_chunk_min_hop,
                                              min_hop_crowd=config.first_chunk_min_hop_crowd,
                                              idle_hop=config.idle_initial_hop,
                                              skip_patient=config.first_chunk_skip_patient,
                                              due_rounds=config.first_chunk_due_rounds,
                                              deadline_holdback=config.first_chunk_deadline_holdback,
                                              hold_refresh=config.first_chunk_hold_refresh,
                                              learnt_rounds_crowd=config.first_chunk_learnt_rounds_crowd)
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
        # With several stages, on each one: placed by load, one after another, they all went
        # to the first stage, and the others learnt no round but a burst's.
        pool = self.stage if isinstance(self.stage, StagePool) else None
        for index in range(len(pool.stages) if pool is not None else 1):
            if pool is not None:
                pool.pinned = index
            try:
                for _ in range(2):
                    await self.synthesize(text, voice, opts)
            finally:
                if pool is not None:
                    pool.pinned = None
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
            stage_pipelined_batches=st.pipelined_batches,
            patient_chunks=self.patient_chunks,
            patient_tokens=self.patient_tokens,
            first_chunk_holds=st.first_chunk_holds,
            first_chunk_hold_seconds=st.first_chunk_hold_seconds,
            first_chunk_hold_caught=st.first_chunk_hold_caught,
            first_chunk_burst_holds=st.first_chunk_burst_holds,
            first_chunk_passed_over=st.first_chunk_passed_over,
            first_chunk_passed_over_late_seconds=st.first_chunk_passed_over_late_seconds,
            first_chunk_below_floor=self.first_chunks.below_floor,
            first_chunk_crowded=self.first_chunks.crowded,
            first_chunk_learnt_rounds=self.first_chunks.learnt_round_plans,
            deadline_cuts=st.deadline_cuts,
            first_chunk_cuts=st.first_chunk_cuts,
            prompt_cache_hits=st.prompt_cache_hits,
            prompt_cache_bytes=st.prompt_cache_bytes,
            context_reads=st.context_reads,
            context_records=st.context_records,
            context_bytes=st.context_bytes,
            vocoder_graph_replays=st.vocoder_graph_replays,
            vocoder_eager_decodes=st.vocoder_eager_decodes,
            **self.first_chunk_times.stats_fields(),
            first_chunk_holdback_seconds=self.first_chunks.holdback_s,
            **plan_fields(self.first_chunks.last),
            **plan_fields(self.first_chunks.last_opening, "opening_chunk"),
            **plan_sum_fields(self.first_chunks.sums),
            **plan_sum_fields(self.first_chunks.opening_sums, "opening_chunk"),
            **self.opening_chunk_times.stats_fields("opening_chunk"),
            **self.slow_opening_chunk_times.stats_fields("slow_opening_chunk"),
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

            text = normalize(text, language_grammar(language))
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
