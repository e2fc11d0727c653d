"""Shared test helpers: test audio, a real uvicorn `LiveServer`, the gateway app with the
tiny random-weight engine, a fault injector around the real engine, and small HTTP
helpers.

Everything here drives the real code path: the app is `gateway.app.create_app` (or the
same lifespan with only the HTTP routes), the engine is `engine.engine.Engine` on the
tiny model directory. Faults are injected by wrapping one method of the real engine for
chosen utterances; no component invents features or audio.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Coroutine, Iterator, TypeVar

import httpx
import numpy as np
import pytest
import torch
import uvicorn
from starlette.applications import Starlette

from engine.config import EngineConfig
from engine.engine import Engine
from engine.types import VoicePrompt
from gateway.audio_files import wav_bytes
from gateway.settings import EngineSettings, Settings
from gateway.voices import VoiceLimits

T = TypeVar("T")

SR = 24000
API_KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# Random weights never emit end-of-speech: fix 2 speech tokens per text token (1 token
# = 960 samples at 24 kHz) so lengths are deterministic and short.
FAST = {"tokens_per_text_token": 2.0, "seed": 0}
SAMPLES_PER_TOKEN = 960


# --------------------------------------------------------------------------------------
# Test audio
# --------------------------------------------------------------------------------------


def tone(seconds: float, sr: int = SR, freq: float = 220.0, amp: float = 0.3) -> np.ndarray:
    t = np.arange(int(round(seconds * sr))) / sr
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def tone_wav(seconds: float, sr: int = SR, freq: float = 220.0) -> bytes:
    return wav_bytes(tone(seconds, sr, freq), sr)


# --------------------------------------------------------------------------------------
# The real engine
# --------------------------------------------------------------------------------------


# By default chunk sizes follow timing: the first chunk's the measured load
# (`engine.first_chunk`), a later chunk's how far ahead of its listener it is
# (`engine.chunk_patience_s`). So a seeded request's audio and its chunks depend on what else
# ran before it and on how fast this CPU is. The tests that compare audio across requests,
# restarts or servers, or count chunks, fix both.
FIXED_CHUNKS = ("--engine.initial-hop-max", "0", "--engine.chunk-patience-s", "0")


def engine_config(model_dir: Path) -> EngineConfig:
    """The tiny engine as the tests run it: CPU, torch LM, no warm-up synthesis, and
    chunks of fixed sizes (FIXED_CHUNKS)."""
    return EngineConfig(model_dir=Path(model_dir), device="cpu", lm_backend="torch", warmup=False, initial_hop_max=0,
                        chunk_patience_s=0.0)


async def create_engine(model_dir: Path) -> Engine:
    return await Engine.create(engine_config(model_dir))


def assert_same_audio(a: np.ndarray, b: np.ndarray) -> None:
    """The same synthesis up to float rounding. Which chunks share a stage batch (and so the
    padded shapes and summation order) depends on timing; seen on the tiny model: up to
    1.3e-4 at a sample, 2.4e-4 of the signal's rms. A real mix-up (a stream's state in the
    wrong row, a chunk out of order) is off by the signal itself."""
    assert a.shape == b.shape
    assert np.max(np.abs(a - b), initial=0.0) < 1e-3
    assert np.sqrt(np.mean((a - b) ** 2)) <= 1e-3 * np.sqrt(np.mean(a**2))


def same_prompt(a: VoicePrompt, b: VoicePrompt) -> bool:
    return (a.transcript == b.transcript and torch.equal(a.speech_tokens, b.speech_tokens)
            and torch.equal(a.speech_feat, b.speech_feat) and torch.equal(a.embedding, b.embedding))


class LoopThread:
    """An asyncio loop in a daemon thread: objects bound to one loop (the engine's
    audio stage and LM tasks) live here for a whole test module, and tests submit
    coroutines with `run`."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="test-loop")
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 120.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


