"""The Starlette application: routes, shared state, start-up and shutdown.

`create_app(settings)` is all a server (uvicorn, tests) needs. On start-up it resolves
the model, loads the engine, opens the voice store and registers the bundled voices;
on shutdown it closes them in reverse order.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import Mount, WebSocketRoute
from starlette.staticfiles import StaticFiles

from engine.config import EngineConfig
from engine.engine import Engine
from engine.heap import freeze_startup_objects, unfreeze
from engine.pool import EnginePool, create_engine
from engine.hub import RANDOM_MODELS, resolve_model
from engine.types import SessionOptions

from . import errors, http_api, ws
from .auth import Auth
from .encode_pool import EncodePool
from .loop_monitor import LoopLagMonitor
from .metrics import Metrics
from .settings import Settings
from .voice_pg import create_voice_store
from .voices import VoiceStore

log = logging.getLogger("gateway")
STATIC_DIR = Path(__file__).resolve().parent.parent / "static"


@dataclass
class GatewayState:
    """Everything a route handler needs, reachable as `request.app.state.gw`."""

    settings: Settings
    engine: Engine | EnginePool
    voices: VoiceStore
    metrics: Metrics
    auth: Auth
    encode_pool: EncodePool
    # Base options of every WebSocket context (requests override them).
    session_defaults: SessionOptions = SessionOptions()
    # Set on SIGTERM (`gateway.__main__`): new sessions are refused, and a WebSocket
    # connection closes with 1001 once its contexts are done and their audio is sent.
    draining: bool = False
    # Set with `draining` when the engine failed and the gateway exits for a restart
    # (Settings.exit_on_engine_failure): connections then close with 1012, not 1001.
    engine_failure: str | None = None
    registrations: int = 0  # `POST /v1/voices` in progress (voices.max_concurrent_registrations)


def engine_config(settings: Settings, model_dir: Path) -> EngineConfig:
    e = settings.engine
    ratio = e.tokens_per_text_token
    if ratio is None and (settings.model in RANDOM_MODELS or Path(settings.model).name in RANDOM_MODELS):
        ratio = 3.0  # random weights never stop on their own
    return EngineConfig(
        model_dir=model_dir,
        device=e.device,
        lm_backend=e.lm_backend,  # type: ignore[arg-type]
        initial_hop=e.initial_hop,
        idle_initial_hop=e.idle_initial_hop,
        initial_hop_max=e.initial_hop_max,
        first_chunk_min_hop=e.first_chunk_min_hop,
        first_chunk_min_hop_crowd=e.first_chunk_min_hop_crowd,
        first_chunk_margin=e.first_chunk_margin,
        first_chunk_opening_rate=e.first_chunk_opening_rate,  # type: ignore[arg-type]
        first_chunk_second_rounds=e.first_chunk_second_rounds,
        first_chunk_skip_patient=e.first_chunk_skip_patient,
        first_chunk_due_rounds=e.first_chunk_due_rounds,
        first_chunk_deadline_holdback=e.first_chunk_deadline_holdback,
        first_chunk_hold_refresh=e.first_chunk_hold_refresh,
        first_chunk_learnt_rounds_crowd=e.first_chunk_learnt_rounds_crowd,
        first_chunk_hold_ms=e.first_chunk_hold_ms,
        first_chunk_hold_share=e.first_chunk_hold_share,
        first_chunk_burst_hold_ms=e.first_chunk_burst_hold_ms,
        first_chunk_burst_rows=e.first_chunk_burst_rows,
        max_hop=e.max_hop,
        chunk_patience_s=e.chunk_patience_s,
        max_unread_audio_s=e.max_unread_audio_s,
        flow_left_context=e.flow_left_context,
        flow_final_full_attention=e.flow_final_full_attention,
        max_gpu_batch=e.max_gpu_batch,
        flow_dtype=e.flow_dtype,  # type: ignore[arg-type]
        flow_compile=e.flow_compile,
        flow_attention=e.flow_attention,  # type: ignore[arg-type]
        flow_attention_rotary=e.flow_attention_rotary,
        flow_conv_kernel=e.flow_conv_kernel,  # type: ignore[arg-type]
        vocoder_snake_kernel=e.vocoder_snake_kernel,  # type: ignore[arg-type]
        vocoder_channels_last=e.vocoder_channels_last,
        flow_split_prefix_rows=e.flow_split_prefix_rows,
        flow_cuda_graphs=e.flow_cuda_graphs,
        flow_graph_max_rows=e.flow_graph_max_rows,
        flow_graph_rows=e.flow_graph_rows,
        flow_graph_frames=e.flow_graph_frames,
        flow_graph_shared_rows=e.flow_graph_shared_rows,
        flow_graph_limit=e.flow_graph_limit,
        vocoder_cuda_graphs=e.vocoder_cuda_graphs,
        vocoder_graph_rows=e.vocoder_graph_rows,
        flow_prompt_cache=e.flow_prompt_cache,
        flow_prompt_cache_bytes=e.flow_prompt_cache_mib << 20,
        flow_context_cache_bytes=e.flow_context_cache_mib << 20,
        flow_context_min_rows=e.flow_context_min_rows,
        flow_split_batches=e.flow_split_batches,
        flow_split_padded=e.flow_split_padded,
        flow_split_call_cost=e.flow_split_call_cost,
        flow_fill_padding=e.flow_fill_padding,
        stage_policy=e.stage_policy,  # type: ignore[arg-type]
        stage_window_tolerance=e.stage_window_tolerance,
        stage_deadline_cut=e.stage_deadline_cut,
        stage_deadline_cut_margin_ms=e.stage_deadline_cut_margin_ms,
        stage_deadline_cut_rescue=e.stage_deadline_cut_rescue,
        stage_pipeline_lead_ms=e.stage_pipeline_lead_ms,
        stage_first_chunk_cut=e.stage_first_chunk_cut,
        stage_second_chunk_cut=e.stage_second_chunk_cut,
        stage_devices=e.stage_devices,
        stage_process=e.stage_process,
        stage_stall_timeout_s=e.stage_stall_timeout_s,
        lm_stall_timeout_s=e.lm_stall_timeout_s,
        stage_mps_thread_percent=e.stage_mps_thread_percent,
        stage_mps_priority=e.stage_mps_priority,  # type: ignore[arg-type]
        stage_profile_dir=e.stage_profile_dir,
        stage_profile_start=e.stage_profile_start,
        stage_profile_batches=e.stage_profile_batches,
        stage_profile_min_chunks=e.stage_profile_min_chunks,
        lm_max_batch=e.lm_max_batch,
        text_normalization=e.text_normalization,
        warmup=e.warmup,
        overlap_start=e.overlap_start,
        warmup_concurrency=e.warmup_concurrency,
        vllm_gpu_memory_utilization=e.vllm_gpu_memory_utilization,
        vllm_max_model_len=e.vllm_max_model_len,
        vllm_async_scheduling=e.vllm_async_scheduling,
        vllm_mps_thread_percent=e.vllm_mps_thread_percent,
        vllm_mps_priority=e.vllm_mps_priority,  # type: ignore[arg-type]
        vllm_compile_sampling=e.vllm_compile_sampling,
        vllm_cudagraph_mode=e.vllm_cudagraph_mode,  # type: ignore[arg-type]
        lm_timing=e.lm_timing,
        tokens_per_text_token=ratio,
    )


def transport_options(settings: Settings) -> dict[str, object]:
    """uvicorn options that come from the settings (every server of the app uses them)."""
    # The transport's frame limit sits above the protocol's so that an oversize frame gets
    # the `message_too_large` error event (the app reads it and answers) on a live socket;
    # only frames over twice the limit (at least the limit + 64 KiB) are refused by the
    # transport, with close code 1009. Each socket buffers at most one such frame.
    limit = settings.ws.max_message_bytes
    # uvicorn counts every open connection, idle ones too, and past its limit answers
    # everything with a bare 503 before any route runs: it was max_sessions + 64, so ~576
    # silent sockets locked out every client and the liveness probe. Sessions past
    # max_sessions are the app's to refuse (`too_many_sessions`).
    return {"ws_max_size": max(2 * limit, limit + (64 << 10)),
            "ws_per_message_deflate": settings.ws.per_message_deflate,
            "limit_concurrency": max(settings.max_connections, settings.max_sessions + 64)}


def _unfreeze(metrics: Metrics) -> None:
    unfreeze()
    metrics.frozen_objects = 0


def create_app(settings: Settings) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        data_dir = Path(settings.data_dir)
        data_dir.mkdir(parents=True, exist_ok=True)
        model_dir = resolve_model(settings.model, data_dir / "models")
        log.info("loading model from %s", model_dir)
        # Each part is closed, last first, whether the start fails after it (an unreachable
        # voice store) or the server stops; a close that raises does not skip the others.
        # An engine left open would keep its stage process, whose pipe a reader thread
        # holds, and the interpreter would wait for that child at exit for ever.
        async with contextlib.AsyncExitStack() as stack:
            engine = await create_engine(engine_config(settings, model_dir), settings.engine.devices)
            stack.push_async_callback(engine.close)
            voices = create_voice_store(settings.voice_store, data_dir, engine, settings.voices)
            await voices.open()
            stack.push_async_callback(voices.close)
            if Path(settings.assets_dir).is_dir():
                await voices.register_assets(Path(settings.assets_dir))
            if voices.get(settings.default_voice) is None:
                # Relative paths (the assets dir) resolve against the working directory: a
                # server started elsewhere than the checkout has none of its voices.
                log.warning("the default voice %r is not registered (assets dir %s: %s): requests that name "
                            "no voice will get 404 voice_not_found", settings.default_voice,
                            Path(settings.assets_dir).resolve(),
                            "found" if Path(settings.assets_dir).is_dir() else "not found")
            encode_pool = EncodePool(settings.audio.encode_threads)
            stack.callback(encode_pool.close)
            metrics = Metrics()
            app.state.gw = GatewayState(settings, engine, voices, metrics, Auth(settings.api_keys), encode_pool)
            lag = LoopLagMonitor(metrics.observe_loop_lag, add_cpu=metrics.add_loop_cpu)
            lag.start()
            stack.push_async_callback(lag.stop)
            frozen = metrics.frozen_objects = freeze_startup_objects()
            stack.callback(_unfreeze, metrics)
            metrics.gc_pauses.start()
            stack.callback(metrics.gc_pauses.stop)
            log.info("ready: model=%s backend=%s device=%s (%d start-up objects exempt from garbage collection)",
                     engine.model_name, engine.backend.name, engine.device, frozen)
            yield

    routes = [
        *http_api.routes,
        WebSocketRoute("/v1/tts/stream", ws.tts_websocket),
        *http_api.method_fallbacks(http_api.routes),
    ]
    if STATIC_DIR.is_dir():
        routes.append(Mount("/", StaticFiles(directory=STATIC_DIR, html=True), name="static"))
    else:
        log.warning("no demo page: %s not found (an install without the source tree)", STATIC_DIR)
    middleware = []
    if settings.cors_origins:
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(settings.cors_origins),
                allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
                allow_headers=["Authorization", "Content-Type"],
            )
        )
    return Starlette(
        routes=routes,
        middleware=middleware,
        lifespan=lifespan,
        exception_handlers=errors.exception_handlers,
    )
