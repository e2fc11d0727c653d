"""One flow+vocoder stage as a configuration asks for it, built in this process: for the
engine's own (`engine.stage_pool.build_stage`, one per device of `stage_devices`) or for
a stage process (`engine.stage_process`)."""

from __future__ import annotations

from pathlib import Path

import torch

from .chunking import GRID
from .config import EngineConfig
from .flow_graphs import GraphPolicy, prompt_shapes
from .models.loader import LoadedModel
from .models.config import ModelConfig
from .models.hift import CausalHiFTGenerator
from .stage_profile import StageProfiler
from .token2wav import AudioStage
from .vocoder_graphs import MAX_GRAPH_FRAMES, VocoderGraphPolicy, window_frames


def graph_policy(config: EngineConfig) -> GraphPolicy:
    """Which flow batch shapes get CUDA graphs."""
    return GraphPolicy(batch_buckets=config.flow_graph_rows, frame_buckets=config.flow_graph_frames,
                       shared_prefix_max_rows=config.flow_graph_shared_rows,
                       max_graphs=config.flow_graph_limit).with_max_rows(config.flow_graph_max_rows)


def voice_graph_shapes(config: EngineConfig, lookahead: int, prompt_tokens: int, cached: int) -> list[tuple[int, ...]]:
    """The flow batch shapes a voice of `prompt_tokens` speech tokens can produce, to warm
    its graphs at registration: (rows, frames), or (rows, frames, cached prefix frames)
    when `cached` (its prompt cache's frames, 0 = none) is served from the prefix graphs."""
    policy = graph_policy(config)
    # Every window a chunk can have: prompt + left context + (1 .. max_hop + lookahead) new
    # tokens (a final chunk takes whatever is left), at every row bucket the policy has
    # (with flow_graph_max_rows 10, say, 10 is one); the runner pads them into buckets.
    shapes: list[tuple[int, ...]] = list(prompt_shapes(
        prompt_tokens, hops=range(1, max(config.max_hop, config.initial_hop) + lookahead + 1),
        left_context=config.flow_left_context, rows=policy.batch_buckets))
    if cached and policy.prefix_bucket(cached) <= policy.prefix_max_frames:
        # From the prompt cache the ODE runs over the frames after the cached prefix.
        return [(rows, frames - cached, cached) for rows, frames in shapes]
    if cached:
        # A prefix too wide for the prefix graphs: small batches take the plain graphs
        # (AudioStage._cache_pays), larger ones run eagerly from the cache.
        return [(rows, frames) for rows, frames in shapes if rows <= policy.prefix_max_rows]
    return shapes


def vocoder_graph_frames(hift: torch.nn.Module, model: ModelConfig, config: EngineConfig) -> int:
    """The vocoder graphs' largest window: a bound on the widest chunk the engine cuts at its
    own settings, as mel frames, with the vocoder's context and held-back frames
    (`window_frames`); no fewer than `VocoderGraphPolicy`'s default of 256 and no more than
    `MAX_GRAPH_FRAMES`. The widest chunk is `max_hop` (or `initial_hop`) tokens and their
    lookahead, and a patient last chunk may take the room a chunk's left context has as well
    (`engine.chunking.patient_target`: at a segment's start, the left context and a block
    less one token). Not covered, so decoded eagerly past it: a request's own `max_hop`, and
    a speed below 1 (the mel is stretched, `AudioStage._stretch`)."""
    if not isinstance(hift, CausalHiFTGenerator):  # CosyVoice2's vocoder has no graphs
        return VocoderGraphPolicy.max_frames
    tokens = max(config.max_hop, config.initial_hop) + model.flow.pre_lookahead_len
    if config.flow_left_context >= 0:
        tokens += config.flow_left_context + GRID - 1
    frames = window_frames(hift, model.flow.token_mel_ratio * tokens)
    return min(MAX_GRAPH_FRAMES, max(VocoderGraphPolicy.max_frames, frames))


def audio_stage(model: LoadedModel, device: torch.device, config: EngineConfig, flow: torch.nn.Module | None = None,
                hift: torch.nn.Module | None = None, index: int = 0) -> AudioStage:
    """The stage on `device` over `flow` and `hift` (the model's own when None); `index`:
    its place among `stage_devices`, which names its profile's folder."""
    profiler = None
    if config.stage_profile_dir:
        profiler = StageProfiler(Path(config.stage_profile_dir) / f"stage{index}", config.stage_profile_start,
                                 config.stage_profile_batches, cuda=device.type == "cuda",
                                 min_chunks=config.stage_profile_min_chunks, origin=None)
    return AudioStage(model.flow if flow is None else flow, model.hift if hift is None else hift, device,
                      max_batch=config.max_gpu_batch, flow_dtype=config.resolved_flow_dtype(),
                      flow_compile=config.flow_compile, flow_cuda_graphs=config.flow_cuda_graphs,
                      graph_policy=graph_policy(config),
                      policy=config.stage_policy, window_tolerance=config.stage_window_tolerance,
                      prompt_cache_bytes=config.flow_prompt_cache_bytes if config.flow_prompt_cache else None,
                      profiler=profiler, split_batches=config.flow_split_batches,
                      split_padded=config.flow_split_padded, split_call_cost=config.flow_split_call_cost,
                      vocoder_cuda_graphs=config.vocoder_cuda_graphs, fill_padding=config.flow_fill_padding,
                      vocoder_graph_rows=config.vocoder_graph_rows,
                      vocoder_graph_frames=vocoder_graph_frames(model.hift if hift is None else hift, model.config, config),
                      context_cache_bytes=config.flow_context_cache_bytes,
                      context_frames=model.config.flow.token_mel_ratio * config.flow_left_context,
                      context_min_rows=config.flow_context_min_rows, flow_attention=config.flow_attention,
                      flow_attention_rotary=config.flow_attention_rotary,
                      flow_conv_kernel=config.flow_conv_kernel,
                      vocoder_snake_kernel=config.vocoder_snake_kernel,
                      vocoder_channels_last=config.vocoder_channels_last,
                      flow_split_prefix_rows=config.flow_split_prefix_rows,
                      first_chunk_hold_s=config.first_chunk_hold_ms / 1000,
                      first_chunk_hold_share=config.first_chunk_hold_share,
                      first_chunk_burst_hold_s=config.first_chunk_burst_hold_ms / 1000,
                      first_chunk_burst_rows=config.first_chunk_burst_rows,
                      cut_for_deadlines=config.stage_deadline_cut,
                      cut_shift_s=config.cut_shift_s(), rescue=config.stage_deadline_cut_rescue,
                      pipeline_lead_ms=config.stage_pipeline_lead_ms,
                      first_cut=config.stage_first_chunk_cut,
                      second_cut=config.stage_second_chunk_cut,
                      final_full_attention=config.flow_final_full_attention)
