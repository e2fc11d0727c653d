import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.chunking import GRID, ChunkSchedule, grown_end, patient_target, window_start


def hops(prompt: int, initial: int, n: int, max_hop: int = 100) -> list[int]:
    s = ChunkSchedule(prompt, initial_hop=initial, max_hop=max_hop)
    out = []
    for _ in range(n):
        h = s.next_hop()
        out.append(h)
        s.advance(h)
    return out


def test_schedule_with_initial_hop_realigns_to_grid_then_doubles():
    # P = 87: first 15, then up to the next multiple of 25 counted from the prompt (23
    # tokens away: no shorter than the first chunk), then doubling.
    assert hops(87, 15, 6) == [15, 23, 50, 100, 100, 100]
    assert (87 + 15 + 23) % GRID == 0
    # P = 106: the next boundary is 4 tokens after the first chunk, shorter than it: the
    # one after (29).
    assert hops(106, 15, 3) == [15, 29, 50]
    # A 5-token first chunk for P = 106: the boundary 14 tokens on, not 39.
    assert hops(106, 5, 3) == [5, 14, 50]


@given(st.integers(0, 400), st.integers(1, 40))
def test_the_second_chunk_is_no_shorter_than_the_first_nor_longer_than_needed(prompt, initial):
    first, second = hops(prompt, initial, 2)
    assert first == initial and (prompt + first + second) % GRID == 0  # ends on the grid
    assert second >= min(initial, GRID)  # audio ahead of playback grows
    assert second < GRID or second - GRID < initial  # the nearest boundary that does


def test_official_schedule_without_initial_hop():
    assert hops(100, 0, 4) == [25, 50, 100, 100]
    assert hops(87, 0, 3) == [38, 50, 100]


def test_max_hop_caps_growth():
    assert hops(100, 0, 5, max_hop=50) == [25, 50, 50, 50, 50]


def test_ready_waits_for_lookahead():
    s = ChunkSchedule(100, initial_hop=15)
    assert s.ready(17) is None  # 15 + 3 lookahead needed
    assert s.ready(18) == 15


@given(st.integers(0, 400), st.integers(0, 40))
def test_every_chunk_after_the_first_two_ends_on_the_grid(prompt, initial):
    s = ChunkSchedule(prompt, initial_hop=initial)
    for i in range(8):
        s.advance(s.next_hop())
        if i >= (1 if initial else 0):
            assert (prompt + s.offset) % GRID == 0


def test_schedules_are_independent_objects():
    a, b = ChunkSchedule(100, 15), ChunkSchedule(100, 15)
    for _ in range(3):
        a.advance(a.next_hop())
    assert b.next_hop() == 15 and b.offset == 0


@pytest.mark.parametrize("prompt", [0, 7, 24, 25, 106])
@pytest.mark.parametrize("initial", [0, 5, 15])
def test_tokens_needed_is_where_ready_turns(prompt: int, initial: int) -> None:
    s = ChunkSchedule(prompt_tokens=prompt, initial_hop=initial, max_hop=100, lookahead=3)
    for _ in range(6):
        need = s.tokens_needed()
        assert s.ready(need - 1) is None and s.ready(need) == s.next_hop()
        s.advance(s.ready(need))


def grow(prompt: int, end: int, *, available: int, lm_done: bool, lookahead: int, room: int,
         offset: int = 0, max_hop: int = 10_000) -> tuple[int, bool] | None:
    return grown_end(prompt, offset, end, available, lm_done, lookahead, room, max_hop)


def test_a_grown_chunk_ends_on_the_grid_with_its_lookahead_generated():
    # P = 87, end = 113 (87 + 113 = 200, on the grid), lookahead 3.
    assert grow(87, 113, available=200, lm_done=False, lookahead=3, room=40) == (138, False)  # +25
    assert grow(87, 113, available=200, lm_done=False, lookahead=3, room=50) == (163, False)  # +50
    # The lookahead of the furthest boundary must exist: 166 tokens hold 163's, 165 do not.
    assert grow(87, 113, available=166, lm_done=False, lookahead=3, room=80) == (163, False)
    assert grow(87, 113, available=165, lm_done=False, lookahead=3, room=80) == (138, False)
    # Off the grid (a first chunk of 15 tokens, 87 + 15 = 102): to the next boundary, 125.
    assert grow(87, 15, available=100, lm_done=False, lookahead=3, room=23) == (38, False)
    assert grow(87, 15, available=100, lm_done=False, lookahead=3, room=22) is None
    # No boundary within the room, or not enough tokens yet: stays.
    assert grow(87, 113, available=200, lm_done=False, lookahead=3, room=24) is None
    assert grow(87, 113, available=140, lm_done=False, lookahead=3, room=50) is None
    assert grow(87, 113, available=200, lm_done=False, lookahead=3, room=0) is None


def test_a_grown_chunk_takes_the_rest_once_the_lm_is_done():
    # The rest (30 tokens) within the room: the last chunk, all of it, no lookahead.
    assert grow(87, 113, available=143, lm_done=True, lookahead=3, room=30) == (143, True)
    # Not within the room: a boundary as before (the rest comes in a later chunk).
    assert grow(87, 113, available=143, lm_done=True, lookahead=3, room=29) == (138, False)
    # Nothing left beyond the chunk's own lookahead would still be "the rest".
    assert grow(87, 113, available=116, lm_done=True, lookahead=3, room=10) == (116, True)
    # Before the LM is done the rest is never taken as final.
    assert grow(87, 113, available=143, lm_done=False, lookahead=3, room=30) == (138, False)


@given(st.integers(0, 300), st.integers(0, 200), st.integers(1, 120), st.integers(0, 400), st.booleans(),
       st.integers(0, 200), st.integers(25, 200))
