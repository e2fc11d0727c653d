"""Text-in streaming through the engine: incremental tokenization and Session.submit_stream."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

from engine.engine import Engine
from engine.frontend.tokenizer import TextTokenizer
from engine.text_stream import TextFeed
from engine.types import AudioChunk, SessionOptions, UtteranceError
from engine.wavio import read_wav
from helpers import engine_config

ROOT = Path(__file__).resolve().parent.parent
TEXT = "Hello there, this sentence is streamed word by word while it is spoken. Numbers 1234 too!"


def _pieces(text: str, seed: int) -> list[str]:
    """Cut `text` at random places (inside words too), like an LLM's text deltas."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), 25))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def test_incremental_tokenization_equals_whole_text(tiny_model_dir: Path) -> None:
    tok = TextTokenizer.from_dir(tiny_model_dir / "CosyVoice-BlankEN")

    async def main(seed: int) -> tuple[list[int], list[int]]:
        feed = TextFeed(tok.encode)
        got: list[int] = []
        seen_before_close = 0
        for piece in _pieces(TEXT, seed):
            feed.append(piece)
        while not feed._queue.empty():  # tokens available before the end: all but the open word
            got += [feed._queue.get_nowait()]  # type: ignore[list-item]
        seen_before_close = len(got)
        feed.close()
        async for a in feed.arrivals():
            assert len(a) == 1  # one token per arrival, as the official frontend
            got += a
        return got, [seen_before_close]

    whole = tok.encode(TEXT)
    for seed in range(5):
        got, (early,) = asyncio.run(main(seed))
        assert got == whole
        assert early == len(tok.encode(TEXT[: TEXT.rfind(" ")]))


def test_incremental_tokenization_keeps_newline_runs_and_takes_complete_words_at_once(tiny_model_dir: Path) -> None:
    """Appends cut anywhere, some marked as ending a word (`word_end`: what the gateway's
    stream mode hands out, text up to a whitespace still to come): the ids are the whole
    text's, newline runs after punctuation included, and a word marked complete is read
    at once, not with the next one."""
    tok = TextTokenizer.from_dir(tiny_model_dir / "CosyVoice-BlankEN")
    # Qwen2's pre-tokens, as ids: the stand-in vocabulary is too small to merge "\n\n" or
    # ".\n\n", so its ids would not show a pre-token cut in two.
    pieces: dict[str, int] = {}

    def pre_tokens(piece: str) -> list[int]:
        return [pieces.setdefault(p, len(pieces)) for p, _ in tok._tok.pre_tokenizer.pre_tokenize_str(piece)]

    text = "Steps:\n\n1. Open it.\n\nThen  tap, twice!\r\nDone ok.\n  Bye"
    rng = random.Random(7)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 20)))
        feed = TextFeed(pre_tokens)
        got: list[int] = []
        for a, b in zip([0, *cuts], [*cuts, len(text)]):
            feed.append(text[a:b], word_end=b < len(text) and text[b].isspace() and rng.random() < 0.7)
            while not feed._queue.empty():
                got.append(feed._queue.get_nowait())  # type: ignore[arg-type]
        feed.close()
        while not feed._queue.empty():
            tok_id = feed._queue.get_nowait()
            if tok_id is not None:
                got.append(tok_id)
        assert got == pre_tokens(text), cuts

    feed = TextFeed(tok.encode)
    feed.append("Hello", word_end=True)  # " world" is still to come
    assert feed.num_tokens == len(tok.encode("Hello"))
    feed.append(" world")  # not known to be complete: waits for what follows
    assert feed.num_tokens == len(tok.encode("Hello"))


def _run(model_dir: Path, fn):
    async def main():
        # Chunks of fixed sizes (`helpers.engine_config`): the tests count chunks, and a streamed
        # utterance queued behind more than `chunk_patience_s` of another's audio still to play
        # (this CPU running ahead of real time) would otherwise go as one patient chunk.
        engine = await Engine.create(engine_config(model_dir))
        try:
            return await fn(engine)
        finally:
            await engine.close()

    return asyncio.run(main())


