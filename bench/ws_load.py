"""WebSocket load benchmark: N concurrent streaming sessions against a real gateway.

    python -m bench.ws_load --launch --model tiny-random --engine.device cpu \\
        --sessions 1,2,4 --baseline --baseline-sessions 1,2 --rate 30 --json out.json --plot out.svg
    python -m bench.ws_load --url http://127.0.0.1:8080 --sessions 8,32 --rate 0

`--launch` starts `python -m gateway` itself (every option this tool does not know is
passed to the gateway), so it knows the server's PID and can start the *baseline*: the
same code made like the seed project (`BASELINE_FLAGS`): each chunk its own flow/vocoder
call, no batching across sessions (`--engine.max-gpu-batch 1`); the flow re-reads the whole
prefix, prompt included, every chunk (`--engine.flow-left-context -1
--engine.flow-prompt-cache false`, no context cache, no flow CUDA graphs); and a fixed chunk
schedule: the first chunk is always `initial_hop` tokens (the load-aware first-chunk planner
off: `--engine.initial-hop-max 0`, so neither the idle nor the min hop below it), no chunk
waits to be cut big (`--engine.chunk-patience-s 0`), no stage round waits for expected first
chunks (`--engine.first-chunk-hold-ms 0 --engine.first-chunk-hold-share 0`) or is cut for
deadlines (`--engine.stage-deadline-cut false`); under MPS the stage is a client of vLLM's
priority (`--engine.stage-mps-priority normal`). The stage still takes first chunks heard
after silence before other queued chunks (`--engine.stage-policy` has no plain FIFO); with
one chunk per round that only orders the queue. `--url` measures a running gateway.

Per level, N sessions connect (idle), then start together (or spread over `--ramp`
seconds; one ramp per level, `--ramp 16,16,0,0`, runs both kinds on one gateway). Each opens one context with a registered 3-5 s voice, streams the paragraph
as LLM-like word pieces at `--rate` pieces/s (0 = in one message), flushes, ends, and
plays the audio on a virtual real-time clock (`bench.playback`). With `--register-at S`,
S seconds into each level one more voice is registered over HTTP, as a user would while
others are served (`registration`: how long the request took, what it answered). Per level,
`sessions_playing_at_once` is the most sessions whose audio played at the same moment (all
of them in a burst, or over a ramp shorter than a session's audio).

Reported per level (see `level_report`): first-audio latency from the moment a
segment's text was complete (its last character sent, or the flush that closed it; with
`--text-mode stream`, where the model reads a segment while it arrives, from its FIRST
character sent) to its first audio byte -- for each context's first segment
(`first_audio_ms`, the headline) and for every segment (`segment_first_audio_ms`; later
segments also wait for the earlier ones' audio, since a context's audio is delivered in
order). A session that ended (timed out, failed) before its first audio counts in them
at the time it had waited, a lower bound, and in `first_audio_censored`; one that ended
with audio still owed counts the silence from its playhead running out to its end as an
underrun. Also how long
before the playhead reached it each later segment's first audio came (`segment_lead_ms`:
a segment made behind seconds of earlier audio has a long latency but a lead) --
chunk gaps, underruns and where in their segment's audio they began (`underrun_at_audio_ms`), RTF
(`RTF_DEFINITION`: the time the TTS had text to speak and audio still to send, per second
of audio, so the simulated LLM's pacing is left out; the old first-text-to-last-audio
ratio is `rtf_wall_incl_text_pacing`), completed sessions and errors, GPU utilisation
(pynvml) and achieved model FLOP/s against the measured bf16 peak (`bench.flops`) over the
whole level (`wall_s`: its start to its last session's end, timeouts included;
`last_audio_s`: to its last audio), GPU memory and RSS (the gateway process from
`/metrics`, `rss`; with `--launch`, also it and its child processes -- the stage
process, vLLM's engine core -- from /proc, `rss_tree`, by proportional set size so shared
pages count once) per started and per peak-active session, and the server's breakdown of every
utterance's first chunk (`first_chunk_phases_ms`, means: text in -> first speech token,
-> the chunk's tokens decoded and queued, -> its stage batch starts, -> audio back; and
`tokens`, its mean size in speech tokens, which `engine.first_chunk` sizes by the load;
`opening_chunk_phases_ms`: the same for each context's first segment only, the one
`first_audio_ms` measures; `slow_opening_chunk_phases_ms`: of those, the ones that took
500 ms or more in the server, the tail a p95 over the bar is made of;
`opening_second_chunk_ms`: the first segments' second chunks, from tokens ready to queued,
batch start and audio, how many came after the first chunk's audio had run out, how
many with less than 100 ms to spare, and how many were past the deadline cut's deadline
when their batch started), and with
`--engine.lm-timing true` vLLM's own account of the LM requests (`lm_server_ms`: queued
and prefill in its engine core, its time to first token, its decode time per token).

Speech length. Random weights never stop speaking, so the gateway generates a fixed
number of speech tokens per text token (`--engine.tokens-per-text-token`). The bench
sets it so that the *audio* is as long as real speech of the text would be: English is
spoken at about 14 characters per second (150 words/min of 4.7-letter words plus a
space) and CosyVoice3 emits 25 speech tokens per second, so a text of C characters
gets 25 * C / 14 speech tokens, divided by the number of text tokens the served
model's tokenizer makes of it. With the real Qwen2 tokenizer (about 4.4 characters per
English token) that is about 7.9 speech tokens per text token; the random models' small
stand-in tokenizer cuts text into ~2x more pieces, hence a ~2x smaller factor for the
same audio length. `--tokens-per-text-token` overrides it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import math
import os
import re
import statistics
import tempfile
import threading
import time
import wave
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import httpx
import numpy as np

from bench.launch import LaunchedGateway, rss_bytes
from bench.machine import describe_machine
from bench.machine import summary as machine_summary
from bench.playback import (
    Arrival,
    covered_s,
    percentile,
    percentile_above,
    ratio,
    simulate_playback,
    summary_ms,
    text_first_byte_time,
    text_ready_time,
)
from bench.svg_plot import Chart, Series, render_svg
from gateway.audio import AudioFormat, resolve_format

ROOT = Path(__file__).resolve().parent.parent
SAMPLE_RATE = 24000
SPEECH_TOKENS_PER_SECOND = 25.0
SPOKEN_CHARS_PER_SECOND = 14.0
PROMPT_SECONDS = 4.25  # the first sentence of assets/default.wav (a 3-5 s prompt)
GATEWAY_LOG_LINES = 200  # the last lines of each launched gateway's log kept in the report
PROMPT_TRANSCRIPT = "Hello, this is the default voice of the CosyVoice gateway."
BASELINE_FLAGS = (
    # Per-request flow/vocoder (no batching across sessions), whole-prefix recompute.
    "--engine.max-gpu-batch", "1", "--engine.flow-left-context", "-1", "--engine.flow-cuda-graphs", "false",
    "--engine.flow-prompt-cache", "false", "--engine.flow-context-cache-mib", "0",
    # A fixed chunk schedule. The first-chunk planner runs only while
    # 0 < initial_hop < initial_hop_max: 0 turns it off whatever initial_hop the run sets,
    # and with it the idle and min hops (planner-only; set to 0 as well so that they stay
    # off should that rule change). No chunk cut big for not being awaited, no round held
    # for expected first chunks or cut for deadlines.
    "--engine.chunk-patience-s", "0", "--engine.initial-hop-max", "0", "--engine.idle-initial-hop", "0",
    "--engine.first-chunk-min-hop", "0", "--engine.first-chunk-hold-ms", "0", "--engine.first-chunk-hold-share", "0",
    "--engine.stage-deadline-cut", "false",
    # Both MPS clients at one priority, as one process would have: the stage below vLLM is
    # the product's (round 55 of docs/benchmarks.md), and it slows the baseline's
    # one-chunk rounds (round 61 ran the baseline with it: RTF 0.815 at 8 sessions against
    # round 40's 0.413).
    "--engine.stage-mps-priority", "normal",
)
DEFAULT_TEXT = (
    "Thanks for calling, I have found your order. It shipped this morning and should arrive "
    "on Tuesday between nine and eleven. Would you like me to send the tracking link by text "
    "message, or is there anything else I can help you with today?"
)
VOICE_ID = "bench-voice"
# What the latencies, RTF and wall time measure (written into each report's settings).
FIRST_AUDIO_DEFINITIONS = {
    "segment": "segment text complete (last character sent, or the flush that closed it) "
               "-> first audio byte of that segment",
    "stream": "segment's FIRST text character sent (stream mode: the model reads a segment while it arrives, "
              "and segment_started.text_end is only the text received so far) -> first audio byte of that segment",
}
CENSORING_DEFINITION = (
    "a session that ended (timeout, error, closed connection) before a segment's first audio counts in "
    "first_audio_ms / segment_first_audio_ms at the time it had waited, from that segment's start point (when "
    "unknown: the last text sent before it ended) to its end: a lower bound; first_audio_censored and "
    "segment_first_audio_censored count them. One that ended with audio still owed counts the silence from its "
    "playhead running out (or its last text, if later) to its end as one more underrun. Sessions that failed to "
    "connect are in errors and completed only.")
RTF_DEFINITION = (
    "per completed session: time during which some segment's text was complete (stream mode: its last "
    "character, i.e. the next segment's first, or the final flush) and its last audio had not arrived (the "
    "union of those intervals), divided by the session's audio seconds; rtf is the median, a session that did "
    "not complete ranks above every measured one (rtf_censored; rtf_max is null with any). "
    "rtf_wall_incl_text_pacing: (last audio - first text sent) / audio seconds, which includes the simulated "
    "LLM's text pacing (rtf's definition in reports made before this field existed)")
WALL_DEFINITION = ("wall_s: the level's start to the end of its last session (timeouts included; the window of "
                   "the GPU sampler, FLOP/s and stage shares); last_audio_s: the level's start to its last audio")
# The bench's client loops are probed this often for lateness (`client_loop_lag_ms`), and a
# level whose probe woke later than this warns.
CLIENT_LAG_INTERVAL_S = 0.01
CLIENT_LAG_WARN_MS = 20.0
# A registration captures the voice's flow graphs when its prompt width is new (~1 min on
# the H200): the client waits this long for one.
REGISTRATION_TIMEOUT_S = 600.0

# /metrics series the report reads (the engine's counters and gauges, gateway RSS).
M_LM = "cosyvoice_engine_lm_tokens_total"
M_FLOW = "cosyvoice_engine_flow_frames_total"
M_VOC = "cosyvoice_engine_vocoder_frames_total"
M_GROWN_CHUNKS = "cosyvoice_engine_flow_grown_chunks_total"
M_GROWN_TOKENS = "cosyvoice_engine_flow_grown_tokens_total"
M_CONTEXT_READS = "cosyvoice_engine_context_reads_total"
M_CONTEXT_RECORDS = "cosyvoice_engine_context_records_total"
M_CHUNKS = "cosyvoice_engine_chunks_total"
M_BATCHES = "cosyvoice_engine_batches_total"
M_BUSY = "cosyvoice_engine_stage_busy_seconds_total"
M_HANDOFF = "cosyvoice_engine_stage_handoff_seconds_total"
M_CUDA = "cosyvoice_engine_cuda_memory_allocated_bytes"
M_RSS = "cosyvoice_process_resident_memory_bytes"
M_ACTIVE = "cosyvoice_engine_active_sessions"
M_LAG = "cosyvoice_event_loop_lag_seconds"
M_LOOP_CPU = "cosyvoice_event_loop_cpu_seconds_total"
M_LOOP_INFO = 'cosyvoice_event_loop_info{loop="'
SERVER_WINDOW = "bench:idle_to_after_seconds"  # not a gateway series: the bench's own clock
# Nor these: the launched gateway's process and its descendants (the stage process, vLLM's
# engine core) from /proc, their summed RSS and how many there were.
TREE_RSS = "bench:process_tree_rss_bytes"
TREE_PROCS = "bench:process_tree_processes"
# Where each utterance's first chunk spends its time (engine counters of summed seconds).
FIRST_CHUNK_PHASES = {
    "lm_first_token": "cosyvoice_engine_first_chunk_lm_first_token_seconds_total",
    "lm_decode": "cosyvoice_engine_first_chunk_lm_decode_seconds_total",
    "stage_wait": "cosyvoice_engine_first_chunk_stage_wait_seconds_total",
    "stage": "cosyvoice_engine_first_chunk_stage_seconds_total",
}


# ---- text -------------------------------------------------------------------------------

_PIECE = re.compile(r"\s*[A-Za-z0-9']+|\s*[^\sA-Za-z0-9']+|\s+")


def split_tokens(text: str, max_piece: int = 5) -> list[str]:
    """Cut text into LLM-like pieces: a word with its leading space, punctuation on its
    own, long words in pieces of at most `max_piece` characters. Joined they give `text`."""
    out: list[str] = []
    for m in _PIECE.finditer(text):
        piece = m.group(0)
        while len(piece) > max_piece:
            out.append(piece[:max_piece])
            piece = piece[max_piece:]
        if piece:
            out.append(piece)
    return out


def calibrated_tokens_per_text_token(text: str, n_text_tokens: int,
                                     chars_per_second: float = SPOKEN_CHARS_PER_SECOND) -> float:
    """Speech tokens per text token that make `text` as long as it would be spoken."""
    if n_text_tokens <= 0:
        raise ValueError("the text has no tokens")
    speech_tokens = SPEECH_TOKENS_PER_SECOND * len(text.strip()) / chars_per_second
    return round(speech_tokens / n_text_tokens, 2)


def prompt_wav(whole: bool = False) -> tuple[bytes, str]:
    """The benchmark voice: the first 4.25 s (first sentence) of assets/default.wav; with
    `whole`, all of it (6.6 s: a cached prompt prefix of another graph width)."""
    from engine.wavio import read_wav

    pcm, sr = read_wav(ROOT / "assets" / "default.wav")
    if whole:
        return _wav_bytes(pcm, sr), (ROOT / "assets" / "default.txt").read_text().strip()
    return _wav_bytes(pcm[: int(PROMPT_SECONDS * sr)], sr), PROMPT_TRANSCRIPT


def _wav_bytes(pcm: np.ndarray, sr: int) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sr)
        w.writeframes((np.clip(pcm, -1, 1) * 32767).astype("<i2").tobytes())
    return buf.getvalue()


# ---- the gateway ------------------------------------------------------------------------


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {series (name with labels): value}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[name] = float(value)
    return out


async def scrape(client: httpx.AsyncClient) -> dict[str, float]:
    resp = await client.get("/metrics")
    resp.raise_for_status()
    return parse_metrics(resp.text)


async def planner_state(client: httpx.AsyncClient) -> dict[str, Any] | None:
    """The gateway's `/debug/planner` at the end of a level: the round times and LM rates
    its first chunks were sized on. None from a gateway without it (an older build)."""
    resp = await client.get("/debug/planner")
    return resp.json() if resp.status_code == 200 else None


async def ensure_voice(client: httpx.AsyncClient, voice_id: str) -> dict[str, Any]:
    audio, transcript = prompt_wav()
    resp = await client.post("/v1/voices", data={"id": voice_id, "transcript": transcript},
                             files={"file": ("prompt.wav", audio, "audio/wav")})
    if resp.status_code not in (200, 201, 409):
        raise RuntimeError(f"voice registration failed: {resp.status_code} {resp.text}")
    return {"voice_id": voice_id, "prompt_seconds": PROMPT_SECONDS, "transcript": transcript,
            "registered": resp.status_code != 409}


async def register_meanwhile(client: httpx.AsyncClient, t0: float, after_s: float, voice_id: str) -> dict[str, Any]:
    """`after_s` seconds after perf_counter `t0` (the level's start), register a voice the gateway has not seen (all of
    assets/default.wav, a longer prompt than the sessions' voice), as a user would while
    the level's sessions are served: how long the request took and what it answered.
    A voice whose prompt needs flow graphs not captured yet captures them at registration,
    on the stage every session's rounds run on."""
    await asyncio.sleep(max(0.0, t0 + after_s - time.perf_counter()))
    audio, transcript = prompt_wav(whole=True)
    start = time.perf_counter()
    try:
        resp = await client.post("/v1/voices", data={"id": voice_id, "transcript": transcript},
                                 files={"file": ("voice.wav", audio, "audio/wav")})
        status: int | str = resp.status_code
    except httpx.HTTPError as e:
        status = type(e).__name__
    return {"voice_id": voice_id, "at_s": round(start - t0, 3),  # into the level, as it came
            "seconds": round(time.perf_counter() - start, 3), "status": status}


# ---- one session ------------------------------------------------------------------------


@dataclass
class SegmentSeen:
    index: int
    text_end: int  # stream mode: the text received when its audio began, not its end
    started_at: float
    first_audio_at: float | None = None
    text_start: int = 0  # exact in both modes


@dataclass
class SessionRecord:
    """What one client did and saw, with client-clock (perf_counter) times."""

    sends: list[tuple[float, int]] = field(default_factory=list)  # (t, chars sent so far)
    flushes: list[tuple[float, int]] = field(default_factory=list)
    segments: list[SegmentSeen] = field(default_factory=list)
    audio: list[tuple[float, int, int]] = field(default_factory=list)  # (t, samples, segment position)
    errors: list[str] = field(default_factory=list)
    done_at: float | None = None
    completed: bool = False
    started_at: float | None = None  # when it began sending
    # When the client stopped waiting: `done`, its timeout, an error or a closed connection.
    # A session that failed is measured up to here, not only up to its last audio.
    ended_at: float | None = None


@dataclass(frozen=True)
class SessionResult:
    completed: bool
    errors: tuple[str, ...]
    first_audio_s: float | None
    segment_first_audio_s: tuple[float, ...]
    gaps_s: tuple[float, ...]
    underruns: int
    underrun_s: float
    text_wait_s: float
    audio_s: float
    generation_s: float | None  # first text sent -> last audio byte
    underrun_at_s: tuple[float, ...] = ()  # audio of its segment played when each underrun began
    underrun_segment: tuple[int, ...] = ()  # the segment of each underrun
    underrun_since_start_s: tuple[float, ...] = ()  # when each began, after playback started
    playing: tuple[float, float] | None = None  # its playback's start and end (client clock)
    segment_leads_s: tuple[float, ...] = ()  # later segments' first audio before the playhead got there
    # first_audio_s is only the time waited until the session ended without its first audio
    # (a lower bound; None where not even that is known).
    first_audio_censored: bool = False
    segment_first_audio_censored: int = 0  # as many of segment_first_audio_s are such lower bounds
    # Seconds during which some segment's text was complete and its last audio had not come
    # (`tts_busy_s`): the RTF's numerator, without the time the text took to arrive.
    tts_s: float | None = None


def playing_at_once(results: Sequence[SessionResult]) -> int:
    """The most sessions whose audio played at the same moment: with starts spread over a
    ramp shorter than a session's audio, all of them; a longer ramp, fewer."""
    edges = sorted((t, step) for r in results if r.playing is not None
                   for t, step in ((r.playing[0], 1), (r.playing[1], -1)))  # an end before a start at one t
    most = now = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


def segment_start_points(rec: SessionRecord, text_mode: str = "segment") -> list[float | None]:
    """Per segment seen, when its first-audio wait begins: its text complete (segment
    mode), or its first character sent (stream mode, where `text_end` is only the text
    received when its audio began, an arbitrary piece of it)."""
    if text_mode == "stream":
        return [text_first_byte_time(s.text_start, rec.sends) for s in rec.segments]
    return [text_ready_time(s.text_end, rec.sends, rec.flushes) for s in rec.segments]


def segment_complete_times(rec: SessionRecord, text_mode: str = "segment") -> list[float | None]:
    """Per segment seen, when its whole text had been sent. In stream mode a segment ends
    where the next one starts (`text_start` is exact), the last one at the text sent."""
    if text_mode != "stream":
        return [text_ready_time(s.text_end, rec.sends, rec.flushes) for s in rec.segments]
    sent = rec.sends[-1][1] if rec.sends else 0
    ends = [nxt.text_start for nxt in rec.segments[1:]] + [sent]
    return [text_ready_time(e, rec.sends, rec.flushes) for e in ends]


def tts_busy_s(rec: SessionRecord, text_mode: str = "segment") -> float | None:
    """Seconds during which some segment's text was complete and its last audio had not
    arrived: the union of [text complete, last audio] over the segments, so that a
    context's segments queued behind one another count once, and the time the simulated
    LLM took to write the text counts not at all. None without audio."""
    last: dict[int, float] = {}
    for t, _, pos in rec.audio:
        if pos >= 0:
            last[pos] = t
    if not last:
        return None
    complete = segment_complete_times(rec, text_mode)
    return covered_s((complete[pos], t) for pos, t in last.items() if complete[pos] is not None)


def _censored_wait(rec: SessionRecord, start: float | None, text_mode: str) -> float | None:
    """How long a session that ended without a segment's first audio had waited for it:
    from `start` (its start point, when known) to its end. Without one (the segment was
    never announced), from a point the start cannot have been later than, so that the wait
    stays a lower bound: the first character sent in stream mode, else the last text sent
    before the end (the flush, once sent, closed the first segment)."""
    if rec.ended_at is None:
        return None
    if start is None:
        if text_mode == "stream":
            start = rec.sends[0][0] if rec.sends else rec.started_at
        else:
            sent = [t for t, _ in [*rec.sends, *rec.flushes] if t <= rec.ended_at]
            start = max(sent) if sent else rec.started_at
    return None if start is None else max(0.0, rec.ended_at - start)


def analyse(rec: SessionRecord, sample_rate: int = SAMPLE_RATE, prebuffer_s: float = 0.0,
            text_mode: str = "segment") -> SessionResult:
    """Latencies and playback of one session from its record (pure). A session that did
    not complete is measured up to its end (`ended_at`): a first audio it never got
    counts at the time waited (censored), and audio it was still owed stalls playback."""
    starts = segment_start_points(rec, text_mode)
    lat: list[float] = []
    censored_segments = 0
    for s, r in zip(rec.segments, starts):
        if s.first_audio_at is not None and r is not None:
            lat.append(s.first_audio_at - r)
        elif s.first_audio_at is None and not rec.completed:
            wait = _censored_wait(rec, r, text_mode)
            censored_segments += 1
            if wait is not None:
                lat.append(wait)
    first, first_censored = None, False
    if rec.segments and rec.segments[0].first_audio_at is not None and starts[0] is not None:
        first = rec.segments[0].first_audio_at - starts[0]
    elif not rec.completed:
        first_censored = True
        first = _censored_wait(rec, starts[0] if rec.segments else None, text_mode)
        if not rec.segments:  # never announced: the segment list above did not count it
            censored_segments += 1
            if first is not None:
                lat.append(first)
    arrivals: list[Arrival] = []
    seen: set[int] = set()
    for t, samples, pos in rec.audio:
        ready_at = None
        if pos >= 0 and pos not in seen:
            seen.add(pos)
            ready_at = starts[pos]
        arrivals.append(Arrival(t, samples, ready_at, pos))
    # Audio still owed when the session ended: the silence after the playhead ran out is an
    # underrun, after the last text it had sent (before that, the text may not have been
    # there yet). Silence before any audio is the censored first audio above instead.
    end = end_ready = None
    if not rec.completed and rec.audio and rec.ended_at is not None:
        end = rec.ended_at
        sent = [t for t, _ in [*rec.sends, *rec.flushes] if t <= end]
        end_ready = max(sent) if sent else None
    pb = simulate_playback(arrivals, sample_rate, prebuffer_s, end, end_ready)
    gen = rec.audio[-1][0] - rec.sends[0][0] if rec.audio and rec.sends else None
    return SessionResult(rec.completed, tuple(rec.errors), first, tuple(lat), pb.gaps_s, pb.underruns,
                         pb.underrun_s, pb.text_wait_s, pb.audio_s, gen, pb.underrun_at_s, pb.underrun_segment,
                         pb.underrun_since_start_s,
                         (pb.play_start, pb.play_end) if pb.play_start is not None and pb.play_end is not None
                         else None, pb.segment_leads_s, first_censored, censored_segments, tts_busy_s(rec, text_mode))


class WsSession:
    """One WebSocket connection carrying one context (a turn)."""

    def __init__(self, ws_url: str, idx: int, headers: dict[str, str] | None,
                 fmt: AudioFormat = AudioFormat("pcm_s16le", SAMPLE_RATE)) -> None:
        self.ws_url, self.idx, self.headers, self.fmt = ws_url, idx, headers, fmt
        self.ws: Any = None
        self.rec = SessionRecord()

    async def connect(self, timeout: float) -> None:
        import websockets

        self.ws = await websockets.connect(self.ws_url, additional_headers=self.headers, max_size=None,
                                           open_timeout=timeout, ping_interval=None)
        first = json.loads(await asyncio.wait_for(self.ws.recv(), timeout))
        if first.get("type") != "session_started":
            raise RuntimeError(f"expected session_started, got {first}")

    async def run(self, pieces: Sequence[str], rate: float, start_at: float, settings: dict[str, Any],
                  timeout: float) -> SessionRecord:
        rec, cid = self.rec, f"c{self.idx}"
        reader = asyncio.create_task(self._read(cid))
        try:
            await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
            sent = 0
            messages = ["".join(pieces)] if rate <= 0 else list(pieces)
            t0 = rec.started_at = time.perf_counter()
            for k, piece in enumerate(messages):
                if rate > 0:
                    await asyncio.sleep(max(0.0, t0 + k / rate - time.perf_counter()))
                msg = {"type": "text", "context_id": cid, "text": piece, **(settings if k == 0 else {})}
                await self.ws.send(json.dumps(msg))
                sent += len(piece)
                rec.sends.append((time.perf_counter(), sent))
            await self.ws.send(json.dumps({"type": "flush", "context_id": cid}))
            rec.flushes.append((time.perf_counter(), sent))
            await self.ws.send(json.dumps({"type": "end", "context_id": cid}))
            await asyncio.wait_for(asyncio.shield(reader), timeout)
        except Exception as exc:  # a failed session is a result, not a crash of the bench
            rec.errors.append(f"client:{type(exc).__name__}")
        finally:
            # Its end: `done`, or the moment the client gave up (a timeout, an error).
            rec.ended_at = rec.done_at if rec.completed and rec.done_at is not None else time.perf_counter()
            reader.cancel()
            with contextlib.suppress(BaseException):
                await reader
        return rec

    async def _read(self, cid: str) -> None:
        import websockets

        rec = self.rec
        try:
            async for msg in self.ws:
                now = time.perf_counter()
                if isinstance(msg, bytes):
                    n = msg[0]
                    if msg[1:1 + n].decode("utf-8", "replace") != cid:
                        continue
                    pos = len(rec.segments) - 1
                    if pos >= 0 and rec.segments[pos].first_audio_at is None:
                        rec.segments[pos].first_audio_at = now
                    rec.audio.append((now, self.fmt.samples_in(msg[1 + n:]), pos))
                    continue
                ev = json.loads(msg)
                kind = ev.get("type")
                if kind == "segment_started":
                    rec.segments.append(SegmentSeen(int(ev["segment_index"]), int(ev["text_end"]), now,
                                                    text_start=int(ev.get("text_start", 0))))
                elif kind == "error":
                    rec.errors.append(str(ev.get("code")))
                    if ev.get("final") and ev.get("context_id") == cid:
                        return  # the context is not open on the server: no `done` will come
                elif kind == "done":
                    rec.done_at, rec.completed = now, True
                    return
        except websockets.ConnectionClosed:
            rec.errors.append("connection_closed")

    async def close(self) -> None:
        if self.ws is not None:
            with contextlib.suppress(Exception):
                await self.ws.close()


# ---- GPU sampling -----------------------------------------------------------------------


class GpuSampler:
    """GPU utilisation, memory, SM clock and power sampled by pynvml in a thread (None when
    unavailable). The clock and the slowdown reasons say whether a slow level was the GPU
    slowing itself (power or thermal limits) rather than the load: round 19's 64-session
    levels under MPS opened with rounds of 165-197 ms in most and 734 ms in one."""

    # nvmlClocksEventReasons that lower the clock under load: the software power cap, hardware
    # slowdown, software and hardware thermal slowdown, the hardware power brake (not idle,
    # application clocks, sync boost or display clocks).
    SLOWDOWN_MASK = 0x4 | 0x8 | 0x20 | 0x40 | 0x80

    def __init__(self, index: int, interval: float = 0.1) -> None:
        self.interval = interval
        self.util: list[float] = []
        self.mem: list[int] = []
        self.clock: list[float] = []  # SM clock, MHz
        self.power: list[float] = []  # W
        self.reasons: list[int] = []  # slowdown reasons (SLOWDOWN_MASK bits) per sample
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml: Any = None
        self._handle: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self._nvml = pynvml
        except Exception:  # no driver, no pynvml, no GPU: "n/a"
            self._nvml = None

    @property
    def available(self) -> bool:
        return self._nvml is not None

    def memory_used(self) -> int | None:
        if not self.available:
            return None
        return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)

    def __enter__(self) -> "GpuSampler":
        if self.available:
            self._stop.clear()
            self.util, self.mem, self.clock, self.power, self.reasons = [], [], [], [], []
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)  # pacing between samples

    def sample(self) -> None:
        """One sample of each reading; one the driver does not offer is left out alone."""
        nv, h = self._nvml, self._handle
        with contextlib.suppress(Exception):
            self.util.append(float(nv.nvmlDeviceGetUtilizationRates(h).gpu))
            self.mem.append(int(nv.nvmlDeviceGetMemoryInfo(h).used))
        with contextlib.suppress(Exception):
            self.clock.append(float(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)))
        with contextlib.suppress(Exception):
            self.power.append(nv.nvmlDeviceGetPowerUsage(h) / 1e3)
        with contextlib.suppress(Exception):  # the newer name first, then the older one
            reasons = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) \
                or nv.nvmlDeviceGetCurrentClocksThrottleReasons
            self.reasons.append(int(reasons(h)) & self.SLOWDOWN_MASK)

    def report(self) -> dict[str, Any] | str:
        if not self.available or not self.util:
            return "n/a"
        out: dict[str, Any] = {"util_mean_pct": round(sum(self.util) / len(self.util), 1),
                               "util_max_pct": max(self.util),
                               "mem_used_max_mb": round(max(self.mem) / 2**20, 1), "samples": len(self.util)}
        if self.clock:
            out |= {"sm_clock_min_mhz": min(self.clock), "sm_clock_mean_mhz": round(sum(self.clock) / len(self.clock))}
        if self.power:
            out |= {"power_mean_w": round(sum(self.power) / len(self.power), 1), "power_max_w": round(max(self.power), 1)}
        if self.reasons:
            seen = 0
            for r in self.reasons:
                seen |= r
            out |= {"slowdown_share": round(sum(1 for r in self.reasons if r) / len(self.reasons), 3),
                    "slowdown_reasons": hex(seen)}
        return out


