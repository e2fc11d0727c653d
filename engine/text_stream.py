"""The text side of a streamed utterance: text pieces in, LM text-token arrivals out.

`TextFeed` is what `Session.submit_stream` hands back: the producer calls
`append(text)` as words arrive (e.g. from an upstream LLM) and `close()` at the end of
the utterance; the LM backend reads `arrivals()`, one text token per item -- the
official bistream frontend also feeds its generator's text one token at a time.

Tokenization is incremental but must give the same ids as tokenizing the whole text.
Qwen2's byte-level BPE never merges across a whitespace boundary (its pre-tokenizer
splits there, the space going with the following word), so text is only tokenized up
to the last whitespace seen: "Hello wor" commits "Hello" and keeps " wor" until more
arrives (`_commit_point`: newline runs stay whole, and after punctuation they wait for
the word after them). The official code tokenizes each generator item separately, which splits a
word that arrives in two pieces; holding back the open word avoids that. As in the
official bistream path, streamed text is not normalized (normalization needs whole
sentences).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable


def _commit_point(buf: str) -> int:
    """Where ``buf`` may be cut so that its two sides tokenize as the whole does: before
    its last whitespace run (a run is one pre-token, its last space joining the next word:
    "a\n\nb" reads "a" | "\n\n" | "b"), unless that run holds a newline after punctuation,
    which takes it (".\n\n" is one pre-token): then before an earlier run. 0: nowhere."""
    end = len(buf)
    while True:
        k = max(buf.rfind(c, 0, end) for c in _WHITESPACE)
        if k < 0:
            return 0
        start = k
        while start > 0 and buf[start - 1].isspace():
            start -= 1
        run = buf[start : k + 1]
        if start > 0 and ("\n" in run or "\r" in run) and not buf[start - 1].isalnum():
            end = start
            continue
        return start


_WHITESPACE = (" ", "\n", "\t", "\r")


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

    def append(self, text: str, word_end: bool = False) -> None:
        """Add text. ``word_end``: the producer knows the text ends a word (a whitespace
        follows it, still to come), so all of it is committed now: the gateway's stream
        mode hands out words up to the whitespace after them, and without this each word
        waited for the next one (the LM a word behind the client)."""
        if self._closed:
            raise RuntimeError("text feed already closed")
        if not text:
            return
        if self.first_text_at is None:
            self.first_text_at = time.monotonic()
        buf = self._pending + text
        if word_end and buf[-1].isalnum():
            # A letter or digit run ends its pre-token whatever whitespace follows (a
            # punctuation run would take following newlines: ".\n\n" is one).
            self._pending = ""
            self._commit(buf)
            return
        cut = _commit_point(buf)
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
