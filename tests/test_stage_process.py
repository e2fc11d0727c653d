"""The audio stage in a process of its own (`engine.stage_process`), on CPU."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import multiprocessing
import os
import signal
import threading
import weakref

import numpy as np
import pytest
import torch

from bench.stage_pipe import main as stage_pipe_main
from bench.ws_load import main as ws_load_main
from engine.config import EngineConfig
from engine.engine import spawn_stages
from engine.first_chunk import RoundTimes
from engine.stage_build import graph_policy
from engine.models.flow import FlowChunk
from engine.mps import MPS_PERCENT_ENV, MPS_PRIORITY_ENV, mps_client_env
from engine.stage_pool import StagePool
from engine.stage_process import RemoteStage, RemoteStream, StageProcessError, _StageServer
from engine.token2wav import ChunkJob, DeviceWorker
from engine.types import AudioChunk, SessionOptions, UtteranceError
from helpers import assert_same_audio
from engine.wavio import read_wav
from tests.test_engine import ROOT, collect, default_voice, run
from tests.test_stage_pool import _speak_four


def test_a_stage_process_gives_the_same_audio_as_the_stage_in_process(tiny_model_dir):
    async def remote(engine):
        stage = engine.stage
        assert isinstance(stage, RemoteStage) and stage._process.is_alive()
        # No SM share asked for; below normal, the default, so vLLM's decode goes first.
        assert stage.mps_env == {MPS_PRIORITY_ENV: "1"}
        assert stage.round_estimate(RemoteStream(-1), 100) is None  # no round yet
        pcm = await _speak_four(engine)
        # The engine's copy of the round times learnt from the child's rounds, and its
        # stats are the child's.
        assert stage.rounds.observed == stage.stats.batches > 0
        assert stage.round_estimate(RemoteStream(-1), 100) > 0
        assert engine.stats().chunks == stage.stats.chunks > 0
        return pcm, stage._process

    single = run(tiny_model_dir, _speak_four, warmup=False)
    pcm, process = run(tiny_model_dir, remote, warmup=False, stage_process=True)
    assert not process.is_alive() and process.exitcode == 0  # closed with the engine
    assert len(pcm) == len(single) == 4
    for a, b in zip(single, pcm):
        assert_same_audio(a, b)


def test_two_stage_devices_run_one_stage_process_each(tiny_model_dir, monkeypatch):
    """`stage_devices` with `stage_process`: a `StagePool` of two stages, each in its own
    process; the utterances are shared out and sound as on one stage in-process. Each
    process is an MPS client with the stage's SM share and priority and nothing else, even
    when this process's environment holds other MPS settings as they spawn (vLLM's, set
    around its engine core's start); this one's environment is as it was."""
    async def pooled(engine):
        pool = engine.stage
        assert isinstance(pool, StagePool) and all(isinstance(s, RemoteStage) for s in pool.stages)
        assert all(s.mps_env == {MPS_PERCENT_ENV: "70", MPS_PRIORITY_ENV: "0"} for s in pool.stages)
        assert os.environ.get(MPS_PERCENT_ENV) == before
        processes = [s._process for s in pool.stages]
        assert len({p.pid for p in processes}) == 2 and all(p.is_alive() for p in processes)
        pcm = await _speak_four(engine)
        per_stage = [s.stats.chunks for s in pool.stages]
        return pcm, per_stage, engine.stats().chunks, processes

    single = run(tiny_model_dir, _speak_four, warmup=False)
    monkeypatch.setenv(MPS_PERCENT_ENV, "30")
    monkeypatch.setenv(MPS_PRIORITY_ENV, "1")
    before = os.environ.get(MPS_PERCENT_ENV)
    pcm, per_stage, total, processes = run(tiny_model_dir, pooled, warmup=False, stage_process=True,
                                           stage_devices=("cpu", "cpu"), stage_mps_thread_percent=70,
                                           stage_mps_priority="normal")
    assert all(n > 0 for n in per_stage) and total == sum(per_stage), per_stage
    assert not any(p.is_alive() for p in processes)
    for a, b in zip(single, pcm):
        assert_same_audio(a, b)


def test_cancelled_utterances_leave_the_stage_process_serving(tiny_model_dir):
    async def fn(engine):
        voice = await default_voice(engine)
        stage = engine.stage
        doomed = engine.open_session(voice, SessionOptions(tokens_per_text_token=6.0, seed=1))
        await doomed.submit("This long sentence is cancelled before its audio is done, " * 3)
        await doomed.finish()
        first = await anext(aiter(doomed.events()))  # one chunk out: the rest is queued or coming
        assert isinstance(first, AudioChunk)
        await doomed.cancel()
        assert all(job.started.done() for job in stage._jobs.values())  # none left queued here
        kept = engine.open_session(voice, SessionOptions(tokens_per_text_token=3.0, seed=2))
        await kept.submit("The next caller is served as before.")
        await kept.finish()
        events = await collect(kept)
        assert events and all(isinstance(e, AudioChunk) for e in events), events
        # Nothing of the cancelled utterance waits here: its queued chunks were dropped,
        # the ones the stage had taken came back and were let go.
        assert not stage._jobs
        return events

    run(tiny_model_dir, fn, warmup=False, stage_process=True)


def test_a_stage_process_that_dies_fails_its_utterances_with_an_error(tiny_model_dir):
    async def fn(engine):
        voice = await default_voice(engine)
        stage = engine.stage
        stage._process.kill()
        session = engine.open_session(voice, SessionOptions(tokens_per_text_token=3.0, seed=3))
        await session.submit("Nobody is left to make this audio.")
        await session.finish()
        events = await asyncio.wait_for(collect(session), 60)  # an error, not a hang
        assert events and isinstance(events[-1], UtteranceError), events
        assert events[-1].code == "engine_error" and "audio stage process" in events[-1].message
        with pytest.raises(StageProcessError, match="exited"):
            stage._check_open()
        # The engine says so: /ready turns 503 with the reason, and no pool places here.
        assert not engine.ready and "audio stage process exited" in (engine.failure or "")

    run(tiny_model_dir, fn, warmup=False, stage_process=True)


def test_a_stage_process_that_stops_answering_is_killed_and_its_utterances_fail(tiny_model_dir):
    """A stage process alive but stuck (SIGSTOP: what a GPU hang looks like from outside)
    is killed by the watchdog once it has been silent for the stall timeout; the utterance
    waiting on it ends with an error that says so, instead of waiting for ever. Before
    that, an idle stage's heartbeats keep it alive through several timeouts."""
    async def fn(engine):
        voice = await default_voice(engine)
        stage = engine.stage
        heard = stage._heard
        await asyncio.sleep(4.0)  # longer than a stall timeout, idle: not a stall
        assert stage.failure is None and stage._process.is_alive()
        assert stage._heard > heard and stage._busy is None  # heartbeats came, from an idle worker
        os.kill(stage._process.pid, signal.SIGSTOP)
        assert engine.stats().stages_failed == 0
        # its last report, as a busy GPU stage would have sent it
        stage.stats = dataclasses.replace(stage.stats, queued=3, context_bytes=1 << 20, prompt_cache_bytes=1 << 20)
        stage.cuda_memory = {"cuda_memory_allocated_bytes": 1 << 30, "cuda_max_memory_allocated_bytes": 2 << 30}
        session = engine.open_session(voice, SessionOptions(tokens_per_text_token=3.0, seed=5))
        await session.submit("Nobody answers for this audio.")
        await session.finish()
        events = await asyncio.wait_for(collect(session), 60)
        assert events and isinstance(events[-1], UtteranceError), events
        assert "stalled (no word from it for" in events[-1].message, events[-1].message
        assert not engine.ready and "stage_stall_timeout_s 2" in (engine.failure or "")
        # what the dead process held it holds no more; the count of failed stages says so
        st = engine.stats()
        assert (st.flow_queue, st.context_bytes, st.prompt_cache_bytes, st.stages_failed) == (0, 0, 0, 1)
        assert stage.cuda_memory == {"cuda_memory_allocated_bytes": 0, "cuda_max_memory_allocated_bytes": 2 << 30}
        await asyncio.to_thread(stage._process.join, 30)
        assert stage._process.exitcode == -signal.SIGKILL

    # Long enough that no real piece of work (a voice's prompt cache on a busy CPU) counts.
    run(tiny_model_dir, fn, warmup=False, stage_process=True, stage_stall_timeout_s=2.0)


