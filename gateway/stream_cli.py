"""Stream a text file to the gateway as fake LLM tokens and save the audio as WAV.

    python -m gateway.stream_cli --url ws://localhost:8080/v1/tts/stream \\
        --voice alice --file text.txt --rate 30 --out out.wav

Tokens are whitespace-delimited words (with their leading space), sent ``--rate`` per
second, like an LLM streaming its answer. Prints the time to first audio. Exit status: 0
when the whole turn was spoken; 1 on any failure (the gateway reported an error or
refused the connection, the connection dropped, the server cannot be reached, a bad
argument or file), with a one-line message; 2 before sending anything when the file is
longer than one context may be (`ws.max_text_chars`); 130 on Ctrl-C. The WAV holds
whatever audio arrived, also after an error or Ctrl-C; none is written when no audio came.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import time
import wave
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import websockets

from .audio import AudioFormat, AudioFormatError, decode_frames, resolve_format
from .client import CONNECTION_CLOSED, GatewayClient, GatewayError


class TextTooLong(ValueError):
    """The text does not fit one context on this server."""


@dataclass
class Received:
    """What came back so far: kept by the caller, so that it survives Ctrl-C."""

    frames: list[bytes] = field(default_factory=list)
    first_audio_s: float | None = None
    errors: int = 0
    audio_s: float = 0.0
    written: bool = False  # the WAV was written


def fake_tokens(text: str) -> list[str]:
    """Split into word-sized pieces that concatenate back to the text exactly."""
    return re.findall(r"\s*\S+|\s+$", text)


class CannotWrite(Exception):
    """The WAV file could not be written (the turn itself may have been spoken)."""


def _write_wav(out: Path, af: AudioFormat, frames: list[bytes]) -> float:
    pcm = decode_frames(af, frames)
    # `decode_frames` divides 16-bit codes by 32768: only the same factor gives back the
    # samples received (32767 took a step off each one past half scale). Float PCM is
    # scaled as the gateway scales its own 16-bit output.
    scale = 32767.0 if af.name == "pcm_f32le" else 32768.0
    try:
        # Opened here, not by `wave`: a `wave` writer that fails to open its file prints a
        # second error from its destructor.
        f = open(out, "wb")
    except OSError as exc:
        raise CannotWrite(f"cannot write {out}: {exc.strerror or exc}") from exc
    with f, wave.open(f, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(af.sample_rate)
        w.writeframes(np.clip(np.rint(pcm * scale), -32768, 32767).astype("<i2").tobytes())
    return len(pcm) / af.sample_rate


async def stream_file(url: str, text: str, voice: str | None, rate: float, out: Path, fmt: str,
                      sample_rate: int | None, api_key: str | None,
                      received: Received | None = None) -> dict[str, Any]:
    """Speak `text` into `out`; returns the timings (`first_audio_s` is None when no audio
    came) and the count of error events. The audio received is written to `out` however
    this ends (an exception, a cancellation), unless there was none."""
    af = resolve_format(fmt, sample_rate)
    got = received if received is not None else Received()
    t0 = time.monotonic()
    try:
        await _speak(url, text, voice, rate, af, api_key, got, t0)
    finally:
        if got.frames:
            got.audio_s = _write_wav(out, af, got.frames)
            got.written = True
    return {"first_audio_s": got.first_audio_s, "audio_s": got.audio_s,
            "wall_s": time.monotonic() - t0, "errors": got.errors}


async def _speak(url: str, text: str, voice: str | None, rate: float, af: AudioFormat, api_key: str | None,
                 got: Received, t0: float) -> None:
    async with await GatewayClient.connect(url, api_key=api_key) as gw:
        limit = gw.session.get("limits", {}).get("max_text_chars")
        if isinstance(limit, int) and len(text) > limit:
            raise TextTooLong(f"the text has {len(text)} characters; one context takes at most {limit} "
                              f"(the server's ws.max_text_chars)")
        settings: dict[str, Any] = {"format": af.name, "sample_rate": af.sample_rate}
        if voice:
            settings["voice"] = voice
        await gw.configure(**settings)
        ctx = gw.context("cli-1")

        async def reader() -> None:
            async for item in ctx.stream():
                if isinstance(item, bytes):
                    if got.first_audio_s is None:
                        got.first_audio_s = time.monotonic() - t0
                    got.frames.append(item)
                elif item.get("type") == "error":
                    got.errors += 1
                    print(f"error: {item.get('code')}: {item.get('message')}", file=sys.stderr)
                elif item.get("type") == "segment_started":
                    print(f"[{item['audio_offset_ms'] / 1000:7.2f}s] {item['text'].strip()}", file=sys.stderr)

        read_task = asyncio.create_task(reader())
        try:
            try:
                for tok in fake_tokens(text):
                    if read_task.done():
                        break  # the gateway ended the context (refused it, or the socket closed)
                    await ctx.send_text(tok)
                    if rate > 0:
                        await asyncio.wait({read_task}, timeout=1.0 / rate)
                if not read_task.done():
                    await ctx.end()
            except GatewayError:
                pass  # the context ended under us: the reader reports why
            await read_task
        finally:
            # On Ctrl-C (a cancellation) the reader stops with us; what it got is kept.
            read_task.cancel()
            await asyncio.wait({read_task})
        # Errors without a context (a refused `config`): the command failed all the same.
        while not gw.events.empty():
            ev = gw.events.get_nowait()
            if ev.get("type") == "error" and ev.get("code") != CONNECTION_CLOSED:
                got.errors += 1
                print(f"error: {ev.get('code')}: {ev.get('message')}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="ws://127.0.0.1:8080/v1/tts/stream")
    p.add_argument("--voice", default=None, help="registered voice id (default: the server's)")
    p.add_argument("--file", type=Path, required=True, help="text file to speak")
    p.add_argument("--rate", type=float, default=30.0, help="fake LLM tokens per second (0 = all at once)")
    p.add_argument("--out", type=Path, default=Path("out.wav"))
    p.add_argument("--format", default="pcm_s16le", help="pcm_s16le, pcm_f32le, ulaw_8000, alaw_8000, opus")
    p.add_argument("--sample-rate", type=int, default=None)
    p.add_argument("--api-key", default=None)
    args = p.parse_args(argv)
    if not args.rate >= 0:  # also refuses nan, which would send everything at once unasked
        p.error(f"--rate must be >= 0 (0 = all at once), not {args.rate:g}")
    try:
        text = args.file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        print(f"error: cannot read {args.file}: {getattr(exc, 'strerror', None) or exc}", file=sys.stderr)
        return 1
    got = Received()
    try:
        result = asyncio.run(
            stream_file(args.url, text, args.voice, args.rate, args.out, args.format, args.sample_rate,
                        args.api_key, received=got)
        )
    except TextTooLong as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except CannotWrite as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"interrupted: " + (f"wrote {args.out}: {got.audio_s:.2f}s of audio" if got.written
                                  else "no audio received"), file=sys.stderr)
        return 130
    except AudioFormatError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except GatewayError as exc:  # the gateway refused the connection (bad key, busy, loading)
        print(f"error: the gateway refused the connection: {exc}", file=sys.stderr)
        return 1
    except (OSError, websockets.InvalidURI, websockets.InvalidHandshake) as exc:
        print(f"error: cannot connect to {args.url}: {exc}", file=sys.stderr)
        return 1
    except websockets.WebSocketException as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if result["first_audio_s"] is None:
        print("no audio received; no WAV written", file=sys.stderr)
    else:
        print(
            f"wrote {args.out}: {result['audio_s']:.2f}s of audio, first audio after "
            f"{result['first_audio_s'] * 1000:.0f} ms, total {result['wall_s']:.2f}s"
            + (f"; {result['errors']:.0f} error(s) from the gateway" if result["errors"] else "")
        )
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