# ---- one level --------------------------------------------------------------------------


@dataclass
class Target:
    """The gateway under test and what the bench knows about it."""

    name: str  # "product" | "baseline"
    url: str
    headers: dict[str, str] | None
    pid: int | None = None

    @property
    def ws_url(self) -> str:
        return self.url.replace("http://", "ws://").replace("https://", "wss://") + "/v1/tts/stream"


@dataclass
class BenchContext:
    pieces: list[str]
    rate: float
    ramp: float
    voice_id: str
    text_mode: str
    timeout: float
    prebuffer_s: float
    flops: Any = None  # bench.flops.ModelFlops | None
    peak_flops: float | None = None
    gpu: GpuSampler | None = None
    kv_tokens_per_session: float | None = None
    # What the sessions ask for: Opus and G.711 put the gateway's encoders under load too.
    fmt: AudioFormat = AudioFormat("pcm_s16le", SAMPLE_RATE)
    # Client processes the sessions are spread over (1 = this process): one event loop
    # timestamps every frame of its sessions, and hundreds of sessions would make it late.
    client_procs: int = 1
    # Seconds into each level at which one more voice is registered (None: none).
    register_at: float | None = None
    # First-chunk planner knobs set before each of the product's levels, in turn
    # (`POST /debug/planner`): an A/B on one gateway, level by level.
    planner_knobs: tuple[dict[str, Any], ...] = ()
    # A ramp per product level (`--ramp 16,16,0,0`), instead of `ramp` for all: spread and
    # burst arrivals on one gateway, whose start costs 100-270 s of the H200's device time.
    level_ramps: tuple[float, ...] = ()


