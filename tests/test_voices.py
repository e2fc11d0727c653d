"""VoiceStore: validation, atomic persistence, crash recovery, restart, assets.

The store runs against the real tiny engine (random weights, real speech tokenizer and
speaker encoder graphs): features are computed by the same code a real model uses, and
"the same voice after a restart" is checked bit for bit against what the engine
computed before. The engine lives on one event loop thread for the module
(`LoopThread`); each test's scenario runs there.
"""

from __future__ import annotations

import asyncio
import math
import shutil
import sqlite3
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from gateway.audio_files import decode_audio, wav_bytes
from gateway.errors import ApiError
from gateway.voices import VoiceInfo, VoiceLimits, VoiceStore
from test_audio_formats import mp3_with_damaged_frames, refused_packets
from helpers import SR, CountingEngine, LoopThread, create_engine, same_prompt, tone, tone_wav  # noqa: F401 (re-exported)


@pytest.fixture(scope="module")
def engine_loop(tiny_model_dir: Path) -> Iterator[tuple[LoopThread, Any]]:
    lt = LoopThread()
    engine = lt.run(create_engine(tiny_model_dir))
    yield lt, engine
    lt.run(engine.close())
    lt.close()


@pytest.fixture
def run(engine_loop):
    """Run a scenario coroutine on the engine's loop."""
    lt, _ = engine_loop
    return lambda coro: lt.run(coro)


@pytest.fixture
def engine(engine_loop) -> CountingEngine:
    """The shared real engine, with a fresh prepare_voice counter per test."""
    return CountingEngine(engine_loop[1])


# --------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------


async def open_store(data_dir: Path, engine: Any, **limits: Any) -> VoiceStore:
    return await VoiceStore(data_dir, engine, VoiceLimits(**limits)).open()


def live_dirs(data_dir: Path) -> list[str]:
    return sorted(p.name for p in (data_dir / "voices").iterdir())


def db_ids(data_dir: Path) -> list[str]:
    with sqlite3.connect(data_dir / "voices.sqlite3") as db:
        return sorted(r[0] for r in db.execute("SELECT id FROM voices"))


# --------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------


def test_register_persists_and_survives_restart(tmp_path: Path, run, engine_loop) -> None:
    async def scenario() -> None:
        engine = CountingEngine(engine_loop[1])
        store = await open_store(tmp_path, engine)
        info = await store.register("alice", "Alice", " Hello there. ", tone_wav(4.0), audio_ext=".wav")
        assert isinstance(info, VoiceInfo)
        assert (info.id, info.name, info.transcript, info.sample_rate) == ("alice", "Alice", "Hello there.", SR)
        assert info.duration_s == pytest.approx(4.0, abs=1e-3)
        assert info.num_prompt_tokens == 100
        first = await store.get_prompt("alice")
        assert engine.prepared == 1
        # The stored prompt is exactly what the engine computes for this audio.
        decoded = decode_audio(tone_wav(4.0))
        direct = await engine_loop[1].prepare_voice("alice", decoded.samples, decoded.sample_rate, "Hello there.")
        assert same_prompt(first, direct)
        assert first.num_tokens == 100 and tuple(first.speech_feat.shape) == (200, 80)
        await store.close()

        # Files on disk: the original bytes untouched, features as plain arrays.
        (folder,) = live_dirs(tmp_path)
        assert folder.startswith("alice.")
        assert (tmp_path / "voices" / folder / "source.wav").read_bytes() == tone_wav(4.0)
        assert db_ids(tmp_path) == ["alice"]

        engine2 = CountingEngine(engine_loop[1])
        store2 = await open_store(tmp_path, engine2)
        assert [v.id for v in store2.list()] == ["alice"]
        assert store2.get("alice") == info
        # Listed, not loaded yet: a context of it would wait for the disk (the WebSocket
        # starts it in the background); an unknown id is known at once.
        assert store2.cached_prompt("alice") is None
        with pytest.raises(KeyError):
            store2.cached_prompt("bob")
        again = await store2.get_prompt("alice")
        assert same_prompt(first, again)
        assert store2.cached_prompt("alice") is again
        assert engine2.prepared == 0  # loaded from disk, not recomputed
        await store2.close()

    run(scenario())


