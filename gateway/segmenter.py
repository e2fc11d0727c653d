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

import bisect
import re
import unicodedata
from dataclasses import dataclass
from typing import Literal

# stream, idle: ws stream mode (a streamed utterance still open; one ended by `stream_idle_s`)
SegmentReason = Literal["sentence", "clause", "max", "flush", "end", "stream", "idle"]

# Sentence terminators that need a following whitespace to count (Latin usage).
_LATIN_SENTENCE = frozenset(".!?;…")
# Terminators that end a sentence by themselves (CJK and fullwidth forms).
_CJK_SENTENCE = frozenset("。！？；．｡")
# Clause marks: an early first segment or a long sentence may be cut after them.
_LATIN_CLAUSE = frozenset(",:")
_CJK_CLAUSE = frozenset("，、：")
# Closers that stay with the sentence they close.
_CLOSERS = frozenset("\"')]}”’»」』】）》")
# What ends a word besides whitespace (`_word_start`).
_WORD_BREAKS = _CJK_SENTENCE | _CJK_CLAUSE | frozenset("」』】）》!?;…")
# Where a boundary can start: a terminator, a clause mark or a newline.
_MARK = re.compile("[" + re.escape("".join(sorted(_LATIN_SENTENCE | _CJK_SENTENCE | _LATIN_CLAUSE | _CJK_CLAUSE))) + "\n]")
# "Mr." & co: a period after these words does not end a sentence. Lower-cased, no dot.
_ABBREVIATIONS = frozenset(
    "mr mrs ms dr prof sr jr st vs etc eg ie cf al fig figs approx dept est inc ltd co corp "
    "mt ft vol vols pp ca gen col lt sgt capt rev hon jan feb mar apr jun jul aug sep "
    "sept oct nov dec".split()
)


