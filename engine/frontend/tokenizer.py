"""The CosyVoice3 text tokenizer: Qwen2 byte-level BPE plus the CosyVoice3 special tokens.

The official frontend loads `CosyVoice-BlankEN/` with HF `AutoTokenizer` (a Qwen2
tokenizer built from vocab.json + merges.txt) and then registers 280 extra special
tokens. We rebuild the same tokenizer with the `tokenizers` library alone:

* normaliser NFC, pre-tokeniser = Qwen2's split regex (isolated) followed by a
  byte-level mapping without its own regex, byte-level decoder, BPE without unk;
* the base specials (`<|endoftext|>`, `<|im_start|>`, `<|im_end|>`) keep the ids that
  `tokenizer_config.json`'s `added_tokens_decoder` gives them;
* CosyVoice3 specials that are not already known get consecutive ids after the
  largest existing id, in the official order, so `<|endofprompt|>` is 151646 and the
  text vocabulary ends at 151924 for the real BlankEN files.

Special tokens are matched in raw text before BPE, so tags such as `[breath]`,
`<strong>`, ARPAbet phones `[AA1]` and pinyin `[ǐ]` each encode to one id.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

# Qwen2's pre-tokenisation pattern (contractions, letter runs with one leading
# non-letter, single digits, punctuation runs, newlines, spaces).
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

ENDOFTEXT = "<|endoftext|>"
ENDOFPROMPT = "<|endofprompt|>"
SYSTEM_PROMPT = "You are a helpful assistant."

# --- The CosyVoice3 additional special tokens, in registration order ------------------
# Order matters: it decides the ids of every token that is new to the base vocabulary.

_CV2_SPECIALS: tuple[str, ...] = (
    "<|im_start|>", "<|im_end|>", ENDOFPROMPT,
    "[breath]", "<strong>", "</strong>", "[noise]", "[laughter]", "[cough]",
    "[clucking]", "[accent]", "[quick_breath]", "<laughter>", "</laughter>",
    "[hissing]", "[sigh]", "[vocalized-noise]", "[lipsmack]", "[mn]",
)

# CMU ARPAbet phones in alphabetical order; vowels also come with stress 0/1/2.
_ARPABET_VOWELS = frozenset("AA AE AH AO AW AY EH ER EY IH IY OW OY UH UW".split())
_ARPABET_PHONES = (
    "AA AE AH AO AW AY B CH D DH EH ER EY F G HH IH IY JH K L M N NG "
    "OW OY P R S SH T TH UH UW V W Y Z ZH"
).split()


def _arpabet_tokens() -> list[str]:
    out: list[str] = []
    for phone in _ARPABET_PHONES:
        out.append(f"[{phone}]")
        if phone in _ARPABET_VOWELS:
            out.extend(f"[{phone}{stress}]" for stress in "012")
    return out


# Pinyin initials and tone-marked finals, in the order the official list uses
# (Python's default string sort of the bracketed tokens).
_PINYIN_UNITS = (
    "a ai an ang ao b c ch d e ei en eng f g h i ian in ing iu ià iàn iàng iào iá ián "
    "iáng iáo iè ié iòng ióng iù iú iā iān iāng iāo iē iě iōng iū iǎ iǎn iǎng iǎo iǒng "
    "iǔ j k l m n o ong ou p q r s sh t u uang ue un uo uà uài uàn uàng uá uái uán uáng "
    "uè ué uì uí uò uó uā uāi uān uāng uē uě uī uō uǎ uǎi uǎn uǎng uǐ uǒ vè w x y z zh "
    "à ài àn àng ào á ái án áng áo è èi èn èng èr é éi én éng ér ì ìn ìng í ín íng ò "
    "òng òu ó óng óu ù ùn ú ún ā āi ān āng āo ē ēi ēn ēng ě ěi ěn ěng ěr ī īn īng ō ōng "
    "ōu ū ūn ǎ ǎi ǎn ǎng ǎo ǐ ǐn ǐng ǒ ǒng ǒu ǔ ǔn ǘ ǚ ǜ"
).split()

COSYVOICE3_SPECIALS: tuple[str, ...] = (
    *_CV2_SPECIALS,
    "<|endofsystem|>",
    *_arpabet_tokens(),
    *(f"[{unit}]" for unit in _PINYIN_UNITS),
)

# The additional specials each model version's tokenizer registers, in order.
SPECIALS_BY_VERSION: dict[str, tuple[str, ...]] = {
    "cosyvoice3": COSYVOICE3_SPECIALS,
    "cosyvoice2": _CV2_SPECIALS,
}

# The system sentence, when the instruction starts with it as a sentence of its own (not
# "You are a helpful assistant who speaks slowly").
_SYSTEM_PREFIX_RE = re.compile(r"^\s*you are a helpful assistant\s*(?:[.。]|$)\s*", re.IGNORECASE)
# Every instruction of the official `instruct_list` ends with one of these.
_INSTRUCTION_ENDS = frozenset("。.？?！!")


def normalize_instruction(instruction: str) -> str:
    """Bring a user instruction into the CosyVoice3 instruct-prompt form.

    Accepts "speak happily", "You are a helpful assistant. speak happily" and either
    with a trailing `<|endofprompt|>`; returns exactly
    `"You are a helpful assistant. <instruction><|endofprompt|>"` (the spacing of the
    official `instruct_list`: one space after the system sentence, none before the
    marker), the instruction ended with a "." (a "。" when it is Chinese) where it has
    no final mark, as every instruction of that list has. Anything after an embedded `<|endofprompt|>` is not part of the
    instruction and is dropped.
    """
    body = instruction.split(ENDOFPROMPT, 1)[0]
    body = _SYSTEM_PREFIX_RE.sub("", body, count=1).strip()
    if not body:
        raise ValueError("empty instruction")
    if body[-1] not in _INSTRUCTION_ENDS:
        body += "。" if re.search("[\u4e00-\u9fff]", body) else "."
    return f"{SYSTEM_PROMPT} {body}{ENDOFPROMPT}"


def apply_qwen2_pipeline(tok: Tokenizer) -> Tokenizer:
    """Set the normaliser, pre-tokeniser and decoder HF's Qwen2TokenizerFast uses."""
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def _build_bpe_tokenizer(vocab: dict[str, int], merges: list[tuple[str, str]]) -> Tokenizer:
    """A Qwen2-style byte-level BPE (what HF's Qwen2 converter builds), no unk token."""
    model = models.BPE(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        continuing_subword_prefix="",
        end_of_word_suffix="",
        fuse_unk=False,
        byte_fallback=False,
    )
    return apply_qwen2_pipeline(Tokenizer(model))


