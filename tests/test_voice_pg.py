"""PgVoiceStore against a real PostgreSQL server (started by the test, see pg_server.py).

Two stores on one database stand for two gateway replicas. The engine is the real tiny
random-weight engine, so the features compared here are the ones synthesis would use.
"What happens at once" is asserted without waiting: `get_prompt`, `delete` and the 409
check consult the database on every call. What follows a notification (the listing
mirror) is awaited with a bounded wait on the store's change condition.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator

import numpy as np
import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from gateway.audio_files import wav_bytes
from gateway.errors import ApiError
from gateway.voice_pg import TABLE, PgOptions, PgVoiceStore, VoiceStoreUnavailable, create_voice_store, redact_url
from gateway.voices import VoiceLimits, VoiceStore
from pg_server import PgServer, find_pg_bindir, temporary_postgres

SR = 24000
WAIT = 10.0  # upper bound for a NOTIFY to reach the other store (normally milliseconds)

if find_pg_bindir() is None:
    if os.environ.get("CI"):
        raise RuntimeError("CI must have PostgreSQL installed (Makefile system-deps)")
    pytest.skip("PostgreSQL server binaries not installed", allow_module_level=True)


def tone_wav(seconds: float, freq: float) -> bytes:
    t = np.arange(int(seconds * SR)) / SR
    return wav_bytes((0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32), SR)


@pytest.fixture(scope="module")
def pg() -> AsyncIterator[PgServer]:
    with temporary_postgres() as server:
        yield server


@pytest.fixture
def db_url(pg: PgServer) -> str:
    """A fresh database per test, so tests cannot see each other's voices."""
    import psycopg

    name = "t_" + uuid.uuid4().hex[:12]
    with psycopg.connect(pg.url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return f"postgresql://{pg.user}@127.0.0.1:{pg.port}/{name}"


Scenario = Callable[[Engine, str], Awaitable[None]]


def run_with_engine(tiny_model_dir: Path, db_url: str, scenario: Scenario) -> None:
    async def main() -> None:
        engine = await Engine.create(EngineConfig(model_dir=tiny_model_dir, device="cpu", lm_backend="torch",
                                                  warmup=False))
        try:
            async with asyncio.timeout(300):  # a hang fails here, with its stack, not at CI's limit
                await scenario(engine, db_url)
        finally:
            await engine.close()

    asyncio.run(main())


async def two_stores(engine: Engine, url: str) -> tuple[PgVoiceStore, PgVoiceStore]:
    a, b = await asyncio.gather(PgVoiceStore(url, engine).open(), PgVoiceStore(url, engine).open())
    return a, b


def same_prompt(p: Any, q: Any) -> bool:
    return (torch.equal(p.speech_tokens, q.speech_tokens) and torch.equal(p.speech_feat, q.speech_feat)
            and torch.equal(p.embedding, q.embedding))


def test_register_on_one_use_on_other_delete_propagates(tiny_model_dir: Path, db_url: str) -> None:
    async def scenario(engine: Engine, url: str) -> None:
        a, b = await two_stores(engine, url)
        try:
            info = await a.register("alice", "Alice", "Hello there, this is Alice.", tone_wav(3.5, 220.0))
            # Usable on B with no wait at all: get_prompt reads the database.
            pb = await b.get_prompt("alice")
            assert same_prompt(pb, await a.get_prompt("alice"))
            assert pb.transcript == "Hello there, this is Alice."
            # B's listing follows A's commit through NOTIFY.
            assert await b.wait_for_mirror(lambda s: s.get("alice") is not None, WAIT)
            assert b.get("alice").audio_sha256 == info.audio_sha256
            assert [v.id for v in b.list()] == ["alice"]
            # The stored upload is the uploaded bytes, untouched.
            assert await b.source_audio("alice") == tone_wav(3.5, 220.0)

            # A has the features cached; B deletes. A's very next use fails.
            assert await b.delete("alice") is True
            with pytest.raises(KeyError):
                await a.get_prompt("alice")
            assert await a.delete("alice") is False  # already gone everywhere
            # An id PostgreSQL cannot hold (a NUL) is an unknown voice, not a DataError (a 500).
            with pytest.raises(KeyError):
                await a.get_prompt("x\x00y")
            assert await a.delete("x\x00y") is False
            assert await b.wait_for_mirror(lambda s: "alice" not in s, WAIT)
            assert a.list() == [] and b.list() == []
        finally:
            await a.close()
            await b.close()

    run_with_engine(tiny_model_dir, db_url, scenario)


def test_voice_count_limit_counts_the_shared_table(tiny_model_dir: Path, db_url: str) -> None:
    """`max_voices` holds for the table all replicas share: B is refused a new id once
    A's registrations filled it, and may replace one."""
    async def scenario(engine: Engine, url: str) -> None:
        a = await PgVoiceStore(url, engine, VoiceLimits(max_voices=1)).open()
        b = await PgVoiceStore(url, engine, VoiceLimits(max_voices=1)).open()
        try:
            await a.register("one", None, "The first voice.", tone_wav(3.5, 230.0))
            with pytest.raises(ApiError) as err:
                await b.register("two", None, "The second voice.", tone_wav(3.5, 240.0))
            assert (err.value.status, err.value.code) == (409, "too_many_voices")
            await b.register("one", None, "The first voice, again.", tone_wav(3.5, 250.0), replace=True)
            assert [v.id for v in b.list()] == ["one"]
            # Two replicas registering at once with one place left: one is refused, however
            # their inserts interleave (each counts under a lock the other's insert holds).
            a.limits = b.limits = VoiceLimits(max_voices=2)
            results = await asyncio.gather(a.register("two", None, "Two.", tone_wav(3.5, 260.0)),
                                           b.register("three", None, "Three.", tone_wav(3.5, 270.0)),
                                           return_exceptions=True)
            refused = [r for r in results if isinstance(r, ApiError)]
            assert len(refused) == 1 and refused[0].code == "too_many_voices", results
            async with a._conn() as conn:
                cur = await conn.execute(f"SELECT count(*) FROM {TABLE}")
                assert (await cur.fetchone())[0] == 2
        finally:
            await a.close()
            await b.close()

    run_with_engine(tiny_model_dir, db_url, scenario)


def test_delete_reaches_other_listing_through_notify(tiny_model_dir: Path, db_url: str) -> None:
    async def scenario(engine: Engine, url: str) -> None:
        a, b = await two_stores(engine, url)
        try:
            await a.register("bob", None, "Bob speaking.", tone_wav(3.2, 330.0))
            assert await b.wait_for_mirror(lambda s: "bob" in s, WAIT)
            await b.delete("bob")
            # A never touches the database for this voice: only the notification can tell it.
            assert await a.wait_for_mirror(lambda s: "bob" not in s, WAIT)
            assert a.get("bob") is None
        finally:
            await a.close()
            await b.close()

    run_with_engine(tiny_model_dir, db_url, scenario)


def test_replacement_invalidates_cached_features(tiny_model_dir: Path, db_url: str, tmp_path: Path) -> None:
    assets = tmp_path / "assets"
    assets.mkdir()
    (assets / "narrator.txt").write_text("The narrator reads this line.")

    async def scenario(engine: Engine, url: str) -> None:
        a, b = await two_stores(engine, url)
        try:
            (assets / "narrator.wav").write_bytes(tone_wav(3.0, 200.0))
            assert await a.register_assets(assets) == ["narrator"]
            old = await a.get_prompt("narrator")  # now cached on A
            assert await b.register_assets(assets) == []  # unchanged: B skips it
            (assets / "narrator.wav").write_bytes(tone_wav(4.0, 440.0))  # the asset changes
            assert await b.register_assets(assets) == ["narrator"]
            new_on_a = await a.get_prompt("narrator")
            assert not same_prompt(new_on_a, old)
            assert same_prompt(new_on_a, await b.get_prompt("narrator"))
            assert new_on_a.num_tokens == 100  # 4 s at 25 tokens/s, not the old 3 s
        finally:
            await a.close()
            await b.close()

    run_with_engine(tiny_model_dir, db_url, scenario)


def test_a_removed_asset_leaves_every_replica(tiny_model_dir: Path, db_url: str, tmp_path: Path) -> None:
    assets = tmp_path / "assets"
    assets.mkdir()
    (assets / "narrator.txt").write_text("The narrator reads this line.")
    (assets / "narrator.wav").write_bytes(tone_wav(3.0, 200.0))
    (assets / "untold.wav").write_bytes(tone_wav(3.0, 200.0))  # no transcript: never registered

    async def scenario(engine: Engine, url: str) -> None:
        a, b = await two_stores(engine, url)
        try:
            assert await a.register_assets(assets) == ["narrator"]
            assert await b.wait_for_mirror(lambda s: "narrator" in s, WAIT)
            assert not await b.delete("narrator", revision="narrator.stale")  # another registration
            assert b.get("narrator") is not None
            (assets / "narrator.wav").unlink()
            assert await b.register_assets(assets) == []
            assert b.get("narrator") is None
            assert await a.wait_for_mirror(lambda s: "narrator" not in s, WAIT)
        finally:
            await a.close()
            await b.close()

    run_with_engine(tiny_model_dir, db_url, scenario)


async def _voice_with_unrecorded_features(engine: Engine, url: str) -> Any:
    """Voice "v" registered, its features then stored as a build that kept no record of how
    they were made would have: the next process to read them makes them again. Returns them."""
    from gateway.voices import _npz_bytes

    a = await PgVoiceStore(url, engine).open()
    try:
        await a.register("v", None, "A transcript.", tone_wav(3.5, 220.0))
        made = await a.get_prompt("v")
        async with a._conn() as conn:
            await conn.execute(f"UPDATE {TABLE} SET features = %s WHERE id = %s", (_npz_bytes(made), "v"))
    finally:
        await a.close()
    return made


@contextlib.contextmanager
def _counting_featurisations(engine: Engine) -> Iterator[list[str]]:
    """The voice ids `engine.prepare_voice` featurises while the block runs."""
    calls: list[str] = []
    prepare = engine.prepare_voice

    async def counting(voice_id: str, *args: Any) -> Any:
        calls.append(voice_id)
        return await prepare(voice_id, *args)

    engine.prepare_voice = counting  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        del engine.prepare_voice


def test_features_made_another_way_are_made_again_for_this_process(tiny_model_dir: Path, db_url: str) -> None:
    """Features stored by another model or an older build are computed again from the
    stored upload, in this process only: replicas of two models mid-way through a change
    would otherwise undo each other's stored features."""

    async def scenario(engine: Engine, url: str) -> None:
        made = await _voice_with_unrecorded_features(engine, url)
        with _counting_featurisations(engine) as calls:
            b = await PgVoiceStore(url, engine).open()
            try:
                assert same_prompt(await b.get_prompt("v"), made) and calls == ["v"]
                assert same_prompt(await b.get_prompt("v"), made) and calls == ["v"]  # cached since
            finally:
                await b.close()

    run_with_engine(tiny_model_dir, db_url, scenario)


def test_sessions_opening_a_voice_at_once_featurise_it_once(tiny_model_dir: Path, db_url: str) -> None:
    """After a model change, every session that opened a voice before the first had made
    its features again made them itself (the SQLite store shares one load; this did not)."""

    async def scenario(engine: Engine, url: str) -> None:
        made = await _voice_with_unrecorded_features(engine, url)
        with _counting_featurisations(engine) as calls:
            b = await PgVoiceStore(url, engine).open()
            try:
                prompts = await asyncio.gather(*(b.get_prompt("v") for _ in range(8)))
                assert all(same_prompt(p, made) for p in prompts)
                assert calls == ["v"], calls
            finally:
                await b.close()

    run_with_engine(tiny_model_dir, db_url, scenario)


def test_racing_registrations_of_one_id_one_wins(tiny_model_dir: Path, db_url: str) -> None:
    async def scenario(engine: Engine, url: str) -> None:
        a, b = await two_stores(engine, url)
        try:
            results = await asyncio.gather(
                a.register("carol", None, "Carol one.", tone_wav(3.0, 250.0)),
                b.register("carol", None, "Carol two.", tone_wav(3.0, 350.0)),
                return_exceptions=True,
            )
            errors = [r for r in results if isinstance(r, ApiError)]
            assert len(errors) == 1 and errors[0].status == 409 and errors[0].code == "voice_exists"
            winner = next(r for r in results if not isinstance(r, BaseException))
            for store in (a, b):
                assert (await store.get_prompt("carol")).transcript == winner.transcript
            # A later registration of the taken id is refused on either replica.
            with pytest.raises(ApiError) as exc:
                await a.register("carol", None, "Carol three.", tone_wav(3.0, 450.0))
            assert exc.value.status == 409
        finally:
            await a.close()
            await b.close()

    run_with_engine(tiny_model_dir, db_url, scenario)


def pause_after(store: PgVoiceStore, call: int, action: Callable[[], Awaitable[None]]) -> None:
    """Run `action` once, when the calling task's `call`-th database use (from 1) through
    `store` is done and before the store goes on with what it read: the moment another
    replica's change and its notification can fall between a read (or a commit) and what
    the store does with it (a large row still in transit, a busy event loop). The
    listener's own queries run in its task and are not counted."""
    original = store._conn
    caller = asyncio.current_task()
    calls = [0]

    @contextlib.asynccontextmanager
    async def conn() -> AsyncIterator[Any]:
        mine = False
        if asyncio.current_task() is caller:
            calls[0] += 1
            mine = calls[0] == call
        async with original() as c:
            yield c
        if mine:
            await action()

    store._conn = conn  # type: ignore[method-assign]


def test_a_read_older_than_a_processed_notification_leaves_the_listing_alone(
        tiny_model_dir: Path, db_url: str) -> None:
    """A speech request that read a voice just before another replica deleted it, and
    went on only after this replica's listener had already dropped it from the listing,
    put the voice back into the listing (until a request for its speech, a 404, dropped it
    again). Likewise a registration whose commit another replica's delete followed."""
    async def scenario(engine: Engine, url: str) -> None:
        a, b = await two_stores(engine, url)
        try:
            await b.register("v", None, "A voice to delete.", tone_wav(3.0, 220.0))
            assert await a.wait_for_mirror(lambda s: "v" in s, WAIT)

            async def delete_on_b() -> None:
                assert await b.delete("v")
                assert await a.wait_for_mirror(lambda s: "v" not in s, WAIT)

            pause_after(a, 1, delete_on_b)  # get_prompt's one query (features not cached on A)
            await a.get_prompt("v")  # it started before the delete: it may be spoken
            del a._conn
            # The listener has handled the delete's notification; nothing else will come.
            assert a.get("v") is None and "v" not in [v.id for v in a.list()]
            with pytest.raises(KeyError):
                await a.get_prompt("v")

            # A registers "w"; B deletes it between A's commit and A's listing update.
            async def delete_w_on_b() -> None:
                assert await b.delete("w")
                # A's listener has seen the delete once it has seen a later change.
                await b.register("marker", None, "A later change.", tone_wav(3.0, 230.0))
                assert await a.wait_for_mirror(lambda s: "marker" in s, WAIT)

            pause_after(a, 3, delete_w_on_b)  # _exists, the count, then the insert
            await a.register("w", None, "A voice deleted at once.", tone_wav(3.0, 240.0))
            del a._conn
            assert a.get("w") is None, [v.id for v in a.list()]
            with pytest.raises(KeyError):
                await a.get_prompt("w")
        finally:
            await a.close()
            await b.close()

    run_with_engine(tiny_model_dir, db_url, scenario)


def test_a_cached_prompt_dropped_during_its_check_is_still_served(tiny_model_dir: Path, db_url: str) -> None:
    """A request whose voice's cached features were dropped while its revision check was
    in flight (another replica replaced the voice, or other voices pushed it out of the
    cache) failed with KeyError: a 404 for a voice that exists."""
    async def scenario(engine: Engine, url: str) -> None:
        a = await PgVoiceStore(url, engine, cache_size=1).open()
        b = await PgVoiceStore(url, engine).open()
        try:
            await a.register("v", None, "The voice in use.", tone_wav(3.0, 220.0))
            await a.register("u", None, "Another voice.", tone_wav(3.0, 330.0))
            cached = await a.get_prompt("v")  # cached; "u" is pushed out (one place)

            async def use_u() -> None:
                await a.get_prompt("u")  # another session's voice takes the one place

            pause_after(a, 1, use_u)
            assert same_prompt(await a.get_prompt("v"), cached)  # the revision checked is current
            del a._conn

            cached = await a.get_prompt("v")
            old = a.get("v").dir_name

            async def replace_on_b() -> None:
                await b.register("v", None, "The voice, replaced.", tone_wav(4.0, 440.0), replace=True)
                assert await a.wait_for_mirror(lambda s: s.get("v") is not None and s.get("v").dir_name != old, WAIT)

            pause_after(a, 1, replace_on_b)
            # Checked before the replacement committed: the old revision may still be spoken.
            assert same_prompt(await a.get_prompt("v"), cached)
            del a._conn
            assert (await a.get_prompt("v")).transcript == "The voice, replaced."
        finally:
            await a.close()
            await b.close()

    run_with_engine(tiny_model_dir, db_url, scenario)


def test_features_made_again_use_the_audio_of_the_revision_read(tiny_model_dir: Path, db_url: str) -> None:
    """A voice whose stored features another model made is featurised again from its
    upload; when another replica replaced the voice between the read of its row and the
    read of its upload, the new upload was featurised with the old transcript (a prompt
    whose text is not what its audio says) and cached under the old revision."""
    from gateway.voices import _npz_bytes

    async def scenario(engine: Engine, url: str) -> None:
        a, b = await two_stores(engine, url)
        try:
            await a.register("v", None, "The first transcript.", tone_wav(3.0, 220.0))
            made = await a.get_prompt("v")
            async with a._conn() as conn:  # as a build that kept no record stored them
                await conn.execute(f"UPDATE {TABLE} SET features = %s WHERE id = %s", (_npz_bytes(made), "v"))

            async def replace_on_a() -> None:
                await a.register("v", None, "The second, longer transcript.", tone_wav(4.0, 440.0), replace=True)

            pause_after(b, 1, replace_on_a)  # get_prompt's read of the row
            prompt = await b.get_prompt("v")
            del b._conn
            pairs = {(p.transcript, p.num_tokens) for p in (made, await a.get_prompt("v"))}
            assert (prompt.transcript, prompt.num_tokens) in pairs, (prompt.transcript, prompt.num_tokens, pairs)
            assert (prompt.transcript, prompt.num_tokens) == ("The second, longer transcript.", 100)
        finally:
            await a.close()
            await b.close()

    run_with_engine(tiny_model_dir, db_url, scenario)


def test_restart_and_lost_connections(tiny_model_dir: Path, db_url: str) -> None:
    import psycopg

    async def scenario(engine: Engine, url: str) -> None:
        a, b = await two_stores(engine, url)
        try:
            await a.register("dave", "Dave", "Dave here.", tone_wav(3.0, 300.0))
            before = await a.get_prompt("dave")
            # Kill every server-side connection of this database (pool and listeners):
            # what a database restart or failover does to the replicas.
            dbname = url.rsplit("/", 1)[1]
            async with await psycopg.AsyncConnection.connect(url.rsplit("/", 1)[0] + "/postgres",
                                                             autocommit=True) as admin:
                cur = await admin.execute(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = %s", (dbname,))
                assert (await cur.fetchone())[0] >= 2
            # The pool replaces dead connections at checkout; requests keep working.
            assert same_prompt(await b.get_prompt("dave"), before)
            await b.delete("dave")
            with pytest.raises(KeyError):
                await a.get_prompt("dave")
            # A's listener reconnected (and reloaded), so its listing follows too.
            assert await a.wait_for_mirror(lambda s: "dave" not in s, WAIT)

            await a.register("erin", None, "Erin speaking here.", tone_wav(3.0, 280.0))
            kept = await a.get_prompt("erin")
            await a.close()
            c = await PgVoiceStore(url, engine).open()  # a replica (re)starting
            try:
                assert [v.id for v in c.list()] == ["erin"]
                assert same_prompt(await c.get_prompt("erin"), kept)
            finally:
                await c.close()
        finally:
            await a.close()
            await b.close()

    run_with_engine(tiny_model_dir, db_url, scenario)


class _FreezingProxy:
    """A TCP proxy in front of PostgreSQL that can go silent on the connections that sent
    LISTEN: no error, no close, nothing forwarded any more either way. That is what a NAT
    or firewall that forgot an idle connection does to it. Later connections pass."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listeners: list[asyncio.Event] = []  # one "frozen" flag per LISTEN connection
        self.server: asyncio.AbstractServer | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    def freeze_listeners(self) -> None:
        for frozen in self.listeners:
            frozen.set()

    async def _serve(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        sr, sw = await asyncio.open_connection("127.0.0.1", self.target_port)
        frozen = asyncio.Event()

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter, from_client: bool) -> None:
            with contextlib.suppress(Exception):
                while data := await r.read(65536):
                    if from_client and b"LISTEN" in data and frozen not in self.listeners:
                        self.listeners.append(frozen)
                    if frozen.is_set():
                        await asyncio.Event().wait()  # silent for good
                    w.write(data)
                    await w.drain()
            w.close()

        await asyncio.gather(pipe(cr, sw, True), pipe(sr, cw, False))

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()


def test_a_silently_dropped_listen_connection_is_found_and_replaced(tiny_model_dir: Path, db_url: str) -> None:
    """The LISTEN connection goes silent without an error (a NAT that forgot it): after
    `listen_check_s` without a notification its check query gets no answer, and a new
    connection and a reload bring the listing back (before, it went stale for good)."""
    async def scenario(engine: Engine, url: str) -> None:
        target = int(url.rsplit(":", 1)[1].split("/", 1)[0])
        proxy = _FreezingProxy(target)
        port = await proxy.start()
        proxied = url.replace(f":{target}/", f":{port}/")
        a = await PgVoiceStore(proxied, engine, options=PgOptions(listen_check_s=0.3, connect_timeout_s=1.0)).open()
        b = await PgVoiceStore(url, engine).open()
        try:
            assert len(proxy.listeners) == 1
            proxy.freeze_listeners()
            await b.register("fay", None, "Fay speaks now.", tone_wav(3.0, 260.0))
            assert await a.wait_for_mirror(lambda s: s.get("fay") is not None, WAIT)
            assert len(proxy.listeners) == 2  # it listens on a new connection
        finally:
            await a.close()
            await b.close()
            await proxy.close()

    run_with_engine(tiny_model_dir, db_url, scenario)


def test_a_query_stuck_behind_a_lock_is_a_503_not_a_hang(tiny_model_dir: Path, db_url: str) -> None:
    import psycopg

    async def scenario(engine: Engine, url: str) -> None:
        store = await PgVoiceStore(url, engine, options=PgOptions(statement_timeout_s=0.3)).open()
        try:
            await store.register("gil", None, "Gil speaks now.", tone_wav(3.0, 240.0))
            # Someone's open transaction (a psql session, a migration) holds the table.
            async with await psycopg.AsyncConnection.connect(url) as holder:
                await holder.execute(f"LOCK TABLE {TABLE} IN ACCESS EXCLUSIVE MODE")
                async with asyncio.timeout(10):  # without a deadline this waits for the holder
                    with pytest.raises(VoiceStoreUnavailable) as exc:
                        await store.get_prompt("gil")
                assert exc.value.status == 503
                await holder.rollback()
            assert (await store.get_prompt("gil")).transcript == "Gil speaks now."  # the pool recovered
        finally:
            await store.close()

    run_with_engine(tiny_model_dir, db_url, scenario)


def test_unreachable_database_is_503(tiny_model_dir: Path) -> None:
    from pg_server import free_port

    async def scenario(engine: Engine, url: str) -> None:
        store = PgVoiceStore(url, engine, options=PgOptions(open_timeout_s=0.5))
        with pytest.raises(VoiceStoreUnavailable) as exc:
            await store.open()
        assert exc.value.status == 503 and exc.value.code == "voice_store_unavailable"
        with pytest.raises(RuntimeError):  # nothing half-open is left to use
            await store.get_prompt("anything")

    run_with_engine(tiny_model_dir, f"postgresql://gw@127.0.0.1:{free_port()}/none", scenario)


def test_create_voice_store_and_redaction(tmp_path: Path) -> None:
    assert type(create_voice_store("sqlite", tmp_path, engine=None)) is VoiceStore
    pg_store = create_voice_store("postgresql://u@db:5432/voices", tmp_path, engine=None)
    assert isinstance(pg_store, PgVoiceStore)
    with pytest.raises(ValueError):
        create_voice_store("mysql://u@db/voices", tmp_path, engine=None)
    assert redact_url("postgresql://u:s3cret@db:5432/v") == "postgresql://u:***@db:5432/v"
    assert redact_url("postgresql://u@db/v") == "postgresql://u@db/v"
    assert redact_url("postgresql://u@db/v?sslmode=require&password=s3cret") == \
        "postgresql://u@db/v?sslmode=require&password=***"
    assert redact_url("postgresql://u:a@db/v?password=b") == "postgresql://u:***@db/v?password=***"
