"""In-process engine benchmark: N concurrent synthetic sessions, no network.

    python -m bench.engine_bench --model tiny-random --sessions 8
    python -m bench.engine_bench --model /data/full-random --device cuda --lm-backend vllm --sessions 1,16,64

Each session submits `--utterances` sentences at once (a voice agent's turn) and plays
the audio back in real time in its head: playback starts when the first chunk arrives,
and a chunk that arrives after the playback clock reached its first sample is an
underrun. Reported per concurrency level: first-chunk latency percentiles (submit ->
first audio of each session's first utterance), inter-chunk gaps, underruns, RTF
(compute time / audio time, per session and aggregate), and the engine's batch sizes.
Random weights never emit eos, so speech length is fixed with --tokens-per-text-token.

Text arriving from an LLM (`--mode segment|stream --text-rate 30`): each session's
turn is produced token by token at --text-rate tokens/s and first audio is measured
from the FIRST text token. `segment` cuts the text with the gateway's segmenter and
submits each segment when it is complete (today's WebSocket default); `stream` feeds
words to the LM as they arrive (text-in streaming, `Session.submit_stream`), the
segmenter only bounding utterances -- exactly what the WebSocket `text_mode` does.
`--mode batch` (default) submits all text at once at t=0.

    python -m bench.engine_bench --sessions 1 --mode segment --text-rate 30
    python -m bench.engine_bench --sessions 1 --mode stream --text-rate 30
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine.config import EngineConfig
from engine.engine import Engine
from engine.hub import resolve_model
from engine.types import AudioChunk, SessionOptions, UtteranceError
from engine.wavio import read_wav

ROOT = Path(__file__).resolve().parent.parent
TEXTS = [
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Streaming speech should start quickly and never stop in the middle.",
    "Every session shares the same GPU with hundreds of other conversations.",
    "This sentence closes the turn and the agent waits for the user.",
]


@dataclass
class SessionResult:
    first_audio_s: float = 0.0
    gaps_s: list[float] = field(default_factory=list)
    underruns: int = 0
    max_late_s: float = 0.0
    audio_s: float = 0.0
    wall_s: float = 0.0
    errors: int = 0


async def produce_text(engine: Engine, sess, text: str, mode: str, rate: float) -> None:
    """Deliver `text` token by token at `rate` tokens/s (an LLM), as `mode` would."""
    from gateway.protocol import StreamCutter
    from gateway.segmenter import Segmenter

    ids = engine.tokenizer.encode(text)
    pieces = [engine.tokenizer.decode([i]) for i in ids]
    seg = Segmenter()
    cutter = StreamCutter()
    feeds: dict[int, object] = {}
    received = ""
    start = time.perf_counter()

    async def handle(segs, final: bool = False) -> None:
        if mode == "segment":
            for sg in segs:
                if sg.speakable:
                    await sess.submit(sg.text.strip())
            return
        for cmd in cutter.advance("b", received, segs, final):
            if cmd.index not in feeds:
                _, feeds[cmd.index] = await sess.submit_stream()
            feed = feeds[cmd.index]
            feed.append(cmd.text)
            if cmd.close:
                feed.close()

    for k, piece in enumerate(pieces):
        delay = start + k / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        received += piece
        await handle(seg.push(piece))
    await handle(seg.end(), final=True)
    await sess.finish()


async def one_session(engine: Engine, voice, idx: int, n_utts: int, tptt: float, opts_kw: dict,
                      mode: str = "batch", text_rate: float = 30.0) -> SessionResult:
    res = SessionResult()
    sr = engine.sample_rate
    sess = engine.open_session(voice, SessionOptions(tokens_per_text_token=tptt, seed=idx, **opts_kw))
    t0 = time.perf_counter()  # batch: all text now; segment/stream: the first text token
    producer = None
    if mode == "batch":
        for k in range(n_utts):
            await sess.submit(TEXTS[(idx + k) % len(TEXTS)])
        await sess.finish()
    else:
        turn = " ".join(TEXTS[(idx + k) % len(TEXTS)] for k in range(n_utts))
        producer = asyncio.create_task(produce_text(engine, sess, turn, mode, text_rate))
    play_start = None
    played = 0  # samples scheduled before this chunk
    last = None
    async for ev in sess.events():
        now = time.perf_counter()
        if isinstance(ev, UtteranceError):
            res.errors += 1
            continue
        assert isinstance(ev, AudioChunk)
        if play_start is None:
            play_start = now
            res.first_audio_s = now - t0
        else:
            due = play_start + played / sr
            if now > due:
                res.underruns += 1
                res.max_late_s = max(res.max_late_s, now - due)
            res.gaps_s.append(now - last)
        last = now
        played += ev.pcm.size
    if producer is not None:
        await producer
    res.audio_s = played / sr
    res.wall_s = time.perf_counter() - t0
    return res


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


async def run_level(engine: Engine, voice, n: int, args) -> dict:
    opts_kw = {}
    if args.initial_hop is not None:
        opts_kw["initial_hop"] = args.initial_hop
    before = engine.stats()
    t0 = time.perf_counter()
    results = await asyncio.gather(
        *(one_session(engine, voice, i, args.utterances, args.tokens_per_text_token, opts_kw,
                      args.mode, args.text_rate) for i in range(n))
    )
    wall = time.perf_counter() - t0
    after = engine.stats()
    first = [r.first_audio_s for r in results]
    gaps = [g for r in results for g in r.gaps_s]
    audio = sum(r.audio_s for r in results)
    return {
        "sessions": n,
        "first_audio_ms": {"p50": pct(first, 50) * 1e3, "p95": pct(first, 95) * 1e3, "p99": pct(first, 99) * 1e3,
                           "max": max(first) * 1e3},
        "chunk_gap_ms": {"p50": pct(gaps, 50) * 1e3, "p95": pct(gaps, 95) * 1e3, "max": (max(gaps) if gaps else 0) * 1e3},
        "underruns": sum(r.underruns for r in results),
        "sessions_with_underrun": sum(1 for r in results if r.underruns),
        "max_late_ms": max(r.max_late_s for r in results) * 1e3,
        "audio_s": audio,
        "wall_s": wall,
        "rtf_aggregate": wall / audio if audio else float("nan"),
        "rtf_per_session_p50": statistics.median(r.wall_s / r.audio_s for r in results if r.audio_s),
        "errors": sum(r.errors for r in results),
        "flow_batches": after.batches - before.batches,
        "mean_flow_batch": (after.chunks - before.chunks) / max(1, after.batches - before.batches),
        "max_flow_batch": after.max_batch_size,
        "lm_tokens": after.lm_tokens - before.lm_tokens,
        "lm_tokens_per_s": (after.lm_tokens - before.lm_tokens) / wall,
        # Wall time the flow+vocoder worker was busy: near wall_s means the audio stage is the bottleneck.
        "stage_busy_s": after.stage_busy_seconds - before.stage_busy_seconds,
        "stage_busy_share": (after.stage_busy_seconds - before.stage_busy_seconds) / wall,
    }


async def main_async(args) -> dict:
    model_dir = resolve_model(args.model, Path(args.cache_dir))
    cfg = EngineConfig(
        model_dir=model_dir,
        device=args.device,
        lm_backend=args.lm_backend,
        flow_left_context=args.flow_left_context,
        warmup=True,
        text_normalization=not args.no_text_normalization,
    )
    t0 = time.perf_counter()
    engine = await Engine.create(cfg)
    load_s = time.perf_counter() - t0
    wav, sr = read_wav(ROOT / "assets" / "default.wav")
    transcript = (ROOT / "assets" / "default.txt").read_text().strip()
    if args.prompt_seconds:
        # A shorter voice prompt (text-in streaming needs ~P/3 text tokens before the
        # first speech token). The transcript is cut proportionally: approximate, which
        # is fine for latency with random weights.
        keep = min(1.0, args.prompt_seconds * sr / len(wav))
        wav = wav[: int(len(wav) * keep)]
        words = transcript.split()
        transcript = " ".join(words[: max(1, round(len(words) * keep))])
    voice = await engine.prepare_voice("bench", wav, sr, transcript)
    report = {
        "model": str(args.model),
        "device": str(engine.device),
        "lm_backend": engine.backend.name,
        "tokens_per_text_token": args.tokens_per_text_token,
        "mode": args.mode,
        "text_rate": args.text_rate if args.mode != "batch" else None,
        "utterances_per_session": args.utterances,
        "prompt_tokens": voice.num_tokens,
        "prompt_transcript": transcript,
        "load_s": load_s,
        "levels": [],
    }
    try:
        levels = [int(x) for x in str(args.sessions).split(",")]
        for n in levels:
            if args.warm_level:
                await run_level(engine, voice, n, args)  # compile/JIT every batch shape first
            lvl = await run_level(engine, voice, n, args)
            report["levels"].append(lvl)
            print(
                f"sessions={n:4d} first_audio p50={lvl['first_audio_ms']['p50']:.0f} p95={lvl['first_audio_ms']['p95']:.0f} "
                f"p99={lvl['first_audio_ms']['p99']:.0f} ms | gap p95={lvl['chunk_gap_ms']['p95']:.0f} ms | "
                f"underruns={lvl['underruns']} ({lvl['sessions_with_underrun']} sessions) | "
                f"RTF agg={lvl['rtf_aggregate']:.3f} | flow batch mean={lvl['mean_flow_batch']:.1f} | "
                f"LM {lvl['lm_tokens_per_s']:.0f} tok/s | stage busy {lvl['stage_busy_share']:.0%} | errors={lvl['errors']}",
                flush=True,
            )
    finally:
        await engine.close()
    return report


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-random")
    p.add_argument("--cache-dir", default="data/models")
    p.add_argument("--device", default="auto")
    p.add_argument("--lm-backend", default="auto")
    p.add_argument("--sessions", default="8", help="comma-separated concurrency levels")
    p.add_argument("--utterances", type=int, default=2, help="sentences per session")
    p.add_argument("--tokens-per-text-token", type=float, default=3.0,
                   help="speech tokens generated per text token (random weights never stop by themselves)")
    p.add_argument("--initial-hop", type=int, default=None)
    p.add_argument("--mode", choices=["batch", "segment", "stream"], default="batch",
                   help="batch: all text at t=0; segment/stream: text arrives at --text-rate (see above)")
    p.add_argument("--text-rate", type=float, default=30.0, help="text tokens per second (segment/stream modes)")
    p.add_argument("--prompt-seconds", type=float, default=None, help="cut the voice prompt to this length")
    p.add_argument("--flow-left-context", type=int, default=50)
    p.add_argument("--warm-level", action="store_true", help="run each level once untimed first")
    p.add_argument("--no-text-normalization", action="store_true",
                   help="skip wetext (the bench sentences are plain words; wetext is not on the GPU image)")
    p.add_argument("--json", type=Path, default=None, help="write the report here")
    args = p.parse_args(argv)
    report = asyncio.run(main_async(args))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
