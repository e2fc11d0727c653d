"""First-chunk sizing from the measured load (`engine.first_chunk`), alone and in the engine."""

from __future__ import annotations

import asyncio
import gc
import math
import re
import time

import pytest

from engine.chunking import ChunkSchedule
from engine.config import EngineConfig
from engine.engine import CPU_WARMUP_CONCURRENCY, WARMUP_SPEECH_TOKENS, Engine
from engine.session import STEP_FROM
from engine.first_chunk import (
    TOKEN_S,
    FirstChunkPlanner,
    LMSteps,
    PlanInputs,
    PlanSums,
    RoundTimes,
    SecondRounds,
    chunks_ahead,
    monotone_fit,
    plan_first_hop,
    shortest_as_safe,
    slack,
    stalls,
)
from engine.stats import SLOW_OPENING_S, EngineStats, FirstChunkTimes, SecondChunkTimes, is_slow_opening, plan_sum_fields
from engine.token2wav import estimate_round
from engine.types import AudioChunk, SessionOptions
from gateway.metrics import ENGINE_COUNTERS
from tests.test_engine import TOKEN_SAMPLES, collect, default_voice, run


def test_round_times_interpolate_between_sizes_and_stay_proportional_above():
    rt = RoundTimes()
    assert rt.predict(8000) is None
    for _ in range(5):
        rt.observe(8000, 0.080)
    # One size measured: proportional above it, its own wall below it (launch-bound).
    assert rt.predict(8000) == pytest.approx(0.080)
    assert rt.predict(64000) == pytest.approx(0.640)
    assert rt.predict(100) == pytest.approx(0.080)
    for _ in range(5):
        rt.observe(64000, 0.416)
    # 8000 frames -> 80 ms, 64000 -> 416 ms: 6 us a frame over 32 ms in between.
    assert rt.predict(64000) == pytest.approx(0.416)
    assert rt.predict(32000) == pytest.approx(0.032 + 32000 * 6e-6)


def test_round_times_forget_old_batches_of_the_same_size():
    rt = RoundTimes(window=5)
    for _ in range(5):
        rt.observe(4000, 1.0)
    for _ in range(2):
        rt.observe(3900, 0.1)  # the same size (a half octave: 2896-4095 frames)
    assert rt.predict(4000) == pytest.approx(1.0)  # the older ones are still most of the window
    rt.observe(3900, 0.1)
    assert rt.predict(3900) == pytest.approx(0.1)  # now the newer ones are
    assert rt.observed == 8


def test_round_times_ignore_one_slow_batch_of_a_size():
    """One batch of a size that took 10x (a cache entry built on first use, say) among
    ordinary ones: the prediction stays the ordinary round; a mean would not."""
    rt = RoundTimes()
    rt.observe(100, 0.030)
    rt.observe(100, 0.300)
    rt.observe(100, 0.031)
    assert rt.predict(100) == pytest.approx(0.031)
    assert rt.predict(6400) == pytest.approx(0.031 * 64)  # the envelope above is not raised either


def test_round_times_keep_a_full_batch_through_a_run_of_small_ones():
    """Round 11 on the H200: single sessions (~30 ms rounds whatever their frames), then a
    burst of 64. A full batch measured before them must still be predicted, not a line
    through the small ones."""
    rt = RoundTimes()
    for _ in range(3):
        rt.observe(64 * 86, 0.45)
    for i in range(200):
        rt.observe(22 + 180 * (i % 2), 0.030)
    assert rt.predict(64 * 86) == pytest.approx(0.45, rel=1e-6)
    assert 0.030 < rt.predict(16 * 86) < 0.45


def test_round_times_never_predict_less_for_more_work():
    rt = RoundTimes()
    rt.observe(1000, 0.2)  # a slow small batch (say, it waited on a compile)
    rt.observe(8000, 0.1)
    # One batch of each: neither is known better, so both sizes get their mean.
    assert rt.predict(1000) == rt.predict(4000) == rt.predict(8000) == pytest.approx(0.15)
    assert rt.predict(16000) == pytest.approx(0.3)
    assert rt.predict(500) == pytest.approx(0.15)


def test_round_times_one_slow_small_batch_does_not_set_every_larger_size():
    """Round 20 on the H200: one slow round of a few rows (a burst's start, beside every
    session's prefill) made the prediction of every larger size under a running maximum:
    64-row rounds of ~240 ms and a single session's 26-ms second chunks were both predicted
    at 483 ms. Pooled with the sizes measured more often it moves them little, and sizes
    below it not at all."""
    rt = RoundTimes()
    for _ in range(7):
        rt.observe(50, 0.027)  # one session's first chunks
        rt.observe(130, 0.026)  # ... and its second ones (launch-bound: no slower)
        rt.observe(64 * 100, 0.30)  # a burst's long chunks
    rt.observe(2 * 50, 0.483)  # the slow one
    rt.observe(64 * 50, 0.24)  # a burst's opening round, once
    pooled = (0.483 + 7 * 0.026) / 8  # with the next size up, measured seven times
    assert rt.predict(50) == pytest.approx(0.027)
    assert rt.predict(100) == rt.predict(130) == pytest.approx(pooled)
    assert rt.predict(64 * 50) == pytest.approx(0.24)
    assert rt.predict(64 * 100) == pytest.approx(0.30)


def test_snapshots_show_the_learnt_inputs():
    rt = RoundTimes()
    assert rt.snapshot() == []
    rt.observe(100, 0.3)
    rt.observe(3200, 0.1)
    rt.observe(3200, 0.1)
    assert rt.snapshot() == [{"work": 100, "wall_s": 0.3, "batches": 1, "predicted_s": pytest.approx(0.5 / 3)},
                             {"work": 3200, "wall_s": 0.1, "batches": 2, "predicted_s": pytest.approx(0.5 / 3)}]
    p = FirstChunkPlanner(limit=40)
    p.learn_lm_step(64, 0.010, opening=True)
    p.learn_lm_step(70, 0.012, opening=True)
    p.learn_lm_step(1, 0.003, opening=False)
    assert p.snapshot()["lm_steps"] == {"opening": {"64": {"step_s": pytest.approx(0.011), "utterances": 2}},
                                        "later": {"1": {"step_s": 0.003, "utterances": 1}}}


def test_monotone_fit_pools_violators_by_weight():
    assert monotone_fit([0.1, 0.2, 0.3], [1, 1, 1]) == [0.1, 0.2, 0.3]
    assert monotone_fit([0.1, 0.5, 0.2, 0.3], [1, 1, 3, 1]) == pytest.approx([0.1, 0.275, 0.275, 0.3])
    assert monotone_fit([3.0, 2.0, 1.0], [1, 1, 1]) == pytest.approx([2.0] * 3)


def test_chunks_ahead_follow_the_schedule_to_its_largest_hop():
    s = ChunkSchedule(prompt_tokens=106, initial_hop=15, max_hop=100)
    # 106 + 15 = 121: the next boundary (125) is 4 away, < 15, so the one after; then 50, 100, 100.
    assert chunks_ahead(s, 15) == [(15, 29), (44, 50), (94, 100), (194, 100)]
    assert chunks_ahead(s, 20) == [(20, 24), (44, 50), (94, 100), (194, 100)]
    assert s.offset == 0 and s.index == 0  # the schedule itself is untouched


def timeline_stalls(first, step, rounds, hold, margin=0.25):
    """The timeline by hand for the schedule of P=106 (chunks_ahead above): chunk k is
    ready when the LM has its tokens, done a round after that or after chunk k-1."""
    after = {15: [29, 50, 100, 100], 20: [24, 50, 100, 100]}[first]
    r0, done, played, generated = rounds[0], 0.0, first * TOKEN_S - hold, 0
    for k, hop in enumerate(after, start=1):
        generated += hop
        done = max(generated * step - r0, done) + rounds[k]
        if (1 + margin) * done > played:
            return True
        played += hop * TOKEN_S
    return False


@pytest.mark.parametrize("first", [15, 20])
@pytest.mark.parametrize("step,rounds", [
    (0.002, [0.03, 0.03, 0.04, 0.05, 0.05]),  # one session
    (0.012, [0.25, 0.45, 0.8, 1.3, 1.3]),  # 64 sessions starting together (H200, round 8)
    (0.012, [0.25, 0.45, 0.5, 0.6, 0.6]),
])
def test_stalls_is_the_timeline(first, step, rounds):
    s = ChunkSchedule(prompt_tokens=106, initial_hop=15)
    hops = {0: first} | dict(chunks_ahead(s, first))  # offset -> hop

    def round_s(offset, hop):
        assert hops[offset] == hop
        return rounds[list(hops).index(offset)]

    assert stalls(s, first, step, round_s, holdback_s=0.16) == timeline_stalls(first, step, rounds, 0.16)


