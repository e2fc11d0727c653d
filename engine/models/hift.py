"""CosyVoice3 causal vocoder: HiFT (neural source filter + iSTFT), whole-utterance and streaming.

Mel (80 x 50 Hz) -> audio (24 kHz, 480 samples per frame) in three stages:

1. F0 predictor (run in float64, as the official code does since commit 0d990d6: the pitch feeds
   a phase accumulator, so tiny float32 differences between a chunked and a whole run would turn
   into audible phase jumps). One conv sees 3 future frames, the rest is left-causal.
2. NSF excitation: 9 harmonics of f0, a phase accumulator and a fixed noise table indexed by the
   absolute sample position, merged by `m_source.l_linear` + tanh.
3. Decoder: a right-causal `conv_pre` (4 future frames), then three upsampling stages fused with
   the STFT of the excitation, causal resblocks, `conv_post`, and an inverse STFT.

Everything except the two look-ahead convs is causal with a bounded receptive field, which is what
makes `stream_step` possible: it keeps a bounded window of mel / excitation per utterance, carries
the phase accumulator and the noise position, recomputes only `[context + new]` and keeps the new
samples. The official streaming path instead re-runs the vocoder over all mel received so far.

Parameter names equal the official `hift.pt` (weight norm via `torch.nn.utils.parametrizations`).

Fixed noise. In inference the official causal vocoder draws its noise from tensors allocated in
the constructors with `torch.rand` (`SineGen2.rand_ini` [1, 9], `SineGen2.sine_waves`
[1, 300*24000, 9], `SourceModuleHnNSF.uv` [1, 300*24000, 1]). They are not in the checkpoint, so
their values come from the global torch RNG at model-build time. That RNG is deterministic: the
flow decoder's constructor (`CausalConditionalCFM.__init__`) calls `set_all_random_seed(0)` just
before, and `cosyvoice3.yaml` builds `flow` and then `hift`, so the draws in between are fixed:
CFM noise `randn(1, 80, 15000)`, the flow's `Embedding(6561, 80)` and `Linear(192, 80)`, the F0
predictor's convs and classifier, then `rand_ini`, then `sine_waves`. `_noise_table_state`
replays exactly those draws on a private generator and keeps only the generator state at the
first element of `sine_waves`; any prefix of the table is then produced on demand (CPU mt19937
draws one 32-bit word per float32 uniform, so chunked draws continue the same sequence). Memory
per utterance is therefore O(samples actually synthesised), never the 259 MB table.
Not needed: `rand_ini` (the linear down-sampling in `SineGen2._f02sine` samples positions
480*i + 239/240 only, never position 0 where it is added) and the `uv` table (it only feeds the
noise-branch output that inference discards).

Every utterance reads the same table from sample 0, so its first `noise_table_seconds` live on
the vocoder's device once (`_NoiseTable`, 52 MB for 60 s) and a batch slices it there. Drawing
each stream's slice on the CPU instead cost a CPU RNG pass per stream and batch, and its
copy to the GPU made the host wait for the whole flow batch queued before it. Past the table,
a stream's own generator (started at the table's end state) continues the same sequence.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

from engine.device_copy import tensor_on, to_device
from engine import ragged
from engine.ragged import ragged_rows, row_ranges, row_windows
from engine.models import snake_kernel
from engine.models.derived import DerivedTensor
from engine.models.triton_support import is_kernel_error
from engine.models.config import HiFTConfig

log = logging.getLogger(__name__)

# Sizes of what the official build draws from the RNG between `set_all_random_seed(0)` (flow
# decoder) and the vocoder's noise table (see module docstring). Fixed by cosyvoice3.yaml.
_CFM_NOISE_NUMEL = 1 * 80 * 50 * 300
_FLOW_VOCAB, _FLOW_MEL_DIM, _FLOW_SPK_DIM = 6561, 80, 192
_F0_LOOKAHEAD = 3  # frames condnet[0] (kernel 4, right-causal) looks ahead
_F0_LEFT_LAYERS = 4  # kernel-3 left-causal convs after it, 2 frames of history each
NOISE_TABLE_SECONDS = 60.0  # device-resident prefix of the noise table (module docstring)


# ----------------------------------------------------------------------------- conv building blocks
#
# Two layouts run the same arithmetic (`CausalHiFTGenerator.channels_last`). Channels-first
# ([B, C, T], each module's `forward`) is PyTorch's own for 1-D convolutions. Channels-last
# ([B, C, 1, T] in `torch.channels_last` memory format, each module's `forward_channels_last`:
# frame-major storage) runs every convolution as a 2-D one, with a channels-last copy of its
# weight made once. cuDNN's float32 (TF32) kernels on Hopper work channels-last, so each
# channels-first convolution paid layout conversions of its input, weight and output around
# the product (~215 conversion kernels a 5-chunk stage round on an H100, round 46 of
# docs/benchmarks.md). PyTorch's padding, nearest upsampling, concatenation and elementwise
# operators keep a channels-last input's layout, so the trunk stays in it end to end (where a
# time or channel size is 1 the two layouts are the same strides' order, either will do).


def conv_channels_last(conv: nn.Conv1d, x: torch.Tensor, weight: DerivedTensor[torch.Tensor],
                       bias: bool = True) -> torch.Tensor:
    """`conv`'s product (its stride, dilation and bias, unless bias=False; no padding) on a
    channels-last x [B, Cin, 1, T] -> [B, Cout, 1, T'], channels-last. `weight` keeps the
    weight's channels-last copy, [Cout, Cin, 1, K]."""
    def make(v: torch.Tensor) -> torch.Tensor:
        if conv.groups != 1 or conv.padding != (0,) or conv.padding_mode != "zeros":
            raise ValueError("a channels-last convolution here is ungrouped and pads nothing itself")
        return v.unsqueeze(2).contiguous(memory_format=torch.channels_last)

    w = weight.get(conv.weight, make)
    return F.conv2d(x, w, conv.bias if bias else None,  # type: ignore[arg-type]
                    stride=(1, conv.stride[0]), dilation=(1, conv.dilation[0]))


class LeftCausalConv1d(nn.Conv1d):
    """Stride-1 conv that only sees the past: zero-pads (kernel-1)*dilation frames on the left."""

    def __init__(self, cin: int, cout: int, kernel: int, dilation: int = 1) -> None:
        super().__init__(cin, cout, kernel, dilation=dilation)
        self.history = (kernel - 1) * dilation
        self.weight_channels_last: DerivedTensor[torch.Tensor] = DerivedTensor()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.pad(x, (self.history, 0)) if self.history else x)  # a pad of 0 copies

    def forward_channels_last(self, x: torch.Tensor, padded: bool = False, bias: bool = True) -> torch.Tensor:
        """padded: x already starts with the `history` zero frames (a Snake's `pad_left`);
        bias=False leaves the bias out (for a Snake after to add)."""
        if not padded and self.history:
            x = F.pad(x, (self.history, 0))
        return conv_channels_last(self, x, self.weight_channels_last, bias)