def _proc_rss(pid: int, proc: Path) -> int | None:
    """Memory of one process in bytes (None: gone, or a zombie without memory): its
    proportional set size (`Pss` of /proc/PID/smaps_rollup: each shared page divided among
    the processes that map it, so a tree's sum counts the libraries and CUDA mappings the
    gateway, its stage process and vLLM's engine core share once), or VmRSS where the
    kernel has no smaps_rollup (before 4.14) or will not show it."""
    base = proc / str(pid)
    try:
        for line in (base / "smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        for line in (base / "status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _children(pid: int, proc: Path) -> list[int]:
    """Child processes of `pid`: from /proc/PID/task/TID/children (any thread may have
    started one: vLLM's engine core, the stage process), or, on a kernel without those
    files, by the parent field of every /proc/PID/stat."""
    tasks = proc / str(pid) / "task"
    try:
        threads = list(tasks.iterdir())
    except OSError:
        return []
    if threads and (threads[0] / "children").exists():
        kids: list[int] = []
        for task in threads:
            with contextlib.suppress(OSError, ValueError):
                kids += [int(k) for k in (task / "children").read_text().split()]
        return kids
    kids = []
    for entry in proc.iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = (entry / "stat").read_text()
                if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:  # after "(comm) state"
                    kids.append(int(entry.name))
    return kids


def process_tree_rss(pid: int, proc: Path = Path("/proc")) -> tuple[int, int] | None:
    """Summed memory (bytes, `_proc_rss`: PSS where the kernel shows it) of `pid` and every
    process below it, and how many there were; None when `pid` cannot be read. The
    gateway's own RSS leaves out the stage process (on by default on CUDA) and vLLM's engine
    core, where most per-session memory may live."""
    own = _proc_rss(pid, proc)
    if own is None:
        return None
    total, count, todo, seen = own, 1, _children(pid, proc), {pid}
    while todo:
        child = todo.pop()
        if child in seen:
            continue
        seen.add(child)
        rss = _proc_rss(child, proc)
        if rss is not None:
            total, count = total + rss, count + 1
        todo += _children(child, proc)
    return total, count


def _add_tree_rss(m: dict[str, float], pid: int | None) -> dict[str, float]:
    """`m` with the process tree's RSS and size under TREE_RSS / TREE_PROCS (when known)."""
    tree = process_tree_rss(pid) if pid is not None else None
    if tree is not None:
        m[TREE_RSS], m[TREE_PROCS] = float(tree[0]), float(tree[1])
    return m


async def _poll_metrics(client: httpx.AsyncClient, stop: asyncio.Event, peaks: dict[str, float],
                        pid: int | None) -> None:
    """Track the peak of gauges during a level (RSS, CUDA memory) until `stop`."""
    while not stop.is_set():
        with contextlib.suppress(Exception):
            m = await scrape(client)
            if pid is not None and M_RSS not in m:
                rss = rss_bytes(pid)
                if rss is not None:
                    m[M_RSS] = float(rss)
            if pid is not None:  # /proc reads off the loop that timestamps the sessions' frames
                m = await asyncio.to_thread(_add_tree_rss, m, pid)
            for key in (M_RSS, M_CUDA, M_ACTIVE, TREE_RSS, TREE_PROCS):
                if key in m:
                    peaks[key] = max(peaks.get(key, 0.0), m[key])
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.25)


def _mb(x: float | None) -> float | None:
    return None if x is None else round(x / 2**20, 2)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1e3 * seconds, 3)


@dataclass(frozen=True)
class ShardPlan:
    """What one group of client sessions needs (picklable: it crosses to a worker process)."""

    ws_url: str
    headers: dict[str, str] | None
    fmt: AudioFormat
    indices: tuple[int, ...]  # session numbers of this group, out of `n`
    n: int
    pieces: tuple[str, ...]
    rate: float
    ramp: float
    settings: dict[str, Any]
    timeout: float


