"""Registered voices: validated once, features computed once, persisted, cached.

Layout under ``data_dir``::

    voices.sqlite3                  metadata, one row per voice (WAL journal)
    voices.lock                     flock'd by the one process that has the store open
    voices/<id>.<rev>/source.<ext>  the uploaded bytes, untouched
    voices/<id>.<rev>/prompt.npz    speech_tokens [P] int64, speech_feat [2P, 80] f32,
                                    embedding [192] f32, features: what made them
                                    (plain arrays, no pickle)
    voices/.tmp-*                   registrations in progress

Atomicity: a registration writes a temp dir, fsyncs it, renames it to its final
``<id>.<rev>`` name and only then commits the row that points at that dir. A crash
before the commit leaves a dir no row references; a crash during deletion leaves a
dir whose row is gone. `VoiceStore.open` removes both, so a voice is either wholly
there (row + files) or not at all. A new revision of an existing id (a changed asset)
gets a new dir, so the old files stay valid until the row switches over.

One process at a time: recovery deletes whatever no row references, which in another
live process is a registration between its rename and its commit, and each process
keeps its own view of the rows. So `open` takes an exclusive lock on ``voices.lock``
(held until `close`, released by the kernel if the process dies) and a second process
fails at start; several replicas share voices through the PostgreSQL store instead.

The metadata sits behind the small `VoiceCatalog` protocol; a PostgreSQL catalog can
replace `SqliteCatalog` without touching the rest.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import logging
import os
import re
import shutil
import sqlite3
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from engine.frontend.prompt import MAX_PROMPT_SECONDS, MIN_INPUT_SAMPLE_RATE
from engine.types import VoicePrompt
from gateway.audio_files import decode_audio
from gateway.errors import ApiError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VoiceLimits:
    """What an uploaded prompt must satisfy (the lead wires this into Settings)."""

    min_seconds: float = 3.0
    max_seconds: float = 30.0
    min_sample_rate: int = 16000
    max_upload_bytes: int = 20 * 1024 * 1024
    id_pattern: str = r"^[A-Za-z0-9_-]{1,64}$"
    max_transcript_chars: int = 1000
    max_name_chars: int = 200
    # Registered voices at most (each keeps its files and a row; a replica caches prompts of
    # the ones in use): a registration of a new id beyond it is refused, 409 too_many_voices.
    max_voices: int = 10000
    # Registrations in progress at once; more are refused, 429 too_many_registrations.
    # Each holds its upload (a 20 MiB JSON body peaks at ~140 MB in the handler) and
    # threads of the default pool that synthesis shares (decoding, featurising).
    max_concurrent_registrations: int = 4
    # Packets of the upload the decoder refuses (a damaged MP3 frame) that
    # become silence of their length; one more is a 400 invalid_audio. 0: any refuses.
    max_damaged_packets: int = 8

    def __post_init__(self) -> None:
        for name in ("min_seconds", "min_sample_rate", "max_upload_bytes", "max_transcript_chars", "max_name_chars",
                     "max_voices", "max_concurrent_registrations"):
            if not getattr(self, name) > 0:  # also refuses NaN
                raise ValueError(f"voices.{name} must be > 0, not {getattr(self, name)}")
        if not self.max_seconds >= self.min_seconds:
            raise ValueError(f"voices.max_seconds ({self.max_seconds}) must be >= voices.min_seconds ({self.min_seconds})")
        # What the featurizer takes (the official frontend's own bounds): past them every
        # registration would fail after its upload.
        if self.max_seconds > MAX_PROMPT_SECONDS:
            raise ValueError(f"voices.max_seconds must be <= {MAX_PROMPT_SECONDS:g} (the speech tokenizer's limit), "
                             f"not {self.max_seconds}")
        if not self.max_damaged_packets >= 0:
            raise ValueError(f"voices.max_damaged_packets must be >= 0, not {self.max_damaged_packets}")
        if self.min_sample_rate < MIN_INPUT_SAMPLE_RATE:
            raise ValueError(f"voices.min_sample_rate must be >= {MIN_INPUT_SAMPLE_RATE}, not {self.min_sample_rate}")
        try:
            re.compile(self.id_pattern)
        except re.error as exc:
            raise ValueError(f"voices.id_pattern is not a regular expression: {exc}") from None


@dataclass(frozen=True)
class VoiceInfo:
    """Public metadata of one voice (what the API lists)."""

    id: str
    name: str
    transcript: str
    created_at: float  # unix seconds
    duration_s: float
    sample_rate: int  # of the uploaded audio
    num_prompt_tokens: int
    audio_sha256: str
    source: str  # "upload" | "asset"
    dir_name: str  # voices/<dir_name>/ holds the files
    audio_file: str

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "voice",
            "name": self.name,
            "transcript": self.transcript,
            "created_at": int(self.created_at),
            "duration_s": round(self.duration_s, 3),
            "sample_rate": self.sample_rate,
            "num_prompt_tokens": self.num_prompt_tokens,
            "source": self.source,
        }


class VoiceCatalog(Protocol):
    """Durable metadata storage. Implementations must make `upsert`/`delete` atomic."""

    def load_all(self) -> list[VoiceInfo]: ...

    def upsert(self, info: VoiceInfo) -> None: ...

    def delete(self, voice_id: str) -> bool: ...

    def close(self) -> None: ...


class SqliteCatalog:
    """VoiceCatalog on one SQLite file. Calls may come from worker threads."""

    _COLUMNS = tuple(VoiceInfo.__dataclass_fields__)

    def __init__(self, path: Path) -> None:
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        # FULL: a committed registration survives power loss, not just a process crash.
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute(
            """CREATE TABLE IF NOT EXISTS voices (
                id TEXT PRIMARY KEY, name TEXT NOT NULL, transcript TEXT NOT NULL,
                created_at REAL NOT NULL, duration_s REAL NOT NULL, sample_rate INTEGER NOT NULL,
                num_prompt_tokens INTEGER NOT NULL, audio_sha256 TEXT NOT NULL,
                source TEXT NOT NULL, dir_name TEXT NOT NULL, audio_file TEXT NOT NULL)"""
        )

    def load_all(self) -> list[VoiceInfo]:
        with self._lock:
            rows = self._db.execute(f"SELECT {', '.join(self._COLUMNS)} FROM voices ORDER BY created_at, id").fetchall()
        return [VoiceInfo(*row) for row in rows]

    def upsert(self, info: VoiceInfo) -> None:
        values = asdict(info)
        cols = ", ".join(self._COLUMNS)
        marks = ", ".join(f":{c}" for c in self._COLUMNS)
        with self._lock:
            self._db.execute(f"INSERT OR REPLACE INTO voices ({cols}) VALUES ({marks})", values)

    def delete(self, voice_id: str) -> bool:
        with self._lock:
            cur = self._db.execute("DELETE FROM voices WHERE id = ?", (voice_id,))
        return cur.rowcount > 0

    def close(self) -> None:
        with self._lock:
            self._db.close()


def _fsync_dir(path: Path) -> None:
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _npz_bytes(prompt: VoicePrompt, features: str | None = None) -> bytes:
    """The prompt's arrays, and `features`: the engine's `features_id`, what made them."""
    import io

    buf = io.BytesIO()
    extra = {} if features is None else {"features": np.array(features)}
    np.savez(
        buf,
        speech_tokens=prompt.speech_tokens.detach().cpu().numpy().astype(np.int64),
        speech_feat=prompt.speech_feat.detach().cpu().float().numpy(),
        embedding=prompt.embedding.detach().cpu().float().numpy(),
        **extra,
    )
    return buf.getvalue()


Arrays = tuple[np.ndarray, np.ndarray, np.ndarray]


def npz_arrays(source: Any) -> tuple[Arrays, str | None]:
    """The prompt's arrays from an npz (a path or a file object) and the `features` it was
    made with (None: stored before that was kept)."""
    with np.load(source, allow_pickle=False) as z:
        made = str(z["features"]) if "features" in z.files else None
        return (z["speech_tokens"], z["speech_feat"], z["embedding"]), made


def features_of(engine: Any) -> str | None:
    """How the engine makes a voice's features now; None when it cannot say."""
    made = getattr(engine, "features_id", None)
    return made if isinstance(made, str) else None