def test_a_stopped_stage_process_with_a_full_pipe_is_killed_too(tiny_model_dir):
    """A stopped child no longer reads its pipe, and a long voice's prompt features (0.4 MB)
    fill it: the event loop blocks in the send. The watchdog runs on its own thread, so it
    still kills the child, which breaks the pipe and frees the loop; the utterance ends with
    the stall's reason. (A backstop kills the child after 60 s, so that a watchdog that
    cannot run fails this test instead of hanging the suite.)"""
    async def fn(engine):
        wav, sr = read_wav(ROOT / "assets" / "default.wav")
        text = (ROOT / "assets" / "default.txt").read_text().strip()
        voice = await engine.prepare_voice("long", np.concatenate([wav] * 4), sr, " ".join([text] * 4))
        stage = engine.stage
        os.kill(stage._process.pid, signal.SIGSTOP)
        backstop = threading.Timer(60, os.kill, (stage._process.pid, signal.SIGKILL))
        backstop.start()
        try:
            session = engine.open_session(voice, SessionOptions(tokens_per_text_token=3.0, seed=6))
            await session.submit("Nobody reads this voice.")
            await session.finish()
            events = await asyncio.wait_for(collect(session), 90)
        finally:
            backstop.cancel()
        assert isinstance(events[-1], UtteranceError), events
        assert "stalled (" in events[-1].message and "was killed" in events[-1].message, events[-1].message

    # Long enough that the long voice's prompt cache, built on a busy CPU, is not a stall.
    run(tiny_model_dir, fn, warmup=False, stage_process=True, stage_stall_timeout_s=10.0)


