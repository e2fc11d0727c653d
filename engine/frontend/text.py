"""Text normalisation as the official CosyVoice frontend does it with `wetext`.

`normalize(text, lang=None)` returns one normalised string; sentence splitting is
the gateway segmenter's job, so the official `split_paragraph` is not reproduced.

Rules (official `CosyVoiceFrontEnd.text_normalize`, wetext path):
* text containing both `<|` and `|>` (e.g. `<|endofprompt|>`) is returned unchanged;
* language: Chinese when the text contains a CJK ideograph (U+4E00..U+9FFF);
* Chinese: wetext TN, then drop newlines, drop spaces not between two ASCII
  characters, superscript 2/3 -> 平方/立方, `.` -> `。`, ` - ` -> `，`, drop
  full-width brackets and backticks, `——` -> space, trailing commas -> `。`;
* English: wetext TN, then spell out any digit run wetext left (the official uses
  `inflect.number_to_words`, not a dependency here; `spell_number` below follows
  its default wording: "one thousand, two hundred and thirty-four").

Where this departs from the official frontend, to fix what it reads wrongly:
* markdown (LLM output) is stripped first (`strip_markdown`);
* text detected as not Chinese goes to wetext's English grammar; the official builds
  wetext with lang "auto", whose own detection sends digit-only text ("42") to Chinese;
* Chinese: thousands separators are dropped ("$1,000" was "一美元,零零零") and a hyphen
  between a letter and a digit is a space ("GPT-4" was "GPT负四");
* English: wetext's readings of 1000-1999 are repaired (`repair_english_thousands`), and
  amounts of money with cents are read as such ("$2.50": two dollars and fifty cents, not
  two point five dollars; `spell_money`);
* the sentence mark is not added after one that closing quotes hide, after `…`, nor
  after a trailing comma, which it replaces (`end_sentence`); nor after a full-width end
  mark on the English path (kana-only and Korean text take it);
* the tokenizer's special tokens in the text (`[breath]`, ARPAbet `[AH0]`, pinyin `[ǐ]`)
  are kept as written, not read ("[AH0]" was "[AHzero]" / "[AH零]").

The first call costs ~3 s on this machine (importing wetext/kaldifst and reading its
pre-compiled FSTs), later calls 1-25 ms per sentence; so the normaliser objects are
created lazily once per process, shared, guarded by a lock, and `warmup()` lets a
server pay the cost at start-up.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
import unicodedata
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from wetext import Normalizer

log = logging.getLogger(__name__)
Lang = Literal["zh", "en"]

_CJK_RE = re.compile(r"[\u4e00-\u9fff]")
_TRAILING_COMMAS_RE = re.compile(r"[，,、]+$")
_DIGITS_RE = re.compile(r"\d+")
# A thousands grouping: 1-3 digits, then groups of exactly three, not part of a longer
# run of digits and commas ("1,23" and "12,345,6" are none).
_CURRENCY = "$¥€£￥"
_FULLWIDTH_DIGIT = re.compile("[\uff10-\uff19]")
_THOUSANDS_GROUPING = re.compile(r"(?<!\d)(?<!\d[.,])\d{1,3}(?:,\d{3})+(?!\d|,\d)")
# Two letters at least: "GPT-4", "COVID-19"; "x-1", "n-1" and "T-5" keep their minus.
_LETTER_HYPHEN_DIGIT = re.compile(r"(?<=[A-Za-z]{2})-(?=\d)")

# Markdown (`strip_markdown`). Line-start rules run on text that still has its newlines.
_MD_RULE = re.compile(r"^[ \t]*([-*_])(?:[ \t]*\1){2,}[ \t]*$", re.M)
_MD_TABLE_SEPARATOR = re.compile(r"^[ \t]*\|(?:[ \t]*:?-+:?[ \t]*\|)+[ \t]*$", re.M)
_MD_TABLE_ROW = re.compile(r"^[ \t]*\|(.*)\|[ \t]*$", re.M)
# Not before a digit: the segmenter hands each sentence on its own, so "^" also matches
# mid-paragraph, where "- 5 degrees", "> 5 years" and "+ 3" are numbers, not marks.
_MD_LINE_MARK = re.compile(r"^[ \t]*(?:#{1,6}|>+|[-*+])[ \t]+(?!\d)", re.M)
_MD_LINK = re.compile(r"!?\[([^\]\n]+)\]\((?:[^()\n]|\([^()\n]*\))*\)")  # one level of (...) in the URL
_MD_DOUBLE_MARK = re.compile(r"\*{2,3}|_{2,3}|~~")
_STREAM_LINE_MARK = re.compile(r"(?<=\n)[ \t]*(?:#{1,6}|>+)(?=[ \t]+\D)")
# Emphasis-shaped stars: opening before a letter with no word before it ("**Bold"), or
# closing after a letter or a mark with no word after it ("Bold**", "Note:**"); not
# "2*3", "press * to", "*67" or "a*b".
_STREAM_STARS = re.compile(r"(?<![\w*])\*+(?=[^\W\d_])|(?<=[^\s\d*])\*+(?!\w)")
_BACKTICK_APOSTROPHE = re.compile(r"(?<=[^\W\d_])`(?=[^\W\d_])")
_MD_EMPHASIS = re.compile(r"(?<![\w*])([*_])(?=[^\s*_])(.+?)(?<=[^\s*_])\1(?![\w*])")


def contains_chinese(text: str) -> bool:
    return _CJK_RE.search(text) is not None


def detect_grammar(text: str) -> Lang | None:
    """The grammar `normalize` picks for `text` without a language hint: Chinese for text
    with Chinese characters or fullwidth digits, English for other text with letters;
    None for text with no letters (digits, symbols), which could be either: a caller that
    knows the text around it (a session's earlier segments) can pass that one's instead."""
    if contains_chinese(text) or _FULLWIDTH_DIGIT.search(text):
        return "zh"
    return "en" if any(c.isalpha() for c in text) else None


def language_grammar(language: str | None) -> Literal["zh", "en"] | None:
    """The normalisation grammar a language hint picks: Chinese ("zh", "yue", "cmn" ...) or
    English ("en..."); None (detect from the text) for anything else."""
    tag = (language or "").lower().replace("_", "-").split("-")[0]
    if tag in ("zh", "yue", "cmn", "wuu"):
        return "zh"
    return "en" if tag == "en" else None


def is_markup(text: str) -> bool:
    """The official skip rule: `<|...|>` markup means the text is already prepared."""
    return "<|" in text and "|>" in text


def is_only_punctuation(text: str) -> bool:
    """True for text made only of punctuation/symbols (Unicode P* and S*) or empty."""
    return all(unicodedata.category(ch)[0] in "PS" for ch in text)


# --- Chinese post-processing ----------------------------------------------------------


def drop_cjk_blanks(text: str) -> str:
    """Keep a space only between two ASCII non-space characters (e.g. "a b")."""
    out: list[str] = []
    for i, ch in enumerate(text):
        if ch != " ":
            out.append(ch)
            continue
        prev = text[i - 1] if i > 0 else ""
        nxt = text[i + 1] if i + 1 < len(text) else ""
        if prev.isascii() and prev not in ("", " ") and nxt.isascii() and nxt not in ("", " "):
            out.append(ch)
    return "".join(out)


def ungroup_thousands(text: str) -> str:
    """Drop the commas of real thousands groupings ("1,234,567" -> "1234567"), which the
    Chinese grammar reads as a list ("$1,000" -> "一美元,零零零"). A comma not followed by
    exactly three digits ("1,23", "12,345,6") is left alone: it is not a grouping. Nor is
    one between numbers of three digits each ("(100,200)", "800,600像素": coordinates,
    sizes, lists), unless money or a group of "000" says it is ("$100,200", "100,000")."""
    def ungroup(m: re.Match[str]) -> str:
        number = m.group(0)
        groups = number.split(",")
        money = m.start() > 0 and text[m.start() - 1] in _CURRENCY
        if len(groups[0]) < 3 or money or "000" in groups[1:]:
            return number.replace(",", "")
        return number

    return _THOUSANDS_GROUPING.sub(ungroup, text)


def _zh_preprocess(text: str) -> str:
    text = ungroup_thousands(text)
    # The grammar reads "-4" as negative even right after a word ("GPT-4" -> "GPT负四");
    # a space keeps the digits a number and is dropped again by `drop_cjk_blanks`.
    return _LETTER_HYPHEN_DIGIT.sub(" ", text)


def _zh_postprocess(text: str) -> str:
    text = text.replace("\n", "")
    text = drop_cjk_blanks(text)
    text = text.replace("²", "平方").replace("³", "立方")
    text = text.replace(".", "。")
    text = text.replace(" - ", "，")
    for ch in ("（", "）", "【", "】", "`"):
        text = text.replace(ch, "")
    text = text.replace("——", " ")
    return _TRAILING_COMMAS_RE.sub("。", text)


# --- English number spelling ----------------------------------------------------------

_ONES = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen "
    "fourteen fifteen sixteen seventeen eighteen nineteen"
).split()
_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()
_SCALES = ("", "thousand", "million", "billion", "trillion", "quadrillion")
# wetext's English readings that `repair_english_thousands` fixes.
_TEN_HUNDRED = re.compile(r"\bten (?:hundred|zero (one|two|three|four|five|six|seven|eight|nine))\b")
_THOUSAND_WORD = re.compile(r"\bthousand\b")
_WORD_BEFORE = re.compile(r"([a-z]+) +$")
_NUMBER_WORDS = frozenset([*_ONES, *_TENS[2:], "hundred"])


def _below_thousand(n: int) -> str:
    hundreds, rest = divmod(n, 100)
    parts: list[str] = []
    if hundreds:
        parts.append(f"{_ONES[hundreds]} hundred")
    if rest:
        if rest < 20:
            words = _ONES[rest]
        else:
            tens, ones = divmod(rest, 10)
            words = _TENS[tens] + (f"-{_ONES[ones]}" if ones else "")
        parts.append(words)
    return " and ".join(parts)


def spell_number(digits: str) -> str:
    """English words for a digit string in inflect's default style.

    "123" -> "one hundred and twenty-three", "2024" -> "two thousand and twenty-four",
    "1234" -> "one thousand, two hundred and thirty-four". Numbers too big for the
    scale words are read digit by digit.
    """
    # Decided on the digits before `int()`, which refuses more than 4300 of them (Python's
    # integer string conversion limit).
    significant = digits.lstrip("0")
    if len(significant) > 3 * len(_SCALES):
        return " ".join(_ONES[int(d)] for d in digits)
    n = int(significant or "0")
    if n == 0:
        return "zero"
    groups: list[int] = []
    while n:
        n, group = divmod(n, 1000)
        groups.append(group)
    chunks: list[str] = []
    for scale_index in range(len(groups) - 1, -1, -1):
        group = groups[scale_index]
        if not group:
            continue
        words = _below_thousand(group)
        if scale_index:
            words += f" {_SCALES[scale_index]}"
        elif chunks and group < 100:
            # a final group below 100 joins with "and" ("one thousand and one")
            chunks[-1] += f" and {words}"
            continue
        chunks.append(words)
    return ", ".join(chunks)


# A decade written with its century ("1990s", "2020s", "1800s"): wetext's English grammar
# reads the digits as a cardinal and the "s" as seconds ("one thousand nine hundred and
# ninety seconds"); two-digit ones ("80s", "'90s") it reads well.
_DECADE = re.compile(r"(?<![\w.,'])(1[0-9]|20)([0-9])0s\b")


def spell_decades(text: str) -> str:
    """ "1990s" -> "nineteen nineties", "2010s" -> "twenty tens", "1800s" -> "eighteen
    hundreds", "2000s" -> "two thousands"."""
    def read(m: re.Match[str]) -> str:
        century, decade = int(m.group(1)), int(m.group(2))
        if decade == 0:
            return "two thousands" if century == 20 else f"{_below_thousand(century)} hundreds"
        tens = "tens" if decade == 1 else _TENS[decade][:-1] + "ies"
        return f"{_below_thousand(century)} {tens}"

    return _DECADE.sub(read, text)


# An amount of money with exactly two decimals ("$2.50", "£1,000.05"), not a scaled one
# ("$3.50 million", "$2.50bn"): wetext's English grammar reads the cents as a decimal
# fraction ("two point five dollars", "twelve point oh five dollars").
_MONEY = re.compile(r"(?<![\w.,])([$£€])(\d{1,3}(?:,\d{3})+|\d+)\.(\d{2})(?!\w|[.,]\d)"
                    r"(?!\s*(?:[kmbt]n?|(?:thousand|million|billion|trillion)s?)\b)", re.I)
_MONEY_UNITS = {"$": ("dollar", "dollars", "cent", "cents"), "€": ("euro", "euros", "cent", "cents"),
                "£": ("pound", "pounds", "penny", "pence")}


def spell_money(text: str) -> str:
    """ "$2.50" -> "2 dollars and 50 cents", "$0.99" -> "99 cents", "£1.00" -> "1 pound":
    the units written out around the amounts, which the grammar then reads as numbers."""
    def read(m: re.Match[str]) -> str:
        one, many, one_minor, many_minor = _MONEY_UNITS[m.group(1)]
        whole, cents = m.group(2), int(m.group(3))
        if "," not in whole:
            whole = whole.lstrip("0") or "0"  # "$01.50": one dollar (no int(): 4300 digits at most)
        parts = []
        if whole.replace(",", "").strip("0") or not cents:
            parts.append(f"{whole} {one if whole == '1' else many}")
        if cents:
            parts.append(f"{cents} {one_minor if cents == 1 else many_minor}")
        return " and ".join(parts)

    return _MONEY.sub(read, text)


def _spell_out_digits(text: str) -> str:
    return _DIGITS_RE.sub(lambda m: spell_number(m.group(0)), text)


def repair_english_thousands(read: str, source: str) -> str:
    """Fix wetext's English readings of 1000-1999 in `read` (wetext's output for `source`).

    Its cardinal drops the leading "one" ("1,234" -> "thousand two hundred and thirty
    four", "$1000" -> "thousand dollars") and its year reading of a bare 1000-1009 says
    "ten hundred" / "ten zero one". Other four-digit years ("nineteen ninety nine",
    "twelve fifty") are sensible and kept. Each repair is skipped when the source text
    itself has what it looks for ("a thousand", "ten hundred"), so written words are
    never changed.
    """
    lowered = source.lower()
    if not _TEN_HUNDRED.search(lowered):
        read = _TEN_HUNDRED.sub(
            lambda m: "one thousand" + (f" and {m.group(1)}" if m.group(1) else ""), read
        )
    if not _THOUSAND_WORD.search(lowered):

        def add_one(m: re.Match[str]) -> str:
            # Only a number word right before (spaces between, no punctuation) says how
            # many thousands: "(one thousand" has it, "one, thousand" has not.
            before = _WORD_BEFORE.search(read, 0, m.start())
            return m.group(0) if before and before.group(1) in _NUMBER_WORDS else "one thousand"

        read = _THOUSAND_WORD.sub(add_one, read)
    return read


# --- markdown -------------------------------------------------------------------------


def strip_markdown(text: str) -> str:
    """Remove the markdown an LLM writes, so that it is not read aloud ("asterisk asterisk").

    Strips, conservatively:
    * at a line start: heading marks (`#` to `######` then a space), blockquote marks
      (`>` then a space), list bullets (`*`, `-` or `+` then a space), horizontal rules
      (three or more `-`, `*` or `_` alone on the line);
    * table rows (a line starting and ending with `|`): cells joined by ", ", and the
      `|---|:--:|` separator row removed;
    * links and images `[text](url)` / `![text](url)` -> text;
    * all backticks (inline code, code fences; never spoken);
    * `**`, `__`, `~~` (bold, strikethrough) unless between two letters/digits or two
      spaces (`2**3`, `a ** b` stay), so a marker left alone by a segment cut goes too;
    * `*text*` / `_text_` emphasis when the marks hug the text and no letter/digit
      touches them outside.
    Kept: `2 * 3`, `2*3*4`, `snake_case`, `C#`, `#1`, a lone `*` or `_`.
    """
    text = _MD_RULE.sub("", text)
    text = _MD_TABLE_SEPARATOR.sub("", text)
    text = _MD_TABLE_ROW.sub(_table_cells, text)
    text = _MD_LINE_MARK.sub("", text)
    text = _MD_LINK.sub(r"\1", text)
    text = _BACKTICK_APOSTROPHE.sub("'", text).replace("`", "")
    text = _MD_DOUBLE_MARK.sub(_drop_double_mark, text)
    return _MD_EMPHASIS.sub(r"\2", text)


def strip_stream_markdown(piece: str, line_start: bool = False) -> str:
    """The markdown marks `strip_markdown` would remove that can be told from a piece of
    text alone, for text-in streaming (no normalisation there: the LM reads the client's
    text as it comes, in pieces that may split a mark): stars glued to a word on one side
    only (emphasis: not "press * to", "*67" or "2*3"), backticks (one between two letters
    is an apostrophe), and a `#` run or `>` that starts a line before a space and a word
    (a heading, a quote). `line_start`: the piece starts a line (the text's first piece, or
    one after a newline: stream mode ends a segment at a newline, so a heading comes as the
    first piece of the next). Offsets reported to the client are those of the text as
    sent; only the LM's copy changes."""
    if not any(c in piece for c in "*`#>"):
        return piece
    piece = _STREAM_STARS.sub("", piece)
    piece = _BACKTICK_APOSTROPHE.sub("'", piece).replace("`", "")
    if line_start:
        return _STREAM_LINE_MARK.sub("", "\n" + piece)[1:]
    return _STREAM_LINE_MARK.sub("", piece)


def _drop_double_mark(m: re.Match[str]) -> str:
    before = m.string[m.start() - 1 : m.start()]
    after = m.string[m.end() : m.end() + 1]
    # "2**3" (a power) and "a ** b" are no markdown; a marker has text on one side only.
    # ASCII only: Chinese characters count as alphanumeric, and "**重要**的" is bold.
    between_words = before.isascii() and before.isalnum() and after.isascii() and after.isalnum()
    between_spaces = before.isspace() and after.isspace()
    return m.group(0) if between_words or between_spaces else ""


def _table_cells(m: re.Match[str]) -> str:
    cells = (cell.strip() for cell in m.group(1).split("|"))
    return ", ".join(cell for cell in cells if cell)


# --- the sentence mark ----------------------------------------------------------------


def end_sentence(text: str, chinese: bool) -> str:
    """End `text` with a sentence mark as the official paragraph splitter does ("。" or
    "."), but not a second one: a mark inside closing quotes/brackets counts ('"stop."'),
    `…` counts, and a trailing comma is replaced rather than followed."""
    ends, mark = (_ZH_ENDS, "。") if chinese else (_EN_ENDS, ".")
    body = text.rstrip(_CLOSERS)
    emoticon = body != text and body[-1:] in (":", ";")  # ":)" is a face, not "):" ended
    if body and body[-1] in ends and not emoticon:
        return text
    unpunctuated = body.rstrip(_COMMAS)
    if unpunctuated and unpunctuated != body:
        return unpunctuated + mark + text[len(body):]
    return text + mark


# --- the normaliser -------------------------------------------------------------------


class TextNormalizer:
    """Holds the wetext normalisers; create once and share between threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._zh: Normalizer | None = None
        self._en: Normalizer | None = None

    def _wetext(self, lang: Lang) -> "Normalizer":
        # Lazy: importing wetext and reading FSTs is only paid by processes that use it.
        with self._lock:
            if self._zh is None or self._en is None:
                from wetext import Normalizer  # noqa: F811 (runtime import)

                # Not wetext's lang "auto" (the official's): its detection sends digit-only
                # text ("42") to the Chinese grammar; `normalize` picks the grammar itself.
                self._zh = Normalizer(lang="zh", remove_erhua=False)
                self._en = Normalizer(lang="en")
            return self._zh if lang == "zh" else self._en

    def warmup(self) -> None:
        """Pay the one-off cost (import, FST loading: ~3 s here) before serving."""
        self.normalize("今天是2024年3月5日。")
        self.normalize("It costs 25 dollars.")

    def normalize(self, text: str, lang: Lang | None = None, terminal: bool = True) -> str:
        """Normalise one piece of text; `lang` forces the grammar (default: detect).
        `terminal`: end it with a sentence mark ("。" or ".") when it ends otherwise, as the
        official frontend's paragraph splitter does for text to speak (not for a prompt's
        transcript, which it normalises unsplit)."""
        if is_markup(text) or not text:
            return text
        # Before the control characters go: its line-start rules need the line breaks.
        text = strip_markdown(text)
        # Control characters (NUL, escapes, ...) are unspeakable and make wetext's FSTs
        # assert; line breaks (form feed, NEL, ... too) and tabs become spaces.
        text = _CONTROL.sub(lambda m: " " if m.group().isspace() else "", text).strip()
        if not text:
            return text
        chinese = detect_grammar(text) == "zh" if lang is None else lang == "zh"
        text = self._read_keeping_special_tokens(text, chinese)
        if chinese:
            text = _zh_postprocess(text)
        if terminal and text:
            text = end_sentence(text, chinese)
        return text

    def _read(self, text: str, chinese: bool) -> str:
        """The grammar's reading of `text` (numbers, symbols, ... in words), before the
        Chinese post-processing."""
        if chinese:
            return self._wetext_or_plain(_zh_preprocess(text), "zh")
        read = self._wetext_or_plain(spell_money(spell_decades(text)), "en")
        return _spell_out_digits(repair_english_thousands(read, text))

    def _read_keeping_special_tokens(self, text: str, chinese: bool) -> str:
        """`_read`, with the tokenizer's special tokens in the text (`[breath]`, `<strong>`,
        ARPAbet phones `[AH0]`, pinyin `[ǐ]`, ...) kept as written: the grammars and the
        digit speller would turn `[AH0]` into `[AHzero]` / `[AH零]`, which no longer
        encodes to its special token. (The official frontend only spares text with
        `<|...|>` markup; these tags it reads like any other text.)

        For the reading each tag is replaced by a private-use character of its own, which
        the grammars pass through, and put back afterwards; should the placeholders not all
        come back exactly once and in order, the pieces between the tags are read one by
        one and joined with the tags as written. Text without a tag is read unchanged."""
        tags = _special_token_re().split(text) if ("[" in text or "<" in text) else [text]
        if len(tags) == 1:
            return self._read(text, chinese)
        # split() with one capturing group: the text pieces at even, the tags at odd indices.
        pieces, tags = tags[0::2], tags[1::2]
        if len(tags) <= _PLACEHOLDER_COUNT and not _PLACEHOLDER_RE.search(text):
            placeholders = [chr(_PLACEHOLDER_FIRST + i) for i in range(len(tags))]
            masked = pieces[0] + "".join(p + piece for p, piece in zip(placeholders, pieces[1:]))
            read = self._read(masked, chinese)
            if _PLACEHOLDER_RE.findall(read) == placeholders:
                # A digit touching a placeholder makes the English grammar assert, and its
                # retry (`_wetext_or_plain`) spaces them apart: "[breath]5" would come back
                # "[breath] five". A tag keeps the neighbours it was written against.
                glued_after = {p for p, piece in zip(placeholders, pieces[1:]) if piece[:1].strip()}
                glued_before = {p for p, piece in zip(placeholders, pieces) if piece[-1:].strip()}
                read = _SPACE_AFTER_PLACEHOLDER.sub(
                    lambda m: m.group(1) if m.group(1) in glued_after else m.group(0), read)
                read = _SPACE_BEFORE_PLACEHOLDER.sub(
                    lambda m: m.group(1) if m.group(1) in glued_before else m.group(0), read)
                restore = dict(zip(placeholders, tags))
                return _PLACEHOLDER_RE.sub(lambda m: restore[m.group()], read)
            log.debug("special-token placeholders lost in normalisation; reading the pieces: %r", text[:80])
        out: list[str] = []
        for piece, tag in zip(pieces, [*tags, ""]):
            core = piece.strip()
            if core:  # the spaces around it stay as written
                start = len(piece) - len(piece.lstrip())
                piece = piece[:start] + self._read(core, chinese) + piece[start + len(core):]
            out.append(piece + tag)
        return "".join(out)

    def _wetext_or_plain(self, text: str, lang: Lang) -> str:
        """wetext's reading of the text. Its grammars assert on a digit touching a character
        they do not know ("5€", "3시", "§5", "2024г": ~2/3 of symbol-digit pairs probed); a
        space between the two lets them read it ("five euro"), and failing that the text
        goes on as written (digits then spelled out by the caller), never an error that
        would drop the sentence."""
        normalizer = self._wetext(lang)

        def read(text: str) -> str:
            out = normalizer.normalize(text)
            # Its English grammar writes '"' and '\\' escaped ('He said \\"stop\\".'); with no
            # backslash in the input, every one in the output is such an escape.
            return _ESCAPED.sub(r"\1", out) if "\\" in out and "\\" not in text else out

        try:
            return read(text)
        except Exception:
            spaced = _DIGIT_TOUCHING_OTHER.sub(" ", text)
            try:
                return read(spaced) if spaced != text else text
            except Exception:
                log.debug("text normalisation failed; kept as written: %r", text[:80])
                return text


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_ESCAPED = re.compile(r'\\(["\\])')
# The marks a text to speak ends with (the official `split_paragraph`'s, without commas;
# plus `…`, after which another mark would be read as a second pause). The full-width ones
# end a sentence on the English path too: kana-only or Korean text ("コンニチハ！",
# "안녕하세요。") has no CJK ideograph and takes that path.
_ZH_ENDS = frozenset("。？！；：、.?!;…")
_EN_ENDS = frozenset(".?!;:…。？！；：")
# What `end_sentence` looks past (a mark inside them ends the sentence) and replaces.
_CLOSERS = "\"')]}”’»」』】）》"
_COMMAS = ",，、"
# Between a digit and a non-ASCII character, either way round (`_wetext_or_plain`).
_DIGIT_TOUCHING_OTHER = re.compile(r"(?<=[0-9])(?=[^\x00-\x7f])|(?<=[^\x00-\x7f])(?=[0-9])")

# The placeholders `_read_keeping_special_tokens` puts in place of special tokens: private
# use characters (U+E000..U+F8FF), which the grammars leave as they are.
_PLACEHOLDER_FIRST, _PLACEHOLDER_COUNT = 0xE000, 0x1900
_PLACEHOLDER_RE = re.compile(r"[\ue000-\uf8ff]")
_SPACE_AFTER_PLACEHOLDER = re.compile(r"([\ue000-\uf8ff]) (?=\S)")
_SPACE_BEFORE_PLACEHOLDER = re.compile(r"(?<=\S) ([\ue000-\uf8ff])")


@functools.lru_cache(maxsize=None)
def _special_token_re() -> re.Pattern[str]:
    """Matches (one capturing group) any special token a tokenizer version registers, the
    longest first. Imported on first use: the tokenizer module loads `tokenizers`, which
    importers of this module (`strip_stream_markdown`) need not pay for."""
    from engine.frontend.tokenizer import ENDOFTEXT, SPECIALS_BY_VERSION

    tokens = {ENDOFTEXT, *(t for specials in SPECIALS_BY_VERSION.values() for t in specials)}
    return re.compile("(" + "|".join(re.escape(t) for t in sorted(tokens, key=lambda t: (-len(t), t))) + ")")


# The per-process shared normaliser. Constructing it is free; wetext is loaded on the
# first `normalize` call, under the instance's lock.
_DEFAULT_NORMALIZER = TextNormalizer()


def default_normalizer() -> TextNormalizer:
    return _DEFAULT_NORMALIZER


def normalize(text: str, lang: Lang | None = None, terminal: bool = True) -> str:
    """Normalise with the shared per-process `TextNormalizer`."""
    return _DEFAULT_NORMALIZER.normalize(text, lang, terminal)
