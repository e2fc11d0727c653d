"""Voices in PostgreSQL, shared by every gateway replica.

`VoiceStore` (gateway/voices.py) keeps voices on the local disk of one gateway. A
cluster of replicas needs one source of truth instead, so `PgVoiceStore` keeps the
metadata, the uploaded audio and the prompt features (an ``.npz`` blob) in one table.
Replicas share nothing but the database: no shared filesystem, no object store.

Consistency, and what "at once" means here
-------------------------------------------
Every voice row carries ``rev``, a random id that changes on each (re-)registration.

* Synthesis (`get_prompt`, used by the WebSocket and the OpenAI endpoint) asks the
  database on every call: one primary-key lookup that returns only ``rev`` when this
  replica's cached features are still current, and the features when they are not.
  So a request that starts after a registration or a deletion has committed (on any
  replica) sees it: a deleted voice is a 404 on the very next request, a replaced
  voice is never spoken with stale features. The price is one index lookup per
  synthesis request (0.7 ms measured on loopback on a busy 2-core machine), far
  below one LM step.
* Writes decide in the database: a duplicate id is refused by the primary key (409 on
  whichever replica loses), a delete reports 404 only when no row was removed.
* Listings (`list`, `get`) are synchronous reads of an in-memory mirror, so they can
  never block the event loop on the network. Each write sends ``NOTIFY`` in its own
  transaction (delivered at commit); a listener task on every replica refreshes the
  changed row. The mirror therefore lags a commit by one notification round trip
  (milliseconds), and after a lost database connection it is reloaded in full.

Failures of the database surface as HTTP 503 ``voice_store_unavailable``; nothing is
served from a cache that could not be checked, so a delete can never be bypassed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import logging
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import numpy as np

from engine.types import VoicePrompt
from gateway.errors import ApiError
from gateway.voices import VoiceInfo, VoiceLimits, VoiceStore, _npz_bytes, features_of, npz_arrays

log = logging.getLogger(__name__)

TABLE = "cosyvoice_voices"
CHANNEL = "cosyvoice_voices"
# pg_advisory_xact_lock key serialising inserts for the `max_voices` count ("cvgw" in ASCII).
COUNT_LOCK = 0x63766777
# Any constant works; it only has to be the same for every replica (pg_advisory_xact_lock).
_SCHEMA_LOCK_KEY = 0x43565657  # "CVVW"

# Metadata columns in `VoiceInfo` field order, minus dir_name (derived from rev).
_META = ("id", "name", "transcript", "created_at", "duration_s", "sample_rate",
         "num_prompt_tokens", "audio_sha256", "source", "audio_file")
_META_SQL = ", ".join(_META)

_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS {TABLE} (
    id                TEXT PRIMARY KEY,
    rev               TEXT NOT NULL,
    name              TEXT NOT NULL,
    transcript        TEXT NOT NULL,
    created_at        DOUBLE PRECISION NOT NULL,
    duration_s        DOUBLE PRECISION NOT NULL,
    sample_rate       INTEGER NOT NULL,
    num_prompt_tokens INTEGER NOT NULL,
    audio_sha256      TEXT NOT NULL,
    source            TEXT NOT NULL,
    audio_file        TEXT NOT NULL,
    audio             BYTEA NOT NULL,
    features          BYTEA NOT NULL
)"""


def is_postgres_url(url: str) -> bool:
    return url.startswith(("postgresql://", "postgres://"))


def redact_url(url: str) -> str:
    """The URL with any password replaced, for logs: libpq reads one from the user
    info (`user:pw@host`) and from a `password=` query parameter alike."""
    parts = urlsplit(url)
    if parts.password is not None:
        host = parts.hostname or ""
        if parts.port is not None:
            host += f":{parts.port}"
        parts = parts._replace(netloc=f"{parts.username or ''}:***@{host}")
    if parts.query:
        pairs = parse_qsl(parts.query, keep_blank_values=True)
        if any(k == "password" for k, _ in pairs):
            parts = parts._replace(query=urlencode(
                [(k, "***" if k == "password" else v) for k, v in pairs], safe="*"))
    return urlunsplit(parts)