def test_a_stage_process_whose_device_work_never_ends_is_killed(tiny_model_dir):
    """The other half of the watchdog: the process answers (its loop runs), but a heartbeat
    reports one piece of device work running past the timeout (a kernel that never
    returns). Injected as that heartbeat: a real one would need a hung device."""
    async def fn(engine):
        stage = engine.stage
        # Injected as the reader thread would record it, until the watchdog acts: the
        # child's own heartbeats (idle) keep coming in between.
        deadline = asyncio.get_running_loop().time() + 30
        while stage._process.is_alive() and asyncio.get_running_loop().time() < deadline:
            stage._received([("alive", 3.0)])
            await asyncio.sleep(0.01)
        await asyncio.to_thread(stage._process.join, 30)
        assert stage._process.exitcode == -signal.SIGKILL
        await asyncio.wait_for(_until(lambda: stage.failure is not None), 30)  # the reader's EOF
        assert "one piece of its device work has run for" in (stage.failure or ""), stage.failure
        with pytest.raises(StageProcessError, match="stalled"):
            stage._check_open()

    run(tiny_model_dir, fn, warmup=False, stage_process=True, stage_stall_timeout_s=2.0)


async def _until(check) -> None:
    while not check():
        await asyncio.sleep(0.01)


def test_the_device_worker_says_how_long_its_current_work_has_run():
    worker = DeviceWorker()
    try:
        assert worker.busy_for() is None
        began, gate = threading.Event(), threading.Event()
        done = worker.submit(lambda: (began.set(), gate.wait(30))[1])
        assert began.wait(30)
        assert worker.busy_for() >= 0
        gate.set()
        assert done.result(30) is True
        assert worker.busy_for() is None
    finally:
        worker.shutdown(wait=True)


def test_stage_stall_timeout_is_checked_at_configuration(tmp_path):
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="stage_stall_timeout_s must be >= 0"):
            EngineConfig(model_dir=tmp_path, stage_stall_timeout_s=bad)
    assert EngineConfig(model_dir=tmp_path, stage_stall_timeout_s=0).stage_stall_timeout_s == 0


def test_a_stage_process_that_cannot_start_says_why(tiny_model_dir, tmp_path):
    config = EngineConfig(model_dir=tmp_path / "no-model", device="cpu", lm_backend="torch", stage_process=True)

    async def main():
        await RemoteStage.spawn(config, config.resolved_device(), graph_policy(config))

    with pytest.raises(StageProcessError, match="failed to start") as err:
        asyncio.run(main())
    assert "Traceback" in str(err.value) and "no-model" in str(err.value)


def test_a_stage_device_that_cannot_start_stops_the_others(tiny_model_dir):
    """One of `stage_devices` fails (a CUDA device on a machine without one): the start
    fails with its reason and leaves no stage process behind."""
    config = EngineConfig(model_dir=tiny_model_dir, device="cpu", lm_backend="torch", stage_process=True,
                          stage_devices=("cpu", "cuda:0"))

    async def main():
        await spawn_stages(config, torch.device("cpu"))

    with pytest.raises(StageProcessError, match="failed to start"):
        asyncio.run(main())
    assert not multiprocessing.active_children()


def test_stage_process_refuses_what_it_cannot_run(tmp_path):
    assert EngineConfig(model_dir=tmp_path, stage_process=True, flow_fill_padding=True).resolved_stage_process()
    assert EngineConfig(model_dir=tmp_path, stage_process=True).resolved_stage_process()
    # By default: on where the lock is contended (a GPU's loads), where it can run.
    assert not EngineConfig(model_dir=tmp_path, device="cpu").resolved_stage_process()
    assert EngineConfig(model_dir=tmp_path, device="cuda").resolved_stage_process()
    assert EngineConfig(model_dir=tmp_path, device="cuda", stage_devices=("cuda:0", "cuda:1")).resolved_stage_process()
    assert EngineConfig(model_dir=tmp_path, device="cuda", flow_fill_padding=True).resolved_stage_process()
    assert not EngineConfig(model_dir=tmp_path, device="cuda", stage_process=False).resolved_stage_process()
    # An SM share is the stage process's MPS setting: refused without that process.
    with pytest.raises(ValueError, match="stage_mps_thread_percent needs the stage's own process"):
        EngineConfig(model_dir=tmp_path, stage_process=False, stage_mps_thread_percent=70)
    with pytest.raises(ValueError, match="stage_mps_thread_percent must be in 1..100"):
        EngineConfig(model_dir=tmp_path, stage_mps_thread_percent=0)
    with pytest.raises(ValueError, match="stage_mps_priority needs the stage's own process"):
        EngineConfig(model_dir=tmp_path, stage_process=False, stage_mps_priority="below_normal")
    with pytest.raises(ValueError, match="both below_normal order nothing"):
        EngineConfig(model_dir=tmp_path, stage_mps_priority="below_normal", vllm_mps_priority="below_normal")
    assert mps_client_env(None, "below_normal") == {MPS_PRIORITY_ENV: "1"}  # what the stage's process is given
    # Unset, the stage's process goes below normal unless vLLM's engine core was put there.
    assert EngineConfig(model_dir=tmp_path).resolved_stage_mps_priority() == "below_normal"
    assert EngineConfig(model_dir=tmp_path, vllm_mps_priority="below_normal").resolved_stage_mps_priority() == "normal"
    assert EngineConfig(model_dir=tmp_path, stage_mps_priority="normal").resolved_stage_mps_priority() == "normal"
    with pytest.raises(ValueError, match="stage_mps_priority must be one of normal, below_normal"):
        EngineConfig(model_dir=tmp_path, stage_mps_priority="high")  # type: ignore[arg-type]