def test_generated_id_and_delete(tmp_path: Path, run, engine) -> None:
    async def scenario() -> None:
        store = await open_store(tmp_path, engine)
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
        ("abc\n", tone_wav(4.0), "hi", "invalid_voice_id", 400),
        ("a\x00b", tone_wav(4.0), "hi", "invalid_voice_id", 400),
        ("ok", b"definitely not audio" * 50, "hi", "invalid_audio", 400),
        ("ok", b"", "hi", "invalid_audio", 400),
        ("ok", tone_wav(2.0), "hi", "audio_too_short", 400),
        ("ok", tone_wav(31.0), "hi", "audio_too_long", 400),
        ("ok", wav_bytes(tone(4.0, 8000), 8000), "hi", "sample_rate_too_low", 400),
        ("ok", wav_bytes(np.zeros(4 * SR, np.float32), SR), "hi", "invalid_audio", 400),
        ("ok", wav_bytes(np.full(4 * SR, 0.5, np.float32), SR), "hi", "invalid_audio", 400),  # DC only
        ("ok", tone_wav(4.0), "   ", "missing_transcript", 400),
        ("ok", tone_wav(4.0), "hi\x00there", "invalid_request", 400),
    ],
)
def test_register_rejects_bad_input(tmp_path: Path, run, engine, voice_id, audio, transcript, code, status) -> None:
    async def scenario() -> None:
        store = await open_store(tmp_path, engine)
        with pytest.raises(ApiError) as err:
            await store.register(voice_id, None, transcript, audio)
        assert (err.value.code, err.value.status) == (code, status)
        assert store.list() == [] and live_dirs(tmp_path) == [] and db_ids(tmp_path) == []
        await store.close()

    run(scenario())


