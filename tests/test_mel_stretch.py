"""Speaking rate on a streamed utterance (`engine.mel_stretch`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.mel_stretch import MelStretch


def _chunks(n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    sizes, left = [], n
    while left:
        sizes.append(min(left, int(rng.integers(1, 40))))
        left -= sizes[-1]
    return sizes


@pytest.mark.parametrize("speed", [0.5, 0.8, 1.3, 2.0, 3.7])
def test_chunks_stretch_as_one_signal_to_the_official_length(speed: float) -> None:
    """However the utterance is cut into chunks, the output is the same frames, int(n / speed)
    of them (the official length), and close to the official whole-mel interpolation:
    stretched chunk by chunk on their own, each chunk's edges bent toward its ends."""
    g = torch.Generator().manual_seed(0)
    mel = torch.cumsum(torch.randn(157, 80, generator=g), 0) * 0.1  # smooth in time, as mel is
    whole = MelStretch(speed).push(mel, final=True)
    assert whole.shape == (int(157 / speed), 80)
    for seed in range(4):
        stretch, out, at = MelStretch(speed), [], 0
        sizes = _chunks(157, seed)
        for i, n in enumerate(sizes):
            out.append(stretch.push(mel[at : at + n], final=i == len(sizes) - 1))
            at += n
        torch.testing.assert_close(torch.cat(out), whole, rtol=0, atol=1e-6)
    official = F.interpolate(mel.t()[None], size=int(157 / speed), mode="linear", align_corners=False)[0].t()
    # The same curve: streaming reads at `speed` frames a frame, the official call at n /
    # int(n / speed), which it can only know at the end: at most a frame's step apart.
    step = (mel[1:] - mel[:-1]).abs().max()
    assert (whole - official).abs().max() <= step + 1e-5
    # Chunks stretched apart (as before) are not the one signal.
    sizes = _chunks(157, 0)
    at = np.cumsum([0, *sizes])
    apart = torch.cat([F.interpolate(mel[a:b].t()[None], size=max(1, round((b - a) / speed)), mode="linear",
                                     align_corners=False)[0].t() for a, b in zip(at[:-1], at[1:])])
    assert apart.shape != whole.shape or (apart - whole).abs().max() > 1e-3

def test_a_chunk_may_complete_no_frame_and_speed_must_be_positive() -> None:
    stretch = MelStretch(3.0)
    assert stretch.push(torch.ones(1, 80), final=False).shape == (0, 80)
    assert stretch.push(torch.ones(2, 80), final=True).shape == (1, 80)
    with pytest.raises(ValueError):
        MelStretch(0.0)


def test_a_last_chunk_shorter_than_what_is_out_ends_there() -> None:
    """At a fast rate a short last chunk can end the utterance (int(n / speed) frames) before
    frames an earlier push gave out: it ends there, with nothing more, instead of raising
    (which failed the chunk's whole stage batch)."""
    stretch = MelStretch(20.0)
    out = stretch.push(torch.zeros(32, 4), final=False)
    assert out.shape[0] == 2  # (k + 0.5) * 20 - 0.5 < 31 for k = 0, 1
    assert stretch.push(torch.zeros(6, 4), final=True).shape[0] == 0  # int(38 / 20) = 1 < 2