class ClientShard:
    """A group of sessions in this process: connect, run from a common start time, close."""

    def __init__(self, plan: ShardPlan) -> None:
        self.plan = plan
        self.sessions = [WsSession(plan.ws_url, i, plan.headers, plan.fmt) for i in plan.indices]
        self.live: list[WsSession] = []

    async def connect(self) -> list[str]:
        """Connects every session; returns the errors of those that failed."""
        got = await asyncio.gather(*(s.connect(self.plan.timeout) for s in self.sessions), return_exceptions=True)
        self.live = [s for s, c in zip(self.sessions, got) if not isinstance(c, BaseException)]
        return [f"connect:{type(c).__name__}" for c in got if isinstance(c, BaseException)]

    async def run(self, t0: float) -> tuple[list[SessionRecord], list[float], list[float]]:
        """Runs the live sessions (session i starts at t0 + ramp * i / n; perf_counter is
        CLOCK_MONOTONIC on Linux, one clock for every process); returns their records and,
        per client event loop (here one), the CPU time its thread spent on them, and how late
        that loop woke a probe every CLIENT_LAG_INTERVAL_S (seconds): the delay any of its
        frames' timestamps may carry, whether the loop was busy or its process waited for a
        CPU (which the CPU time does not show)."""
        from gateway.loop_monitor import LoopLagMonitor

        p = self.plan
        lags: list[float] = []
        monitor = LoopLagMonitor(lags.append, CLIENT_LAG_INTERVAL_S)
        monitor.start()
        cpu0 = time.thread_time()
        try:
            records = await asyncio.gather(*(
                s.run(p.pieces, p.rate, t0 + (p.ramp * s.idx / p.n if p.n > 1 else 0.0), p.settings, p.timeout)
                for s in self.live))
        finally:
            await monitor.stop()
        return list(records), [time.thread_time() - cpu0], lags

    async def close(self) -> None:
        await asyncio.gather(*(s.close() for s in self.live))


def _shard_process(plan: ShardPlan, conn: Any) -> None:
    """A worker process's life: connect, report, wait for the start time, run, report, close."""
    async def main() -> None:
        shard = ClientShard(plan)
        conn.send(await shard.connect())
        t0 = await asyncio.to_thread(conn.recv)
        conn.send(await shard.run(t0))
        await asyncio.to_thread(conn.recv)  # close when told (after the server's final scrape)
        await shard.close()

    asyncio.run(main())


class ShardProcesses:
    """The same interface as `ClientShard`, over worker processes (one pipe each)."""

    def __init__(self, plans: Sequence[ShardPlan]) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.pipes, self.procs = [], []
        for plan in plans:
            here, there = ctx.Pipe()
            proc = ctx.Process(target=_shard_process, args=(plan, there), daemon=True)
            proc.start()
            self.pipes.append(here)
            self.procs.append(proc)

    async def _each(self, message: Any = None, reply: bool = True) -> list[Any]:
        def talk(conn: Any) -> Any:
            if message is not None:
                conn.send(message)
            return conn.recv() if reply else None

        return await asyncio.gather(*(asyncio.to_thread(talk, c) for c in self.pipes))

    async def connect(self) -> list[str]:
        return [e for errors in await self._each() for e in errors]

    async def run(self, t0: float) -> tuple[list[SessionRecord], list[float], list[float]]:
        done = await self._each(t0)
        return ([r for records, _, _ in done for r in records], [c for _, cpus, _ in done for c in cpus],
                [x for _, _, lags in done for x in lags])

    async def close(self) -> None:
        await self._each("close", reply=False)
        for proc in self.procs:
            await asyncio.to_thread(proc.join, 60)


def shard_plans(target: Target, n: int, ctx: BenchContext, ramp: float | None = None) -> list[ShardPlan]:
    """Sessions 0..n-1 dealt round-robin over `ctx.client_procs` groups (so a ramp's early
    and late starters are spread over every process); starting over `ramp` seconds
    (default `ctx.ramp`)."""
    settings = {"voice": ctx.voice_id, "format": ctx.fmt.name, "sample_rate": ctx.fmt.sample_rate,
                "text_mode": ctx.text_mode}
    k = max(1, min(ctx.client_procs, n))
    return [ShardPlan(target.ws_url, target.headers, ctx.fmt, tuple(range(j, n, k)), n, tuple(ctx.pieces),
                      ctx.rate, ctx.ramp if ramp is None else ramp, settings, ctx.timeout) for j in range(k)]


def level_window(records: Sequence[SessionRecord], t0: float, now: float) -> tuple[float, float | None]:
    """(wall, last audio) of a level that started at `t0`, in seconds after it. The level
    ends with its last session however it ended (`ended_at`; `now` without any): one that
    timed out kept the GPU sampler and the server's counters running until then, so the
    rates over the level divide by this, not by the time to the last audio received."""
    ends = [r.ended_at for r in records if r.ended_at is not None]
    audio_ends = [r.audio[-1][0] for r in records if r.audio]
    return (max(ends) if ends else now) - t0, (max(audio_ends) - t0 if audio_ends else None)


async def run_level(target: Target, n: int, ctx: BenchContext, ramp: float | None = None) -> dict[str, Any]:
    plans = shard_plans(target, n, ctx, ramp)
    clients: ClientShard | ShardProcesses = ClientShard(plans[0]) if len(plans) == 1 else ShardProcesses(plans)
    async with httpx.AsyncClient(base_url=target.url, headers=target.headers, timeout=60) as client, \
            httpx.AsyncClient(base_url=target.url, headers=target.headers,
                              timeout=REGISTRATION_TIMEOUT_S) as registrar:
        before = await scrape(client)
        if target.pid is not None and M_RSS not in before:
            before[M_RSS] = float(rss_bytes(target.pid) or 0)
        _add_tree_rss(before, target.pid)
        connect_errors = await clients.connect()
        idle = await scrape(client)
        t_idle = time.perf_counter()
        if target.pid is not None and M_RSS not in idle:
            idle[M_RSS] = float(rss_bytes(target.pid) or 0)
        _add_tree_rss(idle, target.pid)
        peaks: dict[str, float] = {}
        stop = asyncio.Event()
        poller = asyncio.create_task(_poll_metrics(client, stop, peaks, target.pid))
        gpu = ctx.gpu if ctx.gpu is not None else contextlib.nullcontext()
        with gpu:
            t0 = time.perf_counter() + 0.05 + 0.05 * (len(plans) > 1)  # a pipe hop to every worker first
            registering = None
            if ctx.register_at is not None:
                registering = asyncio.create_task(register_meanwhile(
                    registrar, t0, ctx.register_at, f"bench-registered-{n}-{os.getpid()}-{time.time_ns()}"))
            records, client_cpu, client_lags = await clients.run(t0)
            wall, last_audio = level_window(records, t0, time.perf_counter())
        stop.set()
        await poller
        registration = await registering if registering is not None else None
        after = await scrape(client)
        _add_tree_rss(after, target.pid)
        planner = await planner_state(client)
        # The gateway loop's figures cover idle scrape -> after scrape (handshakes excluded).
        after[SERVER_WINDOW] = time.perf_counter() - t_idle
        for key in (M_RSS, M_CUDA, TREE_RSS, TREE_PROCS):  # a level shorter than one poll still has a peak
            if key in after:
                peaks[key] = max(peaks.get(key, 0.0), after[key])
        await clients.close()
    results = [analyse(r, ctx.fmt.sample_rate, ctx.prebuffer_s, ctx.text_mode) for r in records]
    report = level_report(n, results, connect_errors, wall, before, idle, peaks, after, ctx, last_audio)
    report["server"]["planner"] = planner
    if registration is not None:
        report["registration"] = registration
    # The bench's own event loops timestamp every frame: when one is busy, its lateness
    # reads as the gateway's. Near 1.0 the level measured the client, not the server.
    busiest = max(client_cpu, default=0.0)
    report["client_procs"] = len(plans)
    report["client_loop_busy_share"] = round(busiest / wall, 4) if wall > 0 else None
    if wall > 0 and busiest / wall > 0.5:
        print(f"[warning] a bench client loop was {busiest / wall:.0%} busy at {n} sessions: its timestamps "
              "may be late; spread the sessions over more processes (--client-procs)", flush=True)
    # How late the client loops ran (every process's probe pooled): a late loop stamps frames
    # late however little CPU it used (its process waiting for a core: the gateway's, vLLM's
    # and the stage's processes share the host).
    report["client_loop_lag_ms"] = summary_ms(client_lags, qs=(50, 99))
    worst = report["client_loop_lag_ms"]["max"]
    if worst is not None and worst > CLIENT_LAG_WARN_MS:
        print(f"[warning] a bench client loop woke up to {worst:.0f} ms late at {n} sessions: frame timestamps "
              "(first audio, underruns) may be off by that much", flush=True)
    return report


def _delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def loop_lag_summary(after: dict[str, float], before: dict[str, float], window: float,
                     audio_s: float) -> dict[str, Any] | None:
    """The gateway event loop between two scrapes `window` seconds apart, from its metrics'
    deltas: which loop it is, how late it ran and how much CPU its thread used (busy share
    of the window; per second of audio delivered, the figure that scales to more sessions)."""
    n = _delta(after, before, M_LAG + "_count")
    if n <= 0:
        return None
    loop = next((k[len(M_LOOP_INFO):].split('"')[0] for k in after if k.startswith(M_LOOP_INFO)), None)

    def over(le: str) -> float | None:
        key = f'{M_LAG}_bucket{{le="{le}"}}'
        return round(1 - _delta(after, before, key) / n, 4) if key in after else None

    cpu = _delta(after, before, M_LOOP_CPU)
    return {"loop": loop, "samples": int(n), "mean_ms": round(1e3 * _delta(after, before, M_LAG + "_sum") / n, 3),
            "share_over_20ms": over("0.02"), "share_over_100ms": over("0.1"),
            "busy_share": round(cpu / window, 4) if window > 0 else None,
            "cpu_ms_per_audio_s": round(1e3 * cpu / audio_s, 3) if audio_s > 0 else None}


def gc_summary(after: dict[str, float], before: dict[str, float]) -> dict[str, Any] | None:
    """The gateway process's garbage-collector passes between two scrapes: per generation
    how many and their milliseconds, the longest pass since start and the objects exempt
    from them (None from a gateway without these series)."""
    frozen = after.get("cosyvoice_gc_frozen_objects")
    if frozen is None:
        return None
    out: dict[str, Any] = {}
    for g in range(3):
        out[f"gen{g}"] = {
            "passes": int(_delta(after, before, f'cosyvoice_gc_collections_total{{generation="{g}"}}')),
            "ms": round(1e3 * _delta(after, before, f'cosyvoice_gc_pause_seconds_total{{generation="{g}"}}'), 3)}
    return out | {"longest_since_start_ms": _ms(after.get("cosyvoice_gc_pause_max_seconds")),
                  "frozen_objects": int(frozen)}


def chunk_phases(after: dict[str, float], before: dict[str, float], kind: str) -> dict[str, float] | None:
    """Mean phases (ms) of the first chunks of `kind` ("first_chunk": every utterance's;
    "opening_chunk": sessions' first utterances only; "slow_opening_chunk": of those, the
    ones that took `engine.stats.SLOW_OPENING_S` or longer) between two scrapes, from the
    engine's summed counters; None when there were none."""
    count = _delta(after, before, f"cosyvoice_engine_{kind}s_total")
    if count <= 0:
        return None
    return ({name: round(1e3 * _delta(after, before, key.replace("first_chunk", kind)) / count, 3)
             for name, key in FIRST_CHUNK_PHASES.items()}
            | {"utterances": int(count),
               "tokens": round(_delta(after, before, f"cosyvoice_engine_{kind}_tokens_total") / count, 2),
               "planned": round(_delta(after, before, f"cosyvoice_engine_{kind}_planned_tokens_total") / count, 2),
               "batch_rows": round(_delta(after, before, f"cosyvoice_engine_{kind}_batch_rows_total") / count, 2)})


def plan_decisions(after: dict[str, float], before: dict[str, float], kind: str) -> dict[str, float] | None:
    """The first-chunk planner's decisions of `kind` ("first_chunk": every utterance's;
    "opening_chunk": sessions' first utterances) between two scrapes that had a round to go
    on, their means: the first hop chosen (tokens), the LM's time a token, the predicted
    rounds of that first chunk and of the chunk after it (ms), and the utterances in
    progress on the stage, all ("staged") and those not waiting patiently ("due"): what the
    round estimate counts. None when there were none."""
    m = f"cosyvoice_engine_{kind}_decision"
    count = _delta(after, before, m + "s_total")
    if count <= 0:
        return None
    return {"decisions": int(count),
            "hop": round(_delta(after, before, m + "_hop_tokens_total") / count, 2),
            "lm_step_ms": round(1e3 * _delta(after, before, m + "_lm_step_seconds_total") / count, 3),
            "round_ms": round(1e3 * _delta(after, before, m + "_round_seconds_total") / count, 2),
            "second_round_ms": round(1e3 * _delta(after, before, m + "_second_round_seconds_total") / count, 2),
            "staged": round(_delta(after, before, m + "_staged_total") / count, 2),
            "due": round(_delta(after, before, m + "_due_total") / count, 2)}