@pytest.mark.parametrize("channels", [1, 2, 8, 64])
def test_uploads_of_any_channel_count_mix_to_mono(channels: int) -> None:
    """Every channel counts once in the mono mix; 8 or more channels once crashed the
    process inside PyAV (a planar frame's `to_ndarray`)."""
    import io
    import wave

    frames = np.zeros((SR // 4, channels), dtype="<i2")
    frames[:, 0] = 16000  # one channel carries the signal, the others are silent
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(SR)
        w.writeframes(frames.tobytes())
    audio = decode_audio(buf.getvalue())
    assert audio.sample_rate == SR and audio.samples.shape == (SR // 4,)
    np.testing.assert_allclose(audio.samples, 16000 / 32768 / channels, rtol=1e-6)


def test_size_limit_and_conflict(tmp_path: Path, run, engine) -> None:
    async def scenario() -> None:
        store = await open_store(tmp_path, engine, max_upload_bytes=150_000)
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


def test_voice_count_limit(tmp_path: Path, run, engine) -> None:
    """`max_voices`: a new id past it is a 409 `too_many_voices` before any feature
    extraction; replacing a voice takes no room, and a delete makes room again."""
    async def scenario() -> None:
        store = await open_store(tmp_path, engine, max_voices=2)
        await store.register("a", None, "hi", tone_wav(3.2))
        await store.register("b", None, "hi", tone_wav(3.3))
        prepared = engine.prepared
        with pytest.raises(ApiError) as err:
            await store.register("c", None, "hi", tone_wav(3.4))
        assert (err.value.status, err.value.code) == (409, "too_many_voices")
        assert engine.prepared == prepared and store.get("c") is None
        await store.register("a", None, "hi again", tone_wav(3.5), replace=True)
        assert await store.delete("b")
        await store.register("c", None, "hi", tone_wav(3.4))
        assert sorted(v.id for v in store.list()) == ["a", "c"] and store.get("a").transcript == "hi again"
        await store.close()

    run(scenario())
    with pytest.raises(ValueError, match="voices.max_voices must be > 0"):
        VoiceLimits(max_voices=0)


def test_damaged_packets_limit(tmp_path: Path, run, engine) -> None:
    """`max_damaged_packets`: an MP3 with two frames the decoder refuses registers at its
    full length (the frames kept as silence); under a limit of one it is a 400."""
    mp3 = mp3_with_damaged_frames((12, 40), seconds=3.5)
    assert refused_packets(mp3) == 2

    async def scenario() -> None:
        store = await open_store(tmp_path, engine, max_damaged_packets=1)
        with pytest.raises(ApiError) as err:
            await store.register("v", None, "hi", mp3, audio_ext=".mp3")
        assert (err.value.status, err.value.code) == (400, "invalid_audio") and store.get("v") is None
        store.limits = VoiceLimits()
        info = await store.register("v", None, "hi", mp3, audio_ext=".mp3")
        assert (info.sample_rate, info.duration_s) == (24000, pytest.approx(3.5, abs=1e-3))
        await store.close()

    run(scenario())
    with pytest.raises(ValueError, match="voices.max_damaged_packets must be >= 0"):
        VoiceLimits(max_damaged_packets=-1)


def test_concurrent_registrations_of_one_id(tmp_path: Path, run, engine) -> None:
    async def scenario() -> None:
        store = await open_store(tmp_path, engine)
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


def test_crash_before_commit_leaves_no_half_voice(tmp_path: Path, run, engine) -> None:
    async def scenario() -> None:
        store = await open_store(tmp_path, engine)
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


def test_recovery_removes_orphans_on_open(tmp_path: Path, run, engine) -> None:
    async def scenario() -> None:
        store = await open_store(tmp_path, engine)
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

        store2 = await open_store(tmp_path, engine)
        assert [v.id for v in store2.list()] == ["keep"]
        assert db_ids(tmp_path) == ["keep"]
        assert [d.split(".")[0] for d in live_dirs(tmp_path)] == ["keep"]
        assert (await store2.get_prompt("keep")).transcript == "kept"
        await store2.close()

    run(scenario())


def test_a_prompt_load_that_loses_a_race_with_delete_is_an_unknown_voice(tmp_path: Path, run, engine) -> None:
    """A delete drops the id from the catalog, then removes the files: a prompt load from
    disk caught between the two finds no file, and must answer "unknown voice" (KeyError,
    a 404), not a FileNotFoundError (a 500)."""
    async def scenario() -> None:
        store = await open_store(tmp_path, engine)
        await store.register("v", None, "A transcript.", tone_wav(3.5))
        await store.close()
        store = await open_store(tmp_path, engine)  # a fresh process: nothing cached
        info = store.get("v")
        load = store._load_arrays

        def deleted_meanwhile(i: VoiceInfo) -> Any:  # -> the arrays and what made them
            store._infos.pop("v")  # what `delete` does first, then the files go
            shutil.rmtree(store._files / i.dir_name)
            return load(i)

        store._load_arrays = deleted_meanwhile  # type: ignore[method-assign]
        assert info is not None
        with pytest.raises(KeyError):
            await store.get_prompt("v")
        await store.close()

    run(scenario())


def test_a_voice_whose_files_are_gone_is_an_unknown_voice(tmp_path: Path, run, engine) -> None:
    """Files removed from under a listed voice (by hand, a lost disk) while the store is
    open: its prompt is not there to load, a KeyError (404 voice_not_found), not a
    FileNotFoundError (a 500)."""
    async def scenario() -> None:
        store = await open_store(tmp_path, engine)
        await store.register("v", None, "A transcript.", tone_wav(3.5))
        await store.close()
        store = await open_store(tmp_path, engine)  # a fresh process: nothing cached
        shutil.rmtree(tmp_path / "voices" / store.get("v").dir_name)
        with pytest.raises(KeyError):
            await store.get_prompt("v")
        await store.close()

    run(scenario())


def test_a_second_store_on_one_data_dir_is_refused_until_the_first_closes(tmp_path: Path, run, engine) -> None:
    """Two gateways on one SQLite data dir lose voices (one's start-up recovery deletes the
    files of the other's registration in flight): the second fails to open, saying what
    to use instead; once the first closes, a store opens there again."""
    import subprocess
    import sys

    async def scenario() -> None:
        first = await open_store(tmp_path, engine)
        await first.register("v", None, "A transcript.", tone_wav(3.5))
        second = VoiceStore(tmp_path, engine)
        with pytest.raises(RuntimeError, match="in use by another process") as err:
            await second.open()
        assert str(tmp_path) in str(err.value) and "--voice-store postgresql://" in str(err.value)
        assert first.get("v") is not None and len(live_dirs(tmp_path)) == 1  # untouched
        # Another process sees the same lock (a flock on <data_dir>/voices.lock).
        probe = ("import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR)\n"
                 "try: fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
                 "except BlockingIOError: sys.exit(3)")
        lock = str(tmp_path / "voices.lock")
        assert subprocess.run([sys.executable, "-c", probe, lock]).returncode == 3
        await first.close()
        assert subprocess.run([sys.executable, "-c", probe, lock]).returncode == 0
        again = await second.open()
        assert again.get("v") is not None
        await again.close()

    run(scenario())


def test_concurrent_first_uses_featurise_a_voice_once(tmp_path: Path, run, engine) -> None:
    """After a model change, 20 requests at once for one voice whose features another model
    made: one featurisation, shared by all of them (one prompt object); and a request
    that goes away meanwhile does not cancel it for the others."""
    class NewModel(CountingEngine):
        features_id = "another model"

    async def scenario() -> None:
        store = await open_store(tmp_path, engine)
        await store.register("v", None, "A transcript.", tone_wav(3.5))
        await store.close()
        new = NewModel(engine._engine)
        store = await open_store(tmp_path, new)
        prompts = await asyncio.gather(*(store.get_prompt("v") for _ in range(20)))
        assert new.prepared == 1 and len({id(p) for p in prompts}) == 1
        assert (await store.get_prompt("v")) is prompts[0] and new.prepared == 1  # cached
        await store.close()

        newer = NewModel(engine._engine)
        newer.features_id = "yet another model"
        store = await open_store(tmp_path, newer)
        leaver = asyncio.ensure_future(store.get_prompt("v"))
        stayer = asyncio.ensure_future(store.get_prompt("v"))
        await asyncio.sleep(0)
        leaver.cancel()
        prompt = await stayer
        assert leaver.cancelled() and newer.prepared == 1 and prompt.transcript == "A transcript."
        assert not store._loading  # nothing left in flight
        await store.close()

    run(scenario())


def test_open_removes_leftover_temp_npz_of_a_voice(tmp_path: Path, run, engine) -> None:
    """A featurisation again killed between writing its temp npz and renaming it leaves a
    `.prompt-*` file in a live voice's folder: the next open removes it, the voice stays."""
    async def scenario() -> None:
        store = await open_store(tmp_path, engine)
        await store.register("v", None, "A transcript.", tone_wav(3.5))
        folder = tmp_path / "voices" / store.get("v").dir_name
        await store.close()
        (folder / ".prompt-0123abcd.npz").write_bytes(b"half written")
        store = await open_store(tmp_path, engine)
        assert sorted(p.name for p in folder.iterdir()) == ["prompt.npz", "source.bin"]
        assert (await store.get_prompt("v")).transcript == "A transcript."
        await store.close()

    run(scenario())


def test_an_upload_at_an_odd_sample_rate_registers_with_a_bounded_filter_table(
        tmp_path: Path, run, engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """16001 Hz reduces to 16001:16000: the official resampler's polyphase table would hold
    ~2.6e8 weights (GBs, tens of seconds). The upload registers, no such table built."""
    from engine.frontend import features

    sizes: list[int] = []
    real = features.sinc_kernel

    def spy(sr_in: int, sr_out: int, *args: Any, **kw: Any) -> Any:
        g = math.gcd(sr_in, sr_out)
        p, q = sr_in // g, sr_out // g
        sizes.append(q * (2 * math.ceil(6 * p / (0.99 * min(p, q))) + p))
        assert sizes[-1] <= 4_000_000, f"a {sizes[-1]}-weight table for {sr_in} -> {sr_out} Hz"
        return real(sr_in, sr_out, *args, **kw)

    monkeypatch.setattr(features, "sinc_kernel", spy)

    async def scenario() -> None:
        store = await open_store(tmp_path, engine)
        info = await store.register("odd", None, "A transcript.", wav_bytes(tone(3.5, 16001), 16001))
        assert info.sample_rate == 16001 and info.num_prompt_tokens > 0
        assert all(n <= 4_000_000 for n in sizes)
        await store.close()

    run(scenario())


def test_register_assets_skips_unchanged_and_replaces_changed(tmp_path: Path, caplog, run, engine) -> None:
    assets = tmp_path / "assets"
    assets.mkdir()
    (assets / "narrator.wav").write_bytes(tone_wav(3.5))
    (assets / "narrator.txt").write_text("The narrator speaks.\n")
    (assets / "orphan.wav").write_bytes(tone_wav(3.5))  # no transcript: skipped
    (assets / "short.wav").write_bytes(tone_wav(1.0))  # invalid: logged, skipped
    (assets / "short.txt").write_text("too short")
    (assets / "latin1.wav").write_bytes(tone_wav(3.5))
    (assets / "latin1.txt").write_bytes(b"caf\xe9 au lait")  # not UTF-8: logged, skipped
    (assets / "bom.wav").write_bytes(tone_wav(3.6))
    (assets / "bom.txt").write_bytes("\ufeffA line saved with a BOM.\r\n".encode())  # the BOM is not text
    (assets / "Loud.WAV").write_bytes(tone_wav(3.7))  # as recorders and Windows tools name files
    (assets / "Loud.TXT").write_text("Upper-case names count too.")
    data = tmp_path / "data"

    async def scenario() -> None:
        store = await open_store(data, engine)
        assert await store.register_assets(assets) == ["Loud", "bom", "narrator"]
        assert store.get("Loud").transcript == "Upper-case names count too."
        assert store.get("narrator").source == "asset"
        assert store.get("narrator").transcript == "The narrator speaks."
        assert store.get("bom").transcript == "A line saved with a BOM."
        assert (await store.get_prompt("bom")).transcript == "A line saved with a BOM."
        await store.close()

        store = await open_store(data, engine)
        caplog.clear()
        with caplog.at_level("INFO", logger="gateway.voices"):
            assert await store.register_assets(assets) == []
        assert any("unchanged" in r.getMessage() for r in caplog.records)
        assert engine.prepared == 3
        old_dir = store.get("narrator").dir_name

        (assets / "narrator.txt").write_text("A new line.")
        assert await store.register_assets(assets) == ["narrator"]
        assert store.get("narrator").transcript == "A new line."
        assert store.get("narrator").dir_name != old_dir
        assert live_dirs(data) == sorted([store.get(v).dir_name for v in ("Loud", "bom", "narrator")])
        assert (await store.get_prompt("narrator")).transcript == "A new line."
        await store.close()

    run(scenario())


def test_features_made_another_way_are_made_again_from_the_audio(tmp_path: Path, run, engine) -> None:
    """A voice whose stored features another model or an older build made (no record of
    what made them, or another one) gets them computed again from its uploaded audio on
    first use, stored so; a voice stored as the engine makes them now is loaded as is."""
    from gateway.voices import _npz_bytes, npz_arrays

    async def scenario() -> None:
        store = await open_store(tmp_path, engine)
        await store.register("v", None, "A transcript.", tone_wav(3.5))
        first = await store.get_prompt("v")
        await store.close()
        npz = tmp_path / "voices" / store.get("v").dir_name / "prompt.npz"
        assert npz_arrays(npz)[1] == engine.features_id
        npz.write_bytes(_npz_bytes(first))  # as a build that kept no record stored it
        before = engine.prepared
        store = await open_store(tmp_path, engine)
        again = await store.get_prompt("v")
        assert engine.prepared == before + 1 and same_prompt(again, first)
        assert npz_arrays(npz)[1] == engine.features_id  # stored as made now
        await store.close()
        store = await open_store(tmp_path, engine)
        await store.get_prompt("v")
        assert engine.prepared == before + 1  # loaded, not made again
        await store.close()

        class OtherModel:  # the same engine, as if another model's frontend were loaded
            def __init__(self) -> None:
                self.features_id = "another model"

            def __getattr__(self, name: str) -> Any:
                return getattr(engine, name)

        store = await open_store(tmp_path, OtherModel())
        await store.get_prompt("v")
        assert engine.prepared == before + 2 and npz_arrays(npz)[1] == "another model"
        await store.close()

    run(scenario())


def test_an_upload_cannot_make_ffmpeg_read_a_file_of_the_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """FFmpeg guesses a container from its bytes; its concat demuxer then opens the files
    the upload names (relative to the server's working directory). Only audio containers
    are read."""
    secret = tmp_path / "server-side.wav"
    secret.write_bytes(wav_bytes(tone(1.0), SR))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ApiError) as err:
        decode_audio(b"ffconcat version 1.0\nfile server-side.wav\n")
    assert err.value.status == 400 and err.value.code == "invalid_audio"
    assert decode_audio(secret.read_bytes()).duration_s == pytest.approx(1.0, abs=0.01)  # a real WAV still is


def test_an_asset_voice_whose_file_is_gone_is_deleted(tmp_path: Path, caplog, run, engine) -> None:
    """The assets folder says which bundled voices exist: one whose .wav left it goes at the
    next registration, with its files; uploads are never touched, nor a voice uploaded under
    an asset's id; a missing folder deletes nothing."""
    assets = tmp_path / "assets"
    assets.mkdir()
    for name in ("narrator", "retired", "taken"):
        (assets / f"{name}.wav").write_bytes(tone_wav(3.5))
        (assets / f"{name}.txt").write_text(f"The {name} speaks.")
    data = tmp_path / "data"

    async def scenario() -> None:
        store = await open_store(data, engine)
        assert await store.register_assets(assets) == ["narrator", "retired", "taken"]
        await store.register("guest", "guest", "An uploaded voice.", tone_wav(3.5), audio_ext="wav")
        await store.register("taken", "taken", "Uploaded over the asset.", tone_wav(3.6), audio_ext="wav",
                             replace=True)
        await store.close()

        for name in ("retired", "taken"):
            (assets / f"{name}.wav").unlink()
        store = await open_store(data, engine)
        await store.register_assets(tmp_path / "no-such-folder")
        (tmp_path / "empty").mkdir()
        await store.register_assets(tmp_path / "empty")  # a volume not mounted yet, say
        assert {v.id for v in store.list()} == {"narrator", "retired", "taken", "guest"}
        # A delete for another registration of the id than the stored one does nothing.
        assert not await store.delete("retired", revision="retired.stale")
        assert store.get("retired") is not None
        with caplog.at_level("INFO", logger="gateway.voices"):
            assert await store.register_assets(assets) == []
        assert {v.id for v in store.list()} == {"narrator", "taken", "guest"}
        assert store.get("taken").source == "upload"
        assert any("'retired' deleted" in r.getMessage() for r in caplog.records)
        assert live_dirs(data) == sorted(v.dir_name for v in store.list())
        with pytest.raises(KeyError):
            await store.get_prompt("retired")
        await store.close()

        store = await open_store(data, engine)  # the deletion was committed
        assert store.get("retired") is None
        await store.close()

    run(scenario())