def test_the_gateway_serves_websocket_sessions_from_a_stage_process(tiny_model_dir, tmp_path):
    """`python -m gateway --engine.stage-process true` (spawned by the load benchmark, real
    uvicorn and WebSocket clients): the stage's process starts from the gateway's and
    serves its sessions."""
    report = ws_load_main([
        "--launch", "--model", str(tiny_model_dir), "--workdir", str(tmp_path / "gw"),
        "--sessions", "2", "--rate", "0", "--no-warm", "--text", "Hello there. How are you?",
        "--json", str(tmp_path / "load.json"),
        "--engine.device", "cpu", "--engine.lm-backend", "torch", "--engine.warmup", "false",
        "--engine.text-normalization", "false", "--engine.stage-process", "true",
    ])
    (level,) = report["results"]["product"]
    assert level["sessions"] == level["completed"] == 2 and level["errors"] == 0, level
    assert level["audio_s"] > 0 and level["first_audio_ms"]["n"] == 2
    server = level["server"]  # the stage's counters crossed the pipe
    assert server["flow_frames"] > 0 and server["vocoder_frames"] > 0 and server["stage_busy_share"] > 0


def test_stage_pipe_bench_times_round_trips():
    """`bench.stage_pipe`: a round trip per batch size, through a spawned child."""
    out = stage_pipe_main(["--rows", "1,4", "--audio-s", "0.01", "--reps", "20"])
    assert set(out) == {1, 4}
    assert all(0 < r["p50_ms"] <= r["p99_ms"] for r in out.values()), out


def test_a_chunk_the_stage_process_cannot_take_fails_alone(tiny_model_dir):
    """A chunk for a vocoder stream the stage's process does not know gets an error back
    (not silence forever), and the stage goes on serving."""
    async def fn(engine):
        stage = engine.stage
        chunk = FlowChunk(tokens=torch.zeros(12, dtype=torch.long), prompt_feat=torch.zeros(8, 80),
                          embedding=torch.zeros(192), num_prompt_tokens=4, out_start=4, finalize=True)
        job = ChunkJob(flow=chunk, hift_stream=RemoteStream(10**9), speed=1.0, chunk_index=0,
                       is_cancelled=lambda: False)
        with pytest.raises(StageProcessError, match="KeyError"):
            await asyncio.wait_for(stage.run(job), 60)
        assert not stage._jobs
        voice = await default_voice(engine)
        session = engine.open_session(voice, SessionOptions(tokens_per_text_token=3.0, seed=4))
        await session.submit("Still here.")
        await session.finish()
        events = await collect(session)
        assert events and all(isinstance(e, AudioChunk) for e in events), events

    run(tiny_model_dir, fn, warmup=False, stage_process=True)


def test_a_stalled_stage_process_that_does_not_die_fails_its_work_at_once(tiny_model_dir):
    """A process stuck in the GPU driver may not die of SIGKILL for a long time, and its
    pipe stays open until it does: the watchdog's verdict alone must fail the waiting
    utterance and mark the engine failed (before, both waited for the process's exit, and
    the engine stayed ready)."""
    async def fn(engine):
        voice = await default_voice(engine)
        stage = engine.stage
        process = stage._process
        kills: list[int] = []
        stage._process = type("Unkillable", (), {"pid": process.pid, "exitcode": None,
                                                 "kill": lambda self: kills.append(1)})()
        os.kill(process.pid, signal.SIGSTOP)
        try:
            session = engine.open_session(voice, SessionOptions(tokens_per_text_token=3.0, seed=5))
            await session.submit("Nobody answers for this audio.")
            await session.finish()
            events = await asyncio.wait_for(collect(session), 60)
            assert kills and process.is_alive()  # the kill "did not take": the process lives on
            assert events and isinstance(events[-1], UtteranceError), events
            assert "stalled (" in events[-1].message, events[-1].message
            assert not engine.ready and "stalled" in (engine.failure or "")
        finally:
            stage._process = process
            process.kill()
            await asyncio.to_thread(process.join, 30)

    run(tiny_model_dir, fn, warmup=False, stage_process=True, stage_stall_timeout_s=2.0)


def test_the_stage_process_leaves_interrupts_and_terminations_to_the_engine(tiny_model_dir):
    """A SIGTERM to the whole process group (systemd's default stop) killed the stage at once
    while the gateway drained its sessions; the engine closes the stage after the drain."""
    async def fn(engine):
        status = open(f"/proc/{engine.stage._process.pid}/status").read()
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigIgn:")), 16)

    ignored = run(tiny_model_dir, fn, warmup=False, stage_process=True)
    assert ignored & (1 << (signal.SIGINT - 1)) and ignored & (1 << (signal.SIGTERM - 1))


