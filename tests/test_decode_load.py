"""bench/decode_load.py on the CPU: the stand-in LM decode loop runs and reports its rate."""

from __future__ import annotations

from bench import decode_load


def test_decode_load_runs_steps_and_reports() -> None:
    report = decode_load.main(["--device", "cpu", "--rows", "2", "--layers", "2", "--hidden", "32", "--ffn", "64",
                               "--steps-per-s", "0", "--seconds", "0.2"])
    assert report["steps"] >= 1 and report["seconds"] >= 0.2
    assert report["steps_per_s"] == report["steps"] / report["seconds"]
    step = decode_load.DecodeStep(2, 2, 32, 64, decode_load.torch.device("cpu"), decode_load.torch.float32)
    out = step()
    assert out.shape == (2, 32) and bool(out.isfinite().all())