class VoiceStoreUnavailable(ApiError):
    """The shared database cannot be reached; the request may be retried."""

    def __init__(self, detail: str) -> None:
        super().__init__(503, "voice_store_unavailable", f"voice database unavailable: {detail}")


@dataclass(frozen=True)
class PgOptions:
    """Connection tuning; the defaults suit a handful of replicas per database."""

    min_connections: int = 1
    max_connections: int = 4
    connect_timeout_s: float = 5.0
    # How long start-up waits for the first connections (then the gateway fails to start).
    open_timeout_s: float = 10.0
    # How long a request waits for a free pooled connection before a 503.
    acquire_timeout_s: float = 10.0
    # Longest pause between attempts to re-establish the LISTEN connection.
    max_listen_backoff_s: float = 5.0
    # After this long without a notification the LISTEN connection is checked with a
    # query (answered within connect_timeout_s, or it is replaced and the listing
    # reloaded): a connection a NAT or firewall dropped silently delivers nothing, and
    # no error either, so the replica's listing would go stale for good.
    listen_check_s: float = 60.0
    # TCP keepalives on every connection (libpq's settings): probes after this many idle
    # seconds keep NAT mappings alive and find a dead peer in about twice as long again.
    keepalive_idle_s: int = 30
    # PostgreSQL cancels any statement that runs longer (0 = never): a query stuck behind
    # a lock someone forgot (an open transaction in psql holding the table) answers 503
    # instead of holding its request, and its pooled connection, without end.
    statement_timeout_s: float = 30.0


