"""Audio in and out of the HTTP API, in-process through PyAV (libav*), no ffmpeg subprocess.

In:  `decode_audio(data)` turns an uploaded file of any format libavformat reads (wav,
     mp3, flac, ogg/opus, webm, m4a, ...) into float32 mono at its own sample rate;
     `read_body_bounded` reads a request body chunk by chunk and stops at a byte limit
     *before* an oversized upload is held in memory.
Out: incremental encoders for OpenAI's ``response_format`` values: ``encode(pcm)``
     returns whatever bytes the container has ready so far, ``close()`` the rest, so
     speech streams to the client while it is being generated.
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass
from typing import AsyncIterator, Protocol

import av
import numpy as np

from gateway.errors import ApiError

# --------------------------------------------------------------------------------------
# Bounded request bodies
# --------------------------------------------------------------------------------------


async def bounded_stream(chunks: AsyncIterator[bytes], limit: int) -> AsyncIterator[bytes]:
    """Pass chunks through until more than `limit` bytes were seen, then raise 413.

    Used as the source of the multipart parser and of JSON bodies, so at most one
    network chunk beyond the limit is ever buffered.
    """
    seen = 0
    async for chunk in chunks:
        seen += len(chunk)
        if seen > limit:
            raise ApiError(413, "audio_too_large", f"request body exceeds {limit} bytes")
        yield chunk


async def read_body_bounded(chunks: AsyncIterator[bytes], limit: int) -> bytes:
    parts: list[bytes] = []
    async for chunk in bounded_stream(chunks, limit):
        parts.append(chunk)
    return b"".join(parts)


# --------------------------------------------------------------------------------------
# Decoding uploads
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodedAudio:
    samples: np.ndarray  # float32 mono, [-1, 1]
    sample_rate: int

    @property
    def duration_s(self) -> float:
        return self.samples.shape[0] / float(self.sample_rate)


# The containers an upload may be (FFmpeg demuxer names). Without a list FFmpeg guesses
# the demuxer from the bytes, and some of its demuxers open other files: an upload of
# "ffconcat version 1.0\nfile /etc/..." made the server read a file of its own disk.
UPLOAD_CONTAINERS = "wav,w64,mp3,flac,ogg,mov,mp4,m4a,matroska,webm,aac,aiff,caf"


def decode_audio(data: bytes, max_seconds: float | None = None, max_damaged_packets: int = 8) -> DecodedAudio:
    """Decode the first audio stream of `data` to float32 mono.

    `max_seconds` stops decoding early (raising ``audio_too_long``) so a small but very
    long compressed file cannot make us decode minutes of audio into memory.
    Up to `max_damaged_packets` packets the decoder refuses become silence of their
    duration; one more makes the upload a 400 ``invalid_audio``.
    """
    if not data:
        raise ApiError(400, "invalid_audio", "the audio file is empty")
    try:
        container = av.open(io.BytesIO(data), mode="r", options={"format_whitelist": UPLOAD_CONTAINERS})
    except (av.error.FFmpegError, ValueError, OSError) as exc:
        raise ApiError(400, "invalid_audio", f"not a decodable audio file ({exc.__class__.__name__})") from exc
    try:
        if not container.streams.audio:
            raise ApiError(400, "invalid_audio", "the file has no audio stream")
        stream = container.streams.audio[0]
        timeline = _MonoTimeline(max_seconds)
        refused = 0
        try:
            for packet in container.demux(stream):
                try:
                    frames = packet.decode()
                except av.error.InvalidDataError as exc:
                    # One damaged frame (a flipped header bit) should not cost the
                    # whole upload, as it does not in ffmpeg's CLI; many of them mean
                    # the file is not what it claims.
                    refused += 1
                    if refused > max_damaged_packets:
                        raise ApiError(
                            400, "invalid_audio",
                            f"audio could not be decoded: more than {max_damaged_packets} damaged packets",
                        ) from exc
                    if packet.duration and packet.time_base:
                        timeline.add_silence(float(packet.duration * packet.time_base))
                    continue
                for frame in frames:
                    timeline.add(frame)
            timeline.drain()
        except (av.error.FFmpegError, ValueError) as exc:
            # ValueError: PyAV's own checks (a layout or format it cannot set up, a frame
            # its resampler rejects) fail on what the upload holds, not on the server.
            raise ApiError(400, "invalid_audio", f"audio could not be decoded ({exc.__class__.__name__})") from exc
        if not timeline.parts or timeline.rate <= 0:
            raise ApiError(400, "invalid_audio", "the file contains no audio samples")
        # Not clipped: the official frontend reads a float file's samples as they are,
        # and a lossy decoder's overshoot past full scale is part of the signal.
        samples = np.concatenate(timeline.parts).astype(np.float32)
        if not np.isfinite(samples).all():
            raise ApiError(400, "invalid_audio", "the audio has samples that are not finite numbers")
        return DecodedAudio(samples=samples, sample_rate=timeline.rate)
    finally:
        container.close()


class _MonoTimeline:
    """Decoded frames in, whatever their setup, one float32 mono timeline out at the
    first frame's sample rate.

    Packed float, channels averaged here: an honest mono mix regardless of the channel
    layout libswresample would assume. Packed, not planar: PyAV 18's `to_ndarray` of a
    planar frame with 8 or more channels crashes the process (the frame's first 8 data
    pointers only), and a packed frame is one plane.
    """

    def __init__(self, max_seconds: float | None) -> None:
        self.max_seconds = max_seconds
        self.parts: list[np.ndarray] = []
        self.rate = 0
        self._total = 0
        self._resampler: av.AudioResampler | None = None
        self._setup: tuple[str, str, int] | None = None

    def add(self, frame: av.AudioFrame) -> None:
        key = (frame.format.name, frame.layout.name, int(frame.sample_rate))
        if key != self._setup:
            # A resampler takes one input setup only (PyAV raises ValueError on a frame
            # that differs, a passthrough one returns it unconverted), and a stream may
            # change: ADTS/MP3 rate or channel changes, an MP3 frame with a damaged
            # header decoding as stereo. Drain the old resampler and go on with one at
            # the first frame's rate (each keeps its input's layout: `_packed_mono`
            # mixes).
            self.drain()
            self.rate = self.rate or int(frame.sample_rate)
            self._resampler = av.AudioResampler(format="flt", layout=frame.layout.name, rate=self.rate)
            self._setup = key
        assert self._resampler is not None
        self._keep(self._resampler.resample(frame))

    def add_silence(self, seconds: float) -> None:
        """Silence where the decoder refused a packet, so the timeline (and a voice
        prompt's length against its transcript) stays what was recorded. Before the
        first decoded frame the rate is unknown and nothing is added."""
        self.drain()
        count = int(round(seconds * self.rate))
        if count > 0:
            # Counted before it is made: a packet's duration is the container's word.
            self._count(count)
            self.parts.append(np.zeros(count, dtype=np.float32))

    def drain(self) -> None:
        """Take what the resampler still holds; the next frame gets a new one."""
        if self._resampler is not None:
            self._keep(self._resampler.resample(None))
        self._resampler = None
        self._setup = None

    def _keep(self, frames: list[av.AudioFrame]) -> None:
        for out in frames:
            mono = _packed_mono(out)
            self.parts.append(mono)
            self._count(mono.shape[0])

    def _count(self, samples: int) -> None:
        self._total += samples
        # Output samples at `rate`, whatever rate the input had: the limit holds across
        # a mid-stream switch too.
        if self.max_seconds is not None and self.rate and self._total > (self.max_seconds + 1.0) * self.rate:
            raise ApiError(400, "audio_too_long", f"audio is longer than {self.max_seconds:g} s")


def _packed_mono(frame: av.AudioFrame) -> np.ndarray:
    """A packed float frame (one plane, channels interleaved) as float32 mono."""
    channels = max(1, len(frame.layout.channels))
    block = frame.to_ndarray().astype(np.float32, copy=False).reshape(-1, channels)
    return block.mean(axis=1) if channels > 1 else block[:, 0]


def wav_bytes(samples: np.ndarray, sample_rate: int) -> bytes:
    """A complete 16-bit PCM WAV file (sizes filled in)."""
    pcm = float_to_s16le(samples)
    return _wav_header(sample_rate, len(pcm)) + pcm


# --------------------------------------------------------------------------------------
# Encoding responses
# --------------------------------------------------------------------------------------

RESPONSE_FORMATS: tuple[str, ...] = ("mp3", "opus", "aac", "flac", "wav", "pcm")

MEDIA_TYPES: dict[str, str] = {
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",
}


def float_to_s16le(pcm: np.ndarray) -> bytes:
    x = np.clip(np.asarray(pcm, dtype=np.float32).reshape(-1), -1.0, 1.0)
    return np.round(x * 32767.0).astype("<i2").tobytes()


def _wav_header(sample_rate: int, data_bytes: int | None) -> bytes:
    """RIFF/WAVE header for 16-bit mono PCM.

    With `data_bytes=None` both size fields are 0xFFFFFFFF, the "length unknown"
    convention streaming servers (OpenAI included) use; decoders then read to EOF.
    """
    if data_bytes is None:
        riff_size = data_size = 0xFFFFFFFF
    else:
        riff_size, data_size = 36 + data_bytes, data_bytes
    return (
        b"RIFF" + struct.pack("<I", riff_size) + b"WAVE"
        + b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16)
        + b"data" + struct.pack("<I", data_size)
    )


class AudioEncoder(Protocol):
    media_type: str

    def encode(self, pcm: np.ndarray) -> bytes:
        """Feed float32 mono PCM; return the bytes ready to send (may be empty)."""
        ...

    def close(self) -> bytes:
        """Flush the codec and container; return the remaining bytes."""
        ...


class PcmEncoder:
    """Raw s16le mono, OpenAI's ``pcm``."""

    media_type = MEDIA_TYPES["pcm"]

    def __init__(self, sample_rate: int) -> None:
        self.sample_rate = sample_rate

    def encode(self, pcm: np.ndarray) -> bytes:
        return float_to_s16le(pcm)

    def close(self) -> bytes:
        return b""


class WavEncoder:
    """Streaming WAV: an unknown-length header first, then raw s16le."""

    media_type = MEDIA_TYPES["wav"]

    def __init__(self, sample_rate: int) -> None:
        self.sample_rate = sample_rate
        self._header_sent = False

    def _header(self) -> bytes:
        if self._header_sent:
            return b""
        self._header_sent = True
        return _wav_header(self.sample_rate, None)

    def encode(self, pcm: np.ndarray) -> bytes:
        return self._header() + float_to_s16le(pcm)

    def close(self) -> bytes:
        return self._header()  # an empty utterance is still a valid (empty) file


class _Sink:
    """Write-only, non-seekable file object for PyAV's muxer.

    Being non-seekable matters: muxers then never try to go back and patch headers, and
    every byte they write can go out on the wire at once.
    """

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def write(self, data: bytes) -> int:
        self._parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        out = b"".join(self._parts)
        self._parts.clear()
        return out


@dataclass(frozen=True)
class _AvSpec:
    container: str
    codec: str
    bit_rate: int | None
    options: tuple[tuple[str, str], ...] = ()


_AV_SPECS: dict[str, _AvSpec] = {
    "mp3": _AvSpec("mp3", "libmp3lame", 128_000),
    "aac": _AvSpec("adts", "aac", 128_000),
    "flac": _AvSpec("flac", "flac", None),
    # Ogg pages default to ~1 s; 100 ms pages keep opus streaming at speech pace.
    "opus": _AvSpec("ogg", "libopus", 64_000, (("page_duration", "100000"),)),
}


class AvEncoder:
    """mp3 / aac (ADTS) / flac / opus (Ogg) through PyAV, incrementally.

    PyAV re-frames and converts the sample format to what the codec wants (e.g. 1152
    samples of s32p for LAME), so we can feed chunks of any length.
    """

    def __init__(self, fmt: str, sample_rate: int) -> None:
        spec = _AV_SPECS[fmt]
        self.media_type = MEDIA_TYPES[fmt]
        self.sample_rate = sample_rate
        self._sink = _Sink()
        self._container = av.open(self._sink, mode="w", format=spec.container, options=dict(spec.options))
        self._stream = self._container.add_stream(spec.codec, rate=sample_rate, layout="mono")
        if spec.bit_rate is not None:
            self._stream.bit_rate = spec.bit_rate
        self._pts = 0
        self._closed = False

    def encode(self, pcm: np.ndarray) -> bytes:
        x = np.ascontiguousarray(np.clip(np.asarray(pcm, dtype=np.float32).reshape(1, -1), -1.0, 1.0))
        if x.shape[1] == 0:
            return b""
        frame = av.AudioFrame.from_ndarray(x, format="flt", layout="mono")
        frame.sample_rate = self.sample_rate
        frame.pts = self._pts
        self._pts += x.shape[1]
        for packet in self._stream.encode(frame):
            self._container.mux(packet)
        return self._sink.take()

    def close(self) -> bytes:
        if self._closed:
            return b""
        self._closed = True
        for packet in self._stream.encode(None):
            self._container.mux(packet)
        self._container.close()
        return self._sink.take()


def make_encoder(fmt: str, sample_rate: int = 24000) -> AudioEncoder:
    if fmt == "pcm":
        return PcmEncoder(sample_rate)
    if fmt == "wav":
        return WavEncoder(sample_rate)
    if fmt in _AV_SPECS:
        return AvEncoder(fmt, sample_rate)
    raise ApiError(400, "unsupported_format", f"response_format must be one of {', '.join(RESPONSE_FORMATS)}")