class LookaheadConv1d(nn.Conv1d):
    """Conv that sees `kernel-1` future frames. It does no padding itself: the caller appends the
    look-ahead (real frames mid-stream, zeros at the end of an utterance, which is what the
    official code uses when `finalize=True`), so the output is `kernel-1` frames shorter."""

    def __init__(self, cin: int, cout: int, kernel: int) -> None:
        super().__init__(cin, cout, kernel)
        self.lookahead = kernel - 1
        self.weight_channels_last: DerivedTensor[torch.Tensor] = DerivedTensor()

    def forward_channels_last(self, x: torch.Tensor) -> torch.Tensor:
        return conv_channels_last(self, x, self.weight_channels_last)


class UpsampleConv1d(nn.Conv1d):
    """Nearest-neighbour upsampling by `rate`, then a left-causal conv (official
    CausalConv1dUpsample); a causal replacement for the transposed conv of HiFi-GAN."""

    def __init__(self, cin: int, cout: int, kernel: int, rate: int) -> None:
        super().__init__(cin, cout, kernel)
        self.rate = rate
        self.weight_channels_last: DerivedTensor[torch.Tensor] = DerivedTensor()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.repeat_interleave(x, self.rate, dim=2)
        return super().forward(F.pad(x, (self.kernel_size[0] - 1, 0)))

    def forward_channels_last(self, x: torch.Tensor) -> torch.Tensor:
        # Nearest upsampling has channels-last kernels; repeat_interleave would go back to
        # channels-first. The same values while its float32 source index is exact (2^24
        # output frames, ~46 minutes at the last stage: only a whole-utterance `inference`).
        if x.shape[3] * self.rate <= 2**24:
            x = F.interpolate(x, scale_factor=(1, self.rate), mode="nearest")
        else:
            x = torch.repeat_interleave(x, self.rate, dim=3).contiguous(memory_format=torch.channels_last)
        return conv_channels_last(self, F.pad(x, (self.kernel_size[0] - 1, 0)), self.weight_channels_last)


class DownsampleConv1d(nn.Conv1d):
    """Strided conv (kernel 2*rate) with rate-1 zeros on the left (official CausalConv1dDownSample)."""

    def __init__(self, cin: int, cout: int, rate: int) -> None:
        super().__init__(cin, cout, 2 * rate, stride=rate)
        self.rate = rate
        self.weight_channels_last: DerivedTensor[torch.Tensor] = DerivedTensor()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.pad(x, (self.rate - 1, 0)))

    def forward_channels_last(self, x: torch.Tensor) -> torch.Tensor:
        return conv_channels_last(self, F.pad(x, (self.rate - 1, 0)), self.weight_channels_last)


# How the Snake activations run (`use_snake_kernel`, EngineConfig.vocoder_snake_kernel):
# "torch": eager elementwise operators; "triton": one fused pass (`snake_kernel`), where it
# runs (CUDA), else torch's.
SNAKE_KERNELS: tuple[str, ...] = ("torch", "triton")


@dataclass
class SnakeKernel:
    """The kernel choice the Snake activations of one vocoder share: one failure of the
    Triton kernel sends all of them back to torch's operators, not one at a time."""

    name: str = "torch"


class Snake(nn.Module):
    """x + sin^2(alpha x) / alpha, per channel (linear-scale alpha, as in the checkpoint)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))
        self.coefficients: DerivedTensor[tuple[torch.Tensor, ...]] = DerivedTensor()
        self.kernel = SnakeKernel()

    def _alpha_and_inverse(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """alpha and 1 / (alpha + 1e-9), as [1, C, 1] and as [1, C, 1, 1], computed once per
        value of alpha (`DerivedTensor`). The vocoder is launch-bound at small batches and
        has ~75 of these activations, so recomputing the inverse (two kernels) and the
        reshape (two views) on every call was ~300 of a one-chunk vocoder step's ~1150
        dispatches."""
        def make(a: torch.Tensor) -> tuple[torch.Tensor, ...]:
            shaped = a[None, :, None]
            inverse = 1.0 / (shaped + 1e-9)
            return shaped, inverse, shaped[..., None], inverse[..., None]

        return self.coefficients.get(self.alpha, make)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, C, T]."""
        a, inverse, _, _ = self._alpha_and_inverse()
        if self._use_kernel(x, channels_last=False):
            try:
                return snake_kernel.snake(x, a, inverse)
            except Exception as exc:
                self._kernel_failed(exc)
        return x + inverse * torch.sin(x * a).pow(2)

    def forward_channels_last(self, x: torch.Tensor, bias: torch.Tensor | None = None,
                              pad_left: int = 0) -> torch.Tensor:
        """x [B, C, 1, T], channels-last; the activation of x + bias (C values, the
        convolution's before, which left it out), with `pad_left` zero frames in front (the
        history of a left-causal convolution after)."""
        _, _, a, inverse = self._alpha_and_inverse()
        if self._use_kernel(x, channels_last=True):
            try:
                return snake_kernel.snake_channels_last(x, a, inverse, bias, pad_left)
            except Exception as exc:
                self._kernel_failed(exc)
        if bias is not None:
            x = x + bias[:, None, None]
        return F.pad(x + inverse * torch.sin(x * a).pow(2), (pad_left, 0))

    def _use_kernel(self, x: torch.Tensor, channels_last: bool) -> bool:
        return self.kernel.name == "triton" and snake_kernel.available(x, channels_last)

    def _kernel_failed(self, exc: Exception) -> None:
        if not is_kernel_error(exc):
            raise exc
        # The first call is a warm-up's (the stage's, or a graph's eager one), so this
        # falls back before any capture; the audio stays the same, only slower.
        log.exception("the Triton Snake activation cannot run here; the vocoder uses torch's")
        self.kernel.name = "torch"