def _read_merges(path: Path) -> list[tuple[str, str]]:
    merges: list[tuple[str, str]] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        # The first line of a HF merges file is a "#version" header.
        if not line or line.startswith("#version"):
            continue
        left, right = line.split(" ")
        merges.append((left, right))
    return merges


class TextTokenizer:
    """Text -> Qwen2 text ids (not unified-vocabulary ids) and back. Immutable after load."""

    def __init__(self, tokenizer: Tokenizer, special_ids: dict[str, int]) -> None:
        self._tok = tokenizer
        self._special_ids = dict(special_ids)

    @classmethod
    def from_dir(cls, path: Path | str, version: str = "cosyvoice3") -> "TextTokenizer":
        """Load `CosyVoice-BlankEN/` (vocab.json, merges.txt, tokenizer_config.json).

        `version` picks the special-token list: CosyVoice2 registers only its 19 specials
        (a prefix of CosyVoice3's list, so the shared ones, `<|endofprompt|>` = 151646
        included, get the same ids); phone/pinyin tokens are plain text there."""
        path = Path(path)
        vocab: dict[str, int] = json.loads((path / "vocab.json").read_text(encoding="utf-8"))
        merges = _read_merges(path / "merges.txt")
        config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
        base_specials = {
            entry["content"]: int(i) for i, entry in config.get("added_tokens_decoder", {}).items()
        }
        # The base specials are placed in the BPE vocabulary at their configured ids:
        # `add_special_tokens` then keeps those ids (a known token is never renumbered)
        # even when they do not follow the BPE ids directly, as in the small stand-in
        # vocabulary that keeps the real special ids. No merge can produce these strings,
        # and added tokens are split off before BPE runs, so this changes no encoding.
        tok = _build_bpe_tokenizer({**vocab, **base_specials}, merges)
        tok.add_special_tokens(sorted(base_specials, key=base_specials.__getitem__))
        special_ids = dict(base_specials)

        # CosyVoice3 specials: already-known ones keep their id, new ones are appended
        # one by one after the largest id so far (HF `add_special_tokens` semantics).
        last_id = max([*vocab.values(), *special_ids.values()])
        for content in SPECIALS_BY_VERSION[version]:
            if content in special_ids:
                continue
            expected = last_id + 1
            tok.add_special_tokens([content])
            got = tok.token_to_id(content)
            if got != expected:
                raise ValueError(f"special {content!r} got id {got}, expected {expected}")
            special_ids[content] = got
            last_id = got
        return cls(tok, special_ids)

    # --- encoding -----------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Text ids of `text`; special tokens written in the text become single ids."""
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Inverse of `encode`. The official decode skips special tokens by default."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int:
        got = self._tok.token_to_id(token)
        if got is None:
            raise KeyError(token)
        return got

    @property
    def endofprompt_id(self) -> int:
        return self._special_ids[ENDOFPROMPT]

    @property
    def eos_id(self) -> int:
        return self._special_ids[ENDOFTEXT]

    @property
    def special_tokens(self) -> dict[str, int]:
        """All base and CosyVoice3 special tokens with their ids (a copy)."""
        return dict(self._special_ids)

    @property
    def vocab_size(self) -> int:
        """One past the largest text id (151924 for the real CosyVoice3 vocabulary)."""
        return max(self._special_ids.values()) + 1