def test_plan_light_and_heavy_load():
    s = ChunkSchedule(prompt_tokens=106, initial_hop=15)
    light = lambda offset, hop: 0.03  # noqa: E731
    assert plan_first_hop(s, 40, 0.002, light, 0.16) == 15  # one session on the H200
    # 64 sessions: 12 ms a token, rounds growing with the window (the third chunk's 0.8 s).
    heavy = lambda offset, hop: 0.25 if offset == 0 else 0.002 * (offset + hop) + 0.3  # noqa: E731
    hop = plan_first_hop(s, 40, 0.012, heavy, 0.16)
    assert 15 < hop < 40
    assert stalls(s, 15, 0.012, heavy, 0.16) and not stalls(s, hop, 0.012, heavy, 0.16)
    assert stalls(s, hop - 1, 0.012, heavy, 0.16)
    assert plan_first_hop(s, 40, 0.02, lambda o, h: 5.0, 0.16) == 40  # nothing plays through: the limit
    assert plan_first_hop(s, 40, 0.02, lambda o, h: None, 0.16) == 15  # nothing measured yet


def test_later_rounds_take_at_least_what_second_chunks_took():
    """`later_round_s`: a later chunk's round is planned no shorter than it (the stage's wait
    and mixed rounds under spread arrivals); shorter than every estimate, it changes nothing."""
    s = ChunkSchedule(prompt_tokens=106, initial_hop=6)
    light = lambda offset, hop: 0.03  # noqa: E731  one-row rounds
    alone = plan_first_hop(s, 40, 0.004, light, 0.16, margin=0.5)
    assert alone == 6  # round 21's one session
    assert plan_first_hop(s, 40, 0.004, light, 0.16, margin=0.5, later_round_s=0.02) == alone
    # Round 22's 32 sessions over 16 s: second chunks took ~70 ms after their turn.
    loaded = plan_first_hop(s, 40, 0.004, light, 0.16, margin=0.5, later_round_s=0.07)
    assert loaded > alone
    assert stalls(s, alone, 0.004, light, 0.16, margin=0.5, later_round_s=0.07)
    assert not stalls(s, loaded, 0.004, light, 0.16, margin=0.5, later_round_s=0.07)


def test_slack_is_the_least_time_to_spare_and_stalls_below_zero():
    s = ChunkSchedule(prompt_tokens=106, initial_hop=10, max_hop=100, lookahead=3)
    flat = lambda offset, hop: 0.04  # noqa: E731
    assert slack(s, 10, 0.005, lambda o, h: None, 0.16) is None  # nothing measured yet
    # A 10-token first chunk, 240 ms of audio: the next chunk is 34 tokens (to the grid),
    # ready 34 x 5 - 40 ms after the first chunk's audio, done one 99-ms round later.
    assert chunks_ahead(s, 10)[0] == (10, 34)
    assert slack(s, 10, 0.005, flat, 0.16, margin=0.5, later_round_s=0.099) == pytest.approx(0.24 - 1.5 * 0.229)
    for hop in range(6, 16):
        spare = slack(s, hop, 0.005, flat, 0.16, margin=0.5, later_round_s=0.099)
        assert stalls(s, hop, 0.005, flat, 0.16, margin=0.5, later_round_s=0.099) == (spare < 0)


def test_a_shorter_first_chunk_is_taken_where_it_leaves_as_much_to_spare():
    """The bench voice (106 prompt tokens) with the planner's inputs at 64 sessions over 16 s
    (round 27: 3.6-5 ms a token, second chunks 62-99 ms from their turn). 10 tokens are
    followed by 34, 8 by 11: at 3.6 ms and 62 ms, 8 leave more to spare than the 10 the
    planner takes; at 5 ms and 99 ms nothing below its 13 leaves as much."""
    s = ChunkSchedule(prompt_tokens=106, initial_hop=10, max_hop=100, lookahead=3)
    flat = lambda offset, hop: 0.04  # noqa: E731
    light = (0.0036, flat, 0.16, 1.0, 0.5, 0.062)
    assert plan_first_hop(s, 40, *light) == 10
    assert [chunks_ahead(s, hop)[0][1] for hop in (8, 10)] == [11, 34]
    assert slack(s, 8, *light) > slack(s, 10, *light) > slack(s, 7, *light) > 0
    assert shortest_as_safe(s, 10, 6, *light) == 8
    assert shortest_as_safe(s, 10, 9, *light) == 9  # no lower than asked
    heavy = (0.005, flat, 0.16, 1.0, 0.5, 0.099)
    assert plan_first_hop(s, 40, *heavy) == 13
    assert all(slack(s, hop, *heavy) < slack(s, 13, *heavy) for hop in range(6, 13))
    assert shortest_as_safe(s, 13, 6, *heavy) == 13
    assert shortest_as_safe(s, 13, 6, 0.005, lambda o, h: None, 0.16) == 13  # nothing measured
    # Where the planner's hop stalls too (its limit), a shorter one must not.
    assert slack(s, 12, *heavy) < 0 and shortest_as_safe(s, 12, 6, *heavy) == 9
    assert shortest_as_safe(s, 12, 6, 0.005, lambda o, h: 5.0, 0.16, 1.0, 0.5) == 12
    # The planner with `min_hop` sizes it so, on the second rounds it learnt.
    p = FirstChunkPlanner(limit=40, margin=0.5, min_hop=6, holdback_s=0.16)
    for _ in range(3):
        p.learn_second_round(64, 0.062)
    assert p.first_hop(s, 0.0036, flat, 1.0, staged=64) == 8 and p.last.hop == 8
    plain = FirstChunkPlanner(limit=40, margin=0.5, holdback_s=0.16, second_rounds=p.second_rounds)
    assert plain.first_hop(s, 0.0036, flat, 1.0, staged=64) == 10
    # Not while as many other utterances as `min_hop_crowd` wait for their first chunk
    # (a burst: they share an opening round).
    assert p.min_hop_crowd == 4
    assert [p.first_hop(s, 0.0036, flat, 1.0, staged=64, sizing=n) for n in (0, 3, 4, 63)] == [8, 8, 10, 10]
    assert (p.below_floor, p.crowded) == (3, 2) and (plain.below_floor, plain.crowded) == (0, 0)


def test_planner_floors_later_rounds_by_the_second_rounds_learnt_for_the_stage_load():
    s = ChunkSchedule(prompt_tokens=106, initial_hop=6)
    light = lambda offset, hop: 0.03  # noqa: E731
    p = FirstChunkPlanner(limit=40, margin=0.5)
    p.observe(6, 1920, 24000, 1.0)  # the vocoder held 160 ms of a 6-token chunk back
    alone = p.first_hop(s, 0.004, light, 1.0, staged=32)  # nothing learnt: the estimates alone
    assert alone == 6
    p.learn_second_round(1, 0.027)  # one utterance: its second chunk's own round
    assert p.first_hop(s, 0.004, light, 1.0, staged=1) == alone
    for seconds in (0.07, 0.06, 0.09):
        p.learn_second_round(32, seconds)
    assert isinstance(p.second_rounds, SecondRounds) and p.second_rounds.predict(40) == 0.07
    loaded = p.first_hop(s, 0.004, light, 1.0, staged=40)
    assert loaded == plan_first_hop(s, 40, 0.004, light, p.holdback_s, margin=0.5, later_round_s=0.07) > alone
    assert p.last.second_round_s == 0.07  # the floor, above the 30-ms estimate
    assert p.first_hop(s, 0.004, light, 1.0) == alone  # no stage load given: no floor
    assert p.snapshot()["second_rounds"] == {"1": {"round_s": 0.027, "utterances": 1},
                                             "32": {"round_s": 0.07, "utterances": 3}}
    off = FirstChunkPlanner(limit=40, margin=0.5, learn_second_rounds=False)  # as up to round 21
    off.observe(6, 1920, 24000, 1.0)
    off.learn_second_round(32, 0.07)
    assert off.first_hop(s, 0.004, light, 1.0, staged=40) == alone and not off.second_rounds.sizes


def test_lm_steps_per_octave_of_utterances_never_faster_for_more():
    steps = LMSteps(window=3)
    assert steps.predict(1) is None
    steps.observe(64, 0.012)
    assert steps.predict(1) is None and steps.predict(32) is None  # only more utterances measured
    assert steps.predict(64) == steps.predict(127) == 0.012 == steps.predict(500)
    steps.observe(1, 0.0035)
    steps.observe(1.5, 0.0033)  # the mean count over an utterance's span: still the first octave
    assert steps.predict(1) == pytest.approx(0.0034)  # the median of what one utterance got
    # 32-63 utterances, not measured: between one (octave 0) and 64 (octave 6), linear in the octave.
    assert steps.predict(40) == pytest.approx(0.0034 + (0.012 - 0.0034) * 5 / 6)
    for step in (0.006, 0.005, 0.030, 0.007):  # the last `window` of an octave, one slow among them
        steps.observe(48, step)
    assert steps.predict(48) == 0.007
    # A slow rate at 2-3 utterances, once: more are never planned faster, and the octaves
    # above that break the order are pooled with it by how many each measured.
    steps.observe(2, 0.020)
    assert steps.predict(2) == steps.predict(48) == pytest.approx((0.020 + 3 * 0.007) / 4)
    assert steps.predict(64) == 0.012
    assert steps.predict(1) == pytest.approx(0.0034)  # fewer: untouched


