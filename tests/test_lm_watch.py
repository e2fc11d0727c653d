"""The LM watch (`engine.lm_watch`): a stuck LM is named, overload and text waits are not."""

from __future__ import annotations

import asyncio
import time

from engine.config import EngineConfig
from engine.engine import Engine
from engine.lm_watch import LMWatch
from engine.types import SessionOptions

from test_engine import collect, default_voice


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_streams_waiting_without_a_token_for_the_timeout_are_a_stall() -> None:
    clock = Clock()
    watch = LMWatch(10.0, clock)
    clock.now += 1000  # an idle LM: its last token long ago is no stall
    assert watch.stalled() is None
    watch.opened()
    clock.now += 9.9
    assert watch.stalled() is None  # counted from the open, not from the idle LM's last token
    clock.now += 0.2
    why = watch.stalled()
    assert why is not None and "1 request(s)" in why and "no token for 10 s" in why
    watch.token()
    assert watch.stalled() is None
    watch.closed()
    clock.now += 60
    assert watch.stalled() is None


def test_a_token_for_any_stream_is_progress() -> None:
    """Overload: many streams wait, few get tokens; the LM still works."""
    clock = Clock()
    watch = LMWatch(10.0, clock)
    for _ in range(50):
        watch.opened()
    for _ in range(30):
        clock.now += 5
        watch.token()
        assert watch.stalled() is None


def test_a_stream_waiting_for_its_text_is_not_waiting_on_the_lm() -> None:
    clock = Clock()
    watch = LMWatch(10.0, clock)
    gate = asyncio.Event()

    async def arrivals():
        yield [1]
        await gate.wait()  # the client types slowly
        yield [2]

    async def main() -> None:
        watch.opened()
        text = watch.text(arrivals())
        assert await anext(text) == [1]
        waiting = asyncio.ensure_future(anext(text))
        await asyncio.sleep(0)  # the backend now waits for the next piece of text
        assert watch.awaiting_text == 1 and watch.waiting == 0
        clock.now += 1000
        assert watch.stalled() is None
        gate.set()
        assert await waiting == [2]
        assert watch.awaiting_text == 0 and watch.waiting == 1
        clock.now += 9  # the wait on the LM counts from the text's arrival
        assert watch.stalled() is None
        clock.now += 2
        assert watch.stalled() is not None
        await text.aclose()

    asyncio.run(main())


def test_timeout_zero_never_names_a_stall() -> None:
    clock = Clock()
    watch = LMWatch(0.0, clock)
    watch.opened()
    clock.now += 1e6
    assert watch.stalled() is None


def test_an_engine_whose_lm_stops_making_tokens_reports_itself_failed(tiny_model_dir) -> None:
    """The torch backend's generation stops after a few tokens and never ends, as a stuck
    vLLM engine core would: after `lm_stall_timeout_s` the engine names the stall in
    `failure` (which the gateway's exit on engine failure reads) and is not ready. A
    healthy utterance before it left the watch quiet."""
    async def main() -> None:
        engine = await Engine.create(EngineConfig(model_dir=tiny_model_dir, device="cpu", lm_backend="torch",
                                                  warmup=False, lm_stall_timeout_s=2.0, initial_hop_max=0,
                                                  chunk_patience_s=0.0))
        try:
            voice = await default_voice(engine)
            opts = SessionOptions(tokens_per_text_token=3.0, seed=1)
            s = engine.open_session(voice, opts)
            await s.submit("A first sentence.")
            await s.finish()
            await collect(s)
            assert engine.failure is None and engine.ready

            generate = engine.backend.generate
            stuck = asyncio.Event()

            async def hangs(request):
                n = 0
                async for tok in generate(request):
                    yield tok
                    n += 1
                    if n == 3:
                        stuck.set()
                        await asyncio.Event().wait()  # never set: the LM answers no more

            engine.backend.generate = hangs
            s = engine.open_session(voice, opts)
            await s.submit("A second sentence that the model never finishes.")
            await asyncio.wait_for(stuck.wait(), 30)
            deadline = time.monotonic() + 30
            while engine.failure is None and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert engine.failure is not None and "no token" in engine.failure, engine.failure
            assert not engine.ready
            await s.abort()
        finally:
            await engine.close()

    asyncio.run(main())


def test_a_queue_behind_streams_waiting_for_their_text_is_not_a_stall(tiny_model_dir) -> None:
    """Every LM row is held by a text-in stream waiting for its client's next words, and a
    plain utterance queues behind them: it waits on the clients, not on the LM. Before,
    the watch named a stall after `lm_stall_timeout_s` and the gateway restarted."""
    async def main() -> None:
        engine = await Engine.create(EngineConfig(model_dir=tiny_model_dir, device="cpu", lm_backend="torch",
                                                  warmup=False, lm_stall_timeout_s=1.0, lm_max_batch=1,
                                                  initial_hop_max=0, chunk_patience_s=0.0))
        try:
            voice = await default_voice(engine)
            opts = SessionOptions(tokens_per_text_token=3.0, seed=1)
            streaming = engine.open_session(voice, opts)
            _, feed = await streaming.submit_stream()
            feed.append("Hello there, this is a streamed sentence that goes on ", word_end=True)
            drained = asyncio.ensure_future(collect(streaming))
            plain = engine.open_session(voice, opts)
            await plain.submit("A plain sentence.")
            await plain.finish()
            queued = asyncio.ensure_future(collect(plain))
            deadline = time.monotonic() + 60
            while not engine.backend.blocked_on_text() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert engine.backend.blocked_on_text()
            end = time.monotonic() + 2.5  # 2.5 stall timeouts with no token anywhere
            while time.monotonic() < end:
                assert engine.failure is None, engine.failure
                await asyncio.sleep(0.1)
            feed.close()
            await streaming.finish()
            await asyncio.wait_for(asyncio.gather(drained, queued), 60)
            assert engine.failure is None and engine.ready
        finally:
            await engine.close()

    asyncio.run(main())
