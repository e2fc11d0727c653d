"""`bench.flow_profile` (the flow's kernel-time breakdown) runs end to end on CPU with the tiny
model and reports what the benchmark docs quote: wall time, model FLOPs and the families."""

from __future__ import annotations

import json

from bench import flow_profile


def test_flow_profile_reports_families_and_flops(tmp_path, capsys) -> None:  # noqa: ANN001
    out = tmp_path / "p.json"
    assert flow_profile.main(["--device", "cpu", "--tiny", "--batch", "2", "--frames", "60",
                              "--prompt-frames", "30", "--top", "3", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["batch"] == 2 and report["frames"] == 60 and report["mode"] == "torch.float32"
    assert report["wall_ms"] > 0 and report["model_tflops"] > 0 and report["achieved_tflops_s"] > 0
    assert abs(sum(report["families_pct"].values()) - 100) < 1
    printed = capsys.readouterr().out.splitlines()
    assert json.loads(printed[0]) == report and len(printed) == 4  # the report, then the top 3 kernels
