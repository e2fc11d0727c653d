"""Tests of the CosyVoice3 frontend: tokenizer, text normalisation, features, ONNX
stand-ins and prompt featurisation.

Reference numbers marked "recorded" were computed once, offline, with the reference
implementations (whisper's shipped `mel_filters.npz`, librosa 0.11
`filters.mel`, torchaudio 2.8 `compliance.kaldi.fbank`), none of which is a
dependency of this project.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from engine.frontend import features
from engine.frontend.assets_writer import write_frontend_assets, write_tokenizer_files
from engine.frontend.onnx_models import SPEECH_TOKEN_SIZE, SpeakerEncoder, SpeechTokenizer
from engine.frontend.prompt import PromptFeaturizer, build_lm_text, cv2_instruction, lm_prompt_text
from engine.frontend.text import (
    contains_chinese,
    default_normalizer,
    detect_grammar,
    normalize,
    spell_number,
    strip_markdown,
    strip_stream_markdown,
    ungroup_thousands,
)
from engine.frontend.tokenizer import COSYVOICE3_SPECIALS, TextTokenizer, normalize_instruction
from engine.models.config import MelConfig
from engine.wavio import read_wav, write_wav

SYSTEM = "You are a helpful assistant."
EOP = "<|endofprompt|>"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cv3_frontend")
    write_frontend_assets(path, tiny=True, seed=0)
    return path


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> TextTokenizer:
    return TextTokenizer.from_dir(model_dir / "CosyVoice-BlankEN")


def _sine(freq: float, seconds: float, sr: int, amp: float = 0.5) -> np.ndarray:
    t = np.arange(int(seconds * sr)) / sr
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)


# --- tokenizer -------------------------------------------------------------------------


def test_special_token_ids_match_the_real_cosyvoice3_vocabulary(tokenizer: TextTokenizer) -> None:
    assert len(COSYVOICE3_SPECIALS) == 280
    assert len(set(COSYVOICE3_SPECIALS)) == 280
    assert tokenizer.token_id("<|endoftext|>") == 151643
    assert tokenizer.token_id("<|im_start|>") == 151644
    assert tokenizer.token_id("<|im_end|>") == 151645
    assert tokenizer.endofprompt_id == 151646
    assert tokenizer.token_id("[breath]") == 151647
    assert tokenizer.token_id("<|endofsystem|>") == 151646 + 17  # right after the CV2 list
    assert tokenizer.token_id("[AA]") == 151646 + 18
    assert tokenizer.token_id("[ǜ]") == 151923  # the last one
    assert tokenizer.vocab_size == 151924  # ORIGINAL_VOCAB_SIZE of the CV3 Triton runtime
    # 3 base specials + 278 new ones, consecutive
    ids = sorted(tokenizer.special_tokens.values())
    assert ids == list(range(151643, 151924))


def test_encode_recognises_tags_as_single_tokens(tokenizer: TextTokenizer) -> None:
    text = f"{SYSTEM}{EOP}Hello [breath] world, <strong>really</strong>! [AA1] 对报道[j][ǐ]予好评。[laughter]"
    ids = tokenizer.encode(text)
    for tag in (EOP, "[breath]", "<strong>", "</strong>", "[AA1]", "[j]", "[ǐ]", "[laughter]"):
        assert ids.count(tokenizer.token_id(tag)) == 1, tag
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    # The official decode skips specials by default.
    plain = tokenizer.decode(ids)
    assert "[breath]" not in plain and "<|endofprompt|>" not in plain and "对报道予好评" in plain


@pytest.mark.parametrize(
    "text",
    ["Hello, world!", "  spaces   and\n\nnewlines\t", "数字 12345 and émigré café", "It's we'll 😀 ©"],
)
def test_encode_decode_round_trip(tokenizer: TextTokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert all(0 <= i < 151643 for i in ids)  # no special ids from plain text
    assert tokenizer.decode(ids) == text


def test_bpe_merges_and_qwen2_pretokenisation(tokenizer: TextTokenizer) -> None:
    # Merged words are shorter than their bytes; digits are always split one by one.
    assert len(tokenizer.encode("the weather")) < len("the weather".encode())
    assert len(tokenizer.encode("12345")) == 5
    # NFC: a decomposed é encodes like the composed one.
    assert tokenizer.encode("cafe\u0301") == tokenizer.encode("caf\u00e9")


def test_prompt_and_text_split_equals_official_joint_encoding(tokenizer: TextTokenizer) -> None:
    text = "Hello there, 你好。"
    assert tokenizer.encode(SYSTEM + EOP) + tokenizer.encode(text) == tokenizer.encode(SYSTEM + EOP + text)


def test_tokenizer_files_are_deterministic(tmp_path: Path, model_dir: Path) -> None:
    write_tokenizer_files(tmp_path)
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (model_dir / "CosyVoice-BlankEN" / name).read_bytes()
    merges = (tmp_path / "merges.txt").read_text(encoding="utf-8").splitlines()
    assert merges[0].startswith("#version") and len(merges) - 1 >= 300


@pytest.mark.parametrize(
    "raw",
    [
        "speak happily",
        "  speak happily  ",
        "speak happily<|endofprompt|>",
        "You are a helpful assistant. speak happily",
        "You are a helpful assistant.speak happily<|endofprompt|>",
        "you are a helpful assistant.   speak happily <|endofprompt|>",
    ],
)
def test_instruction_normalisation(raw: str) -> None:
    assert normalize_instruction(raw) == "You are a helpful assistant. speak happily.<|endofprompt|>"


def test_instruction_normalisation_ends_it_like_the_official_list_and_keeps_its_words() -> None:
    """Every instruction of the official `instruct_list` ends with a mark; an instruction
    that only starts like the system sentence keeps its words."""
    assert normalize_instruction("请用广东话表达") == "You are a helpful assistant. 请用广东话表达。<|endofprompt|>"
    assert normalize_instruction("Speak slowly?") == "You are a helpful assistant. Speak slowly?<|endofprompt|>"
    assert (normalize_instruction("You are a helpful assistant who speaks slowly")
            == "You are a helpful assistant. You are a helpful assistant who speaks slowly.<|endofprompt|>")


def test_cosyvoice2_instruction_keeps_words_that_only_start_like_the_system_sentence() -> None:
    """CosyVoice2 drops a leading CosyVoice3 system sentence; an instruction that merely
    starts with its words ("... who speaks slowly") lost them, as CosyVoice3's did not."""
    assert (cv2_instruction("You are a helpful assistant who speaks slowly.")
            == "You are a helpful assistant who speaks slowly.<|endofprompt|>")
    assert cv2_instruction("you are a helpful assistantly voice") == "you are a helpful assistantly voice<|endofprompt|>"
    assert cv2_instruction("You are a helpful assistant. 用四川话说这句话") == "用四川话说这句话<|endofprompt|>"
    assert cv2_instruction("You are a helpful assistant。用四川话说这句话<|endofprompt|>") == "用四川话说这句话<|endofprompt|>"
    with pytest.raises(ValueError):
        cv2_instruction("You are a helpful assistant<|endofprompt|>")