def test_planner_takes_the_slower_of_the_own_and_learnt_lm_rates():
    p = FirstChunkPlanner(limit=40)
    s = ChunkSchedule(prompt_tokens=106, initial_hop=15)
    heavy = lambda offset, hop: 0.25 if offset == 0 else 0.002 * (offset + hop) + 0.3  # noqa: E731
    on_own = p.first_hop(s, 0.004, heavy, 1.0, streams=64)  # nothing learnt: the own rate
    assert p.last.step_s == p.last.own_step_s == 0.004
    # A burst's opening utterances decoded at 12 ms a token beside the stage ...
    p.learn_lm_step(64, 0.012, opening=True)
    planned = p.first_hop(s, 0.004, heavy, 1.0, opening=True, streams=64)
    assert planned == plan_first_hop(s, 40, 0.012, heavy, p.holdback_s) > on_own
    assert p.last_opening == PlanInputs(planned, 0.012, 0.25, heavy(*chunks_ahead(s, planned)[0]), own_step_s=0.004)
    # One output of vLLM that brought several tokens at once made the own rate ~0: the learnt one stands.
    assert p.first_hop(s, 1e-6, heavy, 1.0, opening=True, streams=64) == planned
    assert p.first_hop(s, 0.004, heavy, 1.0, opening=True, streams=1) == on_own  # one utterance: nothing learnt
    assert p.first_hop(s, 0.02, heavy, 1.0, opening=True, streams=64) > planned  # its own is slower still: taken
    # ... and a session's later utterances at 20: each kind is sized on its own kind's rate.
    assert p.first_hop(s, 0.004, heavy, 1.0, streams=64) == on_own
    p.learn_lm_step(64, 0.020, opening=False)
    assert p.first_hop(s, 0.004, heavy, 1.0, streams=64) == plan_first_hop(s, 40, 0.020, heavy, 0.0) > planned
    assert p.first_hop(s, 0.004, heavy, 1.0, opening=True, streams=64) == planned


def test_with_opening_rate_learnt_a_sessions_first_utterance_takes_the_learnt_rate_alone():
    """`opening_rate="learnt"`: a burst's first utterances are sized on one rate, the learnt
    one, however slow or fast each one's own first tokens came; with nothing learnt for as
    many decoding, on their own; later utterances as before (the slower of the two)."""
    s = ChunkSchedule(prompt_tokens=106, initial_hop=15)
    heavy = lambda offset, hop: 0.25 if offset == 0 else 0.002 * (offset + hop) + 0.3  # noqa: E731
    p = FirstChunkPlanner(limit=40, opening_rate="learnt")
    assert p.first_hop(s, 0.004, heavy, 1.0, opening=True, streams=64) == plan_first_hop(s, 40, 0.004, heavy, 0.0)
    p.learn_lm_step(64, 0.010, opening=True)
    on_learnt = plan_first_hop(s, 40, 0.010, heavy, 0.0)
    for own in (1e-6, 0.004, 0.021):  # round 21's own rates: the hop is the same for each
        assert p.first_hop(s, own, heavy, 1.0, opening=True, streams=64) == on_learnt
        assert p.last_opening.step_s == 0.010 and p.last_opening.own_step_s == own
    slower = FirstChunkPlanner(limit=40)
    slower.learn_lm_step(64, 0.010, opening=True)
    assert slower.first_hop(s, 0.021, heavy, 1.0, opening=True, streams=64) > on_learnt
    p.learn_lm_step(64, 0.010, opening=False)
    assert p.first_hop(s, 0.021, heavy, 1.0, streams=64) == plan_first_hop(s, 40, 0.021, heavy, 0.0) > on_learnt


def test_planner_learns_the_holdback_and_is_fixed_without_room_or_rate():
    p = FirstChunkPlanner(limit=40)
    s = ChunkSchedule(prompt_tokens=106, initial_hop=15)
    slow = lambda offset, hop: 5.0  # noqa: E731
    assert p.first_hop(s, 0.01, slow, 1.0) == 40
    assert p.last == PlanInputs(hop=40, step_s=0.01, first_round_s=5.0, second_round_s=5.0)  # what it went on
    assert p.last_opening is None  # not a session's first utterance
    fast = lambda offset, hop: 0.01  # noqa: E731
    assert p.first_hop(s, 0.01, fast, 1.0, opening=True) == 15
    assert p.last_opening == p.last == PlanInputs(hop=15, step_s=0.01, first_round_s=0.01, second_round_s=0.01)
    p.first_hop(s, 0.01, slow, 1.0)  # a later utterance's decision keeps the opening one
    assert p.last.hop == 40 and p.last_opening.hop == 15
    assert p.first_hop(s, math.inf, slow, 1.0) == 15  # no LM rate yet
    assert p.last.hop == 40  # nothing was planned
    p.observe(15, 11 * 960, 24000, 1.0)  # 15 tokens gave 11 tokens' worth of audio
    assert p.holdback_s == pytest.approx(0.16)
    assert FirstChunkPlanner(limit=15).first_hop(s, 0.02, slow, 1.0) == 15  # limit <= initial_hop: fixed
    official = ChunkSchedule(prompt_tokens=106, initial_hop=0)  # no short first chunk at all
    assert p.first_hop(official, 0.01, slow, 1.0) == 0


def test_planner_sums_every_decision_with_a_round_and_the_opening_ones_apart():
    """`PlanSums`: a level's means need every decision, not the latest; one with no round
    measured (nothing to plan on) is not summed, and the utterances on the stage are."""
    p = FirstChunkPlanner(limit=40)
    s = ChunkSchedule(prompt_tokens=106, initial_hop=15)
    slow = lambda offset, hop: 5.0 if offset == 0 else 7.0  # noqa: E731  (the first chunk's round, later ones)
    fast = lambda offset, hop: 0.01 if offset == 0 else 0.02  # noqa: E731
    unmeasured = lambda offset, hop: None  # noqa: E731
    assert p.first_hop(s, 0.01, slow, 1.0, staged=80, due=16) == 40
    assert p.first_hop(s, 0.005, fast, 1.0, opening=True, staged=4, due=3) == 15
    assert p.first_hop(s, 0.01, unmeasured, 1.0, opening=True, staged=9, due=9) == 15
    assert p.sums == PlanSums(decisions=2, hop=55, step_s=pytest.approx(0.015), first_round_s=pytest.approx(5.01),
                              second_round_s=pytest.approx(7.02), staged=84, due=19)
    assert p.opening_sums == PlanSums(decisions=1, hop=15, step_s=0.005, first_round_s=0.01, second_round_s=0.02,
                                      staged=4, due=3)
    assert plan_sum_fields(p.opening_sums, "opening_chunk") == {
        "opening_chunk_decisions": 1, "opening_chunk_decision_hop_tokens": 15,
        "opening_chunk_decision_lm_step_seconds": 0.005, "opening_chunk_decision_round_seconds": 0.01,
        "opening_chunk_decision_second_round_seconds": 0.02, "opening_chunk_decision_staged": 4,
        "opening_chunk_decision_due": 3}
    assert set(plan_sum_fields(p.sums)) <= ENGINE_COUNTERS and set(plan_sum_fields(p.sums)) <= set(EngineStats.__dataclass_fields__)