async def _killed(stage: RemoteStage) -> None:
    """Kill `stage`'s process and return once its reader thread has reported the exit."""
    stage._process.kill()
    await asyncio.to_thread(stage._process.join, 30)
    async with asyncio.timeout(30):
        while stage.failure is None:
            await asyncio.sleep(0.01)


def test_a_dead_stage_raises_a_new_error_each_time(tiny_model_dir):
    """Raised again and again, one exception's traceback grew by each raise's frames and
    kept their locals alive for as long as the dead stage was asked."""
    async def fn(engine):
        stage = engine.stage
        await _killed(stage)
        errors = []
        for _ in range(3):
            with pytest.raises(StageProcessError) as err:
                stage._check_open()  # what every submit and call does first
            errors.append(err.value)
        return errors

    errors = run(tiny_model_dir, fn, warmup=False, stage_process=True)
    assert len({id(e) for e in errors}) == 3 and all("exited" in str(e) for e in errors)


def test_a_cancel_for_a_chunk_already_done_leaves_nothing_behind():
    """The engine may cancel a chunk the stage's process has just finished: that id has no
    job left to check it, so keeping it would grow the process's set for good."""
    class Stage:
        rounds = None
        drops = 0

        def drop_cancelled(self) -> int:
            self.drops += 1
            return 0

    async def fn() -> None:
        stage = Stage()
        server = _StageServer(conn=None, stage=stage)  # type: ignore[arg-type]
        server.live.add(7)  # submitted, not yet done
        server.on_cancel([5, 7])
        assert server.cancelled == {7} and stage.drops == 1
        done: asyncio.Future[np.ndarray] = asyncio.get_running_loop().create_future()
        done.cancel()
        server._done(7, done)
        assert not server.cancelled and not server.live

    asyncio.run(fn())


# ---- fill padding in the stage's process ---------------------------------------------------


def test_a_chunk_grows_into_its_spare_tokens_as_the_engine_builds_it():
    """`grow_from_spare` gives the chunk the engine would build for the grown end (the
    window keeps its start), on the 25-token grid counted from the prompt, again from a
    grown chunk, or the rest as the last chunk once the LM is done."""
    from engine.chunking import SpareTokens
    from engine.stage_process import grow_from_spare
    from tests.test_flow_prompt_cache import LOOK, chunk, make_voice

    v = make_voice(60, 1)  # a 60-token prompt; the grid ends chunks at 40, 65, 90, 115, ...
    tokens = v.speech.tolist()
    first = chunk(v, 50, 65, False)  # its window holds tokens [25, 68)

    def spare(available: int, lm_done: bool = False) -> SpareTokens:
        return SpareTokens.of(tokens[:available], 60, 50, 65, 68, lm_done, LOOK, 100)

    def same(a: FlowChunk, b: FlowChunk) -> bool:
        return (torch.equal(a.tokens, b.tokens) and (a.out_start, a.finalize, a.noise_offset)
                == (b.out_start, b.finalize, b.noise_offset))

    grown, end, final = grow_from_spare(first, 65, spare(120), room=40)
    assert (end, final) == (90, False) and same(grown, chunk(v, 50, 90, False))  # 105 rounds down to 90
    again, end, final = grow_from_spare(grown, 90, spare(120), room=30)
    assert (end, final) == (115, False) and same(again, chunk(v, 50, 115, False))
    last, end, final = grow_from_spare(first, 65, spare(80, lm_done=True), room=20)
    assert (end, final) == (80, True) and same(last, chunk(v, 50, 80, True))
    assert grow_from_spare(first, 65, spare(120), room=0) is None
    assert grow_from_spare(first, 65, spare(70), room=40) is None  # no lookahead past the next grid end
    assert grow_from_spare(first, 65, spare(200), room=200)[1] == 140  # at most max_hop (100) past its offset, on the grid