def test_instruction_normalisation_keeps_official_list_entries() -> None:
    official = "You are a helpful assistant. 请用广东话表达。<|endofprompt|>"
    assert normalize_instruction(official) == official
    assert normalize_instruction("请用广东话表达。") == official
    with pytest.raises(ValueError):
        normalize_instruction("You are a helpful assistant.<|endofprompt|>")


# --- text normalisation ----------------------------------------------------------------


def test_normalize_english_numbers() -> None:
    out = normalize("I have 23 apples.")
    assert out == "I have twenty three apples."
    assert normalize("Call 911 now") == "Call nine hundred and eleven now."
    assert normalize('He said "stop"') == 'He said "stop".'  # as the official splitter does
    assert not any(ch.isdigit() for ch in normalize("It costs 1234 dollars on May 5."))


def test_normalize_chinese_numbers_and_punctuation() -> None:
    assert normalize("我有3个苹果") == "我有三个苹果。"  # ended as the official splitter ends it
    assert normalize("我有3个苹果", terminal=False) == "我有三个苹果"
    out = normalize("今天是2024年3月5日，气温25.5度（晴）,")
    assert out == "今天是二零二四年三月五日，气温二十五点五度晴。"
    assert normalize("面积是100m²。") == "面积是一百平方米。"


def test_a_digit_touching_a_character_the_grammar_does_not_know_is_still_read() -> None:
    """wetext's grammars assert on such text; the sentence must be spoken, not dropped."""
    assert normalize("It costs 5€.") == "It costs five euro."
    assert normalize("See §5.") == "See section five."
    for text in ("사과 5개 주세요.", "3시에 만나요.", "りんごを3つください。", "Москва 2024г.", "Costs ₹500."):
        out = normalize(text)
        assert out and not any(ch.isdigit() for ch in out), (text, out)


def test_line_breaks_other_than_newline_separate_words() -> None:
    """Control characters are dropped, line breaks and tabs become spaces; a form feed (a
    page break in text from a PDF), a vertical tab, NEL (U+0085) or a record separator is
    a line break too, and dropping it glued the words around it ("Page onePage two")."""
    for brk in ("\x0b", "\x0c", "\x1e", "\x85"):
        assert normalize(f"Page one{brk}Page two") == "Page one Page two.", repr(brk)
    assert normalize("a\x00b c") == "ab c."  # other control characters still go


def test_normalize_skip_rule_and_detection() -> None:
    marked = f"{SYSTEM}{EOP}I have 3 cats"
    assert normalize(marked) == marked
    assert contains_chinese("abc中") and not contains_chinese("abc ÉÈ")
    assert normalize("") == ""


def test_spell_number_matches_inflect_style() -> None:
    assert spell_number("0") == "zero"
    assert spell_number("21") == "twenty-one"
    assert spell_number("101") == "one hundred and one"
    assert spell_number("2024") == "two thousand and twenty-four"
    assert spell_number("1234") == "one thousand, two hundred and thirty-four"
    assert spell_number("1000000") == "one million"


def test_a_number_past_pythons_digit_limit_is_read_digit_by_digit_not_an_error() -> None:
    """`int()` refuses a string of more than 4300 digits; a digit run that long which the
    English grammar leaves as written (after "$", "#", before "%") made `normalize` raise
    ValueError, the segment an `engine_error` instead of being read (or refused as too long)."""
    digits = "9" * 4400
    assert spell_number(digits) == " ".join(["nine"] * 4400)
    assert spell_number("0" * 4400 + "7") == spell_number("7") == "seven"  # leading zeros: as int() reads them
    for text in ("$" + digits, "#" + digits, digits + "%", "Pay $" + digits + ".50 now"):
        out = normalize(text)
        assert "nine nine nine" in out and not any(ch.isdigit() for ch in out), text[:12]


def test_grouped_and_four_digit_numbers_read_as_the_right_number_in_english() -> None:
    """wetext's English grammar reads a cardinal from 1000 to 1999 without its "one"
    ("1,234" -> "thousand two hundred ...") and a bare 1000-1009 as a broken year ("ten
    hundred", "ten zero one"); its year reading of other four-digit numbers stays."""
    assert normalize("1,000 people came.") == "one thousand people came."
    assert normalize("1,234") == "one thousand two hundred and thirty four."
    assert normalize("about 1000 people") == "about one thousand people."
    assert normalize("$1,000.50") == "one thousand dollars and fifty cents."
    assert normalize("1001 nights") == "one thousand and one nights."
    assert normalize("(1000)") == "(one thousand)."
    assert normalize("It fell to -1,500") == "It fell to negative one thousand five hundred."
    assert normalize("1, 1,000") == "one, one thousand."
    assert normalize("2,345 and 1,000,000") == "two thousand three hundred and forty five and one million."
    # unchanged: years, decimals, and the words the text itself writes
    assert normalize("in 1999") == "in nineteen ninety nine."
    assert normalize("pi is 3.14") == "pi is three point one four."
    assert normalize("a thousand and 2000") == "a thousand and two thousand."


