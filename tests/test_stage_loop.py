"""`bench.stage_loop` on the tiny model: the stage's own loop under a steady load, with and
without pipelined rounds."""

from __future__ import annotations

import json
from pathlib import Path

from bench import stage_loop


def test_stage_loop_runs_each_lead_on_one_stage(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "loop.json"
    report = stage_loop.main(["--device", "cpu", "--model", str(tiny_model_dir), "--streams", "2,3", "--steps", "3",
                              "--leads", "0,5", "--reps", "1", "--prompt-tokens", "12",
                              "--config", "max_gpu_batch=8", "--json", str(out)])
    got = [(r["streams"], r["lead_ms"]) for r in report["results"]]
    assert got == [(2, 0.0), (2, 5.0), (3, 0.0), (3, 5.0)]
    for r in report["results"]:
        # Every utterance queues its next chunk as the stage takes the one before: one
        # round a step, every utterance in it.
        assert (r["rounds"], r["rows_per_round"]) == (3, r["streams"])
        assert r["wall_ms"] > 0 and 0 < r["busy_share"] <= 1.0 + 1e-6
        assert abs(r["chunks_per_s"] - 3 * r["streams"] / (r["wall_ms"] / 1e3)) < 1e-6 * r["chunks_per_s"]
        assert r["pcm_rel_rms"] < 1e-6  # the CPU's rounds are the same either way
    assert [(x["streams"], x["lead_ms"]) for x in report["ratios"]] == [(2, 5.0), (3, 5.0)]
    assert all(x["wall_vs_first_lead"] > 0 for x in report["ratios"])
    saved = json.loads(out.read_text())
    assert (saved["results"], saved["ratios"]) == (report["results"], report["ratios"])