def test_the_stage_process_grows_a_queued_chunk_and_says_how_far(tiny_model_dir):
    """The stage's side of the pipe: a chunk sent with its spare tokens grows into its batch's
    padding, runs grown (the same audio as the grown chunk sent as it is), and its start
    says the end it grew to; the engine's job learns it before its start resolves."""
    from engine.chunking import SpareTokens
    from engine.first_chunk import RoundTimes
    from engine.models.loader import load_model
    from engine.stage_process import ChunkWire
    from engine.token2wav import AudioStage, BatchStart
    from tests.test_flow_prompt_cache import LOOK, chunk, make_voice

    model = load_model(tiny_model_dir, load_lm=False)
    v = make_voice(60, 1)
    spare = SpareTokens.of(v.speech.tolist()[:150], 60, 50, 65, 68, False, LOOK, 100)

    def wire(c: FlowChunk) -> ChunkWire:
        return ChunkWire(c.tokens.numpy(), 1, 2, c.num_prompt_tokens, c.out_start, c.finalize, c.noise_offset)

    async def serve(chunks: list[FlowChunk], spares: list[SpareTokens | None]) -> tuple[list, dict]:
        stage = AudioStage(model.flow, model.hift, torch.device("cpu"), max_batch=8, fill_padding=True)
        sent: list[tuple] = []
        all_done = asyncio.Event()

        class Pipe:
            def send(self, batch: list[tuple]) -> None:
                sent.extend(batch)
                if sum(len(m[2]) for m in sent if m[0] == "events") == len(chunks):
                    all_done.set()

        server = _StageServer(Pipe(), stage)  # type: ignore[arg-type]
        server.handle([("tensor", 1, v.feat.numpy()), ("tensor", 2, v.emb.numpy())]
                      + [("stream", sid) for sid in range(len(chunks))]
                      + [("submit", jid, jid, wire(c), 1.0, 1, True, -float("inf"), None, sp)
                         for jid, (c, sp) in enumerate(zip(chunks, spares))])
        await stage.start()
        try:
            await all_done.wait()
        finally:
            await stage.close()
        events = [m for m in sent if m[0] == "events"]
        started = {jid: grown for m in events for jid, _, _, _, grown in m[1]}
        # Submitted with no deadline (-inf): past it when their batches started, and said so.
        assert [past_due for m in events for _, _, _, past_due, _ in m[1]] == [True] * len(chunks)
        pcm = {jid: p for m in events for jid, p in m[2]}
        assert not server.growing and not server.grown
        return [pcm[j] for j in range(len(chunks))], started

    pcm, started = asyncio.run(serve([chunk(v, 50, 125, False), chunk(v, 50, 65, False)], [None, spare]))
    assert started == {0: None, 1: (115, False)}  # 50 tokens of room, down to the grid
    want, _ = asyncio.run(serve([chunk(v, 50, 125, False), chunk(v, 50, 115, False)], [None, None]))
    for a, b in zip(pcm, want):
        assert_same_audio(a, b)

    # The engine's side: the job hears the end before its start resolves.
    async def engine_side() -> list[tuple[int, bool]]:
        heard: list[tuple[int, bool]] = []
        remote = RemoteStage.__new__(RemoteStage)
        remote.rounds, remote._jobs = RoundTimes(), {}
        job = ChunkJob(flow=chunk(v, 50, 65, False), hift_stream=None, speed=1.0, chunk_index=1,
                       is_cancelled=lambda: False, grown_to=lambda end, final: heard.append((end, final)))
        job.started = asyncio.get_running_loop().create_future()
        job.started.add_done_callback(lambda f: heard.append(("started", f.result().rows)))  # type: ignore[arg-type]
        remote._jobs[7] = job
        remote._on_events([(7, 1.0, 2, True, (115, False))], [], [], [], {}, {})
        await asyncio.sleep(0)  # the start's callback runs on the next turn
        assert job.started.result() == BatchStart(1.0, 2, True)
        return heard

    assert asyncio.run(engine_side()) == [(115, False), ("started", 2)]


def test_an_engine_with_fill_padding_serves_from_a_stage_process(tiny_model_dir):
    pcm = run(tiny_model_dir, _speak_four, warmup=False, stage_process=True, flow_fill_padding=True)
    assert len(pcm) == 4 and all(p.size > 0 for p in pcm)


class _Pipe:
    """A connection that keeps what is sent on it."""

    def __init__(self) -> None:
        self.sent: list = []

    def send(self, batch: list) -> None:
        self.sent.extend(batch)


def _wired_remote() -> RemoteStage:
    """A `RemoteStage` without a process: what it sends stays in `_conn.sent`."""
    remote = RemoteStage.__new__(RemoteStage)
    remote._conn, remote._error, remote._closed = _Pipe(), None, False  # type: ignore[assignment]
    remote._released_streams, remote._released_tensors = collections.deque(), collections.deque()
    return remote


def test_stage_settings_tuned_while_serving_reach_the_stage_process():
    """`RemoteStage.tune` refuses a bad knob itself and sends the rest; the stage's side sets
    them (`POST /debug/planner` with `debug_tuning`: A/B levels on one gateway)."""
    class Stage:
        rounds = None
        fill_padding, split_call_cost = False, 730

        def tune(self, knobs: dict) -> None:
            for name, value in knobs.items():
                setattr(self, name, value)

    async def fn() -> None:
        stage = Stage()
        server = _StageServer(conn=_Pipe(), stage=stage)  # type: ignore[arg-type]
        remote = _wired_remote()
        with pytest.raises(ValueError, match="split_call_cost"):
            remote.tune({"split_call_cost": -5})
        assert remote._conn.sent == []
        remote.tune({"fill_padding": True, "split_call_cost": 400})
        (message,) = remote._conn.sent
        assert message == ("call", None, "tune", ({"fill_padding": True, "split_call_cost": 400},))
        server.handle([message])
        await asyncio.gather(*server.tasks)
        assert (stage.fill_padding, stage.split_call_cost) == (True, 400)

    asyncio.run(fn())