def test_engine_sizes_the_first_chunk_for_a_slow_stage(tiny_model_dir):
    """A stage that has measured 10 s rounds: the first chunk takes the limit's tokens; a
    request's own initial_hop is kept as asked. The audio stays complete either way."""
    async def fn(engine: Engine):
        voice = await default_voice(engine)
        engine.stage.rounds.observe(1000, 10.0)
        # Two more utterances in progress, both waiting patiently: the decision's counts
        # must tell those in progress from those due.
        live = engine.stage.live_utterances
        engine.stage.live_utterances = lambda stream=None, skip_patient=False: (  # type: ignore[method-assign]
            live(stream, skip_patient) + (0 if skip_patient else 2))
        out = []
        for opts in (SessionOptions(tokens_per_text_token=6.0, seed=3),
                     SessionOptions(tokens_per_text_token=6.0, seed=3, initial_hop=5)):
            s = engine.open_session(voice, opts)
            uid = await s.submit("A sentence long enough for several chunks of speech here.")
            await s.finish()
            events = await collect(s)
            out.append((events, s.utterance_stats(uid)))
        return out, engine.first_chunks.holdback_s, engine.stats()

    ((planned, st), (asked, st_asked)), holdback, stats = run(tiny_model_dir, fn, warmup=False,
                                                              initial_hop=5, initial_hop_max=40)
    assert stats.first_chunk_tokens == 40 + 5  # the engine's stats count each first chunk's size
    # The planned one's inputs: the measured LM rate, and the 10 s rounds it predicted.
    assert stats.first_chunk_plan_round_seconds >= 10.0 and stats.first_chunk_plan_second_round_seconds >= 10.0
    # The LM step it planned with was timed on its own tokens (>= 1 step between its first
    # and its last): no longer than that utterance's whole LM span.
    assert 0 < stats.first_chunk_plan_lm_step_seconds <= st.finished_at - st.first_token_at
    assert 0 < stats.first_chunk_plan_lm_step_own_seconds <= stats.first_chunk_plan_lm_step_seconds
    # Each session's first utterance: the opening decision is the same one (the second
    # session's own initial_hop was not planned).
    assert (stats.opening_chunk_plan_round_seconds, stats.opening_chunk_plan_lm_step_seconds) \
        == (stats.first_chunk_plan_round_seconds, stats.first_chunk_plan_lm_step_seconds)
    # ... and the sums hold that one decision, with the utterances on the stage then: the
    # planned one, due, and the two waiting patiently.
    assert stats.first_chunk_decisions == stats.opening_chunk_decisions == 1
    assert stats.first_chunk_decision_hop_tokens == 40
    assert stats.first_chunk_decision_round_seconds == stats.first_chunk_plan_round_seconds
    assert stats.opening_chunk_decision_second_round_seconds == stats.first_chunk_plan_second_round_seconds
    assert (stats.first_chunk_decision_staged, stats.first_chunk_decision_due) == (3, 1)
    assert 0 < holdback <= 0.2  # learnt from the first chunks: the vocoder keeps its last frames back
    for events, stats in ((planned, st), (asked, st_asked)):
        assert all(isinstance(e, AudioChunk) for e in events)
        assert sum(len(e.pcm) for e in events) == stats.num_speech_tokens * TOKEN_SAMPLES
    assert st.extra["first_hop"] == 40
    assert len(planned[0].pcm) > 30 * TOKEN_SAMPLES  # more than a 5-token chunk and its next could give
    assert "first_hop" not in st_asked.extra
    assert len(asked[0].pcm) <= 5 * TOKEN_SAMPLES


def test_engine_sizes_a_lone_first_chunk_from_the_idle_floor(tiny_model_dir):
    """Alone on the engine, the planner sizes the first chunk from idle_initial_hop; with
    another utterance there, from initial_hop; with first_chunk_min_hop it may take fewer
    (the schedule waits for no more tokens than that); a request's own initial_hop, and
    fixed chunks (the planner off), are left as they are."""
    floors: list[int] = []

    async def fn(engine: Engine, cases, knobs=None):
        voice = await default_voice(engine)
        engine.first_chunks.tune(knobs or {})
        firsts = []
        for alone, below, opts in cases:
            def planner(sched, *args, below=below, **kwargs):  # the floor, or that many fewer
                floors.append(sched.initial_hop)
                return sched.initial_hop - below
            engine.first_chunks.first_hop = planner
            engine.alone = lambda alone=alone: alone  # the instance's own, over the method
            before = engine.stats().first_chunk_tokens
            s = engine.open_session(voice, opts)
            uid = await s.submit("A sentence long enough for several chunks of speech here.")
            await s.finish()
            events = await collect(s)
            assert all(isinstance(e, AudioChunk) for e in events) and events[-1].is_last
            assert sum(len(e.pcm) for e in events) == s.utterance_stats(uid).num_speech_tokens * TOKEN_SAMPLES
            firsts.append(engine.stats().first_chunk_tokens - before)
        return firsts

    plain = SessionOptions(tokens_per_text_token=6.0, seed=3)
    cases = [(True, 0, plain), (False, 0, plain), (True, 0, SessionOptions(tokens_per_text_token=6.0, seed=3, initial_hop=9))]
    assert run(tiny_model_dir, lambda e: fn(e, cases), warmup=False, initial_hop=10, idle_initial_hop=6,
               initial_hop_max=40) == [6, 10, 9]
    assert floors == [6, 10]  # the request's own first hop is not planned
    floors.clear()
    below = [(False, 1, plain), (False, 3, plain), (True, 2, plain)]
    assert run(tiny_model_dir, lambda e: fn(e, below), warmup=False, initial_hop=10, idle_initial_hop=0,
               first_chunk_min_hop=7, initial_hop_max=40) == [9, 7, 8]
    assert floors == [10, 10, 10]  # idle_initial_hop 0: alone or not
    floors.clear()
    # The planner off (initial_hop_max <= initial_hop): the chunks stay fixed, alone or not.
    assert run(tiny_model_dir, lambda e: fn(e, cases[:2]), warmup=False, initial_hop=10, idle_initial_hop=6,
               first_chunk_min_hop=7, initial_hop_max=0) == [10, 10]
    assert floors == [10, 10]
    floors.clear()
    # ... and so with the planner's limit tuned to the floor (`POST /debug/planner`).
    assert run(tiny_model_dir, lambda e: fn(e, cases[:2], {"limit": 10}), warmup=False, initial_hop=10,
               idle_initial_hop=6, first_chunk_min_hop=7, initial_hop_max=40) == [10, 10]
    assert floors == [10, 10]


def test_outside_a_crowd_the_plan_takes_no_round_longer_than_second_chunks_took():
    """`learnt_rounds_crowd`: round 43's 200 sessions over 16 s, the burst estimate 570 ms a
    round where second chunks took 180-190 ms from their turn with 64 utterances staged.
    Outside a crowd every round of the plan is capped at the longest of those; in a crowd
    (a burst's tens waiting), for a load whose own octave was not measured, or with it off,
    the estimate stands. Only decisions the cap shortened a round of are counted."""
    s = ChunkSchedule(prompt_tokens=106, initial_hop=10)
    burst = lambda offset, hop: 0.57  # noqa: E731
    p = FirstChunkPlanner(limit=40, margin=0.5)
    p.observe(10, 5760, 24000, 1.0)  # the vocoder held 160 ms of 400 back
    for seconds in (0.185, 0.19, 0.18):
        p.learn_second_round(64, seconds)
    assert p.second_rounds.ceiling(64) == p.second_rounds.ceiling(127) == 0.19
    assert p.second_rounds.ceiling(128) is None and p.second_rounds.ceiling(32) is None
    off = p.first_hop(s, 0.007, burst, 1.0, staged=64, sizing=2)
    assert off == plan_first_hop(s, 40, 0.007, burst, 0.16, margin=0.5, later_round_s=0.185)
    assert p.learnt_round_plans == 0 and p.last.second_round_s == 0.57
    p.tune({"learnt_rounds_crowd": 16})
    assert p.snapshot()["learnt_rounds_crowd"] == 16
    on = p.first_hop(s, 0.007, burst, 1.0, staged=64, sizing=2)
    capped = lambda offset, hop: 0.19  # noqa: E731
    assert on == plan_first_hop(s, 40, 0.007, capped, 0.16, margin=0.5, later_round_s=0.185) < off
    assert p.learnt_round_plans == 1
    assert p.last.first_round_s == p.last.second_round_s == 0.19
    assert p.first_hop(s, 0.007, burst, 1.0, staged=64, sizing=16) == off  # a crowd: a burst's estimate
    assert p.first_hop(s, 0.007, burst, 1.0, sizing=2) == plan_first_hop(s, 40, 0.007, burst, 0.16, margin=0.5)
    # 128 staged: 64's rounds would be a lighter load's (`predict` still floors by them).
    assert p.first_hop(s, 0.007, burst, 1.0, staged=128, sizing=2) == off
    assert p.learnt_round_plans == 1
    short = lambda offset, hop: 0.03  # noqa: E731  estimates below the cap are kept, and not counted
    assert p.first_hop(s, 0.007, short, 1.0, staged=64, sizing=2) == plan_first_hop(
        s, 40, 0.007, short, 0.16, margin=0.5, later_round_s=0.185)
    assert p.last.first_round_s == 0.03
    unmeasured = lambda offset, hop: None  # noqa: E731  no round yet: the schedule's own hop
    assert p.first_hop(s, 0.007, unmeasured, 1.0, staged=64, sizing=2) == 10
    assert p.learnt_round_plans == 1
    # Below the floor (`min_hop`) the capped rounds are what the shortest safe hop is judged on.
    fast = FirstChunkPlanner(limit=40, margin=0.5, min_hop=8, min_hop_crowd=100, learnt_rounds_crowd=16)
    fast.observe(10, 5760, 24000, 1.0)
    for seconds in (0.05, 0.04, 0.05):
        fast.learn_second_round(64, seconds)
    hop = fast.first_hop(s, 0.004, burst, 1.0, staged=64, sizing=2)
    quick = lambda offset, hop: 0.05  # noqa: E731
    chosen = plan_first_hop(s, 40, 0.004, quick, 0.16, margin=0.5, later_round_s=0.05)
    assert hop == shortest_as_safe(s, chosen, 8, 0.004, quick, 0.16, margin=0.5, later_round_s=0.05) < 10


