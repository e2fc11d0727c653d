"""The CosyVoice3 speech-token language model (official `CosyVoice3LM`, inference only).

A Qwen2 backbone reads one sequence of embeddings built from two tables:

    text ids    -> llm.model.model.embed_tokens   (Qwen2's own table)
    speech ids  -> speech_embedding                (6561 codes + 200 reserved: sos, eos, task_id, fill, ...)

and `llm_decoder` maps the final hidden state to 6761 speech-vocabulary logits. The
backbone's `lm_head` is part of the checkpoint but never used.

We address both tables through the unified vocabulary (`engine.models.vocab`): ids
below 6761 are speech rows, ids from 6761 on are text rows shifted by 6761. A prompt
is therefore a plain list of ints, which both backends (and vLLM prefix caching) can use.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from engine.models.config import LMConfig
from engine.models.qwen2 import KVCache, Qwen2Encoder
from engine.models.vocab import UnifiedVocab

# `<|endofprompt|>` in the CosyVoice3 tokenizer; the official LM asserts it is present
# somewhere in prompt_text + text (hard-coded there too).
END_OF_PROMPT_ID = 151646


class CosyVoice3LM(nn.Module):
    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        hidden = cfg.qwen.hidden_size
        self.llm = Qwen2Encoder(cfg.qwen)
        self.speech_embedding = nn.Embedding(cfg.speech_vocab_size, hidden)
        self.llm_decoder = nn.Linear(hidden, cfg.speech_vocab_size, bias=False)

    @property
    def vocab(self) -> UnifiedVocab:
        return unified_vocab(self.cfg)

    def new_cache(self, rows: int = 1, length: int = 256) -> KVCache:
        return self.llm.backbone.new_cache(rows=rows, length=length)

    def embed(self, ids: Tensor) -> Tensor:
        """Unified-vocabulary ids [...] -> input embeddings [..., hidden]."""
        offset = self.cfg.speech_vocab_size
        is_speech = ids < offset
        table = self.speech_embedding.weight
        out = table.new_empty((*ids.shape, table.shape[1]))
        out[is_speech] = self.speech_embedding(ids[is_speech])
        out[~is_speech] = self.llm.backbone.embed_tokens(ids[~is_speech] - offset)
        return out

    def forward(
        self,
        ids: Tensor,  # [B, S] unified ids
        cache: KVCache | None = None,
        start_row: int = 0,
        num_new: list[int] | None = None,
    ) -> Tensor:
        """Final hidden states [B, S, hidden]; see `Qwen2Model.forward` for the cache rules."""
        return self.llm(self.embed(ids), cache, start_row, num_new)

    def speech_logits(self, hidden: Tensor) -> Tensor:
        """Hidden states [..., hidden] -> logits over the 6761-entry speech vocabulary."""
        return self.llm_decoder(hidden)


def unified_vocab(cfg: LMConfig) -> UnifiedVocab:
    return UnifiedVocab(
        speech_token_size=cfg.speech_token_size,
        speech_vocab_size=cfg.speech_vocab_size,
        text_vocab_size=cfg.qwen.vocab_size,
        extra_rows=cfg.text_offset - cfg.speech_vocab_size,
    )


def build_prompt(
    cfg: LMConfig,
    prompt_text_ids: Sequence[int],
    text_ids: Sequence[int],
    prompt_speech_tokens: Sequence[int] = (),
    require_end_of_prompt: bool = False,
) -> list[int]:
    """Unistream LM prompt in unified ids: [sos, prompt_text + text, task_id, prompt_speech].

    Text ids are raw tokenizer ids (shifted here); speech tokens are codebook ids.
    Cross-lingual / instruct modes pass no prompt speech. The official code asserts
    that `<|endofprompt|>` occurs in the text; `require_end_of_prompt=True` enforces
    the same (off by default so random-text tests and benchmarks need not add it).
    """
    text = [*prompt_text_ids, *text_ids]
    if require_end_of_prompt and END_OF_PROMPT_ID not in text:
        raise ValueError("CosyVoice3 needs <|endofprompt|> (151646) in prompt_text or text")
    if any(not 0 <= t < cfg.speech_token_size for t in prompt_speech_tokens):
        raise ValueError("prompt speech tokens must be codebook ids in [0, speech_token_size)")
    vocab = unified_vocab(cfg)
    return [cfg.sos, *vocab.text(text), cfg.task_id, *prompt_speech_tokens]


def length_limits(cfg: LMConfig, num_text_tokens: int) -> tuple[int, int]:
    """(min_tokens, max_tokens) for `num_text_tokens` of text to speak (prompt text
    excluded), as `int(n * ratio)` exactly like the official inference."""
    return (
        int(num_text_tokens * cfg.min_token_text_ratio),
        int(num_text_tokens * cfg.max_token_text_ratio),
    )


def stop_ids(cfg: LMConfig) -> list[int]:
    """Every id the LM head can emit that ends decoding: all 200 reserved ids
    (6561..6760). In unified-vocab terms: any id >= speech_token_size stops."""
    return list(range(cfg.speech_token_size, cfg.speech_vocab_size))


@torch.no_grad()
def init_random_(module: nn.Module, seed: int, std: float = 0.02) -> nn.Module:
    """Deterministic random weights for tests/benchmarks (no checkpoint available).

    Every weight and bias ~ N(0, std); norm weights ~ 1 + N(0, std) (non-trivial values
    exercise every code path). Values are drawn on the CPU with a private generator, so
    the result is the same on every device and no global RNG is touched.
    """
    gen = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        values = torch.randn(p.shape, generator=gen) * std
        if name.endswith("norm.weight"):
            values += 1.0
        p.copy_(values.to(dtype=p.dtype))
    return module
