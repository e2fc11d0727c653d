"""bench/stage_syncs.py on the CPU: it builds the engine's stage from a model directory,
runs batches of every requested size through it and reports their wall time (the GPU-only
parts, kernel busy time and host syncs, are left out off CUDA)."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import pytest

from bench import stage_syncs


def test_stage_syncs_runs_the_engine_stage(tiny_model_dir, tmp_path) -> None:  # noqa: ANN001
    out = tmp_path / "syncs.json"
    report = stage_syncs.main(["--device", "cpu", "--model", str(tiny_model_dir), "--batches", "1,2", "--reps", "1",
                               "--prompt-tokens", "12", "--config", "flow_prompt_cache=false",
                               "--config", "max_gpu_batch=8", "--host", "50", "--json", str(out)])
    assert [r["rows"] for r in report["results"]] == [1, 2]
    assert all(r["wall_ms"] > 0 and "syncs" not in r for r in report["results"])
    # --host: this repository's functions by host time per batch, the whole batch first.
    for r in report["results"]:
        top = r["host"][0]
        assert top["function"].startswith("engine/token2wav.py") and top["function"].endswith("_compute")
        assert top["calls"] == 1 and top["cum_ms"] > 0
        assert all(h["cum_ms"] <= top["cum_ms"] and not h["function"].startswith("bench/") for h in r["host"])
    assert report["config"] == {"flow_prompt_cache": False, "max_gpu_batch": 8}
    assert json.loads(out.read_text()) == report


def test_kernel_table_groups_kernels_per_batch() -> None:
    from types import SimpleNamespace

    import torch

    def event(name: str, start: float, end: float, device: object = torch.autograd.DeviceType.CUDA) -> object:
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end))

    events = [
        event("nvjet_sm90_tst_256x128_gemm", 0, 3000),  # us
        event("nvjet_sm90_tst_256x128_gemm", 3000, 6000),
        event("void cutlass__5x_cudnn::Kernel<cutlass_tensorop_bf16_s16816fprop_analytic>", 6000, 8000),
        event("stage_batch_3", 0, 8000),  # the batch label's GPU copy: not a kernel
        event("aten::mm", 0, 9000, torch.autograd.DeviceType.CPU),
    ]
    table, families = stage_syncs.kernel_table(events, reps=2, top=5)
    assert [(k["kernel"][:12], k["ms"], k["calls"]) for k in table] == [("nvjet_sm90_t", 3.0, 1), ("void cutlass", 1.0, 0.5)]
    assert families == {"gemm": 0.75, "conv": 0.25}


def test_config_overrides_parse_each_field_by_its_type() -> None:
    got = stage_syncs.config_overrides(["warmup_concurrency=8", "flow_compile=false", "stage_devices=cpu,cpu",
                                        "tokens_per_text_token=none"])
    # warmup_concurrency and tokens_per_text_token default to None: typed by annotation, not default.
    assert got == {"warmup_concurrency": 8, "flow_compile": False, "stage_devices": ("cpu", "cpu"),
                   "tokens_per_text_token": None}
    with pytest.raises(SystemExit):
        stage_syncs.config_overrides(["no_such_field=1"])


def test_stage_benches_need_no_gateway_stack() -> None:
    """The GPU machine runs the stage benches without the gateway's web stack (Starlette,
    PyAV: not in its image); importing the gateway from them broke round 12's first run."""
    import subprocess
    import sys

    code = ("import sys, bench.stage_syncs, bench.context_bench; "
            "print(','.join(sorted(m for m in sys.modules if m.split('.')[0] in ('gateway', 'starlette', 'av'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_pcm_files_compare_two_runs(tiny_model_dir, tmp_path) -> None:  # noqa: ANN001
    """--pcm: the same seeds give two runs the same batches, so the same settings give the
    same PCM, the cuDNN attention setting (its bias path through SDPA on the CPU) nearly the
    same, and other inputs a different one."""
    def run(name: str, *extra: str) -> Path:
        path = tmp_path / f"{name}.npz"
        stage_syncs.main(["--device", "cpu", "--model", str(tiny_model_dir), "--batches", "1,2", "--reps", "1",
                          "--prompt-tokens", "12", "--config", "max_gpu_batch=8", "--pcm", str(path), *extra])
        return path

    base = run("a")
    assert stage_syncs.pcm_difference(base, run("b")) == {"rows_1": 0.0, "rows_2": 0.0}
    cudnn = stage_syncs.pcm_difference(base, run("c", "--config", "flow_attention=cudnn"))
    assert set(cudnn) == {"rows_1", "rows_2"} and max(cudnn.values()) < 1e-4
    other = stage_syncs.pcm_difference(base, run("d", "--prompt-tokens", "13"))
    assert min(other.values()) > 0.1


def test_opening_batches_are_first_chunks_of_fresh_utterances(tiny_model_dir) -> None:  # noqa: ANN001
    import torch

    from engine.config import EngineConfig
    from engine.stage_pool import build_stage
    from engine.models.loader import load_model

    stage = build_stage(load_model(tiny_model_dir, load_lm=False), torch.device("cpu"),
                        EngineConfig(model_dir=tiny_model_dir, device="cpu"))
    prompt = (torch.zeros(12, dtype=torch.long), torch.zeros(24, 80), torch.zeros(192))
    streams = [stage.new_stream() for _ in range(3)]
    jobs = stage_syncs.make_batch(stage, streams, prompt, step=5, opening=8)
    # No left context: the window is the chunk's own tokens plus the lookahead after the prompt.
    assert [j.flow.tokens.numel() for j in jobs] == [12 + 8 + stage_syncs.LOOKAHEAD] * 3
    assert all(j.flow.out_start == 12 and j.flow.noise_offset == 0 and j.chunk_index == 0 for j in jobs)
    assert not any(j.hift_stream is s for j in jobs for s in streams)  # each a new utterance
    sliding = stage_syncs.make_batch(stage, streams, prompt, step=5)
    assert [j.hift_stream for j in sliding] == streams and sliding[0].flow.out_start == 12 + stage_syncs.LEFT


def test_busy_threads_run_beside_the_measured_batches(tiny_model_dir, monkeypatch) -> None:  # noqa: ANN001
    """--busy 0,1: every size is measured once alone and once beside a busy Python thread,
    which runs while the batches run and is gone after."""
    seen: list[list[str]] = []
    real = stage_syncs.AudioStage._compute

    def compute(self, batch):  # noqa: ANN001, ANN202
        seen.append([t.name for t in threading.enumerate() if t.name.startswith("busy-")])
        return real(self, batch)

    monkeypatch.setattr(stage_syncs.AudioStage, "_compute", compute)
    switches: list[float] = []
    real_measure = stage_syncs.measure
    monkeypatch.setattr(stage_syncs, "measure", lambda *a, **k: switches.append(sys.getswitchinterval())
                        or real_measure(*a, **k))
    before = sys.getswitchinterval()
    report = stage_syncs.main(["--device", "cpu", "--model", str(tiny_model_dir), "--batches", "1", "--reps", "2",
                               "--prompt-tokens", "12", "--busy", "0,1", "--switch-ms", "0.5,2"])
    got = [(r["rows"], r["busy"], r["switch_ms"]) for r in report["results"]]
    assert got == [(1, 0, 1e3 * before), (1, 1, 0.5), (1, 1, 2.0)]
    assert switches == pytest.approx([before, 0.0005, 0.002]) and sys.getswitchinterval() == before
    assert all(r["wall_ms"] > 0 for r in report["results"])
    # Per measurement: 2 warm-up batches, then the 2 measured ones; only the busy runs'
    # measured batches had the thread beside them.
    assert seen == [[]] * 6 + [["busy-0"]] * 2 + [[]] * 2 + [["busy-0"]] * 2
    assert not [t for t in threading.enumerate() if t.name.startswith("busy-")]
