"""The streaming engine end to end on CPU with the tiny random-weight model."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.chunking import ChunkSchedule
from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import EngineError
from engine.models.flow import FlowChunk
from engine.token2wav import ChunkJob
from engine.types import AudioChunk, SessionOptions, UtteranceError
from engine.wavio import read_wav
from helpers import InjectedFault, assert_same_audio

ROOT = Path(__file__).resolve().parent.parent
SPF = 480  # samples per mel frame at 24 kHz
TOKEN_SAMPLES = 2 * SPF  # 25 Hz tokens -> 960 samples each


def run(model_dir: Path, fn, **cfg):
    # Fixed chunk sizes unless a test asks otherwise: sized from the measured load
    # (`engine.first_chunk`) or from how far ahead of its listener a chunk is
    # (`engine.chunk_patience_s`), a short utterance on a slow CPU becomes one chunk.
    cfg.setdefault("initial_hop_max", 0)
    cfg.setdefault("chunk_patience_s", 0.0)

    async def main():
        engine = await Engine.create(EngineConfig(model_dir=model_dir, device="cpu", lm_backend="torch", **cfg))
        try:
            return await fn(engine)
        finally:
            await engine.close()

    return asyncio.run(main())


async def default_voice(engine: Engine):
    wav, sr = read_wav(ROOT / "assets" / "default.wav")
    return await engine.prepare_voice("default", wav, sr, (ROOT / "assets" / "default.txt").read_text().strip())


def final_chunk_job(stage, voice, seed: int) -> ChunkJob:
    """A one-chunk utterance of 20 of the voice's own tokens, shuffled by `seed`, for the stage."""
    g = torch.Generator().manual_seed(seed)
    new = voice.speech_tokens[torch.randperm(voice.num_tokens, generator=g)[:20]]
    chunk = FlowChunk(tokens=torch.cat([voice.speech_tokens, new]), prompt_feat=voice.speech_feat,
                      embedding=voice.embedding, num_prompt_tokens=voice.num_tokens,
                      out_start=voice.num_tokens, finalize=True)
    return ChunkJob(flow=chunk, hift_stream=stage.new_stream(), speed=1.0, chunk_index=0,
                    is_cancelled=lambda: False)


async def collect(sess):
    out: list[AudioChunk | UtteranceError] = []
    async for ev in sess.events():
        out.append(ev)
    return out


def test_voice_features_are_aligned(tiny_model_dir):
    async def fn(engine):
        v = await default_voice(engine)
        assert v.speech_feat.shape == (2 * v.num_tokens, 80)
        assert v.embedding.shape == (192,)
        assert 100 < v.num_tokens < 200  # 6.6 s at 25 Hz, cut to the mel length
        return v

    run(tiny_model_dir, fn, warmup=False)


@pytest.mark.parametrize("fill_padding,stages,lead_ms", [(False, (), 0.0), (True, (), 0.0), (True, ("cpu", "cpu"), 0.0),
                                                          (False, (), 5.0)],
                         ids=["fixed_chunks", "fill_padding", "fill_padding_two_stages", "pipelined_rounds"])
def test_eight_concurrent_sessions_stream_ordered_complete_audio(tiny_model_dir, fill_padding, stages, lead_ms):
    """Also with `flow_fill_padding`, on one stage or a `StagePool` (which queues a copy of
    each job): chunks that grow in their batch still deliver every token's audio exactly
    once, in order. Whether a chunk grows here depends on timing; growth itself is asserted
    deterministically by `test_chunks_grown_into_batch_padding_stay_exact` and the stage's
    tests (`test_stage_policy`)."""
    texts = [f"Session {i} says hello to the world." for i in range(8)]

    async def fn(engine):
        voice = await default_voice(engine)
        sessions = []
        for i, text in enumerate(texts):
            s = engine.open_session(voice, SessionOptions(tokens_per_text_token=3.0, seed=i))
            u1 = await s.submit(text)
            u2 = await s.submit("And a second sentence.")
            await s.finish()
            sessions.append((s, u1, u2))
        results = await asyncio.gather(*(collect(s) for s, _, _ in sessions))
        return [(r, s.utterance_stats(u1), s.utterance_stats(u2), u1, u2) for (s, u1, u2), r in zip(sessions, results)], engine.stats()

    results, stats = run(tiny_model_dir, fn, flow_fill_padding=fill_padding, stage_devices=stages,
                         stage_pipeline_lead_ms=lead_ms)
    assert stats.max_batch_size > 1, "chunks of different sessions must share flow/vocoder batches"
    assert fill_padding or stats.flow_grown_chunks == 0
    # Pipelined: every round after the first measured one came back as a pipelined round's.
    assert (stats.stage_pipelined_batches > 0) == (lead_ms > 0)
    for events, st1, st2, u1, u2 in results:
        assert all(isinstance(e, AudioChunk) for e in events), events
        ids = [e.utterance_id for e in events]
        # all of utterance 1, then all of utterance 2
        assert ids == [u1] * ids.count(u1) + [u2] * ids.count(u2)
        for uid, st in ((u1, st1), (u2, st2)):
            chunks = [e for e in events if e.utterance_id == uid]
            assert chunks[-1].is_last and not any(c.is_last for c in chunks[:-1])
            assert [c.chunk_index for c in chunks] == list(range(len(chunks)))
            starts = np.cumsum([0] + [c.pcm.size for c in chunks[:-1]])
            assert [c.start_sample for c in chunks] == list(starts)
            total = sum(c.pcm.size for c in chunks)
            # every generated token became exactly two mel frames of audio
            assert total == len(st.speech_tokens) * TOKEN_SAMPLES
            pcm = np.concatenate([c.pcm for c in chunks])
            assert np.isfinite(pcm).all() and np.abs(pcm).max() <= 1.0 and np.abs(pcm).max() > 0
        # Streamed, not one block (a short utterance may grow into one chunk with fill_padding).
        assert fill_padding or len(chunks) >= 2


