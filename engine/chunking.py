"""When an utterance's speech tokens become an audio chunk.

The flow decoder attends in 50-frame (25-token) blocks counted from the start of the
prompt, and needs `lookahead` tokens beyond a chunk's end. The schedule:

    chunk 0: `initial_hop` tokens (small, for first-audio latency; 0 = skip)
    chunk 1: up to a 25-token boundary counted from the prompt: the next one,
             r = -(P + offset) mod 25, when r >= initial_hop, else the one after
             (25 + r; without an initial hop always 25 + r, as the official code)
    then:    hops double from 50 up to `max_hop`
    last:    whatever is left once the LM is done (finalize, no lookahead)

Chunk 1 must be decoded while chunk 0 plays (initial_hop / 25 s). Always taking 25 + r
made it up to 49 tokens: with `initial_hop` 5 (0.2 s of audio) the LM alone needs ~0.15 s
for 42 tokens at one session's ~280 tokens/s, and the H200 run stalled 0.1 s right after
the first chunk. Ending at the nearer boundary when that is no shorter than chunk 0 keeps
the grid and lets audio ahead of the playback grow from the start.

All state is per utterance (`ChunkSchedule` instances are never shared), unlike the
official code, whose shared `token_hop_len` leaks between concurrent requests, and into
later ones: it is never reset, so a model's second streamed request starts on the first
one's last hop.
"""

from __future__ import annotations

from dataclasses import dataclass

GRID = 25


@dataclass
class ChunkSchedule:
    prompt_tokens: int  # P: speech tokens of the voice prompt (flow prefix)
    initial_hop: int = 15
    max_hop: int = 100
    lookahead: int = 3
    offset: int = 0  # tokens already turned into audio
    index: int = 0  # chunks emitted so far

    def next_hop(self) -> int:
        if self.index == 0 and self.initial_hop > 0:
            return self.initial_hop
        k = self.index - (1 if self.initial_hop > 0 else 0)  # chunks since the grid phase began
        if k == 0:
            to_grid = (-(self.prompt_tokens + self.offset)) % GRID
            if self.initial_hop > 0 and to_grid >= self.initial_hop:
                return to_grid
            return GRID + to_grid
        return max(GRID, min(self.max_hop, GRID * 2**k))

    def ready(self, available: int) -> int | None:
        """Tokens to emit now given `available` generated tokens, or None to wait."""
        hop = self.next_hop()
        if available - self.offset >= hop + self.lookahead:
            return hop
        return None

    def tokens_needed(self) -> int:
        """Generated tokens at which `ready` returns the next hop (before the LM is done)."""
        return self.offset + self.next_hop() + self.lookahead

    def advance(self, hop: int) -> None:
        self.offset += hop
        self.index += 1


def grown_end(prompt_tokens: int, offset: int, end: int, available: int, lm_done: bool, lookahead: int,
              room: int, max_hop: int) -> tuple[int, bool] | None:
    """A queued chunk of tokens [offset, end) (not final) that may grow by up to `room`
    tokens of flow window (`AudioStage._fill_padding`): its new (end, finalize), or None
    to stay. It never grows past `max_hop` tokens, the schedule's own bound on a chunk
    (and what the vocoder's graph buckets are sized for).

    With the LM done and the rest within reach, it takes the rest and becomes the last
    chunk (no lookahead then, so its window grows by exactly the tokens it takes).
    Otherwise it ends at the furthest 25-token boundary (counted from the prompt, as the
    schedule's) that fits in `room` and still has its lookahead tokens generated: emitted
    frames stay whole attention blocks, and the schedule's next hop follows from there.
    """
    if room <= 0:
        return None
    limit = offset + max_hop
    if lm_done and available - end <= room and available <= limit:
        return (available, True) if available > end else None
    reach = min(end + room, available - lookahead, limit)
    grid_end = (prompt_tokens + reach) // GRID * GRID - prompt_tokens
    return (grid_end, False) if grid_end > end else None


@dataclass(frozen=True)
class SpareTokens:
    """What a queued chunk may grow into (`grown_end`) where its utterance's token list is
    not at hand (a stage in a process of its own): the tokens generated past its window
    when it was queued, and the rest of what `grown_end` reads. The chunk ends at `end`;
    `after` holds tokens [after_start, after_start + len(after)), up to as far as the
    chunk could ever reach (offset + max_hop + lookahead)."""

    prompt_tokens: int
    offset: int
    end: int
    available: int  # the utterance's tokens when the chunk was queued
    lm_done: bool
    lookahead: int
    max_hop: int
    after_start: int
    after: tuple[int, ...]

    @classmethod
    def of(cls, tokens: list[int], prompt_tokens: int, offset: int, end: int, window_end: int, lm_done: bool,
           lookahead: int, max_hop: int) -> "SpareTokens":
        """For a chunk whose flow window holds the utterance's tokens up to `window_end`."""
        reach = min(len(tokens), offset + max_hop + lookahead)
        return cls(prompt_tokens, offset, end, len(tokens), lm_done, lookahead, max_hop, window_end,
                   tuple(tokens[window_end:reach]))


def patient_target(prompt_tokens: int, offset: int, available: int, lm_done: bool, lookahead: int,
                   max_hop: int, left_context: int) -> tuple[int, bool, int]:
    """(end, finalize, need) of a chunk of tokens from `offset` whose audio is not needed
    soon (`engine.chunk_patience_s`): as large as a chunk may be, cut once `available`
    reaches `need` (at once when final).

    Every chunk re-reads its left context and pays a flow call's fixed cost, and a short
    chunk is padded to the flow graphs' 50 frames, so fewer, longer chunks cost the stage
    less for the same audio. So the chunk waits for the LM's end while the rest could
    still be one last chunk, whose flow window is no wider than the widest a chunk of the
    schedule has (left context + a block + max_hop + lookahead: the shapes the engine
    warms): a 105-token segment is one chunk, not 94 tokens and an 11-token tail that
    re-reads 69 tokens of context. (The vocoder's graphs reach the widest such chunk,
    `engine.stage_build.vocoder_graph_frames`; a vocoder batch over 8 rows decodes eagerly.)
    Once more is generated than that, it ends at the furthest 25-token boundary (counted
    from the prompt) within `max_hop`, as the schedule's own chunks do."""
    rest = available - offset
    if left_context >= 0:
        room = left_context + GRID - 1 + max_hop + lookahead - (offset - window_start(offset, left_context))
    else:
        room = max_hop + lookahead
    if lm_done and 0 < rest <= room:
        return available, True, available
    end = (prompt_tokens + offset + max_hop) // GRID * GRID - prompt_tokens
    end = end if end > offset else offset + max_hop
    return end, False, max(end + lookahead, offset + room + 1)


def window_start(offset: int, left_context: int) -> int:
    """The first generated token a chunk at `offset` re-reads as left context (all of them
    when `left_context` < 0). Whole GRID blocks are dropped before the window, so the
    flow's block grid stays aligned."""
    return 0 if left_context < 0 else max(0, (offset - left_context) // GRID * GRID)


def chunk_frames(prompt_tokens: int, offset: int, hop: int, left_context: int, token_mel_ratio: int,
                 cached: int) -> int:
    """Flow frames the stage computes for a chunk of `hop` tokens at `offset`: its window
    (prompt, left context, the hop; the lookahead tokens are read, not computed) after the
    `cached` prompt frames the prompt cache holds."""
    window = prompt_tokens + offset - window_start(offset, left_context) + hop
    return token_mel_ratio * window - cached
