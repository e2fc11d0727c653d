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

The first call costs ~3 s on this machine (importing wetext/kaldifst and reading its
pre-compiled FSTs), later calls 1-25 ms per sentence; so the normaliser objects are
created lazily once per process, shared, guarded by a lock, and `warmup()` lets a
server pay the cost at start-up.
"""

from __future__ import annotations

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


def contains_chinese(text: str) -> bool:
    return _CJK_RE.search(text) is not None


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
    n = int(digits)
    if n == 0:
        return "zero"
    groups: list[int] = []
    while n:
        n, group = divmod(n, 1000)
        groups.append(group)
    if len(groups) > len(_SCALES):
        return " ".join(_ONES[int(d)] for d in digits)
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


def _spell_out_digits(text: str) -> str:
    return _DIGITS_RE.sub(lambda m: spell_number(m.group(0)), text)


# --- the normaliser -------------------------------------------------------------------


class TextNormalizer:
    """Holds the wetext normalisers; create once and share between threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._zh: Normalizer | None = None
        self._en: Normalizer | None = None
        self._auto: Normalizer | None = None

    def _wetext(self, lang: Lang | None) -> "Normalizer":
        # Lazy: importing wetext and reading FSTs is only paid by processes that use it.
        with self._lock:
            if self._auto is None:
                from wetext import Normalizer  # noqa: F811 (runtime import)

                # The official frontend builds both with lang auto; wetext's own
                # detection then sends pure-digit text to the Chinese grammar.
                self._auto = Normalizer(remove_erhua=False)
                self._zh = Normalizer(lang="zh", remove_erhua=False)
                self._en = Normalizer(lang="en")
            return {None: self._auto, "zh": self._zh, "en": self._en}[lang]

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
        # Control characters (NUL, escapes, ...) are unspeakable and make wetext's FSTs
        # assert; line breaks and tabs become spaces.
        text = _CONTROL.sub(lambda m: " " if m.group() in "\n\r\t" else "", text).strip()
        if not text:
            return text
        chinese = contains_chinese(text) if lang is None else lang == "zh"
        text = self._wetext_or_plain(text, lang)
        text = _zh_postprocess(text) if chinese else _spell_out_digits(text)
        if terminal and text and text[-1] not in (_ZH_ENDS if chinese else _EN_ENDS):
            text += "。" if chinese else "."
        return text

    def _wetext_or_plain(self, text: str, lang: Lang | None) -> str:
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
# The marks a text to speak ends with (the official `split_paragraph`'s, without commas).
_ZH_ENDS = frozenset("。？！；：、.?!;")
_EN_ENDS = frozenset(".?!;:")
# Between a digit and a non-ASCII character, either way round (`_wetext_or_plain`).
_DIGIT_TOUCHING_OTHER = re.compile(r"(?<=[0-9])(?=[^\x00-\x7f])|(?<=[^\x00-\x7f])(?=[0-9])")

# The per-process shared normaliser. Constructing it is free; wetext is loaded on the
# first `normalize` call, under the instance's lock.
_DEFAULT_NORMALIZER = TextNormalizer()


def default_normalizer() -> TextNormalizer:
    return _DEFAULT_NORMALIZER


def normalize(text: str, lang: Lang | None = None, terminal: bool = True) -> str:
    """Normalise with the shared per-process `TextNormalizer`."""
    return _DEFAULT_NORMALIZER.normalize(text, lang, terminal)
