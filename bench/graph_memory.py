"""What the flow's CUDA graphs cost in GPU memory and capture time, voice by voice.

    python -m bench.graph_memory --voices 60,106,160 --json out.json

Builds the stage the engine builds (`engine.stage_pool.build_stage`, default `EngineConfig`
but for `--config`; `flow_graph_limit` raised so that nothing is evicted) on a full-size
random model, then warms, voice after voice, the graphs the engine warms when a voice of
that many prompt tokens is registered (`engine.stage_build.voice_graph_shapes`: 60, 106
and 160 tokens cache 100, 200 and 300 frames, the three prefix widths). After each voice:
the graphs held, how many were captured and in how long, and the memory the device lost
(`torch.cuda.mem_get_info`: the graphs' shared pool plus what the driver keeps per graph,
which PyTorch's allocator does not see; the static prompt-prefix buffers, allocated with the
first voice, are reported apart) against the growth of PyTorch's reserved memory.
That says what `flow_graph_limit` costs (600 by default since round 52, whose `max_hop` of 150
warms up to 187 graphs a width: all three widths'; 480 from round 48, 153 a width; 320 from
round 37; 192 before, two widths').
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.stage_syncs import add_stage_arguments, config_overrides, load_stage_model
from engine.config import EngineConfig
from engine.flow_prompt_cache import cacheable_frames, supports_prompt_cache
from engine.stage_build import graph_policy, voice_graph_shapes
from engine.stage_pool import build_stage
from engine.token2wav import AudioStage


def device_used(device: torch.device) -> int:
    """Bytes of the device in use by anyone (this process's allocator, driver, graphs)."""
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_stage_arguments(p, "flow_graph_shared_rows=16")  # its --prompt-tokens is unused: --voices
    p.add_argument("--voices", default="60,106,160", metavar="P,Q",
                   help="prompt tokens of each voice warmed, in order")
    p.add_argument("--limit", type=int, default=4096, help="flow_graph_limit for the run (no eviction)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    device, model_dir, model = load_stage_model(args)
    if device.type != "cuda":
        p.error("graphs are captured on CUDA only")
    overrides = config_overrides(args.config)
    if "flow_graph_limit" in overrides:
        p.error("set the graph limit with --limit")
    config = EngineConfig(model_dir=model_dir, device=args.device, flow_graph_limit=args.limit, **overrides)
    stage = build_stage(model, device, config)
    assert isinstance(stage, AudioStage)
    runner = stage.graph_runner()
    if runner is None:
        p.error("flow_cuda_graphs is off")
    flow, policy = model.flow, graph_policy(config)
    lookahead = model.config.flow.pre_lookahead_len
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(device), "config": overrides,
                              "limit": args.limit, "voices": []}
    base_used, base_reserved = device_used(device), torch.cuda.memory_reserved(device)
    report["before"] = {"device_used_mib": base_used / 2**20, "reserved_mib": base_reserved / 2**20}
    print(f"before: device used {base_used / 2**20:.0f} MiB, reserved {base_reserved / 2**20:.0f} MiB", flush=True)
    for tokens in (int(v) for v in args.voices.split(",")):
        cached = (cacheable_frames(tokens, flow.token_mel_ratio, lookahead, flow.decoder.estimator.static_chunk_size)
                  if config.flow_prompt_cache and supports_prompt_cache(flow) else 0)
        shapes = voice_graph_shapes(config, lookahead, tokens, cached)
        used0, reserved0, prefix0 = device_used(device), torch.cuda.memory_reserved(device), runner.prefix_bytes
        t0 = time.perf_counter()
        with torch.inference_mode():
            captured = runner.warm(shapes)
        seconds = time.perf_counter() - t0
        used1, reserved1, prefix1 = device_used(device), torch.cuda.memory_reserved(device), runner.prefix_bytes
        row = {"prompt_tokens": tokens, "cached_frames": cached, "prefix_width": policy.prefix_bucket(cached),
               "shapes": len(shapes), "captured": captured, "graphs": runner.num_graphs,
               "evicted": runner.stats.evictions, "seconds": seconds,
               "device_used_mib": (used1 - used0) / 2**20, "reserved_mib": (reserved1 - reserved0) / 2**20,
               "device_used_total_mib": (used1 - base_used) / 2**20,
               # The static prompt-prefix buffers the prefix graphs read (allocated once, at
               # the first voice with a cached prefix), apart from the graphs' own memory.
               "prefix_buffers_mib": (prefix1 - prefix0) / 2**20}
        per_graph = ((used1 - used0) - (prefix1 - prefix0)) / 2**20 / captured if captured else 0.0
        row["mib_per_graph"] = per_graph
        report["voices"].append(row)
        print(f"voice of {tokens} tokens (prefix width {row['prefix_width']}): {captured} graphs captured in "
              f"{seconds:.1f} s, {row['graphs']} held, {row['evicted']} evicted; device used +{row['device_used_mib']:.0f} MiB "
              f"(of which prefix buffers {row['prefix_buffers_mib']:.0f}; {per_graph:.2f} MiB a graph besides), PyTorch reserved +{row['reserved_mib']:.0f} MiB; "
              f"all graphs so far {row['device_used_total_mib']:.0f} MiB", flush=True)
        if args.json:
            args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
