"""CosyVoice2 vocoder: the non-causal `HiFTGenerator` and its official streaming scheme.

Mel (80 x 50 Hz) -> 24 kHz audio, 480 samples per frame, like CosyVoice3's causal HiFT
(`engine.models.hift`, whose Snake activation, Hann window and random init we reuse), but
every conv is centred ("same" padding), upsampling uses transposed convs, and:

* F0: `ConvRNNF0Predictor`, five k=3 convs with ELU, then a linear classifier, |.|.
* Source (official SineGen2, non-causal branch): per-frame phase increments of 9
  harmonics, accumulated per frame, then *linearly* interpolated to samples (so the last
  half of a frame already bends towards the next frame's pitch), sin, times 0.1 where
  voiced; plus Gaussian noise; merged by `m_source.l_linear` + tanh. The official random
  initial phase never reaches the output (the linear down-sampling reads only samples
  480i + 239/240) and is left out. The noise comes from a per-stream generator on the
  vocoder's device (the official one draws from the global RNG), so a given stream is
  reproducible on a given device type (CPU and CUDA generators differ).
* Decoder: conv_pre, 3 x (leaky ReLU, transposed conv, + STFT-of-source branch, mean of 3
  resblocks), conv_post, exp/sin -> inverse STFT (n_fft 16, hop 4), clamp to 0.99.

Streaming (official CosyVoice2Model.token2wav). The vocoder cannot continue a previous
call exactly, so each step re-runs it on [last 8 mel frames of the previous step + new
frames]; the first 8*480 samples of the excitation are replaced by the previous step's
last 8*480 (phase continuity), the first 8*480 output samples are cross-faded with the
previous step's held-back tail through a Hamming window (rising half for the new audio,
falling half for the old), and the last 8*480 samples are held back for the next step.
Streaming output therefore differs from a whole-utterance run *by design* (inside every
cross-fade), while the total length is the same: 480 samples per mel frame.

Parameter names equal the official `hift.pt` (weight norm via torch parametrizations).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

from .config import HiFTConfig
from .hift import Snake, _hann_window, hift_trunk
from .hift import init_random_ as _init_causal_hift_like

F0_LAYERS = 5
MEL_CACHE_FRAMES = 8  # official CosyVoice2Model.mel_cache_len
DEFAULT_NOISE_SEED = 0


def _same_padding(kernel: int, dilation: int = 1) -> int:
    return (kernel * dilation - dilation) // 2


class ResBlock(nn.Module):
    """Three residual units: snake -> dilated conv -> snake -> conv (centred convs)."""

    def __init__(self, channels: int, kernel: int, dilations: tuple[int, ...]) -> None:
        super().__init__()
        self.convs1 = nn.ModuleList(
            weight_norm(nn.Conv1d(channels, channels, kernel, dilation=d, padding=_same_padding(kernel, d)))
            for d in dilations
        )
        self.convs2 = nn.ModuleList(
            weight_norm(nn.Conv1d(channels, channels, kernel, padding=_same_padding(kernel))) for _ in dilations
        )
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for act1, conv1, act2, conv2 in zip(self.activations1, self.convs1, self.activations2, self.convs2):
            x = conv2(act2(conv1(act1(x)))) + x
        return x


class ConvRNNF0Predictor(nn.Module):
    """Mel [B, 80, T] -> f0 [B, T] in Hz (non-negative)."""

    def __init__(self, in_channels: int, channels: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(F0_LAYERS):
            layers += [weight_norm(nn.Conv1d(in_channels if i == 0 else channels, channels, 3, padding=1)), nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(channels, 1)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.condnet(mel).transpose(1, 2)).squeeze(-1).abs()


class SourceModuleHnNSF(nn.Module):
    """Harmonic-plus-noise excitation of the non-causal HiFT (official SineGen2, causal=False)."""

    def __init__(self, cfg: HiFTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.l_linear = nn.Linear(cfg.nb_harmonics + 1, 1)

    def forward(self, f0: torch.Tensor, noise: torch.Generator) -> torch.Tensor:
        """f0 [B, T] (Hz) -> excitation [B, T * samples_per_frame]."""
        cfg = self.cfg
        spf = cfg.samples_per_frame
        harmonics = torch.arange(1, cfg.nb_harmonics + 2, device=f0.device, dtype=f0.dtype)
        # Per-frame increments equal the official per-sample ones down-sampled (the linear
        # down-sampling averages two equal samples of the same frame).
        rad = torch.remainder(f0[:, :, None] * harmonics / cfg.sampling_rate, 1.0)  # [B, T, H]
        phase = torch.cumsum(rad, dim=1) * 2 * math.pi
        phase = F.interpolate(phase.transpose(1, 2) * spf, scale_factor=float(spf), mode="linear")
        sines = torch.sin(phase.transpose(1, 2)) * cfg.nsf_alpha  # [B, T*spf, H]
        uv = torch.repeat_interleave((f0 > cfg.nsf_voiced_threshold).to(f0.dtype), spf, dim=1)[:, :, None]
        noise_amp = uv * cfg.nsf_sigma + (1 - uv) * cfg.nsf_alpha / 3
        # Drawn where the generator lives (the vocoder's device, `new_stream`): a CPU draw
        # and its pageable copy would make the host wait for the GPU's queued flow batch.
        gauss = torch.randn(sines.shape, generator=noise, dtype=torch.float32, device=noise.device)
        gauss = gauss.to(device=f0.device, dtype=f0.dtype)
        waves = sines * uv + noise_amp * gauss
        return torch.tanh(self.l_linear(waves)).squeeze(-1)


@dataclass(eq=False)
class CV2HiFTStream:
    """Per-utterance vocoder state: the official mel / source / speech caches plus the
    mel received since the last vocoder run. Holds tensors and a generator only."""

    noise: torch.Generator
    mel: torch.Tensor  # [80, k]: last run's 8 held-back frames + frames received since
    cache_source: torch.Tensor | None = None  # [8 * 480] excitation of those 8 frames
    cache_speech: torch.Tensor | None = None  # [8 * 480] held-back audio, faded out next run
    received: int = 0
    emitted_samples: int = 0
    finished: bool = False
    runs: list[int] = field(default_factory=list)  # mel frames per vocoder run (observability)


class HiFTGenerator(nn.Module):
    def __init__(self, cfg: HiFTConfig, *, noise_seed: int = DEFAULT_NOISE_SEED) -> None:
        super().__init__()
        self.cfg = cfg
        self.noise_seed = noise_seed
        ch = cfg.base_channels
        n_stft = cfg.n_fft + 2
        self.m_source = SourceModuleHnNSF(cfg)
        self.conv_pre = weight_norm(nn.Conv1d(cfg.in_channels, ch, 7, padding=3))
        self.ups = nn.ModuleList(
            weight_norm(nn.ConvTranspose1d(ch // 2**i, ch // 2 ** (i + 1), k, u, padding=(k - u) // 2))
            for i, (u, k) in enumerate(zip(cfg.upsample_rates, cfg.upsample_kernel_sizes))
        )
        down_rates = np.cumprod([1] + list(cfg.upsample_rates[::-1][:-1]))[::-1].tolist()
        self.source_downs = nn.ModuleList()
        self.source_resblocks = nn.ModuleList()
        for i, (u, k, d) in enumerate(zip(down_rates, cfg.source_resblock_kernel_sizes, cfg.source_resblock_dilation_sizes)):
            cout = ch // 2 ** (i + 1)
            conv = nn.Conv1d(n_stft, cout, 1) if u == 1 else nn.Conv1d(n_stft, cout, 2 * u, u, padding=u // 2)
            self.source_downs.append(conv)
            self.source_resblocks.append(ResBlock(cout, k, tuple(d)))
        self.resblocks = nn.ModuleList(
            ResBlock(ch // 2 ** (i + 1), k, tuple(d))
            for i in range(len(cfg.upsample_rates))
            for k, d in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes)
        )
        self.conv_post = weight_norm(nn.Conv1d(ch // 2 ** len(cfg.upsample_rates), n_stft, 7, padding=3))
        self.f0_predictor = ConvRNNF0Predictor(cfg.in_channels, cfg.f0_cond_channels)
        self.register_buffer("stft_window", _hann_window(cfg.n_fft), persistent=False)
        hold = MEL_CACHE_FRAMES * cfg.samples_per_frame
        # Official fade window: np.hamming(2 * hold); first half fades in, second fades out.
        self.register_buffer("fade_window", torch.from_numpy(np.hamming(2 * hold)).float(), persistent=False)

    # ------------------------------------------------------------------ setup helpers

    def fold_weight_norm(self) -> None:
        """Replace every weight-norm parametrization by its current plain weight (inference)."""
        for module in self.modules():
            if parametrize.is_parametrized(module, "weight"):
                parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)

    @property
    def _dtype(self) -> torch.dtype:
        return self.m_source.l_linear.weight.dtype

    @property
    def _device(self) -> torch.device:
        return self.m_source.l_linear.weight.device

    # ------------------------------------------------------------------ network

    def _stft(self, x: torch.Tensor) -> torch.Tensor:
        n_fft, hop = self.cfg.n_fft, self.cfg.hop_len
        spec = torch.stft(x, n_fft, hop, n_fft, window=self.stft_window.to(x.dtype), return_complex=True)
        spec = torch.view_as_real(spec)
        return torch.cat([spec[..., 0], spec[..., 1]], dim=1)

    def _istft(self, magnitude: torch.Tensor, phase: torch.Tensor) -> torch.Tensor:
        n_fft, hop = self.cfg.n_fft, self.cfg.hop_len
        magnitude = magnitude.clamp(max=1e2)
        spec = torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
        return torch.istft(spec, n_fft, hop, n_fft, window=self.stft_window.to(magnitude.dtype))

    def decode(self, mel: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """mel [B, 80, T], source [B, T * 480] -> audio [B, T * 480]."""
        cfg = self.cfg
        s_stft = self._stft(source)
        magnitude, phase = hift_trunk(self, self.conv_pre(mel), s_stft)
        wav = self._istft(magnitude, phase)
        return wav.clamp(-cfg.audio_limit, cfg.audio_limit)

    @torch.inference_mode()
    def inference(
        self,
        mel: torch.Tensor,
        cache_source: torch.Tensor | None = None,
        noise: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Official `HiFTGenerator.inference`: mel [B, 80, T] -> (audio [B, T*480],
        excitation [B, T*480]); `cache_source` [B, S] overrides the first S samples of the
        excitation. `noise` defaults to a generator seeded with `noise_seed`."""
        mel = mel.to(device=self._device, dtype=self._dtype)
        if noise is None:
            noise = torch.Generator(device=self._device).manual_seed(self.noise_seed)
        f0 = self.f0_predictor(mel)
        source = self.m_source(f0, noise)
        if cache_source is not None and cache_source.shape[-1] > 0:
            source = source.clone()
            source[:, : cache_source.shape[-1]] = cache_source.to(source)
        return self.decode(mel, source), source

    # ------------------------------------------------------------------ streaming

    def new_stream(self) -> CV2HiFTStream:
        return CV2HiFTStream(
            noise=torch.Generator(device=self._device).manual_seed(self.noise_seed),
            mel=torch.zeros(self.cfg.in_channels, 0, dtype=self._dtype, device=self._device),
        )

    @torch.inference_mode()
    def stream_step(
        self, streams: list[CV2HiFTStream], new_mels: list[torch.Tensor], finalize: list[bool]
    ) -> list[torch.Tensor]:
        """Feed new mel frames ([80, n_i]) to each stream; return each stream's new audio (1-D).

        Streams run one by one: the non-causal network's output near the right edge depends on
        how far the input goes, so right-padding streams into one batch would change it.
        """
        if not (len(streams) == len(new_mels) == len(finalize)):
            raise ValueError("streams, new_mels and finalize must have the same length")
        return [self._step_one(st, m, fin) for st, m, fin in zip(streams, new_mels, finalize)]

    def _step_one(self, st: CV2HiFTStream, new_mel: torch.Tensor, finalize: bool) -> torch.Tensor:
        cfg = self.cfg
        if st.finished:
            raise RuntimeError("stream already finalized")
        if new_mel.dim() != 2 or new_mel.shape[0] != cfg.in_channels:
            raise ValueError(f"new mel must be [{cfg.in_channels}, n], got {tuple(new_mel.shape)}")
        st.mel = torch.cat([st.mel, new_mel.to(device=self._device, dtype=self._dtype)], dim=1)
        st.received += new_mel.shape[1]
        st.finished = finalize
        empty = torch.zeros(0, dtype=self._dtype, device=self._device)
        frames = st.mel.shape[1]
        # A non-final run must leave something to release after holding 8 frames back.
        if frames == 0 or (not finalize and frames <= MEL_CACHE_FRAMES):
            return empty
        wav, source = self.inference(st.mel[None], None if st.cache_source is None else st.cache_source[None], st.noise)
        wav, source = wav[0], source[0]
        st.runs.append(frames)
        hold = MEL_CACHE_FRAMES * cfg.samples_per_frame
        if st.cache_speech is not None:
            window = self.fade_window.to(wav)
            n = st.cache_speech.shape[0]
            wav = wav.clone()
            wav[:n] = wav[:n] * window[:n] + st.cache_speech * window[2 * hold - n :]
        if finalize:
            out = wav
            st.mel = st.mel[:, :0]
            st.cache_source = st.cache_speech = None
        else:
            out = wav[:-hold]
            st.mel = st.mel[:, -MEL_CACHE_FRAMES:].clone()
            st.cache_source = source[-hold:].clone()
            st.cache_speech = wav[-hold:].clone()
        st.emitted_samples += out.shape[0]
        return out


@torch.no_grad()
def init_random_(module: HiFTGenerator, seed: int) -> HiFTGenerator:
    """Deterministic random weights giving finite, speech-level audio: the causal HiFT's
    recipe (convs, Snake, F0 classifier around 180 Hz, source mixer) plus the transposed
    convs, which that recipe does not know."""
    _init_causal_hift_like(module, seed)  # type: ignore[arg-type]
    g = torch.Generator(device="cpu").manual_seed(seed + 7919)
    for up in module.ups:
        p = up.parametrizations.weight
        v_shape = p.original1.shape  # [in, out, k]
        fan_in = v_shape[0] * v_shape[2] / up.stride[0]
        v = torch.randn(v_shape, generator=g) * (0.5 / math.sqrt(fan_in))
        p.original1.copy_(v)
        p.original0.copy_(v.flatten(1).norm(dim=1).reshape(p.original0.shape))
        up.bias.copy_(torch.randn(up.bias.shape, generator=g) * 0.02)
    return module


__all__ = ["CV2HiFTStream", "HiFTGenerator", "init_random_"]
