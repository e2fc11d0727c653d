"""`VLLMBackend.generate_streaming` driven on the CPU against a small model of vLLM
0.26's streaming-input semantics, with the real tiny LM and the real logits
processor (`RASBatchState`). vLLM itself cannot run here; `SimLLM` reproduces what
its source does to a resumable request (file:line in the docstrings), including the
two ways it was seen or feared to go wrong on the GPU:

* `deliver_params=False`: later chunks reach the processor with the first chunk's
  params (what the H200 failure was first taken for);
* `async_leak=True`: what async scheduling really does -- one more step after the
  fill stop, whose token is streamed, and fill kept in the context.

Both must raise instead of producing audio; the normal path must equal the
uncached torch reference token for token.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from engine.backends.base import SamplingParams
from engine.backends.ras_logits import RASBatchState
from engine.backends.vllm_backend import VLLMBackend
from engine.bistream import BistreamRequest, LengthLimits, SpeechLimitReached
from engine.models.config import ModelConfig
from engine.models.lm import END_OF_PROMPT_ID, CosyVoice3LM, init_random_, unified_vocab
from test_bistream_backend import reference


@pytest.fixture(scope="module")
def lm() -> CosyVoice3LM:
    torch.set_num_threads(1)
    return init_random_(CosyVoice3LM(ModelConfig.tiny().lm), seed=0).eval()


class SimLLM:
    """One resumable request at a time, synchronous scheduler (vLLM 0.26).

    * a chunk's prompt is appended after the previous chunk's outputs minus its last
      sampled token (scheduler.py `_update_request_as_session`, 1286-1327);
    * the worker removes the row and re-adds it with the chunk's params, the whole
      context as prompt ids and an emptied output list (gpu_model_runner.py
      `_update_streaming_request` 1603-1636, gpu_input_batch.py 312-336, 513-527);
    * stop rules: min_tokens, stop_token_ids, and the FIRST chunk's max_tokens,
      counted per chunk (sched/utils.py `check_stop` 94-130);
    * the end of the input generator finishes the request (async_llm.py 470-490).
    """

    def __init__(self, lm: CosyVoice3LM, *, deliver_params: bool = True, async_leak: bool = False,
                 async_scheduling: bool = False, max_model_len: int | None = None) -> None:
        self.lm = lm
        self.max_model_len = max_model_len  # sched/utils.py `check_stop`: FINISHED_LENGTH_CAPPED
        self.vocab = unified_vocab(lm.cfg)
        self.deliver_params = deliver_params
        self.async_leak = async_leak
        self.vllm_config = SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=async_scheduling))
        self.chunks = 0
        self.requests = 0

    @torch.inference_mode()
    def _sample(self, proc: RASBatchState, ids: list[int]) -> int:
        hidden = self.lm(torch.tensor([ids]))[0, -1]
        text_cols = torch.zeros(self.vocab.size - self.vocab.speech_vocab_size)
        logits = torch.cat([self.lm.speech_logits(hidden).float(), text_cols])[None]
        return int(torch.argmax(proc.apply(logits)[0]))

    @staticmethod
    def _out(toks: list[int], finished: bool = False, reason: str | None = None) -> Any:
        return SimpleNamespace(outputs=[SimpleNamespace(token_ids=toks, finish_reason=reason)], finished=finished)

    async def generate(self, inputs: AsyncIterator[Any], base: Any, rid: str) -> AsyncIterator[Any]:
        self.requests += 1
        proc = RASBatchState()
        it = inputs.__aiter__()
        context: list[int] = []
        first: Any = None
        chunk = await anext(it, None)
        while chunk is not None:
            self.chunks += 1
            params = chunk.sampling_params
            if first is None:
                first = params
            elif not self.deliver_params:
                params = first
            context += chunk.prompt["prompt_token_ids"]
            outputs: list[int] = []
            proc.update([(0, params, list(context), outputs)], [0] if self.chunks > 1 else [], [])
            while True:
                tok = self._sample(proc, context + outputs)
                outputs.append(tok)
                stop = len(outputs) >= params.min_tokens and tok in (params.stop_token_ids or ())
                capped = self.max_model_len is not None and len(context) + len(outputs) >= self.max_model_len
                stop = stop or len(outputs) >= first.max_tokens or capped
                # A resumable request that stops pauses for more input: `finished` stays False.
                yield self._out([tok], reason=("length" if capped else "stop") if stop else None)
                if stop:
                    break
            nxt = await anext(it, None)
            if self.async_leak and nxt is not None:
                # The step scheduled before the stop was seen: it feeds the stop token,
                # samples under the old params, streams that token, and the stop token's
                # position counts as computed, so it stays in the context.
                leaked = self._sample(proc, context + outputs)
                yield self._out([leaked])
                context += outputs
            else:
                context += outputs[:-1]
            chunk = nxt
        yield self._out([], finished=True)

    async def abort(self, rid: str) -> None:
        return None

    def shutdown(self) -> None:
        return None


class SimBackend(VLLMBackend):
    """VLLMBackend with vLLM's two constructors replaced by plain objects."""

    def _chunk_params(self, kwargs: dict[str, Any]) -> Any:
        return SimpleNamespace(**{"min_tokens": 0, "stop_token_ids": None, "extra_args": None, **kwargs})

    def _streaming_input(self, ids: list[int], params: Any) -> Any:
        return SimpleNamespace(prompt={"prompt_token_ids": ids}, sampling_params=params)


