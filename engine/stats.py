"""The engine's statistics: the `EngineStats` snapshot `/metrics` and the benchmarks read,
and the running sums and clocks the engine keeps to fill it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .first_chunk import PlanInputs, PlanSums


@dataclass(frozen=True)
class EngineStats:
    active_sessions: int
    active_utterances: int
    lm_active: int
    flow_queue: int
    last_batch_size: int
    max_batch_size: int
    batches: int
    chunks: int
    dropped_chunks: int
    lm_tokens: int
    stage_busy_seconds: float
    # Of stage_busy_seconds: thread and event-loop hand-offs around the batches (StageStats).
    stage_handoff_seconds: float = 0.0
    # Work actually done by the audio stage (benchmarks turn these into FLOP/s):
    # flow = padded batch rows x padded mel frames summed over batches (CFG doubling not
    # included), vocoder = mel frames vocoded. 0 when the stage does not count them.
    flow_frames: int = 0
    vocoder_frames: int = 0
    # Of flow_frames, the rows' own frames before any padding, the frames of rows added to
    # fill a graph's row bucket, and of rows padded past their call's longest to a graph's
    # frame bucket (StageStats).
    flow_exact_frames: int = 0
    flow_row_padding_frames: int = 0
    flow_bucket_padding_frames: int = 0
    # engine.flow_fill_padding: chunks grown into their batch's padding, tokens they took.
    flow_grown_chunks: int = 0
    flow_grown_tokens: int = 0
    # Stage batches whose flow or vocoder step failed and ran again chunk by chunk
    # (StageStats.batches_retried_apart).
    stage_batches_retried_apart: int = 0
    # Stage batches delivered by an asynchronous copy, pipelined (StageStats.pipelined_batches).
    stage_pipelined_batches: int = 0
    # engine.chunk_patience_s: chunks cut big because their audio was not due soon, and
    # their speech tokens (left out of the first-chunk fields below).
    patient_chunks: int = 0
    patient_tokens: int = 0
    # engine.first_chunk_hold_ms: rounds held for expected first chunks, the seconds they
    # waited, and the first chunks that made a round by it (StageStats).
    first_chunk_holds: int = 0
    first_chunk_hold_seconds: float = 0.0
    first_chunk_hold_caught: int = 0
    # ... of them, the rounds held for a burst (engine.first_chunk_burst_hold_ms).
    first_chunk_burst_holds: int = 0
    # ... and the expected first chunks a round started without, with how much later than
    # expected they came, summed (StageStats; a gauge: the sum falls when they came sooner).
    first_chunk_passed_over: int = 0
    first_chunk_passed_over_late_seconds: float = 0.0
    # engine.first_chunk_min_hop: first chunks planned below the floor, and decisions a
    # crowd of first chunks kept from it (FirstChunkPlanner).
    first_chunk_below_floor: int = 0
    first_chunk_crowded: int = 0
    # engine.first_chunk_learnt_rounds_crowd: decisions planned on the learnt second rounds.
    first_chunk_learnt_rounds: int = 0
    # engine.stage_deadline_cut: rounds cut short for rows due before they would end.
    deadline_cuts: int = 0
    # engine.stage_first_chunk_cut: rounds whose first chunks ran before the rows that could wait.
    first_chunk_cuts: int = 0
    # The flow's voice-prompt K/V cache (engine.flow_prompt_cache): batches served from it
    # and the bytes it holds.
    prompt_cache_hits: int = 0
    prompt_cache_bytes: int = 0
    # The flow's per-utterance context cache (engine.flow_context_cache): chunks that read
    # their kept frames, chunks whose frames were kept, and the bytes of its pool.
    context_reads: int = 0
    context_records: int = 0
    context_bytes: int = 0
    # The vocoder's CUDA graphs: decode steps that replayed one, and those that ran eagerly.
    vocoder_graph_replays: int = 0
    vocoder_eager_decodes: int = 0
    # Where the first chunk of each utterance spends its time (sums of seconds over
    # `first_chunks` utterances): text in -> first speech token (text processing, LM
    # queue and prefill), -> the chunk's tokens decoded and queued to the stage, -> the
    # stage starts its batch, -> its audio is back. (With text_mode "stream" the first
    # phase includes waiting for the text.) From the engine's start on: not its warm-up's.
    first_chunks: int = 0
    first_chunk_lm_first_token_seconds: float = 0.0
    first_chunk_lm_decode_seconds: float = 0.0
    first_chunk_stage_wait_seconds: float = 0.0
    first_chunk_stage_seconds: float = 0.0
    # Speech tokens in those first chunks (their sum) as they ran, and as the chunker
    # queued them: what `engine.first_chunk` chose (the stage may grow a queued chunk by
    # the tokens that came meanwhile, `ChunkJob.grow`).
    first_chunk_tokens: int = 0
    first_chunk_planned_tokens: int = 0
    # The same for the first chunks of sessions' first utterances only (the first audio a
    # listener waits for in silence; a later utterance's first chunk usually plays after
    # earlier audio and shares its batches with other sessions' long chunks).
    opening_chunks: int = 0
    opening_chunk_lm_first_token_seconds: float = 0.0
    opening_chunk_lm_decode_seconds: float = 0.0
    opening_chunk_stage_wait_seconds: float = 0.0
    opening_chunk_stage_seconds: float = 0.0
    opening_chunk_tokens: int = 0
    opening_chunk_planned_tokens: int = 0
    # The chunks in the batches those first chunks ran in (summed per chunk): a burst's
    # first chunks split over a small round and a full one show as a mean below the burst.
    first_chunk_batch_rows: int = 0
    opening_chunk_batch_rows: int = 0
    # The same sums for the opening chunks that took `SLOW_OPENING_S` or longer from their
    # text to their audio: what the first audio over issue #12's 500-ms bar was made of,
    # where the means above are mostly the chunks under it (round 43 of
    # docs/benchmarks.md read the tail off the means).
    slow_opening_chunks: int = 0
    slow_opening_chunk_lm_first_token_seconds: float = 0.0
    slow_opening_chunk_lm_decode_seconds: float = 0.0
    slow_opening_chunk_stage_wait_seconds: float = 0.0
    slow_opening_chunk_stage_seconds: float = 0.0
    slow_opening_chunk_tokens: int = 0
    slow_opening_chunk_planned_tokens: int = 0
    slow_opening_chunk_batch_rows: int = 0
    # The second chunk of sessions' first utterances, the one a short first chunk must
    # cover (sums over `opening_second_chunks`): from the LM having its tokens to its queueing
    # (once the stage has taken the first chunk), to the stage's batch start, to its audio;
    # and by how much it came after the first chunk's audio had run out (a stall, as the
    # engine sees it: `_late_seconds` over `_lates`), with the chunks in the batch the
    # late ones' first chunks ran in (`_late_first_rows`, summed: a first chunk that ran in
    # a small round ahead of its burst starts its listener's clock a round early).
    opening_second_chunks: int = 0
    opening_second_chunk_ready_wait_seconds: float = 0.0
    opening_second_chunk_stage_wait_seconds: float = 0.0
    opening_second_chunk_stage_seconds: float = 0.0
    opening_second_chunk_lates: int = 0
    opening_second_chunk_late_seconds: float = 0.0
    opening_second_chunk_late_first_rows: int = 0
    # ... and where each late one's time went after its first chunk's audio arrived (sums
    # over `_lates`): its tokens ready that much later (0 when they were ready before), its
    # wait for the stage's batch, its round, and the chunks of that round. Which of the LM
    # and the stage made it late (round 41 of docs/benchmarks.md: the runs that failed at
    # 176-192 sessions each had one second chunk 33-103 ms late, cause unknown).
    opening_second_chunk_late_ready_seconds: float = 0.0
    opening_second_chunk_late_stage_wait_seconds: float = 0.0
    opening_second_chunk_late_stage_seconds: float = 0.0
    opening_second_chunk_late_rows: int = 0
    # ... and those that came with less than `CLOSE_CALL_S` (100 ms) to spare, late ones too.
    opening_second_chunk_close_calls: int = 0
    # ... and those whose deadline, as the deadline cut judges it (`EngineConfig.cut_shift_s`),
    # had passed when their round began, late ones too (`_late_past_due`: those of the late
    # ones): the cut gives such a row up as a stall in progress (`token2wav.deadline_cut`;
    # `engine.stage_deadline_cut_rescue` judges it by when its audio runs out instead).
    # Behind a first chunk of less audio than the cut's margin (250 ms) every second chunk
    # is one.
    opening_second_chunk_past_due: int = 0
    opening_second_chunk_late_past_due: int = 0
    # What the first-chunk planner takes a first chunk's audio to fall short of its tokens
    # by (the vocoder's held-back frames; the largest seen, `FirstChunkPlanner.holdback_s`).
    first_chunk_holdback_seconds: float = 0.0
    # The latest planned first chunk's inputs (`FirstChunkPlanner.last`; 0 before any, or
    # when a round was not predicted): the LM's seconds per token (the slower of the
    # utterance's own, `_own_`, and what `LMSteps` learnt for as many utterances decoding)
    # and the predicted rounds of that first chunk and of the chunk after it.
    first_chunk_plan_lm_step_seconds: float = 0.0
    first_chunk_plan_lm_step_own_seconds: float = 0.0
    first_chunk_plan_round_seconds: float = 0.0
    first_chunk_plan_second_round_seconds: float = 0.0
    # The same for the latest session's first utterance (`FirstChunkPlanner.last_opening`):
    # what a burst's opening chunks were planned on, to set against `opening_chunk_*` and
    # `opening_second_chunk_*` (what their two rounds took).
    opening_chunk_plan_lm_step_seconds: float = 0.0
    opening_chunk_plan_lm_step_own_seconds: float = 0.0
    opening_chunk_plan_round_seconds: float = 0.0
    opening_chunk_plan_second_round_seconds: float = 0.0
    # Every decision that had rounds to go on, summed (`FirstChunkPlanner.sums`; a level's
    # means are their differences over its count): the first hops chosen, the LM's seconds
    # per token, the predicted rounds of the first chunk and of the one after it, and the
    # utterances in progress on the stage then, all and those not waiting patiently (which
    # of them the round estimate counts: `engine.first_chunk.PlanSums`).
    first_chunk_decisions: int = 0
    first_chunk_decision_hop_tokens: int = 0
    first_chunk_decision_lm_step_seconds: float = 0.0
    first_chunk_decision_round_seconds: float = 0.0
    first_chunk_decision_second_round_seconds: float = 0.0
    first_chunk_decision_staged: int = 0
    first_chunk_decision_due: int = 0
    # The same for sessions' first utterances.
    opening_chunk_decisions: int = 0
    opening_chunk_decision_hop_tokens: int = 0
    opening_chunk_decision_lm_step_seconds: float = 0.0
    opening_chunk_decision_round_seconds: float = 0.0
    opening_chunk_decision_second_round_seconds: float = 0.0
    opening_chunk_decision_staged: int = 0
    opening_chunk_decision_due: int = 0
    # The LM server's own timings, summed (`engine.backends.lm_times`; vLLM with
    # EngineConfig.lm_timing, else zeros).
    lm_server_requests: int = 0
    lm_server_queued_seconds: float = 0.0
    lm_server_prefill_seconds: float = 0.0
    lm_server_decode_seconds: float = 0.0
    lm_server_decode_tokens: int = 0
    lm_server_first_tokens: int = 0
    lm_server_first_token_seconds: float = 0.0
    # How long the engine's start took, by step (`Engine.create`): loading the model
    # directory, starting the LM backend (vLLM: its engine core's compile and graphs; with
    # EngineConfig.overlap_start the wait left after the stage and voice steps), building
    # and starting the audio stage, the warm-up voice (the flow's compile and its graphs)
    # and the warm-up syntheses.
    start_load_seconds: float = 0.0
    start_lm_seconds: float = 0.0
    start_stage_seconds: float = 0.0
    start_voice_seconds: float = 0.0
    start_warmup_seconds: float = 0.0
    # torch's CUDA allocator on the engine's device (0 on CPU): what the flow, vocoder
    # and an in-process LM hold now and at most since start. A vLLM engine core in its
    # own process is not included.
    cuda_memory_allocated_bytes: int = 0
    cuda_max_memory_allocated_bytes: int = 0
    # Audio stages whose process died or stalled. With several stages the engine serves on
    # the others (still ready), at that much less capacity.
    stages_failed: int = 0


# An opening chunk this many seconds or more from its text to its audio is a slow one
# (`EngineStats.slow_opening_chunks`): issue #12's bar for first audio's p95.
SLOW_OPENING_S = 0.5


def is_slow_opening(phases: tuple[float, ...]) -> bool:
    """Whether an opening chunk whose phases (`FirstChunkTimes.add`'s times, from its text
    submitted to its audio back) span `SLOW_OPENING_S` or more is a slow one."""
    return phases[-1] - phases[0] >= SLOW_OPENING_S


@dataclass
class FirstChunkTimes:
    """Running sums of the first-chunk phases (see EngineStats); one per engine."""

    count: int = 0
    lm_first_token: float = 0.0
    lm_decode: float = 0.0
    stage_wait: float = 0.0
    stage: float = 0.0
    tokens: int = 0
    planned_tokens: int = 0
    batch_rows: int = 0

    def add(self, submitted: float, first_token: float, queued: float, started: float, done: float,
            tokens: int, planned_tokens: int, batch_rows: int) -> None:
        self.count += 1
        self.tokens += tokens
        self.planned_tokens += planned_tokens
        self.batch_rows += batch_rows
        self.lm_first_token += first_token - submitted
        self.lm_decode += queued - first_token
        self.stage_wait += max(0.0, started - queued)
        self.stage += done - max(started, queued)

    def stats_fields(self, name: str = "first_chunk") -> dict[str, float | int]:
        """These sums as EngineStats fields named `name`s, `name`_lm_first_token_seconds, ..."""
        return {f"{name}s": self.count, f"{name}_lm_first_token_seconds": self.lm_first_token,
                f"{name}_lm_decode_seconds": self.lm_decode, f"{name}_stage_wait_seconds": self.stage_wait,
                f"{name}_stage_seconds": self.stage, f"{name}_tokens": self.tokens,
                f"{name}_planned_tokens": self.planned_tokens, f"{name}_batch_rows": self.batch_rows}


# A second chunk with less than this to spare before its first chunk's audio ran out (late
# ones too) is a close call: runs that end with none or one late differ there by tens.
CLOSE_CALL_S = 0.1


@dataclass
class SecondChunkTimes:
    """Running sums of the opening second chunks' phases (see EngineStats); one per engine."""

    count: int = 0
    ready_wait: float = 0.0
    stage_wait: float = 0.0
    stage: float = 0.0
    lates: int = 0
    late: float = 0.0
    late_first_rows: int = 0
    late_ready: float = 0.0
    late_stage_wait: float = 0.0
    late_stage: float = 0.0
    late_rows: int = 0
    close_calls: int = 0
    past_due: int = 0
    late_past_due: int = 0

    def add(self, ready: float, queued: float, started: float, done: float, due: float, first_rows: int,
            first_audio: float, rows: int, past_due: bool = False) -> None:
        """`first_rows`: the chunks in the batch the first chunk ran in; `first_audio`: when
        the first chunk's audio arrived; `rows`: the chunks in this chunk's own batch;
        `past_due`: its deadline as the deadline cut judges it had passed when its batch
        started (`BatchStart.past_due`)."""
        self.count += 1
        self.past_due += int(past_due)
        self.ready_wait += max(0.0, queued - ready)
        self.stage_wait += max(0.0, started - queued)
        self.stage += done - max(started, queued)
        self.close_calls += int(done > due - CLOSE_CALL_S)
        if done > due:
            self.lates += 1
            self.late += done - due
            self.late_first_rows += first_rows
            self.late_ready += max(0.0, ready - first_audio)
            self.late_stage_wait += max(0.0, started - queued)
            self.late_stage += done - max(started, queued)
            self.late_rows += rows
            self.late_past_due += int(past_due)

    def stats_fields(self, name: str = "opening_second_chunk") -> dict[str, float | int]:
        return {f"{name}s": self.count, f"{name}_ready_wait_seconds": self.ready_wait,
                f"{name}_stage_wait_seconds": self.stage_wait, f"{name}_stage_seconds": self.stage,
                f"{name}_lates": self.lates, f"{name}_late_seconds": self.late,
                f"{name}_late_first_rows": self.late_first_rows,
                f"{name}_late_ready_seconds": self.late_ready,
                f"{name}_late_stage_wait_seconds": self.late_stage_wait,
                f"{name}_late_stage_seconds": self.late_stage, f"{name}_late_rows": self.late_rows,
                f"{name}_close_calls": self.close_calls, f"{name}_past_due": self.past_due,
                f"{name}_late_past_due": self.late_past_due}