def test_planner_knobs_are_tuned_all_or_nothing():
    p = FirstChunkPlanner(limit=40, margin=0.5)
    p.tune({"min_hop": 8, "idle_hop": 7, "margin": 0.25, "min_hop_crowd": 64})
    assert (p.min_hop, p.idle_hop, p.margin, p.min_hop_crowd) == (8, 7, 0.25, 64)
    assert p.snapshot()["min_hop"] == 8 and p.snapshot()["idle_hop"] == 7 and p.snapshot()["min_hop_crowd"] == 64
    p.tune({"margin": 1})  # an integer margin is a number
    assert p.margin == 1.0 and isinstance(p.margin, float)
    p.tune({"skip_patient": True})
    assert p.skip_patient is True and p.snapshot()["skip_patient"] is True
    p.tune({"due_rounds": True})
    assert p.due_rounds is True and p.snapshot()["due_rounds"] is True
    with pytest.raises(ValueError, match="due_rounds must be true or false"):
        p.tune({"due_rounds": "yes"})
    p.tune({"hold_refresh": True})
    assert p.hold_refresh is True and p.snapshot()["hold_refresh"] is True
    with pytest.raises(ValueError, match="hold_refresh must be true or false"):
        p.tune({"hold_refresh": 1})
    with pytest.raises(ValueError, match="skip_patient must be true or false"):
        p.tune({"skip_patient": 1})
    for bad, says in (({"holdback_s": 0.1}, "not tunable"), ({"min_hop": 8.5}, "an integer"), ({"min_hop": True}, "an integer"),
                      ({"min_hop": -1}, "within [0, 40]"), ({"idle_hop": 41}, "within [0, 40]"),
                      ({"min_hop_crowd": -1}, "within [0, 10000]"), ({"learnt_rounds_crowd": -1}, "within [0, 10000]"),
                      ({"margin": float("nan")}, "within"), ({"margin": "0.5"}, "a number"),
                      ({"min_hop": 6, "margin": -0.1}, "margin")):
        with pytest.raises(ValueError, match=re.escape(says)):
            p.tune(bad)
    assert (p.min_hop, p.idle_hop, p.margin) == (8, 7, 1.0)  # nothing of a refused call was set


def test_the_limit_is_tuned_within_the_configured_one():
    """`limit` may go down and back up to the configured `initial_hop_max`, not past it
    (the stage warmed its shapes for that), and a plan that finds no first chunk playing
    through takes the tuned limit; other counts of tokens stay bounded by the configured one."""
    s = ChunkSchedule(prompt_tokens=106, initial_hop=10, max_hop=100, lookahead=3)
    slow = lambda offset, hop: 2.0  # noqa: E731  (rounds no first chunk covers)
    p = FirstChunkPlanner(limit=40, margin=0.5)
    assert p.first_hop(s, 0.01, slow, 1.0) == 40
    p.tune({"limit": 30})
    assert p.limit == 30 and p.snapshot()["limit"] == 30 and p.first_hop(s, 0.01, slow, 1.0) == 30
    p.tune({"idle_hop": 35})  # bounded by the configured 40, not the tuned 30
    p.tune({"limit": 8})  # at or below the schedule's floor: not planned
    assert p.first_hop(s, 0.01, slow, 1.0) == 10
    p.tune({"limit": 40})
    assert p.first_hop(s, 0.01, slow, 1.0) == 40
    with pytest.raises(ValueError, match=re.escape("limit must be within [0, 40]")):
        p.tune({"limit": 41})
    assert p.limit == 40 and p.limit_ceiling == 40


def test_skip_patient_deadline_holdback_learnt_rounds_and_hold_refresh_reach_the_engine_config(tmp_path):
    from gateway.app import engine_config
    from gateway.settings import load_settings

    default = engine_config(load_settings([], environ={})[0], tmp_path)
    assert default.first_chunk_skip_patient is False and default.first_chunk_deadline_holdback is True
    s, _ = load_settings(["--engine.first-chunk-skip-patient", "true",
                          "--engine.first-chunk-deadline-holdback", "false"], environ={})
    assert engine_config(s, tmp_path).first_chunk_skip_patient is True
    assert engine_config(s, tmp_path).first_chunk_deadline_holdback is False
    assert default.first_chunk_learnt_rounds_crowd == 0
    s, _ = load_settings(["--engine.first-chunk-learnt-rounds-crowd", "16"], environ={})
    assert engine_config(s, tmp_path).first_chunk_learnt_rounds_crowd == 16
    assert default.first_chunk_due_rounds is True
    s, _ = load_settings(["--engine.first-chunk-due-rounds", "false"], environ={})
    assert engine_config(s, tmp_path).first_chunk_due_rounds is False
    assert default.first_chunk_hold_refresh is False
    s, _ = load_settings(["--engine.first-chunk-hold-refresh", "true"], environ={})
    assert engine_config(s, tmp_path).first_chunk_hold_refresh is True


def test_audio_in_flight_leaves_out_the_first_chunks_holdback():
    """A first chunk of 8 tokens plays 320 - 160 ms: the vocoder keeps its last 160 ms back
    for the next chunk. Once the utterance's audio covered that, each chunk gives back as
    much as it keeps, so its tokens' worth is what it adds; after a first chunk of 3 tokens
    (no audio at all) the next one still falls short by the rest."""
    p = FirstChunkPlanner(limit=40, margin=0.5)
    assert p.audio_in_flight(0, 8, 1.0) == pytest.approx(0.32)  # nothing learnt yet
    p.holdback_s = 0.16
    assert p.audio_in_flight(0, 8, 1.0) == pytest.approx(0.16)
    assert p.audio_in_flight(8, 8, 1.0) == pytest.approx(0.32)
    assert p.audio_in_flight(8, 8 + 25, 1.0) == pytest.approx(1.32)  # two chunks in flight
    assert p.audio_in_flight(0, 10, 2.0) == pytest.approx(0.2 - 0.16)  # output seconds
    assert p.audio_in_flight(0, 3, 1.0) == 0.0  # all of it held back
    assert p.audio_in_flight(3, 8, 1.0) == pytest.approx(0.44 - 0.16)  # 40 ms of the hold still kept
    assert p.audio_in_flight(5, 0, 1.0) == 0.0
    p.tune({"deadline_holdback": False})
    assert p.snapshot()["deadline_holdback"] is False
    assert p.audio_in_flight(0, 8, 1.0) == pytest.approx(0.32)
    with pytest.raises(ValueError, match="deadline_holdback must be true or false"):
        p.tune({"deadline_holdback": "no"})


def test_negative_first_chunk_floors_are_refused(tiny_model_dir):
    for field in ("idle_initial_hop", "first_chunk_min_hop", "first_chunk_min_hop_crowd",
                  "first_chunk_learnt_rounds_crowd"):
        with pytest.raises(ValueError, match="must be >= 0"):
            EngineConfig(model_dir=tiny_model_dir, **{field: -1})


def test_engine_counts_the_utterances_waiting_for_their_first_chunk(tiny_model_dir):
    """The planner is told how many other utterances wait for their first chunk (`sizing`):
    of two sessions' utterances started together, the first to be sized sees the other.
    Once first chunks are on the stage none is counted, nor one cancelled before its first
    chunk went. With `first_chunk_min_hop`, a decision made with as many others waiting as
    `first_chunk_min_hop_crowd` is counted as crowded."""
    seen: list[tuple[int, int]] = []

    async def fn(engine: Engine):
        voice = await default_voice(engine)
        plan = engine.first_chunks.first_hop
        cancel: list = []

        def planner(sched, *args, **kwargs):
            seen.append((kwargs["sizing"], engine.first_chunks_pending))
            if cancel:  # wait for more tokens than there will be before the cancel
                asyncio.get_running_loop().create_task(cancel.pop()())
                return 40
            return plan(sched, *args, **kwargs)
        engine.first_chunks.first_hop = planner
        opts = SessionOptions(tokens_per_text_token=6.0, seed=3)
        sessions = [engine.open_session(voice, opts) for _ in range(2)]
        for s in sessions:
            await s.submit("A sentence long enough for several chunks of speech here.")
            await s.finish()
        for s in sessions:
            assert all(isinstance(e, AudioChunk) for e in await collect(s))
        after = [engine.first_chunks_pending]
        s = engine.open_session(voice, opts)
        uid = await s.submit("Another sentence long enough for several chunks, cancelled first.")
        cancel.append(lambda: s.cancel(uid))
        await s.finish()
        events = await collect(s)
        assert not cancel and not any(isinstance(e, AudioChunk) for e in events)
        return after + [engine.first_chunks_pending, engine.stats().first_chunk_crowded]

    *pending, crowded = run(tiny_model_dir, fn, warmup=False, initial_hop=10, initial_hop_max=40,
                            first_chunk_min_hop=7, first_chunk_min_hop_crowd=1)
    assert pending == [0, 0]
    assert seen[0] == (1, 2)  # the other utterance had not queued its first chunk yet
    assert seen[-1] == (0, 1)  # the cancelled one, alone
    assert all(sizing == waiting - 1 for sizing, waiting in seen)
    # The decisions the planner made (not the cancelled one's) with the other one waiting.
    assert crowded == sum(sizing >= 1 for sizing, _ in seen[:-1]) >= 1


