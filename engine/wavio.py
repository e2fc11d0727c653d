"""Minimal WAV reading (8/16/24/32-bit PCM, 32/64-bit float) and writing (16-bit PCM);
numpy and the standard library only."""

from __future__ import annotations

import struct
import wave
from pathlib import Path

import numpy as np

_PCM, _FLOAT, _EXTENSIBLE = 0x0001, 0x0003, 0xFFFE
# (format tag, bytes per sample) that `read_wav` decodes.
_ENCODINGS = frozenset({(_PCM, 1), (_PCM, 2), (_PCM, 3), (_PCM, 4), (_FLOAT, 4), (_FLOAT, 8)})


def read_wav(path: Path | str) -> tuple[np.ndarray, int]:
    """Return (mono float32, sample rate): PCM scaled to [-1, 1), float samples as stored;
    several channels are averaged.

    Reads the RIFF chunks itself (the stdlib `wave` module refuses float data and, before
    Python 3.12, WAVE_FORMAT_EXTENSIBLE headers): format tag PCM (1; 8-bit unsigned,
    16/24/32-bit signed), IEEE float (3; 32/64-bit), or WAVE_FORMAT_EXTENSIBLE with either
    as its subformat. A data chunk that claims more bytes than the file holds (a writer
    that never patched the sizes) is read up to the file's end. Anything else raises
    ValueError naming the file and what is unsupported."""
    data = Path(path).read_bytes()
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise ValueError(f"{path}: not a RIFF/WAVE file")
    fmt: bytes | None = None
    samples: bytes | None = None
    pos = 12
    while pos + 8 <= len(data):
        chunk_id, size = data[pos : pos + 4], struct.unpack_from("<I", data, pos + 4)[0]
        body = data[pos + 8 : pos + 8 + size]
        if chunk_id == b"fmt " and fmt is None:
            fmt = body
        elif chunk_id == b"data" and samples is None:
            samples = body
        pos += 8 + size + (size & 1)  # chunks are padded to an even size
    if fmt is None or len(fmt) < 16:
        raise ValueError(f"{path}: no valid 'fmt ' chunk")
    if samples is None:
        raise ValueError(f"{path}: no 'data' chunk")
    tag, channels, sample_rate, _, block_align, bits = struct.unpack_from("<HHIIHH", fmt)
    if tag == _EXTENSIBLE:
        if len(fmt) < 40:
            raise ValueError(f"{path}: truncated WAVE_FORMAT_EXTENSIBLE header")
        tag = struct.unpack_from("<H", fmt, 24)[0]  # the subformat GUID's first two bytes
    width = (bits + 7) // 8
    if (tag, width) not in _ENCODINGS:
        kind = {_PCM: "PCM", _FLOAT: "float"}.get(tag, f"format tag {tag:#06x}")
        raise ValueError(f"{path}: unsupported WAV encoding ({kind}, {bits} bits); "
                         "8/16/24/32-bit PCM or 32/64-bit float are read")
    if channels < 1 or sample_rate < 1 or block_align != channels * width:
        raise ValueError(
            f"{path}: inconsistent WAV header ({channels} channels, {bits} bits, block {block_align} bytes)"
        )
    samples = samples[: len(samples) - len(samples) % block_align]  # whole frames only
    if tag == _PCM and width == 1:
        x = (np.frombuffer(samples, np.uint8).astype(np.float32) - 128.0) / 128.0
    elif tag == _PCM and width == 2:
        x = np.frombuffer(samples, "<i2").astype(np.float32) / 32768.0
    elif tag == _PCM and width == 3:
        # Each sample into the top three bytes of an int32: the sign comes along.
        wide = np.zeros((len(samples) // 3, 4), np.uint8)
        wide[:, 1:] = np.frombuffer(samples, np.uint8).reshape(-1, 3)
        x = (wide.view("<i4")[:, 0] / 2147483648.0).astype(np.float32)
    elif tag == _PCM and width == 4:
        x = (np.frombuffer(samples, "<i4") / 2147483648.0).astype(np.float32)
    elif tag == _FLOAT and width == 4:
        x = np.frombuffer(samples, "<f4").astype(np.float32)
    else:  # float, 8 bytes
        x = np.frombuffer(samples, "<f8").astype(np.float32)
    if channels > 1:
        x = x.reshape(-1, channels).mean(axis=1)
    return x, sample_rate


def write_wav(path: Path | str, pcm: np.ndarray, sample_rate: int) -> None:
    s16 = (np.clip(np.asarray(pcm, np.float32), -1.0, 1.0) * 32767.0).astype("<i2")
    # Opened here, not by `wave`: a `wave` writer whose file fails to open raises a second
    # error from its destructor.
    with open(path, "wb") as f, wave.open(f, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(s16.tobytes())