def test_streaming_equals_whole_utterance(tiny_model_dir):
    """Chunk-by-chunk flow + incremental vocoder == one whole-utterance pass (aligned schedule, unbounded window)."""

    async def fn(engine):
        voice = await default_voice(engine)
        s = engine.open_session(voice, SessionOptions(tokens_per_text_token=6.0, seed=3, initial_hop=0))
        uid = await s.submit("A longer sentence, so that there are several chunks to compare.")
        await s.finish()
        events = await collect(s)
        st = s.utterance_stats(uid)
        flow, hift = engine.model.flow, engine.model.hift
        with torch.inference_mode():
            mel = flow.inference(
                torch.tensor(st.speech_tokens).unsqueeze(0),
                voice.speech_tokens.unsqueeze(0),
                voice.speech_feat.unsqueeze(0),
                voice.embedding.unsqueeze(0),
                streaming=True,
                finalize=True,
            )
            whole = hift.inference(mel if mel.shape[1] == 80 else mel.transpose(1, 2), finalize=True)
        return events, whole.reshape(-1).numpy()

    events, whole = run(tiny_model_dir, fn, flow_left_context=-1, warmup=False)
    streamed = np.concatenate([e.pcm for e in events])
    assert len(events) >= 3
    assert streamed.shape == whole.shape
    err = np.abs(streamed - whole).max()
    assert err < 1e-3, f"max abs difference {err}"


def test_the_next_chunk_is_queued_while_the_stage_runs_this_one(tiny_model_dir):
    """Once the stage took chunk k and the LM has chunk k+1's tokens, chunk k+1 is queued,
    before chunk k's audio is back: here the stage's worker holds chunk 0's batch until
    chunk 1 is queued (waiting for chunk 0's audio first would never get there). Audio
    stays whole and in order: one stage runs an utterance's chunks one batch after the
    other."""
    queued_next = threading.Event()
    order: list[tuple[int, bool]] = []  # (chunk index, whether the one before it had its audio)

    async def fn(engine):
        voice = await default_voice(engine)
        # `_launch`: the rounds' work, pipelined (the default) or not.
        submit, launch = engine.stage.submit, engine.stage._launch
        futures: list[asyncio.Future] = []

        def spy(job):
            order.append((job.chunk_index, bool(futures) and futures[-1].done()))
            if job.chunk_index == 1:
                queued_next.set()
            futures.append(submit(job))
            return futures[-1]

        def held(batch, *args, **kwargs):
            if any(j.chunk_index == 0 for j in batch):
                assert queued_next.wait(timeout=30), "chunk 1 was not queued while chunk 0 ran"
            return launch(batch, *args, **kwargs)

        engine.stage.submit, engine.stage._launch = spy, held
        s = engine.open_session(voice, SessionOptions(tokens_per_text_token=6.0, seed=3, initial_hop=0))
        uid = await s.submit("A longer sentence, so that there are several chunks to compare.")
        await s.finish()
        return await collect(s), s.utterance_stats(uid)

    events, st = run(tiny_model_dir, fn, flow_left_context=-1, warmup=False)
    assert order[:2] == [(0, False), (1, False)]
    assert [e.chunk_index for e in events] == list(range(len(order))) and events[-1].is_last
    assert sum(e.pcm.size for e in events) == st.num_speech_tokens * TOKEN_SAMPLES


def test_a_planned_first_chunk_is_announced_to_the_stage_before_it_is_queued(tiny_model_dir):
    """Once the first chunk's size is planned and the chunker waits for its tokens, the
    stage learns when it should come (`AudioStage.expect_first_chunk`, for the hold of
    `first_chunk_hold_ms`): for that utterance's stream, from the LM's measured rate, and
    the expectation is gone once the chunk is queued. With `first_chunk_hold_share` the
    round it would miss comes with it (the stage's prediction for its planned size)."""
    calls: list[tuple[str, object, float]] = []
    rounds: list[float | None] = []

    async def fn(engine):
        voice = await default_voice(engine)
        expect, submit = engine.stage.expect_first_chunk, engine.stage.submit
        # As under a burst's load: the planner takes more tokens than the initial hop.
        engine.first_chunks.first_hop = lambda sched, *args, **kwargs: sched.initial_hop + 8

        def spy_expect(stream, due, round_s=None, urgent=True):
            calls.append(("expect", stream, due - time.monotonic()))
            rounds.append(round_s)
            expect(stream, due, round_s, urgent)

        def spy_submit(job):
            calls.append(("submit", job.hift_stream, job.chunk_index))
            future = submit(job)
            assert job.hift_stream not in engine.stage._coming
            return future

        engine.stage.expect_first_chunk, engine.stage.submit = spy_expect, spy_submit
        s = engine.open_session(voice, SessionOptions(tokens_per_text_token=6.0, seed=3))
        await s.submit("A longer sentence, so that there are several chunks to compare.")
        await s.finish()
        return await collect(s)

    events = run(tiny_model_dir, fn, initial_hop_max=40, first_chunk_hold_ms=20, first_chunk_hold_share=0.2)
    assert events[-1].is_last
    assert len(rounds) == 1 and rounds[0] is not None and rounds[0] > 0  # the warm-up measured rounds
    kinds = [c[0] for c in calls]
    assert kinds[0] == "expect" and kinds[1] == "submit" and calls[1][2] == 0, calls[:3]
    assert calls[0][1] is calls[1][1]  # the first chunk's own stream
    assert 0 < calls[0][2] < 60  # 8 tokens more at the LM's measured rate
    assert kinds.count("expect") == 1  # later chunks are not first chunks


def test_a_later_segments_first_chunk_is_announced_as_not_urgent(tiny_model_dir):
    """The announcement says whether the listener will be waiting for the chunk when it
    comes (`ChunkJob.urgent`, for the hold of `first_chunk_burst_hold_ms`): the first
    utterance's first chunk is; a later utterance's, behind the earlier one's seconds of
    audio still to play, is not."""
    announced: list[bool] = []
    queued: list[bool] = []

    async def fn(engine):
        voice = await default_voice(engine)
        expect, submit = engine.stage.expect_first_chunk, engine.stage.submit
        engine.first_chunks.first_hop = lambda sched, *args, **kwargs: sched.initial_hop + 8

        def spy_expect(stream, due, round_s=None, urgent=True):
            announced.append(urgent)
            expect(stream, due, round_s, urgent)

        def spy_submit(job):
            if job.chunk_index == 0:
                queued.append(job.urgent)
            return submit(job)

        engine.stage.expect_first_chunk, engine.stage.submit = spy_expect, spy_submit
        s = engine.open_session(voice, SessionOptions(tokens_per_text_token=6.0, seed=3))
        await s.submit("A longer sentence, so that there are several chunks to compare.")
        await s.submit("And a second one after it.")
        await s.finish()
        return await collect(s)

    events = run(tiny_model_dir, fn, initial_hop_max=40)
    assert events[-1].is_last
    assert announced == queued == [True, False]