def test_a_first_chunk_that_waits_behind_playing_audio_is_not_in_the_crowd(tiny_model_dir, monkeypatch):
    """A session's next utterance starts while the one before it plays: its first chunk is
    not awaited (it waits for a patient, bigger cut) and does not count among the
    utterances waiting for a first chunk, which would keep `first_chunk_min_hop_crowd`'s
    gate shut for every session that speaks more than once."""
    from engine.session import Session
    counted: list[int] = []
    awaited = Session._first_chunk_awaited

    def spy(self, utt):
        if not utt.first_chunk_pending:
            counted.append(utt.uid)
        awaited(self, utt)
    monkeypatch.setattr(Session, "_first_chunk_awaited", spy)

    async def fn(engine: Engine):
        voice = await default_voice(engine)
        s = engine.open_session(voice, SessionOptions(tokens_per_text_token=6.0, seed=3))
        first = await s.submit("A first sentence, long enough for seconds of speech to play before the next one, "
                               "and then a little more of it.")
        second = await s.submit("Then a second one.")
        await s.finish()
        events = await collect(s)
        assert {e.utterance_id for e in events if isinstance(e, AudioChunk)} == {first, second}
        return first, engine.patient_chunks, engine.first_chunks_pending

    first, patient, pending = run(tiny_model_dir, fn, warmup=False, initial_hop=10, initial_hop_max=40,
                                  chunk_patience_s=1.0)
    assert counted == [first]  # the second utterance's first chunk played behind the first's audio
    assert patient >= 1 and pending == 0


@pytest.mark.parametrize("skip, due", [(False, False), (True, False), (False, True)])
def test_patient_chunks_are_marked_and_the_plan_may_leave_their_utterances_out(tiny_model_dir, skip, due):
    """The chunks cut big behind playing audio go to the stage marked patient, the others
    not; the first chunk's plan asks the stage's round estimate to leave the utterances
    waiting patiently out when `first_chunk_skip_patient` says so, and out of the number
    of rounds when `first_chunk_due_rounds` does; so does the round a first chunk would
    miss, asked for the stage's hold (`first_chunk_hold_share`)."""
    async def fn(engine: Engine):
        voice = await default_voice(engine)
        engine.stage.rounds.observe(100, 0.3)  # a slow round: the planner asks for estimates, plans long
        submitted: list[tuple[int, bool]] = []
        asked: set[tuple[bool, bool]] = set()
        submit, estimate = engine.stage.submit, engine.stage.round_estimate

        def submit_spy(job):
            submitted.append((job.chunk_index, job.patient))
            return submit(job)

        def estimate_spy(stream, frames, cached=0, skip_patient=False, due_rounds=False):
            asked.add((skip_patient, due_rounds))
            return estimate(stream, frames, cached, skip_patient, due_rounds)
        engine.stage.submit, engine.stage.round_estimate = submit_spy, estimate_spy
        s = engine.open_session(voice, SessionOptions(tokens_per_text_token=6.0, seed=3))
        await s.submit("A first sentence, long enough for seconds of speech to play before the next one, "
                       "and then a little more of it.")
        await s.submit("Then a second one.")
        await s.finish()
        await collect(s)
        state = engine.planner_state()
        return submitted, asked, engine.patient_chunks, (state["skip_patient"], state["due_rounds"])

    submitted, asked, patient, state = run(tiny_model_dir, fn, warmup=False, initial_hop=10, initial_hop_max=40,
                                           chunk_patience_s=1.0, first_chunk_skip_patient=skip,
                                           first_chunk_due_rounds=due, first_chunk_hold_share=0.2)
    assert submitted[0] == (0, False) and sum(p for _, p in submitted) == patient >= 1
    assert asked == {(skip, due)} and state == (skip, due)


def test_engine_is_alone_with_one_utterance_decoding_and_on_the_stage(tiny_model_dir):
    async def fn(engine: Engine):
        seen = [engine.alone()]
        engine.lm_streams = 1
        seen.append(engine.alone())
        engine.lm_streams = 2  # another one decoding
        seen.append(engine.alone())
        engine.lm_streams = 1
        streams = [engine.stage.new_stream() for _ in range(2)]  # two utterances on the stage
        seen.append(engine.alone())
        del streams[1]
        seen.append(engine.alone())
        engine.lm_streams = 0
        return seen

    assert run(tiny_model_dir, fn, warmup=False) == [True, True, False, False, True]


def test_engine_learns_the_lm_rate_from_utterances_past_their_first_tokens(tiny_model_dir):
    """Once per utterance, into the session's-first table for the first one and the other
    table for the next (a burst's openings decode beside other rounds than later ones)."""
    async def fn(engine: Engine):
        voice = await default_voice(engine)
        s = engine.open_session(voice, SessionOptions(tokens_per_text_token=6.0, seed=3))
        uids = [await s.submit(text) for text in ("A sentence long enough for several chunks of speech here.",
                                                  "And a second sentence, as long as the first one was.")]
        await s.finish()
        await collect(s)
        planner = engine.first_chunks
        return planner.opening_lm_steps, planner.lm_steps, engine.lm_streams, [s.utterance_stats(u) for u in uids]

    opening, later, streams, stats = run(tiny_model_dir, fn, warmup=False, initial_hop=5, initial_hop_max=40)
    assert streams == 0  # none decoding once it is done
    assert all(st.num_speech_tokens > 2 * STEP_FROM for st in stats)
    for steps, st in zip((opening, later), stats):  # the session's first utterance, then its second
        assert list(steps.sizes) == [0]  # one utterance decoding: the first octave
        (seen,) = steps.sizes[0]  # once per utterance
        # Timed over >= STEP_FROM steps between its tokens: at most its LM span / STEP_FROM.
        assert 0 < seen <= (st.finished_at - st.first_token_at) / STEP_FROM


def test_engine_learns_second_rounds_per_stage_load_and_plans_on_them(tiny_model_dir):
    """Each utterance's second chunk is timed from its turn to its audio, keyed by the
    utterances on its stage when it was queued; a first chunk is planned with that load."""
    asked = []

    async def fn(engine: Engine):
        planner = engine.first_chunks
        plan = planner.first_hop

        def spy(*args, **kwargs):
            asked.append(kwargs["staged"])
            return plan(*args, **kwargs)

        planner.first_hop = spy  # type: ignore[method-assign]
        voice = await default_voice(engine)
        s = engine.open_session(voice, SessionOptions(tokens_per_text_token=6.0, seed=3))
        uid = await s.submit("A sentence long enough for several chunks of speech here.")
        await s.finish()
        await collect(s)
        return planner.second_rounds, s.utterance_stats(uid)

    rounds, st = run(tiny_model_dir, fn, initial_hop=5, initial_hop_max=40)
    assert asked == [1]  # its own stream: one utterance on the stage
    assert list(rounds.sizes) == [0]
    # One second chunk: the warm-up's (one alone, thrice, then four together here) taught
    # nothing, as their first ones may wait behind graph captures on a GPU.
    (seen,) = rounds.sizes[0]
    assert 0 < seen <= st.finished_at - st.submitted_at  # timed within that utterance's life


@pytest.mark.parametrize("crowd", [0, 16])
def test_engine_plans_on_the_learnt_rounds_outside_a_crowd_when_set(tiny_model_dir, crowd):
    """`first_chunk_learnt_rounds_crowd` reaches the planner, and the engine's stats count
    the decisions that took the learnt rounds: the second session's first chunk, once the
    first session's second chunk taught a round for one utterance on the stage. Whether a
    learnt round shortens a planned one depends on the two times; the test then sets the
    learnt one to a microsecond, shorter than any planned, so it does."""
    taught = []

    async def fn(engine: Engine):
        voice = await default_voice(engine)
        rounds = engine.first_chunks.second_rounds
        for seed in (3, 4):
            s = engine.open_session(voice, SessionOptions(tokens_per_text_token=6.0, seed=seed))
            await s.submit("A sentence long enough for several chunks of speech here.")
            await s.finish()
            await collect(s)
            if seed == 3:
                taught.append(rounds.ceiling(1))
                rounds.sizes.clear()
                rounds.observe(1, 1e-6)
        return engine.first_chunks, engine.stats()

    planner, stats = run(tiny_model_dir, fn, initial_hop=5, initial_hop_max=40,
                         first_chunk_learnt_rounds_crowd=crowd)
    assert planner.learnt_rounds_crowd == crowd
    assert taught[0] is not None and taught[0] > 0  # the first session taught one
    assert stats.first_chunk_learnt_rounds == planner.learnt_round_plans == (1 if crowd else 0)