def _keepalives(opts: PgOptions) -> dict[str, int]:
    """libpq connection parameters for TCP keepalives."""
    return {"keepalives": 1, "keepalives_idle": opts.keepalive_idle_s,
            "keepalives_interval": max(1, opts.keepalive_idle_s // 3), "keepalives_count": 3}


def _info_from_row(row: tuple[Any, ...], rev: str) -> VoiceInfo:
    meta = dict(zip(_META, row))
    return VoiceInfo(dir_name=f"{meta['id']}.{rev}", **meta)




@dataclass(frozen=True)
class _Cached:
    rev: str
    prompt: VoicePrompt


class PgVoiceStore(VoiceStore):
    """`VoiceStore` whose single source of truth is a PostgreSQL table.

    Same public API as `VoiceStore` (validation and limits are inherited); `data_dir`
    is unused for voices. Use ``store = PgVoiceStore(url, engine, limits); await
    store.open()`` and ``await store.close()``.
    """

    def __init__(self, url: str, engine: Any, limits: VoiceLimits | None = None, *,
                 cache_size: int = 256, options: PgOptions | None = None) -> None:
        super().__init__(Path("."), engine, limits, cache_size=cache_size)
        if not is_postgres_url(url):
            raise ValueError(f"not a PostgreSQL URL: {redact_url(url)}")
        self.url = url
        self.options = options or PgOptions()
        self._pool: Any = None  # psycopg_pool.AsyncConnectionPool once open
        self._listener: asyncio.Task[None] | None = None
        self._listening = asyncio.Event()
        self._prompts: OrderedDict[str, _Cached] = OrderedDict()
        self._revs: dict[str, str] = {}  # voice id -> rev of the mirrored metadata
        # What the listener applied: `_epoch` counts full reloads, `_seen[id]` the rows it
        # refreshed. Only the listener applies changes in commit order; any other mirror
        # write (a request's own read or commit) is dropped when the listener applied
        # something for that id since the request began: its view may be older, and the
        # listener's next notification brings whatever is newer.
        self._epoch = 0
        self._seen: dict[str, int] = {}
        # Bumped on every mirror change; tests and tools can wait for a change with it.
        self._changed = asyncio.Condition()

    # -- lifecycle ------------------------------------------------------------------------
    async def open(self) -> "PgVoiceStore":
        if self._opened:
            return self
        from psycopg_pool import AsyncConnectionPool

        opts = self.options
        self._pool = AsyncConnectionPool(
            self.url, min_size=opts.min_connections, max_size=opts.max_connections, open=False,
            timeout=opts.acquire_timeout_s,
            kwargs={"autocommit": True, "connect_timeout": int(opts.connect_timeout_s), **_keepalives(opts)},
            # A replica outlives database restarts: a dead connection is replaced at checkout.
            check=AsyncConnectionPool.check_connection, name="voices",
            configure=self._configure_connection,
        )
        from psycopg_pool import PoolTimeout

        try:
            try:
                await self._pool.open(wait=True, timeout=opts.open_timeout_s)
            except PoolTimeout as exc:
                raise VoiceStoreUnavailable(f"no connection to {redact_url(self.url)}") from exc
            await self._create_schema()
            # The listener LISTENs, then loads every voice, then handles notifications:
            # no change between the two is missed, and none is overwritten by the load.
            self._listener = asyncio.create_task(self._listen_forever(), name="voices-listen")
            try:
                await asyncio.wait_for(self._listening.wait(), timeout=opts.open_timeout_s)
            except asyncio.TimeoutError as exc:
                raise VoiceStoreUnavailable("LISTEN connection failed") from exc
        except BaseException:
            await self._shutdown()
            raise
        self._opened = True
        log.info("voice store: PostgreSQL %s (%d voices)", redact_url(self.url), len(self._infos))
        return self

    async def _configure_connection(self, conn: Any) -> None:
        # A session setting rather than libpq's `options` keyword, which would replace
        # any `options` the URL itself carries.
        ms = int(self.options.statement_timeout_s * 1000)
        await conn.execute(f"SET statement_timeout = {ms}")

    async def close(self) -> None:
        async with self._write_lock:
            await self._shutdown()
            self._opened = False

    async def _shutdown(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._listener
            self._listener = None
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    @property
    def catalog(self) -> Any:  # the SQLite catalog does not exist here
        raise AttributeError("PgVoiceStore keeps its catalog in PostgreSQL")

    @contextlib.asynccontextmanager
    async def _conn(self) -> AsyncIterator[Any]:
        """A pooled connection; database failures become `VoiceStoreUnavailable`."""
        import psycopg
        from psycopg_pool import PoolTimeout

        if self._pool is None:
            raise RuntimeError("PgVoiceStore.open() has not been awaited")
        try:
            async with self._pool.connection() as conn:
                yield conn
        except (psycopg.OperationalError, PoolTimeout) as exc:
            log.warning("voice database error: %s", exc)
            raise VoiceStoreUnavailable(type(exc).__name__) from exc

    async def _create_schema(self) -> None:
        async with self._conn() as conn, conn.transaction():
            # Replicas starting together would race on CREATE TABLE IF NOT EXISTS (it is
            # not atomic against a concurrent creator); a transaction-scoped lock orders them.
            await conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK_KEY,))
            await conn.execute(_SCHEMA)

    # -- the mirror behind list()/get() ------------------------------------------------
    async def _reload_all(self) -> None:
        async with self._conn() as conn:
            cur = await conn.execute(f"SELECT rev, {_META_SQL} FROM {TABLE}")
            rows = await cur.fetchall()
        self._infos = {row[1]: _info_from_row(row[1:], row[0]) for row in rows}
        self._revs = {row[1]: row[0] for row in rows}
        self._epoch += 1
        self._seen.clear()
        for vid in [v for v, c in self._prompts.items() if self._revs.get(v) != c.rev]:
            self._prompts.pop(vid, None)
        await self._bump()

    async def _refresh_one(self, voice_id: str, *, listener: bool = False) -> None:
        mark = self._mark(voice_id)
        async with self._conn() as conn:
            cur = await conn.execute(f"SELECT rev, {_META_SQL} FROM {TABLE} WHERE id = %s", (voice_id,))
            row = await cur.fetchone()
        if listener:
            self._seen[voice_id] = self._seen.get(voice_id, 0) + 1
            mark = self._mark(voice_id)
        self._set_mirror(voice_id, None if row is None else _info_from_row(row[1:], row[0]),
                         None if row is None else row[0], mark)
        await self._bump()

    def _mark(self, voice_id: str) -> tuple[int, int]:
        """Taken before a read or write; `_set_mirror` applies its result only if the
        listener has applied nothing for this id since."""
        return self._epoch, self._seen.get(voice_id, 0)

    def _set_mirror(self, voice_id: str, info: VoiceInfo | None, rev: str | None,
                    mark: tuple[int, int]) -> None:
        if mark != self._mark(voice_id):
            return  # the listener applied a change at least as new as what was read
        if info is None or rev is None:
            self._infos.pop(voice_id, None)
            self._revs.pop(voice_id, None)
            self._prompts.pop(voice_id, None)
            return
        self._infos[voice_id] = info
        self._revs[voice_id] = rev
        cached = self._prompts.get(voice_id)
        if cached is not None and cached.rev != rev:
            self._prompts.pop(voice_id, None)

    async def _bump(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def wait_for_mirror(self, predicate: Callable[["PgVoiceStore"], bool], timeout: float) -> bool:
        """Wait until ``predicate(self)`` holds (re-checked after each mirror change)."""
        async def until() -> None:
            async with self._changed:
                await self._changed.wait_for(lambda: predicate(self))

        try:
            await asyncio.wait_for(until(), timeout)
            return True
        except asyncio.TimeoutError:
            return bool(predicate(self))

    async def _listen_forever(self) -> None:
        import psycopg

        backoff = 0.1
        first = True
        while True:
            try:
                opts = self.options
                conn = await psycopg.AsyncConnection.connect(
                    self.url, autocommit=True, connect_timeout=int(opts.connect_timeout_s), **_keepalives(opts))
                async with conn:
                    await conn.execute(f"LISTEN {CHANNEL}")
                    # Everything, after LISTEN and before any notification is handled
                    # (in this task, so no notification's change is overwritten by an
                    # older load): those sent while we were disconnected are gone.
                    await self._reload_all()
                    if first:
                        first = False
                        self._listening.set()
                    backoff = 0.1
                    while True:
                        async for note in conn.notifies(timeout=opts.listen_check_s):
                            await self._refresh_one(note.payload, listener=True)
                        # Quiet for a while: is anyone still there? (A timeout raises, and
                        # the connection is replaced.)
                        await asyncio.wait_for(conn.execute("SELECT 1"), opts.connect_timeout_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # connection lost, database restarting, ...
                log.warning("voice change listener: %s; reconnecting in %.1f s", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.options.max_listen_backoff_s)

    # -- synthesis path ---------------------------------------------------------------------
    def cached_prompt(self, voice_id: str) -> VoicePrompt | None:
        """None: every use asks the database for the voice's revision first."""
        return None

    async def get_prompt(self, voice_id: str) -> VoicePrompt:
        """The voice's prompt, checked against the database; KeyError when it is gone."""
        if "\x00" in voice_id:  # no such id can be stored (PostgreSQL text has no NUL): a DataError, a 500
            raise KeyError(voice_id)
        cached = self._prompts.get(voice_id)
        known_rev = cached.rev if cached is not None else ""
        mark = self._mark(voice_id)
        async with self._conn() as conn:
            # One round trip either way: the features travel only when the cache is stale.
            cur = await conn.execute(
                f"SELECT rev, CASE WHEN rev = %s THEN NULL ELSE features END, {_META_SQL} "
                f"FROM {TABLE} WHERE id = %s",
                (known_rev, voice_id),
            )
            row = await cur.fetchone()
        if row is None:
            self._set_mirror(voice_id, None, None, mark)
            raise KeyError(voice_id)
        rev, blob = row[0], row[1]
        info = _info_from_row(row[2:], rev)
        if self._revs.get(voice_id) != rev:
            self._set_mirror(voice_id, info, rev, mark)
        if blob is None and cached is not None:
            # The revision checked is the cached one's, even if the cache dropped it
            # meanwhile (a replacement's notification, other voices pushing it out).
            if self._prompts.get(voice_id) is cached:
                self._prompts.move_to_end(voice_id)
            return cached.prompt
        arrays, made = await asyncio.to_thread(npz_arrays, io.BytesIO(bytes(blob)))
        current = features_of(self.engine)
        if current is not None and made != current:
            # Made by another model or an older build: computed again from its audio, for
            # this process (replicas mid-way through a model change would undo each
            # other's stored features).
            # Requests for one revision at once share one featurisation.
            key = info.dir_name
            task = self._loading.get(key)
            if task is None:
                task = asyncio.ensure_future(self._featurize_revision(info, rev, current))
                self._loading[key] = task
                task.add_done_callback(lambda t, key=key: self._forget_load(key, t))
            # Shielded: a waiter that goes away does not cancel the others' featurisation.
            remade = await asyncio.shield(task)
            if remade is None:  # deleted or replaced since the row was read
                return await self.get_prompt(voice_id)
            prompt = remade
        else:
            prompt = self.engine.voice_from_arrays(voice_id, info.transcript, *arrays)
        self._remember_prompt(voice_id, rev, prompt)
        return prompt

    async def _featurize_revision(self, info: VoiceInfo, rev: str, features: str) -> VoicePrompt | None:
        """The prompt of one registration made again from its upload (None once that
        registration is no longer current)."""
        audio_bytes = await self._source_audio_of(info.id, rev)
        if audio_bytes is None:
            return None
        prompt = await self._featurize(info, audio_bytes)
        log.info("voice %r featurised again (%s)", info.id, features)
        return prompt

    def _remember_prompt(self, voice_id: str, rev: str, prompt: VoicePrompt) -> None:
        self._prompts[voice_id] = _Cached(rev, prompt)
        self._prompts.move_to_end(voice_id)
        while len(self._prompts) > self._cache_size:
            self._prompts.popitem(last=False)

    async def _current_info(self, voice_id: str) -> VoiceInfo | None:
        # The mirror may not have seen another replica's write yet (its NOTIFY is in
        # flight), so replicas starting together would each re-register the same asset.
        await self._refresh_one(voice_id)
        return self._infos.get(voice_id)

    async def _check_room_now(self, voice_id: str, conn: Any = None) -> None:
        """`_check_room` against the table as it is now (in `conn`'s transaction if given)."""
        async with contextlib.AsyncExitStack() as stack:
            if conn is None:
                conn = await stack.enter_async_context(self._conn())
            cur = await conn.execute(f"SELECT count(*), count(*) FILTER (WHERE id = %s) FROM {TABLE}", (voice_id,))
            registered, exists = await cur.fetchone()
        self._check_room(voice_id, int(registered), bool(exists))

    async def _exists(self, voice_id: str) -> bool:
        async with self._conn() as conn:
            cur = await conn.execute(f"SELECT 1 FROM {TABLE} WHERE id = %s", (voice_id,))
            return await cur.fetchone() is not None

    # -- writes -------------------------------------------------------------------------------
    async def register(self, voice_id: str | None, name: str | None, transcript: str,
                       audio_bytes: bytes, *, audio_ext: str = "bin", source: str = "upload",
                       replace: bool = False) -> VoiceInfo:
        """As `VoiceStore.register`; the duplicate check is the table's primary key."""
        if voice_id is None or voice_id == "":
            voice_id = "voice_" + uuid.uuid4().hex[:16]
        self.validate_id(voice_id)
        name = (name or voice_id).strip() or voice_id
        transcript = (transcript or "").strip()
        self._validate_text(name, transcript)
        # Cheap early refusal before the expensive feature extraction; the insert below
        # is what actually decides when two replicas race.
        if not replace and await self._exists(voice_id):
            raise ApiError(409, "voice_exists", f"voice {voice_id!r} already exists")
        await self._check_room_now(voice_id)
        ext = audio_ext.lower().lstrip(".")
        if not ext.isalnum() or not 1 <= len(ext) <= 5:
            ext = "bin"

        audio = await asyncio.to_thread(self._decode_checked, audio_bytes)
        prompt = await self.engine.prepare_voice(voice_id, audio.samples, audio.sample_rate, transcript)
        npz = await asyncio.to_thread(_npz_bytes, prompt, features_of(self.engine))
        rev = uuid.uuid4().hex[:12]
        info = VoiceInfo(
            id=voice_id, name=name, transcript=transcript, created_at=time.time(),
            duration_s=audio.duration_s, sample_rate=audio.sample_rate,
            num_prompt_tokens=int(prompt.num_tokens),
            audio_sha256=hashlib.sha256(audio_bytes).hexdigest(), source=source,
            dir_name=f"{voice_id}.{rev}", audio_file=f"source.{ext}",
        )
        values = [getattr(info, c) for c in _META] + [rev, audio_bytes, npz]
        cols = ", ".join(_META + ("rev", "audio", "features"))
        marks = ", ".join(["%s"] * len(values))
        if replace:
            updates = ", ".join(f"{c} = EXCLUDED.{c}" for c in _META[1:] + ("rev", "audio", "features"))
            conflict = f"ON CONFLICT (id) DO UPDATE SET {updates}"
        else:
            conflict = "ON CONFLICT (id) DO NOTHING"
        mark = self._mark(voice_id)
        async with self._conn() as conn, conn.transaction():
            # Counted again in the insert's transaction, under a lock every replica's insert
            # takes (held to its commit), so registrations racing for the last places are
            # counted one after another.
            await conn.execute("SELECT pg_advisory_xact_lock(%s)", (COUNT_LOCK,))
            await self._check_room_now(voice_id, conn)
            cur = await conn.execute(f"INSERT INTO {TABLE} ({cols}) VALUES ({marks}) {conflict} RETURNING id", values)
            if await cur.fetchone() is None:
                raise ApiError(409, "voice_exists", f"voice {voice_id!r} already exists")
            await conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, voice_id))
        self._set_mirror(voice_id, info, rev, mark)
        self._remember_prompt(voice_id, rev, prompt)
        await self._bump()
        log.info("registered voice %r (%.2f s, %d prompt tokens)", voice_id, info.duration_s, info.num_prompt_tokens)
        return info

    async def delete(self, voice_id: str, *, revision: str | None = None) -> bool:
        """Remove a voice everywhere; False when no replica knew it. With `revision` (a
        `dir_name`: the id, a dot, the row's rev), only that registration of it."""
        if "\x00" in voice_id:  # as in `get_prompt`
            return False
        where, args = "id = %s", [voice_id]
        if revision is not None:
            where, args = "id = %s AND rev = %s", [voice_id, revision[len(voice_id) + 1:]]
        mark = self._mark(voice_id)
        async with self._conn() as conn, conn.transaction():
            cur = await conn.execute(f"DELETE FROM {TABLE} WHERE {where} RETURNING id", args)
            gone = await cur.fetchone() is not None
            if gone:
                await conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, voice_id))
        if gone or revision is None:
            self._set_mirror(voice_id, None, None, mark)
        else:  # another registration of it may stand: the mirror shows what does
            await self._refresh_one(voice_id)
        await self._bump()
        if gone:
            log.info("deleted voice %r", voice_id)
        return gone

    async def source_audio(self, voice_id: str) -> bytes | None:
        """The uploaded bytes of a voice, untouched (None when it does not exist)."""
        async with self._conn() as conn:
            cur = await conn.execute(f"SELECT audio FROM {TABLE} WHERE id = %s", (voice_id,))
            row = await cur.fetchone()
        return None if row is None else bytes(row[0])

    async def _source_audio_of(self, voice_id: str, rev: str) -> bytes | None:
        """The upload of one registration of a voice (None when it is no longer current)."""
        async with self._conn() as conn:
            cur = await conn.execute(f"SELECT audio FROM {TABLE} WHERE id = %s AND rev = %s", (voice_id, rev))
            row = await cur.fetchone()
        return None if row is None else bytes(row[0])


def create_voice_store(url: str, data_dir: Path, engine: Any, limits: VoiceLimits | None = None) -> VoiceStore:
    """The store a `voice_store` setting names: ``sqlite`` (default) or a PostgreSQL URL."""
    spec = (url or "sqlite").strip()
    if spec in ("sqlite", "sqlite:", "local"):
        return VoiceStore(Path(data_dir), engine, limits)
    if is_postgres_url(spec):
        return PgVoiceStore(spec, engine, limits)
    raise ValueError(f"voice_store must be 'sqlite' or a postgresql:// URL, got {redact_url(spec)!r}")