def second_chunk_ms(after: dict[str, float], before: dict[str, float]) -> dict[str, float] | None:
    """Mean phases (ms) of the sessions' first segments' second chunks between two scrapes
    (the engine's `opening_second_chunk` counters): its tokens ready -> queued (once the
    stage took the first chunk) -> its batch starts -> its audio; how many came after the
    first chunk's audio ran out, by how much on average, and the mean chunks in the
    batches those late ones' first chunks ran in; for the late ones, also how long after
    the first chunk's audio their tokens were ready, their stage wait and round, and the
    chunks of that round (`late_ready`, `late_stage_wait`, `late_stage`, `late_rows`);
    `close`: how many came with less than 100 ms to spare, late ones too (a few runs' late
    counts are too few to compare settings by); `past_due` (and `late_past_due` of the late
    ones): how many were past their deadline as the stage's cuts judge it when their round
    began, so that no cut tried to save them; None without any."""
    m = "cosyvoice_engine_opening_second_chunk"
    count = _delta(after, before, m + "s_total")
    if count <= 0:
        return None
    lates = _delta(after, before, m + "_lates_total")
    return {"ready_wait": round(1e3 * _delta(after, before, m + "_ready_wait_seconds_total") / count, 3),
            "stage_wait": round(1e3 * _delta(after, before, m + "_stage_wait_seconds_total") / count, 3),
            "stage": round(1e3 * _delta(after, before, m + "_stage_seconds_total") / count, 3),
            "chunks": int(count), "late": int(lates), "close": int(_delta(after, before, m + "_close_calls_total")),
            "past_due": int(_delta(after, before, m + "_past_due_total")),
            "late_by": round(1e3 * _delta(after, before, m + "_late_seconds_total") / lates, 3) if lates > 0 else 0.0,
            "late_first_rows": round(_delta(after, before, m + "_late_first_rows_total") / lates, 2) if lates > 0 else None,
            **({f"late_{k}": round(scale * _delta(after, before, f"{m}_late_{name}_total") / lates, 3)
                for k, name, scale in (("ready", "ready_seconds", 1e3), ("stage_wait", "stage_wait_seconds", 1e3),
                                       ("stage", "stage_seconds", 1e3), ("rows", "rows", 1))} if lates > 0 else {}),
            **({"late_past_due": int(_delta(after, before, m + "_late_past_due_total"))} if lates > 0 else {})}


def lm_server_ms(after: dict[str, float], before: dict[str, float]) -> dict[str, float | None] | None:
    """vLLM's own account of the LM requests between two scrapes (a gateway run with
    --engine.lm-timing true), means in ms: queued and prefill in its engine core, its own
    time to first token, and its decode time per token; None without those counters."""
    m = "cosyvoice_engine_lm_server_"
    requests, first = _delta(after, before, m + "requests_total"), _delta(after, before, m + "first_tokens_total")
    if requests <= 0 or first <= 0:
        return None
    tokens = _delta(after, before, m + "decode_tokens_total")
    return {"queued": round(1e3 * _delta(after, before, m + "queued_seconds_total") / requests, 3),
            "prefill": round(1e3 * _delta(after, before, m + "prefill_seconds_total") / requests, 3),
            "first_token": round(1e3 * _delta(after, before, m + "first_token_seconds_total") / first, 3),
            "decode_per_token": round(1e3 * _delta(after, before, m + "decode_seconds_total") / tokens, 3)
            if tokens > 0 else None,
            "requests": int(requests)}


def memory_per_session(before: dict[str, float], idle: dict[str, float], peaks: dict[str, float], key: str,
                       started: int, peak_active: float | None) -> dict[str, Any]:
    """Series `key` (bytes) before the level, with its sessions connected (idle) and at its
    peak while they ran, in MiB; the growth per session named by what it divides by: the
    sessions the level started (all of them, under a ramp too) and the most the engine
    had active at once (its gauge's peak)."""
    rss0, rss_idle, rss_peak = before.get(key), idle.get(key), peaks.get(key)
    grown = rss_peak - rss0 if rss_peak is not None and rss0 is not None else None
    return {
        "before_mb": _mb(rss0), "idle_mb": _mb(rss_idle), "active_peak_mb": _mb(rss_peak),
        "per_idle_session_mb": _mb((rss_idle - rss0) / started) if rss_idle is not None and rss0 is not None else None,
        "per_started_session_mb": _mb(grown / started) if grown is not None else None,
        "per_peak_active_session_mb": _mb(grown / peak_active) if grown is not None and peak_active else None,
        "peak_active_sessions": peak_active,
    }


def level_report(n: int, results: Sequence[SessionResult], connect_errors: Sequence[str], wall: float,
                 before: dict[str, float], idle: dict[str, float], peaks: dict[str, float],
                 after: dict[str, float], ctx: BenchContext, last_audio_s: float | None = None) -> dict[str, Any]:
    codes: dict[str, int] = {}
    for code in [e for r in results for e in r.errors] + list(connect_errors):
        codes[code] = codes.get(code, 0) + 1
    audio = sum(r.audio_s for r in results)
    leads = [x for r in results for x in r.segment_leads_s]
    # RTF without the text's pacing, over completed sessions; one that did not complete has
    # no bound and ranks above them all (`RTF_DEFINITION`), so failures cannot make it look good.
    rtfs = [r.tts_s / r.audio_s for r in results if r.completed and r.tts_s is not None and r.audio_s > 0]
    rtf_censored = sum(1 for r in results if not r.completed)
    # The old figure: first text sent -> last audio, text pacing included.
    wall_rtfs = [r.generation_s / r.audio_s for r in results if r.generation_s is not None and r.audio_s > 0]
    lm_tokens = int(_delta(after, before, M_LM))
    flow_frames = int(_delta(after, before, M_FLOW))
    voc_frames = int(_delta(after, before, M_VOC))
    chunks = int(_delta(after, before, M_CHUNKS))
    batches = int(_delta(after, before, M_BATCHES))
    flops: dict[str, Any] | str = "n/a"
    if ctx.flops is not None and wall > 0:
        f = ctx.flops.total(lm_tokens, flow_frames, chunks, voc_frames)
        achieved = f["total"] / wall
        flops = {**{k: float(v) for k, v in f.items()}, "achieved_flops_per_s": achieved,
                 "peak_flops_per_s": ctx.peak_flops,
                 "fraction_of_peak": ratio(achieved, ctx.peak_flops),
                 "counted_from": {"lm_tokens": lm_tokens, "flow_frames": flow_frames, "flow_rows": chunks,
                                  "vocoder_frames": voc_frames}}
    tree_rss = None  # only for a gateway this bench launched (its PID known)
    if TREE_PROCS in peaks:
        tree_rss = memory_per_session(before, idle, peaks, TREE_RSS, n, peaks.get(M_ACTIVE)) \
            | {"processes": int(peaks[TREE_PROCS])}
    cuda_peak = peaks.get(M_CUDA)
    cuda_grown = cuda_peak - before[M_CUDA] if cuda_peak is not None and before.get(M_CUDA, 0) > 0 else None
    peak_active = peaks.get(M_ACTIVE)
    gpu_mem: dict[str, Any] = {
        # The growth at the level's peak over the sessions started (all n, under a ramp
        # too), and over the most that were active at once (what held that memory).
        "torch_allocated_per_session_mb": _mb(cuda_grown / n) if cuda_grown is not None else None,
        "torch_allocated_per_peak_active_session_mb": _mb(cuda_grown / peak_active)
        if cuda_grown is not None and peak_active else None,
        "lm_kv_estimate_per_session_mb": _mb(ctx.flops.kv_bytes_per_token * ctx.kv_tokens_per_session)
        if ctx.flops is not None and ctx.kv_tokens_per_session else None,
    }
    return {
        "sessions": n,
        "completed": sum(1 for r in results if r.completed),
        "errors": sum(codes.values()),
        "error_codes": codes,
        # Censored sessions (ended before their first audio) count at the time they waited.
        "first_audio_ms": summary_ms([r.first_audio_s for r in results if r.first_audio_s is not None]),
        "first_audio_censored": sum(1 for r in results if r.first_audio_censored),
        "segment_first_audio_ms": summary_ms([x for r in results for x in r.segment_first_audio_s]),
        "segment_first_audio_censored": sum(r.segment_first_audio_censored for r in results),
        # Server side, mean per utterance (segment): text in -> first speech token -> first
        # chunk's tokens queued -> its stage batch starts -> its audio is back.
        "first_chunk_phases_ms": chunk_phases(after, before, "first_chunk"),
        # The same for each session's first segment only: the one `first_audio_ms` counts.
        "opening_chunk_phases_ms": chunk_phases(after, before, "opening_chunk"),
        # ... and of those, the ones that took 500 ms or more from text to audio
        # (`engine.stats.SLOW_OPENING_S`): what first audio past the bar was made of.
        "slow_opening_chunk_phases_ms": chunk_phases(after, before, "slow_opening_chunk"),
        # Their second chunks: whether the one a short first chunk must cover waited for the
        # first's audio, for the stage, or for a long round (`second_chunk_ms`).
        "opening_second_chunk_ms": second_chunk_ms(after, before),
        # Inside the LM server (vLLM with --engine.lm-timing true; None otherwise), to set
        # against the phases' lm_first_token: what of it was vLLM's queue and prefill.
        "lm_server_ms": lm_server_ms(after, before),
        "chunk_gap_ms": summary_ms([g for r in results for g in r.gaps_s], qs=(50, 99)),
        "underruns": sum(r.underruns for r in results),
        "underrun_ms": round(sum(r.underrun_s for r in results) * 1e3, 3),
        "sessions_with_underrun": sum(1 for r in results if r.underruns),
        "sessions_playing_at_once": playing_at_once(results),
        # Where the underruns began: ms of their segment's audio already played (0: the
        # segment's first chunk came late; small: its next chunk after a start; seconds: a
        # stage falling behind).
        "underrun_at_audio_ms": summary_ms([x for r in results for x in r.underrun_at_s], qs=(10, 50, 90)),
        # ... and when, after the session's playback started, and in which of its segments.
        "underrun_since_start_ms": summary_ms([x for r in results for x in r.underrun_since_start_s],
                                              qs=(10, 50, 90)),
        # How early later segments' first audio came before the playhead reached them (the
        # least, and low percentiles): their latency counts from their own text, but the
        # listener only hears them after the earlier audio; negative leads are underruns.
        "segment_lead_ms": summary_ms(leads, qs=(5, 50)) | {"min": round(min(leads) * 1e3, 3) if leads else None},
        "underruns_by_segment": {str(k): v for k, v in sorted(Counter(x for r in results for x in r.underrun_segment).items())},
        "text_wait_ms": round(sum(r.text_wait_s for r in results) * 1e3, 3),
        "audio_s": round(audio, 3),
        "wall_s": round(wall, 3),  # the level's start -> its last session's end (`WALL_DEFINITION`)
        "last_audio_s": round(last_audio_s, 3) if last_audio_s is not None else None,
        "rtf": percentile_above(rtfs, rtf_censored, 50),
        "rtf_max": max(rtfs) if rtfs and not rtf_censored else None,
        "rtf_censored": rtf_censored,
        "rtf_wall_incl_text_pacing": percentile(wall_rtfs, 50),
        "rtf_wall_incl_text_pacing_max": max(wall_rtfs) if wall_rtfs else None,
        "rtf_aggregate": wall / audio if audio else None,
        "server": {
            "lm_tokens": lm_tokens, "flow_frames": flow_frames, "vocoder_frames": voc_frames,
            "flow_chunks": chunks, "flow_batches": batches,
            "mean_flow_batch": chunks / batches if batches else None,
            # --engine.flow-fill-padding: chunks grown into their batch's padding, tokens taken.
            "flow_grown_chunks": int(_delta(after, before, M_GROWN_CHUNKS)),
            "flow_grown_tokens": int(_delta(after, before, M_GROWN_TOKENS)),
            # --engine.chunk-patience-s: chunks cut big, their audio not due soon; their tokens.
            "patient_chunks": int(_delta(after, before, "cosyvoice_engine_patient_chunks_total")),
            "patient_tokens": int(_delta(after, before, "cosyvoice_engine_patient_tokens_total")),
            # --engine.first-chunk-hold-ms: rounds held for expected first chunks, the time
            # they waited, and the first chunks that made a round by it.
            "first_chunk_holds": int(_delta(after, before, "cosyvoice_engine_first_chunk_holds_total")),
            "first_chunk_hold_ms": round(_delta(after, before, "cosyvoice_engine_first_chunk_hold_seconds_total") * 1e3, 3),
            "first_chunk_hold_caught": int(_delta(after, before, "cosyvoice_engine_first_chunk_hold_caught_total")),
            # --engine.first-chunk-burst-hold-ms: the held rounds that held for a burst.
            "first_chunk_burst_holds": int(_delta(after, before, "cosyvoice_engine_first_chunk_burst_holds_total")),
            # ... the expected first chunks a round started without, and how much later than
            # expected they came on average (ms; negative: sooner).
            "first_chunk_passed_over": (passed := int(_delta(after, before, "cosyvoice_engine_first_chunk_passed_over_total"))),
            "first_chunk_passed_over_late_ms": round(_delta(after, before, "cosyvoice_engine_first_chunk_passed_over_late_seconds")
                                                     * 1e3 / passed, 3) if passed else None,
            # --engine.first-chunk-min-hop: first chunks planned below the floor, and decisions
            # a crowd of first chunks kept from it (--engine.first-chunk-min-hop-crowd).
            "first_chunk_below_floor": int(_delta(after, before, "cosyvoice_engine_first_chunk_below_floor_total")),
            "first_chunk_crowded": int(_delta(after, before, "cosyvoice_engine_first_chunk_crowded_total")),
            # --engine.first-chunk-learnt-rounds-crowd: decisions planned on the learnt second rounds.
            "first_chunk_learnt_rounds": int(_delta(after, before, "cosyvoice_engine_first_chunk_learnt_rounds_total")),
            # --engine.stage-deadline-cut: rounds cut short for rows due before they would end.
            "deadline_cuts": int(_delta(after, before, "cosyvoice_engine_deadline_cuts_total")),
            "first_chunk_cuts": int(_delta(after, before, "cosyvoice_engine_first_chunk_cuts_total")),
            # --engine.stage-pipeline-lead-ms: rounds delivered pipelined (the setting took).
            "pipelined_batches": int(_delta(after, before, "cosyvoice_engine_stage_pipelined_batches_total")),
            # --engine.flow-context-cache-mib: chunks that read their utterance's kept frames,
            # and chunks whose final frames were kept.
            "flow_context_reads": int(_delta(after, before, M_CONTEXT_READS)),
            "flow_context_records": int(_delta(after, before, M_CONTEXT_RECORDS)),
            # The vocoder's decode steps on a CUDA graph, and those that ran eagerly (a window
            # wider than its buckets, more than 8 rows).
            "vocoder_graph_replays": int(_delta(after, before, "cosyvoice_engine_vocoder_graph_replays_total")),
            "vocoder_eager_decodes": int(_delta(after, before, "cosyvoice_engine_vocoder_eager_decodes_total")),
            "flow_frames_per_chunk": flow_frames / chunks if chunks else None,
            # Where the flow frames went: padding (to a call's longest row, to a graph's
            # bucket) and frames re-read (left context, uncached prompt) besides those played.
            "flow_exact_frames": (exact := int(_delta(after, before, "cosyvoice_engine_flow_exact_frames_total"))),
            "flow_padding_share": (flow_frames - exact) / flow_frames if flow_frames else None,
            # ... of which rows added to fill a graph's row bucket, and rows padded past their
            # call's longest to a graph's frame bucket (the rest: rows padded to the longest).
            "flow_row_padding_share": _delta(after, before, "cosyvoice_engine_flow_row_padding_frames_total")
                                      / flow_frames if flow_frames else None,
            "flow_bucket_padding_share": _delta(after, before, "cosyvoice_engine_flow_bucket_padding_frames_total")
                                         / flow_frames if flow_frames else None,
            "flow_reread_share": (exact - voc_frames) / flow_frames if flow_frames else None,
            "stage_busy_share": _delta(after, before, M_BUSY) / wall if wall > 0 else None,
            # Of that share: the stage waiting for its worker thread or the event loop.
            "stage_handoff_share": _delta(after, before, M_HANDOFF) / wall if wall > 0 else None,
            "max_active_sessions": peaks.get(M_ACTIVE),
            # What the first-chunk planner takes a first chunk's audio to fall short by.
            "first_chunk_holdback_s": after.get("cosyvoice_engine_first_chunk_holdback_seconds"),
            # ... and the inputs of its latest decision (ms): the LM's time per token, the
            # predicted rounds of that first chunk and of the chunk after it.
            "first_chunk_plan_ms": {name: _ms(after.get(f"cosyvoice_engine_first_chunk_plan_{name}_seconds"))
                                    for name in ("lm_step", "lm_step_own", "round", "second_round")},
            # The same for the latest session's first segment: what the opening chunks
            # (`opening_chunk_phases_ms`, `opening_second_chunk_ms`) were planned on.
            "opening_chunk_plan_ms": {name: _ms(after.get(f"cosyvoice_engine_opening_chunk_plan_{name}_seconds"))
                                      for name in ("lm_step", "lm_step_own", "round", "second_round")},
            # Means over the level's decisions, of every utterance and of sessions' first.
            "first_chunk_decisions": plan_decisions(after, before, "first_chunk"),
            "opening_chunk_decisions": plan_decisions(after, before, "opening_chunk"),
            # The host side: how late the gateway's event loop ran (encoding, sockets, LM output).
            "event_loop": loop_lag_summary(after, idle, after.get(SERVER_WINDOW, wall), audio),
            # ... and the garbage collector's passes over the level, which stop every thread.
            "gc": gc_summary(after, before),
        },
        "gpu": ctx.gpu.report() if ctx.gpu is not None else "n/a",
        "flops": flops,
        "gpu_memory": gpu_mem,
        # The gateway process alone (its /metrics), and with --launch it and its descendants
        # (/proc: the stage process, vLLM's engine core; `processes`: how many at the peak).
        "rss": memory_per_session(before, idle, peaks, M_RSS, n, peaks.get(M_ACTIVE)),
        "rss_tree": tree_rss,
    }


