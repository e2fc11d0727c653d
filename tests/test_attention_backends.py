"""bench/attention_backends.py on the CPU: the DiT's attention inputs and mask at the
engine's shapes, checked against the float32 math backend (GPU timings need CUDA)."""

from __future__ import annotations

import torch

from bench import attention_backends


def test_inputs_follow_the_dit_mask() -> None:
    q, k, v, mask = attention_backends.inputs(rows=2, prefix=100, frames=60, padded=6, device=torch.device("cpu"),
                                              dtype=torch.float32)
    assert q.shape == (4, 16, 60, 64) and k.shape == v.shape == (4, 16, 160, 64)
    assert mask.shape == (4, 1, 60, 160)
    assert bool(mask[:, :, :, :100].all())  # every query sees the whole cached prefix
    # Block-causal among the new frames (blocks of 50): frame 10 sees frames 0-49 only.
    row = mask[0, 0, 10, 100:]
    assert bool(row[:50].all()) and not bool(row[50:].any())
    assert not bool(mask[0, 0, 55, 100 + 54:].any())  # the last 6 frames are padding


def test_the_math_backend_matches_the_reference_on_the_cpu(tmp_path) -> None:  # noqa: ANN001
    report = attention_backends.main(["--device", "cpu", "--dtype", "float32", "--rows", "1", "--frames", "50",
                                      "--json", str(tmp_path / "a.json")])
    (result,) = report["results"]
    math = result["backends"]["math"]
    assert math["max_abs_err"] < 1e-5 and "us" not in math  # no GPU timing off CUDA
    assert set(result["backends"]) == set(attention_backends.BACKENDS)
