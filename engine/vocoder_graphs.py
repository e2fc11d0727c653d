"""CUDA graphs for the CosyVoice3 vocoder's decode (`CausalHiFTGenerator._decode`).

At one or a few streams the vocoder is launch-bound: a one-chunk `stream_step` dispatches
~710 operators, ~620 of them in `_decode` (the HiFT trunk and the inverse STFT), and on
the H200 a one-chunk vocoder step took ~19 ms for work the GPU does in a fraction of that.
A captured graph launches the decode as one replay.

Shapes: a graph has fixed shapes, so a batch is padded up to a bucket:

* rows (streams) to the next of `VocoderGraphPolicy.batch_buckets`;
* decoded mel frames to the next multiple of `frame_multiple` (at most `max_frames`).

The padding is exact, the same argument as the stage's ragged batches, which `stream_step`
already pads: the trunk's convolutions look left, or `conv_pre_look_right` frames right
and only into frames the caller supplies, so a real frame never reads padding. The inverse
STFT leaves out every STFT frame at or past `valid[b]`, and padding rows get `valid` 0.
Batches that fit no bucket, and all batches after a failed capture, run eagerly.

All graphs read and write one set of static buffers, which are views of flat tensors
allocated once at the largest bucket. They share one memory pool, and replays run in
sequence on the stage's worker thread.

A graph reads the vocoder's weights and buffers (and its Snake activations' cached
inverses) by address: after warm-up the module must not be moved, cast, re-folded or have
its weights replaced. The stage builds the runner after the loader and `build_stage` are
done with it. The decode uses no cuFFT (`hift._dft_bases`): a captured plan could be
evicted from PyTorch's plan cache by eager FFTs of other shapes.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable

import torch

from .graph_capture import CAPTURE_LOCK, copy_padded
from .models.hift import CausalHiFTGenerator, held_back_frames

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VocoderGraphPolicy:
    """Which vocoder batches get a graph. Larger batches are compute-bound (a graph would
    gain little and pad more), so the rows stop at 8 by default."""

    batch_buckets: tuple[int, ...] = (1, 2, 4, 8)
    frame_multiple: int = 32
    max_frames: int = 256  # a decode window: its context (~35 frames), held-back frames and new ones

    def bucket(self, rows: int, frames: int) -> tuple[int, int] | None:
        fitting = [b for b in self.batch_buckets if b >= rows]
        padded = -(-frames // self.frame_multiple) * self.frame_multiple
        if not fitting or rows < 1 or frames < 1 or padded > self.max_frames:
            return None
        return min(fitting), padded

    def shapes(self) -> list[tuple[int, int]]:
        """Every bucket, for `VocoderGraphRunner.warm`."""
        return [(r, f) for r in self.batch_buckets
                for f in range(self.frame_multiple, self.max_frames + 1, self.frame_multiple)]


# The widest vocoder graphs a stage captures (`engine.stage_build.vocoder_graph_frames`): a
# wide left context (`flow_left_context`) would otherwise ask for hundreds of graphs, each
# pooled at 8 rows of that width. Wider windows decode eagerly.
MAX_GRAPH_FRAMES = 640


def window_frames(gen: CausalHiFTGenerator, new_frames: int, frame_multiple: int = 32) -> int:
    """A bound on the decode window a chunk of `new_frames` mel frames asks of the vocoder:
    its context, the frames the step before held back (a final step decodes them) and the
    new ones, on `frame_multiple`: the `VocoderGraphPolicy.max_frames` that keeps such
    chunks on graphs."""
    frames = gen.context_frames + held_back_frames(gen.cfg) + new_frames
    return -(-frames // frame_multiple) * frame_multiple


@dataclass
class VocoderGraphStats:
    captures: int = 0
    replays: int = 0
    eager: int = 0


class VocoderGraphRunner:
    """A drop-in for `CausalHiFTGenerator._decode` (pass it as `stream_step(decode=...)`).
    With `capture=False` (the default off CUDA) it keeps the padding and the static buffers
    and decodes eagerly on them: the path the CPU tests check."""

    def __init__(self, gen: CausalHiFTGenerator, policy: VocoderGraphPolicy | None = None,
                 capture: bool | None = None) -> None:
        self.gen = gen
        self.policy = policy or VocoderGraphPolicy()
        self.device = gen.stft_window.device
        self.capture = (self.device.type == "cuda") if capture is None else capture
        if self.capture and self.device.type != "cuda":
            raise ValueError("CUDA graph capture needs the vocoder on a CUDA device")
        self.stats = VocoderGraphStats()
        cfg = gen.cfg
        self._look = cfg.conv_pre_look_right
        self._spf = cfg.samples_per_frame
        self._n_fft = cfg.n_fft
        self._flat: dict[str, torch.Tensor] = {}
        self._graphs: OrderedDict[tuple[int, int], object] = OrderedDict()
        self._pool: object | None = None
        self._stream: torch.cuda.Stream | None = None
        self._broken = False

    @torch.inference_mode()
    def __call__(self, mel: torch.Tensor, s_padded: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Same contract as `CausalHiFTGenerator._decode` ([B, spf * N] audio), for
        valid[b] <= (samples per frame / hop) * N + 1, which is all `_advance_audio` passes:
        a larger value would let the padded STFT frames into the inverse STFT."""
        rows, _, length = mel.shape
        frames = length - self._look
        shape = None if self._broken else self.policy.bucket(rows, frames)
        if shape is None:
            self.stats.eager += 1
            return self.gen._decode(mel, s_padded, valid)
        views = self._views(*shape, dtype=mel.dtype)
        copy_padded(views["mel"], mel)
        copy_padded(views["source"], s_padded[:, : views["source"].shape[1]])
        copy_padded(views["valid"], valid)
        if not self._run(shape, views):
            self.stats.eager += 1
            return self.gen._decode(mel, s_padded, valid)
        self.stats.replays += 1
        # A copy: the next replay overwrites the static output.
        return views["out"][:rows, : self._spf * frames].clone()

    @torch.inference_mode()
    def warm(self, shapes: Iterable[tuple[int, int]] | None = None) -> int:
        """Capture the graphs for these (rows, frames) buckets now (default: all of them),
        so no request pays for a capture; returns how many were captured."""
        if not self.capture:
            return 0
        before = self.stats.captures
        for rows, frames in self.policy.shapes() if shapes is None else shapes:
            shape = self.policy.bucket(rows, frames)
            if shape is None or shape in self._graphs or self._broken:
                continue
            try:
                views = self._views(*shape, dtype=self.gen.stft_window.dtype)
            except torch.OutOfMemoryError:
                log.warning("no memory for the vocoder's graph buffers; it decodes eagerly")
                self._broken = True
                break
            views["mel"].zero_()
            views["source"].zero_()
            views["valid"].fill_(1)
            self._run(shape, views, replay=False)
        return self.stats.captures - before

    # ------------------------------------------------------------------ internals
    def _views(self, rows: int, frames: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        big_rows, big_frames = max(self.policy.batch_buckets), self.policy.max_frames
        channels = self.gen.cfg.in_channels
        sizes = {"mel": big_rows * channels * (big_frames + self._look),
                 "source": big_rows * (self._n_fft + self._spf * big_frames),
                 "out": big_rows * self._spf * big_frames}
        if not self._flat or self._flat["mel"].dtype != dtype:
            self._graphs.clear()  # graphs point into the old buffers
            self._flat = {k: torch.zeros(n, device=self.device, dtype=dtype) for k, n in sizes.items()}
            self._flat["valid"] = torch.zeros(big_rows, device=self.device, dtype=torch.long)

        def view(name: str, *shape: int) -> torch.Tensor:
            n = 1
            for s in shape:
                n *= s
            return self._flat[name][:n].view(*shape)

        return {"mel": view("mel", rows, channels, frames + self._look),
                "source": view("source", rows, self._n_fft + self._spf * frames),
                "valid": view("valid", rows), "out": view("out", rows, self._spf * frames)}

    def _decode_into(self, views: dict[str, torch.Tensor]) -> None:
        views["out"].copy_(self.gen._decode(views["mel"], views["source"], views["valid"]))

    def _run(self, shape: tuple[int, int], views: dict[str, torch.Tensor], replay: bool = True) -> bool:
        """Fill views["out"] from the static inputs; False: the capture failed (the caller
        decodes eagerly, and so does every later batch)."""
        if not self.capture:
            self._decode_into(views)
            return True
        with torch.cuda.device(self.device):
            graph = self._graphs.get(shape)
            if graph is None:
                try:
                    with CAPTURE_LOCK:
                        graph = self._capture(views)
                except Exception:  # a capture problem must not take the stage down
                    log.exception("vocoder CUDA graph capture failed for %s; the vocoder decodes eagerly", shape)
                    self._broken = True
                    self._graphs.clear()
                    return False
                self._graphs[shape] = graph
                self.stats.captures += 1
            if replay:
                graph.replay()  # type: ignore[attr-defined]
        return True

    def _capture(self, views: dict[str, torch.Tensor]) -> object:
        current = torch.cuda.current_stream(self.device)
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
            self._pool = torch.cuda.graph_pool_handle()
        side = self._stream
        side.wait_stream(current)
        with torch.cuda.stream(side):
            self._decode_into(views)  # warm-up: cuDNN and cuFFT plans outside the capture
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the LM backend may use the GPU from other threads meanwhile.
        with torch.cuda.graph(graph, pool=self._pool, stream=side, capture_error_mode="thread_local"):
            self._decode_into(views)
        return graph