def _backend(lm: CosyVoice3LM, **sim: Any) -> tuple[SimBackend, SimLLM]:
    backend = SimBackend("/nonexistent", unified_vocab(lm.cfg))
    backend._llm = SimLLM(lm, **sim)
    return backend, backend._llm


async def _paced(arrivals: list[list[int]], gate: asyncio.Event | None = None, gate_at: int = 0) -> AsyncIterator[list[int]]:
    for i, a in enumerate(arrivals):
        if gate is not None and i == gate_at:
            await gate.wait()
        yield a


def _request(ratio: float = 2.0, speech: tuple[int, ...] = tuple(range(40, 63))) -> BistreamRequest:
    return BistreamRequest("r", (100, END_OF_PROMPT_ID, 102, 103), speech, SamplingParams(greedy=True),
                           LengthLimits(fixed_ratio=ratio))


def _collect(backend: SimBackend, req: BistreamRequest, arrivals: list[list[int]], pause_after: int | None = None,
             gate_at: int = 0) -> list[int]:
    async def main() -> list[int]:
        gate = asyncio.Event()
        got: list[int] = []
        src = _paced(arrivals, gate if pause_after is not None else None, gate_at=gate_at)
        async for tok in backend.generate_streaming(req, src):
            got.append(tok)
            if pause_after is not None and len(got) >= pause_after:
                gate.set()
        return got

    return asyncio.run(asyncio.wait_for(main(), timeout=60))


@pytest.mark.parametrize("speech", [tuple(range(40, 63)), (), tuple(range(40, 70))])
def test_stream_equals_torch_reference(lm: CosyVoice3LM, speech: tuple[int, ...]) -> None:
    """23 / 0 / 30 prompt speech tokens: first fill after 7 / 15 / 15 samples."""
    req = _request(ratio=2.0, speech=speech)
    arrivals = [[200 + i] for i in range(26)]
    backend, sim = _backend(lm)
    got = _collect(backend, req, arrivals)
    expected, _ = reference(lm, req, arrivals)
    assert got == expected and len(got) >= 52  # fixed length, or what the streaming part already made
    assert sim.chunks >= 3  # really several resumable chunks, not one request
    assert backend.num_active() == 0


def test_stream_with_a_text_pause(lm: CosyVoice3LM) -> None:
    """Text stops after 10 tokens (enough for the prompt speech and the first run of 7)
    until the first run's speech came out: the request pauses for text between chunks
    (WAITING_FOR_STREAMING_REQ in vLLM) and resumes with the same result."""
    req = _request(ratio=3.0)
    arrivals = [[300 + i] for i in range(17)]
    backend, _ = _backend(lm)
    assert _collect(backend, req, arrivals, pause_after=7, gate_at=10) == reference(lm, req, arrivals)[0]


def test_later_chunk_params_not_delivered_raise(lm: CosyVoice3LM) -> None:
    backend, sim = _backend(lm, deliver_params=False)
    with pytest.raises(RuntimeError, match="does not fit its context"):
        _collect(backend, _request(), [[200 + i] for i in range(26)])
    assert sim.chunks == 2 and backend.num_active() == 0