async def _voice(engine: Engine):
    wav, sr = read_wav(ROOT / "assets" / "default.wav")
    return await engine.prepare_voice("default", wav, sr, (ROOT / "assets" / "default.txt").read_text().strip())


def test_submit_stream_speaks_in_order_after_a_plain_utterance(tiny_model_dir: Path) -> None:
    async def fn(engine: Engine):
        voice = await _voice(engine)
        sess = engine.open_session(voice, SessionOptions(tokens_per_text_token=3.0, seed=1))
        u1 = await sess.submit("A plain sentence first.")
        u2, feed = await sess.submit_stream()
        events: list[AudioChunk | UtteranceError] = []

        async def read() -> None:
            async for ev in sess.events():
                events.append(ev)

        reader = asyncio.create_task(read())
        for piece in _pieces(TEXT, 7):
            feed.append(piece)
            await asyncio.sleep(0)  # let the LM run between pieces
        feed.close()
        await sess.finish()
        await asyncio.wait_for(reader, 120)
        return events, sess.utterance_stats(u1), sess.utterance_stats(u2), u1, u2, feed.num_tokens

    events, st1, st2, u1, u2, n_text = _run(tiny_model_dir, fn)
    assert all(isinstance(e, AudioChunk) for e in events), events
    ids = [e.utterance_id for e in events]
    assert ids == [u1] * ids.count(u1) + [u2] * ids.count(u2) and ids.count(u2) >= 2
    chunks = [e for e in events if e.utterance_id == u2]
    assert chunks[-1].is_last and not any(c.is_last for c in chunks[:-1])
    assert sum(c.pcm.size for c in chunks) == st2.num_samples > 0
    # fixed length: 3 speech tokens per text token (silence capping may drop a few)
    assert 0.8 * 3 * n_text <= st2.num_speech_tokens <= 3 * n_text
    assert st2.extra["first_text_at"] <= st2.first_token_at <= st2.first_audio_at


def test_empty_stream_is_an_error_and_session_goes_on(tiny_model_dir: Path) -> None:
    async def fn(engine: Engine):
        voice = await _voice(engine)
        sess = engine.open_session(voice, SessionOptions(tokens_per_text_token=2.0, seed=0))
        u1, feed = await sess.submit_stream()
        feed.append("   ")
        feed.close()
        u2 = await sess.submit("Still here.")
        await sess.finish()
        return [ev async for ev in sess.events()], u1, u2

    events, u1, u2 = _run(tiny_model_dir, fn)
    assert isinstance(events[0], UtteranceError) and events[0].utterance_id == u1 and events[0].code == "empty_text"
    assert all(isinstance(e, AudioChunk) and e.utterance_id == u2 for e in events[1:]) and len(events) > 1


def test_backend_that_cannot_stream_input_is_refused_clearly(tiny_model_dir: Path) -> None:
    """A vLLM engine with async scheduling on cannot take text-in streaming: the session says
    so with an `unsupported` error before any work starts, and plain utterances still work."""
    import pytest

    from engine.errors import EngineError

    async def fn(engine: Engine):
        engine.backend.streaming_input_refusal = lambda: "async scheduling is on"  # type: ignore[attr-defined]
        voice = await _voice(engine)
        sess = engine.open_session(voice, SessionOptions(tokens_per_text_token=2.0, seed=0))
        with pytest.raises(EngineError) as err:
            await sess.submit_stream()
        u = await sess.submit("Still fine.")
        await sess.finish()
        return err.value, [ev async for ev in sess.events()], u

    err, events, u = _run(tiny_model_dir, fn)
    assert err.code == "unsupported" and "async scheduling" in str(err)
    assert events and all(isinstance(e, AudioChunk) and e.utterance_id == u for e in events)