def use_snake_kernel(vocoder: nn.Module, name: str) -> None:
    """Every Snake activation of `vocoder` runs with `name` (SNAKE_KERNELS) from now on,
    sharing one choice."""
    if name not in SNAKE_KERNELS:
        raise ValueError(f"snake kernel must be one of {', '.join(SNAKE_KERNELS)}, not {name!r}")
    shared = SnakeKernel(name)
    for module in vocoder.modules():
        if isinstance(module, Snake):
            module.kernel = shared


class CausalResBlock(nn.Module):
    """Three residual units: snake -> dilated causal conv -> snake -> causal conv."""

    def __init__(self, channels: int, kernel: int, dilations: tuple[int, ...]) -> None:
        super().__init__()
        self.convs1 = nn.ModuleList(
            weight_norm(LeftCausalConv1d(channels, channels, kernel, d)) for d in dilations
        )
        self.convs2 = nn.ModuleList(
            weight_norm(LeftCausalConv1d(channels, channels, kernel, 1)) for _ in dilations
        )
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for act1, conv1, act2, conv2 in zip(self.activations1, self.convs1, self.activations2, self.convs2):
            x = conv2(act2(conv1(act1(x)))) + x
        return x

    def forward_channels_last(self, x: torch.Tensor) -> torch.Tensor:
        # Each Snake pads for the convolution after it, and the second adds the first
        # convolution's bias: PyTorch would pad (a fill and a copy) and add the bias (cuDNN's
        # convolution leaves it to a broadcast addition) in passes of their own. Together a
        # 5-stream decode's GPU time went from 7.7 to 6.1 ms on an H100 (round 47 of
        # docs/benchmarks.md).
        for act1, conv1, act2, conv2 in zip(self.activations1, self.convs1, self.activations2, self.convs2):
            h = conv1.forward_channels_last(act1.forward_channels_last(x, pad_left=conv1.history),
                                            padded=True, bias=False)
            h = act2.forward_channels_last(h, bias=conv1.bias, pad_left=conv2.history)
            x = conv2.forward_channels_last(h, padded=True) + x
        return x

    @staticmethod
    def history(kernel: int, dilations: tuple[int, ...]) -> int:
        """Past frames one output depends on (receptive field minus one)."""
        return sum((kernel - 1) * d + (kernel - 1) for d in dilations)