def test_a_decade_with_its_century_is_read_as_a_decade_in_english() -> None:
    """wetext's English grammar read "1990s" as "one thousand nine hundred and ninety
    seconds" (its two-digit "80s" it reads as "eighties")."""
    assert normalize("In the 1990s, music changed.") == "In the nineteen nineties, music changed."
    assert normalize("The 2020s and the 2000s") == "The twenty twenties and the two thousands."
    assert normalize("the 1800s or the 1910s") == "the eighteen hundreds or the nineteen tens."
    assert normalize("The 80s were fun.") == "The eighties were fun."
    assert normalize("It took 5s.") == "It took five seconds."  # no decade: as before
    assert normalize("in 1990") == "in nineteen ninety."


def test_thousands_separators_are_dropped_for_the_chinese_grammar() -> None:
    assert normalize("价格是$1,000") == "价格是一千美元。"
    assert normalize("有1,234,567人") == "有一百二十三万四千五百六十七人。"
    # only real groupings
    assert (ungroup_thousands("1,234,567 and 1,000.5 and 1,23 and 12,345,6")
            == "1234567 and 1000.5 and 1,23 and 12,345,6")


def test_a_hyphen_after_a_letter_is_not_a_minus_sign() -> None:
    assert normalize("GPT-4很强") == "GPT四很强。"
    assert normalize("温度是-4度") == "温度是负四度。"  # a real minus stays one
    assert normalize("GPT-4 is strong") == "GPT-four is strong."


def test_detected_non_chinese_text_is_read_by_the_english_grammar() -> None:
    """wetext's own detection ("auto") sends digit-only text to its Chinese grammar; text
    without a CJK ideograph is decided English and read so."""
    assert normalize("42") == "forty two."
    assert normalize("1999") == "nineteen ninety nine."
    assert normalize("42", "zh") == "四十二。"


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Hello there,", "Hello there."),
        ("Hello、", "Hello."),
        ("The end…", "The end…"),
        ('He said "stop."', 'He said "stop."'),
        ('He said "stop,"', 'He said "stop."'),
        ("(see above.)", "(see above.)"),
        ("他说：“好。”", "他说：“好。”"),
        ("他说：“好，”", "他说：“好。”"),
        ("你好……", "你好……"),
        ("Wait;", "Wait;"),  # an official end mark
    ],
)
def test_no_doubled_sentence_end(text: str, expected: str) -> None:
    assert normalize(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("コンニチハ！", "コンニチハ！"),
        ("ソウデスカ？", "ソウデスカ？"),
        ("レキシ テキ セカイ ニ オイ テ ワ、カコ ワ タンニ スギサッ タ モノ デ ワ ナイ。",
         "レキシ テキ セカイ ニ オイ テ ワ、カコ ワ タンニ スギサッ タ モノ デ ワ ナイ。"),
        ("안녕하세요。", "안녕하세요。"),
        ("안녕？", "안녕？"),
        ("Hello！", "Hello！"),
        ("コンニチハ", "コンニチハ."),  # no end mark: one is still added
    ],
)
def test_a_fullwidth_end_is_not_followed_by_a_second_mark(text: str, expected: str) -> None:
    """Kana-only and Korean text has no CJK ideograph and takes the English path, whose
    end marks were only the ASCII ones: "コンニチハ！" became "コンニチハ！."."""
    assert normalize(text) == expected


def _special_tags(tokenizer: TextTokenizer, text: str) -> list[str]:
    by_id = {i: t for t, i in tokenizer.special_tokens.items()}
    return [by_id[i] for i in tokenizer.encode(text) if i in by_id]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Say [HH][AH0][L][OW1] now.", "Say [HH][AH0][L][OW1] now."),
        ("Hello [breath] [ER0] world 42.", "Hello [breath] [ER0] world forty two."),
        ("The [AO1] 1990s", "The [AO1] nineteen nineties."),
        ("I paid $1,000[breath] for [EY2] it", "I paid one thousand dollars[breath] for [EY2] it."),
        ("[OW1]", "[OW1]."),
        ("读[AH1]这个字。", "读[AH1]这个字。"),
        ("他有<strong>3</strong>个苹果[AA1]", "他有<strong>三</strong>个苹果[AA1]。"),
        ("高管也通过电话、短信[j][ǐ]予好评。", "高管也通过电话、短信[j][ǐ]予好评。"),
        # a tag written against a number stays against its reading
        ("[breath]5 apples", "[breath]five apples."),
        ("Wait[breath]2 minutes", "Wait[breath]two minutes."),
        ("It costs <strong>5</strong> dollars.", "It costs <strong>five</strong> dollars."),
    ],
)
def test_special_tokens_survive_normalisation(tokenizer: TextTokenizer, text: str, expected: str) -> None:
    """The grammars and the digit speller read the digit of an ARPAbet stress tag:
    "[AH0]" became "[AHzero]" / "[AH零]", which no longer encodes to its special token."""
    out = normalize(text)
    assert out == expected
    assert _special_tags(tokenizer, out) == _special_tags(tokenizer, text)
    assert _special_tags(tokenizer, text)  # the case: the text has special tokens


def test_special_tokens_survive_in_both_grammars(tokenizer: TextTokenizer) -> None:
    text = "[HH][AH0][L][OW1] 3 [EY2]"
    for lang in ("en", "zh"):
        out = normalize(text, lang)
        assert _special_tags(tokenizer, out) == ["[HH]", "[AH0]", "[L]", "[OW1]", "[EY2]"], (lang, out)
        assert tokenizer.token_id("[AH0]") in tokenizer.encode(out)
        assert "3" not in out  # the digit outside the tags is still read
    assert normalize(text, "en") == "[HH][AH0][L][OW1] three [EY2]."
    assert normalize(text, "zh") == "[HH][AH0][L][OW1]三[EY2]。"