def test_with_hold_refresh_a_first_chunk_is_announced_again_halfway(tiny_model_dir):
    """`hold_refresh` (`POST /debug/planner`, `first_chunk_hold_refresh`): the planned first
    chunk is announced once more before it is queued, for its own stream; later chunks are
    not announced."""
    calls: list[tuple[str, object, float]] = []

    async def fn(engine):
        voice = await default_voice(engine)
        assert engine.first_chunks.hold_refresh is False  # off by default
        engine.first_chunks.tune({"hold_refresh": True})
        expect, submit = engine.stage.expect_first_chunk, engine.stage.submit
        engine.first_chunks.first_hop = lambda sched, *args, **kwargs: sched.initial_hop + 8

        def spy_expect(stream, due, round_s=None, urgent=True):
            calls.append(("expect", stream, due))
            expect(stream, due, round_s, urgent)

        def spy_submit(job):
            calls.append(("submit", job.hift_stream, job.chunk_index))
            return submit(job)

        engine.stage.expect_first_chunk, engine.stage.submit = spy_expect, spy_submit
        s = engine.open_session(voice, SessionOptions(tokens_per_text_token=6.0, seed=3))
        await s.submit("A longer sentence, so that there are several chunks to compare.")
        await s.finish()
        return await collect(s)

    events = run(tiny_model_dir, fn, initial_hop_max=40)
    assert events[-1].is_last
    kinds = [c[0] for c in calls]
    assert kinds[:3] == ["expect", "expect", "submit"] and calls[2][2] == 0, calls[:4]
    assert calls[0][1] is calls[1][1] is calls[2][1]
    assert kinds.count("expect") == 2


def test_cancel_stops_chunks_and_aborts_the_lm_request(tiny_model_dir):
    async def fn(engine):
        voice = await default_voice(engine)
        s = engine.open_session(voice, SessionOptions(tokens_per_text_token=40.0, seed=1))
        uid = await s.submit("This utterance is long enough to be cancelled in the middle of it.")
        events = s.events()
        first = await events.__anext__()
        assert isinstance(first, AudioChunk) and not first.is_last
        assert engine.backend.num_active() == 1
        await s.cancel(uid)
        # at once: the LM slot is free and no queued chunk of it survives
        assert engine.backend.num_active() == 0
        assert not any(j.is_cancelled() for j in engine.stage._pending)
        chunks_before = engine.stage.stats.chunks
        uid2 = await s.submit("Next turn.", options=SessionOptions(tokens_per_text_token=3.0, seed=2))
        await s.finish()
        rest = [e async for e in events]
        st = s.utterance_stats(uid)
        return first, rest, uid, uid2, st, engine.stage.stats.chunks - chunks_before

    first, rest, uid, uid2, st, chunks_after = run(tiny_model_dir, fn)
    assert all(e.utterance_id == uid2 for e in rest), "no chunk of the cancelled utterance after cancel"
    assert rest and rest[-1].is_last
    assert st.finished_at is None  # the cancelled utterance never finalised
    assert len(st.speech_tokens) == 0
    # after the cancel only the next turn's chunks were computed, plus at most the one
    # chunk of the cancelled utterance that was already inside a running batch
    assert len(rest) <= chunks_after <= len(rest) + 1


def test_abort_ends_the_session_when_the_lm_abort_fails(tiny_model_dir):
    """A backend whose abort raises (vLLM's engine core dead) must still leave an aborted
    session ended: every utterance's task cancelled, events() ended, the engine's count
    down, and no more text taken."""
    async def fn(engine):
        voice = await default_voice(engine)
        s = engine.open_session(voice, SessionOptions(tokens_per_text_token=40.0, seed=1))
        await s.submit("This utterance is long enough to be aborted in the middle of it.")
        await s.submit("And a second one queued behind it.")
        events = s.events()
        first = await events.__anext__()
        assert isinstance(first, AudioChunk) and engine.stats().active_sessions == 1

        async def dead(request_id: str) -> None:
            raise RuntimeError("engine core died")

        engine.backend.abort = dead
        tasks = [u.task for u in s._utts.values()]
        await s.abort()
        rest = [e async for e in events]
        _, running = await asyncio.wait(tasks, timeout=60)  # a bound for a broken build, not a sync
        with pytest.raises(EngineError):
            await s.submit("too late")
        return rest, len(running), engine.stats().active_sessions

    rest, running, active = run(tiny_model_dir, fn, warmup=False)
    assert all(isinstance(e, AudioChunk) for e in rest)
    assert running == 0 and active == 0


def test_bad_text_fails_only_that_utterance(tiny_model_dir):
    async def fn(engine):
        voice = await default_voice(engine)
        s = engine.open_session(voice, SessionOptions(tokens_per_text_token=2.0, seed=0))
        bad = await s.submit("   ")
        good = await s.submit("Fine.")
        await s.finish()
        return await collect(s), bad, good

    events, bad, good = run(tiny_model_dir, fn, warmup=False)
    assert isinstance(events[0], UtteranceError) and events[0].utterance_id == bad and events[0].code == "empty_text"
    assert events[-1].utterance_id == good and events[-1].is_last


def test_submit_after_finish_is_refused(tiny_model_dir):
    async def fn(engine):
        voice = await default_voice(engine)
        s = engine.open_session(voice)
        await s.finish()
        with pytest.raises(EngineError):
            await s.submit("late")
        return await collect(s)

    assert run(tiny_model_dir, fn, warmup=False) == []


