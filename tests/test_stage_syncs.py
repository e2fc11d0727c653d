"""bench/stage_syncs.py on the CPU: it builds the engine's stage from a model directory,
runs batches of every requested size through it and reports their wall time (the GPU-only
parts, kernel busy time and host syncs, are left out off CUDA)."""

from __future__ import annotations

import json

from bench import stage_syncs


def test_stage_syncs_runs_the_engine_stage(tiny_model_dir, tmp_path) -> None:  # noqa: ANN001
    out = tmp_path / "syncs.json"
    report = stage_syncs.main(["--device", "cpu", "--model", str(tiny_model_dir), "--batches", "1,2", "--reps", "1",
                               "--prompt-tokens", "12", "--config", "flow_prompt_cache=false",
                               "--config", "max_gpu_batch=8", "--json", str(out)])
    assert [r["rows"] for r in report["results"]] == [1, 2]
    assert all(r["wall_ms"] > 0 and "syncs" not in r for r in report["results"])
    assert report["config"] == {"flow_prompt_cache": False, "max_gpu_batch": 8}
    assert json.loads(out.read_text()) == report
