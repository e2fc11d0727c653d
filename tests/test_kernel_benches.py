"""The kernel benches run on the CPU and say what they measured (their GPU timings are in
docs/benchmarks.md, rounds 38, 39 and 43)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench import gemm_shapes, position_conv, priority_lanes, split_attention_check, vocoder_cost
from engine.models.config import FlowConfig


def test_position_conv_checks_every_way_against_float32(tmp_path: Path) -> None:
    out = tmp_path / "conv.json"
    assert position_conv.main(["--device", "cpu", "--dtype", "float32", "--rows", "2", "--frames", "40",
                               "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    ways = {r["way"] for r in results}
    assert {"cudnn, channels first", "cudnn, frame-major", "taps"} <= ways
    for r in results:
        assert (r["rows"], r["frames"]) == (2, 40)
        assert r["max_abs_err"] < 1e-4, r  # float32 on the CPU: every way is the same convolution
        assert "us" not in r  # GPU times only


def test_split_attention_check_compares_both_kernels_with_float64(tmp_path: Path) -> None:
    out = tmp_path / "split.json"
    assert split_attention_check.main(["--device", "cpu", "--shapes", "2:100:20:50", "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert [r["kernel"] for r in results] == ["sdpa", "cudnn"]  # triton: not here, outside its interpreter
    for r in results:
        assert r["max_abs_err"] < 1e-5 and r["lse_max_abs_err"] < 1e-5, r
        assert 0 <= r["rel_rms"] < 1e-5


def test_split_attention_inputs_have_ragged_rings_and_padded_frames() -> None:
    x = split_attention_check.inputs(rows=4, prefix=100, ring=20, frames=50)
    own = x["mask"][:, 0, 0, 100:120]  # the first query's view of the ring slots
    held = own.sum(dim=-1)[:4].tolist()
    assert held[0] == 0 and held[-1] == 20 and len(set(held)) == 4
    assert not x["pad"].all() and x["pad"].any(dim=1).all()


def test_vocoder_cost_times_each_way_on_the_same_streams(tmp_path: Path) -> None:
    """On the CPU the Triton way keeps torch's operators (no interpreter here), so both ways
    give the same PCM, and the channels-last one nearly; a way that cannot run (an unknown
    one is refused up front) is a row with its error, not a crash."""
    out = tmp_path / "vocoder.json"
    assert vocoder_cost.main(["--device", "cpu", "--model", "tiny-random", "--model-cache", str(tmp_path),
                              "--rows", "1,3", "--ways", "torch,triton", "--reps", "1", "--new", "12",
                              "--context", "20", "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert [(r["rows"], r["way"]) for r in results] == [(1, "torch"), (1, "triton"), (3, "torch"), (3, "triton")]
    for r in results:
        assert r["wall_ms"] > 0 and r["max_abs_diff"] == 0.0, r
        assert "gpu_ms" not in r  # GPU times only
    # The channels-last decode: the same audio up to the convolutions' summation order.
    assert vocoder_cost.main(["--device", "cpu", "--model", "tiny-random", "--model-cache", str(tmp_path),
                              "--rows", "2", "--ways", "triton,channels-last", "--reps", "1", "--new", "12",
                              "--context", "20", "--json", str(out)]) == 0
    second = json.loads(out.read_text())["results"][1]
    assert second["way"] == "channels-last" and second["max_abs_diff"] < 1e-5, second
    with pytest.raises(SystemExit):
        vocoder_cost.main(["--device", "cpu", "--ways", "torch,cuda"])


def test_priority_lanes_times_every_way_and_checks_the_small_lane_untouched(tmp_path: Path) -> None:
    """On the CPU the lanes run one after the other (no streams): each way and delay is a row
    with both lanes' times, and the small lane's output matches its output alone."""
    out = tmp_path / "lanes.json"
    assert priority_lanes.main(["--device", "cpu", "--model", "tiny-random", "--model-cache", str(tmp_path),
                                "--no-compile", "--attention", "sdpa", "--conv-kernel", "torch",
                                "--big", "60,60", "--small", "20", "--prefix", "0", "--steps", "2",
                                "--delays", "0,5", "--reps", "2", "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert [(r["way"], r["delay_ms"]) for r in results] == [
        ("alone", 0.0), ("after", 0.0), ("beside", 0.0), ("priority", 0.0),
        ("after", 5.0), ("beside", 5.0), ("priority", 5.0)]
    for r in results:
        assert r["small_ms"] > 0 and r["big_ms"] > 0 and r["reps"] == 2, r
        assert r["small_diff"] == 0.0, r


def test_gemm_shapes_times_a_blocks_four_products_and_says_it_needs_cuda() -> None:
    """`bench.gemm_shapes` times the DiT block's products at the real model's widths (a
    fused q/k/v projection, the attention's output, the feed-forward's two), and says it
    needs CUDA where there is none."""
    shapes = gemm_shapes.products(FlowConfig())
    assert shapes == {"qkv": (1024, 3072), "attn_out": (1024, 1024), "ff_in": (1024, 2048), "ff_out": (2048, 1024)}
    if not torch.cuda.is_available():
        assert gemm_shapes.main(["--rows", "1"]) == 2
