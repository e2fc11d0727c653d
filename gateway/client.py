"""A small async client for the streaming WebSocket endpoint (docs/protocol.md).

    async with await GatewayClient.connect("ws://localhost:8080/v1/tts/stream") as gw:
        await gw.configure(voice="alice", format="pcm_s16le", sample_rate=16000)
        ctx = gw.context("turn-1")
        for token in llm_tokens:
            await ctx.send_text(token)
        await ctx.end()
        async for item in ctx.stream():        # bytes (audio) or dict (events)
            ...

One background task reads the socket and routes every frame to its context's queue,
so several contexts can be consumed concurrently (e.g. one per agent turn).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from typing import Any, AsyncIterator

import websockets

_END = object()


class GatewayError(RuntimeError):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


# A `text` message's flags that act after its text is appended: they go with its last part.
_AFTER_TEXT = ("flush", "end")


def text_messages(message: dict[str, Any], limit: int | None) -> list[dict[str, Any]]:
    """A `text` message as one or more whose frames (`json.dumps`, ASCII) are at most `limit`
    bytes each; their texts concatenate to its text (text is appended verbatim, so a cut
    inside a word is harmless). The open overrides (voice, format, ...) go with the first
    part, `flush` and `end` with the last."""
    if limit is None or len(json.dumps(message)) <= limit:
        return [message]
    text = message["text"]
    first = {k: v for k, v in message.items() if k not in _AFTER_TEXT} | {"text": ""}
    last = {k: message[k] for k in _AFTER_TEXT if k in message}
    parts: list[dict[str, Any]] = []
    start, head = 0, first
    while start < len(text):
        # Room for the text once the other fields and the last part's flags are in.
        room = limit - len(json.dumps(head | last))
        end, used = start, 0
        while end < len(text):
            cost = len(json.dumps(text[end])) - 2  # the character as the frame spells it
            if used + cost > room:
                break
            used, end = used + cost, end + 1
        if end == start:
            raise ValueError(f"a text frame of at most {limit} bytes has no room for text")
        parts.append(head | {"text": text[start:end]})
        start, head = end, {"type": "text", "context_id": message["context_id"], "text": ""}
    parts[-1] |= last
    return parts


class Context:
    """One turn on the socket: send text, then read its audio and events in order."""

    def __init__(self, client: "GatewayClient", context_id: str) -> None:
        self.client = client
        self.context_id = context_id
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self.events: list[dict[str, Any]] = []
        self.finished = False

    async def send_text(self, text: str, **overrides: Any) -> None:
        """Append `text`; a piece too large for one frame (the server's `max_message_bytes`)
        goes as several, since the server drops an oversized frame's text whole."""
        message = {"type": "text", "context_id": self.context_id, "text": text, **overrides}
        for part in text_messages(message, self.client.max_message_bytes):
            await self.client.send(part)

    async def flush(self) -> None:
        await self.client.send({"type": "flush", "context_id": self.context_id})

    async def end(self) -> None:
        await self.client.send({"type": "end", "context_id": self.context_id})

    async def cancel(self) -> None:
        await self.client.send({"type": "cancel", "context_id": self.context_id})

    async def stream(self) -> AsyncIterator[bytes | dict[str, Any]]:
        """Audio payloads (bytes) and events (dicts) until done / cancelled / a final error
        (the server refused or ended the context) / socket end."""
        while True:
            item = await self._queue.get()
            if item is _END:
                return
            yield item

    async def collect_audio(self) -> bytes:
        """Every audio byte of the context (after `end`); raises on an error event."""
        parts: list[bytes] = []
        async for item in self.stream():
            if isinstance(item, bytes):
                parts.append(item)
            elif item.get("type") == "error":
                raise GatewayError(item.get("code", ""), item.get("message", ""))
        return b"".join(parts)

    def _deliver(self, item: Any) -> None:
        if isinstance(item, dict):
            self.events.append(item)
        self._queue.put_nowait(item)
        if isinstance(item, dict) and (item.get("type") in ("done", "cancelled")
                                       or (item.get("type") == "error" and item.get("final"))):
            self.finished = True
            self._queue.put_nowait(_END)


class GatewayClient:
    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.session: dict[str, Any] = {}
        self.events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()  # events without a context
        self._contexts: dict[str, Context] = {}
        self._started = asyncio.Event()
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def connect(cls, url: str, api_key: str | None = None, **kwargs: Any) -> "GatewayClient":
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        ws = await websockets.connect(url, additional_headers=headers, max_size=None, **kwargs)
        client = cls(ws)
        await asyncio.wait_for(client._started.wait(), timeout=30)
        return client

    async def __aenter__(self) -> "GatewayClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    @property
    def max_message_bytes(self) -> int | None:
        """The server's frame limit (`session_started`'s limits); None before it said."""
        limit = self.session.get("limits", {}).get("max_message_bytes")
        return limit if isinstance(limit, int) else None

    async def send(self, message: dict[str, Any]) -> None:
        await self.ws.send(json.dumps(message))

    async def configure(self, **settings: Any) -> None:
        await self.send({"type": "config", **settings})

    @property
    def connected(self) -> bool:
        """False once the socket closed (by either side): no context can start then."""
        return not self._reader.done()

    def context(self, context_id: str) -> Context:
        """A handle for ``context_id`` (opened on the server by its first text)."""
        if not self.connected:
            raise ConnectionError("the gateway connection is closed")
        ctx = Context(self, context_id)
        self._contexts[context_id] = ctx
        return ctx

    async def open(self, context_id: str, **settings: Any) -> Context:
        ctx = self.context(context_id)
        await self.send({"type": "open", "context_id": context_id, **settings})
        return ctx

    async def cancel_all(self) -> None:
        await self.send({"type": "cancel"})

    async def aclose(self) -> None:
        with contextlib.suppress(Exception):
            await self.ws.close()
        self._reader.cancel()
        with contextlib.suppress(BaseException):
            await self._reader

    async def _read(self) -> None:
        try:
            async for msg in self.ws:
                if isinstance(msg, bytes):
                    n = msg[0]
                    ctx = self._contexts.get(msg[1 : 1 + n].decode("utf-8"))
                    if ctx is not None:
                        ctx._deliver(msg[1 + n :])
                    continue
                ev = json.loads(msg)
                if ev.get("type") == "session_started":
                    self.session = ev
                    self._started.set()
                    continue
                cid = ev.get("context_id", "")
                ctx = self._contexts.get(cid)
                if ctx is None:
                    self.events.put_nowait(ev)
                elif ev.get("type") == "audio":
                    ctx._deliver(base64.b64decode(ev["data"]))
                else:
                    ctx._deliver(ev)
                    if ctx.finished:  # its id may be opened again; a long-lived client keeps no handles
                        del self._contexts[cid]
        except websockets.ConnectionClosed:
            pass
        finally:
            self._started.set()
            for ctx in self._contexts.values():
                if not ctx.finished:
                    ctx._queue.put_nowait(_END)