def test_a_first_chunks_announcement_reaches_the_stage_process_with_its_urgency():
    """`RemoteStage.expect_first_chunk` sends when the chunk is due, the round it would
    miss and whether its listener will be waiting; the stage's side announces it so to
    the stage, for the stream of that id (the burst hold counts urgent ones only)."""
    class Stage:
        rounds = None

        def __init__(self) -> None:
            self.expected: list[tuple] = []

        def expect_first_chunk(self, stream: object, due: float, round_s: float | None, urgent: bool) -> None:
            self.expected.append((stream, due, round_s, urgent))

    async def fn() -> None:
        stage = Stage()
        server = _StageServer(conn=_Pipe(), stage=stage)  # type: ignore[arg-type]
        inner = object()
        server.streams[4] = inner
        remote = _wired_remote()
        remote.expect_first_chunk(RemoteStream(4), 12.5, 0.3, urgent=False)
        remote.expect_first_chunk(RemoteStream(9), 13.0)  # a stream the stage no longer has
        assert remote._conn.sent == [("expect", 4, 12.5, 0.3, False), ("expect", 9, 13.0, None, True)]
        server.handle(remote._conn.sent)
        assert stage.expected == [(inner, 12.5, 0.3, False)]

    asyncio.run(fn())


def test_the_engines_handle_counts_the_utterances_waiting_patiently():
    """`RemoteStage` keeps the patience count in the engine's process, where the first
    chunks are planned: from a patient chunk to the next one that is not. Each chunk's
    patience travels with it too (the stage's second-chunk cut reads it there)."""
    class Stage:
        rounds = None

        def __init__(self) -> None:
            self.jobs: list[ChunkJob] = []

        def submit(self, job: ChunkJob) -> None:
            loop = asyncio.get_running_loop()
            job.started, job.future = loop.create_future(), loop.create_future()
            self.jobs.append(job)

    async def fn() -> list[tuple[int, int]]:
        remote = _wired_remote()
        remote._ids, remote._tensors, remote._jobs = itertools.count(), {}, {}
        remote._live, remote._patient = weakref.WeakSet(), weakref.WeakSet()
        remote._loop = asyncio.get_running_loop()
        remote.rounds, remote.max_batch, remote.graph_policy = RoundTimes(), 1, None
        remote.rounds.observe(50, 0.1)
        remote.rounds.observe(100, 0.15)  # two rows of 50 frames
        streams = [remote.new_stream() for _ in range(2)]
        chunk = FlowChunk(tokens=torch.zeros(20, dtype=torch.long), prompt_feat=torch.zeros(4, 80),
                          embedding=torch.zeros(192), num_prompt_tokens=2, out_start=2, finalize=False)
        counts = []
        for stream, patient in ((streams[0], True), (streams[1], True), (streams[0], False)):
            remote.submit(ChunkJob(flow=chunk, hift_stream=stream, speed=1.0, chunk_index=1,
                                   is_cancelled=lambda: False, patient=patient))
            counts.append((remote.live_utterances(), remote.live_utterances(skip_patient=True)))
        # Two in progress, one of them patient: two one-row rounds, or one counting the due
        # alone; with rounds of two rows, one two-row round, the patient one in its width or not.
        assert remote.round_estimate(streams[0], 50) == pytest.approx(0.2)
        assert remote.round_estimate(streams[0], 50, due_rounds=True) == pytest.approx(0.1)
        assert remote.round_estimate(streams[0], 50, skip_patient=True) == pytest.approx(0.1)
        remote.max_batch = 2
        assert remote.round_estimate(streams[0], 50, due_rounds=True) == pytest.approx(0.15)
        assert remote.round_estimate(streams[0], 50, skip_patient=True) == pytest.approx(0.1)
        submits = [m for batch in remote._conn.sent for m in (batch if isinstance(batch, list) else [batch]) if m[0] == "submit"]
        assert [m[-1] for m in submits] == [True, True, False]
        stage = Stage()
        server = _StageServer(conn=_Pipe(), stage=stage)  # type: ignore[arg-type]
        server.chunk = lambda wire: chunk  # type: ignore[method-assign]
        server.streams = {m[2]: object() for m in submits}
        server.handle(submits)
        assert [j.patient for j in stage.jobs] == [True, True, False]
        return counts

    assert asyncio.run(fn()) == [(2, 1), (2, 0), (2, 1)]


class _Clock:
    """`time` for `engine.stage_process`'s watchdog: `sleep` moves the clock on and then runs
    what the test scripted for that moment (heartbeats arriving, a pause of every process)."""

    def __init__(self, script) -> None:
        self.now = 1000.0
        self.script = script  # per sleep: (seconds it really took, action or None)

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        took, action = self.script.pop(0) if self.script else (seconds, None)
        self.now += took if took is not None else seconds
        if action is not None:
            action()


def _watched_remote(clock: _Clock, timeout: float) -> RemoteStage:
    """A `RemoteStage` whose watchdog runs on the test's thread, on `clock`; it kills nothing,
    and `_stalled` says why it would have."""
    remote = RemoteStage.__new__(RemoteStage)
    remote._closed, remote._error, remote._stalled, remote._serving = False, None, None, True
    remote._stall_timeout_s = timeout
    remote._heard, remote._busy = clock.now, None
    def stall(why: str) -> None:
        remote._stalled = why

    remote._stall = stall  # type: ignore[method-assign]
    return remote


