"""bench/attention_backends.py on the CPU: the DiT's attention inputs and mask at the
engine's shapes, checked against the float32 math backend (GPU timings need CUDA)."""

from __future__ import annotations

import torch

from bench import attention_backends


def test_inputs_follow_the_dit_mask() -> None:
    x = attention_backends.inputs(rows=2, prefix=100, frames=60, padded=6, device=torch.device("cpu"),
                                  dtype=torch.float32)
    k, v = x.keys_values()
    q, mask = x.q, x.mask
    assert q.shape == (4, 16, 60, 64) and k.shape == v.shape == (4, 16, 160, 64)
    # One voice: rows of a CFG half share the prefix, the halves differ.
    assert torch.equal(k[0, :, :100], k[1, :, :100]) and not torch.equal(k[0, :, :100], k[2, :, :100])
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
    names = {"copy + efficient", "split efficient", "copy + cudnn", "split cudnn"}
    assert set(result["backends"]) == set(attention_backends.BACKENDS) | names
    # The split attention (on the CPU its log-sum-exps are written out) is the same attention,
    # to float32's rounding: two partial softmaxes merged by their log-sum-exps round
    # differently from one (5e-7 here usually, 1.6e-5 once in a CI run; a wrong merge is off
    # by ~1e-1).
    for name in ("split efficient", "split cudnn"):
        assert result["backends"][name]["max_abs_err"] < 1e-4
