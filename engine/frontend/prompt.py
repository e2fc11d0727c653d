"""Voice-prompt featurisation and the per-mode LM text prompts of CosyVoice3.

`PromptFeaturizer.featurize` turns prompt audio into what the models need, once per
voice (the official `frontend_zero_shot` minus the text): 25 Hz speech tokens from
the 16 kHz whisper log-mel, the 24 kHz prompt mel for the flow, and the CAM++
x-vector from the 16 kHz kaldi fbank. Tokens and mel frames are then cut so that
mel frames == 2 x tokens (the flow's token_mel_ratio).

`build_lm_text` gives the text part of the LM input for each mode as two id lists
(text ids, not unified ids): the LM input is
`[sos] + prompt_ids + text_ids + [task_id] (+ prompt speech tokens in zero_shot)`.
Exact strings follow the official `example.py` / `instruct_list`:

* zero_shot:     prompt = "You are a helpful assistant.<|endofprompt|>" + transcript
* instruct:      prompt = "You are a helpful assistant. <instruction><|endofprompt|>",
                 no prompt speech tokens in the LM
* cross_lingual: the official code puts "You are a helpful assistant.<|endofprompt|>"
                 in front of the text and drops the LM prompt; we return that prefix as
                 `prompt_ids` instead. `<|endofprompt|>` is a special token that splits
                 BPE, so prompt_ids + text_ids equals the official encoding exactly,
                 and text_ids stay the user's text alone (handy for streamed text).

CosyVoice2 (`version="cosyvoice2"`) has no system prefix (official example.py /
frontend for CosyVoice2):

* zero_shot:     prompt = transcript
* instruct:      prompt = "<instruction><|endofprompt|>" (instruct2), no prompt speech
* cross_lingual: no prompt text and no prompt speech
"""

from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from engine.frontend.features import prompt_mel, resample, speaker_fbank, whisper_log_mel
from engine.frontend.onnx_models import SpeakerEncoder, SpeechTokenizer
from engine.frontend.tokenizer import ENDOFPROMPT, SYSTEM_PROMPT, TextTokenizer, normalize_instruction
from engine.models.config import MelConfig
from engine.types import Mode

TOKENIZER_SAMPLE_RATE = 16000
MAX_PROMPT_SECONDS = 30.0  # the speech tokenizer's limit in the official frontend
MIN_INPUT_SAMPLE_RATE = 16000  # official load_wav refuses lower rates
TOKEN_MEL_RATIO = 2

ZERO_SHOT_PREFIX = f"{SYSTEM_PROMPT}{ENDOFPROMPT}"
# The system sentence as a sentence of its own (not "You are a helpful assistant who ...").
_SYSTEM_SENTENCE = re.compile(r"^\s*you are a helpful assistant\s*(?:[.。]|$)\s*", re.IGNORECASE)


class PromptFeatures(NamedTuple):
    speech_tokens: torch.Tensor  # [P] int64, 25 Hz
    speech_feat: torch.Tensor  # [2P, 80] float32, 50 Hz prompt mel
    embedding: torch.Tensor  # [192] float32 CAM++ x-vector


# Bumped when this code computes a voice's features differently, so that features stored
# by an older build are computed again (`PromptFeaturizer.fingerprint`). 2: prompts are
# resampled as the official frontend does (windowed sinc), not with soxr.
FEATURES_REVISION = 2


# Bytes read from each end of a network's file for its record: a re-exported or fine-tuned
# network of the same architecture has the same size but other weights throughout.
RECORD_SPAN = 16 << 20


def file_record(path: Path) -> str:
    """name:size:digest of a network's file, the digest over its first and last
    `RECORD_SPAN` bytes (the whole of a small file): ~30 ms for the 1 GB speech tokenizer,
    where hashing it all took seconds at every start."""
    size = path.stat().st_size
    h = hashlib.blake2b(digest_size=8)
    with open(path, "rb") as f:
        h.update(f.read(RECORD_SPAN))
        if size > 2 * RECORD_SPAN:
            f.seek(size - RECORD_SPAN)
        h.update(f.read(RECORD_SPAN))
    return f"{path.name}:{size}:{h.hexdigest()}"