def test_async_scheduling_leak_raises(lm: CosyVoice3LM) -> None:
    """The H200 failure: the leaked token is taken for the next run's first token;
    the next chunk then arrives with fill in its context and the processor refuses it."""
    req = _request()
    arrivals = [[200 + i] for i in range(26)]
    expected, _ = reference(lm, req, arrivals)
    backend, _ = _backend(lm, async_leak=True)
    got: list[int] = []

    async def main() -> None:
        async for tok in backend.generate_streaming(req, _paced(arrivals)):
            got.append(tok)

    with pytest.raises(RuntimeError, match="does not fit its context"):
        asyncio.run(asyncio.wait_for(main(), timeout=60))
    assert got[:7] == expected[:7]  # the first run (23 prompt speech -> 7 + fill) was right
    assert len(got) <= 8  # at most the leaked token got out before the refusal


def test_async_scheduling_engine_is_refused(lm: CosyVoice3LM) -> None:
    backend, sim = _backend(lm, async_scheduling=True)
    with pytest.raises(RuntimeError, match="async_scheduling=False"):
        _collect(backend, _request(), [[200 + i] for i in range(10)])
    assert sim.chunks == 0


def test_cosyvoice2_stream_equals_torch_reference() -> None:
    """CosyVoice2 has three reserved rows (eos, an unused one, fill): the id the processor
    draws on a desync must be the unused one, not fill, or every fill raised."""
    from engine.backends.vllm_backend import bistream_spec, desync_id, eos_id
    from engine.models.cv2_config import cv2_model_config
    from engine.models.cv2_lm import Qwen2LM

    lm = init_random_(Qwen2LM(cv2_model_config("tiny").lm), seed=0).eval()
    vocab = unified_vocab(lm.cfg)
    assert (eos_id(vocab), desync_id(vocab), bistream_spec(vocab).fill) == (6561, 6562, 6563)
    req = BistreamRequest("r", (100, 101, 102), tuple(range(40, 63)), SamplingParams(greedy=True),
                          LengthLimits(fixed_ratio=2.0))
    arrivals = [[200 + i] for i in range(26)]
    backend, sim = _backend(lm)  # type: ignore[arg-type]
    got = _collect(backend, req, arrivals)
    assert got == reference(lm, req, arrivals)[0] and len(got) >= 52  # type: ignore[arg-type]
    assert sim.chunks >= 3 and backend.num_active() == 0


def test_a_run_cut_by_max_model_len_raises_instead_of_hanging(lm: CosyVoice3LM) -> None:
    """vLLM caps a request at max_model_len; a resumable one then pauses for input, and
    without the run's fill token the client never sent any: the utterance hung for good."""
    backend, sim = _backend(lm, max_model_len=70)
    with pytest.raises(RuntimeError, match="max_model_len"):
        _collect(backend, _request(ratio=None), [[200 + i] for i in range(60)])  # type: ignore[arg-type]
    assert backend.num_active() == 0


def test_a_stream_without_text_starts_no_request(lm: CosyVoice3LM) -> None:
    """No text at all: nothing to say, and no vLLM request (vLLM would have started one
    from the base params, aborted only after its first output)."""
    backend, sim = _backend(lm)
    assert _collect(backend, _request(), []) == []
    assert sim.chunks == 0 and sim.requests == 0 and backend.num_active() == 0


def test_a_stream_cut_at_its_speech_limit_while_text_may_come_raises(lm: CosyVoice3LM) -> None:
    """As on the torch backend: at `hard_max` with the text still open the rest of it would
    go unspoken, so the stream raises after its tokens instead of ending quietly."""
    req = BistreamRequest("r", (100, END_OF_PROMPT_ID, 102, 103), tuple(range(40, 63)), SamplingParams(greedy=True),
                          LengthLimits(fixed_ratio=3.0, hard_max=20))
    backend, _ = _backend(lm)
    got: list[int] = []

    async def main() -> None:
        async def open_text() -> AsyncIterator[list[int]]:
            for i in range(40):
                yield [200 + i]
            await asyncio.Event().wait()  # more may come: never closed

        async for tok in backend.generate_streaming(req, open_text()):
            got.append(tok)

    with pytest.raises(SpeechLimitReached, match="limit of 20 speech tokens"):
        asyncio.run(asyncio.wait_for(main(), timeout=60))
    assert len(got) == 20 and backend.num_active() == 0


class _EndedBySim(SimLLM):
    """vLLM ending the request itself after `after` tokens (an abort we did not ask for, an
    error in the engine core): its last output is `finished` with that reason."""

    def __init__(self, lm: CosyVoice3LM, after: int, reason: str) -> None:
        super().__init__(lm)
        self.after, self.reason = after, reason

    async def generate(self, inputs: AsyncIterator[Any], base: Any, rid: str) -> AsyncIterator[Any]:
        n = 0
        async for out in super().generate(inputs, base, rid):
            n += len(out.outputs[0].token_ids)
            if n >= self.after:
                yield self._out(out.outputs[0].token_ids, finished=True, reason=self.reason)
                return
            yield out


