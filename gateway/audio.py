"""Streaming audio encoders: 24 kHz float32 chunks in, wire frames out.

Every encoder is a small stateful object owned by one context (never shared), so a
context's audio is one continuous signal however the engine chunked it:

* the soxr ``ResampleStream`` keeps its filter history across chunks (no clicks at
  joins; the output is the same as resampling the whole utterance at once);
* G.711 and Opus need fixed 20 ms frames, so leftover samples wait for the next chunk;
* ``flush()`` drains the resampler and pads the last frame with silence.

Decoders (G.711 tables, Opus) are here too, for tests and the Python client.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import soxr

ENGINE_RATE = 24000
PCM_RATES = (8000, 16000, 22050, 24000, 44100, 48000)
OPUS_RATES = (48000, 24000)
FORMATS = ("pcm_s16le", "pcm_f32le", "ulaw_8000", "alaw_8000", "opus")
FRAME_MS = 20


class AudioFormatError(ValueError):
    """Unknown format or a sample rate the format does not support."""


@dataclass(frozen=True)
class AudioFormat:
    name: str
    sample_rate: int

    @property
    def frame_samples(self) -> int | None:
        """Samples per frame for framed formats (G.711, Opus); None = any length."""
        if self.name in ("ulaw_8000", "alaw_8000", "opus"):
            return self.sample_rate * FRAME_MS // 1000
        return None

    def samples_in(self, payload: bytes) -> int:
        """Output-rate samples carried by one frame's payload (Opus: the fixed 20 ms)."""
        if self.name == "pcm_s16le":
            return len(payload) // 2
        if self.name == "pcm_f32le":
            return len(payload) // 4
        if self.name in ("ulaw_8000", "alaw_8000"):
            return len(payload)
        return self.sample_rate * FRAME_MS // 1000


def default_rate(name: str) -> int:
    return {"ulaw_8000": 8000, "alaw_8000": 8000, "opus": 48000}.get(name, ENGINE_RATE)


def resolve_format(name: str, sample_rate: int | None) -> AudioFormat:
    """Validate a (format, rate) pair; raise AudioFormatError with a readable reason."""
    if name not in FORMATS:
        # Cut short: a client's 60 KB name must not come back as a 60 KB error.
        raise AudioFormatError(f"unknown format {name[:128]!r}; expected one of {', '.join(FORMATS)}")
    rate = default_rate(name) if sample_rate is None else int(sample_rate)
    allowed = {"ulaw_8000": (8000,), "alaw_8000": (8000,), "opus": OPUS_RATES}.get(name, PCM_RATES)
    if rate not in allowed:
        raise AudioFormatError(f"sample_rate {rate} not supported for {name}; allowed: {allowed}")
    return AudioFormat(name, rate)


@dataclass(frozen=True)
class EncoderOptions:
    """Codec settings of the WebSocket streams (wired into `gateway.settings` as ``audio``;
    `/v1/audio/speech` encodes its files through PyAV with fixed settings)."""

    opus_bitrate: int = field(default=32000, metadata={"help": "WebSocket Opus bitrate in bit/s (6000-510000)"})
    opus_complexity: int = field(
        default=10,
        metadata={"help": "WebSocket Opus encoder complexity 0-10; 6 and below cost a fifth or less of 10's CPU "
                          "on speech (docs/benchmarks.md)"},
    )
    encode_threads: int = field(
        default=4,
        metadata={"help": "threads that encode WebSocket Opus off the event loop (0 = on the loop; PCM and "
                          "G.711 always stay on it)"},
    )

    def __post_init__(self) -> None:
        if not 6000 <= self.opus_bitrate <= 510000:
            raise ValueError("audio.opus_bitrate must be within [6000, 510000]")
        if not 0 <= self.opus_complexity <= 10:
            raise ValueError("audio.opus_complexity must be within [0, 10]")
        if self.encode_threads < 0:
            raise ValueError("audio.encode_threads must be >= 0")


class Encoder(Protocol):
    format: AudioFormat
    # Cheap enough to run on the event loop: a thread hop would cost more than the work.
    inline: bool

    def encode(self, pcm: np.ndarray) -> list[bytes]:
        """Encode 24 kHz float32 mono samples; returns zero or more complete frames."""
        ...

    def flush(self) -> list[bytes]:
        """Everything encoded so far, out: drains internal state (the resampler's filter,
        a codec's lookahead) and pads the last frame. The encoder goes on after it: a flush
        mid-stream keeps a codec's state, so a client's decoder runs on undisturbed."""
        ...