def test_special_tokens_survive_when_the_placeholders_do_not(tokenizer: TextTokenizer,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Should the grammar lose a placeholder, the pieces between the tags are read one by
    one and joined with the tags as written."""
    normalizer = default_normalizer()
    read = normalizer._wetext_or_plain
    monkeypatch.setattr(normalizer, "_wetext_or_plain",
                        lambda text, lang: "".join(c for c in read(text, lang) if not "\ue000" <= c <= "\uf8ff"))
    assert normalize("Say [HH][AH0] 42 times [breath] now") == "Say [HH][AH0] forty two times [breath] now."
    assert normalize("读[AH1]这个字3次") == "读[AH1]这个字三次。"


def test_text_without_special_tokens_is_read_as_before() -> None:
    """Brackets that hold no special token ("[1]", "[AH3]", lower-case "[ah0]") are text."""
    assert normalize("See [1] and [AH3] and [ah0] and <5>.") == "See [one] and [AHthree] and [ahzero] and <five>."
    assert normalize("第[1]条") == "第[一]条。"
    normalizer = default_normalizer()
    for text in ("It costs $1,000 on 2024-03-05.", "今天是2024年3月5日。", "Read [x] 2 times", "a < b > c"):
        for chinese in (False, True):
            assert normalizer._read_keeping_special_tokens(text, chinese) == normalizer._read(text, chinese)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("**Note:** be careful.", "Note: be careful."),
        ("**Note:", "Note:"),  # segments cut inside a bold span
        ("** be careful.", "be careful."),
        ("### Summary", "Summary."),
        ("* First item", "First item."),
        ("- Second item", "Second item."),
        ("_italic_ and *emphasis*", "italic and emphasis."),
        ("| a | b |", "a, b."),
        ("See [the docs](http://x.com/a_b) now.", "See the docs now."),
        ("Run `pip install` first.", "Run pip install first."),
        ("> quoted text", "quoted text."),
        ("~~old~~ new", "old new."),
        ("**注意：**小心", "注意：小心。"),
        # not markdown: read as before
        ("2 * 3", "two times three."),
        ("2*3*4 and my_var_name", "two times three times four and my underscore var underscore name."),
        ("C# is #1", "C# is #one."),
    ],
)
def test_markdown_is_not_read_aloud(text: str, expected: str) -> None:
    assert normalize(text) == expected


def test_strip_markdown_keeps_what_is_not_markdown() -> None:
    for text in ("2 * 3 * 4", "2*3*4", "a ** b", "2**3", "C# is #1", "snake_case_name", "x_1 + y_2"):
        assert strip_markdown(text) == text
    assert strip_markdown("__init__ and ***both***") == "init and both"
    assert strip_markdown("|---|:---:|") == ""
    assert strip_markdown("line one\n## Two\n* three\n---\n| x | **y** |") == "line one\nTwo\nthree\n\nx, y"


# --- filterbanks -------------------------------------------------------------------------


def test_slaney_filterbank_matches_whisper_mel_filters() -> None:
    fb = features.slaney_mel_filterbank(16000, 400, 128)
    assert fb.shape == (128, 201) and fb.dtype == np.float32
    # recorded from whisper/assets/mel_filters.npz["mel_128"] (== librosa's filters)
    rows = [0, 10, 64, 127]
    np.testing.assert_allclose(
        fb[rows].sum(axis=1), [0.0123739867, 0.0123739860, 0.0248412010, 0.0249360440], rtol=1e-6
    )
    assert [int(fb[r].argmax()) for r in rows] == [1, 6, 43, 195]
    np.testing.assert_allclose(fb[rows].max(axis=1), [0.0123739867, 0.0112891840, 0.0180915184, 0.0050416016], rtol=1e-6)
    assert fb.sum() == pytest.approx(3.1909857, rel=1e-6)


def test_slaney_filterbank_closed_form_properties() -> None:
    sr, n_fft, n_mels = 24000, 1920, 80
    fb = features.slaney_mel_filterbank(sr, n_fft, n_mels).astype(np.float64)
    assert fb.shape == (n_mels, 961) and (fb >= 0).all()
    # Slaney norm: each triangle has unit area in Hz (sampled on the FFT grid).
    bin_hz = sr / n_fft
    areas = fb.sum(axis=1) * bin_hz
    np.testing.assert_allclose(areas[20:], 1.0, rtol=0.02)
    # Peaks move up monotonically; fmax None reaches Nyquist.
    peaks = fb.argmax(axis=1)
    assert (np.diff(peaks) >= 0).all() and peaks[-1] > 900
    # The mel scale is linear below 1 kHz and the inverse is exact.
    assert features.hz_to_mel_slaney(np.array(1000.0)) == pytest.approx(15.0)
    hz = np.array([0.0, 200.0, 999.0, 1000.0, 4000.0, 12000.0])
    np.testing.assert_allclose(features.mel_to_hz_slaney(features.hz_to_mel_slaney(hz)), hz, atol=1e-6)


def test_kaldi_mel_banks_closed_form() -> None:
    banks = features.kaldi_mel_filterbank(80, 512, 16000, 20.0, 0.0).astype(np.float64)
    assert banks.shape == (80, 257)
    assert (banks[:, -1] == 0).all() and banks.max() <= 1.0
    # Triangles in the mel domain: neighbouring filters sum to ~1 between first and last centre.
    mel = features.hz_to_mel_kaldi(16000 / 512 * np.arange(257))
    lo, hi = features.hz_to_mel_kaldi(20.0), features.hz_to_mel_kaldi(8000.0)
    delta = (hi - lo) / 81
    inside = (mel > lo + delta) & (mel < hi - delta)
    np.testing.assert_allclose(banks[:, inside].sum(axis=0), 1.0, atol=1e-5)
    assert features.hz_to_mel_kaldi(700.0) == pytest.approx(1127.0 * np.log(2.0))


# --- features ---------------------------------------------------------------------------


def test_whisper_log_mel_shape_range_and_numpy_reference() -> None:
    rng = np.random.default_rng(0)
    wav = (rng.standard_normal(16000 * 2 + 77) * 0.1).astype(np.float32)
    mel = features.whisper_log_mel(wav)
    assert mel.shape == (128, wav.size // 160) and mel.dtype == torch.float32
    assert mel.max().item() - mel.min().item() <= 2.0 + 1e-6  # 8 in log10 units / 4

    # Independent numpy version: reflect pad n_fft/2, periodic Hann, |rfft|^2, last frame dropped.
    padded = np.pad(wav.astype(np.float64), (200, 200), mode="reflect")
    n_frames = 1 + (padded.size - 400) // 160
    frames = np.stack([padded[i * 160 : i * 160 + 400] for i in range(n_frames)])
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(400) / 400)
    power = np.abs(np.fft.rfft(frames * window, axis=1)) ** 2
    spec = features.slaney_mel_filterbank(16000, 400, 128).astype(np.float64) @ power[:-1].T
    ref = np.log10(np.maximum(spec, 1e-10))
    ref = (np.maximum(ref, ref.max() - 8.0) + 4.0) / 4.0
    np.testing.assert_allclose(mel.numpy(), ref, atol=2e-4)


def test_kaldi_fbank_frames_and_recorded_torchaudio_values() -> None:
    wav = _sine(440.0, 1.0, 16000)
    fb = features.kaldi_fbank(wav)
    assert fb.shape == (1 + (16000 - 400) // 160, 80) == (98, 80)
    # recorded: torchaudio.compliance.kaldi.fbank(wav[None], num_mel_bins=80, dither=0, sample_frequency=16000)[10]
    expected = [-11.571252822875977, -9.106409072875977, -4.5737786293029785, -7.332019329071045,
                -15.942384719848633, -15.942384719848633]
    np.testing.assert_allclose(fb[10, [0, 5, 10, 20, 40, 79]].numpy(), expected, atol=2e-3)
    # The loudest bin is the one centred on 440 Hz: (mel(440) - mel(20)) / delta - 1 = 13.97.
    delta = (features.hz_to_mel_kaldi(8000.0) - features.hz_to_mel_kaldi(20.0)) / 81
    centre = (features.hz_to_mel_kaldi(440.0) - features.hz_to_mel_kaldi(20.0)) / delta - 1
    assert int(fb[10].argmax()) == round(float(centre)) == 14
    assert features.kaldi_fbank(np.zeros(399, np.float32)).shape == (0, 80)


def test_speaker_fbank_is_mean_normalised() -> None:
    feat = features.speaker_fbank(_sine(300.0, 0.7, 16000) + _sine(2000.0, 0.7, 16000, 0.1))
    assert feat.shape[1] == 80
    assert feat.mean(dim=0).abs().max().item() < 1e-4


def test_prompt_mel_frames_and_recorded_librosa_values() -> None:
    cfg = MelConfig()
    wav = _sine(440.0, 2.0, 24000) + _sine(3000.0, 2.0, 24000, 0.1)
    mel = features.prompt_mel(wav, cfg)
    assert mel.shape == (wav.size // cfg.hop_size, 80) == (100, 80)
    # recorded: matcha's formula computed with librosa.stft / librosa.filters.mel (float64)
    expected = [-9.108999252319336, -6.787806510925293, 1.6584739685058594, -9.411819458007812,
                -11.512925148010254, -11.512925148010254]
    np.testing.assert_allclose(mel[20, [0, 5, 10, 20, 40, 79]].numpy(), expected, atol=2e-3)
    assert mel.min().item() >= np.log(1e-5) - 1e-6


def test_resample_lengths_and_tone() -> None:
    wav = _sine(1000.0, 1.0, 48000)
    out = features.resample(wav, 48000, 16000)
    assert out.dtype == np.float32 and abs(out.size - 16000) <= 1
    spectrum = np.abs(np.fft.rfft(out[:16000]))
    assert int(spectrum.argmax()) == 1000  # 1 Hz bins
    assert np.array_equal(features.resample(wav, 48000, 48000), wav)


@pytest.mark.parametrize("sr_in, sr_out", [(16000, 24000), (44100, 16000), (22050, 24000), (48000, 16000)])
def test_resample_is_the_official_windowed_sinc(sr_in: int, sr_out: int) -> None:
    """Each output sample is the official (torchaudio `Resample`) formula evaluated
    directly: input samples weighted by a Hann-windowed sinc at 0.99 of the lower Nyquist
    rate, 6 zero crossings wide; ceil(n * sr_out / sr_in) of them. And it filters as
    that formula does: a tone in the band passes, one above the new Nyquist is gone."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal(3001).astype(np.float32)
    out = features.resample(x, sr_in, sr_out)
    g = math.gcd(sr_in, sr_out)
    p, q = sr_in // g, sr_out // g
    assert out.size == math.ceil(x.size * q / p)
    cutoff = 0.99 * min(p, q)
    i = np.arange(x.size)
    for m in rng.integers(0, out.size, 25):
        t = np.clip((i / p - m / q) * cutoff, -6, 6)
        w = np.sinc(t) * np.cos(np.pi * t / 12) ** 2 * cutoff / p
        assert abs(float(w @ x.astype(np.float64)) - float(out[m])) < 1e-4
    low = min(sr_in, sr_out)
    passed = features.resample(_sine(0.3 * low, 1.0, sr_in), sr_in, sr_out)
    assert abs(float(np.sqrt(np.mean(passed[200:-200] ** 2))) - 0.5 / math.sqrt(2)) < 0.01
    if sr_out < sr_in:  # a gentle roll-off: 0.55 of the new rate still leaks -14 dB; 0.7 none
        stopped = features.resample(_sine(0.7 * sr_out, 1.0, sr_in), sr_in, sr_out)
        assert float(np.sqrt(np.mean(stopped[200:-200] ** 2))) < 0.002


# Rates uploads come at in practice; each must keep the polyphase path (the official
# frontend's exact arithmetic).
STANDARD_RATES = (8000, 11025, 16000, 22050, 24000, 32000, 44100, 48000, 88200, 96000, 176400, 192000)
TABLE_LIMIT = 4_000_000  # weights: 16 MB as float32


def _table_weights(sr_in: int, sr_out: int) -> int:
    """q x (2w + p): the size of the polyphase table of `sr_in -> sr_out` (torchaudio's)."""
    g = math.gcd(sr_in, sr_out)
    p, q = sr_in // g, sr_out // g
    return q * (2 * math.ceil(6 * p / (0.99 * min(p, q))) + p)


@pytest.fixture
def table_spy(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the polyphase tables `resample` builds; one past TABLE_LIMIT fails the
    test before it is built (a 16001 Hz one is ~1 GB and takes tens of seconds)."""
    built: list[int] = []
    real = features.sinc_kernel

    def spy(sr_in: int, sr_out: int, *args, **kw):
        built.append(_table_weights(sr_in, sr_out))
        assert built[-1] <= TABLE_LIMIT, f"a {built[-1]}-weight table for {sr_in} -> {sr_out} Hz"
        return real(sr_in, sr_out, *args, **kw)

    monkeypatch.setattr(features, "sinc_kernel", spy)
    return built


@pytest.mark.parametrize("sr_in, sr_out", [(16001, 16000), (16001, 24000), (22051, 24000), (22051, 16000),
                                           (44101, 16000), (191999, 24000)])
def test_resample_at_an_odd_rate_builds_no_huge_table(sr_in: int, sr_out: int, table_spy: list[int]) -> None:
    """An odd rate barely reduces (16001:16000): its polyphase table would have ~2.6e8
    weights. It is resampled without one, by the same formula: every output sample is the
    official windowed sinc evaluated at its own input time m sr_in / sr_out."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal(4003).astype(np.float32)
    out = features.resample(x, sr_in, sr_out)
    assert all(n <= TABLE_LIMIT for n in table_spy)
    assert out.dtype == np.float32 and out.size == math.ceil(x.size * sr_out / sr_in)
    f = 0.99 * min(sr_in, sr_out) / sr_in  # the cut-off in cycles per input sample
    i = np.arange(x.size)
    for m in list(rng.integers(0, out.size, 25)) + [0, out.size - 1]:
        t = np.clip((i - m * sr_in / sr_out) * f, -6, 6)
        w = np.sinc(t) * np.cos(np.pi * t / 12) ** 2 * f
        assert abs(float(w @ x.astype(np.float64)) - float(out[m])) < 1e-4
    low = min(sr_in, sr_out)
    passed = features.resample(_sine(0.3 * low, 1.0, sr_in), sr_in, sr_out)
    assert abs(float(np.sqrt(np.mean(passed[200:-200] ** 2))) - 0.5 / math.sqrt(2)) < 0.01


def test_resample_keeps_the_polyphase_table_at_standard_rates(monkeypatch: pytest.MonkeyPatch,
                                                              table_spy: list[int]) -> None:
    """Every standard rate to 16 and 24 kHz still goes through the table (bit for bit the
    official arithmetic), and the direct evaluation agrees with it to float rounding."""
    x = np.random.default_rng(2).standard_normal(6007).astype(np.float32) * 0.3
    tabled = {}
    for sr_in in STANDARD_RATES:
        for sr_out in (16000, 24000):
            if sr_in != sr_out:
                tabled[sr_in, sr_out] = features.resample(x, sr_in, sr_out)
                assert len(table_spy) == len(tabled)  # one table each
                assert _table_weights(sr_in, sr_out) <= features.MAX_POLYPHASE_WEIGHTS
    monkeypatch.setattr(features, "MAX_POLYPHASE_WEIGHTS", 0)  # everything direct now
    for (sr_in, sr_out), expected in tabled.items():
        direct = features.resample(x, sr_in, sr_out)
        assert direct.shape == expected.shape
        np.testing.assert_allclose(direct, expected, atol=1e-4, err_msg=f"{sr_in} -> {sr_out}")
    assert len(table_spy) == len(tabled)  # no table built on the direct path
    monkeypatch.undo()  # the real sinc_kernel and limit
    with pytest.raises(ValueError, match="polyphase table"):
        features.sinc_kernel(16001, 16000)  # refused, not ~1 GB allocated


# --- ONNX stand-ins ---------------------------------------------------------------------


def test_speech_tokenizer_standin_signature_and_values(model_dir: Path) -> None:
    session = ort.InferenceSession(str(model_dir / "speech_tokenizer_v3.onnx"), providers=["CPUExecutionProvider"])
    ins, outs = session.get_inputs(), session.get_outputs()
    assert [(i.type, len(i.shape)) for i in ins] == [("tensor(float)", 3), ("tensor(int32)", 1)]
    assert ins[0].shape[1] == 128
    assert [(o.type, len(o.shape)) for o in outs] == [("tensor(int64)", 2)]

    rng = np.random.default_rng(1)
    wav = (rng.standard_normal(16000 * 3) * 0.2).astype(np.float32) * np.linspace(0, 1, 48000, dtype=np.float32)
    log_mel = features.whisper_log_mel(wav).numpy()
    tokens = SpeechTokenizer(model_dir / "speech_tokenizer_v3.onnx", prefer_gpu=False)(log_mel)
    assert tokens.dtype == np.int64 and tokens.shape == (log_mel.shape[1] // 4,)
    assert tokens.min() >= 0 and tokens.max() < SPEECH_TOKEN_SIZE
    assert len(set(tokens.tolist())) > 1
    # Deterministic, and feats_length is honoured.
    again = session.run(None, {ins[0].name: log_mel[None], ins[1].name: np.array([100], np.int32)})[0]
    assert again.shape == (1, 25) and (again[0] == tokens[:25]).all()


def test_campplus_standin_signature_and_values(model_dir: Path) -> None:
    session = ort.InferenceSession(str(model_dir / "campplus.onnx"), providers=["CPUExecutionProvider"])
    (inp,), (out,) = session.get_inputs(), session.get_outputs()
    assert inp.name == "input" and inp.type == "tensor(float)" and len(inp.shape) == 3 and inp.shape[2] == 80
    assert out.type == "tensor(float)" and out.shape == [1, 192]
    encoder = SpeakerEncoder(model_dir / "campplus.onnx")
    a = encoder(features.speaker_fbank(_sine(200.0, 1.0, 16000)).numpy())
    b = encoder(features.speaker_fbank(_sine(3000.0, 1.0, 16000)).numpy())
    assert a.shape == (192,) and a.dtype == np.float32 and np.isfinite(a).all()
    assert not np.allclose(a, b)  # different voices, different embeddings


# --- prompt featurisation and LM prompts ------------------------------------------------


@pytest.mark.parametrize("sample_rate", [16000, 24000, 44100])
def test_featurize_alignment(model_dir: Path, sample_rate: int) -> None:
    featurizer = PromptFeaturizer(
        SpeechTokenizer(model_dir / "speech_tokenizer_v3.onnx", prefer_gpu=False),
        SpeakerEncoder(model_dir / "campplus.onnx"),
        MelConfig(),
    )
    rng = np.random.default_rng(2)
    wav = (rng.standard_normal(int(sample_rate * 2.37)) * 0.1).astype(np.float32)
    out = featurizer.featurize(wav, sample_rate)
    n = out.speech_tokens.numel()
    assert n == 59  # 2.37 s at 25 Hz, floored
    assert out.speech_tokens.dtype == torch.int64 and out.speech_tokens.shape == (n,)
    assert out.speech_feat.shape == (2 * n, 80) and out.speech_feat.dtype == torch.float32
    assert out.embedding.shape == (192,) and out.embedding.dtype == torch.float32
    tokens, feat, emb = out  # also unpacks as a tuple
    assert int(tokens.max()) < SPEECH_TOKEN_SIZE

    with pytest.raises(ValueError):
        featurizer.featurize(wav[: sample_rate // 10], 8000)  # below 16 kHz
    with pytest.raises(ValueError):
        featurizer.featurize(np.zeros(sample_rate * 31, np.float32), sample_rate)  # over 30 s


def test_lm_prompt_strings_per_mode() -> None:
    transcript = "希望你以后能够做的比我还好呦。"
    assert lm_prompt_text("zero_shot", transcript=transcript) == SYSTEM + EOP + transcript
    assert lm_prompt_text("zero_shot", transcript=SYSTEM + EOP + transcript) == SYSTEM + EOP + transcript
    assert lm_prompt_text("instruct", instruction="请用广东话表达。") == "You are a helpful assistant. 请用广东话表达。<|endofprompt|>"
    assert lm_prompt_text("cross_lingual") == SYSTEM + EOP
    with pytest.raises(ValueError):
        lm_prompt_text("instruct", instruction="")


def test_build_lm_text_ids(tokenizer: TextTokenizer) -> None:
    text = "Hello there."
    zs = build_lm_text(tokenizer, "zero_shot", text, transcript="Nice day.")
    assert zs.use_prompt_speech
    assert list(zs.prompt_ids) == tokenizer.encode(SYSTEM + EOP + "Nice day.")
    assert list(zs.text_ids) == tokenizer.encode(text)

    ins = build_lm_text(tokenizer, "instruct", text, instruction="speak happily")
    assert not ins.use_prompt_speech and ins.prompt_ids[-1] == tokenizer.endofprompt_id

    cl = build_lm_text(tokenizer, "cross_lingual", text)
    assert not cl.use_prompt_speech
    # Same LM text as the official `inference_cross_lingual(SYSTEM + EOP + text)`.
    assert list(cl.prompt_ids + cl.text_ids) == tokenizer.encode(SYSTEM + EOP + text)


def test_language_hint_picks_the_grammar() -> None:
    from engine.frontend.text import language_grammar

    assert [language_grammar(t) for t in ("en", "en-US", "zh", "zh_CN", "yue-HK", "fr", None, "")] == \
        ["en", "en", "zh", "zh", "zh", None, None, None]
    assert normalize("2024", language_grammar("en")) != normalize("2024", language_grammar("zh"))


@pytest.mark.parametrize(
    "text, expected",
    [
        # numbers and symbols that are no markdown stay
        ("Press # to repeat, or press * to go back. Dial *67 first.",
         "Press # to repeat, or press * to go back. Dial *67 first."),
        ("So 2*3=6 and 5 * 3 = 15.", "So 2*3=6 and 5 * 3 = 15."),
        ("C# is #1 and 3 > 2", "C# is #1 and 3 > 2"),
        # emphasis, code and line marks go (a mark closing after punctuation too)
        ("**Note:** use `pip`", "Note: use pip"),
        ("**Bold", "Bold"),
        ("x\n## Title\n> quoted", "x\n Title\n quoted"),
        ("I don`t know", "I don't know"),
    ],
)
def test_stream_markdown_leaves_numbers_and_symbols(text: str, expected: str) -> None:
    assert strip_stream_markdown(text) == expected


def test_what_looks_like_markdown_but_is_text_is_read() -> None:
    """A segment starts mid-paragraph (the segmenter cuts sentences), so a mark before a
    number is a number's sign; a single-letter variable keeps its minus; three-digit
    groups are not merged unless money or "000" says they are one number."""
    assert normalize("- 5 degrees by morning") == "- five degrees by morning."
    assert normalize("+ 3 for the home team") == "plus three for the home team."
    assert normalize("- Second item") == "Second item."
    assert normalize("当x-1等于0时") == "当x负一等于零时。"
    assert normalize("T-5分钟") == "T负五分钟。"
    assert normalize("坐标是(100,200)。") == "坐标是(一百,两百)。"
    assert ungroup_thousands("800,600 and $100,200 and 100,000 and 12,345") == "800,600 and $100200 and 100000 and 12345"
    assert normalize("I don`t know.") == "I don't know."
    assert normalize("See [docs](https://a.com/x_(y)) here.") == "See docs here."
    assert normalize("这是**重要**的事情") == "这是重要的事情。"
    assert normalize("Thanks :)") == "Thanks :)."


def test_the_grammar_of_text_without_letters_is_left_to_the_caller() -> None:
    assert detect_grammar("Hello") == "en" and detect_grammar("你好") == "zh"
    assert detect_grammar("１２３") == "zh"  # fullwidth digits come with CJK text
    assert detect_grammar("42") is None and detect_grammar("$5, 50%") is None


def test_the_features_record_tells_networks_of_one_size_apart(tmp_path: Path) -> None:
    """The record of what made a voice's features named each network's file by name and
    size only: a re-exported or fine-tuned network of the same architecture (same size,
    other weights) reused the voices stored under the old one."""
    from engine.frontend.prompt import file_record
    from engine.models.writer import write_model_dir

    a, b = write_model_dir(tmp_path / "a", "tiny", seed=0), write_model_dir(tmp_path / "b", "tiny", seed=7)
    for name in ("campplus.onnx", "speech_tokenizer_v3.onnx"):
        fa, fb = Path(a) / name, Path(b) / name
        assert fa.stat().st_size == fb.stat().st_size  # the case: one size, other weights
        assert file_record(fa) != file_record(fb)
        assert file_record(fa) == file_record(Path(a) / name)  # and stable


# --- prompt WAV reading ----------------------------------------------------------------


def _riff(tag: int, bits: int, channels: int, sample_rate: int, payload: bytes, extensible: bool = False,
          extra_chunk: bool = False) -> bytes:
    """A WAV file as bytes, written by hand (no WAV library writes float or 24-bit here)."""
    block = channels * bits // 8
    fmt = struct.pack("<HHIIHH", 0xFFFE if extensible else tag, channels, sample_rate, sample_rate * block, block, bits)
    if extensible:  # cbSize, valid bits, channel mask, the subformat GUID (tag + fixed tail)
        fmt += struct.pack("<HHI", 22, bits, 0) + struct.pack("<H", tag) + bytes.fromhex("000000001000800000aa00389b71")
    chunks = b"fmt " + struct.pack("<I", len(fmt)) + fmt
    if extra_chunk:  # an odd-sized chunk before the data: padded to an even size
        chunks += b"LIST" + struct.pack("<I", 3) + b"abc\0"
    chunks += b"data" + struct.pack("<I", len(payload)) + payload
    return b"RIFF" + struct.pack("<I", 4 + len(chunks)) + b"WAVE" + chunks


def _pcm_bytes(x: np.ndarray, bits: int) -> bytes:
    full = 2 ** (bits - 1)
    ints = np.clip(np.round(x.astype(np.float64) * full), -full, full - 1).astype(np.int64)
    if bits == 8:
        return (ints + 128).astype(np.uint8).tobytes()
    return b"".join(int(v).to_bytes(bits // 8, "little", signed=True) for v in ints) if bits == 24 \
        else ints.astype(f"<i{bits // 8}").tobytes()


@pytest.mark.parametrize(
    "name, tag, bits, encode",
    [
        ("pcm8", 1, 8, lambda x: _pcm_bytes(x, 8)),
        ("pcm24", 1, 24, lambda x: _pcm_bytes(x, 24)),
        ("pcm32", 1, 32, lambda x: _pcm_bytes(x, 32)),
        ("float32", 3, 32, lambda x: x.astype("<f4").tobytes()),
        ("float64", 3, 64, lambda x: x.astype("<f8").tobytes()),
    ],
)
@pytest.mark.parametrize("extensible", [False, True])
def test_read_wav_reads_pcm_and_float_like_16_bit(tmp_path: Path, name: str, tag: int, bits: int, encode,
                                                   extensible: bool) -> None:
    """`read_wav` (the CLI's prompt loader) refused 24-bit PCM and float WAV files."""
    x = _sine(220, 0.25, 16000, amp=0.6)
    x[:3] = [-1.0, 0.999, -0.5]  # the extremes and a negative 24-bit sample
    (tmp_path / "ref.wav").write_bytes(_riff(1, 16, 1, 16000, _pcm_bytes(x, 16)))
    ref, ref_sr = read_wav(tmp_path / "ref.wav")
    (tmp_path / f"{name}.wav").write_bytes(_riff(tag, bits, 1, 16000, encode(x), extensible, extra_chunk=True))
    got, sr = read_wav(tmp_path / f"{name}.wav")
    assert (sr, got.dtype, got.shape) == (ref_sr, np.float32, ref.shape)
    tolerance = 1 / 128 if bits == 8 else 1 / 32768  # the coarser of the two quantisations
    np.testing.assert_allclose(got, ref, rtol=0, atol=tolerance)
    if bits > 16:
        np.testing.assert_allclose(got, x, rtol=0, atol=2.0 ** -23)


def test_read_wav_averages_channels_and_reads_its_own_files(tmp_path: Path) -> None:
    x = _sine(330, 0.1, 24000, amp=0.5)
    stereo = np.stack([x, -0.5 * x], axis=1).reshape(-1)  # interleaved: the mean is x / 4
    (tmp_path / "stereo24.wav").write_bytes(_riff(1, 24, 2, 24000, _pcm_bytes(stereo, 24)))
    (tmp_path / "stereo_f32.wav").write_bytes(_riff(3, 32, 2, 24000, stereo.astype("<f4").tobytes(), extensible=True))
    for name in ("stereo24.wav", "stereo_f32.wav"):
        got, sr = read_wav(tmp_path / name)
        assert sr == 24000 and got.shape == x.shape
        np.testing.assert_allclose(got, x / 4, rtol=0, atol=1e-6)
    write_wav(tmp_path / "own.wav", x, 24000)
    got, sr = read_wav(tmp_path / "own.wav")
    assert sr == 24000
    np.testing.assert_allclose(got, x, rtol=0, atol=1 / 16384)


def test_read_wav_names_what_it_cannot_read(tmp_path: Path) -> None:
    cases = {
        "mulaw.wav": (_riff(7, 8, 1, 8000, bytes(100)), "unsupported WAV encoding"),
        "float16.wav": (_riff(3, 16, 1, 8000, bytes(100)), "unsupported WAV encoding"),
        "text.wav": (b"not a wav file at all", "not a RIFF/WAVE file"),
        "nodata.wav": (_riff(1, 16, 1, 8000, b"")[:-8], "no 'data' chunk"),
    }
    for name, (content, message) in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ValueError, match=message):
            read_wav(tmp_path / name)


def test_money_with_cents_reads_as_units_and_cents() -> None:
    """wetext reads "$2.50" as "two point five dollars"; an amount with exactly two decimals
    is dollars (euros, pounds) and cents (pence), singular where one; a scaled amount, one
    of other decimals and an amount without decimals keep the grammar's reading."""
    assert normalize("It costs $19.99 today.") == "It costs nineteen dollars and ninety nine cents today."
    assert normalize("$0.99") == "ninety nine cents."
    assert normalize("$1.01") == "one dollar and one cent."
    assert normalize("$100.00") == "one hundred dollars."
    assert normalize("£3.20 or €12.05") == "three pounds and twenty pence or twelve euros and five cents."
    assert normalize("£1.01") == "one pound and one penny."
    assert normalize("from $2.50 to $3.75, or $4.00.") == (
        "from two dollars and fifty cents to three dollars and seventy five cents, or four dollars.")
    assert normalize("$5") == "five dollars."
    assert normalize("$3.50 million") == "three point five million dollars."
    assert normalize("$2.50bn") == "two point five billion dollars."
    assert normalize("€2.5") == "two point five euros."
    assert normalize("$2.505") == "two point five oh five dollars."
    # Scaled by a plural, or glued to a word: not an amount with cents (wetext's reading stays).
    assert "cents" not in normalize("$2.50 millions")
    assert "cents" not in normalize("$2.50x")
