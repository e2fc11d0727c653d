"""The text side of a streamed utterance: text pieces in, LM text-token arrivals out.

`TextFeed` is what `Session.submit_stream` hands back: the producer calls
`append(text)` as words arrive (e.g. from an upstream LLM) and `close()` at the end of
the utterance; the LM backend reads `arrivals()`, one text token per item -- the
official bistream frontend also feeds its generator's text one token at a time.

Tokenization is incremental but must give the same ids as tokenizing the whole text.
Qwen2's byte-level BPE never merges across a whitespace boundary (its pre-tokenizer
splits there, the space going with the following word), so text is only tokenized up
to the last whitespace seen: "Hello wor" commits "Hello" and keeps " wor" until more
arrives. The official code tokenizes each generator item separately, which splits a
word that arrives in two pieces; holding back the open word avoids that. As in the
official bistream path, streamed text is not normalized (normalization needs whole
sentences).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable


class TextFeed:
    """Single producer, single consumer; both on the event loop."""

    def __init__(self, tokenize: Callable[[str], list[int]]) -> None:
        self._tokenize = tokenize
        self._pending = ""  # text after the last whitespace: a word that may go on
        self._queue: asyncio.Queue[int | None] = asyncio.Queue()
        self._closed = False
        self.num_tokens = 0
        self.first_text_at: float | None = None  # monotonic time of the first append

    @property
    def closed(self) -> bool:
        return self._closed

    def append(self, text: str) -> None:
        if self._closed:
            raise RuntimeError("text feed already closed")
        if not text:
            return
        if self.first_text_at is None:
            self.first_text_at = time.monotonic()
        buf = self._pending + text
        cut = max(buf.rfind(c) for c in (" ", "\n", "\t", "\r"))
        if cut <= 0 or not buf[:cut].strip():
            self._pending = buf  # no complete word yet (whitespace alone waits too)
            return
        self._pending = buf[cut:]
        self._commit(buf[:cut])

    def close(self) -> None:
        """End of this utterance's text (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._pending.strip():
            self._commit(self._pending)
        self._pending = ""
        self._queue.put_nowait(None)

    def _commit(self, piece: str) -> None:
        for tok in self._tokenize(piece):
            self.num_tokens += 1
            self._queue.put_nowait(int(tok))

    async def arrivals(self) -> AsyncIterator[list[int]]:
        """One `[token]` per text token, ending when the feed is closed."""
        while True:
            tok = await self._queue.get()
            if tok is None:
                return
            yield [tok]
