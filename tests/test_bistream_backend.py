"""Text-in streaming on the torch LM backend (`TorchLMBackend.generate_streaming`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import pytest
import torch

from bench.bistream_parity import uncached_reference
from engine.backends.base import LMRequest, SamplingParams
from engine.backends.torch_backend import TorchLMBackend
from engine.bistream import BistreamRequest, BistreamState, LengthLimits, SpeechLimitReached
from engine.models.config import ModelConfig
from engine.models.lm import END_OF_PROMPT_ID, CosyVoice3LM, init_random_, unified_vocab

T = TypeVar("T")
PROMPT_TEXT = (100, 101, END_OF_PROMPT_ID, 102, 103)  # system part, eop, 2 transcript tokens
PROMPT_SPEECH = tuple(range(40, 60))  # 20 tokens: the first run completes a 15-block with 10


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def lm() -> CosyVoice3LM:
    return init_random_(CosyVoice3LM(ModelConfig.tiny().lm), seed=0).eval()


def _run(fn: Callable[[], Awaitable[T]]) -> T:
    return asyncio.run(asyncio.wait_for(fn(), timeout=60))


def _request(rid: str, ratio: float = 3.0, **kw: object) -> BistreamRequest:
    return BistreamRequest(rid, PROMPT_TEXT, PROMPT_SPEECH, SamplingParams(greedy=True),
                           LengthLimits(fixed_ratio=ratio), **kw)  # type: ignore[arg-type]


def reference(lm: CosyVoice3LM, req: BistreamRequest, arrivals: list[list[int]]) -> tuple[list[int], list[int]]:
    """The uncached greedy reference of the GPU parity bench: (speech tokens, context)."""
    ref = uncached_reference(lm, req, arrivals)
    return ref["speech"], ref["context"]


async def _source(arrivals: list[list[int]], gate: asyncio.Event | None = None, gate_at: int = 0) -> AsyncIterator[list[int]]:
    for i, a in enumerate(arrivals):
        if gate is not None and i == gate_at:
            await gate.wait()
        yield a


def test_stream_matches_uncached_reference_with_a_pause(lm: CosyVoice3LM) -> None:
    """Text token by token; after 8 tokens the source blocks until the first run's 10
    speech tokens were received, so the request must wait (fill) and resume."""
    arrivals = [[200 + i] for i in range(22)]
    req = _request("s1")
    expected, context = reference(lm, req, arrivals)
    assert len(expected) == 66  # fixed ratio 3 x 22 text tokens
    # The reference context has the official shape: 2 prompt blocks, 10 generated, then 5-text blocks.
    off = lm.cfg.speech_vocab_size
    assert context[:5] == [lm.cfg.sos, off + 100, off + 101, off + END_OF_PROMPT_ID, off + 102]

    async def main() -> list[int]:
        backend = TorchLMBackend(lm, unified_vocab(lm.cfg))
        gate = asyncio.Event()
        got: list[int] = []
        async for tok in backend.generate_streaming(req, _source(arrivals, gate, gate_at=8)):
            got.append(tok)
            if len(got) == 10:
                gate.set()
        assert backend.num_active() == 0
        await backend.close()
        return got

    assert _run(main) == expected


def test_waiting_stream_does_not_block_other_requests(lm: CosyVoice3LM) -> None:
    """A stream waits for text (its source is gated on the plain request finishing);
    the plain request and a second stream complete meanwhile, and all three equal
    their results when run alone."""
    arr_a = [[300 + i] for i in range(12)]
    arr_b = [[400 + i, 401 + i] for i in range(0, 16, 2)]
    req_a, req_b = _request("a", ratio=2.0), _request("b", ratio=2.5)
    plain = LMRequest("p", tuple([6561] + [6761 + 7 + i for i in range(5)] + [6563]),
                      SamplingParams(greedy=True, fixed_length=30))

    async def main() -> tuple[list[int], list[int], list[int], list[int]]:
        backend = TorchLMBackend(lm, unified_vocab(lm.cfg))
        plain_done = asyncio.Event()

        async def run_plain() -> list[int]:
            out = [t async for t in backend.generate(plain)]
            plain_done.set()
            return out

        async def run_stream(r: BistreamRequest, src: AsyncIterator[list[int]]) -> list[int]:
            return [t async for t in backend.generate_streaming(r, src)]

        a, b, p = await asyncio.gather(
            run_stream(req_a, _source(arr_a, plain_done, gate_at=3)),
            run_stream(req_b, _source(arr_b)),
            run_plain(),
        )
        alone = [t async for t in backend.generate(plain)]
        await backend.close()
        return a, b, p, alone

    a, b, p, alone = _run(main)
    assert a == reference(lm, req_a, arr_a)[0]
    assert b == reference(lm, req_b, arr_b)[0]
    assert p == alone and len(p) == 30


def test_fill_cadence_in_backend(lm: CosyVoice3LM) -> None:
    """The backend's state machine saw a fill after every 15 generated speech tokens
    (the first after 10, completing the prompt's partial block)."""
    arrivals = [[500 + i] for i in range(27)]
    req = _request("c", ratio=3.0)
    seen: list[BistreamState] = []

    async def main() -> None:
        backend = TorchLMBackend(lm, unified_vocab(lm.cfg))
        agen = backend.generate_streaming(req, _source(arrivals))
        first = await agen.__anext__()
        seen.append(backend._known["c"].stream)  # type: ignore[arg-type]
        rest = [t async for t in agen]
        assert len(rest) + 1 == 81
        assert first is not None
        await backend.close()

    _run(main)
    hist = seen[0].history
    fills = [i for i, t in enumerate(hist) if t == lm.cfg.fill_token]
    # Greedy random weights may also sample fill themselves; forced ones keep the
    # gaps at most 15 speech tokens, and the first gap at most 10.
    assert fills and fills[0] <= 10
    assert all(b - a <= 16 for a, b in zip(fills, fills[1:]))


def test_abort_while_waiting_for_text(lm: CosyVoice3LM) -> None:
    async def main() -> tuple[int, int]:
        backend = TorchLMBackend(lm, unified_vocab(lm.cfg))
        never = asyncio.Event()
        agen = backend.generate_streaming(_request("w"), _source([[600 + i] for i in range(20)], never, gate_at=8))
        got = [await agen.__anext__() for _ in range(10)]  # the first run; then it waits
        during = backend.num_active()
        await agen.aclose()
        after = backend.num_active()
        await backend.close()
        return during + len(got) * 0, after

    during, after = _run(main)
    assert during == 1 and after == 0


def test_text_source_error_fails_only_its_stream(lm: CosyVoice3LM) -> None:
    async def bad() -> AsyncIterator[list[int]]:
        yield [700]
        raise RuntimeError("upstream LLM died")

    async def main() -> list[int]:
        backend = TorchLMBackend(lm, unified_vocab(lm.cfg))
        with pytest.raises(RuntimeError, match="upstream LLM died"):
            async for _ in backend.generate_streaming(_request("e"), bad()):
                pass
        ok = [t async for t in backend.generate_streaming(_request("f", ratio=1.0), _source([[1, 2, 3, 4, 5, 6]]))]
        await backend.close()
        return ok

    assert len(_run(main)) >= 6


async def _until(cond: Callable[[], bool], what: str) -> None:
    """A bounded wait for the backend's loop to get somewhere (it runs on this event loop)."""
    for _ in range(3000):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_text_source_failing_while_its_row_decodes_frees_the_row(lm: CosyVoice3LM) -> None:
    """The source raises while a step is decoding its stream in the worker thread. Before,
    the step then set the request's `finished` back from the stream's state, and the row
    was held for good: with one row, nothing else ever ran."""
    import threading

    async def main() -> list[int]:
        loop = asyncio.get_running_loop()
        backend = TorchLMBackend(lm, unified_vocab(lm.cfg), max_batch=1)
        in_step, go = asyncio.Event(), threading.Event()
        advance = backend._advance_stream

        def held(req, token):  # worker thread, inside a step
            if req.request.request_id == "e" and not go.is_set():
                loop.call_soon_threadsafe(in_step.set)
                go.wait(30)
            return advance(req, token)

        backend._advance_stream = held  # type: ignore[method-assign]

        async def failing() -> AsyncIterator[list[int]]:
            for i in range(12):  # text for the first run
                yield [200 + i]
            await in_step.wait()  # a step is decoding this stream now
            loop.call_soon(go.set)  # runs once this failure has been handled
            raise RuntimeError("upstream LLM died")

        with pytest.raises(RuntimeError, match="upstream LLM died"):
            async for _ in backend.generate_streaming(_request("e"), failing()):
                pass
        plain = LMRequest("p", tuple([6561] + [6761 + 7 + i for i in range(5)] + [6563]),
                          SamplingParams(greedy=True, fixed_length=5))
        out = await asyncio.wait_for(_collect(backend.generate(plain)), 30)
        await backend.close()
        return out

    assert len(_run(main)) == 5


async def _collect(agen: AsyncIterator[int]) -> list[int]:
    return [t async for t in agen]


def test_a_stream_that_ends_while_waiting_for_a_row_is_never_admitted(lm: CosyVoice3LM) -> None:
    """A stream whose text never came ended while a plain request held the only row; when
    the row came free it was admitted anyway and counted active for good."""
    async def main() -> None:
        backend = TorchLMBackend(lm, unified_vocab(lm.cfg), max_batch=1)
        plain = LMRequest("p", tuple([6561] + [6761 + 7 + i for i in range(5)] + [6563]),
                          SamplingParams(greedy=True, fixed_length=20))
        gen = backend.generate(plain)
        await gen.__anext__()  # the plain request holds the only row

        async def empty() -> AsyncIterator[list[int]]:
            return
            yield  # an async generator that yields nothing

        assert [t async for t in backend.generate_streaming(_request("s"), empty())] == []
        assert len(await _collect(gen)) == 19
        await _until(lambda: backend.num_pending() == 0, "the queue to empty")
        assert backend.num_active() == 0
        await backend.close()

    _run(main)


def test_a_stream_cut_at_its_speech_limit_while_text_may_come_is_an_error(lm: CosyVoice3LM) -> None:
    """At `hard_max` with its text still open the utterance cannot speak the rest: an error
    after the tokens made, not a quiet end that drops the text."""
    async def main() -> list[int]:
        backend = TorchLMBackend(lm, unified_vocab(lm.cfg))
        req = BistreamRequest("L", PROMPT_TEXT, PROMPT_SPEECH, SamplingParams(greedy=True),
                              LengthLimits(fixed_ratio=3.0, hard_max=30))
        got: list[int] = []

        async def open_text() -> AsyncIterator[list[int]]:
            for i in range(40):
                yield [200 + i]
            await asyncio.Event().wait()  # more may come: never closed

        with pytest.raises(SpeechLimitReached, match="limit of 30 speech tokens"):
            async for t in backend.generate_streaming(req, open_text()):
                got.append(t)
        await backend.close()
        return got

    assert len(_run(main)) == 30
