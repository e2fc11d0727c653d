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
  else the last whitespace, else hard. Such a cut waits while "No." waits for the word
  after it and only whitespace lies past ``max_chars``, decisions read what the segments
  before hold (the word before a mark may have begun in one), and a cut inside a run of
  marks leaves the rest of the run to be decided again: otherwise the segments would
  depend on where the messages ended.
"""

from __future__ import annotations

import bisect
import re
import unicodedata
from dataclasses import dataclass, replace
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
_CLOSER_CHARS = "".join(sorted(_CLOSERS))
# A run of marks goes on over these; read by regular expressions and str methods, in C: a
# character at a time in Python, a long run read again at every cut forced inside it took
# seconds ("。" * 20,000 at max_chars 8: 5.5 s).
_RUN_GOES_ON = re.compile("[" + re.escape("".join(sorted(_LATIN_SENTENCE | _CJK_SENTENCE | _CLOSERS))) + "]*")
_TERMINATOR = re.compile("[" + re.escape("".join(sorted(_LATIN_SENTENCE | _CJK_SENTENCE))) + "]")
_CJK_TERMINATOR = re.compile("[" + re.escape("".join(sorted(_CJK_SENTENCE))) + "]")
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


# The shortest hard maximum a client may set for a segment.
MIN_MAX_CHARS = 8


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
        if self.max_chars < MIN_MAX_CHARS:
            raise ValueError(f"max_chars must be >= {MIN_MAX_CHARS}")
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
    start: int  # where its run of marks (or newlines) starts: buf[start:pos] ends the segment


@dataclass(frozen=True)
class _Pending:
    """What `_scan` has read of the undecided item it stopped at (a run of marks or newlines
    at the end of the text, or "No." and the whitespace after it), relative to the item's
    start, so that the next scan goes on from there. Re-reading a run that grows an append
    at a time from its start on every append made 20,000 appends of "." take 40 s of the
    event loop. Only facts about the item's own characters are kept: the text before it
    may be emitted in between, so whatever depends on that is worked out again."""

    run_end: int  # the run read so far is buf[start:start + run_end]
    sentence: bool = False  # it holds a sentence terminator
    cjk: bool = False  # it holds a CJK terminator, or starts with a CJK mark
    marks: int = 0  # its characters other than closers: how many (3 stands for 3 or more),
    dots: bool = True  # whether all of them are ".",
    eager: bool = True  # and whether all of them are in _EAGER_MARKS
    spaces_end: int = 0  # after "No.": buf[start + run_end:start + spaces_end] is whitespace


# The last word break (see `_word_start`) of a searched slice, and what follows it. `\s` is
# exactly `str.isspace` for str patterns.
_BREAK_CHARS = "\\s" + re.escape("".join(sorted(_WORD_BREAKS)))
_LAST_WORD_BREAK = re.compile(f"[{_BREAK_CHARS}][^{_BREAK_CHARS}]*\\Z")


# How far back a word is looked at: the checks on a word before a mark (an abbreviation,
# a list marker, an address's characters: a URL is seldom over 2,000 characters) need no
# more, and a client growing one word an append at a time ("a.a.a." ...) must not make
# every append read the whole of it again.
_WORD_LOOKBACK = 2048
# Longest word read as an abbreviation ("U.S.A", "e.g", "Ph.D"): far below the lookback,
# so a word cut short by it is never one.
_ABBREVIATION_MAX_CHARS = 32


class _Words:
    """What the checks on the word before a mark have read of a context's text, at context
    offsets, so that the next check reads only the text after it: a word that grows an
    append at a time ("a.a.a." ...) had each append search its last `_WORD_LOOKBACK`
    characters several times over (10,000 appends of "a.": 0.8 s of the event loop). The
    text is only appended to, so what was found holds; ``base`` is the context offset of
    the ``buf`` the functions below are given (`Segmenter._scan_on` sets it)."""

    __slots__ = ("base", "searched_to", "last_break", "addresses_to", "last_address", "word", "word_text")

    def __init__(self) -> None:
        self.base = 0
        # No word break in (last_break, searched_to), and last_break is one or lies more than
        # `_WORD_LOOKBACK` characters before searched_to (too far back to matter).
        self.searched_to = -1
        self.last_break = -1
        # No address character in (last_address, addresses_to) from the word's start on.
        self.addresses_to = -1
        self.last_address = -1
        # The last word's start, and where its text begins after opening quotes and brackets.
        self.word = -1
        self.word_text = -1

    def start(self, buf: str, i: int) -> int:
        """`_word_start` of ``buf[i]``, searching only the text not searched before."""
        base, at = self.base, self.base + i
        if not base <= self.searched_to <= at:
            start = _word_start(buf, i)
            # Kept unless the search was cut short by the start of ``buf`` (never the case with
            # `Segmenter`'s buffers: the text before one starts at a word break).
            if start > 0 or base == 0 or i >= _WORD_LOOKBACK:
                self.searched_to, self.last_break = at, base + start - 1
            return start
        if at > self.searched_to:
            m = _LAST_WORD_BREAK.search(buf, max(self.searched_to - base, i - _WORD_LOOKBACK), i)
            if m is not None:
                self.last_break = base + m.start()
            else:
                self.last_break = max(self.last_break, at - _WORD_LOOKBACK - 1)
            self.searched_to = at
        return max(self.last_break + 1 - base, i - _WORD_LOOKBACK, 0)

    def has_address_chars(self, buf: str, start: int, i: int) -> bool:
        """Whether ``buf[start:i]``, the word before ``buf[i]``, holds an `_ADDRESS_CHARS`."""
        base, at = self.base, self.base + i
        whole = start > 0 or base == 0  # else cut short by the start of ``buf``, as above
        if not whole or not base <= self.addresses_to <= at:
            found = _LAST_ADDRESS_CHAR.search(buf, start, i)
            if whole:
                self.addresses_to = at
                self.last_address = base + found.start() if found is not None else base + start - 1
            return found is not None
        # The word's start only moves on as the text grows: what lies before it is not read.
        found = _LAST_ADDRESS_CHAR.search(buf, max(self.addresses_to - base, start), i)
        if found is not None:
            self.last_address = base + found.start()
        self.addresses_to = at
        return self.last_address >= base + start

    def text_start(self, buf: str, start: int, i: int) -> int:
        """Where the text of the word ``buf[start:i]`` begins, after opening quotes and brackets."""
        base = self.base
        if self.word == base + start and base <= self.word_text < base + i:
            return self.word_text - base
        m = _NOT_OPENER.search(buf, start, i)
        k = m.start() if m is not None else i
        if k < i:
            self.word, self.word_text = base + start, base + k
        return k


def _word_start(buf: str, i: int, words: _Words | None = None) -> int:
    """Where the word ending at ``buf[i]`` (exclusive) starts: after a whitespace, or after
    a terminator other than a period, or a CJK mark or closer ("好。etc." and "!Mr." read
    "etc" and "Mr"; a period belongs to the word: "e.g", "a.b/c"); at most `_WORD_LOOKBACK`
    characters back."""
    if words is not None:
        return words.start(buf, i)
    start, stop = i, (i - 16 if i > 16 else 0)
    while start > stop and not buf[start - 1].isspace() and buf[start - 1] not in _WORD_BREAKS:
        start -= 1
    if start > stop or start == 0:
        return start
    lo = max(i - _WORD_LOOKBACK, 0)
    m = _LAST_WORD_BREAK.search(buf, lo, i)
    return lo if m is None else m.start() + 1


_OPENERS = "\"'([{“‘«"
_NOT_OPENER = re.compile("[^" + re.escape(_OPENERS) + "]")


def _word(buf: str, dot: int, words: _Words | None = None) -> str | None:
    """The word before the period at ``buf[dot]``, opening quotes and brackets left out;
    ``None`` if it is longer than any abbreviation (not cut out of the text: a word may be
    `_WORD_LOOKBACK` characters long)."""
    start = _word_start(buf, dot, words)
    if words is not None:
        start = words.text_start(buf, start, dot)
    else:
        start = dot - len(buf[start:dot].lstrip(_OPENERS))
    return buf[start:dot] if dot - start <= _ABBREVIATION_MAX_CHARS else None


def _is_abbreviation(buf: str, dot: int, words: _Words | None = None) -> bool:
    """Whether the period at ``buf[dot]`` closes an abbreviation or an initial ("No." as
    one: the caller decides it by the word after it)."""
    word = _word(buf, dot, words)
    if not word:
        return False
    if len(word) == 1 and word.isalpha():
        return word != "I"  # "J. Smith", "a. first item" read better unsplit; "So did I." ends
    if "." in word:
        return _DOTTED_ABBREVIATION.fullmatch(word) is not None
    lower = word.lower()
    return lower in _ABBREVIATIONS or lower in _NUMBER_ABBREVIATIONS


def _is_list_marker(buf: str, dot: int, line_start: bool, words: _Words | None = None) -> bool:
    """Whether the period at ``buf[dot]`` closes a numbered list's marker: 1-3 digits at the
    start of a line ("\n2. Tap login."), read with its item rather than alone."""
    start = _word_start(buf, dot, words)
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
_ADDRESS_CLASS = re.escape("".join(sorted(_ADDRESS_CHARS)))
_LAST_ADDRESS_CHAR = re.compile(f"[{_ADDRESS_CLASS}][^{_ADDRESS_CLASS}]*\\Z")


def _eager_end(buf: str, i: int, run: _Pending, opens: int, words: _Words | None = None) -> bool:
    """Whether the mark run ``buf[i:]`` (closing the buffer; ``run`` sums it up) is a
    boundary as long as a whitespace would follow: the one case the next character could
    still veto is left to it (digits, abbreviations, addresses, a ".." that may grow to "...").
    Never a run that would be a segment by itself (one opening the segment, at ``opens``)."""
    if buf[i] in _CJK_NOT_DECIMAL:
        return i > opens  # no decimal point or address part: "共3。" ends there
    if i == opens or not (buf[i - 1].isalpha() or buf[i - 1] in _CLOSERS):
        return False  # "3." may become "3.5", "1," "1,000"
    if not run.eager or (run.dots and run.marks == 2):
        return False
    start = _word_start(buf, i, words)
    if (words.has_address_chars(buf, start, i) if words is not None
            else not _ADDRESS_CHARS.isdisjoint(buf[start:i])):
        return False  # "https://a.b/c?" + "x=1"
    return not (run.dots and run.marks == 1 and _is_abbreviation(buf, i, words))


def _summed_up(buf: str, i: int, j: int, sentence: bool, cjk: bool, known: _Pending | None) -> _Pending:
    """The mark run ``buf[i:j]`` summed up for `_eager_end`, going on from ``known`` (what
    was summed up of its start before) so that no character is looked at twice."""
    if known is not None and known.run_end == j - i:
        return known  # nothing new: making a new one would cost more than the rest of the scan
    marks, dots, eager = (known.marks, known.dots, known.eager) if known is not None else (0, True, True)
    a = i + (known.run_end if known is not None else 0)  # what is new of the run: buf[a:j]
    marks += j - a - len(_CLOSER.findall(buf, a, j))
    dots = dots and _NEITHER_DOT_NOR_CLOSER.search(buf, a, j) is None
    eager = eager and _NEITHER_EAGER_NOR_CLOSER.search(buf, a, j) is None
    return _Pending(j - i, sentence, cjk, marks, dots, eager)


_CLOSER = re.compile("[" + re.escape(_CLOSER_CHARS) + "]")
_NOT_CLOSER = re.compile("[^" + re.escape(_CLOSER_CHARS) + "]")
_NEITHER_DOT_NOR_CLOSER = re.compile("[^." + re.escape(_CLOSER_CHARS) + "]")
_NEITHER_EAGER_NOR_CLOSER = re.compile("[^" + re.escape("".join(sorted(_EAGER_MARKS)) + _CLOSER_CHARS) + "]")


def _scan(buf: str, start: int, final: bool, eager: bool = False, line_start: bool = False,
          pending: _Pending | None = None, opens: int = 0,
          words: _Words | None = None) -> tuple[list[_Boundary], int, _Pending | None]:
    """The boundaries in ``buf`` from ``start`` on, in order, where the scan stopped: at an
    undecided mark run (one that more text may still change), else ``len(buf)``, and what
    it read of that run (``None`` if it stopped at the end). Passing that back as
    ``pending``, with ``start`` where the scan stopped, goes on reading where it left off.

    Without ``final`` or ``eager`` a boundary found depends only on the text up to the
    character after it (for "No.", the word after it), so it stays a boundary whatever is
    appended: `Segmenter` keeps them and scans each appended piece once. With ``final`` the end of the buffer counts
    as "followed by whitespace", which is how flush/end resolve a trailing "." (the caller
    cuts the remainder anyway). With ``eager`` it does so for a mark run that `_eager_end`
    accepts. ``line_start``: ``buf`` starts a line (the context's, or one after a newline);
    ``opens``: where in ``buf`` the text not yet emitted begins (text before it is read);
    ``words``: what earlier checks on words read of the text (`_Words`).
    """
    out: list[_Boundary] = []
    n = len(buf)
    # The regex skips the ordinary characters in C, so only the marks cost Python steps.
    m = _MARK.search(buf, start)
    while m is not None:
        i = m.start()
        ch = buf[i]
        known = pending if i == start else None  # what an earlier scan read of this item
        if ch == "\n":
            j = i + (known.run_end if known is not None else 1)
            while j < n and buf[j] == "\n":
                j += 1
            if j >= n and not final:
                # More newlines may follow.
                return out, i, known if known is not None and known.run_end == j - i else _Pending(j - i)
            out.append(_Boundary(j, True, i))
            m = _MARK.search(buf, j)
            continue
        # Extend over a run of terminators and closing quotes: "?!", "...", "。」".
        if known is not None:
            j, sentence, cjk = i + known.run_end, known.sentence, known.cjk
        else:
            j = i + 1
            sentence = ch in _LATIN_SENTENCE or ch in _CJK_SENTENCE
            cjk = ch in _CJK_SENTENCE or ch in _CJK_CLAUSE
        k, j = j, _RUN_GOES_ON.match(buf, j).end()
        if j > k:
            sentence = sentence or _TERMINATOR.search(buf, k, j) is not None
            cjk = cjk or _CJK_TERMINATOR.search(buf, k, j) is not None
        if j >= n and not final:
            run = _summed_up(buf, i, j, sentence, cjk, known)
            if not (eager and _eager_end(buf, i, run, opens, words)):
                return out, i, run  # the run may still grow: undecided
        nxt = buf[j] if j < n else " "
        # Latin marks between CJK characters read as CJK ones, a run of them too ("吗?!我").
        if (not cjk and j < n and i > 0 and _is_cjk(nxt) and _is_cjk(buf[i - 1])
                and all(c in _LATIN_IN_CJK for c in buf[i:j])):
            cjk = True
        if ch == "．" and j == i + 1 and i > 0 and buf[i - 1].isdigit() and nxt.isdigit():
            cjk = False  # a fullwidth decimal point: "３．１４"
        elif cjk or nxt.isspace():
            single_dot = ch == "." and j == i + 1 and not cjk
            if single_dot and (_word(buf, i, words) or "").lower() in _NUMBER_ABBREVIATIONS:
                k = max(j, i + known.spaces_end) if known is not None else j
                while k < n and buf[k].isspace():
                    k += 1
                if k >= n and not final:  # "No." + " 5" or " I": the word after it decides
                    run = _summed_up(buf, i, j, sentence, cjk, known)
                    return out, i, run if run.spaces_end == k - i else replace(run, spaces_end=k - i)
                if k >= n or not (buf[k].isdigit() or buf[k] == "#"):
                    out.append(_Boundary(j, sentence, i))
            elif not (single_dot and (_is_abbreviation(buf, i, words)
                                      or _is_list_marker(buf, i, line_start, words))):
                out.append(_Boundary(j, sentence, i))
        m = _MARK.search(buf, j)
    return out, n, None


@dataclass(slots=True)
class _RunFacts:
    """Where in a run of marks at the end of the buffer, read so far up to ``end`` (context
    offsets, from ``start`` on), its last characters of each kind lie: what the rest of it
    after a cut (`Segmenter._after_a_cut_past_the_scan`) is, summed up as `_scan` would,
    without reading it again. Reading the rest from the cut on at every cut forced inside
    a long run made one message of 20,000 "。" at max_chars 8 take 0.3 s (each read in C)."""

    start: int
    end: int
    last_cjk: int = -1  # its last CJK terminator
    last_not_dot: int = -1  # its last character that is neither a period nor a closer
    last_not_eager: int = -1  # its last one neither in `_EAGER_MARKS` nor a closer
    last_marks: tuple[int, ...] = ()  # its last three characters other than closers, latest first

    def read_on(self, buf: str, base: int, end: int) -> None:
        """Take in ``buf[self.end - base:end - base]``, the run's characters after those read."""
        piece, at = buf[self.end - base:end - base], self.end
        # rstrip (in C) finds the last character not stripped: the run holds marks and closers
        # only (and perhaps a clause mark first), so stripping the others leaves it at the end.
        self.last_cjk = max(self.last_cjk, at + len(piece.rstrip(_NOT_CJK_TERMINATOR_CHARS)) - 1)
        self.last_not_dot = max(self.last_not_dot, at + len(piece.rstrip(_DOT_AND_CLOSER_CHARS)) - 1)
        self.last_not_eager = max(self.last_not_eager, at + len(piece.rstrip(_EAGER_AND_CLOSER_CHARS)) - 1)
        found: list[int] = []
        while len(found) < 3:
            piece = piece.rstrip(_CLOSER_CHARS)
            if not piece:
                break
            found.append(at + len(piece) - 1)
            piece = piece[:-1]
        self.last_marks = (tuple(found) + self.last_marks)[:3]
        self.end = end

    def rest(self, i: int) -> _Pending:
        """The run from ``i`` (a character other than a closer, after its first) to ``end``
        summed up, as `_scan` and `_summed_up` sum up a run that starts there."""
        marks = sum(1 for k in self.last_marks if k >= i)
        return _Pending(self.end - i, True, self.last_cjk >= i, marks,
                        self.last_not_dot < i, self.last_not_eager < i)


_ALL_MARK_CHARS = "".join(sorted(_LATIN_SENTENCE | _CJK_SENTENCE | _CLOSERS | _LATIN_CLAUSE | _CJK_CLAUSE))
_NOT_CJK_TERMINATOR_CHARS = "".join(c for c in _ALL_MARK_CHARS if c not in _CJK_SENTENCE)
_DOT_AND_CLOSER_CHARS = "." + _CLOSER_CHARS
_EAGER_AND_CLOSER_CHARS = "".join(sorted(_EAGER_MARKS)) + _CLOSER_CHARS


# The first non-whitespace character (`Segmenter._next_content`).
_CONTENT = re.compile(r"\S")


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
    the event loop (quadratic in its length). For the same reason the undecided run at the
    end (`_Pending`) and whitespace (`_next_content`) are not read again on every append,
    nor the rest of such a run after a cut forced into it (`_RunFacts`), nor the word before
    a mark once searched (`_Words`)."""

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
        self._run_starts: list[int] = []  # where each one's run of marks starts
        self._sentences: list[int] = []
        self._first = self._first_sentence = 0
        self._scanned = 0
        self._pending: _Pending | None = None  # what was read of the undecided item at _scanned
        # Where the scan has read the text up to (context offset), -1 if it must read again
        # from `_scanned`: a cut into a run of marks or newlines it stopped at sums up the
        # rest of it (`_RunFacts`), and then there is nothing new to read until an append.
        self._read_to = 0
        self._run_facts: _RunFacts | None = None
        self._words = _Words()
        # Context offset -> how far the whitespace from there reaches, as far as looked at
        # (`_next_content`); at every cut only what reaches past it is kept, from the cut on.
        self._spaces: dict[int, int] = {}
        # The emitted text just before the buffer that a boundary's decision may read (the
        # word before a mark, the character before a run), and whether what lies before
        # that, spaces and tabs aside, ends a line or is nothing (a list marker's line).
        # With them a decision depends on the text alone, not on where the segments before
        # were cut, which would depend on how the text was split into appends.
        self._before = ""
        self._line_start = True
        self._buf_line_start = True  # the same of what lies before the buffer
        # A run cut inside (`_decide_the_rest_of_a_cut_run`): its boundary's context offset, and
        # those of its last character other than a closer and of its last CJK terminator.
        self._cut_run: tuple[int, int, int] | None = None

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
        # Kept from the last word break on (at most a lookback): no decision reads past it
        # but a list marker's, which goes on over spaces and tabs to the line's start.
        m = _LAST_WORD_BREAK.search(text, max(len(text) - _WORD_LOOKBACK, 0), len(text))
        if m is not None:
            gone, self._before = self._before + text[: m.start()], text[m.start() :]
        else:
            before = self._before + text
            keep = max(len(before) - _WORD_LOOKBACK, 0)
            gone, self._before = before[:keep], before[keep:]
        gone = gone.rstrip(" \t")
        if gone:
            self._line_start = gone[-1] == "\n"
        kept = self._before.rstrip(" \t")
        self._buf_line_start = kept[-1] == "\n" if kept else self._line_start
        seg = Segment(self._count, text, self._offset, self._offset + pos, reason)
        if self._offset + pos > self._scanned:  # into or past the undecided item
            self._scanned, self._pending = self._after_a_cut_past_the_scan(self._offset + pos)
        self._count += 1
        self._offset += pos
        self._buf = self._buf[pos:]
        # Whitespace known to reach past the cut still does from the new buffer's start: cuts
        # forced one after the other into a long run of it (as after "No." and 20,000 spaces,
        # which wait for the word after them) must not each walk it again from the start.
        reach = max((e for a, e in self._spaces.items() if a <= self._offset < e), default=0)
        self._spaces = {self._offset: reach} if reach else {}
        self._first = bisect.bisect_right(self._bounds, self._offset, self._first)
        self._first_sentence = bisect.bisect_right(self._sentences, self._offset, self._first_sentence)
        if self._first < len(self._bounds) and self._run_starts[self._first] < self._offset:
            self._decide_the_rest_of_a_cut_run()
        if self._first > 1024 and self._first * 2 > len(self._bounds):  # drop what was emitted
            del self._bounds[: self._first], self._is_sentence[: self._first], self._run_starts[: self._first]
            del self._sentences[: self._first_sentence]
            self._first = self._first_sentence = 0
        return seg

    def _decide_the_rest_of_a_cut_run(self) -> None:
        """A cut inside a run of marks (a forced one: regular cuts come after runs) leaves
        the rest of the run to be decided again, as the start of the next segment: so it is
        when the cut comes before the run's end has arrived (`_emit` drops the undecided
        run), and the segments must not depend on how the text was split into appends.
        Only this run: the boundaries after it read the text, not where it was cut.

        What precedes the rest is a mark or closer of the same run, so no word, number or
        CJK character before it counts: the rest of a run of newlines still ends there (the
        character after it is no newline); the rest of a run of marks does if it holds a
        terminator (a closer alone is none) and a whitespace follows, or a CJK terminator
        lies in it (`_scan`'s rules for a run that starts with a terminator). Where in the
        run its last terminator and last CJK terminator lie is read once per run: reading
        the rest again at every cut forced inside a long run was quadratic ("a" + 20,000
        "!" + " " in one message, max_chars 8: 2.6 s)."""
        k, base, buf = self._first, self._offset, self._buf
        key, end = self._bounds[k], self._bounds[k] - base
        if self._is_sentence[k]:
            del self._sentences[self._first_sentence]
        if buf[0] != "\n":
            if self._cut_run is None or self._cut_run[0] != key:
                rest = buf[:end]
                last_mark = base + len(rest.rstrip(_CLOSER_CHARS)) - 1  # base - 1 if none
                last_cjk = base + max(rest.rfind(c) for c in _CJK_SENTENCE)
                self._cut_run = (key, last_mark, last_cjk)
            _, last_mark, last_cjk = self._cut_run
            if last_mark < base or not (buf[end].isspace() or last_cjk >= base):
                del self._bounds[k], self._is_sentence[k], self._run_starts[k]
                return
        # A sentence end: a run of newlines, or a run of marks from a terminator on.
        self._is_sentence[k], self._run_starts[k] = True, base
        self._sentences.insert(self._first_sentence, key)

    def _after_a_cut_past_the_scan(self, cut: int) -> tuple[int, _Pending | None]:
        """Where the scan goes on, and what it has read there, after a cut at context offset
        ``cut`` past `_scanned` (before the buffer is cut): what a scan from the cut would
        find. The rest of a run of newlines or marks at the end of the buffer is summed up
        from what was read of the run; anything else ("No." and whitespace) is read again."""
        p, s, base, buf = self._pending, self._scanned, self._offset, self._buf
        end = base + len(buf)
        if cut >= end:
            return cut, None
        if p is None or p.spaces_end or s + p.run_end != end:
            self._read_to = -1
            return cut, None
        if buf[s - base] == "\n":
            return cut, _Pending(end - cut)
        # The rest holds terminators and closers: it starts, as a run, at its first terminator
        # (closers before it are plain text to `_scan`); closers alone are no run.
        m = _NOT_CLOSER.search(buf, cut - base)
        if m is None:
            return end, None
        facts = self._run_facts
        if facts is None or not facts.start <= s <= facts.end:
            facts = self._run_facts = _RunFacts(s, s)
        if facts.end < end:
            facts.read_on(buf, base, end)
        return base + m.start(), facts.rest(base + m.start())

    def _keep_scanning(self) -> None:
        """Scan what was appended since the last scan; keep the boundaries it confirms."""
        end = self._offset + len(self._buf)
        if self._read_to == end:
            return  # nothing appended since
        self._read_to = end
        found, stop, self._pending = self._scan_on(False, False)
        base = self._offset
        for b in found:
            self._bounds.append(base + b.pos)
            self._is_sentence.append(b.sentence)
            self._run_starts.append(base + b.start)
            if b.sentence:
                self._sentences.append(base + b.pos)
        self._scanned = base + stop

    def _scan_on(self, final: bool, eager: bool) -> tuple[list[_Boundary], int, _Pending | None]:
        """`_scan` from `_scanned` on, at buffer positions, reading the emitted text before
        the buffer (`_before`) where a decision may reach it. Far into the buffer only a
        list marker's run of spaces and tabs may: the buffer is then scanned as it is, not
        copied behind `_before` (copying a long message's buffer for every segment cut
        from it made segmenting it a third slower)."""
        start = self._scanned - self._offset
        if self._pending is None and _MARK.search(self._buf, start) is None:
            return [], len(self._buf), None  # most appends (a word of an LLM's): no mark to decide
        if start > _WORD_LOOKBACK or not self._before:
            self._words.base = self._offset
            return _scan(self._buf, start, final, eager, self._buf_line_start, self._pending, 0, self._words)
        shift = len(self._before)
        self._words.base = self._offset - shift
        found, stop, pending = _scan(self._before + self._buf, start + shift, final, eager, self._line_start,
                                     self._pending, shift, self._words)
        if found:
            found = [_Boundary(b.pos - shift, b.sentence, b.start - shift) for b in found]
        return found, stop - shift, pending

    def _drain(self, final: bool) -> list[Segment]:
        cfg = self.config
        out: list[Segment] = []
        while self._buf:
            self._keep_scanning()
            # The undecided run at the end, decided as the end of the text (final) or of
            # an append (eager): not kept, the next append may decide it otherwise.
            tail = self._scan_on(final, cfg.eager_ends)[0] if final or cfg.eager_ends else []
            cut = self._regular_cut(tail)
            if cut is not None:
                out.append(self._emit(cut[0], "sentence" if cut[1] else "clause"))
                continue
            # Not while "No." waits for the word after it and only whitespace is past
            # max_chars: the word decides a boundary within them.
            if len(self._buf) > cfg.max_chars and not (
                    not final and self._pending is not None and self._pending.spaces_end
                    and self._next_content(cfg.max_chars) == len(self._buf)):
                out.append(self._emit(self._forced_cut(tail), "max"))
                continue
            break
        return out

    def _lead(self) -> int:
        """Index of the buffer's first non-whitespace character (its length if none)."""
        buf = self._buf
        if buf[:1].isspace() and not buf[1:2].isspace():  # a segment's usual start: one space
            return 1
        return self._next_content(0)

    def _next_content(self, i: int) -> int:
        """Index of the buffer's first non-whitespace character at or after ``i`` (its
        length if none). The search goes on where the last one from ``i`` ended: walking a
        buffer of whitespace that grows an append at a time from its start on every append
        was quadratic (20,000 appends of a space: 10 s)."""
        buf, base = self._buf, self._offset
        if i >= len(buf) or not buf[i].isspace():
            return min(i, len(buf))
        m = _CONTENT.search(buf, max(self._spaces.get(base + i, 0) - base, i))
        end = m.start() if m is not None else len(buf)
        self._spaces[base + i] = base + end
        return end

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
            if first == len(positions):
                continue  # none kept
            size = max(size, 1)
            # A segment ending at pos is long enough, whitespace at its end not counted, if and
            # only if a non-whitespace character lies in [lead + size - 1, pos): the first
            # boundary after the first one there is the cut. Trying the boundaries one by one
            # tried every one in a run of whitespace (" \n \n ...") on every append.
            k = bisect.bisect_right(positions, base + self._next_content(lead + size - 1), first)
            if k < len(positions) and positions[k] - base <= cfg.max_chars:
                pos = positions[k] - base
                sentence = positions is self._sentences or self._is_sentence[k]
                if best is None or pos < best[0]:
                    best = (pos, sentence)
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
        # A segment ending at pos has more than whitespace if and only if pos > lead.
        usable = [b for b in tail if lead < b.pos <= limit]
        # Prefer the latest sentence end, then the latest clause mark.
        sentences = [b for b in usable if b.sentence]
        if sentences:
            return sentences[-1].pos
        k = bisect.bisect_right(self._sentences, base + limit, self._first_sentence)
        if k > self._first_sentence and self._sentences[k - 1] - base > lead:
            return self._sentences[k - 1] - base
        if usable:
            return usable[-1].pos
        k = bisect.bisect_right(self._bounds, base + limit, self._first)
        if k > self._first and self._bounds[k - 1] - base > lead:
            return self._bounds[k - 1] - base
        # Last whitespace that leaves something before it; the space starts the next one.
        for k in range(limit, lead, -1):
            if buf[k].isspace():
                return k
        # Hard, but not inside a character as read: a combining mark, a joined emoji.
        for k in range(limit, 0, -1):
            if not _continues_cluster(buf, k):
                return k
        return limit


def _continues_cluster(buf: str, k: int) -> bool:
    """Whether ``buf[k]`` belongs with the character before it, as one character read (the
    grapheme cluster rules of UAX #29 that matter here): a mark (combining or spacing), a
    variation selector, skin tone or tag, either side of a zero-width joiner, the second
    regional indicator of a flag, a Hangul jamo that joins the one before it."""
    ch, prev = buf[k], buf[k - 1]
    if (unicodedata.category(ch)[0] == "M" or ch == _ZWJ or prev == _ZWJ or "\ufe00" <= ch <= "\ufe0f"
            or "\U0001f3fb" <= ch <= "\U0001f3ff" or "\U000e0020" <= ch <= "\U000e007f"):
        return True
    if _is_regional_indicator(ch) and _is_regional_indicator(prev):
        # Indicators pair up from the first of a run: "🇺🇸🇫🇷" is two flags, not 🇸🇫 inside.
        first = k - 1
        while first > 0 and _is_regional_indicator(buf[first - 1]):
            first -= 1
        return (k - first) % 2 == 1
    before, after = _jamo(prev), _jamo(ch)
    return ((before == "L" and after in ("L", "V", "LV", "LVT"))
            or (before in ("LV", "V") and after in ("V", "T"))
            or (before in ("LVT", "T") and after == "T"))


_ZWJ = "\u200d"


def _is_regional_indicator(ch: str) -> bool:
    return "\U0001f1e6" <= ch <= "\U0001f1ff"


def _jamo(ch: str) -> str:
    """The Hangul syllable type of ``ch``: a leading consonant, vowel or trailing consonant
    jamo ("L", "V", "T"), a precomposed syllable without or with a trailing consonant
    ("LV", "LVT"), or "" for anything else."""
    if "\u1100" <= ch <= "\u115f" or "\ua960" <= ch <= "\ua97c":
        return "L"
    if "\u1160" <= ch <= "\u11a7" or "\ud7b0" <= ch <= "\ud7c6":
        return "V"
    if "\u11a8" <= ch <= "\u11ff" or "\ud7cb" <= ch <= "\ud7fb":
        return "T"
    if "\uac00" <= ch <= "\ud7a3":
        return "LV" if (ord(ch) - 0xAC00) % 28 == 0 else "LVT"
    return ""