class CausalF0Predictor(nn.Module):
    """Mel -> f0 in Hz. Input must already carry the 3 look-ahead frames at its end."""

    def __init__(self, in_channels: int, channels: int) -> None:
        super().__init__()
        layers: list[nn.Module] = [weight_norm(LookaheadConv1d(in_channels, channels, _F0_LOOKAHEAD + 1)), nn.ELU()]
        for _ in range(_F0_LEFT_LAYERS):
            layers += [weight_norm(LeftCausalConv1d(channels, channels, 3)), nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(channels, 1)
        # `forward` runs the convs as `conv1d_time_major`, which has no stride, dilation or groups.
        assert all(m.stride == (1,) and m.dilation == (1,) and m.groups == 1 and m.padding == (0,)
                   for m in self.condnet if isinstance(m, nn.Conv1d))

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        """f0 [B, T - 3] from mel [B, C, T]. The convs run as matrix products over the taps,
        time-major, not through `condnet`'s own conv calls: the predictor runs in float64
        (see the module docstring), where cuDNN has only a generic kernel. On the H200 it ran
        ~212 us per 512-channel conv on 4 thread blocks, 0.9 ms of a lone session's ~15 ms of
        GPU work in its stage round (round 37 of docs/benchmarks.md); cuBLAS's float64 GEMM
        does it as one product. The same arithmetic up to the order of the sums."""
        h = mel.transpose(1, 2)  # [B, T, C]
        for layer in self.condnet:
            if isinstance(layer, nn.Conv1d):
                history = layer.history if isinstance(layer, LeftCausalConv1d) else 0
                h = conv1d_time_major(F.pad(h, (0, 0, history, 0)) if history else h, layer.weight, layer.bias)
            else:
                h = layer(h)
        return self.classifier(h).squeeze(-1).abs()


def conv1d_time_major(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A stride-1, undilated, ungrouped, unpadded conv1d on time-major input, as one matrix
    product: x [B, T, Cin], weight [Cout, Cin, K] -> [B, T - K + 1, Cout]."""
    windows = x.unfold(1, weight.shape[2], 1)  # [B, T', Cin, K]: (Cin, K) flattened as the weight is
    return F.linear(windows.flatten(2), weight.flatten(1), bias)


class NSFSource(nn.Module):
    """Harmonic-plus-noise excitation (official SourceModuleHnNSF + SineGen2, causal inference).

    Works at frame level where the official works per sample: f0 is constant inside a frame and
    the causal SineGen2 holds the phase constant per frame too (nearest up-sampling of a
    per-frame phase), so computing per frame and repeating gives the same numbers.
    """

    def __init__(self, cfg: HiFTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.l_linear = nn.Linear(cfg.nb_harmonics + 1, 1)

    def forward(
        self, f0: torch.Tensor, phase_start: torch.Tensor, noise: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """f0 [B, N] (Hz), phase_start [B, H] float64 (accumulated cycles/sample before frame 0 of
        this call), noise [B or 1, N*spf, H] uniform table slice. Returns the excitation
        [B, N*spf] and the accumulated phase after each frame, [B, N, H] float64."""
        cfg = self.cfg
        spf = cfg.samples_per_frame
        harmonics = torch.arange(1, cfg.nb_harmonics + 2, device=f0.device, dtype=f0.dtype)
        rad = torch.remainder(f0.unsqueeze(-1) * harmonics / cfg.sampling_rate, 1.0)
        # Accumulate in float64 with the carried value as the first addend, so a chunked run adds
        # the same numbers in the same order as a whole-utterance run (bit-identical phase; the
        # float32 phase reaches ~1e5 rad, where one ulp of drift is an audible difference).
        acc = torch.cumsum(torch.cat([phase_start.unsqueeze(1), rad.double()], dim=1), dim=1)[:, 1:]
        phase = acc.to(f0.dtype) * 2 * math.pi * spf
        sines = torch.sin(phase) * cfg.nsf_alpha
        uv = (f0 > cfg.nsf_voiced_threshold).to(f0.dtype).unsqueeze(-1)
        noise_amp = uv * cfg.nsf_sigma + (1 - uv) * cfg.nsf_alpha / 3
        frame_part = torch.repeat_interleave(sines * uv, spf, dim=1)
        waves = frame_part + torch.repeat_interleave(noise_amp, spf, dim=1) * noise
        return torch.tanh(self.l_linear(waves)).squeeze(-1), acc


# ----------------------------------------------------------------------------- noise table


def _noise_table_state(cfg: HiFTConfig) -> torch.Tensor:
    """CPU generator state at the first element of the official `SineGen2.sine_waves` table,
    replaying the official build's RNG draws after `set_all_random_seed(0)` (module docstring).
    Only the number of draws matters, so each module init is replayed on a same-sized tensor."""
    g = torch.Generator(device="cpu").manual_seed(0)
    torch.empty(_CFM_NOISE_NUMEL).normal_(generator=g)  # CFM rand_noise
    torch.empty(_FLOW_VOCAB, _FLOW_MEL_DIM).normal_(generator=g)  # flow input_embedding
    torch.empty(_FLOW_MEL_DIM, _FLOW_SPK_DIM).uniform_(generator=g)  # spk_embed_affine_layer.weight
    torch.empty(_FLOW_MEL_DIM).uniform_(generator=g)  # .bias
    c = cfg.f0_cond_channels
    shapes = [(c, cfg.in_channels, _F0_LOOKAHEAD + 1)] + [(c, c, 3)] * _F0_LEFT_LAYERS
    for shape in shapes:  # F0 predictor convs: weight, then bias
        torch.empty(shape).uniform_(generator=g)
        torch.empty(shape[0]).uniform_(generator=g)
    torch.empty(1, c).uniform_(generator=g)  # classifier.weight
    torch.empty(1).uniform_(generator=g)  # classifier.bias
    torch.empty(1, cfg.nb_harmonics + 1).uniform_(generator=g)  # SineGen2.rand_ini
    return g.get_state()


@dataclass(eq=False)
class _NoiseTable:
    """The first rows of the noise table on one device, and the CPU generator state after them."""

    rows: torch.Tensor  # [samples, harmonics + 1]
    end_state: torch.Tensor


def _hann_window(n: int) -> torch.Tensor:
    """Periodic Hann window computed like scipy's get_window('hann', n) in float64, then float32."""
    angle = np.linspace(-np.pi, np.pi, n + 1)[:-1]
    return torch.from_numpy((0.5 + 0.5 * np.cos(angle)).astype(np.float32))


def _dft_bases(n_fft: int, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The windowed one-sided DFT of n_fft points as two real matrices (float64 -> float32).

    analysis [n_fft, 2 * bins]: windowed frames @ analysis = [Re X_0..X_{n/2}, Im X_0..X_{n/2}]
    (torch.stft's bins, real then imaginary, as `_stft` lays them out).
    synthesis [2 * bins, n_fft]: [Re; Im] -> torch.fft.irfft(n=n_fft) times the window (the
    imaginary parts of the DC and Nyquist bins drop out, as irfft ignores them).

    Why not torch.stft / torch.fft.irfft: the vocoder's decode is replayed as a CUDA graph
    (`engine.vocoder_graphs`), and cuFFT plans live in an LRU cache that a captured graph
    never touches, so a busy eager path could evict a plan a graph still uses. At 16 points
    a matrix product is as cheap, and it needs no plan.
    """
    n = torch.arange(n_fft, dtype=torch.float64)
    k = torch.arange(n_fft // 2 + 1, dtype=torch.float64)
    angle = 2 * math.pi * n[:, None] * k[None, :] / n_fft  # [n, k]
    w = window.to(torch.float64)[:, None]
    analysis = torch.cat((w * torch.cos(angle), -w * torch.sin(angle)), dim=1)
    weight = torch.full((k.numel(),), 2.0, dtype=torch.float64)
    weight[0] = 1.0
    if n_fft % 2 == 0:
        weight[-1] = 1.0
    cos_part = (weight[:, None] * torch.cos(angle.T)) / n_fft  # [k, n]
    sin_part = -(weight[:, None] * torch.sin(angle.T)) / n_fft
    synthesis = torch.cat((cos_part, sin_part), dim=0) * window.to(torch.float64)[None, :]
    return analysis.float(), synthesis.float()


def held_back_frames(cfg: HiFTConfig) -> int:
    """Mel frames a stream step that does not finalize keeps back for the next one: the F0
    predictor's and conv_pre's look-ahead, and the frame whose iSTFT overlap is still
    incomplete. A final step decodes them with its own new frames."""
    return _F0_LOOKAHEAD + cfg.conv_pre_look_right + 1


def decoder_context_frames(cfg: HiFTConfig) -> int:
    """Mel frames of history that make the decoder's output for later frames exact.

    Conservative: sums the history of every causal op on the way from the output back to the
    mel / excitation input (the true dependency is the max over branches), converting each to mel
    frames at the rate where it runs, plus the STFT/iSTFT overlaps and one frame of rounding slack.
    """
    rates = np.cumprod(cfg.upsample_rates).tolist()  # frames per mel frame after each stage
    stft_rate = rates[-1]
    down_rates = np.cumprod([1] + list(cfg.upsample_rates[::-1][:-1]))[::-1].tolist()
    total = 2 * cfg.n_fft / cfg.hop_len / stft_rate  # STFT + iSTFT window overlap
    total += 6 / stft_rate + 1 / stft_rate  # conv_post, reflection pad
    for i, rate in enumerate(rates):
        res = max(CausalResBlock.history(k, d) for k, d in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes))
        src = CausalResBlock.history(cfg.source_resblock_kernel_sizes[i], cfg.source_resblock_dilation_sizes[i])
        total += (res + src + cfg.upsample_kernel_sizes[i]) / rate + 2 * down_rates[i] / stft_rate
    return int(math.ceil(total)) + 1


# ----------------------------------------------------------------------------- streaming state


@dataclass(eq=False)
class HiFTStream:
    """Per-utterance vocoder state. Holds tensors and a generator only (no module reference).

    Frame counters are absolute mel-frame indices within the utterance.
    """

    noise: torch.Generator  # positioned at sample max(table length, f0_done * samples_per_frame)
    phase: torch.Tensor  # [H] float64, accumulated phase after frame f0_done-1
    mel: torch.Tensor  # [80, k] mel frames [mel_start, received)
    source: torch.Tensor  # [k' * spf] excitation of frames [source_start, f0_done)
    mel_start: int = 0
    source_start: int = 0
    received: int = 0  # mel frames received
    f0_done: int = 0  # frames whose f0 and excitation are final
    emitted: int = 0  # frames whose audio has been returned
    finished: bool = False
    # Sizes of the last step's windows, for observing that per-step work stays bounded.
    last_f0_window: int = 0
    last_decode_window: int = 0


# ----------------------------------------------------------------------------- the generator


def reflect_first(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x with its second sample along `dim` prepended: F.pad(x, (1, 0), mode="reflect") on
    that dimension, which keeps a channels-last x channels-last (F.pad's reflection pads
    only the last dimensions of 2-D or 3-D inputs)."""
    return torch.cat((x.narrow(dim, 1, 1), x), dim=dim)


def hift_trunk(gen: nn.Module, x: torch.Tensor, s_stft: torch.Tensor,
               channels_last: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The HiFT body shared by the causal (CosyVoice3) and CosyVoice2 generators: each
    upsampling stage adds the excitation's STFT (through `source_downs` / `source_resblocks`),
    then averages its multi-kernel resblocks; `conv_post` gives log-magnitude and phase.

    `gen` needs `cfg`, `ups`, `source_downs`, `source_resblocks`, `resblocks`, `conv_post`;
    `x` is the output of its `conv_pre`. Returns (magnitude, phase) for the inverse STFT,
    [B, n_fft/2 + 1, frames] each.

    channels_last: `x` and `s_stft` are [B, C, 1, T] channels-last and every module runs its
    `forward_channels_last` (the causal generator's modules have one); the returned tensors
    are frame-major views. Otherwise [B, C, T] through the modules' `forward`.
    """
    cfg = gen.cfg
    n_kernels = len(cfg.resblock_kernel_sizes)
    time = x.dim() - 1

    def run(module: nn.Module, v: torch.Tensor) -> torch.Tensor:
        return module.forward_channels_last(v) if channels_last else module(v)

    for i, up in enumerate(gen.ups):
        x = run(up, F.leaky_relu(x, cfg.lrelu_slope))
        if i == len(gen.ups) - 1:
            # One extra leading sample so the last stage lines up with the STFT's n+1 frames.
            x = reflect_first(x, time)
        x = x + run(gen.source_resblocks[i], run(gen.source_downs[i], s_stft))
        xs = run(gen.resblocks[i * n_kernels], x)
        for j in range(1, n_kernels):
            xs = xs + run(gen.resblocks[i * n_kernels + j], x)
        x = xs / n_kernels
    x = run(gen.conv_post, F.leaky_relu(x))  # default 0.01 slope here, as in the official code
    half = cfg.n_fft // 2 + 1
    if channels_last:
        x = x.squeeze(2)
    return torch.exp(x[:, :half]), torch.sin(x[:, half:])


class CausalHiFTGenerator(nn.Module):
    def __init__(self, cfg: HiFTConfig, *, context_frames: int | None = None,
                 noise_table_seconds: float = NOISE_TABLE_SECONDS) -> None:
        super().__init__()
        self.cfg = cfg
        self.noise_table_samples = int(noise_table_seconds * cfg.sampling_rate)
        self._noise_table: _NoiseTable | None = None  # built on first use, on the module's device
        ch = cfg.base_channels
        n_stft = cfg.n_fft + 2  # real + imaginary bins
        self.m_source = NSFSource(cfg)
        self.conv_pre = weight_norm(LookaheadConv1d(cfg.in_channels, ch, cfg.conv_pre_look_right + 1))
        self.ups = nn.ModuleList(
            weight_norm(UpsampleConv1d(ch // 2**i, ch // 2 ** (i + 1), k, u))
            for i, (u, k) in enumerate(zip(cfg.upsample_rates, cfg.upsample_kernel_sizes))
        )
        # The excitation's STFT joins each stage after down-sampling to that stage's rate.
        down_rates = np.cumprod([1] + list(cfg.upsample_rates[::-1][:-1]))[::-1].tolist()
        self.source_downs = nn.ModuleList()
        self.source_resblocks = nn.ModuleList()
        for i, (u, k, d) in enumerate(
            zip(down_rates, cfg.source_resblock_kernel_sizes, cfg.source_resblock_dilation_sizes)
        ):
            cout = ch // 2 ** (i + 1)
            self.source_downs.append(LeftCausalConv1d(n_stft, cout, 1) if u == 1 else DownsampleConv1d(n_stft, cout, u))
            self.source_resblocks.append(CausalResBlock(cout, k, tuple(d)))
        self.resblocks = nn.ModuleList(
            CausalResBlock(ch // 2 ** (i + 1), k, tuple(d))
            for i in range(len(cfg.upsample_rates))
            for k, d in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes)
        )
        self.conv_post = weight_norm(LeftCausalConv1d(ch // 2 ** len(cfg.upsample_rates), n_stft, 7))
        self.f0_predictor = CausalF0Predictor(cfg.in_channels, cfg.f0_cond_channels)
        self.register_buffer("stft_window", _hann_window(cfg.n_fft), persistent=False)
        analysis, synthesis = _dft_bases(cfg.n_fft, self.stft_window)
        self.register_buffer("stft_analysis", analysis, persistent=False)
        self.register_buffer("stft_synthesis", synthesis, persistent=False)
        # Plain CPU tensors (not buffers): generator states must stay on the CPU.
        self.noise_state = _noise_table_state(cfg)
        self.context_frames = decoder_context_frames(cfg) if context_frames is None else context_frames
        # The decode's layout (see "conv building blocks"); the same audio up to the
        # convolutions' rounding. Set before CUDA graphs are captured: they keep it.
        self.channels_last = False

    # ------------------------------------------------------------------ setup helpers

    def fold_weight_norm(self) -> None:
        """Replace every weight-norm parametrization by its current plain weight (inference)."""
        for module in self.modules():
            if parametrize.is_parametrized(module, "weight"):
                parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)

    def _prepare_f0_predictor(self) -> None:
        # Same as the official inference(): the F0 net lives in float64 from the first call on.
        if self.f0_predictor.classifier.weight.dtype != torch.float64:
            self.f0_predictor.to(torch.float64)

    @property
    def _dtype(self) -> torch.dtype:
        return self.m_source.l_linear.weight.dtype

    @property
    def _device(self) -> torch.device:
        return self.m_source.l_linear.weight.device

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001, ANN202
        self._noise_table = None  # `.to()` & co: rebuilt on the new device or dtype when used
        return super()._apply(fn, recurse)

    def build_noise_table(self) -> None:
        """Build the device noise table now (about 0.1 s of CPU draws and a 52 MB upload),
        not on the first stream."""
        self._table()

    def _table(self) -> _NoiseTable:
        t = self._noise_table
        if t is None or t.rows.device != self._device or t.rows.dtype != self._dtype:
            gen = torch.Generator(device="cpu")
            gen.set_state(self.noise_state)
            rows = torch.rand(self.noise_table_samples, self.cfg.nb_harmonics + 1, generator=gen)
            t = self._noise_table = _NoiseTable(rows.to(device=self._device, dtype=self._dtype), gen.get_state())
        return t

    def _noise(self, gen: torch.Generator, start_frame: int, frames: int) -> torch.Tensor:
        """Noise rows of frames [start_frame, start_frame + frames) of one stream; `gen` is
        that stream's generator, positioned past the device table (draws happen in order)."""
        spf, table = self.cfg.samples_per_frame, self._table().rows
        lo, hi = start_frame * spf, (start_frame + frames) * spf
        n_table = table.shape[0]
        if hi <= n_table:
            return table[lo:hi]
        tail = torch.rand(hi - max(lo, n_table), self.cfg.nb_harmonics + 1, generator=gen)
        tail = to_device(tail, self._device, self._dtype)
        return torch.cat([table[lo:], tail]) if lo < n_table else tail

    def _generator(self) -> torch.Generator:
        """A stream's generator: at the end of the device table."""
        gen = torch.Generator(device="cpu")
        gen.set_state(self._table().end_state)
        return gen

    # ------------------------------------------------------------------ network pieces

    def _predict_f0(self, mel: torch.Tensor) -> torch.Tensor:
        """mel [B, 80, W + 3] (3 look-ahead frames included) -> f0 [B, W] in the model dtype."""
        self._prepare_f0_predictor()
        return self.f0_predictor(mel.to(torch.float64)).to(self._dtype)

    def _stft(self, s_padded: torch.Tensor, frames: int) -> torch.Tensor:
        """s_padded [B, S]: excitation with its centre padding already applied per utterance.
        Returns [B, 2 * bins, frames], a frame-major view ([B, 2 * bins, 1, frames] channels-last
        is one more view of it)."""
        n_fft, hop = self.cfg.n_fft, self.cfg.hop_len
        need = n_fft + hop * (frames - 1)
        if s_padded.shape[1] < need:
            s_padded = F.pad(s_padded, (0, need - s_padded.shape[1]))
        # torch.stft(center=False, window=hann) as a matrix product (see _dft_bases):
        # [B, frames, n_fft] windows -> [B, 2 * bins, frames], real parts then imaginary.
        windows = s_padded[:, :need].unfold(1, n_fft, hop)
        return (windows @ self.stft_analysis.to(windows.dtype)).transpose(1, 2)

    def _istft(self, magnitude: torch.Tensor, phase: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Inverse STFT (centre-trimmed, like torch.istft(center=True)) where utterance b only uses
        its first valid[b] frames: a batch of right-padded windows must not let one utterance's
        padding leak into another's last samples through the overlap-add."""
        n_fft, hop = self.cfg.n_fft, self.cfg.hop_len
        frames = magnitude.shape[2]
        magnitude = magnitude.clamp(max=1e2)
        spec = torch.cat((magnitude * torch.cos(phase), magnitude * torch.sin(phase)), dim=1)  # [B, 2 bins, F]
        keep = (torch.arange(frames, device=valid.device)[None, :] < valid[:, None]).to(magnitude.dtype)
        window = self.stft_window.to(magnitude.dtype)
        # torch.fft.irfft(n=n_fft) times the window, as a matrix product (see _dft_bases).
        chunks = (self.stft_synthesis.to(spec.dtype).T @ spec) * keep[:, None, :]
        length = n_fft + hop * (frames - 1)
        fold = dict(output_size=(1, length), kernel_size=(1, n_fft), stride=(1, hop))
        wav = F.fold(chunks, **fold).reshape(chunks.shape[0], length)
        env = F.fold((window**2)[None, :, None] * keep[:, None, :], **fold).reshape(chunks.shape[0], length)
        wav = torch.where(env > 1e-11, wav / env.clamp(min=1e-11), torch.zeros_like(wav))
        return wav[:, n_fft // 2 : n_fft // 2 + hop * (frames - 1)]

    def _decode(self, mel: torch.Tensor, s_padded: torch.Tensor, valid_frames: torch.Tensor) -> torch.Tensor:
        """mel [B, 80, N + look_right] (look-ahead included), s_padded [B, >= spf*N + n_fft] the
        centre-padded excitation, valid_frames [B] STFT frames that belong to item b (the rest is
        batch padding and is kept out of its inverse STFT). Returns [B, spf*N] audio; which of it
        is final is the caller's business (see `inference` and `_advance_audio`)."""
        cfg = self.cfg
        n_frames = mel.shape[2] - cfg.conv_pre_look_right
        stft_per_frame = cfg.samples_per_frame // cfg.hop_len
        s_stft = self._stft(s_padded, stft_per_frame * n_frames + 1)
        if self.channels_last:
            mel = mel.unsqueeze(2).contiguous(memory_format=torch.channels_last)
            x = self.conv_pre.forward_channels_last(mel)
            s_stft = s_stft.unsqueeze(2)  # channels-last already (see _stft)
        else:
            x = self.conv_pre(mel)
        magnitude, phase = hift_trunk(self, x, s_stft, self.channels_last)
        wav = self._istft(magnitude, phase, valid_frames)
        return wav.clamp(-cfg.audio_limit, cfg.audio_limit)

    def _centre_pad(self, s: torch.Tensor) -> torch.Tensor:
        """Reflect-pad n_fft/2 on both sides of one utterance's excitation (torch.stft center=True)."""
        p = self.cfg.n_fft // 2
        return F.pad(s[None, None], (p, p), mode="reflect")[0, 0]

    # ------------------------------------------------------------------ whole utterance

    @torch.inference_mode()
    def inference(self, mel: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        """mel [B, 80, T] -> audio [B, samples]; official CausalHiFTGenerator.inference semantics.

        finalize=True: T*480 samples; the look-ahead convs see zeros past the end.
        finalize=False: the last 3 frames only serve as F0 look-ahead, the 4 before them only as
        conv_pre look-ahead, and the last 480 samples of what remains are dropped (their iSTFT
        overlap is incomplete): (T-8)*480 samples, identical to the start of a later call.
        """
        cfg = self.cfg
        mel = mel.to(device=self._device, dtype=self._dtype)
        b, _, t = mel.shape
        spf, look = cfg.samples_per_frame, cfg.conv_pre_look_right
        if finalize:
            n_f0, n_net, n_out = t, t, t
        else:
            n_f0, n_net, n_out = t - _F0_LOOKAHEAD, t - _F0_LOOKAHEAD - look, t - _F0_LOOKAHEAD - look - 1
        if n_out <= 0:
            return mel.new_zeros(b, 0)
        f0 = self._predict_f0(F.pad(mel, (0, _F0_LOOKAHEAD)) if finalize else mel)
        phase0 = torch.zeros(b, cfg.nb_harmonics + 1, dtype=torch.float64, device=mel.device)
        s, _ = self.m_source(f0, phase0, self._noise(self._generator(), 0, n_f0).unsqueeze(0))
        s_padded = torch.stack([self._centre_pad(row) for row in s])
        mel_in = F.pad(mel, (0, look)) if finalize else mel[:, :, : n_net + look]
        valid = torch.full((b,), (spf // cfg.hop_len) * n_net + 1, device=mel.device)
        return self._decode(mel_in, s_padded, valid)[:, : n_out * spf]

    # ------------------------------------------------------------------ streaming

    def new_stream(self) -> HiFTStream:
        return HiFTStream(
            noise=self._generator(),
            phase=torch.zeros(self.cfg.nb_harmonics + 1, dtype=torch.float64, device=self._device),
            mel=torch.zeros(self.cfg.in_channels, 0, dtype=self._dtype, device=self._device),
            source=torch.zeros(0, dtype=self._dtype, device=self._device),
        )

    @torch.inference_mode()
    def stream_step(
        self, streams: list[HiFTStream], new_mels: list[torch.Tensor], finalize: list[bool],
        decode: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """Feed new mel frames ([80, n_i], n_i may be 0) to each stream; return each stream's newly
        final samples (1-D). Non-final steps release exactly what the official non-final
        `inference` over all mel so far would add; the finalizing step releases the rest.
        All streams are computed as one batch per stage (right-padded windows). `decode`
        stands in for `_decode` (same contract; e.g. `engine.vocoder_graphs`)."""
        if not (len(streams) == len(new_mels) == len(finalize)):
            raise ValueError("streams, new_mels and finalize must have the same length")
        cfg = self.cfg
        for st, m in zip(streams, new_mels):
            if st.finished:
                raise RuntimeError("stream already finalized")
            if m.dim() != 2 or m.shape[0] != cfg.in_channels:
                raise ValueError(f"new mel must be [{cfg.in_channels}, n], got {tuple(m.shape)}")
            if m.device != self._device or m.dtype != self._dtype:
                m = m.to(device=self._device, dtype=self._dtype)
            st.mel = torch.cat([st.mel, m], dim=1)
            st.received += m.shape[1]

        # Stage 1+2: f0 and excitation for the frames whose f0 became final.
        f0_targets = [
            st.received if fin else max(st.f0_done, st.received - _F0_LOOKAHEAD) for st, fin in zip(streams, finalize)
        ]
        todo = [i for i, st in enumerate(streams) if f0_targets[i] > st.f0_done]
        if todo:
            self._advance_source([streams[i] for i in todo], [f0_targets[i] for i in todo])

        # Stage 3: decode a window of [context + new] frames per stream.
        held = held_back_frames(self.cfg)
        targets = [st.received if fin else max(st.emitted, st.received - held) for st, fin in zip(streams, finalize)]
        todo = [i for i, st in enumerate(streams) if targets[i] > st.emitted]
        # Streams with nothing new share one empty tensor: at 64 streams every operator
        # call counts (each one gives up the interpreter lock; round 17 of docs/benchmarks.md).
        nothing = torch.zeros(0, dtype=self._dtype, device=self._device) if len(todo) < len(streams) else None
        out = [nothing for _ in streams]
        if todo:
            pieces = self._advance_audio([streams[i] for i in todo], [targets[i] for i in todo],
                                         [finalize[i] for i in todo], decode or self._decode)
            for i, piece in zip(todo, pieces):
                out[i] = piece

        for st, fin in zip(streams, finalize):
            st.finished = fin
            self._trim(st)
        return out  # type: ignore[return-value]  # every None was replaced by a piece

    def _advance_source(self, streams: list[HiFTStream], targets: list[int]) -> None:
        spf = self.cfg.samples_per_frame
        hist = 2 * _F0_LEFT_LAYERS  # frames of history the F0 net's left-causal convs need
        starts = [max(0, st.f0_done - hist) for st in streams]
        win_len = [st.mel.shape[1] - (s0 - st.mel_start) for st, s0 in zip(streams, starts)]
        # Zero right-padding = the official finalize look-ahead; non-final streams never use
        # outputs that reach into it. Gathered for all streams at once (`_advance_audio`).
        batch = ragged_rows([st.mel for st in streams], [s0 - st.mel_start for st, s0 in zip(streams, starts)],
                             win_len, max(win_len) + _F0_LOOKAHEAD)
        f0_all = self._predict_f0(batch)
        new_counts = [t - st.f0_done for st, t in zip(streams, targets)]
        n_max = max(new_counts)
        f0 = row_windows(f0_all, [st.f0_done - s0 for st, s0 in zip(streams, starts)], new_counts, n_max)
        noise = self._batch_noise(streams, new_counts, n_max)
        phase0 = torch.stack([st.phase for st in streams])
        s, acc = self.m_source(f0, phase0, noise)
        news = row_ranges(s, [0] * len(streams), [n * spf for n in new_counts])
        # Views of this step's own (small) accumulated phase, one indexing for all streams.
        last = tensor_on([n - 1 for n in new_counts], torch.long, acc.device)
        phases = acc[torch.arange(len(streams), device=acc.device), last].unbind(0)
        for b, (st, t) in enumerate(zip(streams, targets)):
            st.source = torch.cat([st.source, news[b]])
            st.phase = phases[b]
            st.f0_done = t
            st.last_f0_window = win_len[b]

    def _batch_noise(self, streams: list[HiFTStream], counts: list[int], n_max: int) -> torch.Tensor:
        """[B, n_max * spf, H + 1]: each stream's noise rows of its next `counts[b]` frames
        (`_noise`), zero-padded; rows inside the device table are gathered for all streams
        at once, a stream that reaches past it draws its own."""
        spf, table = self.cfg.samples_per_frame, self._table().rows
        if len(streams) < ragged.GATHER_MIN_ROWS:
            return torch.stack([F.pad(self._noise(st.noise, st.f0_done, c), (0, 0, 0, (n_max - c) * spf))
                                for st, c in zip(streams, counts)])
        n_table = table.shape[0]
        lo = [st.f0_done * spf for st in streams]
        device = table.device
        first = tensor_on(lo, torch.long, device)[:, None]
        n = tensor_on([c * spf for c in counts], torch.long, device)[:, None]
        pos = torch.arange(n_max * spf, device=device)
        inside = pos < n
        rows = table[(first + pos).clamp(max=n_table - 1)]
        noise = torch.where(inside[..., None], rows, torch.zeros((), dtype=rows.dtype, device=device))
        for b, (st, c) in enumerate(zip(streams, counts)):
            if lo[b] + c * spf > n_table:  # past the table: the stream's generator, in order
                noise[b, : c * spf] = self._noise(st.noise, st.f0_done, c)
        return noise

    def _advance_audio(self, streams: list[HiFTStream], targets: list[int], finalize: list[bool],
                       decode: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
        cfg = self.cfg
        spf, look = cfg.samples_per_frame, cfg.conv_pre_look_right
        stft_per_frame = spf // cfg.hop_len
        starts = [max(0, st.emitted - self.context_frames) for st in streams]
        # Network frames per window: final windows run to the end (zero look-ahead); non-final
        # ones compute one frame more than they release (its iSTFT overlap is still incomplete).
        n_net = [st.received - s0 if fin else t + 1 - s0 for st, s0, t, fin in zip(streams, starts, targets, finalize)]
        n_max = max(n_net)
        # Each stream's window, right-padded with zeros, gathered for all streams at once
        # (a few operators per batch instead of ~12 per stream: each one gives up the
        # interpreter lock, round 17 of docs/benchmarks.md). The excitation is reflect-
        # padded by n_fft/2 on both sides first (torch.stft's center=True, `_centre_pad`).
        mel_len = [n + (0 if fin else look) for n, fin in zip(n_net, finalize)]
        mels = ragged_rows([st.mel for st in streams], [s0 - st.mel_start for st, s0 in zip(streams, starts)],
                            mel_len, n_max + look)
        src_len = [(st.f0_done - s0) * spf for st, s0 in zip(streams, starts)]
        pad = cfg.n_fft // 2
        s_padded = ragged_rows([st.source for st in streams],
                                [(s0 - st.source_start) * spf for st, s0 in zip(streams, starts)],
                                src_len, max(src_len) + 2 * pad, reflect=pad)
        # Queued, not waited for: the host would otherwise stop here until the whole flow
        # batch ran, and launch the vocoder with the GPU idle.
        valid = tensor_on([stft_per_frame * n + 1 for n in n_net], torch.long, self._device)
        wav = decode(mels, s_padded, valid)
        # Views of this step's own output (the caller copies them out at once), all from one split.
        pieces = row_ranges(wav, [(st.emitted - s0) * spf for st, s0 in zip(streams, starts)],
                             [(t - st.emitted) * spf for st, t in zip(streams, targets)])
        for b, (st, t) in enumerate(zip(streams, targets)):
            st.emitted = t
            st.last_decode_window = n_net[b] + look
        return pieces

    def _trim(self, st: HiFTStream) -> None:
        """Drop mel / excitation no future step can need (bounded memory and per-step work).
        Views, not copies: the next step's concatenation copies what they keep, and until
        then each holds at most the one tensor the last step made."""
        spf = self.cfg.samples_per_frame
        keep_src = max(0, st.emitted - self.context_frames)
        keep_mel = max(0, min(keep_src, st.f0_done - 2 * _F0_LEFT_LAYERS))
        if keep_mel > st.mel_start:
            st.mel = st.mel[:, keep_mel - st.mel_start :]
            st.mel_start = keep_mel
        if keep_src > st.source_start:
            st.source = st.source[(keep_src - st.source_start) * spf :]
            st.source_start = keep_src


# ----------------------------------------------------------------------------- random weights


@torch.no_grad()
def init_random_(module: CausalHiFTGenerator, seed: int) -> CausalHiFTGenerator:
    """Deterministic random weights that give finite, non-trivial, mostly unclipped audio."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def normal(shape: torch.Size, std: float) -> torch.Tensor:
        return torch.randn(shape, generator=g) * std

    for name, mod in module.named_modules():
        if isinstance(mod, nn.Conv1d):
            w_shape = mod.parametrizations.weight.original1.shape if parametrize.is_parametrized(mod, "weight") else mod.weight.shape
            fan_in = w_shape[1] * w_shape[2]
            w = normal(w_shape, 0.5 / math.sqrt(fan_in))
            bias = normal(mod.bias.shape, 0.02)
            if name == "conv_post":
                w = w * 0.5
                half = module.cfg.n_fft // 2 + 1
                bias[:half] += 0.5  # speech-like level (rms ~0.05), far below the 1e2 clip
            if parametrize.is_parametrized(mod, "weight"):
                p = mod.parametrizations.weight
                p.original1.copy_(w)
                p.original0.copy_(w.flatten(1).norm(dim=1).reshape(p.original0.shape))
            else:
                mod.weight.copy_(w)
            mod.bias.copy_(bias)
        elif isinstance(mod, Snake):
            mod.alpha.copy_(1.0 + normal(mod.alpha.shape, 0.1))
    clf = module.f0_predictor.classifier
    clf.weight.copy_(normal(clf.weight.shape, 20.0 / math.sqrt(clf.weight.shape[1])))
    clf.bias.fill_(180.0)  # voiced f0 around 180 Hz, varying with the mel
    lin = module.m_source.l_linear
    lin.weight.copy_(normal(lin.weight.shape, 1.0))
    lin.bias.zero_()
    return module