@dataclass
class StartClock:
    """Seconds per step of an engine's start, in order (the steps' names are the keys)."""

    laps: dict[str, float] = field(default_factory=dict)
    _last: float = field(default_factory=time.monotonic)

    def lap(self, name: str) -> None:
        now = time.monotonic()
        self.laps[name] = now - self._last
        self._last = now


def plan_fields(plan: PlanInputs | None, name: str = "first_chunk") -> dict[str, float]:
    """EngineStats' `name`_plan_* gauges of a first-chunk decision."""
    if plan is None:
        return {}
    return {f"{name}_plan_lm_step_seconds": plan.step_s,
            f"{name}_plan_lm_step_own_seconds": plan.own_step_s or 0.0,
            f"{name}_plan_round_seconds": plan.first_round_s or 0.0,
            f"{name}_plan_second_round_seconds": plan.second_round_s or 0.0}


def plan_sum_fields(sums: PlanSums, name: str = "first_chunk") -> dict[str, float]:
    """EngineStats' `name`_decision* counters of a planner's sums."""
    return {f"{name}_decisions": sums.decisions,
            f"{name}_decision_hop_tokens": sums.hop,
            f"{name}_decision_lm_step_seconds": sums.step_s,
            f"{name}_decision_round_seconds": sums.first_round_s,
            f"{name}_decision_second_round_seconds": sums.second_round_s,
            f"{name}_decision_staged": sums.staged,
            f"{name}_decision_due": sums.due}