def test_a_pause_of_every_process_during_device_work_is_no_stall(monkeypatch):
    """SIGSTOP of the whole group (Ctrl-Z, `docker pause`, a debugger) while the stage's worker
    runs a round: after the resume, the stage's heartbeat reports the round as busy for the
    whole pause (its clock ran on), as the last heartbeat before it does when extrapolated.
    The watchdog gives a silent stage a full timeout again after such a gap; a busy one must
    get it too, not be killed for the pause. A piece of work that then really runs past the
    timeout is still a stall."""
    import engine.stage_process as sp

    timeout, period = 2.0, sp.heartbeat_period(2.0)
    script: list = []
    clock = _Clock(script)
    monkeypatch.setattr(sp, "time", clock)
    remote = _watched_remote(clock, timeout)
    remote._received([("alive", 0.1)])  # a round under way as every process stops

    def resumed() -> None:  # the stage's first heartbeat after the resume: its round, 100 s on
        remote._received([("alive", 100.1)])

    def close() -> None:
        remote._closed = True

    script += [(None, None), (100.0, resumed), (None, None), (None, None), (None, close)]
    remote._watch()
    assert remote._stalled is None, remote._stalled

    # A piece of work that runs on after the resume, past the timeout: killed.
    clock.script = [(100.0, resumed)] + [(None, lambda: remote._received([("alive", clock.now - 1000.0)]))] * 20
    remote._closed, remote._heard = False, clock.now
    remote._received([("alive", 0.1)])
    remote._watch()
    assert remote._stalled is not None and "one piece of its device work" in remote._stalled


def test_chunks_dropped_by_a_cancel_leave_the_stage_process_reporting_an_empty_queue(tiny_model_dir):
    """The stage's process reports its counters with its events (a batch taken, audio back).
    A chunk still queued when it last reported (`queued` 1), then dropped by its utterance's
    cancel, is no event: without a report of its own, the engine's copy kept `queued` at 1
    (`flow_queue` in /metrics) and the drop uncounted for as long as the stage stayed idle."""
    from engine.models.loader import load_model
    from engine.stage_process import ChunkWire
    from engine.token2wav import AudioStage
    from tests.test_flow_prompt_cache import chunk, make_voice

    model = load_model(tiny_model_dir, load_lm=False)
    v = make_voice(20, 1)
    c = chunk(v, 0, 25, False)
    wire = ChunkWire(c.tokens.numpy(), 1, 2, c.num_prompt_tokens, c.out_start, c.finalize, c.noise_offset)

    async def fn() -> dict:
        # Not started: its chunks stay queued, as behind a round in flight or a hold.
        stage = AudioStage(model.flow, model.hift, torch.device("cpu"), max_batch=8)
        pipe = _Pipe()
        server = _StageServer(pipe, stage)  # type: ignore[arg-type]
        try:
            server.handle([("tensor", 1, v.feat.numpy()), ("tensor", 2, v.emb.numpy()), ("stream", 5),
                           ("submit", 7, 5, wire, 1.0, 0, True, -float("inf"), None, None)])
            server.flush()  # another chunk's event reports the queue as it is: one chunk
            assert pipe.sent[-1][5]["queued"] == 1
            reports = len(pipe.sent)
            server.handle([("cancel", [7])])
            assert stage.stats.queued == 0 and stage.stats.dropped == 1
            for _ in range(10):  # the loop turns a report takes
                await asyncio.sleep(0)
            assert len(pipe.sent) > reports, "the drop was never reported"
            return pipe.sent[-1][5]
        finally:
            await stage.close()

    stats = asyncio.run(fn())
    assert (stats["queued"], stats["dropped"]) == (0, 1)


def test_a_dead_stage_refuses_a_voice_warm_up_with_a_new_error_each_time(tiny_model_dir):
    """A voice registered after the stage's process died (the gateway stays up with
    `exit_on_engine_failure` off) warms its prompt on the stage, whose first use of the voice's
    tensors writes to the broken pipe. That raised the stage's own error object again and
    again: its traceback grew by each raise's frames and kept their locals (the request,
    the upload, the voice) alive, as `_check_open` once did."""
    async def fn(engine):
        stage = engine.stage
        await _killed(stage)
        errors = []
        for n in range(3):  # three new voices: their tensors were never sent
            prompt = FlowChunk(tokens=torch.zeros(12, dtype=torch.long), prompt_feat=torch.zeros(8, 80),
                               embedding=torch.zeros(192), num_prompt_tokens=12, out_start=12, finalize=True)
            with pytest.raises(StageProcessError) as err:
                await stage.warm_prompt(prompt)
            errors.append(err.value)
        return errors, stage._error.__traceback__

    errors, kept = run(tiny_model_dir, fn, warmup=False, stage_process=True)
    assert len({id(e) for e in errors}) == 3 and all("exited" in str(e) for e in errors)
    assert kept is None  # the stage's own error was never raised: it holds no frames