# ---- comparing product and baseline -----------------------------------------------------


# Issue #12's capacity target: real-time sessions with zero underruns and p95 first audio at most this.
TARGET_P95_MS = 500.0


@dataclass(frozen=True)
class LevelTarget:
    """What issue #12 asks of one session count: a first-audio percentile at most
    `max_ms`, with every session complete and free of underruns."""
    stat: str  # "p50" or "p95" of first_audio_ms
    max_ms: float

    def met(self, lv: dict[str, Any]) -> bool:
        v = lv["first_audio_ms"][self.stat]
        return (lv["underruns"] == 0 and lv["errors"] == 0 and lv["completed"] == lv["sessions"]
                and all_played_at_once(lv) and v is not None and v <= self.max_ms)

    def __str__(self) -> str:
        return f"{self.stat} <= {self.max_ms:g} ms, no underrun"


def issue_target(sessions: int) -> LevelTarget:
    """Issue #12's bar at this many sessions: p50 60 ms alone, p95 250 ms at 64, and the
    capacity bar (p95 500 ms) at any other count."""
    if sessions == 1:
        return LevelTarget("p50", 60.0)
    if sessions == 64:
        return LevelTarget("p95", 250.0)
    return LevelTarget("p95", TARGET_P95_MS)


def all_played_at_once(lv: dict[str, Any]) -> bool:
    """Whether every session of the level played at the same moment
    (`sessions_playing_at_once`; reports without it: assumed): a level whose starts were
    spread over a ramp longer than a session's audio never had its session count concurrent."""
    return lv.get("sessions_playing_at_once", lv["sessions"]) >= lv["sessions"]


def largest_clean_level(levels: Sequence[dict[str, Any]], max_p95_ms: float | None = None) -> int | None:
    """The largest concurrency whose sessions all completed without an underrun and all
    played at once (and, with `max_p95_ms`, with a first-audio p95 at most that)."""
    ok = [lv["sessions"] for lv in levels
          if lv["underruns"] == 0 and lv["errors"] == 0 and lv["completed"] == lv["sessions"]
          and all_played_at_once(lv)
          and (max_p95_ms is None or (lv["first_audio_ms"]["p95"] is not None
                                      and lv["first_audio_ms"]["p95"] <= max_p95_ms))]
    return max(ok) if ok else None


