"""How long an utterance's first chunk is, from the load it starts into.

Playback starts when the first chunk arrives, and from then on each later chunk has to
arrive before the audio already delivered runs out. The LM keeps generating while the
stage works, so chunk k is ready once the LM has its tokens, and is done one stage round
after that or after chunk k-1 is done, whichever is later (one stage, one batch at a
time; the engine queues chunk k as soon as its tokens are there and the stage took chunk
k-1, `AudioStage.submit`). A round grows with the flow work of the batch: rows x frames,
and later chunks have wider windows (left context plus a hop that doubles). On the H200 (round 8 of
docs/benchmarks.md) 64 sessions starting together all stalled once, either right after a
15-token first chunk (440 ms of audio: the vocoder keeps its last frames back until more
mel arrives) or, with a first chunk sized for the second one only, after the second
chunk, when the third (50 tokens) took a longer round.

So the first chunk starts at the configured `initial_hop` (first audio as early as the
model allows at light load) and takes more tokens only when this timeline, with the
measured LM rate and round times, predicts a stall in the chunks up to the schedule's
largest hop: the smallest hop that plays through them with `margin` to spare, at most
the planner's `limit` (`initial_hop_max` unless tuned lower). Decided once, when the first
chunk could go.

The stage's round time is learnt from its own batches (`RoundTimes`); the LM's rate from the
utterance's own first tokens and from earlier utterances' later ones (`LMSteps`, one table for
sessions' first utterances and one for the rest); what the
vocoder keeps back from a first chunk from first chunks made (`FirstChunkPlanner.observe`).
A later chunk's round is never planned shorter than what second chunks took lately with as
many utterances on the stage (`SecondRounds`): under arrivals spread over time a round
holds other utterances' long chunks, and the one in progress has to end first.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable, ClassVar, Literal

from .chunking import ChunkSchedule
from .mel_stretch import streamed_frames

SPEECH_TOKENS_PER_S = 25  # at speed 1 (CosyVoice2 and 3)
TOKEN_S = 1 / SPEECH_TOKENS_PER_S

# Predicted seconds for the round of a chunk of (offset, hop) tokens, None before any batch.
RoundFn = Callable[[int, int], "float | None"]
# Which LM rate a session's first utterance is sized on (`FirstChunkPlanner.opening_rate`).
OpeningRate = Literal["slower", "learnt"]


def monotone_fit(ys: list[float], weights: list[float]) -> list[float]:
    """The non-decreasing sequence nearest `ys` in weighted squares (pool adjacent
    violators): where a value is above the ones after it, the run is replaced by its
    weighted mean. A lone high value among well-measured lower ones moves them little;
    values in increasing order are returned as they are."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for y, w in zip(ys, weights):
        blocks.append([y, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, w1, c1), (m2, w2, c2) = blocks[-2], blocks.pop()
            blocks[-1] = [(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, c1 + c2]
    return [m for m, _, c in blocks for _ in range(int(c))]


@dataclass
class RoundTimes:
    """A stage's batch wall time against the batch's flow work (rows x frames computed),
    remembered per size of work: the last `window` batches of each `1 / per_octave`
    octave of work, predicted by their medians.

    Why per size, not one line fitted over recent batches: the sizes a stage meets come
    in runs. An hour of single sessions (one-row rounds, launch-bound: their wall barely
    grows with their frames) would fit a line through them alone and forget what a full
    batch costs (~30 ms a round against ~450 at 64 rows on the H200), and the first burst
    after it would be planned on rounds far too short. On the H200 that burst stalled in
    every session, twice in round 11 of docs/benchmarks.md, while the next one, with big
    batches fresh in the fit, played through. A size's own batches still follow the load
    (a busy interpreter, the LM sharing the GPU slow batches down).

    Why medians, not means: one slow batch (a prompt-cache entry built on first use, the
    allocator growing, the event loop late to take the result) stayed in an exponential
    mean for tens of batches of its size, and sizes are met a few times a burst. In
    round 14 the planner predicted 65 ms for a one-session first chunk's round against
    27-41 ms measured, and took a longer first chunk for it (which batches made that
    mean, the run did not record).

    Between two measured sizes the prediction is linear, below the smallest measured it is
    that size's wall (a smaller batch is no faster on a launch-bound GPU), above the largest
    proportional to the work, and it never falls as the work grows: each errs long,
    which makes a first chunk longer, not a stall.

    Why the sizes' medians are made monotone by pooling (`monotone_fit`), not by a running
    maximum: under a running maximum one slow batch of a small size, seen once (say a
    burst's early round of a few rows beside every session's prefill), set the
    prediction of every larger size until seven more of its own size came, which a load of
    other sizes never brings. In round 20 of docs/benchmarks.md three gateways each
    predicted one value (483, 636, 451 ms) for 64-row rounds of 147-322 ms and for a
    single session's 26-ms second chunks, and sized first chunks on it: 18-21 tokens at
    one session where 6 played through."""

    window: int = 7
    per_octave: int = 2
    # size -> the latest (work, wall) of that size, oldest first
    sizes: dict[int, deque[tuple[int, float]]] = field(default_factory=dict)
    observed: int = 0  # batches observed in all
    # The prediction's curve (each size's median work, the sizes' median walls made
    # monotone), built on the first prediction after an observation: a first chunk's plan
    # asks for tens of rounds, and a burst plans all its first chunks within a few LM
    # steps, on the event loop every session shares (`bench.plan_cost`).
    _curve: tuple[list[float], list[float]] | None = field(default=None, init=False, repr=False, compare=False)

    def observe(self, work: int, wall_s: float) -> None:
        key = math.floor(self.per_octave * math.log2(max(work, 1)))
        self.sizes.setdefault(key, deque(maxlen=self.window)).append((work, wall_s))
        self.observed += 1
        self._curve = None

    def predict(self, work: int) -> float | None:
        """Seconds for a batch of this much flow work, None before any batch."""
        if not self.sizes:
            return None
        if self._curve is None:
            points = self._medians()
            xs = [max(x, 1.0) for x, _, _ in points]
            self._curve = (xs, monotone_fit([y for _, y, _ in points], [n for _, _, n in points]))
        xs, ys = self._curve
        if work <= xs[0]:
            return ys[0]
        if work >= xs[-1]:
            return ys[-1] * work / xs[-1]
        i = bisect.bisect_right(xs, work)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (work - x0) / (x1 - x0)

    def _medians(self) -> list[tuple[float, float, int]]:
        """(median work, median wall, batches kept) per size, smallest first."""
        return sorted((statistics.median(w for w, _ in seen), statistics.median(t for _, t in seen), len(seen))
                      for seen in self.sizes.values())

    def snapshot(self) -> list[dict[str, float]]:
        """Per size, smallest first: its median work and wall, the batches behind them and
        the wall predicted there (the monotone curve), for `GET /debug/planner`."""
        return [{"work": w, "wall_s": t, "batches": n, "predicted_s": self.predict(int(w)) or 0.0}
                for w, t, n in self._medians()]


def octave(count: float) -> int:
    """The octave of a count of utterances that `OctaveMedians` keys by (1: 0, 2-3: 1, ...)."""
    return math.floor(math.log2(max(count, 1.0)))


@dataclass
class OctaveMedians:
    """Seconds against a count of utterances (decoding, or on the stage): per octave of the
    count, the median of the last `window` measured."""

    window: int = 7
    # octave of the count -> the latest seconds, oldest first
    sizes: dict[int, deque[float]] = field(default_factory=dict)
    snapshot_key: ClassVar[str] = "seconds"

    def observe(self, streams: float, seconds: float) -> None:
        self.sizes.setdefault(octave(streams), deque(maxlen=self.window)).append(seconds)

    def predict(self, streams: int) -> float | None:
        """Seconds with `streams` utterances, None below the fewest measured (what more
        utterances got only bounds it). Its octave's median where measured, linear in the
        octave between two measured ones, the most's above them; never less than for fewer
        utterances (each errs long, as `RoundTimes`, and the octaves' medians are made so as
        its sizes' are: `monotone_fit`)."""
        key = octave(streams)
        octaves = sorted(self.sizes)
        fitted = monotone_fit([statistics.median(self.sizes[k]) for k in octaves],
                              [len(self.sizes[k]) for k in octaves])
        points = list(zip(octaves, fitted))
        if not points or key < points[0][0]:
            return None
        for (k0, y0), (k1, y1) in zip(points, points[1:]):
            if key < k1:
                return y0 + (y1 - y0) * (key - k0) / (k1 - k0)
        return points[-1][1]

    def snapshot(self) -> dict[str, dict[str, float]]:
        """Per octave, keyed by its fewest utterances: the median and how many kept."""
        return {str(2**k): {self.snapshot_key: statistics.median(seen), "utterances": len(seen)}
                for k, seen in sorted(self.sizes.items())}


@dataclass
class LMSteps(OctaveMedians):
    """The LM's seconds per speech token with a number of utterances decoding at once, learnt
    from utterances past their first tokens.

    Why not only the utterance's own rate: that is measured over its first few tokens, before
    its first chunk goes, and in a burst that is before the stage's opening round starts,
    while the chunks after the first are generated during the stage's rounds. On the H200
    (round 19 of docs/benchmarks.md) 64-session bursts were planned on 4-7 ms a token, and on
    ~0 where one of vLLM's outputs brought several tokens at once, while vLLM decoded at
    7.7-8.4 ms a token beside the stage (12-13 under MPS); two bursts planned on 15-token
    first chunks ran dry 43-45 ms at their second chunk."""

    snapshot_key: ClassVar[str] = "step_s"


@dataclass
class SecondRounds(OctaveMedians):
    """Seconds from a second chunk's turn (its tokens there and its first chunk's audio
    back, whichever is later) to its audio, with a number of utterances on the stage: the
    stage's wait and round as they came, the floor of a later chunk's planned round.

    Why: the round estimate (`AudioStage.round_estimate`) counts a round of chunks like this
    one, one per utterance in progress, which is what a burst brings. Under arrivals spread
    over time a second chunk waits for the round in progress and rides with other
    utterances' long chunks, padded to the longest. On the H200 (round 22 of
    docs/benchmarks.md, 32 and 48 sessions starting over 16 s) second chunks were planned
    on 30-39 ms rounds and took 70-112 (22-40 ms of it waiting), after 6-8-token first
    chunks, and 9 and 7 sessions ran dry by 22-51 ms; with 10-token first chunks none did."""

    snapshot_key: ClassVar[str] = "round_s"

    def ceiling(self, staged: int) -> float | None:
        """The longest round kept for `staged`'s own octave; None where none was measured.
        A cap on a planned round (`FirstChunkPlanner.learnt_rounds_crowd`) errs short when
        read off a lighter load's octave, as `predict` does above the highest measured, or
        off a median: at 64 utterances staged the medians read 42-241 ms from level to
        level in round 43 of docs/benchmarks.md."""
        seen = self.sizes.get(octave(staged))
        return max(seen) if seen else None


def chunks_ahead(schedule: ChunkSchedule, first: int, horizon: int = 8) -> list[tuple[int, int]]:
    """(offset, hop) of the chunks the schedule makes after a first chunk of `first`
    tokens, up to one past its first largest hop (from there every chunk is as long)."""
    s = replace(schedule, initial_hop=first, offset=0, index=0)
    out: list[tuple[int, int]] = []
    s.advance(first)
    for _ in range(horizon):
        hop = s.next_hop()
        out.append((s.offset, hop))
        s.advance(hop)
        if len(out) >= 2 and out[-2][1] >= s.max_hop:
            break
    return out


def slack(schedule: ChunkSchedule, first: int, step_s: float, round_s: RoundFn, holdback_s: float,
          speed: float = 1.0, margin: float = 0.25, later_round_s: float | None = None, *,
          stop_below: float = -math.inf) -> float | None:
    """The least seconds to spare, over the chunks after a first chunk of `first` tokens,
    between the audio delivered before a chunk and its predicted arrival with `margin`
    (below 0: a stall; None: no round measured yet). Times count from the first chunk's
    arrival; `later_round_s` is the least a later chunk's round takes (`SecondRounds`).
    Once it is below `stop_below` the rest are not predicted (a burst plans every first
    chunk on the event loop: `bench.plan_cost`)."""
    r0 = round_s(0, first)
    if r0 is None:
        return None
    generated, done, played = 0, 0.0, first * TOKEN_S - holdback_s * speed  # speed-1 seconds
    least = math.inf
    for offset, hop in chunks_ahead(schedule, first):
        generated += hop
        ready = generated * step_s - r0  # the LM went on while the first chunk was made
        rnd = round_s(offset, hop)
        done = max(ready, done) + max(r0 if rnd is None else rnd, later_round_s or 0.0)
        least = min(least, played / speed - (1.0 + margin) * done)
        if least < stop_below:
            break
        played += hop * TOKEN_S
    return least


class CappedRounds:
    """`round_s` with no round longer than `cap` seconds (one not measured yet stays None);
    `cut` says whether it shortened one."""

    def __init__(self, round_s: RoundFn, cap: float) -> None:
        self.round_s, self.cap, self.cut = round_s, cap, False

    def __call__(self, offset: int, hop: int) -> float | None:
        predicted = self.round_s(offset, hop)
        if predicted is None or predicted <= self.cap:
            return predicted
        self.cut = True
        return self.cap


def stalls(schedule: ChunkSchedule, first: int, step_s: float, round_s: RoundFn, holdback_s: float,
           speed: float = 1.0, margin: float = 0.25, later_round_s: float | None = None) -> bool | None:
    """Whether a first chunk of `first` tokens is predicted to run dry before a later chunk
    arrives (None: no round measured yet): `slack` below 0."""
    spare = slack(schedule, first, step_s, round_s, holdback_s, speed, margin, later_round_s, stop_below=0.0)
    return None if spare is None else spare < 0


def shortest_as_safe(schedule: ChunkSchedule, chosen: int, low: int, step_s: float, round_s: RoundFn,
                     holdback_s: float, speed: float = 1.0, margin: float = 0.25,
                     later_round_s: float | None = None) -> int:
    """The smallest first hop in [low, chosen] with at least the `slack` of `chosen` (and
    none below 0).

    Why a shorter first chunk can be safer: the chunk after it ends on the schedule's
    25-token grid, so its length depends on where the first one ends. With the bench
    voice's 106 prompt tokens a 10-token first chunk is followed by 34 tokens, a 9-token
    one by 10: 240 ms of audio to cover 34 tokens of LM and a round, against 200 ms to
    cover 10. On the H200 (round 27 of docs/benchmarks.md) 64 sessions arriving over 16 s
    ran 1-3 sessions dry in five runs of six, each 240 ms into its audio, after 10-token
    first chunks."""
    target = slack(schedule, chosen, step_s, round_s, holdback_s, speed, margin, later_round_s)
    if target is None:
        return chosen
    enough = max(target, 0.0)
    for hop in range(max(low, 1), chosen):
        spare = slack(schedule, hop, step_s, round_s, holdback_s, speed, margin, later_round_s, stop_below=enough)
        if spare is not None and spare >= enough:
            return hop
    return chosen


def plan_first_hop(schedule: ChunkSchedule, limit: int, step_s: float, round_s: RoundFn, holdback_s: float,
                   speed: float = 1.0, margin: float = 0.25, later_round_s: float | None = None) -> int:
    """The smallest first hop in [schedule.initial_hop, limit] predicted to play without a
    stall; `limit` when none is; `initial_hop` when nothing was measured yet."""
    low = schedule.initial_hop
    for hop in range(low, max(low, limit) + 1):
        verdict = stalls(schedule, hop, step_s, round_s, holdback_s, speed, margin, later_round_s)
        if verdict is None:
            return low
        if not verdict:
            return hop
    return max(low, limit)


@dataclass(frozen=True)
class PlanInputs:
    """What one first-chunk decision went on: the LM's seconds per token, and the predicted
    rounds of the chosen first chunk and of the chunk after it (at least `SecondRounds`'
    floor; None: not measured yet)."""

    hop: int
    step_s: float
    first_round_s: float | None
    second_round_s: float | None
    own_step_s: float | None = None  # the utterance's own rate, when `LMSteps` was asked too


@dataclass
class PlanSums:
    """Sums over first-chunk decisions that had rounds to go on (`PlanInputs` with both
    rounds predicted), for a level's means: a level holds hundreds of decisions, and the
    latest (`FirstChunkPlanner.last`) is one of them. `staged`: the utterances in progress
    on the decision's stage; `due`: those of them not waiting patiently
    (`AudioStage.live_utterances`). The round estimate counts `staged` by default, `due`
    with `skip_patient`, and with `due_rounds` `staged` for a round's width and `due` for
    how many rounds."""

    decisions: int = 0
    hop: int = 0
    step_s: float = 0.0
    first_round_s: float = 0.0
    second_round_s: float = 0.0
    staged: int = 0
    due: int = 0

    def add(self, plan: PlanInputs, staged: int | None, due: int | None) -> None:
        if plan.first_round_s is None or plan.second_round_s is None:
            return
        self.decisions += 1
        self.hop += plan.hop
        self.step_s += plan.step_s
        self.first_round_s += plan.first_round_s
        self.second_round_s += plan.second_round_s
        self.staged += staged or 0
        self.due += due or 0


# The planner's knobs `FirstChunkPlanner.tune` may set while it serves, and their types.
TUNABLE: dict[str, type] = {"limit": int, "min_hop": int, "min_hop_crowd": int, "idle_hop": int, "margin": float,
                            "skip_patient": bool, "due_rounds": bool, "deadline_holdback": bool,
                            "learnt_rounds_crowd": int, "hold_refresh": bool}
CROWDS = ("min_hop_crowd", "learnt_rounds_crowd")  # counts of utterances, not tokens: up to MAX_CROWD
MAX_MARGIN = 10.0
MAX_CROWD = 10_000


@dataclass
class FirstChunkPlanner:
    """One engine's first-chunk decisions (`plan_first_hop`) and what they learn from."""

    limit: int  # EngineConfig.initial_hop_max; `tune` may lower it and raise it back
    margin: float = 0.25
    # "slower": a session's first utterance, like any other, is sized on the slower of its
    # own rate and the learnt one. "learnt": on the learnt one alone where there is one for
    # as many decoding. Its own rate is read over its first few tokens, before the first
    # chunk goes: in round 21 of docs/benchmarks.md it read 0-21 ms a token (the learnt one
    # 6-10, vLLM's level average 13-14.5), and where it was the slower one (12-21 ms) each
    # session of a burst got a first chunk of its own size (28-31 tokens on average) and
    # 53-63 first chunks missed the round they were planned for. EngineConfig.first_chunk_opening_rate.
    opening_rate: OpeningRate = "slower"
    # Largest seen: output seconds a first chunk delivered short of its tokens' audio (the
    # vocoder's held-back frames, 0.16 s whatever the speed; in speed-1 seconds it would
    # be 0.16 x speed, and one fast session would shorten every later plan's audio).
    holdback_s: float = 0.0
    # The LM rates learnt from utterances that were not their session's first, and from those
    # that were (`learn_lm_step`): apart, because a burst's opening utterances decode their
    # tokens past the first chunk while the stage runs the opening rounds, and later ones
    # while it runs every session's long chunks. In round 20 of docs/benchmarks.md one
    # table for both learnt 17-22 ms a token at 64 utterances (under MPS) from the later
    # ones, and bursts' first chunks were sized on it at 30-40 tokens, while the opening
    # utterances' second chunks had their tokens within 10 ms of their round with 18.
    lm_steps: LMSteps = field(default_factory=LMSteps)
    opening_lm_steps: LMSteps = field(default_factory=LMSteps)
    second_rounds: SecondRounds = field(default_factory=SecondRounds)
    learn_second_rounds: bool = True  # EngineConfig.first_chunk_second_rounds
    # Below the schedule's initial_hop, down to this many tokens, when as safe
    # (`shortest_as_safe`; EngineConfig.first_chunk_min_hop). 0: never below.
    min_hop: int = 0
    # ... and only while fewer than this many other utterances' listeners wait for a first
    # chunk (EngineConfig.first_chunk_min_hop_crowd). Why: first chunks sized at once share an
    # opening round, which one utterance's timeline does not see. In H200 bursts of 64
    # sessions (round 28 of docs/benchmarks.md) `min_hop` 8 split that round (47-52 rows,
    # not 62-64; first chunks waited 63-108 ms for the stage, not 3-25), and first audio's
    # p95 went from 327-369 ms to 680-703; with sessions arriving over 16 s it ran none dry
    # in three runs where the floor alone ran 2 and 3 sessions dry in two of three.
    min_hop_crowd: int = 4
    # The floor for an utterance alone on the engine (EngineConfig.idle_initial_hop; the
    # engine applies it). 0: none.
    idle_hop: int = 0
    # The round estimate leaves out the utterances waiting patiently
    # (EngineConfig.first_chunk_skip_patient; the engine asks the stage so).
    skip_patient: bool = False
    # The round estimate counts the utterances waiting patiently in a round's width but not
    # in how many rounds the crowd fills (EngineConfig.first_chunk_due_rounds; the engine
    # asks the stage so): a patient utterance queues one big chunk in several rounds.
    due_rounds: bool = True
    # A chunk's deadline counts its utterance's chunks still on the stage as delivering
    # `holdback_s` less than their tokens' worth until its audio covered that
    # (EngineConfig.first_chunk_deadline_holdback; the session asks `audio_in_flight`).
    deadline_holdback: bool = True
    # A planned first chunk is announced to the stage's hold once more halfway to its tokens,
    # from the LM's rate then (EngineConfig.first_chunk_hold_refresh; the session does it).
    hold_refresh: bool = False
    # While fewer than this many other utterances' listeners wait for a first chunk, no
    # round of a plan is taken as longer than the longest second chunks took lately, from
    # their turn to their audio, with as many utterances on the stage (`SecondRounds.ceiling`;
    # none where that load was not measured): the round estimate is a burst's, every
    # utterance in progress with a chunk in one round, which a load of arrivals spread over
    # time never forms. On an H100 at 200 sessions over 16 s (round 43
    # of docs/benchmarks.md) it planned rounds of 558-610 ms (past the stage's 64 rows it
    # doubles) where the second chunks' learnt rounds were 42-241 ms, and first chunks went
    # 24-28 tokens long. A burst brings tens waiting at once and keeps the estimate
    # (EngineConfig.first_chunk_learnt_rounds_crowd). 0: off.
    learnt_rounds_crowd: int = 0
    learnt_round_plans: int = 0  # decisions whose plan the learnt rounds shortened a round of
    # Decisions that went below the floor (`min_hop`), and those that might have but for a
    # crowd of first chunks (`min_hop_crowd`): how often each fires under a load.
    below_floor: int = 0
    crowded: int = 0
    last: PlanInputs | None = None  # the latest decision's inputs, for the engine's stats
    # ... and the latest for a session's first utterance (a burst's opening chunks: later
    # utterances' decisions, made under other loads, would hide it by the end of a run)
    last_opening: PlanInputs | None = None
    # Every decision's inputs summed, and those of sessions' first utterances.
    sums: PlanSums = field(default_factory=PlanSums)
    opening_sums: PlanSums = field(default_factory=PlanSums)
    # The configured limit: the most tokens a knob of `tune` may name (`limit` included).
    # Tuning compares values within the configuration (A/B levels on one gateway); a wider
    # bound is a configuration of its own.
    limit_ceiling: int = field(init=False)

    def __post_init__(self) -> None:
        self.limit_ceiling = self.limit

    def observe(self, tokens: int, samples: int, sample_rate: int, speed: float, token_mel_ratio: int = 2) -> None:
        """A first chunk of `tokens` speech tokens gave `samples` of audio. At a speed other
        than 1 the mel stretch keeps back a frame of its own (`streamed_frames`): counted
        as the vocoder's, one slow session would shorten every later plan's audio."""
        frames = tokens * token_mel_ratio
        if speed != 1.0:
            frames = streamed_frames(frames, speed)
        self.holdback_s = max(self.holdback_s, frames * TOKEN_S / token_mel_ratio - samples / sample_rate)

    def audio_in_flight(self, made: int, pending: int, speed: float) -> float:
        """Output seconds of audio that an utterance's `pending` speech tokens, queued on
        the stage after the `made` ones whose audio is made, will deliver. Until its last
        chunk the vocoder keeps `holdback_s` of an utterance's audio back, so its chunks
        made up to a point delivered that much less than their tokens' worth (none at all
        for a first chunk shorter than it): a first chunk's audio falls short of its
        tokens, and once one chunk's audio covered the holdback each later chunk gives back
        as much as it keeps."""
        def delivered(tokens: int) -> float:
            seconds = tokens / SPEECH_TOKENS_PER_S / speed
            return max(0.0, seconds - self.holdback_s) if self.deadline_holdback else seconds

        return delivered(made + pending) - delivered(made) if pending > 0 else 0.0

    def snapshot(self) -> dict[str, object]:
        """What the next decisions would go on, for `GET /debug/planner`."""
        return {"holdback_s": self.holdback_s, "margin": self.margin, "limit": self.limit,
                "min_hop": self.min_hop, "min_hop_crowd": self.min_hop_crowd, "idle_hop": self.idle_hop,
                "skip_patient": self.skip_patient, "due_rounds": self.due_rounds,
                "deadline_holdback": self.deadline_holdback, "hold_refresh": self.hold_refresh,
                "learnt_rounds_crowd": self.learnt_rounds_crowd,
                "opening_rate": self.opening_rate,
                "lm_steps": {"opening": self.opening_lm_steps.snapshot(), "later": self.lm_steps.snapshot()},
                "second_rounds": self.second_rounds.snapshot()}

    def tune(self, knobs: dict[str, object]) -> None:
        """Set `TUNABLE` knobs (`POST /debug/planner`: A/B levels on one gateway, where
        between gateways the LM's first token alone moved ~1 ms in round 27). An utterance
        reads `idle_hop` as it starts and the rest when its first chunk is sized. A count of
        tokens is at most the configured `limit` (`limit_ceiling`); a `limit` at or below a
        schedule's `initial_hop` leaves its first chunks unplanned. All or nothing:
        ValueError names the first bad knob."""
        checked: dict[str, object] = {}
        for name, value in knobs.items():
            kind = TUNABLE.get(name)
            if kind is None:
                raise ValueError(f"{name!r} is not tunable (one of {', '.join(sorted(TUNABLE))})")
            if kind is bool:
                if not isinstance(value, bool):
                    raise ValueError(f"{name} must be true or false, got {value!r}")
                checked[name] = value
                continue
            if isinstance(value, bool) or not isinstance(value, int if kind is int else (int, float)):
                raise ValueError(f"{name} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
            high = MAX_MARGIN if kind is float else MAX_CROWD if name in CROWDS else self.limit_ceiling
            if not 0 <= value <= high:
                raise ValueError(f"{name} must be within [0, {high}], got {value!r}")
            checked[name] = kind(value)
        for name, value in checked.items():
            setattr(self, name, value)

    def learn_lm_step(self, streams: float, step_s: float, opening: bool) -> None:
        """An utterance (its session's first: `opening`) decoded at `step_s` seconds a token
        past its first tokens, with `streams` utterances decoding."""
        (self.opening_lm_steps if opening else self.lm_steps).observe(streams, step_s)

    def learn_second_round(self, staged: int, seconds: float) -> None:
        """A second chunk queued with `staged` utterances on its stage had its audio
        `seconds` after its turn (`SecondRounds`)."""
        if self.learn_second_rounds:
            self.second_rounds.observe(staged, seconds)

    def first_hop(self, schedule: ChunkSchedule, step_s: float, round_s: RoundFn, speed: float,
                  opening: bool = False, streams: int | None = None, staged: int | None = None,
                  sizing: int = 0, due: int | None = None) -> int:
        """The first chunk's hop for an utterance whose LM gave it a token every `step_s`
        so far; with `streams` (the utterances decoding now) the rate learnt for that many
        (from utterances that were, or were not, their session's first like this one) is
        taken when it is slower, or for a session's first utterance always with
        `opening_rate` "learnt"; with `staged` (the utterances on its stage) later rounds
        take at least what second chunks took lately with as many; `sizing`: the other
        utterances waiting for their first chunk (`min_hop_crowd`); `due`: of `staged`, those
        not waiting patiently (only summed, `PlanSums`)."""
        # initial_hop 0 is the official schedule (no short first chunk): nothing to size.
        if schedule.initial_hop <= 0 or self.limit <= schedule.initial_hop or not math.isfinite(step_s):
            return schedule.initial_hop
        own = None
        if streams is not None:
            own, learnt = step_s, (self.opening_lm_steps if opening else self.lm_steps).predict(streams)
            if opening and self.opening_rate == "learnt" and learnt is not None:
                step_s = learnt
            else:
                step_s = max(step_s, learnt or 0.0)
        later = self.second_rounds.predict(staged) if staged is not None else None
        cap = self.second_rounds.ceiling(staged) if staged is not None and sizing < self.learnt_rounds_crowd else None
        capped = None if cap is None else CappedRounds(round_s, cap)
        if capped is not None:
            round_s = capped
        hop = plan_first_hop(schedule, self.limit, step_s, round_s, self.holdback_s, speed, self.margin, later)
        if 0 < self.min_hop < hop and sizing >= self.min_hop_crowd:
            self.crowded += 1
        elif 0 < self.min_hop < hop:
            hop = shortest_as_safe(schedule, hop, self.min_hop, step_s, round_s, self.holdback_s, speed,
                                   self.margin, later)
            self.below_floor += hop < schedule.initial_hop
        after = chunks_ahead(schedule, hop)[0]
        second = round_s(*after)
        if second is not None and later is not None:
            second = max(second, later)
        self.last = PlanInputs(hop, step_s, round_s(0, hop), second, own)
        self.sums.add(self.last, staged, due)
        if capped is not None and capped.cut:
            self.learnt_round_plans += 1
        if opening:
            self.last_opening = self.last
            self.opening_sums.add(self.last, staged, due)
        return hop
