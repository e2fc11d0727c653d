"""What a session's gateway-side work costs the host CPU, and what the encode threads buy.

    python -m bench.host_cost --json docs/bench/host_cost.json

Everything here runs in the gateway process, on its one event loop unless said otherwise:

* `text_path`: CPU time per incoming LLM-token message (JSON parse, protocol state,
  segmenter), over the load benchmark's paragraph cut into its token pieces.

The audio side, on the bundled speech recording (`assets/default.wav`, looped), fed in
engine-sized chunks:

* `formats`: CPU time per second of audio for one stream of each wire format (one
  thread, best of `--reps`), and what that means in real-time streams per core;
  Opus at each `--complexities` value with its bytes per second.
* `loop`: `--streams` streams paced in real time (each gets a chunk every `--chunk-s`
  seconds, starts staggered) on one asyncio loop, encoding through `EncodePool` with 0
  threads (on the loop, as before) and with `--threads`. A `LoopLagMonitor` measures
  how late the loop runs (what every WebSocket would see), and `behind_s` how far the
  last chunk's encoding ended after its real-time due time (> 0: encoding falls behind).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.playback import percentile
from bench.ws_load import DEFAULT_TEXT, split_tokens
from engine.wavio import read_wav
from gateway.audio import ENGINE_RATE, EncoderOptions, make_encoder, resolve_format
from gateway.encode_pool import EncodePool
from gateway.loop_monitor import LoopLagMonitor
from gateway.protocol import ConnectionState, ContextSettings, Speak, WsLimits, parse_client_message

ROOT = Path(__file__).resolve().parent.parent
FORMATS = (("pcm_s16le", 24000), ("pcm_s16le", 48000), ("ulaw_8000", 8000), ("opus", 24000), ("opus", 48000))


def speech(seconds: float) -> np.ndarray:
    pcm, sr = read_wav(ROOT / "assets" / "default.wav")
    if sr != ENGINE_RATE:
        raise SystemExit(f"assets/default.wav is {sr} Hz, expected {ENGINE_RATE}")
    x = np.asarray(pcm, np.float32).reshape(-1)
    return np.tile(x, int(np.ceil(seconds * ENGINE_RATE / x.size)))[: int(seconds * ENGINE_RATE)]


def text_path_cost(text: str, reps: int) -> dict[str, Any]:
    """CPU per text message, best of `reps` passes over 50 contexts of `text`."""
    limits = WsLimits()
    defaults = ContextSettings(voice="v", format=resolve_format("pcm_s16le", ENGINE_RATE))
    pieces = split_tokens(text)
    messages = [json.dumps({"type": "text", "context_id": "c", "text": p}) for p in pieces]
    end = json.dumps({"type": "end", "context_id": "c"})
    best, segments = float("inf"), 0
    for _ in range(reps):
        t = time.process_time()
        for _ in range(50):
            state = ConnectionState(defaults, limits)
            commands = [c for m in messages for c in state.handle(parse_client_message(m, limits))]
            commands += state.handle(parse_client_message(end, limits))
        best = min(best, time.process_time() - t)
        segments = sum(len(c.segments) for c in commands if isinstance(c, Speak))
    us = 1e6 * best / (50 * (len(messages) + 1))
    return {"messages_per_context": len(messages) + 1, "segments_per_context": segments,
            "cpu_us_per_message": round(us, 2), "messages_per_core_s": round(1e6 / us)}


def cpu_cost(fmt: str, rate: int, x: np.ndarray, chunk: int, opts: EncoderOptions, reps: int) -> dict[str, Any]:
    best, nbytes = float("inf"), 0
    for _ in range(reps):
        enc = make_encoder(fmt, rate, opts)
        t = time.process_time()
        frames = [f for i in range(0, x.size, chunk) for f in enc.encode(x[i : i + chunk])] + enc.flush()
        best = min(best, time.process_time() - t)
        nbytes = sum(map(len, frames))
    audio_s = x.size / ENGINE_RATE
    ms = 1e3 * best / audio_s
    return {"format": fmt, "sample_rate": rate, "cpu_ms_per_audio_s": round(ms, 3),
            "streams_per_core": round(1e3 / ms) if ms > 0 else None, "bytes_per_audio_s": round(nbytes / audio_s)}


async def paced_streams(x: np.ndarray, streams: int, threads: int, chunk_s: float, seconds: float,
                        opts: EncoderOptions) -> dict[str, Any]:
    chunk = int(chunk_s * ENGINE_RATE)
    lags: list[float] = []
    monitor = LoopLagMonitor(lags.append, interval=0.01)
    pool = EncodePool(threads)
    behind: list[float] = []
    loop = asyncio.get_running_loop()

    async def stream(i: int, t0: float) -> None:
        enc = make_encoder("opus", 48000, opts)
        start = t0 + chunk_s * i / streams
        k = 0
        while k * chunk_s < seconds:
            due = start + k * chunk_s
            await asyncio.sleep(max(0.0, due - loop.time()))
            off = (k * chunk) % max(1, x.size - chunk)
            await pool.encode(enc, x[off : off + chunk])
            behind.append(loop.time() - due - chunk_s)  # done after the next chunk was due: behind
            k += 1

    monitor.start()
    cpu0, t0 = time.process_time(), loop.time() + 0.05
    try:
        await asyncio.gather(*(stream(i, t0) for i in range(streams)))
    finally:
        await monitor.stop()
        pool.close()
    wall = loop.time() - t0
    return {"streams": streams, "threads": threads, "wall_s": round(wall, 3),
            "process_cpu_share": round((time.process_time() - cpu0) / wall, 3),
            "loop_lag_ms": {"p50": round(1e3 * percentile(lags, 50), 3), "p99": round(1e3 * percentile(lags, 99), 3),
                            "max": round(1e3 * max(lags), 3), "samples": len(lags)},
            "behind_s_max": round(max(behind), 4), "chunks_late": sum(1 for b in behind if b > 0)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=20.0, help="audio per stream in the format costs")
    p.add_argument("--chunk-s", type=float, default=1.0, help="engine chunk length fed to the encoders")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--complexities", default="0,5,8,10")
    p.add_argument("--streams", default="20,40", help="paced Opus streams per loop run")
    p.add_argument("--threads", type=int, default=2, help="encode threads of the pooled loop runs")
    p.add_argument("--loop-seconds", type=float, default=10.0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    x = speech(args.seconds)
    chunk = int(args.chunk_s * ENGINE_RATE)
    report: dict[str, Any] = {"cpu": os.cpu_count(), "chunk_s": args.chunk_s,
                              "text_path": text_path_cost(DEFAULT_TEXT, args.reps),
                              "formats": [], "opus_complexity": [], "loop": []}
    tp = report["text_path"]
    print(f"text path: {tp['cpu_us_per_message']:.2f} us CPU per LLM-token message "
          f"({tp['messages_per_core_s']} messages per core-second; {tp['segments_per_context']} segments per context)")
    for fmt, rate in FORMATS:
        resolve_format(fmt, rate)
        row = cpu_cost(fmt, rate, x, chunk, EncoderOptions(), args.reps)
        report["formats"].append(row)
        print(f"{fmt:10s} {rate:6d} Hz  {row['cpu_ms_per_audio_s']:8.3f} ms CPU / audio s   "
              f"{row['streams_per_core']:>7} streams/core")
    for c in (int(v) for v in args.complexities.split(",")):
        row = cpu_cost("opus", 48000, x, chunk, EncoderOptions(opus_complexity=c), args.reps) | {"complexity": c}
        report["opus_complexity"].append(row)
        print(f"opus 48 kHz complexity {c:2d}  {row['cpu_ms_per_audio_s']:7.3f} ms CPU / audio s  "
              f"{row['streams_per_core']:>5} streams/core  {row['bytes_per_audio_s']} B/s")
    for n in (int(v) for v in args.streams.split(",")):
        for threads in (0, args.threads):
            row = asyncio.run(paced_streams(x, n, threads, args.chunk_s, args.loop_seconds, EncoderOptions()))
            report["loop"].append(row)
            lag = row["loop_lag_ms"]
            print(f"{n:4d} opus streams, {threads} encode threads: loop lag p50 {lag['p50']:.2f} ms p99 {lag['p99']:.2f} "
                  f"max {lag['max']:.2f} ms; process CPU {row['process_cpu_share']:.2f} cores; "
                  f"late chunks {row['chunks_late']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