async def three_utterances_of_two_sessions(engine: Engine) -> EngineStats:
    """Two sessions, one after the other: the first speaks two utterances, the second one.
    The engine's stats after them."""
    voice = await default_voice(engine)
    for texts in (["One sentence here.", "And another one."], ["A third."]):
        s = engine.open_session(voice, SessionOptions(tokens_per_text_token=3.0, seed=1))
        for text in texts:
            await s.submit(text)
        await s.finish()
        assert all(isinstance(e, AudioChunk) for e in await collect(s))
    return engine.stats()


def test_engine_counts_sessions_first_utterances_apart(tiny_model_dir):
    """Every utterance's first chunk is in the first_chunk sums; only a session's first
    utterance's is also in the opening_chunk ones (what a listener waits for in silence)."""
    hops = []

    async def fn(engine: Engine):
        hops.append(engine.config.initial_hop)
        return await three_utterances_of_two_sessions(engine)

    st = run(tiny_model_dir, fn, warmup=False)
    assert (st.first_chunks, st.opening_chunks) == (3, 2)
    (hop,) = hops
    assert st.opening_chunk_tokens == 2 * hop < st.first_chunk_tokens == 3 * hop  # fixed first chunks
    assert (st.opening_chunk_planned_tokens, st.first_chunk_planned_tokens) == (2 * hop, 3 * hop)
    for phase in ("lm_first_token", "lm_decode", "stage_wait", "stage"):
        assert 0 <= getattr(st, f"opening_chunk_{phase}_seconds") <= getattr(st, f"first_chunk_{phase}_seconds")
    assert st.opening_chunk_stage_seconds > 0


@pytest.mark.parametrize("bar", [0.0, 1e9])
def test_engine_sums_the_slow_opening_chunks_apart(tiny_model_dir, monkeypatch, bar):
    """A session's first utterance whose first chunk took `SLOW_OPENING_S` or longer from
    its text to its audio is also in the slow_opening_chunk sums, with the same phases; a
    quicker one, or a later utterance's, is not. (The bar is moved, not the clock: a bar of
    0 makes every opening chunk slow, one of 1e9 none.)"""
    monkeypatch.setattr("engine.stats.SLOW_OPENING_S", bar)
    st = run(tiny_model_dir, three_utterances_of_two_sessions, warmup=False)
    assert (st.first_chunks, st.opening_chunks) == (3, 2)
    if bar:
        assert st.slow_opening_chunks == 0 and st.slow_opening_chunk_stage_seconds == 0
        return
    assert st.slow_opening_chunks == 2  # not the second utterance of the first session
    for phase in ("lm_first_token_seconds", "lm_decode_seconds", "stage_wait_seconds", "stage_seconds", "tokens",
                  "planned_tokens", "batch_rows"):
        assert getattr(st, f"slow_opening_chunk_{phase}") == getattr(st, f"opening_chunk_{phase}")
    assert st.slow_opening_chunk_stage_seconds > 0


def test_the_warm_up_is_not_in_the_first_chunk_sums(tiny_model_dir):
    """The engine's warm-up syntheses (sessions of their own, before it is ready, some behind
    graph captures) add nothing to the first and second chunks' sums: one session after it
    is one first chunk, one opening chunk and one opening second chunk."""
    async def fn(engine: Engine):
        assert engine.config.warmup
        voice = await default_voice(engine)
        s = engine.open_session(voice, SessionOptions(tokens_per_text_token=6.0, seed=3))
        await s.submit("A sentence long enough for several chunks of speech here.")
        await s.finish()
        assert all(isinstance(e, AudioChunk) for e in await collect(s))
        return engine.stats()

    st = run(tiny_model_dir, fn, initial_hop=6)
    assert (st.first_chunks, st.opening_chunks, st.opening_second_chunks) == (1, 1, 1)


def test_an_opening_chunk_is_slow_from_its_text_to_its_audio():
    """Slow means text submitted to audio back at the bar or over it, whatever the phases
    between; each sum of first-chunk phases is a counter in `/metrics`."""
    assert SLOW_OPENING_S == 0.5
    assert is_slow_opening((10.0, 10.1, 10.3, 10.4, 10.5))  # at the bar, the stage only 0.1 s of it
    assert not is_slow_opening((10.0, 10.1, 10.3, 10.4, 10.49))
    assert is_slow_opening((10.0, 10.45, 10.46, 10.47, 10.6))
    for kind in ("first_chunk", "opening_chunk", "slow_opening_chunk"):
        assert set(FirstChunkTimes().stats_fields(kind)) <= ENGINE_COUNTERS


def test_engine_times_the_opening_second_chunks(tiny_model_dir):
    """The second chunk of a session's first utterance (the one a short first chunk must
    cover) is timed from its tokens being ready to its audio; a later utterance's is not.
    A stage made slow (every batch waits 300 ms here) brings it after the first chunk's
    audio has run out: counted late. (A first chunk with no audio of its own is not
    covered by anything: its utterance's second chunk is not counted.)"""
    async def fn(engine: Engine, delay: float):
        voice = await default_voice(engine)
        stage = engine.stage
        launch = stage._launch  # a round's work, pipelined or not

        def slow(batch, *args, **kwargs):
            time.sleep(delay)  # the stage's worker thread: a slow GPU, not a test's synchronisation
            return launch(batch, *args, **kwargs)

        stage._launch = slow
        s = engine.open_session(voice, SessionOptions(tokens_per_text_token=4.0, seed=2))
        for text in ("A sentence long enough for a few chunks.", "And a second one after it."):
            await s.submit(text)
        await s.finish()
        assert all(isinstance(e, AudioChunk) for e in await collect(s))
        return engine.stats()

    st = run(tiny_model_dir, lambda e: fn(e, 0.0), warmup=False, initial_hop=6)
    assert st.opening_second_chunks == 1  # the session's first utterance only
    assert st.opening_second_chunk_ready_wait_seconds >= 0 and st.opening_second_chunk_stage_seconds > 0
    assert st.opening_second_chunk_stage_wait_seconds >= 0
    slow = run(tiny_model_dir, lambda e: fn(e, 0.3), warmup=False, initial_hop=6)
    # A 6-token first chunk plays at most 240 ms (less what the vocoder holds back): the
    # second chunk runs in the batch after it, 300 ms or more, and is late by 60 ms or
    # more; its first chunk ran alone.
    assert slow.opening_second_chunks == 1 and slow.opening_second_chunk_lates == 1
    assert slow.opening_second_chunk_close_calls == 1  # a late one is a close call too
    assert slow.opening_second_chunk_stage_seconds >= 0.3 and slow.opening_second_chunk_late_seconds >= 0.06
    assert slow.opening_second_chunk_late_first_rows == 1
    # Where its lateness came from, the one second chunk being late: the wait for the first
    # chunk's round and its own round (300 ms or more each; it holds the chunk, maybe with
    # the next utterance's first one), not its tokens (the LM is done long before).
    assert (slow.opening_second_chunk_late_stage_wait_seconds, slow.opening_second_chunk_late_stage_seconds) \
        == (slow.opening_second_chunk_stage_wait_seconds, slow.opening_second_chunk_stage_seconds)
    assert slow.opening_second_chunk_late_stage_seconds >= 0.3 and slow.opening_second_chunk_late_rows >= 1
    assert 0 <= slow.opening_second_chunk_late_ready_seconds < 0.3
    assert (st.opening_second_chunk_late_rows == 0) == (st.opening_second_chunk_lates == 0)  # late or not
    # Its first chunk plays less than the cuts' margin (250 ms), so its deadline as a cut
    # judges it had passed before it was even queued: no cut would have tried to save it.
    assert slow.opening_second_chunk_past_due == slow.opening_second_chunk_late_past_due == 1
    assert st.opening_chunks == 1 and st.opening_chunk_batch_rows == 1 and st.first_chunk_batch_rows >= 2


def test_second_chunks_no_cut_would_save_are_counted() -> None:
    """A second chunk whose deadline as the deadline cut judges it had passed when its round
    began (`BatchStart.past_due`) is counted past due, and again among the late ones when it
    was late: on time, late, on time."""
    times = SecondChunkTimes()
    times.add(0.0, 0.1, 0.2, 0.3, 0.5, 1, 0.05, 2, past_due=False)
    times.add(0.0, 0.1, 0.2, 0.6, 0.5, 1, 0.05, 3, past_due=True)  # and late
    times.add(0.0, 0.1, 0.2, 0.3, 0.5, 1, 0.05, 2, past_due=True)  # in time all the same
    assert (times.count, times.lates, times.past_due, times.late_past_due) == (3, 1, 2, 1)
    fields = times.stats_fields()
    assert (fields["opening_second_chunk_past_due"], fields["opening_second_chunk_late_past_due"]) == (2, 1)
    assert set(fields) <= ENGINE_COUNTERS
    # The cuts' shift: none at the default margin (the deadlines' own), later deadlines below it.
    assert EngineConfig(model_dir=".").cut_shift_s() == 0.0
    assert EngineConfig(model_dir=".", stage_deadline_cut_margin_ms=50).cut_shift_s() == pytest.approx(0.2)