class CountingEngine:
    """The real engine, counting `prepare_voice` calls (to prove features are loaded
    from disk rather than recomputed). Everything else is delegated unchanged."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.prepared = 0

    async def prepare_voice(self, *args: Any, **kw: Any) -> VoicePrompt:
        self.prepared += 1
        return await self._engine.prepare_voice(*args, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


# --------------------------------------------------------------------------------------
# Fault injection around the real engine
# --------------------------------------------------------------------------------------


class InjectedFault(RuntimeError):
    """What an injected fault raises (so logs and assertions can tell it apart)."""


class StageFault:
    """Make the real `AudioStage` fail the chunks of one voice from chunk `from_chunk` on.

    The voice is recognised by its speaker embedding, which every chunk job carries, so a
    test selects the faulty utterances through the public API (the voice it asks for).
    ``where="run"`` fails a matching chunk as it is submitted (only that utterance is
    hit); ``where="compute"`` makes the flow/vocoder batch that contains it raise on the
    stage's worker thread (every chunk batched with it fails too — the engine's real
    failure unit). `count` says how many chunks were failed.
    """

    def __init__(self, engine: Engine, voice: VoicePrompt, from_chunk: int = 1, where: str = "run") -> None:
        self.engine = engine
        self.embedding = voice.embedding.detach().cpu().clone()
        self.from_chunk = from_chunk
        self.where = where
        self.count = 0
        self._orig: Callable[..., Any] | None = None

    def _hit(self, job: Any) -> bool:
        emb = job.flow.embedding.detach().cpu()
        return job.chunk_index >= self.from_chunk and emb.shape == self.embedding.shape and torch.equal(emb, self.embedding)

    def install(self) -> "StageFault":
        stage = self.engine.stage
        if self.where == "run":
            orig_submit = stage.submit

            def submit(job: Any) -> Any:
                if self._hit(job):
                    self.count += 1
                    raise InjectedFault(f"injected fault in chunk {job.chunk_index}")
                return orig_submit(job)

            self._orig = orig_submit
            stage.submit = submit  # type: ignore[method-assign]
        elif self.where == "compute":
            # `_launch`: a round's work, pipelined (`stage_pipeline_lead_ms`) or not.
            orig_launch = stage._launch

            def launch(batch: list[Any], *args: Any, **kwargs: Any) -> Any:
                if any(self._hit(j) for j in batch):
                    self.count += 1
                    raise InjectedFault("injected fault in a flow/vocoder batch")
                return orig_launch(batch, *args, **kwargs)

            self._orig = orig_launch
            stage._launch = launch  # type: ignore[method-assign]
        else:
            raise ValueError(self.where)
        return self

    def remove(self) -> None:
        stage = self.engine.stage
        if self.where == "run":
            del stage.submit  # the instance attribute; the class method shows through again
        else:
            del stage._launch

    def __enter__(self) -> "StageFault":
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.remove()


# --------------------------------------------------------------------------------------
# The gateway, served by a real uvicorn on a loopback port
# --------------------------------------------------------------------------------------


def gateway_settings(model_dir: Path, root: Path, **over: Any) -> Settings:
    """Settings for `create_app` with the tiny model, a fresh data dir under `root`,
    API keys on and a 2 MB upload limit (so limit tests stay small)."""
    base = Settings(
        model=str(model_dir),
        data_dir=root / "data",
        assets_dir=root / "no-assets",
        api_keys=(API_KEY,),
        default_voice="default",
        engine=EngineSettings(device="cpu", lm_backend="torch", warmup=False, initial_hop_max=0,
                              chunk_patience_s=0.0),
        voices=VoiceLimits(max_upload_bytes=2_000_000),
    )
    return replace(base, **over)


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.ready = threading.Event()
        self.loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: Any = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets)
        self.ready.set()


class LiveServer:
    """uvicorn in a background thread on a free loopback port.

    `__enter__` returns once the app's lifespan start-up has finished (an Event, no
    sleeps). `gw` is the app's shared state; `call(coro)` runs a coroutine on the
    server's own event loop (where the engine lives).
    """

    def __init__(self, app: Starlette, start_timeout: float = 180.0, send_buffer: int | None = None,
                 **config: Any) -> None:
        self.app = app
        self.start_timeout = start_timeout
        # A fixed kernel send buffer (inherited by accepted sockets) stands in for a slow
        # network: without it loopback buffers absorb megabytes before backpressure.
        self.send_buffer = send_buffer
        self.config = {"log_level": "warning", "lifespan": "on", "timeout_graceful_shutdown": 5, **config}

    def __enter__(self) -> "LiveServer":
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if self.send_buffer is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.send_buffer)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.ws_url = f"ws://127.0.0.1:{self.port}/v1/tts/stream"
        self.server = _Server(uvicorn.Config(self.app, **self.config))

        def target() -> None:
            try:
                self.server.run(sockets=[sock])
            finally:
                self.server.ready.set()  # never leave the waiter hanging on a failed start

        self.thread = threading.Thread(target=target, daemon=True)
        self.thread.start()
        if not self.server.ready.wait(self.start_timeout) or not self.server.started:
            self.__exit__()
            raise RuntimeError("server did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive(), "server did not stop"

    @property
    def gw(self) -> Any:
        return self.app.state.gw

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        assert self.server.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.server.loop).result(timeout)

    def client(self, **kw: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, **{"timeout": 120, **kw})


@contextlib.contextmanager
def live_gateway(model_dir: Path, root: Path, send_buffer: int | None = None, **over: Any) -> Iterator[LiveServer]:
    """The production app (`create_app`) with the tiny model, served on loopback."""
    from gateway.app import create_app, transport_options

    settings = gateway_settings(model_dir, root, **over)
    with LiveServer(create_app(settings), send_buffer=send_buffer, **transport_options(settings)) as srv:
        yield srv


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------------------
# HTTP helpers
# --------------------------------------------------------------------------------------


def register(client: httpx.Client, voice_id: str | None, audio: bytes, transcript: str = "Hello there.",
             filename: str = "prompt.wav", headers: dict[str, str] | None = None, **extra: str) -> httpx.Response:
    data = {"transcript": transcript, **extra}
    if voice_id is not None:
        data["id"] = voice_id
    return client.post("/v1/voices", headers=AUTH if headers is None else headers, data=data,
                       files={"file": (filename, audio, "audio/wav")})


def err(resp: httpx.Response) -> tuple[int, str]:
    """(status, code) of a documented JSON error; asserts the shape."""
    body = resp.json()
    assert set(body) == {"error"} and isinstance(body["error"]["message"], str), body
    return resp.status_code, body["error"]["code"]


def scrape(client: httpx.Client, headers: dict[str, str] | None = None) -> dict[str, float]:
    """`/metrics` as {series (with labels): value}."""
    resp = client.get("/metrics", headers=AUTH if headers is None else headers)
    assert resp.status_code == 200, resp.text
    out: dict[str, float] = {}
    for line in resp.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


ENGINE_IDLE_GAUGES = ("cosyvoice_engine_active_sessions", "cosyvoice_engine_active_utterances",
                      "cosyvoice_engine_lm_active", "cosyvoice_engine_flow_queue", "cosyvoice_sessions_active")


def leftovers(client: httpx.Client) -> dict[str, float]:
    """The engine/gateway gauges that must be 0 when nothing is running, non-zero ones only."""
    m = scrape(client)
    return {k: m.get(k, float("nan")) for k in ENGINE_IDLE_GAUGES if m.get(k, float("nan")) != 0}


def eventually(check: Callable[[], T], timeout: float = 30.0, interval: float = 0.05) -> T:
    """Poll `check` until it returns a truthy value or `timeout` passes (then assert).

    For black-box conditions that have no event to wait on (an engine session freed
    after a client hung up); the deadline bounds the test, the interval only paces it.
    """
    deadline = time.monotonic() + timeout
    last: T = check()
    while not last:
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached within {timeout}s (last: {last!r})")
        time.sleep(interval)
        last = check()
    return last


@pytest.fixture(scope="module")
def loop_thread() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.close()


# --------------------------------------------------------------------------------------
# WebSocket client side
# --------------------------------------------------------------------------------------


class WsRecorder:
    """Reads one socket's frames: JSON events in order, binary audio per context.

    Binary frames are ``[len(context_id)][context_id][payload]`` (docs/protocol.md).
    """

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.events: list[dict[str, Any]] = []
        self.audio: dict[str, bytearray] = {}

    def of(self, kind: str, cid: str | None = None) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == kind and (cid is None or e.get("context_id") == cid)]

    def finished(self, *cids: str) -> bool:
        """Every context got `done` or `cancelled`."""
        ended = {e.get("context_id") for e in self.events if e["type"] in ("done", "cancelled")}
        return all(c in ended for c in cids)

    async def send(self, **msg: Any) -> None:
        import json

        await self.ws.send(json.dumps(msg))

    async def recv_one(self, timeout: float = 60.0) -> None:
        import base64
        import json

        msg = await asyncio.wait_for(self.ws.recv(), timeout)
        if isinstance(msg, bytes):
            n = msg[0]
            self.audio.setdefault(msg[1:1 + n].decode(), bytearray()).extend(msg[1 + n:])
        else:
            ev = json.loads(msg)
            self.events.append(ev)
            if ev["type"] == "audio":
                self.audio.setdefault(ev["context_id"], bytearray()).extend(base64.b64decode(ev["data"]))

    async def until(self, done: Callable[["WsRecorder"], bool], timeout: float = 60.0) -> "WsRecorder":
        deadline = time.monotonic() + timeout
        while not done(self):
            await self.recv_one(max(0.05, deadline - time.monotonic()))
        return self


# --------------------------------------------------------------------------------------
# The gateway as a separate process (signals, crashes)
# --------------------------------------------------------------------------------------


class GatewayProcess:
    """`python -m gateway` in a subprocess on a free port, for signal and crash tests.

    `start()` returns once uvicorn reports it is serving (read from the process's log,
    no polling); the log keeps being drained by a thread so the pipe never fills.
    """

    def __init__(self, model_dir: Path, root: Path, *args: str) -> None:
        self.model_dir, self.root, self.args = Path(model_dir), Path(root), args
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ws_url = f"ws://127.0.0.1:{self.port}/v1/tts/stream"
        self.log: list[str] = []
        self.proc: Any = None

    def start(self, timeout: float = 120.0, attempts: int = 3) -> "GatewayProcess":
        # The port is free when chosen but may be taken (e.g. as some client's ephemeral
        # port) before the child binds it: then the child exits and we retry on another.
        for attempt in range(attempts):
            if self._start_once(timeout):
                return self
            if not any("address already in use" in line.lower() for line in self.log) or attempt == attempts - 1:
                break
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            self.ws_url = f"ws://127.0.0.1:{self.port}/v1/tts/stream"
        self.kill()
        raise RuntimeError("gateway process did not start:\n" + "\n".join(self.log[-30:]))

    def _start_once(self, timeout: float) -> bool:
        import os
        import subprocess
        import sys

        repo = Path(__file__).resolve().parent.parent
        cmd = [sys.executable, "-m", "gateway", "--model", str(self.model_dir), "--host", "127.0.0.1",
               "--port", str(self.port), "--data-dir", str(self.root / "data"),
               "--assets-dir", str(self.root / "assets"), "--engine.device", "cpu",
               "--engine.lm-backend", "torch", "--engine.warmup", "false", *FIXED_CHUNKS, *self.args]
        env = {k: v for k, v in os.environ.items() if not k.startswith("COSYVOICE_GW_")}
        env["PYTHONPATH"] = str(repo) + os.pathsep + env.get("PYTHONPATH", "")
        self.root.mkdir(parents=True, exist_ok=True)
        self.log = []
        # cwd outside the repo so its config/default.yaml is not picked up.
        self.proc = subprocess.Popen(cmd, cwd=self.root, env=env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, bufsize=1)
        up = threading.Event()
        proc, log = self.proc, self.log

        def drain() -> None:
            for line in proc.stderr:
                log.append(line.rstrip())
                if "Uvicorn running on" in line:  # logged once the socket is bound
                    up.set()
            up.set()  # EOF: the process ended

        threading.Thread(target=drain, daemon=True).start()
        if not up.wait(timeout):
            return False
        if proc.poll() is not None or not any("Uvicorn running on" in line for line in log):
            proc.wait(30)
            return False
        return True

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 60.0) -> int:
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def client(self, **kw: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, **kw)