def repeats(levels: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per session count that ran more than once (`--sessions 40,64,40,64`): its runs'
    first-audio p95s in order, their median, and how many were underrun-free and met
    issue #12's bar for that count (`issue_target`). On the H200 the same build and load
    differed by half between levels of one gateway (round 16 of docs/benchmarks.md): one
    level alone resolves little."""
    by: dict[tuple[int, float, str], list[dict[str, Any]]] = {}
    for lv in levels:  # levels run with other planner knobs (`--planner-knobs`) or ramps apart
        key = (lv["sessions"], lv.get("ramp_s", 0.0), json.dumps(lv.get("planner_knobs"), sort_keys=True))
        by.setdefault(key, []).append(lv)
    out = []
    for (n, _, _), runs in sorted(by.items()):
        if len(runs) < 2:
            continue
        p95 = [lv["first_audio_ms"]["p95"] for lv in runs]
        known = [v for v in p95 if v is not None]
        knobs = {"planner_knobs": runs[0]["planner_knobs"]} if "planner_knobs" in runs[0] else {}
        if "ramp_s" in runs[0]:
            knobs["ramp_s"] = runs[0]["ramp_s"]
        out.append({"sessions": n, **knobs, "runs": len(runs), "first_audio_p95_ms": p95,
                    "median_first_audio_p95_ms": statistics.median(known) if known else None,
                    "runs_without_underrun": sum(1 for lv in runs if lv["underruns"] == 0 and lv["errors"] == 0
                                                and lv["completed"] == lv["sessions"]),
                    "target": str(issue_target(n)),
                    "runs_meeting_target": sum(1 for lv in runs if issue_target(n).met(lv))})
    return out


# What `compare` sets side by side: per level, a figure of the level report.
COMPARED: dict[str, Callable[[dict[str, Any]], float | None]] = {
    "first_audio_p50": lambda lv: lv["first_audio_ms"]["p50"],
    "first_audio_p95": lambda lv: lv["first_audio_ms"]["p95"],
    "segment_first_audio_p50": lambda lv: lv["segment_first_audio_ms"]["p50"],
    "rtf": lambda lv: lv["rtf"],
    "rtf_aggregate": lambda lv: lv["rtf_aggregate"],
}


def level_group(lv: dict[str, Any]) -> tuple[float | None, str]:
    """What besides its session count sets a level apart: its own ramp (`--ramp 16,0`;
    None: the run's one ramp) and its planner knobs (`--planner-knobs`; JSON, "null": none)."""
    return lv.get("ramp_s"), json.dumps(lv.get("planner_knobs"), sort_keys=True)


def _median_of(runs: Sequence[dict[str, Any]], get: Callable[[dict[str, Any]], float | None]) -> float | None:
    known = [v for v in (get(lv) for lv in runs) if v is not None]
    return statistics.median(known) if known else None


def compare(product: Sequence[dict[str, Any]], baseline: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """product / baseline of the medians over repeated runs at every (session count, ramp)
    both ran, one row per product planner-knob setting (below 1 = the product is better
    for latencies and RTF; a ratio is null unless every run of both completed every
    session: a level whose sessions timed out has no latency to compare), and the largest
    underrun-free level of each (above 1 = better)."""
    def grouped(levels: Sequence[dict[str, Any]], knobs: bool) -> dict[tuple[int, float, str], list[dict[str, Any]]]:
        by: dict[tuple[int, float, str], list[dict[str, Any]]] = {}
        for lv in levels:
            ramp, setting = level_group(lv)
            by.setdefault((lv["sessions"], -1.0 if ramp is None else ramp, setting if knobs else "null"), []).append(lv)
        return by

    base = grouped(baseline, False)  # the baseline takes no planner knobs: one row per product setting
    shared = []
    for (n, ramp, setting), runs in sorted(grouped(product, True).items()):
        b = base.get((n, ramp, "null"))
        if b is None:
            continue
        complete = all(lv["completed"] == lv["sessions"] for lv in (*runs, *b))
        row: dict[str, Any] = {"sessions": n}
        if "ramp_s" in runs[0]:
            row["ramp_s"] = ramp
        if "planner_knobs" in runs[0]:
            row["planner_knobs"] = runs[0]["planner_knobs"]
        row |= {"runs": {"product": len(runs), "baseline": len(b)}, "all_completed": complete}
        for name, get in COMPARED.items():
            row[name] = ratio(_median_of(runs, get), _median_of(b, get)) if complete else None
        shared.append(row)
    p_clean, b_clean = largest_clean_level(product), largest_clean_level(baseline)
    p_target, b_target = (largest_clean_level(product, TARGET_P95_MS), largest_clean_level(baseline, TARGET_P95_MS))
    return {"levels": shared,
            "largest_level_without_underrun": {"product": p_clean, "baseline": b_clean, "ratio": ratio(p_clean, b_clean)},
            "largest_level_meeting_target": {"max_p95_ms": TARGET_P95_MS, "product": p_target, "baseline": b_target,
                                             "ratio": ratio(p_target, b_target)}}


def _group_label(ramp: float | None, setting: str) -> str:
    parts = [] if ramp is None else [f"over {ramp:g} s" if ramp else "at once"]
    if setting != "null":
        parts.append(setting)
    return f" ({', '.join(parts)})" if parts else ""


def plot(report: dict[str, Any]) -> str:
    """First-audio p50/p95 against sessions: a line per mode and level group (ramp,
    planner knobs), through its session counts in order, at the median of repeated runs."""
    series = []
    palettes = {"product": ("#1f77b4", "#2ca02c", "#9467bd", "#17becf", "#8c564b", "#7f7f7f"),
                "baseline": ("#d62728", "#ff7f0e", "#e377c2", "#bcbd22")}
    for mode in ("product", "baseline"):
        groups: dict[tuple[float | None, str], list[dict[str, Any]]] = {}
        for lv in report["results"].get(mode) or []:
            groups.setdefault(level_group(lv), []).append(lv)
        for k, ((ramp, setting), levels) in enumerate(groups.items()):
            colour = palettes[mode][k % len(palettes[mode])]
            for q, dashed in (("p50", False), ("p95", True)):
                by_n: dict[int, list[float]] = {}
                for lv in levels:
                    if lv["first_audio_ms"][q] is not None:
                        by_n.setdefault(lv["sessions"], []).append(lv["first_audio_ms"][q])
                pts = tuple((float(n), statistics.median(v)) for n, v in sorted(by_n.items()))
                if pts:
                    series.append(Series(f"{mode} {q}{_group_label(ramp, setting)}", pts, colour, dashed))
    return render_svg(Chart("First-audio latency vs concurrent sessions", "concurrent sessions",
                            "first audio (ms)", tuple(series)))


def table(report: dict[str, Any]) -> str:
    head = (f"{'mode':9s} {'sess':>5s} {'done':>5s} {'err':>4s} {'cens':>4s} {'fa p50':>8s} {'fa p95':>8s} "
            f"{'fa p99':>8s} {'seg p95':>8s} {'gap p99':>8s} {'underrun':>9s} {'u.sess':>6s} {'RTF':>6s} {'batch':>6s} "
            f"{'GPU%':>5s} {'%peak':>6s} {'RSS/pk':>8s}")
    lines = [head, "-" * len(head)]

    def f(v: Any, fmt: str = ".0f") -> str:
        return "-" if v is None else format(v, fmt)

    for mode in ("product", "baseline"):
        for lv in report["results"].get(mode) or []:
            gpu = lv["gpu"]["util_mean_pct"] if isinstance(lv["gpu"], dict) else None
            frac = lv["flops"].get("fraction_of_peak") if isinstance(lv["flops"], dict) else None
            # RSS growth per peak-active session, of the whole process tree where known.
            memory = lv.get("rss_tree") or lv["rss"]
            lines.append(
                f"{mode:9s} {lv['sessions']:5d} {lv['completed']:5d} {lv['errors']:4d} "
                f"{lv.get('first_audio_censored', 0):4d} "
                f"{f(lv['first_audio_ms']['p50']):>8s} {f(lv['first_audio_ms']['p95']):>8s} "
                f"{f(lv['first_audio_ms']['p99']):>8s} {f(lv['segment_first_audio_ms']['p95']):>8s} "
                f"{f(lv['chunk_gap_ms']['p99']):>8s} {lv['underruns']:4d}/{lv['underrun_ms'] / 1e3:4.1f}s "
                f"{lv['sessions_with_underrun']:6d} {f(lv['rtf'], '.3f'):>6s} "
                f"{f(lv['server']['mean_flow_batch'], '.1f'):>6s} {f(gpu):>5s} "
                f"{f(None if frac is None else 100 * frac, '.2f'):>6s} {f(memory['per_peak_active_session_mb'], '.1f'):>8s}")
    for mode, rows in (report.get("repeats") or {}).items():
        for r in rows:
            knobs = f" with {json.dumps(r['planner_knobs'])}" if "planner_knobs" in r else ""
            if "ramp_s" in r:
                knobs += f" over {r['ramp_s']:g} s" if r["ramp_s"] else " at once"
            lines.append(f"{mode} @ {r['sessions']} sessions{knobs}, {r['runs']} runs: first-audio p95 "
                         f"{', '.join(f(v) for v in r['first_audio_p95_ms'])} ms, median "
                         f"{f(r['median_first_audio_p95_ms'])}; without underrun {r['runs_without_underrun']}, "
                         f"meeting the target ({r.get('target', str(LevelTarget('p95', TARGET_P95_MS)))}) "
                         f"{r['runs_meeting_target']}")  # reports before round 29 had one bar for all
    cmp = report.get("comparison")
    if cmp:
        for row in cmp["levels"]:
            where = _group_label(row.get("ramp_s"), json.dumps(row.get("planner_knobs"), sort_keys=True))
            runs = row.get("runs", {})
            medians = f", medians of {runs['product']}/{runs['baseline']} runs" if max(runs.values(), default=1) > 1 else ""
            if row.get("all_completed", True):
                lines.append(f"ratio product/baseline @ {row['sessions']} sessions{where}{medians}: first-audio p50 "
                             f"{f(row['first_audio_p50'], '.3f')}, p95 {f(row['first_audio_p95'], '.3f')}, "
                             f"RTF {f(row['rtf'], '.3f')}")
            else:
                lines.append(f"ratio product/baseline @ {row['sessions']} sessions{where}: none, "
                             "not every session of both completed")
        c = cmp["largest_level_without_underrun"]
        lines.append(f"largest level without underrun: product {c['product']}, baseline {c['baseline']}")
        t = cmp["largest_level_meeting_target"]
        lines.append(f"largest level without underrun and with p95 <= {t['max_p95_ms']:.0f} ms: "
                     f"product {t['product']}, baseline {t['baseline']}")
    return "\n".join(lines)


# ---- the run ----------------------------------------------------------------------------


def parse_levels(text: str) -> list[int]:
    levels = [int(x) for x in str(text).split(",") if x.strip()]
    if not levels or any(n < 1 for n in levels):
        raise ValueError(f"bad session levels {text!r}")
    return levels


async def _warm(target: Target, ctx: BenchContext) -> None:
    """One untimed single session (first-call allocations, lazy imports)."""
    s = WsSession(target.ws_url, 999_999, target.headers)
    with contextlib.suppress(Exception):
        await s.connect(ctx.timeout)
        await s.run(ctx.pieces[: max(4, len(ctx.pieces) // 4)], 0.0, time.perf_counter(),
                    {"voice": ctx.voice_id, "format": "pcm_s16le", "text_mode": ctx.text_mode}, ctx.timeout)
    await s.close()


START_STEPS = ("load", "lm", "stage", "voice", "warmup")  # EngineStats.start_<step>_seconds


async def tune_planner(target: Target, knobs: dict[str, Any]) -> None:
    """Set the gateway's first-chunk planner knobs (`POST /debug/planner`; the gateway needs
    `--debug-tuning true`, which the bench adds to a gateway it launches)."""
    async with httpx.AsyncClient(base_url=target.url, headers=target.headers, timeout=60) as client:
        resp = await client.post("/debug/planner", json=knobs)
    if resp.status_code != 200:
        raise RuntimeError(f"POST /debug/planner {knobs}: HTTP {resp.status_code} {resp.text}")


def parse_ramps(spec: str, levels: int) -> tuple[float, ...]:
    """`--ramp 16` (every level) or `--ramp 16,16,0,0` (one per level): seconds >= 0."""
    try:
        ramps = tuple(float(x) for x in str(spec).split(","))
    except ValueError:
        raise SystemExit(f"--ramp: seconds, or one per level comma-separated, got {spec!r}") from None
    if any(not r >= 0 or math.isinf(r) for r in ramps):
        raise SystemExit(f"--ramp: seconds must be finite and >= 0, got {spec!r}")
    if len(ramps) not in (1, levels):
        raise SystemExit(f"--ramp: one value, or one per level ({levels}), got {len(ramps)}")
    return ramps


def parse_planner_knobs(spec: str | None) -> tuple[dict[str, Any], ...]:
    """`--planner-knobs '{"min_hop": 0};{"min_hop": 8}'`: one JSON object per setting."""
    if not spec:
        return ()
    out = []
    for part in spec.split(";"):
        knobs = json.loads(part)
        if not isinstance(knobs, dict) or not knobs:
            raise SystemExit(f"--planner-knobs: each setting must be a non-empty JSON object, got {part!r}")
        out.append(knobs)
    return tuple(out)


async def run_target(target: Target, levels: Sequence[int], ctx: BenchContext, warm: bool,
                     out: list[dict[str, Any]], on_level: Callable[[], None] = lambda: None,
                     start: dict[str, Any] | None = None) -> None:
    """Run every level against `target`, appending to `out` (and calling `on_level`
    after each, so that a run cut short still leaves its finished levels). `start`
    receives how the gateway's start went: the engine's steps and the bench voice's
    registration (it captures the voice's flow graphs), in seconds."""
    # A registration captures the voice's flow graphs: 40-130 s on the H200 (round 11 timed
    # out at 120 s with the context cache's ring graphs).
    async with httpx.AsyncClient(base_url=target.url, headers=target.headers, timeout=REGISTRATION_TIMEOUT_S) as client:
        t0 = time.perf_counter()
        await ensure_voice(client, ctx.voice_id)
        if start is not None:
            start["voice_s"] = round(time.perf_counter() - t0, 1)
            metrics = await scrape(client)
            start |= {step: round(metrics[f"cosyvoice_engine_start_{step}_seconds"], 1)
                      for step in START_STEPS if f"cosyvoice_engine_start_{step}_seconds" in metrics}
            print(f"[{target.name}] start (s): {start}", flush=True)
    if warm:
        await _warm(target, ctx)
    knobs = ctx.planner_knobs if target.name == "product" else ()
    ramps = ctx.level_ramps if target.name == "product" else ()
    for i, n in enumerate(levels):
        if knobs:
            await tune_planner(target, knobs[i % len(knobs)])
        lv = await run_level(target, n, ctx, ramps[i] if ramps else None)
        if knobs:
            lv["planner_knobs"] = knobs[i % len(knobs)]
        if ramps:
            lv["ramp_s"] = ramps[i]
        out.append(lv)
        on_level()
        fa = lv["first_audio_ms"]
        print(f"[{target.name}] sessions={n} completed={lv['completed']} errors={lv['errors']} "
              f"playing at once={lv['sessions_playing_at_once']} "
              f"first-audio p50={fa['p50']} p95={fa['p95']} ms (censored {lv['first_audio_censored']}) "
              f"underruns={lv['underruns']} "
              f"(at audio ms p10/p50/p90 {[lv['underrun_at_audio_ms'][q] for q in ('p10', 'p50', 'p90')]}, "
              f"after start ms {[lv['underrun_since_start_ms'][q] for q in ('p10', 'p50', 'p90')]}, "
              f"by segment {lv['underruns_by_segment']}) "
              f"later segments' lead ms min/p5/p50 "
              f"{[lv['segment_lead_ms'][q] for q in ('min', 'p5', 'p50')]} "
              f"rtf={lv['rtf']} (censored {lv['rtf_censored']}; with text pacing {lv['rtf_wall_incl_text_pacing']}) "
              f"first-chunk phases (ms)={lv['first_chunk_phases_ms']} "
              f"first segments' (ms)={lv['opening_chunk_phases_ms']} "
              f"their slow ones' (ms)={lv['slow_opening_chunk_phases_ms']} "
              f"the first segments' second chunks (ms)={lv['opening_second_chunk_ms']} lm server (ms)={lv['lm_server_ms']} "
              f"planned on (ms)={lv['server']['opening_chunk_plan_ms']} "
              f"opening decisions (means)={lv['server'].get('opening_chunk_decisions')} "
              f"passed over={lv['server'].get('first_chunk_passed_over')} cuts={lv['server'].get('deadline_cuts')}/{lv['server'].get('first_chunk_cuts')} "
              f"below floor={lv['server'].get('first_chunk_below_floor')} crowded={lv['server'].get('first_chunk_crowded')} "
              f"learnt rounds={lv['server'].get('first_chunk_learnt_rounds')} "
              f"gc={lv['server'].get('gc')}"
              + (f" planner knobs={lv['planner_knobs']}" if "planner_knobs" in lv else "")
              + (f" registration={lv['registration']}" if "registration" in lv else ""),
              flush=True)


def nvml_index() -> int:
    """NVML numbers GPUs physically; CUDA_VISIBLE_DEVICES=1 makes the gateway's cuda:0 NVML's 1."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return int(first) if first.isdigit() else 0


def _token_counter(model_dir: Path | None) -> Callable[[str], int] | None:
    """Text tokens of a string under the served model's tokenizer (None without a model)."""
    if model_dir is None:
        return None
    from engine.frontend.tokenizer import TextTokenizer
    from engine.models.loader import read_model_config

    version = read_model_config(model_dir).version
    tok = TextTokenizer.from_dir(model_dir / "CosyVoice-BlankEN", version=version)
    return lambda text: len(tok.encode(text))


def kv_tokens_per_session(count: Callable[[str], int], text: str, tptt: float) -> float:
    """LM context of one session at its longest: prompt transcript + prompt speech + the
    whole paragraph's text and speech (an upper bound: each segment is its own request)."""
    n = count(text)
    return count(PROMPT_TRANSCRIPT) + PROMPT_SECONDS * SPEECH_TOKENS_PER_SECOND + n * (1 + tptt)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.ws_load", description=__doc__, allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Options not listed here are passed to the launched gateway (e.g. --engine.device cuda).")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--launch", action="store_true", help="start `python -m gateway` (with the unknown options)")
    where.add_argument("--url", help="base URL of a running gateway, e.g. http://127.0.0.1:8080")
    p.add_argument("--model", default=None,
                   help="model of the launched gateway (default tiny-random); with --url only for FLOP counting")
    p.add_argument("--model-cache", type=Path, default=ROOT / "data" / "models",
                   help="where random/hub models are written or downloaded")
    p.add_argument("--workdir", type=Path, default=None, help="launched gateways' data dirs (default: a temp dir)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--sessions", default="1,8,32", help="comma-separated concurrency levels")
    p.add_argument("--baseline", action="store_true", help="also run the baseline gateway (--launch only)")
    p.add_argument("--baseline-sessions", default=None, help="baseline levels (default: --sessions)")
    p.add_argument("--rate", type=float, default=30.0, help="text pieces per second per session (0 = all at once)")
    p.add_argument("--ramp", default="0",
                   help="spread each level's session starts over this many seconds; one value per level of "
                        "--sessions, comma-separated (e.g. 16,16,0,0), runs spread and burst levels on one gateway")
    p.add_argument("--register-at", type=float, default=None,
                   help="register one more voice (a longer prompt) this many seconds into each level")
    p.add_argument("--planner-knobs", default=None,
                   help="first-chunk planner knobs (and the stage's fill_padding, split_call_cost, first_cut, second_cut, rescue, pipeline_lead_ms, hold_ms, burst_hold_ms, burst_rows) set before "
                        "each level in turn, ';'-separated JSON objects (e.g. '{\"min_hop\": 0};{\"min_hop\": 8}'): "
                        "an A/B on one gateway (POST /debug/planner)")
    p.add_argument("--text", default=DEFAULT_TEXT)
    p.add_argument("--text-file", type=Path, default=None)
    p.add_argument("--text-mode", choices=("segment", "stream"), default="segment")
    p.add_argument("--tokens-per-text-token", type=float, default=None,
                   help="speech tokens per text token (default: calibrated to 14 spoken chars/s, see above)")
    p.add_argument("--client-procs", type=int, default=1,
                   help="client processes the sessions are spread over (one event loop each; use several "
                        "for hundreds of sessions)")
    p.add_argument("--format", choices=("pcm_s16le", "opus", "ulaw_8000"), default="pcm_s16le",
                   help="audio format of every session (at its default rate: 24 kHz, 48 kHz, 8 kHz)")
    p.add_argument("--prebuffer-ms", type=float, default=0.0, help="client jitter buffer before playback starts")
    p.add_argument("--timeout", type=float, default=600.0, help="per-session limit in seconds")
    p.add_argument("--no-warm", action="store_true", help="skip the untimed warm-up session")
    p.add_argument("--no-flops", action="store_true", help="skip FLOP counting")
    p.add_argument("--gpu-index", type=int, default=None,
                   help="NVML index of the gateway's GPU (default: the first of CUDA_VISIBLE_DEVICES, else 0)")
    p.add_argument("--ready-timeout", type=float, default=900.0)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None)
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args, gateway_flags = build_parser().parse_known_args(argv)
    if args.baseline and not args.launch:
        raise SystemExit("--baseline needs --launch (the bench starts the baseline gateway itself)")
    if gateway_flags and not args.launch:
        raise SystemExit(f"unknown options {gateway_flags} (gateway options need --launch)")
    levels = parse_levels(args.sessions)
    ramps = parse_ramps(args.ramp, len(levels))
    if len(ramps) > 1 and args.baseline:
        raise SystemExit("--ramp: one ramp per level applies to the product's levels; run --baseline with one")
    text = args.text_file.read_text().strip() if args.text_file else args.text
    pieces = split_tokens(text)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None

    if args.launch and args.model is None:
        args.model = "tiny-random"
    model_dir: Path | None = None
    if args.model:
        from engine.hub import resolve_model

        model_dir = resolve_model(args.model, args.model_cache)
    count = _token_counter(model_dir)
    n_text = count(text) if count else None
    tptt = args.tokens_per_text_token
    if tptt is None:
        tptt = calibrated_tokens_per_text_token(text, n_text) if n_text else 7.9
    device = _flag_value(gateway_flags, "--engine.device") or "auto"
    use_cuda = _cuda_available() and device != "cpu"

    peak = None
    count_flops: Callable[[], Any] | None = None
    if not args.no_flops and model_dir is not None:
        from bench.flops import count_model_flops, measure_peak_flops

        # The peak first, alone on the device. On CUDA the model FLOPs are counted before
        # any gateway starts: vLLM's start-up memory profiling fails when another process
        # frees GPU memory meanwhile. On CPU they are counted while the first gateway loads.
        peak = measure_peak_flops() if use_cuda else None
        if use_cuda:
            counted = count_model_flops(model_dir, "cuda")
            count_flops = lambda: counted  # noqa: E731
        else:
            flops_dir = model_dir
            count_flops = lambda: count_model_flops(flops_dir, "cpu")  # noqa: E731
    gpu = GpuSampler(args.gpu_index if args.gpu_index is not None else nvml_index()) if use_cuda else None
    ctx = BenchContext(pieces, args.rate, ramps[0] if len(ramps) == 1 else 0.0, VOICE_ID, args.text_mode, args.timeout,
                       args.prebuffer_ms / 1e3, None, peak, gpu if gpu and gpu.available else None,
                       kv_tokens_per_session(count, text, tptt) if count else None,
                       resolve_format(args.format, 24000 if args.format == "pcm_s16le" else None),
                       max(1, args.client_procs), args.register_at, parse_planner_knobs(args.planner_knobs),
                       ramps if len(ramps) > 1 else ())
    base_levels = parse_levels(args.baseline_sessions) if args.baseline_sessions else levels

    machine = describe_machine(use_cuda)  # figures compare only within one machine
    print(f"[machine] {machine_summary(machine)}", flush=True)
    report: dict[str, Any] = {
        "settings": {
            "model": args.model, "model_dir": str(model_dir) if model_dir else None,
            "gateway_flags": gateway_flags, "baseline_flags": list(BASELINE_FLAGS) if args.baseline else None,
            "url": args.url, "sessions": levels, "baseline_sessions": base_levels if args.baseline else None,
            "rate_tokens_per_s": args.rate, "ramp_s": ramps[0] if len(ramps) == 1 else list(ramps), "register_at_s": args.register_at,
            "planner_knobs": list(ctx.planner_knobs) or None,
            "text_mode": args.text_mode,
            "text": text, "text_chars": len(text), "text_pieces": len(pieces), "text_tokens": n_text,
            # With --url the running gateway's own setting applies; this is what it should be.
            "tokens_per_text_token": tptt,
            "speech_length_rule": f"{SPEECH_TOKENS_PER_SECOND:g} speech tokens/s at {SPOKEN_CHARS_PER_SECOND:g} "
                                  "spoken chars/s, divided by the served tokenizer's tokens for the text",
            "expected_audio_s_per_session": round(len(text) / SPOKEN_CHARS_PER_SECOND, 2),
            "voice": {"id": VOICE_ID, "prompt_seconds": PROMPT_SECONDS, "transcript": PROMPT_TRANSCRIPT},
            "prebuffer_ms": args.prebuffer_ms, "format": args.format, "sample_rate": ctx.fmt.sample_rate,
            "client_procs": ctx.client_procs,
            "first_audio_definition": FIRST_AUDIO_DEFINITIONS[args.text_mode],
            "censoring_definition": CENSORING_DEFINITION,
            "rtf_definition": RTF_DEFINITION,
            "wall_definition": WALL_DEFINITION,
            "machine": machine,
        },
        "model_flops": "n/a",
        "peak_flops_per_s": peak if peak is not None else "n/a",
        "results": {"product": [], "baseline": []},
    }

    def save() -> None:
        report["repeats"] = {mode: rows for mode, lvs in report["results"].items() if (rows := repeats(lvs))}
        if args.baseline and report["results"]["baseline"]:
            report["comparison"] = compare(report["results"]["product"], report["results"]["baseline"])
        if args.json:
            args.json.write_text(json.dumps(report, indent=2, allow_nan=False))

    async def go() -> None:
        counting = asyncio.create_task(asyncio.to_thread(count_flops)) if count_flops else None

        async def flops_ready() -> None:
            if counting is None or counting.done() and report["model_flops"] != "n/a":
                return
            try:
                ctx.flops = await counting
                report["model_flops"] = ctx.flops.to_json()
            except Exception as exc:  # FLOPs are one figure among many: report, go on
                report["model_flops"] = {"error": f"{type(exc).__name__}: {exc}"}

        if not args.launch:
            await flops_ready()
            target = Target("product", args.url.rstrip("/"), headers)
            await run_target(target, levels, ctx, not args.no_warm, report["results"]["product"], save)
            return
        workdir = args.workdir or Path(tempfile.mkdtemp(prefix="ws-load-"))
        flags = [*gateway_flags, "--engine.tokens-per-text-token", str(tptt)]
        tuning = ["--debug-tuning", "true"] if ctx.planner_knobs else []
        runs = [("product", [*flags, *tuning], levels)]
        if args.baseline:
            runs.append(("baseline", [*flags, *BASELINE_FLAGS], base_levels))
        for name, fl, lv in runs:
            gw = LaunchedGateway(Path(model_dir).resolve(), fl, workdir / name)
            await asyncio.to_thread(gw.wait_ready, args.ready_timeout)
            # A cold machine compiles and captures at start: worth knowing when a level's
            # time budget runs out before its first session.
            report["settings"].setdefault("ready_s", {})[name] = round(gw.ready_s or 0.0, 1)
            print(f"[{name}] gateway ready in {gw.ready_s:.1f} s", flush=True)
            try:
                await flops_ready()
                target = Target(name, gw.url, headers, gw.pid)
                report["settings"].setdefault("launch_commands", {})[name] = gw.command
                start = report["settings"].setdefault("start_s", {}).setdefault(name, {})
                await run_target(target, lv, ctx, not args.no_warm, report["results"][name], save, start)
            finally:
                await asyncio.to_thread(gw.stop)
                # Its warnings and errors (it runs at --log-level warning): a setting that fell
                # back at start (cuDNN's attention, a Triton kernel) says so only there.
                kept = report["settings"].setdefault("gateway_log", {})[name] = gw.log[-GATEWAY_LOG_LINES:]
                print(f"[{name}] gateway log: {len(gw.log)} lines" + "".join(f"\n    {line}" for line in kept[-5:]),
                      flush=True)

    asyncio.run(go())
    save()
    if args.plot:
        args.plot.write_text(plot(report))
    print(table(report), flush=True)
    return report


def _flag_value(flags: Sequence[str], name: str) -> str | None:
    value = None
    for i, f in enumerate(flags):
        if f == name and i + 1 < len(flags):
            value = flags[i + 1]
        elif f.startswith(name + "="):
            value = f.split("=", 1)[1]
    return value


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


if __name__ == "__main__":
    main()