def test_growth_never_exceeds_the_room_the_tokens_or_max_hop(prompt, offset, hop, extra, lm_done, room, max_hop):
    end = offset + hop
    available = end + 3 + extra  # a queued chunk's own lookahead always exists
    out = grown_end(prompt, offset, end, available, lm_done, 3, room, max_hop)
    if out is not None:
        new_end, final = out
        assert end < new_end <= min(end + room, offset + max_hop) and new_end <= available
        if final:
            assert lm_done and new_end == available
        else:
            assert (prompt + new_end) % GRID == 0 and new_end + 3 <= available


def test_a_grown_chunk_stays_within_max_hop():
    # Tokens [100, 113) queued, max_hop 50: it may end at 150 at most, so at 138 (grid), not 163.
    assert grow(87, 113, available=300, lm_done=False, lookahead=3, room=80, offset=100, max_hop=50) == (138, False)
    # The rest (143) is 43 tokens from the offset: within max_hop 50, taken; 40 is too few.
    assert grow(87, 113, available=143, lm_done=True, lookahead=3, room=40, offset=100, max_hop=50) == (143, True)
    assert grow(87, 113, available=143, lm_done=True, lookahead=3, room=40, offset=100, max_hop=40) == (138, False)
    # A first chunk (offset 0) with a huge room: one max_hop at most.
    assert grow(87, 15, available=1000, lm_done=False, lookahead=3, room=500, max_hop=100) == (88, False)


def test_chunk_frames_counts_the_window_after_the_cached_prompt() -> None:
    """`chunk_frames`: a 4.25 s voice (106 tokens, 200 cached frames) computes 12 + 2 x hop
    frames for a first chunk; later windows drop whole 25-token blocks beyond the left
    context, and none with the left context unbounded."""
    from engine.chunking import chunk_frames, window_start

    assert chunk_frames(106, 0, 22, 50, 2, 200) == 56
    assert window_start(75, 50) == 25 and window_start(49, 50) == 0 and window_start(500, -1) == 0
    assert chunk_frames(106, 75, 50, 50, 2, 200) == 2 * (106 + 50 + 50) - 200
    assert chunk_frames(106, 75, 50, -1, 2, 200) == 2 * (106 + 75 + 50) - 200


def test_a_patient_chunk_waits_for_the_rest_or_goes_as_a_max_hop_on_the_grid() -> None:
    # Prompt of 106 tokens: the grid falls at 19, 44, 69, 94, ... generated tokens. The
    # widest window of the schedule: 50 + 24 of context + 100 + 3 = 177 tokens.
    assert patient_target(106, 0, 50, False, 3, 100, 50) == (94, False, 178)  # the rest may still fit
    assert patient_target(106, 0, 178, False, 3, 100, 50) == (94, False, 178)  # it cannot: 94 goes
    assert patient_target(106, 94, 200, False, 3, 100, 50) == (194, False, 94 + 108 + 1)  # 69 of context
    # The LM done: the rest as one last chunk while its window fits ...
    assert patient_target(106, 0, 105, True, 3, 100, 50) == (105, True, 105)  # not 94 and an 11-token tail
    assert patient_target(106, 0, 177, True, 3, 100, 50) == (177, True, 177)
    assert patient_target(106, 94, 94 + 108, True, 3, 100, 50) == (94 + 108, True, 94 + 108)
    # ... else a whole max_hop on the grid, at once (its lookahead is there).
    assert patient_target(106, 0, 178, True, 3, 100, 50) == (94, False, 178)
    assert patient_target(106, 94, 94 + 109, True, 3, 100, 50) == (194, False, 94 + 109)
    assert patient_target(106, 0, 104, True, 3, 100, -1) == (94, False, 104)  # unbounded context: max_hop + lookahead
    # From an offset off the grid (after a first chunk of 10), the grid end within max_hop.
    assert patient_target(106, 10, 60, False, 3, 100, 50)[:2] == (94, False)
    assert patient_target(100, 0, 10, False, 3, 20, 50)[:2] == (20, False)  # max_hop under a block: no grid end within it


@given(st.integers(0, 300), st.integers(0, 400), st.integers(0, 300), st.booleans(), st.integers(25, 200),
       st.sampled_from([-1, 0, 25, 50]))
def test_a_patient_chunk_stays_within_the_schedules_shapes(prompt, offset, extra, lm_done, max_hop, left_context):
    available = offset + extra
    end, final, need = patient_target(prompt, offset, available, lm_done, 3, max_hop, left_context)
    assert end > offset and need >= (end if final else end + 3)  # a non-final chunk's lookahead is there
    if lm_done and extra > 0:
        assert available >= need  # the LM done: it goes now
    if final:
        assert lm_done and end == available
        if left_context >= 0:  # its window: no wider than the widest of the schedule's
            assert end - window_start(offset, left_context) <= left_context + GRID - 1 + max_hop + 3
        else:
            assert end - offset <= max_hop + 3
    else:
        assert end - offset <= max_hop and (prompt + end) % GRID == 0
        assert max_hop - (end - offset) < GRID  # the furthest boundary within max_hop


def test_session_options_refuse_what_would_fail_a_batch_or_stall_a_schedule() -> None:
    from engine.types import SessionOptions

    for bad in ({"speed": 0.0}, {"speed": -1.0}, {"speed": float("nan")}, {"speed": float("inf")},
                {"initial_hop": -1}, {"max_hop": 0}, {"max_hop": 60}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SessionOptions(**bad)
    assert SessionOptions(speed=0.25, initial_hop=0, max_hop=25).max_hop == 25
