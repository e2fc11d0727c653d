"""Text-in streaming ("bistream"): the LM reads text and writes speech interleaved.

CosyVoice2/3 were trained on sequences in which text and speech alternate in blocks:

    [sos, <system part up to <|endofprompt|>>,            (CosyVoice3 only)
     t t t t t, s s s ... s (15), t t t t t, s ... s (15), ...,
     <the last < 5 text tokens>, task_id, s s s ..., eos]

and after each 15-token speech block the model predicts `fill_token`, i.e. "give me
the next 5 text tokens". The speech of the voice prompt takes the place of the first
speech blocks (its transcript is the first text). So the LM can start speaking after
the first few words instead of after the whole sentence.

`BistreamState` is that interleaving as one pure state machine, shared by every LM
backend. It never touches a model: a driver asks it what to feed, samples under the
rule it gives, and reports each sampled token back.

    st = BistreamState(spec, prompt_text_ids, prompt_speech_tokens, limits)
    st.push_text([...]); st.close_text()          # the text side (any time, any chunking)
    run = st.next_run()                           # between runs: None = wait for text
    feed run.feed; then until the run ends:
        rule = st.token_rule(); tok = rule.forced or sample(masked by rule)
        st.on_token(tok) -> speech token to emit, or None
        feed [tok] back if st.in_run

A *run* is one stretch of decoding: the driver appends `run.feed` to the context and
samples until the run ends (a fill token in a streaming run, a stop id or a length
limit in the final run). Speech tokens sampled inside a run are fed back one by one
by the driver; fill tokens never enter the context (the next text block does).

Faithfulness to the official `Qwen2LM.inference_bistream` (cosyvoice/llm/llm.py):
text is processed in the *arrivals* it was pushed in (one `push_text` call = one item
of the official text generator), and arrivals are consumed only between runs, exactly
where the official loop reads its generator. So for the same arrivals and the same
sampled tokens, the context equals the official one -- with three exceptions, where
the official code departs from its own training layout (`prepare_lm_input_target`).
`official_quirks=True` reproduces them (tests compare both ways):

1. At the end of text the official code appends `[lm_input, text_cache, task_id]`,
   where `lm_input` is the input *already consumed* by the last decode step, so the
   last speech token (or text block) is fed twice. Default: fed once, as in training.
2. If the text ends while prompt speech is still waiting for text to pair with, the
   official code drops the rest of the prompt speech and the model re-speaks the end
   of the prompt transcript. Default: it follows `task_id` ([t_rest, task_id, s_rest]),
   which is how training lays out a sequence whose text runs out.
3. CosyVoice3 without prompt speech (cross-lingual, instruct): the official test
   "only sos so far" never holds after the system prefix, so decoding starts with no
   target text at all. Default: wait for the first 5 text tokens, as in training.

Sampling rules: while text may still come, every stop id except `fill` is masked (the
official code would raise on them); `fill` may be sampled freely and is forced at the
official `next_fill_index`. In the final run stop ids are allowed once `min` speech
tokens exist; the min/max limits are the unistream ones (ratios of the number of
target text tokens), plus an absolute cap.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from engine.backends.base import SamplingParams

# `<|endofprompt|>` of the CosyVoice3 tokenizer (hard-coded in the official LM too).
END_OF_PROMPT_ID = 151646


class TextInLM(Protocol):
    """An LM backend (`engine.backends.base.LMBackend`) that also takes an utterance's text
    while it decodes it; the engine refuses text-in streaming on one that does not."""

    def generate_streaming(self, request: "BistreamRequest", text_source: AsyncIterator[list[int]]) -> AsyncIterator[int]:
        """One generation fed text token ids as they arrive: each item of `text_source` is
        one arrival of raw text ids, its end the end of the text. The interleaving (5 text
        tokens, 15 speech tokens, fill) is `BistreamState`'s; speech ids are yielded as in
        `LMBackend.generate`."""
        ...


class SpeechLimitReached(RuntimeError):
    """An utterance reached a hard cap of speech tokens (the LM's context window) before its
    text was spoken: while a text-in stream's text could still come, or, for a whole text,
    below the model's own maximum for its length. The rest would go unspoken, so it is an
    error, not an end (the engine's code `speech_too_long`)."""

    def __init__(self, limit: int, streaming: bool = True) -> None:
        when = "while its text was still coming" if streaming else "before the model ended its speech"
        super().__init__(f"the utterance reached its limit of {limit} speech tokens (the LM's context) {when}; "
                         "the rest of its text was not spoken (send shorter segments)")


@dataclass(frozen=True)
class BistreamSpec:
    """Token ids (unified vocabulary) and block sizes of one LM."""

    sos: int
    task_id: int
    fill: int
    speech_token_size: int  # ids >= this are reserved (stop/special), never speech
    text_offset: int  # unified id of raw text id 0
    mix_text: int = 5
    mix_speech: int = 15
    # CosyVoice3 keeps the prompt text up to <|endofprompt|> in front of the first
    # block; None (CosyVoice2) treats the whole prompt text as interleavable text.
    end_of_prompt: int | None = END_OF_PROMPT_ID

    @classmethod
    def from_lm_config(cls, cfg: Any) -> "BistreamSpec":
        """From an `LMConfig` (or any config with the same properties). CosyVoice2's
        config puts extra prompt rows before the text (its sos/task_id table) and has
        no <|endofprompt|> handling in bistream."""
        text_offset = getattr(cfg, "text_offset", cfg.speech_vocab_size)
        end_of_prompt = END_OF_PROMPT_ID if text_offset == cfg.speech_vocab_size else None
        return cls(
            sos=cfg.sos,
            task_id=cfg.task_id,
            fill=cfg.fill_token,
            speech_token_size=cfg.speech_token_size,
            text_offset=text_offset,
            mix_text=cfg.mix_ratio[0],
            mix_speech=cfg.mix_ratio[1],
            end_of_prompt=end_of_prompt,
        )


@dataclass(frozen=True)
class LengthLimits:
    """Length rules of one utterance, applied when its text has ended.

    min/max are `int(n * ratio)` of the n target text tokens (prompt excluded), as in
    the unistream path. `fixed_ratio` (benchmarks: random weights never stop) makes the
    utterance exactly `max(1, round(n * fixed_ratio))` speech tokens long, or as long as
    the streaming part already made it. `hard_max` caps everything.
    """

    min_ratio: float = 2.0
    max_ratio: float = 20.0
    fixed_ratio: float | None = None
    hard_max: int = 4000


@dataclass(frozen=True)
class Run:
    feed: tuple[int, ...]  # unified ids appended to the context before the first sample
    final: bool  # the text has ended: decode to a stop id / the length limit
    fill_at: int | None  # streaming run: fill is forced at this sample index of the run


@dataclass(frozen=True)
class TokenRule:
    """How to draw the next token of the current run."""

    forced: int | None  # take this id without sampling (the logits are unused)
    allow_fill: bool  # streaming runs: fill may be sampled
    allow_stop: bool  # final run: stop ids may be sampled


@dataclass(frozen=True)
class BistreamRequest:
    """One utterance whose text arrives while it is spoken (`TextInLM.generate_streaming`).
    Sampling uses `sampling`'s RAS/greedy/seed fields; its
    min/max/fixed lengths are replaced by `limits` (the text length is not known yet)."""

    request_id: str
    prompt_text: tuple[int, ...]  # raw text ids (CosyVoice3: contains <|endofprompt|>)
    prompt_speech: tuple[int, ...]  # codebook ids of the voice prompt (may be empty)
    sampling: SamplingParams
    limits: LengthLimits = LengthLimits()
    official_quirks: bool = False

    def new_state(self, spec: BistreamSpec) -> "BistreamState":
        return BistreamState(spec, self.prompt_text, self.prompt_speech, self.limits, self.official_quirks)


class BistreamState:
    """The interleaving state of one utterance. Not thread-safe: one owner at a time."""

    def __init__(
        self,
        spec: BistreamSpec,
        prompt_text: Sequence[int],
        prompt_speech: Sequence[int] = (),
        limits: LengthLimits = LengthLimits(),
        official_quirks: bool = False,
    ) -> None:
        self.spec = spec
        self.limits = limits
        self.quirks = official_quirks
        prompt_text = list(prompt_text)
        head: list[int] = []
        if spec.end_of_prompt is not None:
            if spec.end_of_prompt not in prompt_text:
                raise ValueError("CosyVoice3 bistream needs <|endofprompt|> in the prompt text")
            cut = prompt_text.index(spec.end_of_prompt) + 1
            head, prompt_text = prompt_text[:cut], prompt_text[cut:]
        if any(not 0 <= t < spec.speech_token_size for t in prompt_speech):
            raise ValueError("prompt speech tokens must be codebook ids")
        self._unfed: list[int] = [spec.sos, *self._text(head)]  # appended, not yet fed
        self._text_cache: deque[int] = deque(prompt_text)  # raw ids not yet appended
        self._prompt_speech: deque[int] = deque(prompt_speech)
        self._had_prompt_speech = bool(prompt_speech)
        p = len(prompt_speech)
        # Number of sampled tokens (fills included) at which the first fill is forced,
        # so that the first generated block completes the prompt's last partial block.
        self._next_fill = (p // spec.mix_speech + 1) * spec.mix_speech - p
        self._arrivals: deque[list[int]] = deque()
        self._closed = False
        self._started = False  # something has been fed to the model
        self._last_fed: list[int] = []  # the most recent input the model consumed
        self._run: Run | None = None
        self._run_samples = 0
        self._done = False
        self.cut_short = False  # ended at `limits.hard_max` while text could still come
        self.history: list[int] = []  # every sampled token incl. fills (the RAS window)
        self.speech: list[int] = []  # the speech tokens emitted
        self.context: list[int] = []  # every id fed to the model, in order
        self.num_text = 0  # target text tokens received (prompt excluded)

    # ------------------------------------------------------------------ text side

    def push_text(self, ids: Sequence[int]) -> None:
        """One arrival of raw text ids (an empty one still counts, as in the official loop)."""
        if self._closed:
            raise RuntimeError("text already closed")
        ids = [int(t) for t in ids]
        self.num_text += len(ids)
        self._arrivals.append(ids)

    def close_text(self) -> None:
        self._closed = True

    @property
    def text_closed(self) -> bool:
        return self._closed

    # ------------------------------------------------------------------ model side

    @property
    def done(self) -> bool:
        return self._done

    @property
    def in_run(self) -> bool:
        return self._run is not None

    @property
    def run(self) -> Run | None:
        return self._run

    @property
    def run_samples(self) -> int:
        """Tokens sampled so far in the current run."""
        return self._run_samples

    def next_run(self) -> Run | None:
        """The next run, or None: wait for text (or the utterance is `done`)."""
        if self._done or self._run is not None:
            raise RuntimeError("next_run() only between runs of an unfinished utterance")
        while self._arrivals:
            run = self._take_arrival(self._arrivals.popleft())
            if run is not None:
                return self._start(run)
        if not self._closed:
            return None
        return self._final_run()

    def token_rule(self) -> TokenRule:
        run = self._require_run()
        if not run.final:
            if run.fill_at is not None and self._run_samples == run.fill_at:
                return TokenRule(forced=self.spec.fill, allow_fill=True, allow_stop=False)
            return TokenRule(forced=None, allow_fill=True, allow_stop=False)
        allow = self.limits.fixed_ratio is None and len(self.speech) >= self._min_len()
        return TokenRule(forced=None, allow_fill=False, allow_stop=allow)

    def on_token(self, token: int) -> int | None:
        """Record the token sampled for the current run; returns the speech token to
        emit (None for fill / stop). After it, `in_run` says whether to feed it back."""
        run = self._require_run()
        token = int(token)
        self._run_samples += 1
        reserved = token >= self.spec.speech_token_size
        if not run.final:
            index = len(self.history)
            self.history.append(token)
            if token == self.spec.fill:
                # The fill is not fed: the next text block follows the last speech token.
                self._next_fill = index + self.spec.mix_speech + 1
                self._run = None
                return None
            if reserved:
                raise ValueError(f"reserved id {token} sampled while text may still come")
            return self._emit(token, limit=self.limits.hard_max)
        if reserved:
            self._finish()
            return None
        self.history.append(token)
        return self._emit(token, limit=self._max_len())

    def remaining_limits(self) -> tuple[int, int]:
        """(min, max) speech tokens still to generate once the text has ended."""
        done = len(self.speech)
        return max(0, self._min_len() - done), max(0, self._max_len() - done)

    # ------------------------------------------------------------------ internals

    def _text(self, raw: Sequence[int]) -> list[int]:
        off = self.spec.text_offset
        return [off + t for t in raw]

    def _take_block(self, n: int) -> list[int]:
        return self._text([self._text_cache.popleft() for _ in range(n)])

    def _take_arrival(self, ids: list[int]) -> Run | None:
        """The body of the official `for this_text in text` loop for one arrival."""
        s = self.spec
        self._text_cache.extend(ids)
        # Pair prompt speech with text while both are there (5 text + up to 15 speech).
        while self._prompt_speech and len(self._text_cache) >= s.mix_text:
            self._unfed += self._take_block(s.mix_text)
            n = min(s.mix_speech, len(self._prompt_speech))
            self._unfed += [self._prompt_speech.popleft() for _ in range(n)]
        if self._prompt_speech:
            return None  # not enough text yet to place the rest of the prompt speech
        if self._needs_text_block():
            if len(self._text_cache) < s.mix_text:
                return None
            self._unfed += self._take_block(s.mix_text)
        return Run(tuple(self._unfed), final=False, fill_at=self._next_fill - len(self.history))

    def _needs_text_block(self) -> bool:
        if self.history:
            return self.history[-1] == self.spec.fill
        if self.quirks:
            return len(self._unfed) == 1  # official: "lm_input is just sos"
        return not self._had_prompt_speech

    def _final_run(self) -> Run | None:
        if len(self.speech) >= self._max_len():  # e.g. a fixed length already reached
            self._finish()
            return None
        if self.quirks and self._started:
            head = list(self._last_fed)  # quirk 1: the consumed input goes in again
        else:
            head = list(self._unfed)
        rest = [] if self.quirks else list(self._prompt_speech)  # quirk 2: dropped
        self._prompt_speech.clear()
        tail = self._text(list(self._text_cache))
        self._text_cache.clear()
        return self._start(Run(tuple([*head, *tail, self.spec.task_id, *rest]), final=True, fill_at=None))

    def _start(self, run: Run) -> Run:
        self._unfed = []
        self._run = run
        self._run_samples = 0
        self._feed(list(run.feed))
        return run

    def _feed(self, ids: list[int]) -> None:
        self.context += ids
        self._last_fed = ids
        self._started = True

    def _emit(self, token: int, limit: int) -> int:
        self.speech.append(token)
        if len(self.speech) >= limit:
            # At the hard cap with text still to come (a streaming run) the utterance ends
            # short of its text: the backends raise `SpeechLimitReached`, not a quiet end.
            self.cut_short = self._run is not None and not self._run.final
            self._finish()
        else:
            self._feed([token])  # the driver feeds it back before the next sample
        return token

    def _finish(self) -> None:
        self._run = None
        self._done = True

    def _require_run(self) -> Run:
        if self._run is None:
            raise RuntimeError("no run in progress")
        return self._run

    def _fixed_len(self) -> int | None:
        r = self.limits.fixed_ratio
        return None if r is None else max(1, int(round(self.num_text * r)))

    def _min_len(self) -> int:
        return int(self.num_text * self.limits.min_ratio)

    def _max_len(self) -> int:
        if self.num_text == 0:
            return 0  # no target text: nothing to speak
        fixed = self._fixed_len()
        if fixed is not None:
            return min(max(fixed, len(self.speech)), self.limits.hard_max)
        return min(int(self.num_text * self.limits.max_ratio), self.limits.hard_max)
