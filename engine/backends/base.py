"""The one interface every speech-token LM backend implements.

A backend takes token-id prompts over the *unified vocabulary* (see
`engine.models.vocab.UnifiedVocab`) and streams back generated speech-token ids.
Backends own batching: many requests may be in flight at once and each backend
batches them however it can (the torch backend in one decode loop, vLLM through its
continuous batching). Per-request state lives in the request, never on the backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Protocol

if TYPE_CHECKING:
    from engine.backends.lm_times import LMServerTimes


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. RAS is the official CosyVoice sampler."""

    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10
    tau_r: float = 0.1
    # greedy=True takes the arg-max every step (parity checks between backends).
    greedy: bool = False
    seed: int | None = None
    min_tokens: int = 0
    max_tokens: int = 2000
    # When set, stop ids are ignored and exactly this many tokens are produced:
    # random weights never emit eos by themselves, so benchmarks fix the length.
    fixed_length: int | None = None


@dataclass(frozen=True)
class LMRequest:
    request_id: str
    prompt: tuple[int, ...]  # unified-vocabulary ids
    sampling: SamplingParams


class LMBackend(Protocol):
    """Async LM interface shared by the torch and vLLM backends. A backend that can also
    take text while it decodes is a `engine.bistream.TextInLM` as well."""

    name: str

    async def start(self) -> None:
        """Load weights / start engine threads. Idempotent."""

    def generate(self, request: LMRequest) -> AsyncIterator[int]:
        """Yield speech-token ids (< speech_token_size) as they are sampled.

        The stream ends when a stop id (any id >= speech_token_size) is sampled, or at
        max_tokens; the stop id itself is not yielded. Closing the iterator early
        (aclose / task cancel) aborts the request and frees its slot.
        """
        ...

    async def abort(self, request_id: str) -> None:
        """Abort a request now; its iterator ends without further tokens."""

    def num_active(self) -> int:
        """Requests currently holding a slot (for metrics and tests)."""
        ...

    def server_times(self) -> "LMServerTimes | None":
        """The LM server's own timings of its requests, when it keeps them (vLLM with
        `lm_timing`), else None."""
        ...

    async def close(self) -> None:
        """Abort everything and release resources."""
