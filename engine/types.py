"""Small typed values that cross the seam between gateway and engine.

Data flows one way: the gateway submits text to a `Session`, the engine answers
with `AudioChunk`s and `UtteranceEvent`s on that session's stream.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

Mode = Literal["zero_shot", "instruct", "cross_lingual"]
# Speaking rates served (`SessionOptions.speed`; the WebSocket and HTTP APIs take the same).
# Far outside it the mel stretch fails its chunk's whole batch (a 6-frame last chunk above
# ~13) or multiplies the vocoder's work (200,000 frames for 100 tokens at 0.001).
SPEED_RANGE = (0.25, 4.0)


@dataclass(frozen=True)
class VoicePrompt:
    """Everything the models need about a voice, computed once and cached.

    speech_tokens: 25 Hz speech tokens of the prompt audio (int64, [P]).
    speech_feat:   24 kHz prompt mel, [2P, 80] float32 (aligned: frames = 2 x tokens).
    embedding:     CAM++ speaker embedding, [192] float32.
    transcript:    what the prompt audio says (the zero-shot LM prompt text).
    """

    voice_id: str
    transcript: str
    speech_tokens: torch.Tensor
    speech_feat: torch.Tensor
    embedding: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.speech_tokens.numel())


@dataclass(frozen=True)
class SessionOptions:
    mode: Mode = "zero_shot"
    instruction: str | None = None
    speed: float = 1.0
    # Chunk schedule (tokens): first chunk after initial_hop (+ lookahead), then the
    # 25-token grid, doubling up to max_hop.
    initial_hop: int | None = None
    max_hop: int | None = None
    # Benchmarks: generate exactly this many speech tokens per text token (random
    # weights never stop on their own). None = the model decides (eos).
    tokens_per_text_token: float | None = None
    seed: int | None = None
    greedy: bool = False
    # A language hint (BCP-47-ish: "en", "zh-CN"): which grammar normalises the text
    # (`Engine.text_ids`); None detects it from the text.
    language: str | None = None

    def __post_init__(self) -> None:
        # Refused here, not in a stage batch where one bad utterance failed its batch-mates.
        if not (math.isfinite(self.speed) and SPEED_RANGE[0] <= self.speed <= SPEED_RANGE[1]):
            raise ValueError(f"speed must be a number in [{SPEED_RANGE[0]}, {SPEED_RANGE[1]}], not {self.speed}")
        if self.initial_hop is not None and self.initial_hop < 0:
            raise ValueError(f"initial_hop must be >= 0, not {self.initial_hop}")
        if self.max_hop is not None and (self.max_hop < 25 or self.max_hop % 25):
            raise ValueError(f"max_hop must be a multiple of 25 tokens, at least 25, not {self.max_hop}")


@dataclass(frozen=True)
class AudioChunk:
    """24 kHz mono float32 PCM of one utterance, in order."""

    utterance_id: str
    pcm: np.ndarray  # float32, [-1, 1]
    start_sample: int  # offset of pcm[0] within the utterance
    is_last: bool
    chunk_index: int = 0


@dataclass(frozen=True)
class UtteranceError:
    utterance_id: str
    code: str
    message: str


@dataclass
class UtteranceStats:
    """Timings of one utterance, filled in as it runs (monotonic seconds)."""

    submitted_at: float = 0.0
    first_token_at: float | None = None
    first_audio_at: float | None = None
    finished_at: float | None = None
    num_speech_tokens: int = 0
    # The text tokens the LM read for it (normalised; 0 for text-in streaming).
    num_text_tokens: int = 0
    num_samples: int = 0
    chunks: int = 0
    # The speech tokens the utterance was voiced from (after silence capping).
    speech_tokens: tuple[int, ...] = ()
    extra: dict[str, float] = field(default_factory=dict)
