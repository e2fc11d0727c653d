"""Stream a text file to the gateway as fake LLM tokens and save the audio as WAV.

    python -m gateway.stream_cli --url ws://localhost:8080/v1/tts/stream \\
        --voice alice --file text.txt --rate 30 --out out.wav

Tokens are whitespace-delimited words (with their leading space), sent ``--rate`` per
second, like an LLM streaming its answer. Prints the time to first audio. Exits with
status 1 when the gateway reported an error (the WAV then holds what audio there was), and
with 2 before sending anything when the file is longer than one context may be
(`ws.max_text_chars`).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import time
import wave
from pathlib import Path

import numpy as np

from .audio import decode_frames, resolve_format
from .client import GatewayClient


class TextTooLong(ValueError):
    """The text does not fit one context on this server."""


def fake_tokens(text: str) -> list[str]:
    """Split into word-sized pieces that concatenate back to the text exactly."""
    return re.findall(r"\s*\S+|\s+$", text)


async def stream_file(url: str, text: str, voice: str | None, rate: float, out: Path, fmt: str,
                      sample_rate: int | None, api_key: str | None) -> dict[str, float]:
    """Speak `text` into `out`; returns the timings and the count of error events."""
    af = resolve_format(fmt, sample_rate)
    async with await GatewayClient.connect(url, api_key=api_key) as gw:
        limit = gw.session.get("limits", {}).get("max_text_chars")
        if isinstance(limit, int) and len(text) > limit:
            raise TextTooLong(f"the text has {len(text)} characters; one context takes at most {limit} "
                              f"(the server's ws.max_text_chars)")
        settings = {"format": af.name, "sample_rate": af.sample_rate}
        if voice:
            settings["voice"] = voice
        await gw.configure(**settings)
        ctx = gw.context("cli-1")
        t0 = time.monotonic()
        first_audio: list[float] = []
        frames: list[bytes] = []
        errors = 0

        async def reader() -> None:
            async for item in ctx.stream():
                if isinstance(item, bytes):
                    if not first_audio:
                        first_audio.append(time.monotonic() - t0)
                    frames.append(item)
                elif item.get("type") == "error":
                    nonlocal errors
                    errors += 1
                    print(f"error: {item['code']}: {item['message']}", file=sys.stderr)
                elif item.get("type") == "segment_started":
                    print(f"[{item['audio_offset_ms'] / 1000:7.2f}s] {item['text'].strip()}", file=sys.stderr)

        read_task = asyncio.create_task(reader())
        for tok in fake_tokens(text):
            await ctx.send_text(tok)
            if rate > 0:
                await asyncio.sleep(1.0 / rate)
        await ctx.end()
        await read_task
    pcm = decode_frames(af, frames)
    with wave.open(str(out), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(af.sample_rate)
        w.writeframes(np.clip(np.rint(pcm * 32767), -32768, 32767).astype("<i2").tobytes())
    return {
        "first_audio_s": first_audio[0] if first_audio else float("nan"),
        "audio_s": len(pcm) / af.sample_rate,
        "wall_s": time.monotonic() - t0,
        "errors": errors,
    }


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
    text = args.file.read_text(encoding="utf-8")
    try:
        result = asyncio.run(
            stream_file(args.url, text, args.voice, args.rate, args.out, args.format, args.sample_rate, args.api_key)
        )
    except TextTooLong as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(
        f"wrote {args.out}: {result['audio_s']:.2f}s of audio, first audio after "
        f"{result['first_audio_s'] * 1000:.0f} ms, total {result['wall_s']:.2f}s"
        + (f"; {result['errors']:.0f} error(s) from the gateway" if result["errors"] else "")
    )
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