class _Resampler:
    """24 kHz -> target rate with state across chunks (identity at 24 kHz)."""

    def __init__(self, out_rate: int) -> None:
        self._stream = (
            None if out_rate == ENGINE_RATE else soxr.ResampleStream(ENGINE_RATE, out_rate, 1, dtype="float32", quality="HQ")
        )

    def __call__(self, pcm: np.ndarray, last: bool = False) -> np.ndarray:
        """Resampled samples; `last` drains the filter and starts the stream over."""
        x = np.ascontiguousarray(pcm, dtype=np.float32).reshape(-1)
        if self._stream is None:
            return x
        out = np.asarray(self._stream.resample_chunk(x, last=last), dtype=np.float32).reshape(-1)
        if last:
            self._stream.clear()
        return out


def float_to_s16(x: np.ndarray) -> np.ndarray:
    # Round (not truncate) so a full-scale sine maps symmetrically.
    return np.clip(np.rint(x * 32767.0), -32768, 32767).astype(np.int16)


class PcmEncoder:
    """Raw little-endian PCM; one frame per engine chunk."""

    inline = True  # <= 0.2 ms of CPU per second of audio, resampling included

    def __init__(self, fmt: AudioFormat) -> None:
        self.format = fmt
        self._resample = _Resampler(fmt.sample_rate)

    def _pack(self, y: np.ndarray) -> list[bytes]:
        if y.size == 0:
            return []
        if self.format.name == "pcm_f32le":
            return [np.clip(y, -1.0, 1.0).astype("<f4").tobytes()]
        return [float_to_s16(y).astype("<i2").tobytes()]

    def encode(self, pcm: np.ndarray) -> list[bytes]:
        return self._pack(self._resample(pcm))

    def flush(self) -> list[bytes]:
        return self._pack(self._resample(np.zeros(0, np.float32), last=True))


class _FramedEncoder:
    """Shared logic of G.711 and Opus: resample, collect s16, cut fixed frames."""

    def __init__(self, fmt: AudioFormat) -> None:
        self.format = fmt
        self._resample = _Resampler(fmt.sample_rate)
        self._frame = fmt.frame_samples or 0
        self._pending = np.zeros(0, np.int16)

    def _encode_frames(self, block: np.ndarray) -> list[bytes]:
        """Encode whole frames (``block.size`` is a multiple of the frame length)."""
        raise NotImplementedError

    def _frames(self, y: np.ndarray, pad: bool) -> list[bytes]:
        buf = np.concatenate([self._pending, float_to_s16(y)]) if y.size else self._pending
        if pad and buf.size % self._frame:
            buf = np.concatenate([buf, np.zeros(self._frame - buf.size % self._frame, np.int16)])
        full = buf.size - buf.size % self._frame
        out = self._encode_frames(buf[:full]) if full else []
        self._pending = buf[full:].copy()
        return out

    def encode(self, pcm: np.ndarray) -> list[bytes]:
        return self._frames(self._resample(pcm), pad=False)

    def flush(self) -> list[bytes]:
        return self._frames(self._resample(np.zeros(0, np.float32), last=True), pad=True)


# ---- G.711 (ITU-T G.711, segment/mantissa companding) ------------------------------

_MU_BIAS = 0x84
_MU_BIAS14 = 0x21
_MU_CLIP14 = 8159


def ulaw_encode(s16: np.ndarray) -> bytes:
    # Works on 14-bit magnitudes like the reference coder (and the classic audioop),
    # so our bytes match other implementations exactly.
    x = s16.astype(np.int32) >> 2
    neg = x < 0
    mag = np.minimum(np.where(neg, -x, x), _MU_CLIP14) + _MU_BIAS14
    seg = np.zeros(mag.shape, np.int32)
    for s in range(1, 8):
        seg += (mag >= (0x40 << (s - 1))).astype(np.int32)
    code = (seg << 4) | ((mag >> (seg + 1)) & 0x0F)
    code = np.where(mag > 0x1FFF, 0x7F, code)  # clipped full scale: top code
    return (code ^ np.where(neg, 0x7F, 0xFF)).astype(np.uint8).tobytes()


def ulaw_decode(data: bytes) -> np.ndarray:
    u = ~np.frombuffer(data, np.uint8).astype(np.int32) & 0xFF
    seg = (u >> 4) & 0x07
    mag = (((u & 0x0F) << 3) + _MU_BIAS) << seg
    return np.where(u & 0x80, _MU_BIAS - mag, mag - _MU_BIAS).astype(np.int16)


def alaw_encode(s16: np.ndarray) -> bytes:
    x = s16.astype(np.int32) >> 3  # A-law works on 13-bit magnitudes
    sign = np.where(x >= 0, 0x80, 0)
    mag = np.where(x >= 0, x, -x - 1)
    mag = np.minimum(mag, 0x0FFF)
    seg = np.zeros(mag.shape, np.int32)
    for s in range(1, 8):
        seg += (mag >= (0x20 << (s - 1))).astype(np.int32)
    mant = np.where(seg == 0, mag >> 1, mag >> seg) & 0x0F
    return (((sign | (seg << 4) | mant) ^ 0x55) & 0xFF).astype(np.uint8).tobytes()


