"""Audio features of the CosyVoice3 frontend, in plain torch (no torchaudio, no librosa).

* `whisper_log_mel`: Whisper's `log_mel_spectrogram(n_mels=128)`, input of the speech
  tokenizer (16 kHz, 100 frames/s).
* `kaldi_fbank`: `torchaudio.compliance.kaldi.fbank` with the defaults the official
  frontend uses (80 bins, dither 0), then mean normalisation; input of CAM++.
* `prompt_mel`: Matcha-TTS `mel_spectrogram` with the CosyVoice3 `feat_extractor`
  parameters (24 kHz, 50 frames/s, fmax None -> Nyquist); the flow's prompt features.
* `resample`: the official frontend's (torchaudio's) windowed-sinc resampling.

Filterbanks are pure functions of their parameters and cached per process
(`functools.lru_cache` is thread-safe for this use; the arrays are never mutated,
callers get torch tensors built from them).
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F

from engine.models.config import MelConfig

WHISPER_SAMPLE_RATE = 16000
WHISPER_N_FFT = 400
WHISPER_HOP = 160

KALDI_SAMPLE_RATE = 16000
KALDI_FRAME_LENGTH = 400  # 25 ms at 16 kHz
KALDI_FRAME_SHIFT = 160  # 10 ms
KALDI_PREEMPHASIS = 0.97
KALDI_LOW_FREQ = 20.0
KALDI_EPSILON = float(torch.finfo(torch.float32).eps)


# --- Slaney mel scale (librosa htk=False) ----------------------------------------------

_SLANEY_F_SP = 200.0 / 3.0  # Hz per mel in the linear part
_SLANEY_MIN_LOG_HZ = 1000.0
_SLANEY_MIN_LOG_MEL = _SLANEY_MIN_LOG_HZ / _SLANEY_F_SP  # 15 mels
_SLANEY_LOGSTEP = math.log(6.4) / 27.0


def hz_to_mel_slaney(freq: np.ndarray) -> np.ndarray:
    """Linear below 1 kHz, logarithmic above (Slaney's Auditory Toolbox)."""
    freq = np.asarray(freq, dtype=np.float64)
    linear = freq / _SLANEY_F_SP
    log_part = _SLANEY_MIN_LOG_MEL + np.log(np.maximum(freq, 1e-10) / _SLANEY_MIN_LOG_HZ) / _SLANEY_LOGSTEP
    return np.where(freq >= _SLANEY_MIN_LOG_HZ, log_part, linear)


def mel_to_hz_slaney(mels: np.ndarray) -> np.ndarray:
    mels = np.asarray(mels, dtype=np.float64)
    linear = mels * _SLANEY_F_SP
    log_part = _SLANEY_MIN_LOG_HZ * np.exp(_SLANEY_LOGSTEP * (mels - _SLANEY_MIN_LOG_MEL))
    return np.where(mels >= _SLANEY_MIN_LOG_MEL, log_part, linear)


@lru_cache(maxsize=16)
def slaney_mel_filterbank(
    sample_rate: int, n_fft: int, n_mels: int, fmin: float = 0.0, fmax: float | None = None
) -> np.ndarray:
    """librosa.filters.mel(sr, n_fft, n_mels, fmin, fmax, htk=False, norm='slaney').

    Triangles whose corners are n_mels + 2 points equally spaced on the Slaney mel
    scale, each scaled to unit area (2 / bandwidth in Hz). Computed in float64 and
    returned as float32 [n_mels, 1 + n_fft // 2], like librosa's default dtype.
    """
    if fmax is None:
        fmax = sample_rate / 2.0
    fft_freqs = np.linspace(0.0, sample_rate / 2.0, 1 + n_fft // 2)
    mel_points = np.linspace(hz_to_mel_slaney(fmin), hz_to_mel_slaney(fmax), n_mels + 2)
    corners_hz = mel_to_hz_slaney(mel_points)
    widths = np.diff(corners_hz)
    # distance of every FFT bin to every corner, [n_mels + 2, n_bins]
    offsets = corners_hz[:, None] - fft_freqs[None, :]
    rising = -offsets[:-2] / widths[:-1, None]
    falling = offsets[2:] / widths[1:, None]
    weights = np.maximum(0.0, np.minimum(rising, falling))
    weights *= (2.0 / (corners_hz[2:] - corners_hz[:-2]))[:, None]
    return weights.astype(np.float32)


# --- Kaldi mel scale ------------------------------------------------------------------


def hz_to_mel_kaldi(freq: np.ndarray | float) -> np.ndarray:
    return 1127.0 * np.log1p(np.asarray(freq, dtype=np.float64) / 700.0)


@lru_cache(maxsize=8)
def kaldi_mel_filterbank(
    num_bins: int, padded_window: int, sample_rate: int, low_freq: float, high_freq: float
) -> np.ndarray:
    """Kaldi's `MelBanks` without VTLN: [num_bins, padded_window // 2 + 1] float32.

    Triangles are equally spaced on the 1127 ln(1 + f/700) scale between low_freq and
    high_freq (<= 0 means relative to Nyquist) and evaluated at the mel value of each
    FFT bin's centre frequency; the Nyquist bin gets no weight (as in Kaldi).
    """
    nyquist = 0.5 * sample_rate
    if high_freq <= 0.0:
        high_freq += nyquist
    n_bins = padded_window // 2
    bin_width = sample_rate / padded_window
    mel_low, mel_high = hz_to_mel_kaldi(low_freq), hz_to_mel_kaldi(high_freq)
    delta = (mel_high - mel_low) / (num_bins + 1)
    index = np.arange(num_bins, dtype=np.float64)[:, None]
    left = mel_low + index * delta
    centre = left + delta
    right = centre + delta
    mel = hz_to_mel_kaldi(bin_width * np.arange(n_bins, dtype=np.float64))[None, :]
    up = (mel - left) / (centre - left)
    down = (right - mel) / (right - centre)
    banks = np.maximum(0.0, np.minimum(up, down))
    banks = np.pad(banks, ((0, 0), (0, 1)))  # zero weight for the Nyquist bin
    return banks.astype(np.float32)


def _as_1d_float(wav: np.ndarray | torch.Tensor) -> torch.Tensor:
    x = torch.as_tensor(wav, dtype=torch.float32)
    if x.dim() == 2:
        # [channels, samples] -> mono, as the official load_wav (mean over channels).
        x = x.mean(dim=0)
    if x.dim() != 1:
        raise ValueError(f"expected mono audio [N] or [C, N], got shape {tuple(x.shape)}")
    return x


# --- Whisper log-mel ------------------------------------------------------------------


def whisper_log_mel(wav16k: np.ndarray | torch.Tensor, n_mels: int = 128) -> torch.Tensor:
    """Whisper log-mel of 16 kHz audio: [n_mels, N // 160] float32.

    Centred STFT (reflect padding), periodic Hann, power spectrum with the last frame
    dropped, Slaney mel, log10 clamped at 1e-10, dynamic range limited to 8 (80 dB)
    below the maximum, then (x + 4) / 4.
    """
    audio = _as_1d_float(wav16k)
    window = torch.hann_window(WHISPER_N_FFT, device=audio.device)
    spec = torch.stft(
        audio, WHISPER_N_FFT, WHISPER_HOP, window=window, center=True, pad_mode="reflect", return_complex=True
    )
    power = spec[..., :-1].abs() ** 2
    filters = torch.from_numpy(slaney_mel_filterbank(WHISPER_SAMPLE_RATE, WHISPER_N_FFT, n_mels)).to(audio.device)
    log_spec = torch.clamp(filters @ power, min=1e-10).log10()
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    return (log_spec + 4.0) / 4.0


# --- Kaldi fbank ----------------------------------------------------------------------


def kaldi_fbank(wav16k: np.ndarray | torch.Tensor, num_mel_bins: int = 80) -> torch.Tensor:
    """`kaldi.fbank(wav, num_mel_bins=80, dither=0, sample_frequency=16000)`: [T, 80].

    The waveform is used as given (float in [-1, 1]; torchaudio does not rescale to
    int16 range, and neither does the official call). Frames: 25 ms windows every
    10 ms with snip_edges (T = 1 + (N - 400) // 160), per-frame DC removal,
    pre-emphasis 0.97 (the first sample uses itself as predecessor), Povey window
    (Hann^0.85, symmetric), zero-padded to 512, power spectrum, Kaldi mel banks
    20 Hz..Nyquist, log with float32 epsilon floor.
    """
    audio = _as_1d_float(wav16k)
    n = audio.numel()
    if n < KALDI_FRAME_LENGTH:
        return torch.zeros(0, num_mel_bins, dtype=torch.float32)
    frames = audio.unfold(0, KALDI_FRAME_LENGTH, KALDI_FRAME_SHIFT)  # [T, 400]
    frames = frames - frames.mean(dim=1, keepdim=True)
    previous = torch.cat([frames[:, :1], frames[:, :-1]], dim=1)
    frames = frames - KALDI_PREEMPHASIS * previous
    window = torch.hann_window(KALDI_FRAME_LENGTH, periodic=False, dtype=torch.float32).pow(0.85)
    frames = frames * window
    padded = 1 << (KALDI_FRAME_LENGTH - 1).bit_length()  # 512
    power = torch.fft.rfft(frames, n=padded).abs().pow(2)  # [T, 257]
    banks = torch.from_numpy(
        kaldi_mel_filterbank(num_mel_bins, padded, KALDI_SAMPLE_RATE, KALDI_LOW_FREQ, 0.0)
    )
    energies = power @ banks.T
    return torch.clamp(energies, min=KALDI_EPSILON).log()


def speaker_fbank(wav16k: np.ndarray | torch.Tensor) -> torch.Tensor:
    """CAM++ input: kaldi fbank with the per-bin mean over time removed (CMN)."""
    feat = kaldi_fbank(wav16k)
    return feat - feat.mean(dim=0, keepdim=True)


# --- Matcha prompt mel ----------------------------------------------------------------


def prompt_mel(wav24k: np.ndarray | torch.Tensor, cfg: MelConfig) -> torch.Tensor:
    """The flow's prompt features: [N // hop, num_mels] float32 (frames first).

    Reflect padding of (n_fft - hop) / 2 on each side and an uncentred STFT give
    exactly one frame per hop; magnitude with a 1e-9 floor inside the sqrt; Slaney
    mel (fmax None -> Nyquist); natural log clamped at 1e-5.
    """
    audio = _as_1d_float(wav24k)
    pad = (cfg.n_fft - cfg.hop_size) // 2
    if audio.numel() <= pad:
        return torch.zeros(0, cfg.num_mels, dtype=torch.float32)
    padded = torch.nn.functional.pad(audio[None, None], (pad, pad), mode="reflect")[0, 0]
    window = torch.hann_window(cfg.win_size, device=audio.device)
    spec = torch.stft(
        padded,
        cfg.n_fft,
        hop_length=cfg.hop_size,
        win_length=cfg.win_size,
        window=window,
        center=False,
        normalized=False,
        onesided=True,
        return_complex=True,
    )
    magnitude = torch.sqrt(spec.real.pow(2) + spec.imag.pow(2) + 1e-9)
    filters = torch.from_numpy(
        slaney_mel_filterbank(cfg.sampling_rate, cfg.n_fft, cfg.num_mels, cfg.fmin, cfg.fmax)
    ).to(audio.device)
    mel = torch.log(torch.clamp(filters @ magnitude, min=1e-5))
    return mel.T.contiguous()


# --- resampling -----------------------------------------------------------------------


# The official frontend resamples a prompt with torchaudio's `Resample` at its defaults
# (Hann-windowed sinc, 6 zero crossings, cut-off at 0.99 of the lower Nyquist rate), and
# the models were trained on features of audio resampled that way: its gentle roll-off
# leaves some energy above the cut-off that a steep filter (soxr, used before) removes,
# up to 8 nats in the top mel bins of a 16 kHz upload's 24 kHz prompt mel.
SINC_ZERO_CROSSINGS = 6
SINC_ROLLOFF = 0.99


# The polyphase table of the reduced ratio p:q has q x (2w + p) weights. Common rates
# give small tables (44100 -> 16000: 160 x 475; the largest, 11025 -> 16000: 640 x 455),
# but an odd rate barely reduces: 16001 -> 16000 would need 16000 x 16015 (~1 GB as
# float32, ~10 GB peak with the temporaries that build it, and tens of seconds of
# convolution over mostly-zero taps). Past this many weights `resample` evaluates the
# same formula directly per output sample instead.
MAX_POLYPHASE_WEIGHTS = 2_000_000
# Weights evaluated at once by the direct path (bounds its working memory, ~8 bytes each
# in several float64 temporaries).
_DIRECT_CHUNK_WEIGHTS = 1 << 20


def polyphase_shape(sr_in: int, sr_out: int) -> tuple[int, int, int]:
    """(q, 2w + p, w): the rows and taps of `sinc_kernel`'s table and its half-width w."""
    g = math.gcd(sr_in, sr_out)
    p, q = sr_in // g, sr_out // g
    cutoff = min(p, q) * SINC_ROLLOFF
    width = math.ceil(SINC_ZERO_CROSSINGS * p / cutoff)
    return q, 2 * width + p, width


def sinc_kernel(sr_in: int, sr_out: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, int]:
    """The polyphase filter bank of `resample` for the reduced ratio p:q (p = sr_in / g,
    q = sr_out / g): [q, 1, 2w + p], row j the weights that output phase j gives the
    input samples around it, and w, the filter's half-width in input samples.

    Output sample m of a block reads input time m / q (in units of p input samples); the
    weight of input sample i is sinc(pi f (i / p - j / q)) * cos^2(pi f (i / p - j / q) /
    (2 c)) * f / p with f = 0.99 min(p, q), clipped to c = 6 zero crossings.

    Raises ValueError past `MAX_POLYPHASE_WEIGHTS` weights (an odd rate such as 16001 Hz),
    rather than allocating gigabytes; `resample` does not build those."""
    rows, span, width = polyphase_shape(sr_in, sr_out)
    if rows * span > MAX_POLYPHASE_WEIGHTS:
        raise ValueError(f"the polyphase table of {sr_in} -> {sr_out} Hz would hold {rows} x {span} weights")
    g = math.gcd(sr_in, sr_out)
    p, q = sr_in // g, sr_out // g
    cutoff = min(p, q) * SINC_ROLLOFF
    taps = torch.arange(-width, width + p, dtype=dtype) / p
    phases = -torch.arange(q, dtype=dtype)[:, None] / q
    x = ((phases + taps) * cutoff).clamp(-SINC_ZERO_CROSSINGS, SINC_ZERO_CROSSINGS)
    window = torch.cos(x * (math.pi / SINC_ZERO_CROSSINGS / 2)) ** 2
    x = x * math.pi
    sinc = torch.where(x == 0, torch.ones_like(x), torch.sin(x) / torch.where(x == 0, torch.ones_like(x), x))
    return (sinc * window * (cutoff / p))[:, None, :], width


def resample(wav: np.ndarray, sr_in: int, sr_out: int) -> np.ndarray:
    """Mono float32 resampling as the official frontend's torchaudio `Resample` does it
    (`sinc_kernel`; identity if the rates are equal): ceil(n * sr_out / sr_in) samples.

    A rate pair whose polyphase table would be too large (`MAX_POLYPHASE_WEIGHTS`) gets
    the same formula evaluated directly (`_resample_direct`): equal up to float32
    rounding, at a cost per output sample of the filter's span instead of q x p."""
    x = np.asarray(wav, dtype=np.float32)
    if sr_in == sr_out:
        return x
    rows, span, _ = polyphase_shape(sr_in, sr_out)
    if rows * span > MAX_POLYPHASE_WEIGHTS:
        return _resample_direct(x, sr_in, sr_out)
    g = math.gcd(sr_in, sr_out)
    p, q = sr_in // g, sr_out // g
    kernel, width = sinc_kernel(sr_in, sr_out)
    signal = F.pad(torch.from_numpy(np.ascontiguousarray(x))[None, None], (width, width + p))
    blocks = F.conv1d(signal, kernel, stride=p)  # [1, q, blocks]: output phase by block
    out = blocks[0].T.reshape(-1)[: math.ceil(q * x.shape[0] / p)]
    return out.numpy().astype(np.float32, copy=False)


def _resample_direct(x: np.ndarray, sr_in: int, sr_out: int) -> np.ndarray:
    """`resample`'s formula per output sample: output m reads input time c = m sr_in /
    sr_out (in input samples) and input sample i weighs sinc(pi f (i - c)) * cos^2(pi f
    (i - c) / 12) * f with f = 0.99 min(sr_in, sr_out) / sr_in, zero past 6 zero crossings
    (the polyphase table's weights, which depend on the rates only through f and c);
    samples outside the input are zeros, as the table's padding. Float64 inside, in
    chunks of output samples so memory stays bounded whatever the ratio."""
    n = x.shape[0]
    n_out = -(-n * sr_out // sr_in)  # ceil, exactly
    f = SINC_ROLLOFF * min(sr_in, sr_out) / sr_in
    half = math.ceil(SINC_ZERO_CROSSINGS / f)  # input samples each side with a weight
    span = 2 * half + 2
    # Zero padding so every index a chunk reads is inside the array.
    padded = np.zeros(n + 2 * span, dtype=np.float64)
    padded[span: span + n] = x
    offsets = np.arange(span, dtype=np.int64)
    out = np.empty(n_out, dtype=np.float32)
    step = max(1, _DIRECT_CHUNK_WEIGHTS // span)
    for start in range(0, n_out, step):
        m = np.arange(start, min(start + step, n_out), dtype=np.int64)
        whole, rest = np.divmod(m * sr_in, sr_out)  # c = whole + rest / sr_out, exactly
        first = whole - half  # the first input sample of each row
        t = (offsets[None, :] - half - (rest / sr_out)[:, None]) * f  # (i - c) f
        t = np.clip(t, -SINC_ZERO_CROSSINGS, SINC_ZERO_CROSSINGS)
        weights = np.sinc(t) * np.cos(t * (math.pi / SINC_ZERO_CROSSINGS / 2)) ** 2 * f
        samples = padded[(first + span)[:, None] + offsets[None, :]]
        out[start: start + m.shape[0]] = np.einsum("ij,ij->i", weights, samples)
    return out
