"""All configuration in one typed place.

Precedence, lowest first: the defaults below <- a YAML file (`--config`, default
`config/default.yaml` when present) <- environment variables `COSYVOICE_GW_*` <- CLI flags.
Nested sections map to prefixed names: `ws.max_contexts` is `ws: {max_contexts: ..}`
in YAML, `COSYVOICE_GW_WS__MAX_CONTEXTS` in the environment and `--ws.max-contexts`
on the command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import typing
from dataclasses import dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any, Mapping

import yaml

from engine.config_values import convert_value
from gateway.audio import EncoderOptions
from gateway.protocol import WsLimits
from gateway.voice_pg import is_postgres_url, redact_url
from gateway.voices import VoiceLimits

ENV_PREFIX = "COSYVOICE_GW_"
DEFAULT_MODEL = "FunAudioLLM/Fun-CosyVoice3-0.5B-2512"
LM_BACKENDS = ("auto", "torch", "vllm")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
# An index as torch reads it: `cuda:01` matched `\d+` here and failed only once the model
# had loaded.
_DEVICE = re.compile(r"auto|cpu|cuda(:(0|[1-9]\d*))?")


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True)
class EngineSettings:
    device: str = field(default="auto", metadata=_help("torch device: auto, cpu, cuda, cuda:N (vLLM LM backend: "
                                                       "the first visible GPU; pick it with CUDA_VISIBLE_DEVICES)"))
    lm_backend: str = field(default="auto", metadata=_help("LM backend: auto (vllm on GPU when installed), torch, vllm"))
    initial_hop: int = field(default=10, metadata=_help("speech tokens in the first audio chunk (0 = official 25-token grid)"))
    idle_initial_hop: int = field(
        default=6, metadata=_help("speech tokens in the first chunk when no other utterance is on the engine "
                                  "(0 or >= initial_hop: initial_hop; needs the planner, initial_hop_max)"))
    initial_hop_max: int = field(
        default=40,
        metadata=_help("the first chunk takes up to this many speech tokens when the measured load (LM rate, "
                       "flow/vocoder round times) predicts that a shorter one would run out before a later "
                       "chunk arrives (<= initial_hop: fixed; fixed chunks give reproducible seeded audio)"),
    )
    first_chunk_min_hop: int = field(
        default=8, metadata=_help("the planner may take fewer first-chunk tokens than initial_hop, down to this "
                                  "many, where that leaves at least as much time to spare (0 = never)"))
    first_chunk_min_hop_crowd: int = field(
        default=4, metadata=_help("first-chunk-min-hop applies only while fewer than this many other utterances' "
                                  "listeners wait for a first chunk (a burst's first chunks share one opening round)"))
    first_chunk_margin: float = field(
        default=0.5, metadata=_help("spare fraction on the planned first chunk's predicted arrival times "
                                     "(see initial_hop_max)"))
    first_chunk_opening_rate: str = field(
        default="slower", metadata=_help("the LM rate a session's first utterance is sized on: slower (of its own "
                                          "and the one learnt for as many decoding) or learnt (that one alone, "
                                          "where there is one)"))
    first_chunk_second_rounds: bool = field(
        default=True, metadata=_help("plan a later chunk's flow/vocoder round no shorter than second chunks took "
                                     "lately with as many utterances on the stage (false: the round estimate "
                                     "alone)"))
    first_chunk_skip_patient: bool = field(
        default=False, metadata=_help("the round estimate that sizes first chunks leaves out the utterances "
                                      "waiting patiently (their latest chunk cut big, its audio not due within "
                                      "chunk_patience_s)"))
    first_chunk_due_rounds: bool = field(
        default=True, metadata=_help("the round estimate that sizes first chunks counts the utterances waiting "
                                     "patiently in a round's width but not in how many rounds the crowd fills "
                                     "(false: the whole crowd in both)"))
    first_chunk_hold_refresh: bool = field(
        default=False, metadata=_help("a planned first chunk is announced to the stage's hold once more halfway "
                                      "to its tokens, from the LM's rate then"))
    first_chunk_deadline_holdback: bool = field(
        default=True, metadata=_help("a chunk's deadline and patience count its utterance's first chunk's audio "
                                     "less what the vocoder keeps back of it (false: its tokens' worth)"))
    first_chunk_learnt_rounds_crowd: int = field(
        default=0, metadata=_help("while fewer than this many other utterances' listeners wait for a first chunk, "
                                  "plan no flow/vocoder round longer than the longest second chunks took lately "
                                  "with as many utterances on the stage, not the burst's round estimate (0 = off)"))
    first_chunk_hold_ms: float = field(
        default=25.0, metadata=_help("a flow/vocoder round about to start first chunks waits up to this long for "
                                     "other first chunks expected within it (0 = no wait)"))
    first_chunk_burst_hold_ms: float = field(
        default=0.0, metadata=_help("the hold is this long, for urgent first chunks (listeners waiting), while a "
                                    "burst is under way: at least first_chunk_burst_rows of them queued or "
                                    "expected within it (0 = off)"))
    first_chunk_burst_rows: int = field(
        default=8, metadata=_help("urgent first chunks queued or expected within first_chunk_burst_hold_ms that "
                                  "make a burst"))
    first_chunk_hold_share: float = field(
        default=0.0, metadata=_help("the hold grows to this share (0..0.5) of the round an expected first chunk "
                                     "would miss, as predicted for it (0 = first_chunk_hold_ms alone)"))
    max_hop: int = field(default=150, metadata=_help("largest chunk in speech tokens (25 tokens = 1 s)"))
    chunk_patience_s: float = field(
        default=1.0,
        metadata=_help("a chunk whose audio is due more than this many seconds from now waits and is cut as large "
                       "as allowed (max_hop, or the utterance's rest): fewer flow calls for later segments "
                       "(0 = off)"),
    )
    max_unread_audio_s: float = field(
        default=30.0,
        metadata=_help("a session's later utterances make no more audio while this many seconds of its audio wait "
                       "unread (a WebSocket whose queue is full, a slow HTTP reader); the utterance being "
                       "delivered goes on (0 = no limit)"),
    )
    flow_left_context: int = field(default=50, metadata=_help("earlier speech tokens the flow re-reads per chunk (-1 = all)"))
    flow_final_full_attention: bool = field(
        default=False,
        metadata=_help("decode an utterance's last chunk with full attention, as the official streaming inference "
                       "does (eagerly, without the prompt cache; with flow_left_context -1 and initial_hop 0 the "
                       "audio matches the official streaming output)"),
    )
    max_gpu_batch: int = field(default=64, metadata=_help("chunks per flow/vocoder batch"))
    flow_dtype: str = field(
        default="auto",
        metadata=_help("flow precision: auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16 or float16"),
    )
    flow_compile: bool = field(
        default=True,
        metadata=_help("torch.compile the CosyVoice3 flow's DiT blocks (fused elementwise kernels; compiles at "
                       "start; CUDA only)"),
    )
    flow_attention: str = field(
        default="triton",
        metadata=_help("the CosyVoice3 DiT's attention kernel: triton (cudnn, but a batch split at its prompt "
                       "attends in one Triton kernel: 3.5-5% less stage time a round of 5-8 chunks on H100s; "
                       "cudnn where it cannot run), cudnn (cuDNN's fused attention on CUDA) or sdpa (PyTorch's "
                       "pick; the memory-efficient kernel for batches split at their prompt, 11-12% slower "
                       "there on the stage alone)"),
    )
    flow_attention_rotary: bool = field(
        default=True,
        metadata=_help("with --engine.flow-attention triton, the split kernel takes head 0 (the one the rotary "
                       "embedding turns) rotated apart and the other heads from the projection, sparing a "
                       "rotated copy of q and k: 5.6-6.8% less stage time a round on an H100"),
    )
    flow_conv_kernel: str = field(
        default="triton",
        metadata=_help("the CosyVoice3 DiT's position convolutions: triton (one Triton kernel, Mish fused; CUDA "
                       "with Triton, elsewhere as torch) or torch (cuDNN for large batches)"),
    )
    vocoder_snake_kernel: str = field(
        default="triton",
        metadata=_help("the vocoder's Snake activations: triton (one fused Triton pass each; CUDA with Triton, "
                       "elsewhere as torch) or torch (eager elementwise operators)"),
    )
    vocoder_channels_last: bool = field(
        default=True,
        metadata=_help("the CosyVoice3 vocoder's decode with its activations and convolutions channels-last "
                       "(frame-major), sparing cuDNN's layout conversions around each convolution: "
                       "5.9-6.4% less stage time a round on an H100"),
    )
    flow_split_prefix_rows: int | None = field(
        default=None,
        metadata=_help("one-voice flow batches of at least this many chunks attend to the voice's cached prompt "
                       "once for all chunks and to each chunk's own frames apart, merged by log-sum-exp, instead "
                       "of over per-chunk copies of the prompt (0 = never; default: 1 with the split attention "
                       "kernel, --engine.flow-attention triton, 8 with cudnn or sdpa and on the CPU)"),
    )
    flow_cuda_graphs: bool = field(default=True, metadata=_help("run the CosyVoice3 flow's ODE solve as CUDA graphs (CUDA only)"))
    flow_graph_max_rows: int = field(
        default=64,
        metadata=_help("flow batches with more chunks than this run eagerly at their exact size instead of "
                       "padded to a CUDA graph bucket (64 = the largest bucket; above 16 chunks a batch takes "
                       "its bucket only when it fills half of it; batches from the prompt cache use graphs up "
                       "to 8 chunks, or --engine.flow-graph-shared-rows)"),
    )
    flow_graph_rows: tuple[int, ...] = field(
        default=(1, 2, 3, 4, 5, 6, 8, 12, 16, 32, 64),
        metadata=_help("row buckets of the flow's CUDA graphs, increasing: a batch is padded to the smallest that "
                       "holds it, and each is captured for every voice prompt width"),
    )
    flow_graph_frames: tuple[int, ...] = field(
        default=(),
        metadata=_help("frame sizes that get flow CUDA graphs besides every multiple of 50, increasing (e.g. "
                       "60,70,80: first chunks of 20-34 tokens then pad to those instead of 100 frames; each is "
                       "captured at every row bucket)"),
    )
    flow_graph_shared_rows: int = field(
        default=64,
        metadata=_help("a batch from the prompt cache whose chunks all have one voice takes a CUDA graph when its "
                       "row bucket (1, 2, 3, ..., 64) is at most this (the voice's prefix is held once); otherwise "
                       "the per-row prefix graphs (up to 8 chunks) or eager"),
    )
    flow_graph_limit: int = field(
        default=600,
        metadata=_help("at most this many flow CUDA graphs kept per stage (least recently used dropped; a batch "
                       "whose graph was dropped captures it again while serving): each voice prompt width (100, "
                       "200, 300 frames) warms up to 187 of its own at the default row buckets and max_hop, ~13 MiB "
                       "of GPU memory each on the H200"),
    )
    vocoder_cuda_graphs: bool = field(
        default=True,
        metadata=_help("run the CosyVoice3 vocoder's decode as CUDA graphs up to 8 streams (CUDA only)"),
    )
    vocoder_graph_rows: tuple[int, ...] = field(
        default=(1, 2, 4, 8),
        metadata=_help("row (stream) buckets of the vocoder's CUDA graphs, increasing: a batch is padded to the "
                       "smallest that holds it, larger batches decode eagerly"),
    )
    flow_prompt_cache: bool = field(
        default=True,
        metadata=_help("cache each voice prompt's flow DiT keys/values so flow batches skip the prompt's frames "
                       "(exact; CosyVoice3)"),
    )
    flow_split_batches: bool = field(
        default=True,
        metadata=_help("run a flow batch whose chunks differ much in length as up to three calls of similar "
                       "lengths (less padding under staggered arrivals: on the H200, 64 sessions arriving over "
                       "16 s got first audio p95 396 ms against 857 without it)"),
    )
    flow_split_call_cost: int = field(
        default=730,
        metadata=_help("with split flow batches, what one more call costs in row-frames of ODE work (lower: more "
                       "splits, less padding; 730 was fitted on the H200 before round 39's kernels)"),
    )
    flow_split_padded: bool = field(
        default=True,
        metadata=_help("with flow CUDA graphs, split a batch by the padded shapes its graphs run (row and frame "
                       "buckets) rather than its exact ones (on the H200, 80 sessions arriving over 16 s got "
                       "first audio p95 403 ms against 875)"),
    )
    flow_fill_padding: bool = field(
        default=False,
        metadata=_help("let a queued chunk shorter than the longest in its flow batch take more of its "
                       "utterance's generated tokens, up to the length the batch pads it to anyway (more audio "
                       "for the same flow work; not measured on a GPU yet)"),
    )
    flow_prompt_cache_mib: int = field(
        default=4096,
        metadata=_help("memory budget of the flow prompt cache per flow/vocoder stage in MiB (least recently used "
                       "voices are evicted; ~1.8 MB per cached prompt frame at full size in bf16)"),
    )
    flow_context_cache_mib: int = field(
        default=0,
        metadata=_help("memory of the flow context cache per flow/vocoder stage in MiB, 0 = off: each utterance "
                       "keeps its last 2 x flow_left_context frames as DiT keys/values (~180 MB at full size), so "
                       "its next chunk computes only its new frames (a sliding window, changes the audio "
                       "slightly; CosyVoice3)"),
    )
    flow_context_min_rows: int = field(
        default=16,
        metadata=_help("with CUDA graphs, the fewest chunks of a flow batch mixing voices that uses the context "
                       "cache (smaller ones replay a per-row graph, which has none, and end their utterances' "
                       "use of it)"),
    )
    stage_policy: str = field(
        default="first_chunks",
        metadata=_help("how the flow/vocoder stage picks a batch: first_chunks (first chunks heard after silence first, then FIFO) or "
                       "deadline (most urgent playback deadline first, grouped by similar window length)"),
    )
    stage_window_tolerance: float = field(
        default=0.25,
        metadata=_help("deadline policy: a batch's longest flow window is at most (1 + this) x its shortest; a large "
                       "value (e.g. 1000) batches by deadline alone"),
    )
    stage_deadline_cut: bool = field(
        default=True,
        metadata=_help("a flow/vocoder round that would end after a row's playback deadline runs the rows due "
                       "sooner first in a smaller round, when that leaves fewer rows late"),
    )
    stage_deadline_cut_margin_ms: float = field(
        default=250.0,
        metadata=_help("the deadline cut counts a row late when its round would end less than this before its "
                       "audio runs out at the client (0..1000)"),
    )
    stage_deadline_cut_rescue: bool = field(
        default=False,
        metadata=_help("the deadline cut judges a row already past its deadline (less the cut's margin) by when "
                       "its audio runs out instead of giving it up (not a first chunk; off: no difference measured)"),
    )
    stage_pipeline_lead_ms: float = field(
        default=5.0,
        metadata=_help("take the next flow/vocoder round and queue its kernels up to this many ms before the "
                       "running round is predicted to end, its audio then copied to the host asynchronously "
                       "(0..1000; 0: off, once the previous round's audio is back)"),
    )
    stage_first_chunk_cut: bool = field(
        default=True,
        metadata=_help("a flow/vocoder round carrying first chunks that listeners wait for runs them first, with the "
                       "rows that would be late after them (by stage_deadline_cut_margin_ms), and the rest in the "
                       "next round, when the first chunks gain more than the stage loses"),
    )
    stage_second_chunk_cut: bool = field(
        default=False,
        metadata=_help("with stage_first_chunk_cut, an utterance's second chunk (unless cut big and patient) "
                       "runs with the first chunks"),
    )
    stage_profile_dir: str = field(
        default="",
        metadata=_help("write a torch.profiler summary of the flow/vocoder stage's batches to this directory, "
                       "one subdirectory per stage (stageN), under one per engine with engine.devices (workerN) "
                       "(empty = off)"),
    )
    stage_profile_start: int = field(
        default=20, metadata=_help("first stage batch profiled, counted from the first after the engine's start "
                                   "(its warm-up excluded)"))
    stage_profile_batches: int = field(default=20, metadata=_help("stage batches profiled"))
    stage_profile_min_chunks: int = field(
        default=0, metadata=_help("the profiled window opens at the first batch with at least this many chunks"))
    stage_devices: tuple[str, ...] = field(
        default=(),
        metadata=_help("flow+vocoder stage copies, one per device, e.g. cuda:0,cuda:1; the LM stays on "
                       "engine.device (empty = one stage on engine.device)"),
    )
    stage_process: bool | None = field(
        default=None,
        metadata=_help("run the flow+vocoder stage in a process of its own, so that its operator calls do not "
                       "wait for the interpreter lock behind the event loop; one per stage device (default: on "
                       "with a CUDA device)"),
    )
    stage_stall_timeout_s: float = field(
        default=120.0,
        metadata=_help("kill a flow+vocoder stage process that has said nothing, or run one piece of device work, "
                       "for this many seconds (a GPU hang): its utterances end with an error instead of waiting "
                       "for ever (0 = no watchdog)"),
    )
    lm_stall_timeout_s: float = field(
        default=120.0,
        metadata=_help("report the engine failed (the gateway drains and exits for a restart) when LM requests "
                       "have waited this many seconds without any of them getting a token: vLLM's engine core "
                       "alive but stuck (0 = no watch)"),
    )
    stage_mps_thread_percent: int | None = field(
        default=None,
        metadata=_help("the flow+vocoder stage's process(es) under an NVIDIA MPS daemon: percent of the GPU's SMs "
                       "they may use, the rest left to vLLM's decode (default: no limit; without a daemon it does "
                       "nothing)"),
    )
    stage_mps_priority: str | None = field(
        default=None,
        metadata=_help("the flow+vocoder stage's process(es) under an NVIDIA MPS daemon: their priority as MPS "
                       "clients, normal or below_normal (vLLM's decode kernels then go first; default: below_normal "
                       "with the stage in a process of its own, unless vllm_mps_priority is below_normal)"),
    )
    lm_max_batch: int = field(default=256, metadata=_help("LM sequences decoded together (torch: per step; "
                                                          "vLLM: max_num_seqs); more utterances wait"))
    text_normalization: bool = field(default=True, metadata=_help("normalise numbers etc. with wetext before the LM"))
    warmup: bool = field(default=True, metadata=_help("run one synthesis at start before /ready turns true"))
    overlap_start: bool = field(
        default=False,
        metadata=_help("start the LM (vLLM's engine core) while the audio stage is built and the flow warmed, "
                       "instead of one after the other (not yet measured on a GPU)"),
    )
    warmup_concurrency: int | None = field(
        default=None,
        metadata=_help("warm-up then also runs this many sentence-long syntheses at once (at most max_gpu_batch): "
                       "the first-chunk planner then knows a full batch's round times before the first load "
                       "and, first, one of them alone twice, for one-row round times "
                       "(0 = none of these; default: max_gpu_batch on a GPU, 4 on the CPU)"),
    )
    vllm_gpu_memory_utilization: float = field(default=0.35, metadata=_help("vLLM: fraction of GPU memory for weights + KV cache"))
    vllm_max_model_len: int = field(
        default=4096,
        metadata=_help("longest LM prompt + speech in tokens (vLLM's context window; the torch backend is held "
                       "to it too): a segment whose speech cannot fit is refused (text_too_long)"),
    )
    vllm_async_scheduling: bool = field(
        default=False,
        metadata=_help("vLLM: schedule one step ahead (faster decode; text_mode 'stream' contexts are then refused)"),
    )
    vllm_mps_thread_percent: int | None = field(
        default=None,
        metadata=_help("vLLM under an NVIDIA MPS daemon: percent of the GPU's SMs its engine core may use, the rest "
                       "left to the flow/vocoder stage (default: no limit; without a daemon it does nothing)"),
    )
    vllm_mps_priority: str | None = field(
        default=None,
        metadata=_help("vLLM under an NVIDIA MPS daemon: its engine core's priority as an MPS client, normal or "
                       "below_normal (the flow/vocoder stage's kernels then go first; default: normal)"),
    )
    vllm_compile_sampling: bool = field(
        default=False,
        metadata=_help("vLLM: run the RAS sampler compiled in its engine core (fewer operators a decode step; "
                       "compiles at start)"),
    )
    vllm_cudagraph_mode: str = field(
        default="full",
        metadata=_help("vLLM's CUDA graph mode: full (one graph for prefills and mixed batches too: a lone "
                       "session's first token ~2.4 ms sooner on the H200), full_and_piecewise (vLLM's own default), "
                       "piecewise, full_decode_only or none"),
    )
    lm_timing: bool = field(
        default=False,
        metadata=_help("keep vLLM's own timings of its requests (queued, prefill, decode, time to first token) as "
                       "cosyvoice_engine_lm_server_* metrics; costs vLLM's per-step statistics in this process"),
    )
    devices: tuple[str, ...] = field(
        default=(),
        metadata=_help("one engine per device, sessions on the least-loaded, e.g. cuda:0,cuda:1 "
                       "(torch LM backend; not with engine.stage_devices; empty = one engine on engine.device)"),
    )
    tokens_per_text_token: float | None = field(
        default=None,
        metadata=_help("fix speech length: speech tokens per text token (benchmarks; random models default to 3)"),
    )

    def __post_init__(self) -> None:
        # Checked here, before a download and a model load: found later, the same mistakes
        # cost the whole start and exit as an engine failure would.
        if self.lm_backend not in LM_BACKENDS:
            raise ValueError(f"engine.lm_backend must be one of {', '.join(LM_BACKENDS)}, not {self.lm_backend!r}")
        for name, devices in (("engine.device", (self.device,)), ("engine.devices", self.devices),
                              ("engine.stage_devices", self.stage_devices)):
            for device in devices:
                if not _DEVICE.fullmatch(device) or (name != "engine.device" and device == "auto"):
                    raise ValueError(f"{name}: {device!r} is not a device (auto, cpu, cuda, cuda:N)")
        if len(self.devices) > 1 and self.stage_devices:
            # Each engine would build a stage copy on every stage device: N flows and vocoders
            # per GPU, none of them meant.
            raise ValueError("engine.devices (one engine per device) does not combine with engine.stage_devices "
                             "(every engine would put a stage copy on every stage device): use one or the other")
        if not 0 < self.vllm_gpu_memory_utilization <= 1:
            raise ValueError("engine.vllm_gpu_memory_utilization must be within (0, 1], "
                             f"not {self.vllm_gpu_memory_utilization}")
        if self.tokens_per_text_token is not None and not 0 < self.tokens_per_text_token <= 50:
            raise ValueError(f"engine.tokens_per_text_token must be within (0, 50], not {self.tokens_per_text_token}")


@dataclass(frozen=True)
class Settings:
    host: str = field(default="127.0.0.1", metadata=_help("address to listen on (0.0.0.0 in containers)"))
    port: int = field(default=8080, metadata=_help("TCP port"))
    model: str = field(
        default=DEFAULT_MODEL,
        metadata=_help("model directory, hub repo id (downloaded into the data dir), or a random-weight model: tiny-random, full-random, tiny-random-cv2, full-random-cv2"),
    )
    data_dir: Path = field(default=Path("data"), metadata=_help("voices database, voice files and model cache live here"))
    voice_store: str = field(
        default="sqlite",
        metadata=_help("where voices live: 'sqlite' (in the data dir) or a postgresql://user@host:port/db URL "
                       "shared by all replicas (password via PGPASSWORD)"),
    )
    assets_dir: Path = field(default=Path("assets"), metadata=_help("voices registered at start: <id>.wav + <id>.txt"))
    default_voice: str = field(default="default", metadata=_help("voice used when a request names none"))
    api_keys: tuple[str, ...] = field(default=(), metadata=_help("comma-separated API keys; empty = no auth"))
    cors_origins: tuple[str, ...] = field(default=(), metadata=_help("comma-separated allowed CORS origins; empty = closed"))
    openai_model_aliases: tuple[str, ...] = field(
        default=("tts-1", "tts-1-hd", "gpt-4o-mini-tts", "cosyvoice3"),
        metadata=_help("model names /v1/audio/speech accepts"),
    )
    max_input_chars: int = field(default=4096, metadata=_help("longest /v1/audio/speech input"))
    max_sessions: int = field(default=512, metadata=_help("concurrent WebSocket connections + HTTP syntheses"))
    speech_send_timeout_s: float = field(
        default=60.0,
        metadata=_help("/v1/audio/speech: break a streamed response whose client took none of its bytes for this "
                       "long (it stopped reading), ending its synthesis and freeing its session; 0 = never"),
    )
    max_connections: int = field(
        default=4096,
        metadata=_help("open TCP connections (WebSockets, keep-alive HTTP, sockets that never sent a byte) beyond "
                       "which uvicorn answers every request, /health included, with a plain-text 503; at least "
                       "max_sessions + 64 (the app refuses sessions past max_sessions with its own JSON errors)"),
    )
    shutdown_timeout: float = field(default=30.0, metadata=_help("seconds SIGTERM waits for running sessions"))
    exit_on_engine_failure: bool = field(
        default=True,
        metadata=_help("when the engine can serve no more (its stage process died or stalled, vLLM's engine core "
                       "died), end its sessions with errors, drain the rest (up to shutdown_timeout) and exit with "
                       "status 3, so a supervisor (a restart policy, systemd, Kubernetes) starts a fresh gateway; "
                       "off: stay up with /ready and /health answering 503"),
    )
    debug_tuning: bool = field(
        default=False, metadata=_help("let POST /debug/planner set first-chunk planner knobs and the stage's "
                                      "fill_padding, split_call_cost, first_cut, second_cut, rescue, pipeline_lead_ms, hold_ms, burst_hold_ms and burst_rows while serving (benchmarks: "
                                      "A/B levels on one gateway)"))
    log_level: str = field(default="info", metadata=_help("debug, info, warning, error"))
    log_json: bool = field(default=False, metadata=_help("one JSON object per log line"))
    gil_switch_interval_ms: float = field(
        default=5.0,
        metadata=_help("how long a Python thread may hold the interpreter while another waits for it "
                       "(sys.setswitchinterval; Python's default 5 ms): the event loop shares it with the "
                       "audio stage's thread, which dispatches the flow's kernels"),
    )
    engine: EngineSettings = field(default_factory=EngineSettings)
    ws: WsLimits = field(default_factory=WsLimits)
    audio: EncoderOptions = field(default_factory=EncoderOptions)
    voices: VoiceLimits = field(default_factory=VoiceLimits)

    def __post_init__(self) -> None:
        # CPython turns values below a microsecond, and huge ones (inf, 1e30), into 0 (switch
        # as often as it can): keep to a sane range, and refuse NaN, rather than get the
        # opposite of the ask.
        if not 0.01 <= self.gil_switch_interval_ms <= 1000:
            raise ValueError("gil_switch_interval_ms must be within [0.01, 1000]")
        for name in ("max_sessions", "max_input_chars", "max_connections"):
            if not getattr(self, name) >= 1:
                raise ValueError(f"{name} must be >= 1, not {getattr(self, name)}")
        if not self.shutdown_timeout >= 0:
            raise ValueError(f"shutdown_timeout must be >= 0, not {self.shutdown_timeout}")
        if not self.speech_send_timeout_s >= 0:
            raise ValueError(f"speech_send_timeout_s must be >= 0, not {self.speech_send_timeout_s}")
        if not 0 <= self.port <= 65535:  # 0: any free port
            raise ValueError(f"port must be within [0, 65535], not {self.port}")
        if self.log_level.lower() not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, not {self.log_level!r}")
        if self.voice_store != "sqlite" and not is_postgres_url(self.voice_store):
            raise ValueError(f"voice_store must be 'sqlite' or a postgresql:// URL, not {redact_url(self.voice_store)!r}")


# ---------------------------------------------------------------- loading
def _leaves(cls: type, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], dataclasses.Field]]:
    out = []
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        t = hints[f.name]
        if is_dataclass(t):
            out += _leaves(t, prefix + (f.name,))
        else:
            out.append((prefix + (f.name,), f))
    return out


def _field_type(root: type, path: tuple[str, ...]) -> Any:
    cls = root
    for name in path[:-1]:
        cls = typing.get_type_hints(cls)[name]
    return typing.get_type_hints(cls)[path[-1]]


def _set_all(settings: Any, values: Mapping[tuple[str, ...], Any]) -> Any:
    """`settings` with every `path: value` of one layer set, each section replaced once:
    options checked against each other (voices.min_seconds and max_seconds) are checked
    with the layer's values together, not each against the other's value from below."""
    changes: dict[str, Any] = {}
    nested: dict[str, dict[tuple[str, ...], Any]] = {}
    for path, value in values.items():
        if len(path) == 1:
            changes[path[0]] = value
        else:
            nested.setdefault(path[0], {})[path[1:]] = value
    for name, below in nested.items():
        changes[name] = _set_all(getattr(settings, name), below)
    return replace(settings, **changes) if changes else settings


def _flag(path: tuple[str, ...]) -> str:
    return "--" + ".".join(p.replace("_", "-") for p in path)


def _env(path: tuple[str, ...]) -> str:
    return ENV_PREFIX + "__".join(p.upper() for p in path)


def apply_mapping(settings: Settings, data: Mapping[str, Any], where: str) -> Settings:
    def walk(obj: Any, d: Mapping[str, Any], prefix: tuple[str, ...]) -> Any:
        known = {f.name for f in fields(obj)}
        changes: dict[str, Any] = {}
        for key, value in d.items():
            if key not in known:
                raise ValueError(f"{where}: unknown option '{'.'.join(prefix + (key,))}'")
            cur = getattr(obj, key)
            if is_dataclass(cur):
                if not isinstance(value, Mapping):
                    raise ValueError(f"{where}: '{key}' must be a mapping")
                changes[key] = walk(cur, value, prefix + (key,))
            else:
                t = _field_type(type(obj), (key,))
                changes[key] = convert_value(value, t, ".".join(prefix + (key,)))
        # One replace per section: its options are checked together (see `_set_all`).
        return replace(obj, **changes) if changes else obj

    return walk(settings, data, ())


# Kubernetes gives every pod variables for each Service of its namespace: a Service
# named `cosyvoice-gw` yields COSYVOICE_GW_SERVICE_HOST, COSYVOICE_GW_SERVICE_PORT...,
# COSYVOICE_GW_PORT=tcp://10.0.0.1:8080 and COSYVOICE_GW_PORT_8080_TCP...: not settings.
# So does any Service named `cosyvoice-gw-<more>` (COSYVOICE_GW_METRICS_SERVICE_HOST, ...).
# A Service's name has no `__` (a section's separator here).
_SERVICE_NAME = r"(?:[A-Z0-9]+(?:_[A-Z0-9]+)*_)?"
_SERVICE_LINK = re.compile(ENV_PREFIX + _SERVICE_NAME + r"(SERVICE_(HOST|PORT)\w*|PORT_\d+_(TCP|UDP|SCTP)\w*)")
_SERVICE_PORT = re.compile(ENV_PREFIX + _SERVICE_NAME + "PORT")


def _service_link(key: str, value: str) -> bool:
    return bool(_SERVICE_LINK.fullmatch(key)) or (bool(_SERVICE_PORT.fullmatch(key)) and "://" in value)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cosyvoice-gateway",
        description="Real-time streaming TTS gateway for CosyVoice. Every option can also be set in the YAML "
        "file (--config) or as an environment variable (shown in brackets).",
    )
    p.add_argument("--config", type=Path, default=None, help="YAML settings file (default: config/default.yaml if present)")
    p.add_argument("--print-config", action="store_true", help="print the effective settings as YAML (API keys and database passwords masked) and exit")
    defaults = Settings()
    for path, f in _leaves(Settings):
        cur: Any = defaults
        for name in path:
            cur = getattr(cur, name)
        shown = ",".join(map(str, cur)) if isinstance(cur, tuple) else cur
        text = f.metadata.get("help", ".".join(path).replace("_", " "))
        # argparse formats help with `%`: a literal one ("11-12% slower") must be doubled.
        p.add_argument(_flag(path), dest="opt:" + ".".join(path), default=None, metavar="V",
                       help=f"{text} (default: {shown}) [{_env(path)}]".replace("%", "%%"))
    return p


def load_settings(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> tuple[Settings, argparse.Namespace]:
    environ = os.environ if environ is None else environ
    args = build_parser().parse_args(argv)
    settings = Settings()
    cfg_path = args.config
    if cfg_path is None and Path("config/default.yaml").is_file():
        cfg_path = Path("config/default.yaml")
    if cfg_path is not None:
        try:
            data = yaml.safe_load(Path(cfg_path).read_text(encoding="utf-8")) or {}
        except OSError as exc:
            raise ValueError(f"{cfg_path}: cannot read: {exc.strerror or exc}") from None
        except (UnicodeDecodeError, yaml.YAMLError) as exc:
            # A YAML error spans lines (the offending line, a caret): one line is enough.
            raise ValueError(f"{cfg_path}: not valid YAML: {' '.join(str(exc).split())}") from None
        if not isinstance(data, Mapping):
            raise ValueError(f"{cfg_path}: top level must be a mapping")
        settings = apply_mapping(settings, data, str(cfg_path))
    leaves = _leaves(Settings)
    known_env = {_env(path) for path, _ in leaves}
    environ = {k: v for k, v in environ.items() if not _service_link(k, v)}
    for key in environ:
        if key.startswith(ENV_PREFIX) and key not in known_env:
            raise ValueError(f"unknown environment variable {key}")
    settings = _set_all(settings, {
        path: convert_value(environ[_env(path)], _field_type(Settings, path), _env(path))
        for path, _ in leaves if _env(path) in environ})
    flags = {path: getattr(args, "opt:" + ".".join(path)) for path, _ in leaves}
    settings = _set_all(settings, {path: convert_value(value, _field_type(Settings, path), _flag(path))
                                   for path, value in flags.items() if value is not None})
    return settings, args


def redacted(settings: Settings) -> Settings:
    """The settings with their secrets masked, to print or log: `--print-config` output
    lands in terminals, CI logs and issue reports."""
    return replace(settings, api_keys=tuple("***" for _ in settings.api_keys),
                   voice_store=redact_url(settings.voice_store))


def settings_to_dict(settings: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in fields(settings):
        v = getattr(settings, f.name)
        if is_dataclass(v):
            out[f.name] = settings_to_dict(v)
        elif isinstance(v, tuple):
            out[f.name] = list(v)
        elif isinstance(v, Path):
            out[f.name] = str(v)
        else:
            out[f.name] = v
    return out