@pytest.mark.parametrize("reason", ["abort", "error"])
def test_a_stream_vllm_ends_by_itself_raises_instead_of_ending_as_whole_speech(lm: CosyVoice3LM, reason: str) -> None:
    """As `generate` does since a review: a text-in request vLLM finishes mid-run with an
    abort we did not ask for, or an error, is not whole speech; ending quietly, the engine
    delivered the tokens so far as a complete utterance (its last chunk finalized)."""
    backend = SimBackend("/nonexistent", unified_vocab(lm.cfg))
    backend._llm = _EndedBySim(lm, after=12, reason=reason)
    with pytest.raises(RuntimeError, match=reason):
        _collect(backend, _request(), [[200 + i] for i in range(26)])
    assert backend.num_active() == 0


class _SlotsSim(SimLLM):
    """`slots` requests at a time (vLLM's max_num_seqs); one more waits for a slot. A
    resumable request keeps its slot while it pauses for input: vLLM's scheduler counts
    its WAITING_FOR_STREAMING_REQ requests against max_num_seqs (scheduler.py 670-674)."""

    def __init__(self, lm: CosyVoice3LM, slots: int) -> None:
        super().__init__(lm)
        self.slots = asyncio.Semaphore(slots)

    async def generate(self, inputs: AsyncIterator[Any], base: Any, rid: str) -> AsyncIterator[Any]:
        async with self.slots:
            async for out in super().generate(inputs, base, rid):
                yield out


async def _until(condition: Any, turns: int = 10_000) -> None:
    """Let the loop's other tasks run until `condition()` holds (turns of the loop, no clock)."""
    for _ in range(turns):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("the condition never held")


@pytest.mark.parametrize("slots", [1, 2])
def test_streams_paused_on_text_in_every_slot_block_on_text_not_on_the_lm(lm: CosyVoice3LM, slots: int) -> None:
    """A text-in stream paused for its client's text keeps its vLLM slot. With every slot
    so held, a request behind them gets no token until the text comes: `blocked_on_text`
    says so, or the engine's LM watch took the silence for a stuck LM and the gateway
    exited. With a slot free the other request runs and nothing is blocked."""
    vocab = unified_vocab(lm.cfg)
    backend = SimBackend("/nonexistent", vocab, max_num_seqs=slots)
    backend._llm = _SlotsSim(lm, slots)
    paused = _request(ratio=3.0)  # request id "r"
    other = dataclasses.replace(paused, request_id="o")
    arrivals = [[300 + i] for i in range(17)]
    other_text = [[400 + i] for i in range(17)]

    async def main() -> tuple[list[int], list[int], bool, bool]:
        gate, first_run = asyncio.Event(), asyncio.Event()
        got: list[int] = []
        other_got: list[int] = []
        blocked_while_other_ran: list[bool] = []

        async def speak_paused() -> None:
            async for tok in backend.generate_streaming(paused, _paced(arrivals, gate, gate_at=10)):
                got.append(tok)
                if len(got) >= 7:  # the first run (23 prompt speech -> 7 + fill): then it waits for text
                    first_run.set()

        async def speak_other() -> None:
            async for tok in backend.generate_streaming(other, _paced(other_text)):
                other_got.append(tok)
                blocked_while_other_ran.append(backend.blocked_on_text())

        a = asyncio.create_task(speak_paused())
        await first_run.wait()
        b = asyncio.create_task(speak_other())
        if slots == 1:
            await _until(backend.blocked_on_text)
            blocked = True
            assert other_got == []  # behind the paused stream: no token while its text is missing
        else:
            await _until(lambda: len(other_got) > 0)
            blocked = backend.blocked_on_text()
        gate.set()
        await asyncio.gather(a, b)
        return got, other_got, blocked, any(blocked_while_other_ran)

    got, other_got, blocked, blocked_later = asyncio.run(asyncio.wait_for(main(), timeout=60))
    assert blocked == (slots == 1) and not blocked_later
    assert got == reference(lm, paused, arrivals)[0] and other_got == reference(lm, other, other_text)[0]
    assert not backend.blocked_on_text() and backend.num_active() == 0
