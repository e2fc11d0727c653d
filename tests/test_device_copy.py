"""device_copy: the same tensors as a plain copy (the non-blocking path is CUDA-only)."""

from __future__ import annotations

import torch

from engine.device_copy import tensor_on, to_device


def test_tensor_on_matches_a_plain_tensor() -> None:
    for data, dtype in (([3, 1, 2], torch.long), ([0.5, -1.25], torch.float32), ([True, False], torch.bool)):
        got = tensor_on(data, dtype, "cpu")
        assert got.dtype == dtype and got.device.type == "cpu"
        assert torch.equal(got, torch.tensor(data, dtype=dtype))


def test_to_device_casts_on_the_host_and_leaves_values_alone() -> None:
    t = torch.arange(6, dtype=torch.int32).reshape(2, 3)
    out = to_device(t, torch.device("cpu"), torch.float64)
    assert out.dtype == torch.float64 and torch.equal(out, t.double())
    assert to_device(t, "cpu") is t  # nothing to do: no copy
