"""The unified token vocabulary shared by both LM backends.

Speech ids come first so a generated id *is* the speech token (no remapping on the
hot path); text ids follow at `text_offset`. Token-id prompts over this vocabulary
let vLLM use prefix caching and streaming input, which `prompt_embeds` prompts do not.

    [0, speech_vocab_size)                     speech_embedding rows (codebook + sos/eos/task/fill/...)
    [speech_vocab_size, text_offset)           extra prompt-only rows (CosyVoice2: llm_embedding's
                                               sos and task_id; none for CosyVoice3)
    [text_offset, text_offset + text_vocab)    Qwen2 embed_tokens rows
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class UnifiedVocab:
    speech_token_size: int  # 6561: ids below this are audio codes
    speech_vocab_size: int  # 6761 for CosyVoice3 (codebook + reserved)
    text_vocab_size: int  # 151936 (Qwen2 embed_tokens rows)
    # Rows between the speech table and the text: never generated, only used in prompts
    # (CosyVoice2 keeps sos/task_id in a separate 2-row table; CosyVoice3 has none).
    extra_rows: int = 0

    @property
    def text_offset(self) -> int:
        return self.speech_vocab_size + self.extra_rows

    @property
    def size(self) -> int:
        return self.text_offset + self.text_vocab_size

    def text(self, ids: list[int]) -> list[int]:
        off = self.text_offset
        return [off + i for i in ids]

    def is_stop(self, token: int) -> bool:
        return token >= self.speech_token_size
