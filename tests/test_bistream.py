"""The bistream interleaving (engine/bistream.py) against the official algorithm.

`official_trace` is a line-by-line transliteration of `Qwen2LM.inference_bistream`
(cosyvoice/llm/llm.py, CosyVoice3 branch) over token ids instead of embeddings: it
records every input handed to `forward_one_step` and every yielded token. With
`official_quirks=True` our state machine must reproduce it exactly; by default it
differs only by the three documented training-layout fixes, checked on hand-built
sequences.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from engine.bistream import BistreamSpec, BistreamState, LengthLimits

SOS, TASK, FILL, EOS = 1000, 1002, 1003, 1001
SPEC = BistreamSpec(sos=SOS, task_id=TASK, fill=FILL, speech_token_size=1000, text_offset=2000, end_of_prompt=99)
FREE = LengthLimits(min_ratio=0.0, max_ratio=100.0)


def T(*ids: int) -> list[int]:
    return [2000 + i for i in ids]


Sampler = Callable[[list[int], bool], int]


def scripted(eos_after: int = 5, natural_fill_at: int | None = None) -> Sampler:
    """A deterministic 'model': token = 100 + number of tokens sampled so far; in the
    final phase eos after `eos_after` tokens; optionally a fill of its own."""

    def sample(out: list[int], final: bool) -> int:
        n = len(out)
        if not final and natural_fill_at is not None and n == natural_fill_at:
            return FILL
        if final and sum(1 for t in out if t < 1000) >= eos_after + count_stream[0]:
            return EOS
        return 100 + n

    count_stream = [0]
    sample.count_stream = count_stream  # type: ignore[attr-defined]
    return sample


def official_trace(prompt_text, prompt_speech, arrivals, sample) -> tuple[list[int], list[int]]:
    """Transliteration of the official inference_bistream (ids instead of embeddings)."""
    fed: list[int] = []
    yielded: list[int] = []
    lm_input = [SOS]
    eop = prompt_text.index(99)
    lm_input = lm_input + T(*prompt_text[: eop + 1])
    prompt_text = prompt_text[eop + 1 :]
    text_cache = T(*prompt_text)
    ps = list(prompt_speech)
    next_fill = (len(ps) // 15 + 1) * 15 - len(ps)
    out: list[int] = []
    for this_text in arrivals:
        text_cache = text_cache + T(*this_text)
        while len(ps) != 0:
            if len(text_cache) >= 5:
                lm_input = lm_input + text_cache[:5] + ps[:15]
                text_cache, ps = text_cache[5:], ps[15:]
            else:
                break
        if len(ps) == 0:
            if (len(out) != 0 and out[-1] == FILL) or (len(out) == 0 and len(lm_input) == 1):
                if len(text_cache) >= 5:
                    if len(out) != 0 and out[-1] == FILL:
                        lm_input = text_cache[:5]
                    else:
                        lm_input = lm_input + text_cache[:5]
                    text_cache = text_cache[5:]
                else:
                    continue
            while True:
                fed += lm_input
                if next_fill != -1 and len(out) == next_fill:
                    top = FILL
                    next_fill += 16
                else:
                    top = sample(out, False)
                if top == FILL:
                    next_fill = len(out) + 16
                out.append(top)
                if top >= 1000:
                    assert top == FILL
                    break
                yielded.append(top)
                lm_input = [top]
    sample.count_stream[0] = len(yielded)
    lm_input = lm_input + text_cache + [TASK]
    while True:
        fed += lm_input
        top = sample(out, True)
        out.append(top)
        if top >= 1000:
            break
        yielded.append(top)
        lm_input = [top]
    return fed, yielded


def drive(st: BistreamState, arrivals, sample, upfront: bool) -> None:
    """Run the state machine like a backend would. `upfront`: all text is pushed before
    decoding (text faster than the LM); otherwise one arrival each time it waits."""
    pending = list(arrivals)
    if upfront:
        for a in pending:
            st.push_text(a)
        st.close_text()
        pending = []
    while not st.done:
        run = st.next_run()
        if run is None:
            if st.done:
                break
            if pending:
                st.push_text(pending.pop(0))
            else:
                st.close_text()
            continue
        if run.final:
            sample.count_stream[0] = len(st.speech)
        while st.in_run:
            rule = st.token_rule()
            tok = rule.forced if rule.forced is not None else sample(list(st.history), run.final)
            if tok >= 1000 and tok != FILL:
                assert rule.allow_stop
            st.on_token(tok)


CASES = {
    # prompt speech (20) shorter than what the text pairs with; text token by token
    "short_prompt": ([7, 99, 11, 12], list(range(1, 21)), [[t] for t in range(31, 61)]),
    # prompt speech (40) longer than the whole text can pair with
    "long_prompt": ([7, 99, 11], list(range(1, 41)), [[t] for t in range(31, 37)]),
    # prompt speech an exact multiple of 15
    "aligned_prompt": ([7, 99, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], list(range(1, 31)), [[t] for t in range(31, 52)]),
    # no prompt speech (cross-lingual / instruct)
    "no_prompt_speech": ([7, 99], [], [[t] for t in range(31, 43)]),
    # text arriving in uneven chunks
    "chunked": ([7, 99, 11, 12], list(range(1, 21)), [[31, 32, 33], [34], [], [35, 36, 37, 38, 39, 40, 41], [42, 43]]),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("upfront", [False, True])
@pytest.mark.parametrize("natural_fill", [None, 12])
def test_quirk_mode_equals_official_transliteration(name: str, upfront: bool, natural_fill: int | None) -> None:
    prompt_text, prompt_speech, arrivals = CASES[name]
    fed, yielded = official_trace(prompt_text, prompt_speech, arrivals, scripted(natural_fill_at=natural_fill))
    st = BistreamState(SPEC, prompt_text, prompt_speech, FREE, official_quirks=True)
    drive(st, arrivals, scripted(natural_fill_at=natural_fill), upfront)
    assert st.context == fed
    assert st.speech == yielded
    assert st.done


def test_short_prompt_token_by_token_layout() -> None:
    """Hand-built: CV3, prompt speech (20) shorter than the text, text token by token."""
    prompt_text, prompt_speech, arrivals = CASES["short_prompt"]
    st = BistreamState(SPEC, prompt_text, prompt_speech, FREE)
    drive(st, arrivals, scripted(eos_after=3), upfront=False)
    g = lambda a, b: list(range(100 + a, 100 + b))  # noqa: E731  sampled ids for out[a:b]
    expected = (
        [SOS, *T(7, 99)]
        + T(11, 12, 31, 32, 33) + list(range(1, 16))  # block 1: transcript + first text, 15 prompt speech
        + T(34, 35, 36, 37, 38) + list(range(16, 21))  # block 2: the last 5 prompt tokens
        + g(0, 10)  # 15 - 20 % 15 = 10 generated, then the forced fill (out[10], not fed)
        + T(39, 40, 41, 42, 43) + g(11, 26)  # fill -> next 5 text -> 15 speech -> fill (out[26])
        + T(44, 45, 46, 47, 48) + g(27, 42)
        + T(49, 50, 51, 52, 53) + g(43, 58)
        + T(54, 55, 56, 57, 58) + g(59, 74)
        + T(59, 60) + [TASK]  # end of text: the rest + task_id (the last speech token NOT re-fed)
        + g(75, 78)  # final decode: 3 tokens, each fed back, then eos
    )
    assert st.context == expected
    assert st.history.count(FILL) == 5
    assert st.speech == [t for t in st.history if t != FILL]
    assert len(st.speech) == 73 and st.done


def test_long_prompt_keeps_the_rest_of_the_prompt_speech() -> None:
    """Hand-built: the text (6 tokens) ends while 25 prompt speech tokens still wait."""
    prompt_text, prompt_speech, arrivals = CASES["long_prompt"]
    st = BistreamState(SPEC, prompt_text, prompt_speech, FREE)
    drive(st, arrivals, scripted(eos_after=2), upfront=False)
    expected = (
        [SOS, *T(7, 99)]
        + T(11, 31, 32, 33, 34) + list(range(1, 16))
        + T(35, 36) + [TASK] + list(range(16, 41))  # training layout: [t_rest, task_id, s_rest]
        + [100, 101]
    )
    assert st.context == expected
    # The official code drops s16..s40 instead (quirk 2).
    q = BistreamState(SPEC, prompt_text, prompt_speech, FREE, official_quirks=True)
    drive(q, arrivals, scripted(eos_after=2), upfront=False)
    assert q.context == [SOS, *T(7, 99), *T(11, 31, 32, 33, 34), *range(1, 16), *T(35, 36), TASK, 100, 101]


def test_no_prompt_speech_waits_for_the_first_text_block() -> None:
    prompt_text, prompt_speech, arrivals = CASES["no_prompt_speech"]
    st = BistreamState(SPEC, prompt_text, prompt_speech, FREE)
    assert st.next_run() is None
    for a in arrivals[:4]:
        st.push_text(a)
        assert st.next_run() is None  # 4 text tokens: not enough
    st.push_text(arrivals[4])
    run = st.next_run()
    assert run is not None and run.feed == (SOS, *T(7, 99), *T(31, 32, 33, 34, 35))
    assert run.fill_at == 15 and not run.final


def test_fill_cadence_and_rules() -> None:
    st = BistreamState(SPEC, [7, 99, 11, 12], list(range(1, 21)), FREE)
    for t in range(31, 45):
        st.push_text([t])
    run = st.next_run()
    assert run is not None and run.fill_at == 10
    for i in range(10):
        rule = st.token_rule()
        assert rule.forced is None and rule.allow_fill and not rule.allow_stop
        assert st.on_token(500 + i) == 500 + i and st.in_run
    assert st.token_rule().forced == FILL
    assert st.on_token(FILL) is None and not st.in_run
    run = st.next_run()  # 39..43 already there: the next block goes at once
    assert run is not None and run.feed == tuple(T(39, 40, 41, 42, 43)) and run.fill_at == 15
    with pytest.raises(ValueError):
        st.on_token(EOS)  # stop ids are masked while text may come


def test_length_limits_in_final_phase() -> None:
    st = BistreamState(SPEC, [7, 99], [], LengthLimits(min_ratio=2.0, max_ratio=3.0))
    st.push_text([31, 32])
    st.close_text()
    run = st.next_run()
    assert run is not None and run.final and run.feed == (SOS, *T(7, 99), *T(31, 32), TASK)
    emitted = []
    while st.in_run:
        rule = st.token_rule()
        assert rule.allow_stop == (len(emitted) >= 4)  # min = int(2 * 2)
        emitted.append(st.on_token(100))
    assert st.done and len(emitted) == 6  # max = int(2 * 3)


@pytest.mark.parametrize("ratio,expected", [(4.0, 40), (2.0, 30)])
def test_fixed_ratio_counts_streamed_tokens(ratio: float, expected: int) -> None:
    """10 text tokens with 15 prompt speech tokens stream 30 speech tokens (2 runs);
    a fixed length tops that up in the final run, or ends without one."""
    st = BistreamState(SPEC, [7, 99], list(range(1, 16)), LengthLimits(fixed_ratio=ratio))
    for t in range(31, 41):
        st.push_text([t])
    st.close_text()
    finals = 0
    while not st.done:
        run = st.next_run()
        if run is None:
            break
        finals += run.final
        while st.in_run:
            rule = st.token_rule()
            assert not (run.final and rule.allow_stop)
            st.on_token(rule.forced if rule.forced is not None else 200)
    assert st.done and len(st.speech) == expected
    assert finals == (1 if expected > 30 else 0)


def test_requires_end_of_prompt_for_cv3() -> None:
    with pytest.raises(ValueError):
        BistreamState(SPEC, [7, 8], [])
