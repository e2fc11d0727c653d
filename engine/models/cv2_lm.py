"""The CosyVoice2 speech-token language model (official `Qwen2LM`, inference only).

Same Qwen2 backbone and decode loop as CosyVoice3 (`engine.models.lm`); three differences
in the tables around it:

    llm_embedding     Embedding(2, hidden)       row 0 = sos, row 1 = task_id
    speech_embedding  Embedding(6564, hidden)    6561 codes + eos 6561, 6562, fill 6563
    llm_decoder       Linear(hidden, 6564)       *with* bias (CosyVoice3's has none)

In the unified vocabulary (see `CV2LMConfig`) the two `llm_embedding` rows follow the
speech rows, so a prompt is `[6564, text + 6566..., 6565, prompt speech...]` and every
other piece of the engine (torch backend, prompt building, stop ids) works unchanged.
"""

from __future__ import annotations

from torch import Tensor, nn

from engine.models.config import LMConfig
from engine.models.cv2_config import LLM_EMBEDDING_ROWS
from engine.models.lm import CosyVoice3LM
from engine.models.qwen2 import Qwen2Encoder


class Qwen2LM(CosyVoice3LM):
    """CosyVoice2 LM; offers exactly the interface of `CosyVoice3LM` (embed, forward,
    speech_logits, new_cache, vocab) that the LM backends use."""

    def __init__(self, cfg: LMConfig) -> None:
        # Skip CosyVoice3LM.__init__: its decoder has no bias and no llm_embedding exists.
        nn.Module.__init__(self)
        if cfg.text_offset != cfg.speech_vocab_size + LLM_EMBEDDING_ROWS:
            raise ValueError("Qwen2LM needs a CV2LMConfig (sos/task_id rows between speech and text)")
        self.cfg = cfg
        hidden = cfg.qwen.hidden_size
        self.llm_embedding = nn.Embedding(LLM_EMBEDDING_ROWS, hidden)
        self.llm = Qwen2Encoder(cfg.qwen)
        self.llm_decoder = nn.Linear(hidden, cfg.speech_vocab_size, bias=True)
        self.speech_embedding = nn.Embedding(cfg.speech_vocab_size, hidden)

    def embed(self, ids: Tensor) -> Tensor:
        """Unified ids [...] -> embeddings [..., hidden], routing each id to its table."""
        speech_end, text_start = self.cfg.speech_vocab_size, self.cfg.text_offset
        is_speech = ids < speech_end
        is_text = ids >= text_start
        is_prompt_row = ~is_speech & ~is_text
        table = self.speech_embedding.weight
        out = table.new_empty((*ids.shape, table.shape[1]))
        out[is_speech] = self.speech_embedding(ids[is_speech])
        out[is_prompt_row] = self.llm_embedding(ids[is_prompt_row] - speech_end)
        out[is_text] = self.llm.backbone.embed_tokens(ids[is_text] - text_start)
        return out


__all__ = ["Qwen2LM"]
