"""VoiceStore: validation, atomic persistence, crash recovery, restart, assets.

The store only needs `prepare_voice` / `voice_from_arrays` from the engine, so these
tests use `FakeEngine` (also used by the HTTP tests for error paths): deterministic
features derived from the audio, so "the same voice after a restart" is checkable
bit for bit. The real tiny engine is exercised end to end in test_http_api.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Callable

import numpy as np
import pytest
import torch

from engine.types import AudioChunk, SessionOptions, UtteranceError, UtteranceStats, VoicePrompt
from gateway.audio_files import wav_bytes
from gateway.errors import ApiError
from gateway.voices import VoiceInfo, VoiceLimits, VoiceStore

SR = 24000


def tone(seconds: float, sr: int = SR, freq: float = 220.0, amp: float = 0.3) -> np.ndarray:
    t = np.arange(int(round(seconds * sr))) / sr
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def tone_wav(seconds: float, sr: int = SR, freq: float = 220.0) -> bytes:
    return wav_bytes(tone(seconds, sr, freq), sr)


# --------------------------------------------------------------------------------------
# A deterministic stand-in for the engine (same contract as engine.engine.Engine)
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FakeStats:
    active_sessions: int
    lm_tokens: int


class FakeSession:
    """Speaks `tokens_per_text_token` x words tokens; 960 samples per token at speed 1."""

    CHUNK = 9600

    def __init__(self, engine: "FakeEngine", voice: VoicePrompt, options: SessionOptions) -> None:
        self.engine, self.voice, self.options = engine, voice, options
        self._queue: asyncio.Queue[AudioChunk | UtteranceError | None] = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._stats: dict[str, UtteranceStats] = {}
        self._prev: asyncio.Task | None = None
        self.aborted = False
        self.on_abort: Callable[[], None] | None = None  # tests hook a threading.Event here

    async def submit(self, text: str, options: SessionOptions | None = None) -> str:
        uid = f"u{len(self._tasks)}"
        self._stats[uid] = UtteranceStats(submitted_at=time.monotonic())
        task = asyncio.create_task(self._speak(uid, text, options or self.options, self._prev))
        self._prev = task
        self._tasks.append(task)
        return uid

    def utterance_stats(self, uid: str) -> UtteranceStats | None:
        return self._stats.get(uid)

    async def _speak(self, uid: str, text: str, opts: SessionOptions, prev: asyncio.Task | None) -> None:
        if prev is not None:
            await prev
        if "FAIL" in text:
            await self._queue.put(UtteranceError(uid, "engine_error", "asked to fail"))
            return
        tokens = max(1, round((opts.tokens_per_text_token or 2.0) * len(self.engine.text_ids(text))))
        total = int(round(tokens * 960 / opts.speed))
        rng = np.random.default_rng(opts.seed or 0)
        pcm = (0.2 * np.sin(np.arange(total) * 0.05) + 0.05 * rng.standard_normal(total)).astype(np.float32)
        start, index = 0, 0
        while True:
            end = min(total, start + self.CHUNK)
            await asyncio.sleep(0)  # yield like a real pipeline would
            await self._queue.put(AudioChunk(uid, pcm[start:end], start, end >= total, index))
            self.engine.lm_tokens += tokens if end >= total else 0
            self._stats[uid].num_speech_tokens = tokens
            if end >= total:
                return
            start, index = end, index + 1

    async def finish(self) -> None:
        tasks = list(self._tasks)

        async def close_after() -> None:
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._queue.put(None)

        self._tasks.append(asyncio.create_task(close_after()))

    async def events(self) -> AsyncIterator[AudioChunk | UtteranceError]:
        while True:
            ev = await self._queue.get()
            if ev is None:
                return
            yield ev

    async def cancel(self, uid: str | None = None) -> None:
        for t in self._tasks:
            t.cancel()

    async def abort(self) -> None:
        if not self.aborted:
            self.aborted = True
            self.engine.sessions.discard(self)
            if self.on_abort is not None:
                self.on_abort()
        await self.cancel(None)
        self._queue.put_nowait(None)


class FakeEngine:
    sample_rate = SR
    model_name = "Fake-CosyVoice3"

    def __init__(self) -> None:
        self.ready = True
        self.prepared = 0
        self.lm_tokens = 0
        self.sessions: set[FakeSession] = set()

    async def prepare_voice(self, voice_id: str, wav: np.ndarray, sample_rate: int, transcript: str) -> VoicePrompt:
        self.prepared += 1
        p = max(1, int(len(wav) / sample_rate * 25))
        digest = np.frombuffer(hashlib.sha256(np.asarray(wav, np.float32).tobytes()).digest(), np.uint8)
        tokens = np.resize(digest.astype(np.int64), p)
        feat = np.outer(np.arange(2 * p, dtype=np.float32), np.ones(80, np.float32)) * 0.01 + digest[0]
        emb = np.resize(digest.astype(np.float32) / 255.0, 192)
        return self.voice_from_arrays(voice_id, transcript, tokens, feat, emb)

    def voice_from_arrays(self, voice_id, transcript, speech_tokens, speech_feat, embedding) -> VoicePrompt:
        return VoicePrompt(
            voice_id=voice_id,
            transcript=transcript,
            speech_tokens=torch.as_tensor(np.asarray(speech_tokens), dtype=torch.long).reshape(-1),
            speech_feat=torch.as_tensor(np.asarray(speech_feat), dtype=torch.float32).reshape(-1, 80),
            embedding=torch.as_tensor(np.asarray(embedding), dtype=torch.float32).reshape(-1),
        )

    def text_ids(self, text: str) -> list[int]:
        return list(range(len(text.split())))

    def open_session(self, voice: VoicePrompt, options: SessionOptions | None = None) -> FakeSession:
        s = FakeSession(self, voice, options or SessionOptions())
        self.sessions.add(s)
        return s

    def stats(self) -> FakeStats:
        return FakeStats(active_sessions=len(self.sessions), lm_tokens=self.lm_tokens)

    async def close(self) -> None:
        for s in list(self.sessions):
            await s.abort()


# --------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------


def run(coro):
    return asyncio.run(coro)


async def open_store(data_dir: Path, engine: FakeEngine | None = None, **limits) -> VoiceStore:
    return await VoiceStore(data_dir, engine or FakeEngine(), VoiceLimits(**limits)).open()


def same_prompt(a: VoicePrompt, b: VoicePrompt) -> bool:
    return (a.transcript == b.transcript and torch.equal(a.speech_tokens, b.speech_tokens)
            and torch.equal(a.speech_feat, b.speech_feat) and torch.equal(a.embedding, b.embedding))


def live_dirs(data_dir: Path) -> list[str]:
    return sorted(p.name for p in (data_dir / "voices").iterdir())


def db_ids(data_dir: Path) -> list[str]:
    with sqlite3.connect(data_dir / "voices.sqlite3") as db:
        return sorted(r[0] for r in db.execute("SELECT id FROM voices"))


# --------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------


def test_register_persists_and_survives_restart(tmp_path: Path) -> None:
    async def scenario() -> None:
        engine = FakeEngine()
        store = await open_store(tmp_path, engine)
        info = await store.register("alice", "Alice", " Hello there. ", tone_wav(4.0), audio_ext=".wav")
        assert isinstance(info, VoiceInfo)
        assert (info.id, info.name, info.transcript, info.sample_rate) == ("alice", "Alice", "Hello there.", SR)
        assert info.duration_s == pytest.approx(4.0, abs=1e-3)
        assert info.num_prompt_tokens == 100
        first = await store.get_prompt("alice")
        await store.close()

        # Files on disk: the original bytes untouched, features as plain arrays.
        (folder,) = live_dirs(tmp_path)
        assert folder.startswith("alice.")
        assert (tmp_path / "voices" / folder / "source.wav").read_bytes() == tone_wav(4.0)
        assert db_ids(tmp_path) == ["alice"]

        engine2 = FakeEngine()
        store2 = await open_store(tmp_path, engine2)
        assert [v.id for v in store2.list()] == ["alice"]
        assert store2.get("alice") == info
        again = await store2.get_prompt("alice")
        assert same_prompt(first, again)
        assert engine2.prepared == 0  # loaded from disk, not recomputed
        await store2.close()

    run(scenario())


def test_generated_id_and_delete(tmp_path: Path) -> None:
    async def scenario() -> None:
        store = await open_store(tmp_path)
        info = await store.register(None, None, "Some words.", tone_wav(3.5))
        assert info.id.startswith("voice_") and info.name == info.id
        assert await store.delete(info.id) is True
        assert await store.delete(info.id) is False
        assert store.get(info.id) is None and store.list() == []
        with pytest.raises(KeyError):
            await store.get_prompt(info.id)
        assert live_dirs(tmp_path) == [] and db_ids(tmp_path) == []
        await store.close()

    run(scenario())


@pytest.mark.parametrize(
    "voice_id, audio, transcript, code, status",
    [
        ("bad id!", tone_wav(4.0), "hi", "invalid_voice_id", 400),
        ("x" * 65, tone_wav(4.0), "hi", "invalid_voice_id", 400),
        ("ok", b"definitely not audio" * 50, "hi", "invalid_audio", 400),
        ("ok", b"", "hi", "invalid_audio", 400),
        ("ok", tone_wav(2.0), "hi", "audio_too_short", 400),
        ("ok", tone_wav(31.0), "hi", "audio_too_long", 400),
        ("ok", wav_bytes(tone(4.0, 8000), 8000), "hi", "sample_rate_too_low", 400),
        ("ok", wav_bytes(np.zeros(4 * SR, np.float32), SR), "hi", "invalid_audio", 400),
        ("ok", tone_wav(4.0), "   ", "missing_transcript", 400),
    ],
)
def test_register_rejects_bad_input(tmp_path: Path, voice_id, audio, transcript, code, status) -> None:
    async def scenario() -> None:
        store = await open_store(tmp_path)
        with pytest.raises(ApiError) as err:
            await store.register(voice_id, None, transcript, audio)
        assert (err.value.code, err.value.status) == (code, status)
        assert store.list() == [] and live_dirs(tmp_path) == [] and db_ids(tmp_path) == []
        await store.close()

    run(scenario())


def test_size_limit_and_conflict(tmp_path: Path) -> None:
    async def scenario() -> None:
        store = await open_store(tmp_path, max_upload_bytes=150_000)
        with pytest.raises(ApiError) as err:
            await store.register("big", None, "hi", tone_wav(4.0))  # 192 kB of WAV
        assert (err.value.status, err.value.code) == (413, "audio_too_large")
        await store.register("v1", None, "hi", wav_bytes(tone(3.2, 16000), 16000))  # 102 kB
        with pytest.raises(ApiError) as err:
            await store.register("v1", None, "hi again", wav_bytes(tone(3.5, 16000), 16000))
        assert (err.value.status, err.value.code) == (409, "voice_exists")
        assert store.get("v1").transcript == "hi"
        await store.close()

    run(scenario())


def test_concurrent_registrations_of_one_id(tmp_path: Path) -> None:
    async def scenario() -> None:
        store = await open_store(tmp_path)
        results = await asyncio.gather(
            *(store.register("twin", None, f"take {i}", tone_wav(3.5, freq=200 + i)) for i in range(4)),
            return_exceptions=True,
        )
        ok = [r for r in results if isinstance(r, VoiceInfo)]
        conflicts = [r for r in results if isinstance(r, ApiError) and r.code == "voice_exists"]
        assert len(ok) == 1 and len(conflicts) == 3
        assert len(live_dirs(tmp_path)) == 1 and db_ids(tmp_path) == ["twin"]
        await store.close()

    run(scenario())


def test_crash_before_commit_leaves_no_half_voice(tmp_path: Path) -> None:
    async def scenario() -> None:
        store = await open_store(tmp_path)
        await store.register("keep", None, "kept", tone_wav(3.5))

        def boom(info: VoiceInfo) -> None:
            raise OSError("disk died at the commit point")

        store.catalog.upsert = boom  # type: ignore[method-assign]
        with pytest.raises(OSError):
            await store.register("half", None, "never", tone_wav(3.5))
        assert store.get("half") is None
        assert [d.split(".")[0] for d in live_dirs(tmp_path)] == ["keep"]
        await store.close()

    run(scenario())


def test_recovery_removes_orphans_on_open(tmp_path: Path) -> None:
    async def scenario() -> None:
        store = await open_store(tmp_path)
        await store.register("keep", None, "kept", tone_wav(3.5))
        await store.register("lost", None, "files gone", tone_wav(3.5))
        lost_dir = store.get("lost").dir_name
        await store.close()

        voices = tmp_path / "voices"
        # A process killed mid-write: a temp dir, a renamed dir whose row never committed,
        # and a row whose files were lost.
        (voices / ".tmp-deadbeef").mkdir()
        (voices / ".tmp-deadbeef" / "prompt.npz").write_bytes(b"partial")
        (voices / "ghost.1234abcd").mkdir()
        (voices / "ghost.1234abcd" / "prompt.npz").write_bytes(b"no row")
        (voices / lost_dir / "prompt.npz").unlink()

        store2 = await open_store(tmp_path)
        assert [v.id for v in store2.list()] == ["keep"]
        assert db_ids(tmp_path) == ["keep"]
        assert [d.split(".")[0] for d in live_dirs(tmp_path)] == ["keep"]
        assert (await store2.get_prompt("keep")).transcript == "kept"
        await store2.close()

    run(scenario())


def test_register_assets_skips_unchanged_and_replaces_changed(tmp_path: Path, caplog) -> None:
    assets = tmp_path / "assets"
    assets.mkdir()
    (assets / "narrator.wav").write_bytes(tone_wav(3.5))
    (assets / "narrator.txt").write_text("The narrator speaks.\n")
    (assets / "orphan.wav").write_bytes(tone_wav(3.5))  # no transcript: skipped
    (assets / "short.wav").write_bytes(tone_wav(1.0))  # invalid: logged, skipped
    (assets / "short.txt").write_text("too short")
    data = tmp_path / "data"

    async def scenario() -> None:
        engine = FakeEngine()
        store = await open_store(data, engine)
        assert await store.register_assets(assets) == ["narrator"]
        assert store.get("narrator").source == "asset"
        assert store.get("narrator").transcript == "The narrator speaks."
        await store.close()

        store = await open_store(data, engine)
        caplog.clear()
        with caplog.at_level("INFO", logger="gateway.voices"):
            assert await store.register_assets(assets) == []
        assert any("unchanged" in r.getMessage() for r in caplog.records)
        assert engine.prepared == 1
        old_dir = store.get("narrator").dir_name

        (assets / "narrator.txt").write_text("A new line.")
        assert await store.register_assets(assets) == ["narrator"]
        assert store.get("narrator").transcript == "A new line."
        assert store.get("narrator").dir_name != old_dir
        assert live_dirs(data) == [store.get("narrator").dir_name]
        assert (await store.get_prompt("narrator")).transcript == "A new line."
        await store.close()

    run(scenario())
