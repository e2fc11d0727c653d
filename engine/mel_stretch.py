"""Speaking rate: an utterance's mel resampled in time, chunk by chunk, as one signal.

The official code changes the rate after the flow, by linear interpolation of the whole
utterance's mel to int(n / speed) frames (`F.interpolate`, not half-pixel aligned
corners), and only outside streaming. Stretching each streamed chunk on its own, as
this stage did, bent every chunk's edges toward its own ends and rounded each chunk's
length apart. `MelStretch` keeps the utterance's position instead: output frame k reads
input position (k + 0.5) * speed - 0.5, linearly between its two neighbours, whichever
chunk they came in, and a frame whose right neighbour is still to come waits for the
next chunk (one input frame, 20 ms of mel, at most). The last chunk ends the utterance at
int(n / speed) frames, the official length.
"""

from __future__ import annotations

import math

import torch


def streamed_frames(received: int, speed: float) -> int:
    """Output frames given out once `received` input frames have come and more will: those
    whose position has a right neighbour received, (k + 0.5) speed - 0.5 < received - 1.
    The rest of the `received / speed` wait for the next chunk (one frame at most)."""
    return max(0, math.ceil((received - 0.5) / speed - 0.5))


class MelStretch:
    """One utterance's rate change; `push` each chunk's mel [n, C] in order."""

    def __init__(self, speed: float) -> None:
        if not speed > 0:
            raise ValueError(f"speed must be > 0, not {speed}")
        self.speed = speed
        self._kept: torch.Tensor | None = None  # input frames [start, received) still needed
        self._start = 0  # utterance index of _kept[0]
        self._received = 0
        self._produced = 0

    def push(self, mel: torch.Tensor, final: bool) -> torch.Tensor:
        """The output frames this chunk completes ([m, C], m may be 0); `final`: the
        utterance's last chunk, after which nothing more is pushed."""
        kept = mel if self._kept is None else torch.cat((self._kept, mel))
        self._received += mel.shape[0]
        last = self._received - 1
        # Never below what was produced: a fast rate's last chunk of a few frames could end
        # the utterance before frames an earlier push already gave out.
        end = max(self._produced, int(self._received / self.speed) if final else streamed_frames(self._received, self.speed))
        k = torch.arange(self._produced, end, device=mel.device, dtype=torch.float64)
        pos = ((k + 0.5) * self.speed - 0.5).clamp(0.0, max(last, 0))
        lo = pos.floor()
        weight = (pos - lo).to(mel.dtype).unsqueeze(1)
        i0 = lo.long() - self._start
        i1 = torch.clamp(i0 + 1, max=kept.shape[0] - 1)
        out = kept[i0] * (1 - weight) + kept[i1] * weight if end > self._produced else kept[:0]
        self._produced = end
        if final:
            self._kept = None
            return out
        # Keep from the next frame's left neighbour on.
        first = min(int(max(0.0, (end + 0.5) * self.speed - 0.5)), last) - self._start
        self._kept, self._start = kept[first:], self._start + first
        return out