# "No." and "Nos." abbreviate "number" only before one ("No. 5", "No. #3"); otherwise
# "No." is a whole sentence ("No. I can't."), which the word after it decides.
_NUMBER_ABBREVIATIONS = frozenset(("no", "nos"))
# A dotted word is an abbreviation when each of its parts is a letter or two: "e.g", "U.S",
# "a.m", "Ph.D"; not "2.0", "Node.js" or "example.com", which end sentences.
_DOTTED_ABBREVIATION = re.compile(r"(?:[^\W\d_]{1,2}\.)+[^\W\d_]{1,2}")
# Ideographs and kana: ASCII punctuation between two of them needs no space to end a
# sentence or clause ("你好!我是小明"), as LLMs often write Chinese.
_CJK_CHAR = re.compile("[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
# Latin marks read as CJK ones between CJK characters.
_LATIN_IN_CJK = frozenset(".!?;,")


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


def _word_start(buf: str, i: int) -> int:
    """Where the word ending at ``buf[i]`` (exclusive) starts: after a whitespace, or after
    a terminator other than a period, or a CJK mark or closer ("好。etc." and "!Mr." read
    "etc" and "Mr"; a period belongs to the word: "e.g", "a.b/c")."""
    start = i
    while start > 0 and not buf[start - 1].isspace() and buf[start - 1] not in _WORD_BREAKS:
        start -= 1
    return start


def _word(buf: str, dot: int) -> str:
    """The word before the period at ``buf[dot]``, opening quotes and brackets left out."""
    return buf[_word_start(buf, dot):dot].lstrip("\"'([{“‘«")


def _is_abbreviation(buf: str, dot: int) -> bool:
    """Whether the period at ``buf[dot]`` closes an abbreviation or an initial ("No." as
    one: the caller decides it by the word after it)."""
    word = _word(buf, dot)
    if not word:
        return False
    if len(word) == 1 and word.isalpha():
        return word != "I"  # "J. Smith", "a. first item" read better unsplit; "So did I." ends
    if "." in word:
        return _DOTTED_ABBREVIATION.fullmatch(word) is not None
    lower = word.lower()
    return lower in _ABBREVIATIONS or lower in _NUMBER_ABBREVIATIONS


def _is_list_marker(buf: str, dot: int, line_start: bool) -> bool:
    """Whether the period at ``buf[dot]`` closes a numbered list's marker: 1-3 digits at the
    start of a line ("\n2. Tap login."), read with its item rather than alone."""
    start = _word_start(buf, dot)
    if not (0 < dot - start <= 3 and buf[start:dot].isdigit()):
        return False
    while start > 0 and buf[start - 1] in " \t":
        start -= 1
    return buf[start - 1] == "\n" if start > 0 else line_start


def _is_cjk(ch: str) -> bool:
    return _CJK_CHAR.match(ch) is not None


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
    if not _ADDRESS_CHARS.isdisjoint(buf[_word_start(buf, i):i]):
        return False  # "https://a.b/c?" + "x=1"
    return not (marks == ["."] and _is_abbreviation(buf, i))


def _scan(buf: str, start: int, final: bool, eager: bool = False,
          line_start: bool = False) -> tuple[list[_Boundary], int]:
    """The boundaries in ``buf`` from ``start`` on, in order, and where the scan stopped:
    at an undecided mark run (one that more text may still change), else ``len(buf)``.

    Without ``final`` or ``eager`` a boundary found depends only on the text up to the
    character after it (for "No.", the word after it), so it stays a boundary whatever is
    appended: `Segmenter` keeps them and scans each appended piece once. With ``final`` the end of the buffer counts
    as "followed by whitespace", which is how flush/end resolve a trailing "." (the caller
    cuts the remainder anyway). With ``eager`` it does so for a mark run that `_eager_end`
    accepts. ``line_start``: ``buf`` starts a line (the context's, or one after a newline).
    """
    out: list[_Boundary] = []
    n = len(buf)
    # The regex skips the ordinary characters in C, so only the marks cost Python steps.
    m = _MARK.search(buf, start)
    while m is not None:
        i = m.start()
        ch = buf[i]
        if ch == "\n":
            j = i + 1
            while j < n and buf[j] == "\n":
                j += 1
            if j >= n and not final:
                return out, i  # more newlines may follow
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
            return out, i  # the run may still grow: undecided
        nxt = buf[j] if j < n else " "
        if not cjk and ch in _LATIN_IN_CJK and j == i + 1 and j < n and i > 0 and _is_cjk(buf[i - 1]) and _is_cjk(nxt):
            cjk = True
        if ch == "．" and j == i + 1 and i > 0 and buf[i - 1].isdigit() and nxt.isdigit():
            cjk = False  # a fullwidth decimal point: "３．１４"
        elif cjk or nxt.isspace():
            single_dot = ch == "." and j == i + 1 and not cjk
            if single_dot and _word(buf, i).lower() in _NUMBER_ABBREVIATIONS:
                k = j
                while k < n and buf[k].isspace():
                    k += 1
                if k >= n and not final:
                    return out, i  # "No." + " 5" or " I": the word after it decides
                if k >= n or not (buf[k].isdigit() or buf[k] == "#"):
                    out.append(_Boundary(j, sentence))
            elif not (single_dot and (_is_abbreviation(buf, i) or _is_list_marker(buf, i, line_start))):
                out.append(_Boundary(j, sentence))
        m = _MARK.search(buf, j)
    return out, n


def _content_end(buf: str, lead: int, pos: int) -> int:
    """``pos`` moved back over the whitespace before it, not past ``lead``."""
    while pos > lead and buf[pos - 1].isspace():
        pos -= 1
    return pos


class Segmenter:
    """Cuts one context's streamed text into segments. Not thread-safe; one per context.

    Appended text is scanned once: the boundaries found are kept (`_scan`), at context
    offsets, and a cut is looked up among them by bisection. Rescanning the whole buffer
    for every cut made one 20,000-character message of short sentences take seconds of
    the event loop (quadratic in its length)."""

    def __init__(self, config: SegmenterConfig | None = None) -> None:
        self.config = config or SegmenterConfig()
        self._buf = ""
        self._offset = 0  # context offset of _buf[0]
        self._count = 0
        self._ended = False
        # Boundaries that no later text can change, at context offsets, in order: all of
        # them, and the sentence ends among them. `_first`/`_first_sentence` index the
        # first not yet emitted; `_scanned` is where the next scan starts.
        self._bounds: list[int] = []
        self._is_sentence: list[bool] = []
        self._sentences: list[int] = []
        self._first = self._first_sentence = 0
        self._scanned = 0
        self._line_start = True  # the buffer starts a line (the context, or after a newline)

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
        if text:
            self._line_start = text[-1] == "\n"
        seg = Segment(self._count, text, self._offset, self._offset + pos, reason)
        self._count += 1
        self._offset += pos
        self._buf = self._buf[pos:]
        self._scanned = max(self._scanned, self._offset)
        self._first = bisect.bisect_right(self._bounds, self._offset, self._first)
        self._first_sentence = bisect.bisect_right(self._sentences, self._offset, self._first_sentence)
        if self._first > 1024 and self._first * 2 > len(self._bounds):  # drop what was emitted
            del self._bounds[: self._first], self._is_sentence[: self._first]
            del self._sentences[: self._first_sentence]
            self._first = self._first_sentence = 0
        return seg

    def _keep_scanning(self) -> None:
        """Scan what was appended since the last scan; keep the boundaries it confirms."""
        base = self._offset
        found, stop = _scan(self._buf, self._scanned - base, False, False, self._line_start)
        for b in found:
            self._bounds.append(base + b.pos)
            self._is_sentence.append(b.sentence)
            if b.sentence:
                self._sentences.append(base + b.pos)
        self._scanned = base + stop

    def _drain(self, final: bool) -> list[Segment]:
        cfg = self.config
        out: list[Segment] = []
        while self._buf:
            self._keep_scanning()
            # The undecided run at the end, decided as the end of the text (final) or of
            # an append (eager): not kept, the next append may decide it otherwise.
            tail = _scan(self._buf, self._scanned - self._offset, final, cfg.eager_ends, self._line_start)[0] \
                if final or cfg.eager_ends else []
            cut = self._regular_cut(tail)
            if cut is not None:
                out.append(self._emit(cut[0], "sentence" if cut[1] else "clause"))
                continue
            if len(self._buf) > cfg.max_chars:
                out.append(self._emit(self._forced_cut(tail), "max"))
                continue
            break
        return out

    def _lead(self) -> int:
        """Index of the buffer's first non-whitespace character (its length if none)."""
        lead, buf = 0, self._buf
        while lead < len(buf) and buf[lead].isspace():
            lead += 1
        return lead

    def _regular_cut(self, tail: list[_Boundary]) -> tuple[int, bool] | None:
        """The earliest boundary (buffer position, sentence or not) within max_chars that
        ends a segment: for the first one a sentence end, or any boundary once the
        segment has first_min_chars; for later ones a sentence end once it has min_chars
        (whitespace at either end not counted; nothing but whitespace never)."""
        cfg, buf, base = self.config, self._buf, self._offset
        lead = self._lead()
        # (kept positions, the first not emitted, the size a segment ending there needs)
        kinds = [(self._sentences, self._first_sentence, 1)]
        if self._count == 0:
            kinds.append((self._bounds, self._first, cfg.first_min_chars))
        else:
            kinds[0] = (self._sentences, self._first_sentence, cfg.min_chars)
        best: tuple[int, bool] | None = None
        for positions, first, size in kinds:
            size = max(size, 1)
            # A boundary's segment is at most pos - lead long: skip the ones shorter still.
            k = bisect.bisect_left(positions, base + lead + size, first)
            while k < len(positions) and positions[k] - base <= cfg.max_chars:
                pos = positions[k] - base
                if _content_end(buf, lead, pos) - lead >= size:
                    sentence = positions is self._sentences or self._is_sentence[k]
                    if best is None or pos < best[0]:
                        best = (pos, sentence)
                    break
                k += 1
        for b in tail:
            if best is not None or b.pos > cfg.max_chars:
                break
            size = _content_end(buf, lead, b.pos) - lead
            if size == 0:
                continue
            if self._count == 0 and (b.sentence or size >= cfg.first_min_chars):
                best = (b.pos, b.sentence)
            elif self._count > 0 and b.sentence and size >= cfg.min_chars:
                best = (b.pos, b.sentence)
        return best

    def _forced_cut(self, tail: list[_Boundary]) -> int:
        """Where to cut a buffer longer than max_chars with no regular boundary."""
        limit, buf, base = self.config.max_chars, self._buf, self._offset
        lead = self._lead()
        usable = [b for b in tail if b.pos <= limit and _content_end(buf, lead, b.pos) > lead]
        # Prefer the latest sentence end, then the latest clause mark.
        sentences = [b for b in usable if b.sentence]
        if sentences:
            return sentences[-1].pos
        k = bisect.bisect_right(self._sentences, base + limit, self._first_sentence)
        if k > self._first_sentence and _content_end(buf, lead, self._sentences[k - 1] - base) > lead:
            return self._sentences[k - 1] - base
        if usable:
            return usable[-1].pos
        k = bisect.bisect_right(self._bounds, base + limit, self._first)
        if k > self._first and _content_end(buf, lead, self._bounds[k - 1] - base) > lead:
            return self._bounds[k - 1] - base
        # Last whitespace that leaves something before it; the space starts the next one.
        for k in range(limit, 0, -1):
            if buf[k].isspace() and buf[:k].strip():
                return k
        # Hard, but not inside a character as read: a combining mark, a joined emoji.
        for k in range(limit, 0, -1):
            if not _continues_cluster(buf, k):
                return k
        return limit


def _continues_cluster(buf: str, k: int) -> bool:
    """Whether ``buf[k]`` belongs with the character before it (a combining mark, a
    variation selector or skin tone, either side of a zero-width joiner)."""
    ch = buf[k]
    return (unicodedata.combining(ch) != 0 or ch == _ZWJ or buf[k - 1] == _ZWJ
            or "\ufe00" <= ch <= "\ufe0f" or "\U0001f3fb" <= ch <= "\U0001f3ff")


_ZWJ = "\u200d"