_AUDIO_EXT = re.compile(r"^[a-z0-9]{1,5}$")

LOCK_FILE = "voices.lock"


class VoiceStoreInUse(RuntimeError):
    """Another `VoiceStore` (another gateway process, or this one) has the data dir open."""


def _lock_data_dir(data_dir: Path) -> int:
    """An fd holding an exclusive flock on ``<data_dir>/voices.lock``; VoiceStoreInUse when
    another open file holds it. flock, not fcntl locks: those belong to the process (a
    second store in one process would get it again, and closing any fd of the file drops
    it), this one to the open file, and the kernel releases it when the process dies."""
    fd = os.open(data_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise VoiceStoreInUse(
            f"the voice store {data_dir} is in use by another process; several replicas need the "
            f"PostgreSQL store (--voice-store postgresql://...)") from None
    except BaseException:
        os.close(fd)
        raise
    return fd


class VoiceStore:
    """Voices for one gateway: validation, persistence and a VoicePrompt cache.

    `engine` needs `prepare_voice(...)` (async) and `voice_from_arrays(...)`.
    Use as ``store = VoiceStore(data_dir, engine, limits); await store.open()`` and
    ``await store.close()`` at shutdown.
    """

    def __init__(self, data_dir: Path, engine: Any, limits: VoiceLimits | None = None,
                 catalog: VoiceCatalog | None = None, cache_size: int = 256) -> None:
        self.data_dir = Path(data_dir)
        self.engine = engine
        self.limits = limits or VoiceLimits()
        self._id_re = re.compile(self.limits.id_pattern)
        self._files = self.data_dir / "voices"
        self._catalog: VoiceCatalog | None = catalog
        self._infos: dict[str, VoiceInfo] = {}
        self._cache: OrderedDict[str, VoicePrompt] = OrderedDict()
        self._cache_size = cache_size
        # Serialises the check-then-write step of registrations and deletions of this
        # store; the expensive feature extraction runs outside it.
        self._write_lock = asyncio.Lock()
        self._opened = False
        self._lock_fd: int | None = None  # the flock on voices.lock while open
        # Prompt loads in progress by voice dir (one revision of a voice): concurrent first
        # uses share one, so a voice whose features must be made again is made once.
        self._loading: dict[str, asyncio.Task[VoicePrompt]] = {}

    async def open(self) -> "VoiceStore":
        """Open the catalog and clean up after any crash; returns self. Idempotent."""
        if not self._opened:
            await asyncio.to_thread(self._open_sync)
            self._opened = True
        return self

    def _open_sync(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        # Before recovery: it must not delete what another live process is writing.
        self._lock_fd = _lock_data_dir(self.data_dir)
        try:
            self._files.mkdir(parents=True, exist_ok=True)
            if self._catalog is None:
                self._catalog = SqliteCatalog(self.data_dir / "voices.sqlite3")
            self._recover()
        except BaseException:
            self._unlock()
            raise

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    @property
    def catalog(self) -> VoiceCatalog:
        if self._catalog is None:
            raise RuntimeError("VoiceStore.open() has not been awaited")
        return self._catalog

    # -- start-up recovery -----------------------------------------------------------
    def _recover(self) -> None:
        """Drop half-written state so every listed voice has its files and vice versa."""
        infos = self.catalog.load_all()
        for info in infos:
            folder = self._files / info.dir_name
            if (folder / "prompt.npz").is_file() and (folder / info.audio_file).is_file():
                self._infos[info.id] = info
            else:
                log.warning("voice %r: files missing, removing its row", info.id)
                self.catalog.delete(info.id)
        referenced = {info.dir_name for info in self._infos.values()}
        for entry in self._files.iterdir():
            if entry.name not in referenced:
                log.info("removing unreferenced voice data %s", entry.name)
                if entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
        # A featurisation again that died between writing its temp npz and the rename.
        for name in referenced:
            for tmp in (self._files / name).glob(".prompt-*"):
                log.info("removing leftover %s/%s", name, tmp.name)
                tmp.unlink(missing_ok=True)

    # -- reads -------------------------------------------------------------------------
    def list(self) -> list[VoiceInfo]:
        return sorted(self._infos.values(), key=lambda v: (v.created_at, v.id))

    def get(self, voice_id: str) -> VoiceInfo | None:
        return self._infos.get(voice_id)

    def __contains__(self, voice_id: object) -> bool:
        return voice_id in self._infos

    def cached_prompt(self, voice_id: str) -> VoicePrompt | None:
        """The voice's prompt when `get_prompt` would have it without waiting, None when
        it must be loaded first (the WebSocket then starts the context in the background);
        KeyError when the id is unknown."""
        if voice_id not in self._infos:
            raise KeyError(voice_id)
        return self._cache.get(voice_id)

    async def get_prompt(self, voice_id: str) -> VoicePrompt:
        """The cached VoicePrompt of a voice; KeyError when the id is unknown (or its files
        are gone)."""
        while True:
            info = self._infos.get(voice_id)
            if info is None:
                raise KeyError(voice_id)
            prompt = self._cache.get(voice_id)
            if prompt is not None:
                self._cache.move_to_end(voice_id)
                return prompt
            task = self._loading.get(info.dir_name)
            if task is None:
                task = asyncio.ensure_future(self._load_prompt(info))
                self._loading[info.dir_name] = task
                task.add_done_callback(lambda t, key=info.dir_name: self._forget_load(key, t))
            try:
                # Shielded: a waiter that goes away (a client hung up) does not cancel the
                # load the others wait for; it finishes and is cached.
                prompt = await asyncio.shield(task)
            except FileNotFoundError:
                # A delete or replace drops the id from the catalog before removing its files,
                # so a load that lost that race finds the catalog changed: ask it again.
                if self._infos.get(voice_id) is info:
                    # Files gone from under a listed voice (removed by hand, a lost disk):
                    # nothing to speak with, as for an unknown voice (404, not a 500).
                    log.error("voice %r: its files in %s are missing", voice_id, self._files / info.dir_name)
                    raise KeyError(voice_id) from None
                continue
            if self._infos.get(voice_id) is info:
                return prompt
            # deleted or replaced meanwhile: ask again

    def _forget_load(self, key: str, task: asyncio.Task[VoicePrompt]) -> None:
        if self._loading.get(key) is task:
            del self._loading[key]

    async def _load_prompt(self, info: VoiceInfo) -> VoicePrompt:
        """One voice revision's prompt from disk (made again from its audio when another
        model or build made the stored one), cached if the revision is still current."""
        arrays, made = await asyncio.to_thread(self._load_arrays, info)
        current = features_of(self.engine)
        if current is not None and made != current:
            # Made by another model or an older build: computed again from its audio.
            prompt = await self._featurize_again(info, current)
        else:
            prompt = self.engine.voice_from_arrays(info.id, info.transcript, *arrays)
        if self._infos.get(info.id) is info:  # not deleted or replaced meanwhile
            self._remember(info.id, prompt)
        return prompt

    def _load_arrays(self, info: VoiceInfo) -> tuple[Arrays, str | None]:
        return npz_arrays(self._files / info.dir_name / "prompt.npz")

    async def _featurize_again(self, info: VoiceInfo, features: str) -> VoicePrompt:
        """A stored voice's prompt computed from its uploaded audio by the engine as it is
        now, and stored so (the npz replaced in place, atomically: its directory is this
        revision's own)."""
        folder = self._files / info.dir_name
        audio_bytes = await asyncio.to_thread((folder / info.audio_file).read_bytes)
        prompt = await self._featurize(info, audio_bytes)
        await asyncio.to_thread(self._replace_npz, folder, _npz_bytes(prompt, features))
        log.info("voice %r featurised again (%s)", info.id, features)
        return prompt

    async def _featurize(self, info: VoiceInfo, audio_bytes: bytes) -> VoicePrompt:
        """A registered voice's prompt from its stored upload: checked when it was
        registered, so not against today's limits (which may have changed since)."""
        audio = await asyncio.to_thread(decode_audio, audio_bytes, MAX_PROMPT_SECONDS)
        return await self.engine.prepare_voice(info.id, audio.samples, audio.sample_rate, info.transcript)

    @staticmethod
    def _replace_npz(folder: Path, npz: bytes) -> None:
        tmp = folder / f".prompt-{uuid.uuid4().hex}.npz"
        _write_synced(tmp, npz)
        os.replace(tmp, folder / "prompt.npz")
        _fsync_dir(folder)

    def _remember(self, voice_id: str, prompt: VoicePrompt) -> None:
        self._cache[voice_id] = prompt
        self._cache.move_to_end(voice_id)
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)

    # -- validation ----------------------------------------------------------------------
    def validate_id(self, voice_id: str) -> None:
        # fullmatch: `$` also matches before a final newline ("abc\n" passed).
        if not isinstance(voice_id, str) or not self._id_re.fullmatch(voice_id):
            raise ApiError(400, "invalid_voice_id",
                           "voice id must be 1-64 characters of letters, digits, '_' or '-'")

    def _validate_text(self, name: str, transcript: str) -> None:
        if not transcript or not transcript.strip():
            raise ApiError(400, "missing_transcript", "the transcript of the prompt audio is required")
        if len(transcript) > self.limits.max_transcript_chars:
            raise ApiError(400, "invalid_request",
                           f"transcript is longer than {self.limits.max_transcript_chars} characters")
        if len(name) > self.limits.max_name_chars:
            raise ApiError(400, "invalid_request", f"name is longer than {self.limits.max_name_chars} characters")
        if "\x00" in transcript or "\x00" in name:  # PostgreSQL text cannot hold it: a 500 after featurising
            raise ApiError(400, "invalid_request", "the name and transcript must not contain NUL characters")

    def _check_room(self, voice_id: str, registered: int, exists: bool) -> None:
        """A new voice must fit under `max_voices` (replacing one takes no room)."""
        if not exists and registered >= self.limits.max_voices:
            raise ApiError(409, "too_many_voices",
                           f"{registered} voices are registered, the most this gateway keeps "
                           f"(voices.max_voices); delete one first")

    def _decode_checked(self, audio_bytes: bytes):  # -> DecodedAudio
        lim = self.limits
        if len(audio_bytes) > lim.max_upload_bytes:
            raise ApiError(413, "audio_too_large", f"audio file exceeds {lim.max_upload_bytes} bytes")
        audio = decode_audio(audio_bytes, max_seconds=lim.max_seconds, max_damaged_packets=lim.max_damaged_packets)
        if audio.sample_rate < lim.min_sample_rate:
            raise ApiError(400, "sample_rate_too_low",
                           f"sample rate {audio.sample_rate} Hz is below {lim.min_sample_rate} Hz")
        if audio.duration_s < lim.min_seconds:
            raise ApiError(400, "audio_too_short",
                           f"audio is {audio.duration_s:.2f} s; at least {lim.min_seconds:g} s needed")
        if audio.duration_s > lim.max_seconds:
            raise ApiError(400, "audio_too_long",
                           f"audio is {audio.duration_s:.2f} s; at most {lim.max_seconds:g} s allowed")
        # Around its mean: a constant offset (DC) carries no speech either.
        x = audio.samples
        mean = float(np.mean(x, dtype=np.float64))
        if max(float(np.max(x)) - mean, mean - float(np.min(x))) < 1e-4:
            raise ApiError(400, "invalid_audio", "the audio is silent")
        return audio

    # -- writes ----------------------------------------------------------------------------
    async def register(self, voice_id: str | None, name: str | None, transcript: str,
                       audio_bytes: bytes, *, audio_ext: str = "bin", source: str = "upload",
                       replace: bool = False) -> VoiceInfo:
        """Validate, extract features, persist atomically; returns the new voice's info.

        Raises ApiError (400/409/413) on bad input. With `replace=False` an existing id
        is a 409 conflict.
        """
        if voice_id is None or voice_id == "":
            voice_id = "voice_" + uuid.uuid4().hex[:16]
        self.validate_id(voice_id)
        name = (name or voice_id).strip() or voice_id
        transcript = (transcript or "").strip()
        self._validate_text(name, transcript)
        if not replace and voice_id in self._infos:
            raise ApiError(409, "voice_exists", f"voice {voice_id!r} already exists")
        self._check_room(voice_id, len(self._infos), voice_id in self._infos)
        ext = audio_ext.lower().lstrip(".")
        if not _AUDIO_EXT.match(ext):
            ext = "bin"

        audio = await asyncio.to_thread(self._decode_checked, audio_bytes)
        prompt = await self.engine.prepare_voice(voice_id, audio.samples, audio.sample_rate, transcript)
        digest = await asyncio.to_thread(lambda: hashlib.sha256(audio_bytes).hexdigest())  # 20 MiB: ~20 ms

        async with self._write_lock:
            if not replace and voice_id in self._infos:  # lost a race with a twin request
                raise ApiError(409, "voice_exists", f"voice {voice_id!r} already exists")
            self._check_room(voice_id, len(self._infos), voice_id in self._infos)  # others registered meanwhile
            info = VoiceInfo(
                id=voice_id, name=name, transcript=transcript, created_at=time.time(),
                duration_s=audio.duration_s, sample_rate=audio.sample_rate,
                num_prompt_tokens=int(prompt.num_tokens),
                audio_sha256=digest, source=source,
                dir_name=f"{voice_id}.{uuid.uuid4().hex[:8]}", audio_file=f"source.{ext}",
            )
            old = self._infos.get(voice_id)
            await asyncio.to_thread(self._persist, info, audio_bytes, _npz_bytes(prompt, features_of(self.engine)))
            self._infos[voice_id] = info
            self._remember(voice_id, prompt)
        if old is not None:
            await asyncio.to_thread(self._remove_dir, old.dir_name)
        log.info("registered voice %r (%.2f s, %d prompt tokens)", voice_id, info.duration_s, info.num_prompt_tokens)
        return info

    def _persist(self, info: VoiceInfo, audio_bytes: bytes, npz: bytes) -> None:
        tmp = self._files / f".tmp-{uuid.uuid4().hex}"
        tmp.mkdir()
        try:
            _write_synced(tmp / info.audio_file, audio_bytes)
            _write_synced(tmp / "prompt.npz", npz)
            _fsync_dir(tmp)
            final = self._files / info.dir_name
            os.rename(tmp, final)
            _fsync_dir(self._files)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        try:
            self.catalog.upsert(info)  # the commit point
        except BaseException:
            shutil.rmtree(final, ignore_errors=True)
            raise

    def _remove_dir(self, dir_name: str) -> None:
        folder = self._files / dir_name
        trash = self._files / f".tmp-del-{uuid.uuid4().hex}"
        try:
            os.rename(folder, trash)  # one atomic step out of the live namespace
        except FileNotFoundError:
            return
        shutil.rmtree(trash, ignore_errors=True)

    async def delete(self, voice_id: str, *, revision: str | None = None) -> bool:
        """Remove a voice; False when it did not exist. With `revision` (a `dir_name`),
        only that registration of it: a voice registered again since is kept."""
        async with self._write_lock:
            info = self._infos.get(voice_id)
            if info is None or (revision is not None and info.dir_name != revision):
                return False
            await asyncio.to_thread(self.catalog.delete, voice_id)  # commit point
            self._infos.pop(voice_id, None)
            self._cache.pop(voice_id, None)
        await asyncio.to_thread(self._remove_dir, info.dir_name)
        log.info("deleted voice %r", voice_id)
        return True

    async def register_assets(self, assets_dir: Path) -> list[str]:
        """Register every ``<id>.wav`` that has an ``<id>.txt`` transcript beside it.

        Unchanged voices (same audio bytes and transcript) are skipped; changed ones are
        replaced; invalid ones are logged and skipped so one bad file cannot stop start-up.
        A voice registered from an asset whose ``<id>.wav`` is gone is deleted: the folder
        says which bundled voices exist (a missing folder, or one without any ``.wav``,
        deletes nothing). Every gateway sharing a voice store should have the same assets.
        Returns the ids (re)registered now.
        """
        assets_dir = Path(assets_dir)
        done: list[str] = []
        if not assets_dir.is_dir():
            return done
        wavs = _asset_files(assets_dir, ".wav")
        await self._forget_removed_assets(assets_dir, set(wavs))
        texts = _asset_files(assets_dir, ".txt")
        for voice_id, wav in sorted(wavs.items()):
            txt = texts.get(voice_id)
            if txt is None:
                log.info("asset %s has no %s.txt transcript; skipped", wav.name, voice_id)
                continue
            try:
                audio_bytes = await asyncio.to_thread(wav.read_bytes)
                # utf-8-sig: a byte-order mark (Windows editors write one) would otherwise be
                # the transcript's first character and reach the LM prompt (str.strip keeps it).
                transcript = (await asyncio.to_thread(txt.read_text, encoding="utf-8-sig")).strip()
            except (OSError, UnicodeDecodeError) as exc:
                log.warning("asset voice %r not registered: %s", voice_id, exc)
                continue
            existing = await self._current_info(voice_id)
            if (existing is not None and existing.audio_sha256 == hashlib.sha256(audio_bytes).hexdigest()
                    and existing.transcript == transcript):
                log.info("asset voice %r already registered and unchanged; skipped", voice_id)
                continue
            try:
                await self.register(voice_id, voice_id, transcript, audio_bytes, audio_ext="wav",
                                    source="asset", replace=True)
            except ApiError as exc:
                log.warning("asset voice %r not registered: %s (%s)", voice_id, exc.message, exc.code)
                continue
            except Exception:
                log.exception("asset voice %r not registered", voice_id)
                continue
            done.append(voice_id)
        return done

    async def _forget_removed_assets(self, assets_dir: Path, present: set[str]) -> None:
        if not present:
            # An empty folder is more likely a volume not mounted (yet) than a decision
            # to drop every bundled voice.
            if any(info.source == "asset" for info in self._infos.values()):
                log.warning("assets folder %s holds no .wav: asset voices kept", assets_dir)
            return
        for info in list(self._infos.values()):
            if info.source != "asset" or info.id in present:
                continue
            current = await self._current_info(info.id)  # re-registered by an upload since?
            if current is None or current.source != "asset":
                continue
            try:
                # Only the registration looked at: an upload racing in under its id stays.
                if await self.delete(info.id, revision=current.dir_name):
                    log.info("asset voice %r deleted: %s is gone", info.id, f"{info.id}.wav")
            except Exception:
                log.exception("asset voice %r could not be deleted", info.id)

    async def _current_info(self, voice_id: str) -> VoiceInfo | None:
        """The voice as the store of record has it now (a replicated store asks its database)."""
        return self._infos.get(voice_id)

    async def close(self) -> None:
        async with self._write_lock:  # let a registration in flight commit first
            # And prompt loads: one may be writing a voice's npz, which must be done before
            # the lock lets another process in.
            loading = list(self._loading.values())
            if loading:
                await asyncio.wait(loading)
            if self._catalog is not None:
                self._catalog.close()
                self._catalog = None
            self._unlock()
            self._opened = False


def _asset_files(assets_dir: Path, suffix: str) -> dict[str, Path]:
    """Voice id -> file for the folder's files with `suffix` in any case: recorders and
    Windows tools write `Alice.WAV`, and a voice that case-sensitive matching skipped
    would be missing without a word. Where two names differ only in the suffix's case,
    the first in sorted order counts."""
    found: dict[str, Path] = {}
    for path in sorted(assets_dir.iterdir()):
        if path.suffix.lower() == suffix and path.stem and path.is_file():
            if path.stem in found:
                log.warning("asset %s ignored: %s has the same voice id", path.name, found[path.stem].name)
                continue
            found[path.stem] = path
    return found
