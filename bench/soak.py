"""Soak: hundreds of sessions opened, streamed, cancelled and dropped at random points
against a real gateway process on loopback, for a bounded time and count.

    python -m bench.soak --model tiny-random --sessions 300 --concurrency 12 --max-seconds 240

It starts `python -m gateway` as a subprocess (so the memory figure is the server's
own RSS, read from /proc), registers one voice, runs a warm-up round, records the
server RSS as the baseline, then runs the soak. Every session picks one behaviour:

* ``ws_complete``    WebSocket context spoken to the end (text sent word by word);
  checks: `done` arrived, no error, `done.audio_samples` == samples received;
* ``ws_two``         two interleaved contexts on one socket, both to the end;
* ``ws_cancel``      cancel after the first audio; checks a `cancelled` event;
* ``ws_drop``        TCP connection aborted after a random number of frames;
* ``ws_idle_close``  open a context, send nothing more, `close` the socket;
* ``http_complete``  OpenAI speech as SSE with a fixed token budget; checks the audio
  bytes == 2 x 960 x output_tokens and output_tokens == round(ratio x input_tokens);
* ``http_drop``      speech stream closed after the first chunk.

After each round it waits (bounded) for the engine to go idle, then `--settle-seconds`
(the server hands freed heap back to the OS once idle, see `gateway.__main__`), and
reads the RSS. At the end it reports the /metrics
gauges (active sessions, utterances, LM requests, queued flow chunks, open sessions:
all must be 0), the RSS after the soak against the baseline, and the losses: completed
sessions whose audio was incomplete or that got an unexpected error. Exit status 1 when
anything leaked or was lost.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import websockets

from bench.launch import LaunchedGateway, rss_bytes

SAMPLES_PER_TOKEN = 960
IDLE_GAUGES = ("cosyvoice_engine_active_sessions", "cosyvoice_engine_active_utterances",
               "cosyvoice_engine_lm_active", "cosyvoice_engine_flow_queue", "cosyvoice_sessions_active")
BEHAVIOURS = ("ws_complete", "ws_two", "ws_cancel", "ws_drop", "ws_idle_close", "http_complete", "http_drop")
TEXTS = ("Hello there.", "How can I help you today?", "The weather is fine, thanks for asking.",
         "Please hold on while I look that up.", "One, two, three.", "Goodbye and take care.")


# ---- the server process ------------------------------------------------------------------


def _rss(srv: LaunchedGateway) -> int:
    rss = rss_bytes(srv.pid)
    if rss is None:
        raise RuntimeError("cannot read the server's RSS from /proc")
    return rss


# ---- sessions --------------------------------------------------------------------------


@dataclass
class Tally:
    started: dict[str, int] = field(default_factory=dict)
    ok: dict[str, int] = field(default_factory=dict)
    losses: list[str] = field(default_factory=list)  # completed sessions with wrong/missing audio
    unexpected: list[str] = field(default_factory=list)  # exceptions/errors that should not happen
    audio_seconds: float = 0.0

    def count(self, d: dict[str, int], key: str) -> None:
        d[key] = d.get(key, 0) + 1


class Recorder:
    def __init__(self, ws: Any) -> None:
        self.ws, self.events, self.audio, self.frames = ws, [], {}, 0

    async def one(self, timeout: float = 120.0) -> None:
        msg = await asyncio.wait_for(self.ws.recv(), timeout)
        self.frames += 1
        if isinstance(msg, bytes):
            n = msg[0]
            cid = msg[1:1 + n].decode()
            self.audio[cid] = self.audio.get(cid, 0) + len(msg) - 1 - n
        else:
            self.events.append(json.loads(msg))

    def of(self, kind: str, cid: str | None = None) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == kind and (cid is None or e.get("context_id") == cid)]

    def ended(self, *cids: str) -> bool:
        got = {e.get("context_id") for e in self.events if e["type"] in ("done", "cancelled")}
        return all(c in got for c in cids)

    async def until(self, cond: Any, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            await self.one(max(0.05, deadline - time.monotonic()))


def _check_done(rec: Recorder, cid: str, tally: Tally, name: str) -> None:
    errors = rec.of("error", cid)
    done = rec.of("done", cid)
    if errors:
        tally.unexpected.append(f"{name}: {errors[0]}")
    elif len(done) != 1 or done[0]["audio_samples"] * 2 != rec.audio.get(cid, 0) or not rec.audio.get(cid):
        tally.losses.append(f"{name}: done={done} bytes={rec.audio.get(cid, 0)}")
    else:
        tally.audio_seconds += done[0]["audio_samples"] / 24000


async def ws_session(url: str, kind: str, rng: random.Random, tally: Tally, name: str) -> None:
    async with websockets.connect(url, max_size=None) as ws:
        rec = Recorder(ws)
        await rec.one()  # session_started
        text = rng.choice(TEXTS)
        if kind == "ws_complete":
            for word in text.split(" "):
                await ws.send(json.dumps({"type": "text", "context_id": "a", "text": word + " "}))
            await ws.send(json.dumps({"type": "end", "context_id": "a"}))
            await rec.until(lambda: rec.ended("a"))
            _check_done(rec, "a", tally, name)
        elif kind == "ws_two":
            for cid in ("a", "b"):
                await ws.send(json.dumps({"type": "text", "context_id": cid, "text": rng.choice(TEXTS), "end": True}))
            await rec.until(lambda: rec.ended("a", "b"))
            _check_done(rec, "a", tally, name + "/a")
            _check_done(rec, "b", tally, name + "/b")
        elif kind == "ws_cancel":
            await ws.send(json.dumps({"type": "text", "context_id": "a", "text": text + " " + text, "end": True}))
            await rec.until(lambda: rec.audio.get("a", 0) > 0 or rec.ended("a"))
            await ws.send(json.dumps({"type": "cancel", "context_id": "a"}))
            await rec.until(lambda: rec.ended("a"))
            if rec.of("error"):
                tally.unexpected.append(f"{name}: {rec.of('error')[0]}")
        elif kind == "ws_drop":
            await ws.send(json.dumps({"type": "text", "context_id": "a", "text": text, "end": True}))
            stop_after = rng.randint(0, 6)
            while rec.frames < stop_after and not rec.ended("a"):
                await rec.one()
            ws.transport.abort()  # vanish without a close frame
            tally.count(tally.ok, kind)
            return
        elif kind == "ws_idle_close":
            await ws.send(json.dumps({"type": "open", "context_id": "a"}))
            await ws.send(json.dumps({"type": "close"}))
            try:
                await rec.until(lambda: False, 30)
            except websockets.ConnectionClosed:
                pass
            if ws.close_code != 1000:
                tally.unexpected.append(f"{name}: close code {ws.close_code}")
    tally.count(tally.ok, kind)


async def http_session(client: httpx.AsyncClient, kind: str, rng: random.Random, tally: Tally, name: str,
                       ratio: float) -> None:
    text = rng.choice(TEXTS)
    body = {"model": "tts-1", "voice": "default", "input": text, "response_format": "pcm",
            "tokens_per_text_token": ratio, "seed": rng.randint(0, 1000)}
    if kind == "http_drop":
        async with client.stream("POST", "/v1/audio/speech", json=body) as resp:
            if resp.status_code != 200:
                tally.unexpected.append(f"{name}: status {resp.status_code}")
                return
            async for _ in resp.aiter_raw():
                break  # leave after the first chunk
    else:
        body["stream_format"] = "sse"
        audio, usage = 0, None
        async with client.stream("POST", "/v1/audio/speech", json=body) as resp:
            if resp.status_code != 200:
                tally.unexpected.append(f"{name}: status {resp.status_code}")
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                ev = json.loads(line[6:])
                if ev["type"] == "speech.audio.delta":
                    audio += len(base64.b64decode(ev["audio"]))
                elif ev["type"] == "speech.audio.done":
                    usage = ev["usage"]
                else:
                    tally.unexpected.append(f"{name}: {ev}")
        expected = None if usage is None else max(1, round(ratio * usage["input_tokens"]))
        if usage is None or usage["output_tokens"] != expected or audio != 2 * SAMPLES_PER_TOKEN * expected:
            tally.losses.append(f"{name}: usage={usage} bytes={audio}")
        else:
            tally.audio_seconds += audio / 2 / 24000
    tally.count(tally.ok, kind)


async def run_sessions(srv: LaunchedGateway, n: int, concurrency: int, max_seconds: float, seed: int,
                       ratio: float) -> tuple[Tally, float]:
    tally = Tally()
    rng = random.Random(seed)
    plan = [rng.choice(BEHAVIOURS) for _ in range(n)]
    queue: asyncio.Queue[tuple[int, str]] = asyncio.Queue()
    for i, kind in enumerate(plan):
        queue.put_nowait((i, kind))
    deadline = time.monotonic() + max_seconds
    t0 = time.monotonic()

    async def worker(wid: int, client: httpx.AsyncClient) -> None:
        wrng = random.Random(seed * 1000 + wid)
        while time.monotonic() < deadline:
            try:
                i, kind = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            name = f"#{i}:{kind}"
            tally.count(tally.started, kind)
            try:
                if kind.startswith("ws_"):
                    await ws_session(srv.ws_url, kind, wrng, tally, name)
                else:
                    await http_session(client, kind, wrng, tally, name, ratio)
            except Exception as exc:  # noqa: BLE001 - every failure is a finding
                tally.unexpected.append(f"{name}: {type(exc).__name__}: {exc}")

    async with httpx.AsyncClient(base_url=srv.url, timeout=120) as client:
        await asyncio.gather(*(worker(w, client) for w in range(concurrency)))
    return tally, time.monotonic() - t0


# ---- figures ---------------------------------------------------------------------------


def scrape(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def wait_idle(url: str, timeout: float) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        left = {k: m.get(k, float("nan")) for k in IDLE_GAUGES if m.get(k) != 0}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def write_voice(root: Path) -> None:
    assets = root / "assets"
    assets.mkdir(parents=True, exist_ok=True)
    sr = 24000
    t = np.arange(int(3.5 * sr)) / sr
    pcm = (0.3 * np.sin(2 * np.pi * 210 * t) * 32767).astype("<i2").tobytes()
    header = (b"RIFF" + (36 + len(pcm)).to_bytes(4, "little") + b"WAVEfmt " + (16).to_bytes(4, "little")
              + (1).to_bytes(2, "little") + (1).to_bytes(2, "little") + sr.to_bytes(4, "little")
              + (2 * sr).to_bytes(4, "little") + (2).to_bytes(2, "little") + (16).to_bytes(2, "little")
              + b"data" + len(pcm).to_bytes(4, "little"))
    (assets / "default.wav").write_bytes(header + pcm)
    (assets / "default.txt").write_text("The default voice of the soak test.")


def _merge(into: Tally, part: Tally) -> None:
    for k, v in part.started.items():
        into.started[k] = into.started.get(k, 0) + v
    for k, v in part.ok.items():
        into.ok[k] = into.ok.get(k, 0) + v
    into.losses += part.losses
    into.unexpected += part.unexpected
    into.audio_seconds += part.audio_seconds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-random", help="model dir or tiny-random")
    ap.add_argument("--sessions", type=int, default=300)
    ap.add_argument("--warmup-sessions", type=int, default=30)
    ap.add_argument("--concurrency", type=int, default=12)
    ap.add_argument("--max-seconds", type=float, default=240.0, help="soak time bound (sessions not started by then are skipped)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ratio", type=float, default=1.0, help="HTTP: speech tokens per text token")
    ap.add_argument("--rounds", type=int, default=3, help="the soak's sessions are split into rounds; RSS is read after each")
    ap.add_argument("--rss-tolerance-mb", type=float, default=64.0)
    ap.add_argument("--settle-seconds", type=float, default=6.0,
                    help="idle time before each RSS reading (the server trims its heap after 5 s idle)")
    ap.add_argument("--server-arg", action="append", default=[], help="extra gateway flag (repeatable)")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        root = Path(tmp)
        write_voice(root)
        extra = ["--engine.device", "cpu", "--engine.lm-backend", "torch", *args.server_arg]
        srv = LaunchedGateway(args.model, extra, root)
        try:
            srv.wait_ready(300)
            warm, _ = asyncio.run(run_sessions(srv, args.warmup_sessions, args.concurrency, 120, args.seed + 1, args.ratio))
            wait_idle(srv.url, 60)
            time.sleep(args.settle_seconds)
            baseline = _rss(srv)
            tally, elapsed, rss_rounds = Tally(), 0.0, []
            per_round = max(1, args.sessions // args.rounds)
            t_end = time.monotonic() + args.max_seconds
            for r in range(args.rounds):
                part, dt = asyncio.run(run_sessions(srv, per_round, args.concurrency, max(1.0, t_end - time.monotonic()),
                                                    args.seed + 100 * r, args.ratio))
                _merge(tally, part)
                elapsed += dt
                left = wait_idle(srv.url, 60)
                time.sleep(args.settle_seconds)
                rss_rounds.append(round(_rss(srv) / 2**20, 1))
            after = _rss(srv)
            metrics = scrape(srv.url)
        finally:
            code = srv.stop()

    started = sum(tally.started.values())
    growth_mb = (after - baseline) / 2**20
    report = {
        "sessions_started": started,
        "sessions_ok": sum(tally.ok.values()),
        "by_behaviour": {k: f"{tally.ok.get(k, 0)}/{v}" for k, v in sorted(tally.started.items())},
        "seconds": round(elapsed, 1),
        "audio_seconds_verified": round(tally.audio_seconds, 1),
        "losses": len(tally.losses),
        "unexpected": len(tally.unexpected),
        "leftover_gauges": left,
        "lm_tokens_total": metrics.get("cosyvoice_engine_lm_tokens_total"),
        "rss_baseline_mb": round(baseline / 2**20, 1),
        "rss_after_mb": round(after / 2**20, 1),
        "rss_growth_mb": round(growth_mb, 1),
        "rss_after_each_round_mb": rss_rounds,
        "rss_tolerance_mb": args.rss_tolerance_mb,
        "warmup_unexpected": len(warm.unexpected) + len(warm.losses),
        "server_exit_code": code,
    }
    print(json.dumps(report, indent=2))
    for line in (tally.losses + tally.unexpected)[:20]:
        print("  ", line)
    failed = bool(tally.losses or tally.unexpected or left or growth_mb > args.rss_tolerance_mb or code != 0)
    print("SOAK", "FAILED" if failed else "PASSED")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
