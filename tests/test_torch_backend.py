"""The batched torch LM backend: concurrency, limits, abort/close, error isolation."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest
import torch

from engine.backends.base import LMRequest, SamplingParams
from engine.backends.torch_backend import TorchLMBackend
from engine.models.config import ModelConfig
from engine.models.lm import CosyVoice3LM, init_random_, unified_vocab

T = TypeVar("T")
EOS = 6562


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny model: threading overhead dominates
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    return init_random_(CosyVoice3LM(ModelConfig.tiny().lm), seed=0).state_dict()


@pytest.fixture()
def lm(weights: dict[str, torch.Tensor]) -> CosyVoice3LM:
    # A fresh module per test: some tests patch its methods.
    model = CosyVoice3LM(ModelConfig.tiny().lm)
    model.load_state_dict(weights)
    return model.eval()


def _backend(lm: CosyVoice3LM, max_batch: int = 64) -> TorchLMBackend:
    return TorchLMBackend(lm, unified_vocab(lm.cfg), max_batch=max_batch)


def _req(rid: str, prompt_len: int = 6, **sampling: object) -> LMRequest:
    prompt = tuple([6561] + [6761 + 100 + i for i in range(prompt_len - 2)] + [6563])
    return LMRequest(rid, prompt, SamplingParams(**sampling))  # type: ignore[arg-type]


async def _collect(backend: TorchLMBackend, req: LMRequest) -> list[int]:
    return [t async for t in backend.generate(req)]


def _run(fn: Callable[[], Awaitable[T]]) -> T:
    return asyncio.run(asyncio.wait_for(fn(), timeout=60))


def _bias_logits(lm: CosyVoice3LM, ids: slice | int, delta: float) -> None:
    """Shift some speech logits so stop handling is observable with random weights."""
    plain = lm.speech_logits

    def biased(hidden: torch.Tensor) -> torch.Tensor:
        out = plain(hidden).clone()
        out[..., ids] += delta
        return out

    lm.speech_logits = biased  # type: ignore[method-assign]


def test_concurrent_requests_complete_with_correct_counts(lm: CosyVoice3LM) -> None:
    async def main() -> tuple[list[list[int]], list[list[int]], int]:
        backend = _backend(lm)
        reqs = [_req(f"r{i}", prompt_len=3 + i, greedy=True, fixed_length=5 + 2 * i) for i in range(8)]
        together = await asyncio.gather(*(_collect(backend, r) for r in reqs))
        active_after = backend.num_active()
        alone = []
        for r in reqs:  # one at a time: batch of one
            alone.append(await _collect(backend, r))
        await backend.close()
        return together, alone, active_after

    together, alone, active_after = _run(main)
    assert [len(t) for t in together] == [5 + 2 * i for i in range(8)]
    assert all(0 <= tok < 6561 for t in together for tok in t)
    assert together == alone  # batching does not change greedy results
    assert active_after == 0


def test_more_requests_than_max_batch(lm: CosyVoice3LM) -> None:
    async def main() -> list[list[int]]:
        backend = _backend(lm, max_batch=2)
        reqs = [_req(f"r{i}", fixed_length=4, seed=i) for i in range(5)]
        out = await asyncio.gather(*(_collect(backend, r) for r in reqs))
        await backend.close()
        return out

    assert [len(t) for t in _run(main)] == [4] * 5


def test_seeded_ras_is_reproducible_and_seed_dependent(lm: CosyVoice3LM) -> None:
    async def main() -> list[list[int]]:
        backend = _backend(lm)
        out = await asyncio.gather(
            _collect(backend, _req("a", fixed_length=30, seed=7)),
            _collect(backend, _req("b", fixed_length=30, seed=7)),
            _collect(backend, _req("c", fixed_length=30, seed=8)),
        )
        await backend.close()
        return out

    a, b, c = _run(main)
    assert a == b and a != c


def test_abort_stops_request_and_frees_slot(lm: CosyVoice3LM) -> None:
    async def main() -> tuple[list[int], int, int, list[int]]:
        backend = _backend(lm)
        long_stream = backend.generate(_req("long", fixed_length=10_000))
        other = asyncio.create_task(_collect(backend, _req("other", fixed_length=20)))
        got = [await long_stream.__anext__() for _ in range(3)]
        before = backend.num_active()
        await backend.abort("long")
        after = backend.num_active()
        rest = [t async for t in long_stream]  # ends at once, nothing more
        other_tokens = await other
        await backend.close()
        return got + rest, before, after, other_tokens

    tokens, before, after, other_tokens = _run(main)
    assert len(tokens) == 3
    assert after == before - 1
    assert len(other_tokens) == 20


def test_aclose_and_cancel_free_the_slot(lm: CosyVoice3LM) -> None:
    async def main() -> tuple[int, int, int]:
        backend = _backend(lm)
        stream = backend.generate(_req("closed", fixed_length=10_000))
        await stream.__anext__()
        await stream.aclose()
        after_close = backend.num_active()

        started = asyncio.Event()

        async def consume() -> None:
            async for _ in backend.generate(_req("cancelled", fixed_length=10_000)):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        during = backend.num_active()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        after_cancel = backend.num_active()
        # the loop is still healthy afterwards
        assert len(await _collect(backend, _req("next", fixed_length=3))) == 3
        await backend.close()
        return after_close, during, after_cancel

    assert _run(main) == (0, 1, 0)


def test_stop_ids_min_tokens_max_tokens_and_fixed_length(lm: CosyVoice3LM) -> None:
    _bias_logits(lm, EOS, 100.0)  # eos overwhelmingly likely

    async def main() -> list[list[int]]:
        backend = _backend(lm)
        out = await asyncio.gather(
            _collect(backend, _req("stop", seed=1)),
            _collect(backend, _req("min", seed=1, min_tokens=5)),
            _collect(backend, _req("greedy-min", greedy=True, min_tokens=3)),
            _collect(backend, _req("fixed", seed=1, fixed_length=7)),
        )
        await backend.close()
        return out

    stop, min5, greedy_min3, fixed7 = _run(main)
    assert stop == []  # the stop id ends the stream and is not yielded
    assert len(min5) == 5 and all(t < 6561 for t in min5)
    assert len(greedy_min3) == 3
    assert len(fixed7) == 7 and all(t < 6561 for t in fixed7)


def test_max_tokens_caps_the_stream(lm: CosyVoice3LM) -> None:
    _bias_logits(lm, slice(6561, None), -100.0)  # stop ids practically impossible
    async def main() -> tuple[list[int], list[int]]:
        backend = _backend(lm)
        capped = await _collect(backend, _req("cap", seed=3, max_tokens=4))
        empty = await _collect(backend, _req("zero", seed=3, max_tokens=0))
        await backend.close()
        return capped, empty

    capped, empty = _run(main)
    assert len(capped) == 4 and empty == []


def test_model_errors_fail_affected_requests_and_loop_survives(lm: CosyVoice3LM) -> None:
    plain_forward = lm.forward
    failures = {"prefill_len": 9, "decode_once": True}

    def flaky(ids: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        if ids.shape[1] == failures["prefill_len"]:
            raise RuntimeError("prefill boom")
        if ids.shape[1] == 1 and ids.shape[0] == 2 and failures["decode_once"]:
            failures["decode_once"] = False
            raise RuntimeError("decode boom")
        return plain_forward(ids, *args, **kwargs)

    lm.forward = flaky  # type: ignore[method-assign]

    async def main() -> tuple[list[object], list[int], int]:
        backend = _backend(lm)
        results = await asyncio.gather(
            _collect(backend, _req("bad-prompt", prompt_len=9, fixed_length=5)),
            _collect(backend, _req("x", fixed_length=50, seed=1)),
            _collect(backend, _req("y", fixed_length=50, seed=2)),
            return_exceptions=True,
        )
        after = await _collect(backend, _req("after", fixed_length=6, seed=3))
        active = backend.num_active()
        await backend.close()
        return list(results), after, active

    results, after, active = _run(main)
    assert isinstance(results[0], RuntimeError) and "prefill" in str(results[0])
    # x and y share the batched decode step that failed
    assert all(isinstance(r, RuntimeError) and "decode" in str(r) for r in results[1:])
    assert len(after) == 6
    assert active == 0


def test_duplicate_request_id_is_rejected(lm: CosyVoice3LM) -> None:
    async def main() -> None:
        backend = _backend(lm)
        first = backend.generate(_req("same", fixed_length=100))
        await first.__anext__()
        with pytest.raises(ValueError):
            await _collect(backend, _req("same", fixed_length=1))
        await first.aclose()
        assert len(await _collect(backend, _req("same", fixed_length=2))) == 2
        await backend.close()

    _run(main)
