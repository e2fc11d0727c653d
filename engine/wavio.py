"""Minimal WAV reading and writing (16-bit PCM and float), stdlib only."""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np


def read_wav(path: Path | str) -> tuple[np.ndarray, int]:
    """Return (mono float32 in [-1, 1], sample rate)."""
    with wave.open(str(path), "rb") as w:
        sr, ch, width, n = w.getframerate(), w.getnchannels(), w.getsampwidth(), w.getnframes()
        raw = w.readframes(n)
    if width == 2:
        x = np.frombuffer(raw, "<i2").astype(np.float32) / 32768.0
    elif width == 4:
        x = np.frombuffer(raw, "<i4").astype(np.float32) / 2147483648.0
    elif width == 1:
        x = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) / 128.0
    else:
        raise ValueError(f"{path}: unsupported sample width {width}")
    if ch > 1:
        x = x.reshape(-1, ch).mean(axis=1)
    return x, sr


def write_wav(path: Path | str, pcm: np.ndarray, sample_rate: int) -> None:
    s16 = (np.clip(np.asarray(pcm, np.float32), -1.0, 1.0) * 32767.0).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(s16.tobytes())
