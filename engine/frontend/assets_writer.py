"""Writes random-weight stand-ins for the frontend files of a CosyVoice3 model dir.

No real weights can be downloaded here, so tests and benchmarks run on a model dir
that has the official *layout* with synthetic contents:

* `CosyVoice-BlankEN/{vocab.json, merges.txt, tokenizer_config.json,
  generation_config.json}`: a small byte-level BPE (256 byte tokens + a few hundred
  merges learned from a short embedded English/Chinese text) whose base specials sit
  at the real ids 151643..151645, so every CosyVoice3 special lands on its real id
  (`<|endofprompt|>` = 151646, last special 151923). The real 151643-token BPE cannot
  be produced offline, so the `tiny` and full stand-ins share this vocabulary; text
  ids below 151643 therefore differ from the real model's (which is fine for random
  weights). `config.json` belongs to the model writer, not to this module.
* `speech_tokenizer_v3.onnx` and `campplus.onnx`: see `onnx_models.build_*`.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from engine.frontend import onnx_models
from engine.frontend.tokenizer import ENDOFTEXT, apply_qwen2_pipeline

TOKENIZER_SUBDIR = "CosyVoice-BlankEN"
SPEECH_TOKENIZER_FILE = "speech_tokenizer_v3.onnx"
CAMPPLUS_FILE = "campplus.onnx"

# The ids the real Qwen2 / BlankEN tokenizer gives its three added tokens.
BASE_SPECIAL_IDS: dict[str, int] = {ENDOFTEXT: 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}
NUM_MERGES = 400

# Training text for the stand-in BPE: everyday English and Chinese so that common
# words become multi-byte tokens and encodings look realistic in length.
_TRAINING_TEXT = """
The quick brown fox jumps over the lazy dog. She sells sea shells by the sea shore.
Hello, how are you today? I am fine, thank you, and you? It is a beautiful morning.
Please read the following sentence slowly and clearly, then say it again with a smile.
We are going to the market this afternoon to buy some fresh bread, milk and apples.
There is nothing either good or bad, but thinking makes it so. To be or not to be.
The weather will be sunny in the morning and cloudy in the evening, with light wind.
You are a helpful assistant. Speak happily. Speak slowly. Speak in a very soft voice.
Numbers like one, two, three, four, five, six, seven, eight, nine and ten are common.
希望你以后能够做的比我还好呦。今天天气很好，我们一起去公园散步吧。
收到好友从远方寄来的生日礼物，那份意外的惊喜与深深的祝福让我心中充满了甜蜜的快乐。
八百标兵奔北坡，北坡炮兵并排跑，炮兵怕把标兵碰，标兵怕碰炮兵炮。
请用尽可能快地语速说一句话。我们的生活越来越好，大家的笑容也越来越多了。
"""


def _train_bpe(num_merges: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Learn a deterministic byte-level BPE with Qwen2's pre-tokeniser."""
    tok = apply_qwen2_pipeline(Tokenizer(models.BPE()))
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=len(alphabet) + num_merges,
        min_frequency=1,
        initial_alphabet=alphabet,
        special_tokens=[],
        show_progress=False,
    )
    lines = [line for line in _TRAINING_TEXT.splitlines() if line.strip()]
    tok.train_from_iterator(lines, trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    vocab: dict[str, int] = model["vocab"]
    # Newer `tokenizers` serialise merges as pairs, older ones as "a b" strings.
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    return vocab, merges  # type: ignore[return-value]


def write_tokenizer_files(out_dir: Path, num_merges: int = NUM_MERGES) -> None:
    """Write a HF-Qwen2-style tokenizer directory (everything but config.json)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab, merges = _train_bpe(num_merges)
    (out_dir / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    merge_lines = ["#version: 0.2", *(f"{a} {b}" for a, b in merges)]
    (out_dir / "merges.txt").write_text("\n".join(merge_lines) + "\n", encoding="utf-8")

    added = {
        str(token_id): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for content, token_id in BASE_SPECIAL_IDS.items()
    }
    tokenizer_config = {
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": ENDOFTEXT,
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": ENDOFTEXT,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    generation_config = {
        "bos_token_id": BASE_SPECIAL_IDS[ENDOFTEXT],
        "eos_token_id": BASE_SPECIAL_IDS[ENDOFTEXT],
        "do_sample": False,
        "max_new_tokens": 2048,
    }
    (out_dir / "generation_config.json").write_text(json.dumps(generation_config, indent=2))


def write_frontend_assets(
    model_dir: Path, *, tiny: bool, seed: int = 0, speech_tokenizer_file: str = SPEECH_TOKENIZER_FILE
) -> None:
    """Write the tokenizer directory and both ONNX stand-ins into `model_dir`.

    `tiny` only shrinks the ONNX stand-ins' hidden width; the graphs keep the official
    input/output signatures either way. CosyVoice2 directories name the speech tokenizer
    `speech_tokenizer_v2.onnx` (same whisper-log-mel in, 25 Hz tokens out signature).
    """
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    write_tokenizer_files(model_dir / TOKENIZER_SUBDIR)
    onnx_models.save_model(
        onnx_models.build_speech_tokenizer_standin(seed=seed), model_dir / speech_tokenizer_file
    )
    onnx_models.save_model(
        onnx_models.build_campplus_standin(seed=seed + 1, hidden=32 if tiny else 256),
        model_dir / CAMPPLUS_FILE,
    )
