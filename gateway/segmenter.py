"""Incremental text segmenter: streamed text in, speakable segments out.

Text arrives in appends of any size (often one LLM token at a time). We want to hand
the engine a segment as soon as it is a complete sentence, but never cut where a
reader would not pause: inside ``3.14``, ``10:30``, ``example.com/a.b``, after ``Mr.``.

Design points:

* A boundary is only *confirmed* once the character after it is known. A ``.`` at the
  very end of the buffer could still become ``3.1`` or ``...``; waiting for one more
  character makes the result independent of how the input was chunked (the property
  tests check exactly this).
* Except with ``eager_ends`` (the default): a text append that ends right after a mark
  which can only be a boundary once a space follows (after a word, not a number, an
  abbreviation, an initial, a URL or a growing ``..``) ends the segment there. One LLM
  token is ~33 ms at 30 tokens/s, and waiting for it delays every first audio by that
  much. The price: such a mark that the *next* append continues without a space
  (``example.`` + ``com``) is cut anyway. Whenever a whitespace does follow, the result
  is the same as without it (tested).
* Segments are contiguous slices of the context text, whitespace included, so their
  concatenation is the input and every segment carries exact character offsets.
  Whitespace after a boundary belongs to the *next* segment.
* The first segment of a context may end at a clause mark (comma, colon ...) so the
  first audio starts early; later segments end at sentence ends.
* No segment is longer than ``max_chars``: long runs are cut at the last clause mark,
  else the last whitespace, else hard.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

SegmentReason = Literal["sentence", "clause", "max", "flush", "end", "stream"]  # stream: ws stream mode

# Sentence terminators that need a following whitespace to count (Latin usage).
_LATIN_SENTENCE = frozenset(".!?;…")
# Terminators that end a sentence by themselves (CJK and fullwidth forms).
_CJK_SENTENCE = frozenset("。！？；．｡")
# Clause marks: an early first segment or a long sentence may be cut after them.
_LATIN_CLAUSE = frozenset(",:")
_CJK_CLAUSE = frozenset("，、：")
# Closers that stay with the sentence they close.
_CLOSERS = frozenset("\"')]}”’»」』】）》")
# Where a boundary can start: a terminator, a clause mark or a newline.
_MARK = re.compile("[" + re.escape("".join(sorted(_LATIN_SENTENCE | _CJK_SENTENCE | _LATIN_CLAUSE | _CJK_CLAUSE))) + "\n]")
# "Mr." & co: a period after these words does not end a sentence. Lower-cased, no dot.
_ABBREVIATIONS = frozenset(
    "mr mrs ms dr prof sr jr st vs etc eg ie cf al fig figs approx dept est inc ltd co corp "
    "mt ft no nos vol vols pp ca gen col lt sgt capt rev hon jan feb mar apr jun jul aug sep "
    "sept oct nov dec".split()
)


@dataclass(frozen=True)
class SegmenterConfig:
    """Tuning of the segmenter (all lengths in characters)."""

    # The first segment may end at a clause mark once it is at least this long.
    first_min_chars: int = 12
    # Later segments end at a sentence end only once they are at least this long
    # (0 = every sentence is its own segment); shorter sentences are merged.
    min_chars: int = 0
    # Hard maximum length of any segment.
    max_chars: int = 220
    # End a segment at a mark that closes a text append, without waiting for the next
    # character to confirm it (see the module docstring).
    eager_ends: bool = True

    def __post_init__(self) -> None:
        if self.max_chars < 8:
            raise ValueError("max_chars must be >= 8")
        if not 0 <= self.first_min_chars <= self.max_chars:
            raise ValueError("first_min_chars must be within [0, max_chars]")
        if not 0 <= self.min_chars <= self.max_chars:
            raise ValueError("min_chars must be within [0, max_chars]")


@dataclass(frozen=True)
class Segment:
    """One speakable piece: ``text == context_text[start:end]``."""

    index: int
    text: str
    start: int
    end: int
    reason: SegmentReason

    @property
    def speakable(self) -> bool:
        """True when the segment contains something to say (a letter or digit)."""
        return any(ch.isalnum() for ch in self.text)


@dataclass(frozen=True)
class _Boundary:
    pos: int  # cut position in the buffer (segment = buf[:pos])
    sentence: bool  # False = clause mark


def _is_abbreviation(buf: str, dot: int) -> bool:
    """Whether the period at ``buf[dot]`` closes an abbreviation or an initial."""
    start = dot
    while start > 0 and not buf[start - 1].isspace():
        start -= 1
    word = buf[start:dot].lstrip("\"'([{“‘«")
    if not word:
        return False
    if len(word) == 1 and word.isalpha():
        return True  # "J. Smith", "a. first item" reads better unsplit
    if "." in word:
        return True  # dotted forms: e.g / i.e / U.S / a.m
    return word.lower() in _ABBREVIATIONS


# Marks that may end a segment eagerly; ":" is left out ("http:" + "//...").
_EAGER_MARKS = frozenset(".!?;…,") | _CJK_SENTENCE | frozenset("，、")
# CJK marks that never sit inside a number ("．" does: "３．１４").
_CJK_NOT_DECIMAL = (_CJK_SENTENCE | _CJK_CLAUSE) - {"．"}
# Characters in a word that make a mark right after it part of an address ("a.b/c?x=1"),
# which the next character may continue.
_ADDRESS_CHARS = frozenset("/@:\\_=&#%")


def _eager_end(buf: str, i: int) -> bool:
    """Whether the mark run ``buf[i:]`` (closing the buffer) is a boundary as long as a
    whitespace would follow: the one case the next character could still veto is left
    to it (digits, abbreviations, addresses, a ".." that may grow to "...")."""
    marks = [c for c in buf[i:] if c not in _CLOSERS]
    if buf[i] in _CJK_NOT_DECIMAL:
        return i > 0  # no decimal point or address part: "共3。" ends there
    if i == 0 or not (buf[i - 1].isalpha() or buf[i - 1] in _CLOSERS):
        return False  # "3." may become "3.5", "1," "1,000"
    if any(c not in _EAGER_MARKS for c in marks) or marks == [".", "."]:
        return False
    start = i
    while start > 0 and not buf[start - 1].isspace():
        start -= 1
    if not _ADDRESS_CHARS.isdisjoint(buf[start:i]):
        return False  # "https://a.b/c?" + "x=1"
    return not (marks == ["."] and _is_abbreviation(buf, i))


def _scan(buf: str, final: bool, eager: bool = False) -> list[_Boundary]:
    """All confirmed boundaries in ``buf``, in order.

    With ``final`` the end of the buffer counts as "followed by whitespace", which is
    how flush/end resolve a trailing "." (the caller cuts the remainder anyway). With
    ``eager`` it does so for a mark run that `_eager_end` accepts.
    """
    out: list[_Boundary] = []
    n = len(buf)
    # The buffer is re-scanned on every append (one LLM token): the regex skips the
    # ordinary characters in C, so only the marks cost Python steps.
    m = _MARK.search(buf)
    while m is not None:
        i = m.start()
        ch = buf[i]
        if ch == "\n":
            j = i + 1
            while j < n and buf[j] == "\n":
                j += 1
            if j >= n and not final:
                break  # more newlines may follow
            out.append(_Boundary(j, True))
            m = _MARK.search(buf, j)
            continue
        # Extend over a run of terminators and closing quotes: "?!", "...", "。」".
        cjk = ch in _CJK_SENTENCE or ch in _CJK_CLAUSE
        j = i + 1
        sentence = ch in _LATIN_SENTENCE or ch in _CJK_SENTENCE
        while j < n and (buf[j] in _LATIN_SENTENCE or buf[j] in _CJK_SENTENCE or buf[j] in _CLOSERS):
            sentence = sentence or buf[j] in _LATIN_SENTENCE or buf[j] in _CJK_SENTENCE
            cjk = cjk or buf[j] in _CJK_SENTENCE
            j += 1
        if j >= n and not final and not (eager and _eager_end(buf, i)):
            break  # the run may still grow: undecided
        nxt = buf[j] if j < n else " "
        if cjk or nxt.isspace():
            if not (ch == "." and j == i + 1 and _is_abbreviation(buf, i)):
                out.append(_Boundary(j, sentence))
        m = _MARK.search(buf, j)
    return out


class Segmenter:
    """Cuts one context's streamed text into segments. Not thread-safe; one per context."""

    def __init__(self, config: SegmenterConfig | None = None) -> None:
        self.config = config or SegmenterConfig()
        self._buf = ""
        self._offset = 0  # context offset of _buf[0]
        self._count = 0
        self._ended = False

    @property
    def buffered(self) -> str:
        """Text received but not yet emitted."""
        return self._buf

    @property
    def ended(self) -> bool:
        return self._ended

    @property
    def emitted_chars(self) -> int:
        return self._offset

    def push(self, text: str) -> list[Segment]:
        """Append text; return the segments it completed (possibly none)."""
        if self._ended:
            raise RuntimeError("segmenter already ended")
        self._buf += text
        return self._drain(final=False)

    def flush(self) -> list[Segment]:
        """Emit everything buffered that has something besides whitespace."""
        if self._ended:
            return []
        out = self._drain(final=True)
        if self._buf.strip():
            out.append(self._emit(len(self._buf), "flush"))
        return out

    def end(self) -> list[Segment]:
        """Flush and close; a whitespace-only tail is emitted too so nothing is lost."""
        if self._ended:
            return []
        out = self._drain(final=True)
        if self._buf:
            out.append(self._emit(len(self._buf), "end"))
        self._ended = True
        return out

    # -- internals ---------------------------------------------------------------

    def _emit(self, pos: int, reason: SegmentReason) -> Segment:
        text = self._buf[:pos]
        seg = Segment(self._count, text, self._offset, self._offset + pos, reason)
        self._count += 1
        self._offset += pos
        self._buf = self._buf[pos:]
        return seg

    def _drain(self, final: bool) -> list[Segment]:
        cfg = self.config
        out: list[Segment] = []
        while self._buf:
            bounds = _scan(self._buf, final, cfg.eager_ends)
            first = self._count == 0
            cut: _Boundary | None = None
            for b in bounds:
                if b.pos > cfg.max_chars:
                    break
                size = len(self._buf[: b.pos].strip())
                if size == 0:
                    continue
                if first and (b.sentence or size >= cfg.first_min_chars):
                    cut = b
                    break
                if not first and b.sentence and size >= cfg.min_chars:
                    cut = b
                    break
            if cut is not None:
                out.append(self._emit(cut.pos, "sentence" if cut.sentence else "clause"))
                continue
            if len(self._buf) > cfg.max_chars:
                out.append(self._emit(self._forced_cut(bounds), "max"))
                continue
            break
        return out

    def _forced_cut(self, bounds: list[_Boundary]) -> int:
        """Where to cut a buffer longer than max_chars with no regular boundary."""
        limit = self.config.max_chars
        usable = [b for b in bounds if b.pos <= limit and self._buf[: b.pos].strip()]
        if usable:
            # Prefer the latest sentence end, then the latest clause mark.
            sentences = [b for b in usable if b.sentence]
            return (sentences or usable)[-1].pos
        # Last whitespace that leaves something before it; the space starts the next one.
        for k in range(limit, 0, -1):
            if self._buf[k].isspace() and self._buf[:k].strip():
                return k
        return limit