class PromptFeaturizer:
    """Prompt audio -> (speech tokens, prompt mel, speaker embedding). Stateless per call."""

    def __init__(self, tokenizer: SpeechTokenizer, speaker: SpeakerEncoder, mel_cfg: MelConfig) -> None:
        self.tokenizer = tokenizer
        self.speaker = speaker
        self.mel_cfg = mel_cfg

    @functools.cached_property
    def fingerprint(self) -> str:
        """What the features depend on: this code's revision, the two networks' files and
        the mel's settings. A voice stored with another fingerprint (another model, or an
        older build) is featurised again from its audio (`gateway.voices`)."""
        files = ",".join(file_record(m.path) for m in (self.tokenizer, self.speaker))
        cfg = self.mel_cfg
        mel = f"{cfg.sampling_rate}/{cfg.n_fft}/{cfg.hop_size}/{cfg.win_size}/{cfg.num_mels}/{cfg.fmin}/{cfg.fmax}"
        return f"r{FEATURES_REVISION};{files};mel {mel}"

    def featurize(self, wav: np.ndarray, sample_rate: int) -> PromptFeatures:
        """wav: mono float32 in [-1, 1] (a [C, N] array is averaged to mono)."""
        audio = np.asarray(wav, dtype=np.float32)
        if audio.ndim == 2:
            audio = audio.mean(axis=0)
        if audio.ndim != 1 or audio.size == 0:
            raise ValueError(f"expected non-empty mono audio, got shape {np.shape(wav)}")
        if sample_rate < MIN_INPUT_SAMPLE_RATE:
            raise ValueError(f"prompt sample rate {sample_rate} is below {MIN_INPUT_SAMPLE_RATE} Hz")
        if audio.size / sample_rate > MAX_PROMPT_SECONDS:
            raise ValueError(f"prompt audio longer than {MAX_PROMPT_SECONDS:.0f} s")

        wav16k = resample(audio, sample_rate, TOKENIZER_SAMPLE_RATE)
        wav_mel = resample(audio, sample_rate, self.mel_cfg.sampling_rate)

        tokens = self.tokenizer(whisper_log_mel(wav16k).numpy())
        feat = prompt_mel(wav_mel, self.mel_cfg)
        embedding = self.speaker(speaker_fbank(wav16k).numpy())

        # Force feat frames == 2 x tokens (both sides may be a frame or two long).
        n_tokens = min(feat.shape[0] // TOKEN_MEL_RATIO, int(tokens.shape[0]))
        if n_tokens == 0:
            raise ValueError("prompt audio too short to give a single speech token")
        return PromptFeatures(
            speech_tokens=torch.from_numpy(tokens[:n_tokens].astype(np.int64)),
            speech_feat=feat[: TOKEN_MEL_RATIO * n_tokens].contiguous(),
            embedding=torch.from_numpy(np.asarray(embedding, dtype=np.float32)),
        )


# --- LM text prompts ------------------------------------------------------------------


@dataclass(frozen=True)
class LMTextPrompt:
    """Text ids (Qwen2 ids, not unified) of one request's LM prompt."""

    prompt_ids: tuple[int, ...]  # system / instruction / transcript part, ends after <|endofprompt|> (+ transcript)
    text_ids: tuple[int, ...]  # the text to synthesise
    use_prompt_speech: bool  # whether the LM input ends with the prompt speech tokens


def zero_shot_prompt_text(transcript: str) -> str:
    """The CosyVoice3 zero-shot prompt text; a transcript already carrying the
    `<|endofprompt|>` system part is used as is."""
    if ENDOFPROMPT in transcript:
        return transcript
    return ZERO_SHOT_PREFIX + transcript


def cv2_instruction(instruction: str) -> str:
    """A user instruction in CosyVoice2's instruct2 form: `"<instruction><|endofprompt|>"`.
    A leading CosyVoice3-style system sentence and anything after an embedded marker go."""
    body = instruction.split(ENDOFPROMPT, 1)[0]
    body = _SYSTEM_SENTENCE.sub("", body, count=1).strip()
    if not body:
        raise ValueError("empty instruction")
    return body + ENDOFPROMPT


def lm_prompt_text(
    mode: Mode, transcript: str | None = None, instruction: str | None = None, version: str = "cosyvoice3"
) -> str:
    """The prompt string (before tokenisation) for a mode and model version."""
    if version == "cosyvoice2":
        return _cv2_prompt_text(mode, transcript, instruction)
    if mode == "zero_shot":
        if transcript is None:
            raise ValueError("zero_shot needs the prompt transcript")
        return zero_shot_prompt_text(transcript)
    if mode == "instruct":
        if not instruction:
            raise ValueError("instruct needs an instruction")
        return normalize_instruction(instruction)
    if mode == "cross_lingual":
        return ZERO_SHOT_PREFIX
    raise ValueError(f"unknown mode {mode!r}")


def _cv2_prompt_text(mode: Mode, transcript: str | None, instruction: str | None) -> str:
    if mode == "zero_shot":
        if transcript is None:
            raise ValueError("zero_shot needs the prompt transcript")
        return transcript
    if mode == "instruct":
        if not instruction:
            raise ValueError("instruct needs an instruction")
        return cv2_instruction(instruction)
    if mode == "cross_lingual":
        return ""
    raise ValueError(f"unknown mode {mode!r}")


def build_lm_text(
    tokenizer: TextTokenizer,
    mode: Mode,
    text: str,
    *,
    transcript: str | None = None,
    instruction: str | None = None,
    version: str = "cosyvoice3",
) -> LMTextPrompt:
    """Tokenise the LM text prompt of one request. `text` should already be
    normalised (`engine.frontend.text.normalize`); the prompt part never is, as in
    the official code (it contains `<|endofprompt|>`)."""
    prompt = lm_prompt_text(mode, transcript, instruction, version)
    prompt_ids = tuple(tokenizer.encode(prompt))
    if version != "cosyvoice2" and tokenizer.endofprompt_id not in prompt_ids:
        # CosyVoice3's LM asserts the marker is present; fail here with a clear message.
        raise ValueError("CosyVoice3 prompt lacks <|endofprompt|>")
    return LMTextPrompt(
        prompt_ids=prompt_ids,
        text_ids=tuple(tokenizer.encode(text)),
        use_prompt_speech=mode == "zero_shot",
    )