@pytest.mark.parametrize("max_batch", [64, 1])
def test_stage_round_estimate_counts_the_utterances_in_progress(tiny_model_dir, max_batch):
    """A round for every live vocoder stream's chunk: one batch of them all, or as many
    rounds as they fill batches; a stream dropped with its utterance no longer counts."""
    async def fn(engine: Engine):
        stage = engine.stage
        first = stage.new_stream()
        assert stage.round_estimate(first, 500) is None  # no batch measured yet
        stage.rounds.observe(1000, 0.1)  # proportional above 1000 frames, 0.1 s below
        second = stage.new_stream()
        two = stage.round_estimate(first, 800)
        del second
        gc.collect()
        return two, stage.round_estimate(first, 800)

    two, one = run(tiny_model_dir, fn, warmup=False, max_gpu_batch=max_batch)
    # 64: both chunks in one batch of 1600 frames; 1: two rounds of 800 frames each.
    assert two == pytest.approx(0.16 if max_batch == 64 else 0.2)
    assert one == pytest.approx(0.1)


def test_finished_utterances_do_not_count_as_in_progress(tiny_model_dir):
    """Once an utterance is done its stream is gone at once (no garbage collection
    needed): the stage's loop used to hold its last batch until the next one, so a
    finished burst's utterances counted into the next burst's predicted rounds."""
    async def fn(engine: Engine):
        voice = await default_voice(engine)
        opts = SessionOptions(tokens_per_text_token=3.0, seed=1)
        await asyncio.gather(*(engine.synthesize("One sentence here.", voice, opts) for _ in range(3)))
        return engine.stats().batches, engine.stage.live_utterances()

    enabled = gc.isenabled()
    gc.disable()
    try:
        batches, live = run(tiny_model_dir, fn, warmup=False)
    finally:
        if enabled:
            gc.enable()
    assert batches > 0 and live == 0


def test_round_estimate_plans_on_the_shape_a_graph_solves(tiny_model_dir):
    """With flow graphs, rounds are learnt at the graph's padded shape, so a prediction
    asks for that shape too: 40 one-voice chunks run in the 64-row graph and cost what a
    64-row round costs, not 40/64 of it. Without graphs the batch runs as it is."""
    async def fn(engine: Engine):
        stage = engine.stage
        policy = stage.graph_policy
        streams = [stage.new_stream() for _ in range(40)]
        full, frames = policy.bucket(40, 24, 212, shared=True)
        stage.rounds.observe(64 * 50, 0.15)  # a 64-row first-chunk round in the graph
        stage.rounds.observe(50, 0.03)  # a one-row one
        eager = stage.round_estimate(streams[0], 24, cached=212)
        stage.flow_cuda_graphs = True  # as on a GPU (the estimate reads only the policy)
        try:
            graph = stage.round_estimate(streams[0], 24, cached=212)
        finally:
            stage.flow_cuda_graphs = False
        return (full, frames), eager, graph

    shape, eager, graph = run(tiny_model_dir, fn, warmup=False, max_gpu_batch=64)
    assert shape == (64, 50)
    assert graph == pytest.approx(0.15)
    assert eager == pytest.approx(0.03 + 0.12 * (40 * 24 - 50) / (64 * 50 - 50))


@pytest.mark.parametrize("together", [0, 1, 3, None])
def test_warm_up_runs_sentences_together_for_the_round_times(tiny_model_dir, together):
    """Several sentence-long utterances at once (None: CPU_WARMUP_CONCURRENCY on the CPU),
    so the round times hold batches of several rows, long chunks among them; and one such
    utterance alone, twice, for one-row rounds (the first captures, the second counts)."""
    async def fn(engine: Engine):
        st = engine.stats()
        return st.max_batch_size, st.chunks, engine.lm_tokens, engine.stage.rounds.predict(1000)

    largest, chunks, tokens, predicted = run(tiny_model_dir, fn, warmup=True, warmup_concurrency=together)
    n = CPU_WARMUP_CONCURRENCY if together is None else together
    assert chunks > 0 and predicted is not None  # the warm-up's batches were measured
    assert (largest > 1) == (n > 1)
    # One short utterance, then (n >= 1) two alone and (n > 1) n together of
    # WARMUP_SPEECH_TOKENS each.
    sentences = 0 if n < 1 else 2 + (n if n > 1 else 0)
    assert sentences * WARMUP_SPEECH_TOKENS <= tokens < (sentences + 1) * WARMUP_SPEECH_TOKENS


def test_batches_that_capture_or_compile_are_not_rounds(tiny_model_dir):
    """A batch that captured a graph or compiled took seconds once: its time must not
    enter the round times, which keep each size's latest batches."""
    async def fn(engine: Engine):
        stage = engine.stage
        voice = await default_voice(engine)
        opts = SessionOptions(tokens_per_text_token=4.0, seed=0)
        await engine.synthesize("Hello there.", voice, opts)
        weight = stage.rounds.observed
        batches = engine.stats().batches
        counts = iter(range(1_000_000))
        stage._one_off_work = lambda: (next(counts), 0, 0)  # every batch "captured" something
        await engine.synthesize("Hello there, and once more.", voice, opts)
        return weight, batches, stage.rounds.observed, engine.stats().batches

    weight, batches, weight_after, batches_after = run(tiny_model_dir, fn, warmup=False)
    assert weight > 0 and batches_after > batches
    assert weight_after == weight


def test_plan_cost_bench_plans_both_loads() -> None:
    """`bench.plan_cost`: one session keeps the initial hop; a burst at 12 ms a token tries
    hops up to a longer one, asking for more round predictions."""
    from bench.plan_cost import main as plan_cost

    light, burst = plan_cost(["--reps", "3"])["results"]
    assert (light["sessions"], light["first_hop"]) == (1, 6)
    assert burst["sessions"] == 64 and burst["first_hop"] > 6
    assert burst["round_predictions_per_plan"] > light["round_predictions_per_plan"] > 0
    assert light["ms_per_plan"] > 0 and burst["ms_per_plan"] > 0


def test_the_vocoder_holdback_is_learnt_in_output_seconds_whatever_the_speed() -> None:
    """The vocoder holds back 8 frames of stretched output: 0.16 s of audio at any speed.
    Learnt in speed-1 seconds it was 0.16 x speed, the largest kept: one speed-4 session
    made every later speed-1 plan count its first chunk 0.48 s shorter (first chunks of
    23 tokens instead of 9)."""
    sr, held = 24000, 0.16
    planner = FirstChunkPlanner(limit=40)
    for tokens, speed in ((10, 1.0), (40, 4.0), (20, 0.5)):
        samples = round((tokens * 0.04 / speed - held) * sr)
        planner.observe(tokens, samples, sr, speed)
        assert planner.holdback_s == pytest.approx(held)
    # The plan's audio is the chunk's audio at its speed, less the held frames.
    schedule = ChunkSchedule(prompt_tokens=106, initial_hop=10, max_hop=100, lookahead=3)

    def round_s(offset: int, hop: int) -> float:
        return 0.0

    for speed in (1.0, 2.0):
        spare = slack(schedule, 10, 0.0, round_s, held, speed=speed, margin=0.0)
        assert spare == pytest.approx(10 * 0.04 / speed - held)


def test_rounds_counted_for_the_due_alone_plan_a_shorter_first_chunk_past_the_stage_rows():
    """80 utterances in progress, 16 of them due: the whole-crowd estimate plans two 64-row
    rounds a chunk and so a longer first chunk than the same load counted in one round
    (`first_chunk_due_rounds`); below 64 in progress the two plan alike."""
    rounds = RoundTimes()
    for rows, wall in ((1, 0.02), (8, 0.04), (64, 0.14)):  # rows of 100 frames (an H100's, round 52)
        rounds.observe(rows * 100, wall)
    s = ChunkSchedule(prompt_tokens=106, initial_hop=10, max_hop=150, lookahead=3)

    def plan(live: int, due: int | None) -> int:
        p = FirstChunkPlanner(limit=40, margin=0.5)
        frames = lambda offset, hop: 2 * (hop + 3) + 2 * min(offset, 25)  # noqa: E731  (window: hop, look, context)
        return p.first_hop(s, 0.007, lambda offset, hop: estimate_round(rounds, live, 64, None, frames(offset, hop), 0, due),
                           1.0)

    crowd, due = plan(80, None), plan(80, 16)
    assert 10 <= due < crowd <= 40
    assert plan(60, None) == plan(60, 16) == due  # one round either way