def test_the_chunker_wakes_per_chunk_not_per_token(tiny_model_dir, monkeypatch):
    """The LM consumer wakes the chunker only once its next chunk's tokens exist: a handful
    of schedule checks per chunk, not one per generated token (each a task switch on the
    event loop every session shares)."""
    from engine.chunking import ChunkSchedule

    checks = []
    ready = ChunkSchedule.ready
    monkeypatch.setattr(ChunkSchedule, "ready", lambda self, n: checks.append(n) or ready(self, n))

    async def fn(engine):
        voice = await default_voice(engine)
        s = engine.open_session(voice, SessionOptions(tokens_per_text_token=8.0, seed=3))
        uid = await s.submit("A longer sentence, so that there are several chunks to look at here.")
        await s.finish()
        await collect(s)
        return s.utterance_stats(uid)

    st = run(tiny_model_dir, fn, warmup=False)
    assert st.num_speech_tokens > 100 and st.chunks >= 4
    assert len(checks) <= 3 * st.chunks + 2 < st.num_speech_tokens / 4


def test_chunks_grown_into_batch_padding_stay_exact(tiny_model_dir):
    """`ChunkJob.grow` (the stage's `flow_fill_padding`) through the engine: each chunk,
    queued once the LM is done, grows by up to 40 tokens to a 25-token boundary, or takes
    the rest as the last chunk. Audio stays that of one whole-utterance pass (aligned
    schedule, unbounded window), in fewer chunks than the schedule alone makes."""

    async def fn(engine):
        voice = await default_voice(engine)
        s = engine.open_session(voice, SessionOptions(tokens_per_text_token=6.0, seed=3, initial_hop=0))
        grown: list[int] = []
        submit = engine.stage.submit
        later: list[asyncio.Task] = []

        def submit_grown(job):
            # The engine waits on job.future and job.started; the stage gets the chunk, grown,
            # once every token exists (growth is then deterministic).
            loop = asyncio.get_running_loop()
            job.future, job.started = loop.create_future(), loop.create_future()

            async def grow_then_run():
                (utt,) = s._utts.values()
                await utt.lm_done.wait()
                inner = dataclasses.replace(job)
                if inner.grow is not None:  # None: queued as the last chunk already
                    before = len(inner.flow.tokens) - (0 if inner.flow.finalize else 3)
                    chunk = inner.grow(40)
                    if chunk is not None:
                        inner.flow = chunk
                    grown.append(len(inner.flow.tokens) - (0 if inner.flow.finalize else 3) - before)
                pcm = submit(inner)
                job.started.set_result(await inner.started)
                job.future.set_result(await pcm)

            later.append(asyncio.create_task(grow_then_run()))
            return job.future

        engine.stage.submit = submit_grown
        uid = await s.submit("A longer sentence, so that there are several chunks to compare.")
        await s.finish()
        events = await collect(s)
        st = s.utterance_stats(uid)
        with torch.inference_mode():
            mel = engine.model.flow.inference(
                torch.tensor(st.speech_tokens).unsqueeze(0), voice.speech_tokens.unsqueeze(0),
                voice.speech_feat.unsqueeze(0), voice.embedding.unsqueeze(0), streaming=True, finalize=True)
            whole = engine.model.hift.inference(mel if mel.shape[1] == 80 else mel.transpose(1, 2), finalize=True)
        return events, whole.reshape(-1).numpy(), grown, st, voice.num_tokens

    events, whole, grown, st, P = run(tiny_model_dir, fn, flow_left_context=-1, warmup=False)
    tokens = [e.pcm.size // TOKEN_SAMPLES for e in events]
    assert sum(tokens) == st.num_speech_tokens and events[-1].is_last
    assert len(grown) >= len(events) - 1 and all(0 <= g <= 40 for g in grown) and sum(grown) > 0
    schedule = ChunkSchedule(P, initial_hop=0)  # the same utterance without growth
    ungrown, left = 0, st.num_speech_tokens
    while left > schedule.next_hop() + schedule.lookahead:
        left -= schedule.next_hop()
        schedule.advance(schedule.next_hop())
        ungrown += 1
    assert len(events) < ungrown + 1
    streamed = np.concatenate([e.pcm for e in events])
    assert streamed.shape == whole.shape
    assert np.abs(streamed - whole).max() < 1e-3


def test_a_segment_behind_seconds_of_audio_is_cut_in_fewer_chunks(tiny_model_dir):
    """With `chunk_patience_s` a session's second utterance, queued behind seconds of the
    first's audio still to play, waits for its LM's end and goes as one chunk (its tokens
    fit in max_hop), while the first's opening chunk, awaited in silence, goes as the
    schedule cuts it. Chunks that end on the 25-token grid decode exactly (unbounded left
    context), so the audio is the audio without patience."""
    first_text = ("A much longer first sentence, with enough words in it that its speech plays "
                  "for many seconds while the next one is being made.")
    second_text = "Then a short one."

    async def fn(engine, options=SessionOptions(tokens_per_text_token=6.0, seed=3)):
        voice = await default_voice(engine)
        s = engine.open_session(voice, options)
        uids = [await s.submit(first_text), await s.submit(second_text)]
        await s.finish()
        events = await collect(s)
        return events, [s.utterance_stats(u) for u in uids], engine.stats()

    # initial_hop 0: every chunk ends on the grid (the first one included), so all decode exactly.
    runs = {p: run(tiny_model_dir, fn, flow_left_context=-1, warmup=False, initial_hop=0, chunk_patience_s=p)
            for p in (0.0, 1.0)}
    (plain, plain_st, plain_eng), (patient, patient_st, patient_eng) = runs[0.0], runs[1.0]
    first, second = patient_st
    assert first.num_speech_tokens * 40 > 6000 and second.num_speech_tokens <= 100  # ms of audio; one max_hop
    assert second.chunks == 1 and plain_st[1].chunks >= 2
    assert patient_eng.patient_chunks >= 1 and patient_eng.patient_tokens >= second.num_speech_tokens
    assert plain_eng.patient_chunks == 0 and plain_eng.first_chunks == 2
    assert patient_eng.first_chunks == 1  # the second utterance's chunk was not awaited: not a first audio
    for a, b in zip(plain_st, patient_st):
        assert a.speech_tokens == b.speech_tokens
    for events in (plain, patient):
        assert sum(e.pcm.size for e in events) == sum(st.num_speech_tokens for st in patient_st) * TOKEN_SAMPLES
    assert_same_audio(np.concatenate([e.pcm for e in plain]), np.concatenate([e.pcm for e in patient]))

    # A request that sets its own schedule gets it as asked: no chunk cut by timing.
    own = SessionOptions(tokens_per_text_token=6.0, seed=3, initial_hop=0)
    _, own_st, own_eng = run(tiny_model_dir, lambda engine: fn(engine, own), flow_left_context=-1, warmup=False,
                             chunk_patience_s=1.0)
    assert own_eng.patient_chunks == 0 and [st.chunks for st in own_st] == [st.chunks for st in plain_st]


def test_a_flow_batch_that_fails_runs_its_other_chunks_apart(tiny_model_dir):
    """A chunk whose flow call fails (an injected fault on the stage's worker thread, for one
    voice) no longer fails its batch-mates: the batch runs again chunk by chunk, before any
    of it reached the vocoder, and the others get the audio they get without the fault."""
    async def fn(engine):
        good = await default_voice(engine)
        wav, sr = read_wav(ROOT / "assets" / "default.wav")
        bad = await engine.prepare_voice("bad", np.ascontiguousarray(wav[::-1]), sr, "A voice read backwards.")
        stage = engine.stage

        def job(voice, seed: int) -> ChunkJob:
            return final_chunk_job(stage, voice, seed)

        async def together(jobs: list[ChunkJob]) -> list:
            futures = [stage.submit(j) for j in jobs]  # no await between: one batch
            return await asyncio.gather(*futures, return_exceptions=True)

        clean = await together([job(good, 1), job(good, 2)])
        calls: list[int] = []
        decode = stage._decode

        def failing(chunks, entries, keys):
            if any(torch.equal(c.embedding, bad.embedding) for c in chunks):
                calls.append(len(chunks))
                raise InjectedFault("a flow call with the bad voice")
            return decode(chunks, entries, keys)

        stage._decode = failing
        try:
            mixed = await together([job(good, 1), job(bad, 3), job(good, 2)])
        finally:
            del stage._decode
        assert calls == [3, 1], calls  # the batch, then the bad chunk on its own
        assert stage.stats.batches_retried_apart == 1 and engine.stats().stage_batches_retried_apart == 1
        assert isinstance(mixed[1], InjectedFault), mixed[1]
        assert_same_audio(mixed[0], clean[0])
        assert_same_audio(mixed[2], clean[1])

    run(tiny_model_dir, fn, warmup=False)


def test_a_vocoder_step_that_fails_runs_its_other_chunks_apart(tiny_model_dir):
    """A fault in a batch's vocoder step, after the step had moved its streams (the
    excitation is made, the audio not yet), fails only the chunk that causes it: the
    streams are put back, each chunk's step runs again alone from the mel its flow made
    (the flow does not run again), and the others get the audio they get without the
    fault. Without the streams put back, the retried steps would read each mel twice."""
    async def fn(engine):
        voice = await default_voice(engine)
        stage = engine.stage
        look = stage.flow.pre_lookahead_len

        def utterance(seed: int) -> tuple[list[FlowChunk], object]:
            g = torch.Generator().manual_seed(seed)
            new = voice.speech_tokens[torch.randperm(voice.num_tokens, generator=g)[:24]]
            tokens = torch.cat([voice.speech_tokens, new])
            start = voice.num_tokens

            def chunk(end: int, out_start: int, final: bool) -> FlowChunk:
                return FlowChunk(tokens=tokens[: start + end], prompt_feat=voice.speech_feat,
                                 embedding=voice.embedding, num_prompt_tokens=start, out_start=start + out_start,
                                 finalize=final)

            return [chunk(10 + look, 0, False), chunk(24, 10, True)], stage.new_stream()

        async def rounds(utterances, fault_in=None) -> list[list]:
            out = []
            for index in range(2):
                jobs = [ChunkJob(flow=chunks[index], hift_stream=stream, speed=1.0, chunk_index=index,
                                 is_cancelled=lambda: False) for chunks, stream in utterances]
                if index == 1 and fault_in is not None:
                    fault_in()
                futures = [stage.submit(j) for j in jobs]  # no await between: one batch
                out.append(await asyncio.gather(*futures, return_exceptions=True))
            return out

        clean = await rounds([utterance(s) for s in (1, 2, 3)])
        faulty = [utterance(s) for s in (1, 2, 3)]
        bad_stream = faulty[1][1]
        steps: list[int] = []
        flow_rows: list[int] = []
        advance, decode = stage.hift._advance_audio, stage._decode

        def failing_audio(streams, *args):
            steps.append(len(streams))
            if any(st is bad_stream for st in streams):
                raise InjectedFault("a vocoder step with the bad stream")
            return advance(streams, *args)

        def counting(chunks, entries, keys):
            flow_rows.append(len(chunks))
            return decode(chunks, entries, keys)

        def arm() -> None:
            stage.hift._advance_audio = failing_audio
            stage._decode = counting

        try:
            mixed = await rounds(faulty, arm)
        finally:
            del stage.hift._advance_audio, stage._decode
        assert steps == [3, 1, 1, 1], steps  # the batch, then each chunk alone
        assert sum(flow_rows) == 3, flow_rows  # each chunk's flow ran once
        assert stage.stats.batches_retried_apart == 1 and engine.stats().stage_batches_retried_apart == 1
        assert isinstance(mixed[1][1], InjectedFault), mixed[1][1]
        for i in (0, 2):
            assert_same_audio(mixed[0][i], clean[0][i])
            assert_same_audio(mixed[1][i], clean[1][i])

    run(tiny_model_dir, fn, warmup=False)


def test_cross_lingual_length_limits_count_the_system_prefix(tiny_model_dir):
    """The official cross-lingual call carries "You are a helpful assistant.<|endofprompt|>"
    in the text to speak, so its min/max speech tokens count those tokens; zero-shot's
    prompt (the voice's transcript) is not counted."""
    async def fn(engine):
        voice = await default_voice(engine)
        seen: dict[str, object] = {}
        generate = engine.backend.generate

        for mode in ("zero_shot", "cross_lingual"):
            async def recording(request, mode=mode):
                seen[mode] = request.sampling
                return
                yield  # an async generator that ends at once: the utterance has no tokens

            engine.backend.generate = recording
            try:
                s = engine.open_session(voice, SessionOptions(mode=mode, seed=1))
                await s.submit("A short sentence to speak.")
                await s.finish()
                await collect(s)
            finally:
                engine.backend.generate = generate
        text = len(engine.text_ids("A short sentence to speak."))
        prefix = len(engine.lm_prefix(voice, SessionOptions(mode="cross_lingual"))[0])
        lm = engine.model.config.lm
        assert seen["zero_shot"].max_tokens == int(text * lm.max_token_text_ratio)
        assert seen["cross_lingual"].max_tokens == int((text + prefix) * lm.max_token_text_ratio)
        assert seen["cross_lingual"].min_tokens == int((text + prefix) * lm.min_token_text_ratio)

    run(tiny_model_dir, fn, warmup=False)


def test_an_lm_failure_behind_patience_is_an_error_not_a_shorter_utterance(tiny_model_dir):
    """With `chunk_patience_s` a session's second utterance, queued behind seconds of the
    first's audio, waits for its LM's end to go as one chunk. An LM that raises after 40 of
    its tokens has not ended: the utterance must end with the LM's error, not as a finished
    40-token utterance."""
    def tokens(n: int, fail_after: int | None = None):
        async def generate(request):
            for i in range(n):
                if i == fail_after:
                    raise RuntimeError("the LM died")
                yield 100 + i % 50
        return generate

    async def fn(engine):
        voice = await default_voice(engine)
        scripts = iter([tokens(300), tokens(60, fail_after=40)])
        engine.backend.generate = lambda request: next(scripts)(request)
        s = engine.open_session(voice, SessionOptions(seed=0))
        first, second = await s.submit("first"), await s.submit("second")
        await s.finish()
        events = await collect(s)
        return {u: [e for e in events if e.utterance_id == u] for u in (first, second)}, engine.stats()

    by_utterance, stats = run(tiny_model_dir, fn, warmup=False, chunk_patience_s=1.0)
    first, second = by_utterance.values()
    assert sum(e.pcm.size for e in first) == 300 * TOKEN_SAMPLES and first[-1].is_last
    assert isinstance(second[-1], UtteranceError)
    assert not any(isinstance(e, AudioChunk) and e.is_last for e in second)
    assert sum(e.pcm.size for e in second if isinstance(e, AudioChunk)) < 40 * TOKEN_SAMPLES


def test_a_segment_without_letters_is_read_like_the_text_before_it(tiny_model_dir) -> None:
    """No language hint: "42" alone could be read in either grammar; after Chinese text it
    is read as Chinese, after English as English, and alone the normaliser decides."""
    async def fn(engine):
        voice = await default_voice(engine)
        opts = SessionOptions(tokens_per_text_token=2.0, seed=1)
        got = {}
        for first in ("你好。", "Hello there.", None):
            s = engine.open_session(voice, opts)
            if first is not None:
                await s.submit(first)
            uid = await s.submit("42")
            got[first] = s._utts[uid].language
            await s.abort()
        hinted = engine.open_session(voice, dataclasses.replace(opts, language="en"))
        await hinted.submit("你好。")
        uid = await hinted.submit("42")
        assert hinted._utts[uid].language == "en"  # a hint always wins
        await hinted.abort()
        return got

    assert run(tiny_model_dir, fn, warmup=False) == {"你好。": "zh", "Hello there.": "en", None: None}


def test_a_segment_whose_speech_cannot_fit_the_lm_context_is_refused_or_cut_with_an_error(tiny_model_dir):
    """vLLM stops a request quietly at its context window ("length"). A segment whose least
    speech cannot fit beside the voice's prompt is refused (`text_too_long`, the LM never
    asked); one whose most can run past the window gets the room left as its cap, and a
    stream that reaches it ends with `speech_too_long`, not as a whole utterance. Below the
    model's own maximum, or stopping before the cap, nothing changes."""
    text = "A sentence of a few words to speak."
    seen: list[object] = []

    def scripted(count):
        async def generate(request):
            seen.append(request)
            for i in range(count(request)):
                yield 100 + i % 50
        return generate

    async def speak(engine, voice, model_len, count):
        engine.config = dataclasses.replace(engine.config, vllm_max_model_len=model_len)
        engine.backend.generate = scripted(count)
        s = engine.open_session(voice, SessionOptions(seed=0))
        await s.submit(text)
        await s.finish()
        return await collect(s)

    async def fn(engine):
        voice = await default_voice(engine)
        lm = engine.model.config.lm
        n_text = len(engine.text_ids(text))
        least, most = int(n_text * lm.min_token_text_ratio), int(n_text * lm.max_token_text_ratio)
        everything = await speak(engine, voice, 100_000, lambda r: r.sampling.max_tokens)
        prompt = len(seen[-1].prompt)
        asked = len(seen)
        refused = await speak(engine, voice, prompt + least - 1, lambda r: 1)
        assert len(seen) == asked  # never reached the LM
        room = least + 5
        cut = await speak(engine, voice, prompt + room, lambda r: r.sampling.max_tokens)
        capped = seen[-1].sampling
        stopped = await speak(engine, voice, prompt + room, lambda r: r.sampling.max_tokens - 1)
        return everything, refused, cut, capped, stopped, room, most

    everything, refused, cut, capped, stopped, room, most = run(tiny_model_dir, fn, warmup=False)
    assert everything[-1].is_last and sum(e.pcm.size for e in everything) == most * TOKEN_SAMPLES
    assert [(e.code, "context" in e.message) for e in refused] == [("text_too_long", True)]
    assert capped.max_tokens == room and capped.fixed_length is None
    assert isinstance(cut[-1], UtteranceError) and cut[-1].code == "speech_too_long"
    assert not any(isinstance(e, AudioChunk) and e.is_last for e in cut)
    assert stopped[-1].is_last and sum(e.pcm.size for e in stopped) == (room - 1) * TOKEN_SAMPLES


def test_a_failed_chunk_takes_its_utterances_queued_chunk_with_it(tiny_model_dir):
    """The chunker queues an utterance's next chunk as the stage takes the one before. When
    that one fails, the next goes with it (dropped at the stage's next round), instead of a
    flow and vocoder pass for an utterance that has ended, on a vocoder stream that never
    got the chunk before it."""
    async def fn(engine):
        voice = await default_voice(engine)
        stage = engine.stage
        launch, submit = stage._launch, stage.submit  # a round's work, pipelined or not
        ran: list[list[int]] = []
        queued = threading.Event()  # chunk 1 is on the stage: chunk 0 may fail now
        second: list[ChunkJob] = []

        def failing(batch, *args, **kwargs):
            ran.append([j.chunk_index for j in batch])
            if any(j.chunk_index == 0 for j in batch):
                queued.wait(60)
                raise InjectedFault("the flow failed")
            return launch(batch, *args, **kwargs)

        def spying(job):
            future = submit(job)
            if job.chunk_index == 1:
                second.append(job)
                queued.set()
            return future

        stage._launch, stage.submit = failing, spying
        s = engine.open_session(voice, SessionOptions(seed=3, initial_hop=0, tokens_per_text_token=6.0))
        await s.submit("A longer sentence, so that there are several chunks to compare.")
        await s.finish()
        events = await collect(s)
        await asyncio.wait({second[0].future})  # run or dropped
        return events, ran, second[0], stage.stats.dropped

    events, ran, second, dropped = run(tiny_model_dir, fn, warmup=False, flow_left_context=-1)
    assert [type(e) for e in events] == [UtteranceError]
    assert ran == [[0]] and second.future.cancelled() and dropped == 1


@pytest.mark.parametrize("failure", ["lm", "stage", "empty_stream"])
def test_a_failed_utterance_frees_its_vocoder_stream_without_a_garbage_collection(tiny_model_dir, failure):
    """An utterance that failed (its LM raised, a chunk of it failed on the stage, its
    chunker refused it) kept its vocoder stream alive in a reference cycle (its error's
    traceback held the chunker's frames, which held the task or the chunk future holding
    that error) that only a full garbage collection freed: until then the stage counted it
    in `live_utterances` (the first-chunk planner's load) and kept its vocoder state.
    Freed by reference counting alone once its task is over (logging off: a captured
    record's traceback would keep the frames too)."""
    async def fn(engine):
        voice = await default_voice(engine)
        if failure == "lm":
            async def generate(request):
                for i in range(60):
                    if i == 40:
                        raise InjectedFault("the LM died")
                    yield 100 + i % 50

            engine.backend.generate = generate
        elif failure == "stage":
            launch = engine.stage._launch

            def failing(batch, *args, **kwargs):
                if any(j.chunk_index == 1 for j in batch):
                    raise InjectedFault("the flow failed")
                return launch(batch, *args, **kwargs)

            engine.stage._launch = failing
        gc.collect()
        gc.disable()
        logging.disable(logging.CRITICAL)
        try:
            s = engine.open_session(voice, SessionOptions(seed=1, initial_hop=0, tokens_per_text_token=6.0))
            if failure == "empty_stream":
                uid, feed = await s.submit_stream()
                feed.close()
            else:
                uid = await s.submit("A longer sentence, so that there are several chunks to compare.")
            task = s._utts[uid].task
            await s.finish()
            events = await collect(s)
            await asyncio.wait({task})
            return events, engine.stage.live_utterances()
        finally:
            logging.disable(logging.NOTSET)
            gc.enable()

    events, live = run(tiny_model_dir, fn, warmup=False, flow_left_context=-1)
    assert isinstance(events[-1], UtteranceError)
    assert live == 0


def test_an_lm_stream_that_ends_cancelled_is_an_error_not_a_shorter_utterance(tiny_model_dir):
    """An LM token stream that raises CancelledError itself (not the utterance cancelled:
    the engine cancels its LM task only after the chunk loop) ended the utterance quietly
    with the audio of the tokens so far, a last chunk that was not marked last and no
    error: speech cut short, reported as whole. It ends with an error."""
    async def generate(request):
        for i in range(60):
            if i == 40:
                raise asyncio.CancelledError()
            yield 100 + i % 50

    async def fn(engine):
        voice = await default_voice(engine)
        engine.backend.generate = generate
        s = engine.open_session(voice, SessionOptions(seed=0))
        await s.submit("A sentence to speak.")
        await s.finish()
        return await collect(s)

    events = run(tiny_model_dir, fn, warmup=False)
    assert isinstance(events[-1], UtteranceError), events[-1]
    assert not any(isinstance(e, AudioChunk) and e.is_last for e in events)


def test_a_draining_or_failed_engine_refuses_sessions_with_warm_up_off_too(tiny_model_dir):
    """The drain on SIGTERM turns `ready` off; an engine whose LM or stage failed is not
    ready either. Sessions were refused only with warm-up on."""
    async def fn(engine):
        voice = await default_voice(engine)
        await engine.open_session(voice).abort()  # ready: opens
        engine.ready = False  # draining
        with pytest.raises(EngineError) as draining:
            engine.open_session(voice)
        engine.ready = True
        engine._lm_stall = "no LM token for 120 s"
        with pytest.raises(EngineError) as failed:
            engine.open_session(voice)
        engine._lm_stall = None
        return draining.value, failed.value

    draining, failed = run(tiny_model_dir, fn, warmup=False)
    assert draining.code == failed.code == "not_ready"
    assert "draining" in str(draining) and "no LM token for 120 s" in str(failed)


def test_a_stored_voice_is_warmed_once_however_many_sessions_open_meanwhile(tiny_model_dir, monkeypatch):
    """A voice featurised before this process started is warmed in the background when a
    session first opens with it; twenty sessions opened before that finished started twenty
    warm-ups of the same prompt length."""
    async def fn(engine):
        voice = await default_voice(engine)
        stored = dataclasses.replace(voice, voice_id="stored", speech_tokens=voice.speech_tokens[:-1],
                                     speech_feat=voice.speech_feat[:-2])
        assert stored.num_tokens not in engine._warmed_prompts
        release = asyncio.Event()
        calls: list[str] = []

        async def warm(v):
            calls.append(v.voice_id)
            await release.wait()
            engine._warmed_prompts.add(v.num_tokens)
            return 0

        monkeypatch.setattr(engine, "warm_voice", warm)
        sessions = [engine.open_session(stored) for _ in range(20)]
        release.set()
        await asyncio.gather(*list(engine._background))
        sessions.append(engine.open_session(stored))  # warmed by then: no more
        for s in sessions:
            await s.abort()
        return calls, engine._warming

    calls, warming = run(tiny_model_dir, fn, warmup=False)
    assert calls == ["stored"] and not warming


def test_a_chunk_cancelled_under_its_utterance_ends_it_with_an_error(tiny_model_dir):
    """A chunk's future cancelled by the stage (closing under it), not by the utterance's
    own cancel, ended the utterance with neither its last chunk nor an error."""
    async def fn(engine):
        voice = await default_voice(engine)
        submit = engine.stage.submit

        def closing(job):
            future = submit(job)
            job.future.cancel()
            return future

        engine.stage.submit = closing
        s = engine.open_session(voice, SessionOptions(seed=0))
        await s.submit("Hello there.")
        await s.finish()
        return await collect(s)

    events = run(tiny_model_dir, fn, warmup=False)
    assert [(type(e), getattr(e, "code", None)) for e in events] == [(UtteranceError, "engine_closed")]


@pytest.mark.parametrize("prompt_cache", [False, True])
def test_the_last_chunk_with_full_attention_as_the_official_streaming_inference(tiny_model_dir, prompt_cache):
    """The official streaming inference decodes an utterance's last chunk with full attention
    (streaming=False). With `flow_final_full_attention` the last chunk runs that way, in a
    flow call of its own (past the prompt cache, whose keys are block-causal); every earlier
    chunk's audio is unchanged, the last one's differs."""
    tokens = [int(t) for t in torch.randint(0, 6561, (90,), generator=torch.Generator().manual_seed(1))]

    def speak(full: bool):
        async def fn(engine):
            voice = await default_voice(engine)
            calls: list[tuple[bool, list[bool]]] = []
            decode = engine.stage.flow.decode_chunks

            def spying(chunks, streaming=True, solver=None):
                calls.append((streaming, [c.finalize for c in chunks]))
                return decode(chunks, streaming=streaming, solver=solver)

            engine.stage.flow.decode_chunks = spying

            async def generate(request):
                for t in tokens:
                    yield t

            engine.backend.generate = generate
            s = engine.open_session(voice, SessionOptions(seed=0))
            await s.submit("Some text.")
            await s.finish()
            return await collect(s), calls
        return run(tiny_model_dir, fn, warmup=False, flow_left_context=-1, initial_hop=0,
                   flow_final_full_attention=full, flow_prompt_cache=prompt_cache)

    (plain, plain_calls), (full, full_calls) = speak(False), speak(True)
    assert [e.pcm.size for e in plain] == [e.pcm.size for e in full] and len(plain) >= 3
    for a, b in zip(plain[:-1], full[:-1]):
        assert_same_audio(a.pcm, b.pcm)
    assert np.abs(plain[-1].pcm - full[-1].pcm).max() > 1e-4
    assert all(streaming for streaming, _ in plain_calls)
    assert full_calls[-1] == (False, [True]) and all(streaming for streaming, _ in full_calls[:-1])
    if prompt_cache:  # the earlier chunks decoded from the cache, not by decode_chunks
        assert plain_calls == [] and full_calls == [(False, [True])]


def test_a_failed_chunks_error_holds_no_frames_and_a_rounds_bookkeeping_error_ends_no_stage(tiny_model_dir):
    """A failed chunk's future held its exception, whose traceback held the batch (jobs,
    futures, tensors) in a cycle that only a full garbage collection freed. And an error in
    a round's bookkeeping after its compute ended the stage's loop for good, the round's
    chunks never answered."""
    async def fn(engine):
        voice = await default_voice(engine)
        stage = engine.stage

        def job(seed: int) -> ChunkJob:
            return final_chunk_job(stage, voice, seed)

        decode = stage._decode

        def failing(chunks, entries, keys):
            raise InjectedFault("the flow failed")

        stage._decode = failing
        failed = stage.submit(job(1))
        await asyncio.wait({failed})
        del stage._decode
        assert stage._decode == decode
        error = failed.exception()

        observe = stage.rounds.observe

        def broken(*args):
            raise RuntimeError("a bookkeeping bug")

        stage.rounds.observe = broken
        first = await asyncio.wait_for(stage.submit(job(2)), 60)
        stage.rounds.observe = observe
        second = await asyncio.wait_for(stage.submit(job(3)), 60)
        return error, first, second

    error, first, second = run(tiny_model_dir, fn, warmup=False)
    assert isinstance(error, InjectedFault) and error.__traceback__ is None
    assert first.size > 0 and second.size > 0


@pytest.mark.parametrize("speed", [1.0, 0.5, 0.25])
def test_the_planner_learns_the_vocoders_holdback_whatever_the_speed(tiny_model_dir, speed):
    """A first chunk comes the vocoder's holdback (8 mel frames, 0.16 s) short of its tokens'
    audio, at any speed; at a speed other than 1 the mel stretch keeps back a frame more, which
    is the stretch's, not the vocoder's: learnt as holdback, one slow session would shorten
    every later session's planned audio (0.18-0.20 s at 0.5-0.25 before)."""

    async def fn(engine):
        voice = await default_voice(engine)
        s = engine.open_session(voice, SessionOptions(seed=0, initial_hop=10, speed=speed, tokens_per_text_token=3.0))
        await s.submit("Hello there, this is a longer sentence.")
        await s.finish()
        events = await collect(s)
        return events, engine.first_chunks.holdback_s

    events, holdback = run(tiny_model_dir, fn, warmup=False)
    assert events[-1].is_last
    assert holdback == pytest.approx(0.16, abs=1e-6)


@pytest.mark.parametrize("speed", [0.2, 4.5, 20.0])
def test_a_speed_outside_the_served_range_is_refused_up_front(speed):
    with pytest.raises(ValueError, match="speed"):
        SessionOptions(speed=speed)
    assert SessionOptions(speed=0.25).speed == 0.25 and SessionOptions(speed=4.0).speed == 4.0