def alaw_decode(data: bytes) -> np.ndarray:
    a = np.frombuffer(data, np.uint8).astype(np.int32) ^ 0x55
    seg = (a >> 4) & 0x07
    mant = a & 0x0F
    mag = np.where(seg == 0, (mant << 4) + 8, ((mant << 4) + 0x108) << np.maximum(seg - 1, 0))
    return np.where(a & 0x80, mag, -mag).astype(np.int16)


class G711Encoder(_FramedEncoder):
    """μ-law / A-law at 8 kHz in exact 160-byte (20 ms) frames."""

    inline = True  # ~0.3 ms of CPU per second of audio, resampling included (bench/host_cost.py)

    def _encode_frames(self, block: np.ndarray) -> list[bytes]:
        # Sample by sample, so one pass over the block gives the same bytes as one per
        # frame, at a fifteenth of the cost (the numpy calls' overhead dominated 160 samples).
        data = ulaw_encode(block) if self.format.name == "ulaw_8000" else alaw_encode(block)
        return [data[i : i + self._frame] for i in range(0, len(data), self._frame)]


# ---- Opus ----------------------------------------------------------------------------


class OpusEncoder(_FramedEncoder):
    """Raw Opus packets of 20 ms, mono, one libopus encoder per stream."""

    # ~13 ms of CPU per second of speech at complexity 10: 500 streams would need ~7 cores,
    # so it runs on the encode threads (libopus is called through ctypes, which drops the GIL).
    inline = False

    def __init__(self, fmt: AudioFormat, bitrate: int = 32000, complexity: int = 10) -> None:
        super().__init__(fmt)
        import opuslib  # imported lazily: needs the system libopus

        self._enc = opuslib.Encoder(fmt.sample_rate, 1, opuslib.APPLICATION_AUDIO)
        self._enc.bitrate = bitrate
        self._enc.complexity = complexity
        self._fed = False  # samples came since the last flush

    def _encode_frames(self, block: np.ndarray) -> list[bytes]:
        data = block.astype("<i2").tobytes()
        step = 2 * self._frame
        return [self._enc.encode(data[i : i + step], self._frame) for i in range(0, len(data), step)]

    def encode(self, pcm: np.ndarray) -> list[bytes]:
        self._fed = self._fed or pcm.size > 0
        return super().encode(pcm)

    def flush(self) -> list[bytes]:
        # libopus codes each sample `lookahead` samples (6.5 ms) later: silence after the
        # stream's end puts its last samples into a packet; padding to the frame alone
        # lost them about one flush in three. Nothing fed since the last flush: nothing to put.
        tail = self._resample(np.zeros(0, np.float32), last=True)
        if self._fed:
            tail = np.concatenate([tail, np.zeros(self._enc.lookahead, np.float32)])
            self._fed = False
        return self._frames(tail, pad=True)


class OpusDecoder:
    """Decoder for tests/clients: packets -> int16 samples at the stream rate."""

    def __init__(self, sample_rate: int) -> None:
        import opuslib

        self._dec = opuslib.Decoder(sample_rate, 1)
        self._frame = sample_rate * FRAME_MS // 1000

    def decode(self, packet: bytes) -> np.ndarray:
        return np.frombuffer(self._dec.decode(packet, self._frame), dtype="<i2").copy()


def make_encoder(format: str, sample_rate: int | None = None, options: EncoderOptions | None = None) -> Encoder:
    """Build a fresh encoder for one stream (raises AudioFormatError on bad input)."""
    fmt = resolve_format(format, sample_rate)
    if fmt.name in ("pcm_s16le", "pcm_f32le"):
        return PcmEncoder(fmt)
    if fmt.name in ("ulaw_8000", "alaw_8000"):
        return G711Encoder(fmt)
    opts = options or EncoderOptions()
    return OpusEncoder(fmt, opts.opus_bitrate, opts.opus_complexity)


def decode_frames(fmt: AudioFormat, frames: list[bytes]) -> np.ndarray:
    """Decode a stream's frames back to float32 at ``fmt.sample_rate`` (tests, client)."""
    if not frames:
        return np.zeros(0, np.float32)
    if fmt.name == "pcm_f32le":
        return np.frombuffer(b"".join(frames), "<f4").astype(np.float32)
    if fmt.name == "pcm_s16le":
        s16 = np.frombuffer(b"".join(frames), "<i2")
    elif fmt.name == "ulaw_8000":
        s16 = np.concatenate([ulaw_decode(f) for f in frames])
    elif fmt.name == "alaw_8000":
        s16 = np.concatenate([alaw_decode(f) for f in frames])
    else:
        dec = OpusDecoder(fmt.sample_rate)
        s16 = np.concatenate([dec.decode(f) for f in frames])
    return s16.astype(np.float32) / 32768.0
