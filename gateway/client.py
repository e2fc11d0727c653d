"""A small async client for the streaming WebSocket endpoint (docs/protocol.md).

    async with await GatewayClient.connect("ws://localhost:8080/v1/tts/stream") as gw:
        await gw.configure(voice="alice", format="pcm_s16le", sample_rate=16000)
        ctx = gw.context("turn-1")
        for token in llm_tokens:
            await ctx.send_text(token)
        await ctx.end()
        async for item in ctx.stream():        # bytes (audio) or dict (events)
            ...

One background task reads the socket and routes every frame to its context's buffer,
so several contexts can be consumed concurrently (e.g. one per agent turn).

Every context ends with exactly one terminal event in its stream: `done`, `cancelled`,
or an `error` with `"final": true` (refused or ended by the server, or code
`connection_closed` when the socket closed first). `collect_audio()` raises
`GatewayError` on an error event, so a lost connection is never mistaken for a
complete turn.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import re
from collections import deque
from typing import Any, AsyncIterator

import websockets
from websockets.exceptions import InvalidURI
from websockets.uri import parse_uri

_END = object()

# The server's rule for context ids (gateway.protocol._CONTEXT_ID). Checked here because the
# server answers a bad id with an error naming a shortened copy of it, which no handle would
# ever receive: the caller would wait forever.
_CONTEXT_ID = re.compile(r"[A-Za-z0-9_.:\-]{1,64}")

# Unread bytes one context may hold before the reader stops reading the socket. Then the
# server's own backpressure applies (its queue fills, synthesis waits, and a client that
# stays stalled for `max_lag_s` is closed with 4001). Large, so that a real-time player
# of a long turn (which always reads behind the engine) is not taken for a stalled one:
# 32 MiB is ~11 minutes of 24 kHz pcm_s16le, ~70 minutes of ulaw_8000.
DEFAULT_MAX_BUFFERED_BYTES = 32 << 20
# Socket-level events (`keepalive`, `stats`, errors without a context) kept for `events`;
# the oldest are dropped beyond this, so a client that never reads them does not grow.
DEFAULT_MAX_EVENTS = 1000

CONNECTION_CLOSED = "connection_closed"


class GatewayError(RuntimeError):
    """An error from the gateway (its `code` and `message`), or `connection_closed`
    (`close_code` then says how the socket closed)."""

    def __init__(self, code: str, message: str, close_code: int | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.close_code = close_code


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


def _is_terminal(event: dict[str, Any]) -> bool:
    kind = event.get("type")
    return kind in ("done", "cancelled") or (kind == "error" and bool(event.get("final")))


class Context:
    """One turn on the socket: send text, then read its audio and events in order.

    A handle is made by `GatewayClient.context()`. Once it is over for sending (after
    `end()`, `cancel()`, or its terminal event), `send_text` and `flush` raise
    `GatewayError`: on the server the id may already be free, and more text would open a
    new context there with the socket's default settings.
    """

    def __init__(self, client: "GatewayClient", context_id: str,
                 max_buffered_bytes: int | None = DEFAULT_MAX_BUFFERED_BYTES) -> None:
        self.client = client
        self.context_id = context_id
        self.events: list[dict[str, Any]] = []
        self.finished = False  # its terminal event was received: nothing more comes
        self.error: dict[str, Any] | None = None  # the final error event, if it ended with one
        self._terminal: dict[str, Any] | None = None
        self._items: deque[tuple[Any, int]] = deque()  # (bytes | event | _END, cost in bytes)
        self._buffered = 0
        # At least one byte: with 0 the reader would wait for room before the first frame.
        self._limit = None if max_buffered_bytes is None else max(max_buffered_bytes, 1)
        self._stream_over = False
        self._readable = asyncio.Event()
        self._writable = asyncio.Event()
        self._writable.set()
        # Set once the server's frames for this id are this handle's: at once, or when the
        # id's earlier handle is over (see GatewayClient.context).
        self._live = asyncio.Event()
        self._ended = False  # `end` sent
        self._cancelled = False  # `cancel()` called
        self._cancels_pending = 0  # `cancel` messages whose `cancelled` has not come back
        self._sent = 0  # messages sent for this handle

    @property
    def cancelled(self) -> bool:
        """True once `cancel()` was called (its audio is dropped from then on)."""
        return self._cancelled

    # -- sending ---------------------------------------------------------------------------

    async def send_text(self, text: str, **overrides: Any) -> None:
        """Append `text`; a piece too large for one frame (the server's `max_message_bytes`)
        goes as several, since the server drops an oversized frame's text whole.
        `end=True` / `flush=True` act as `end()` / `flush()` after the text."""
        self._check_open()
        message = {"type": "text", "context_id": self.context_id, "text": text, **overrides}
        parts = text_messages(message, self.client.max_message_bytes)
        for i, part in enumerate(parts):
            if i:
                # A refusal or a cancel() may have come while the earlier parts went: the
                # rest would open a context with the socket's defaults that nobody reads.
                self._check_over()
            if part.get("end"):
                self._ended = True
            await self._send(part)

    async def flush(self) -> None:
        self._check_open()
        await self._send({"type": "flush", "context_id": self.context_id})

    async def end(self) -> None:
        """No more text: the rest is spoken, then `done` ends the stream. Calling it again
        does nothing."""
        self._check_over()
        if self._ended:
            return
        self._ended = True
        if self._sent == 0:
            # The server refuses a bare `end` for an id it never opened (`unknown context`):
            # an empty text opens the context and ends it, so a turn without text is `done`.
            await self._send({"type": "text", "context_id": self.context_id, "text": "", "end": True})
            return
        await self._send({"type": "end", "context_id": self.context_id})

    async def cancel(self) -> None:
        """Barge-in: stop the context now. Audio not yet read from `stream()` is dropped, and
        so is audio still on its way; the stream ends with `cancelled`. Once the context is
        over (its terminal event came) only its unread audio is dropped: nothing is sent (its
        id may belong to a newer handle on the server by then), and the stream ends with the
        terminal event it had."""
        if self._cancelled:
            return
        if self.finished:
            # A real-time player reads far behind the engine: the turn's `done` is here long
            # before its audio was played, and a barge-in must still silence the rest.
            self._drop_audio()
            return
        self._cancelled = True
        self._drop_audio()
        if not self._live.is_set():
            # Still waiting for the id's earlier context to end: it never reached the server.
            self.client._withdraw(self)
            return
        self._cancels_pending += 1
        with contextlib.suppress(websockets.ConnectionClosed):  # a closed socket ends the handle anyway
            await self.client.send({"type": "cancel", "context_id": self.context_id})

    def _check_over(self) -> None:
        """Raise if the context failed or was cancelled: nothing more may go for it."""
        if self.error is not None:
            raise GatewayError(str(self.error.get("code", "")), str(self.error.get("message", "")),
                               self.error.get("close_code"))
        if self._cancelled or (self._terminal is not None and self._terminal.get("type") == "cancelled"):
            raise GatewayError("context_cancelled", f"context {self.context_id!r} was cancelled")

    def _check_open(self) -> None:
        """Raise unless more text may go for this context."""
        self._check_over()
        if self._ended or self.finished:
            raise GatewayError("context_ended", f"context {self.context_id!r} was ended; use a new context")

    async def _send(self, message: dict[str, Any]) -> None:
        if not self._live.is_set():
            # The id's earlier context is not over on the server yet: this message would join it.
            await self._live.wait()
            self._check_over()
        self._sent += 1
        await self.client.send(message)

    # -- receiving -------------------------------------------------------------------------

    async def stream(self) -> AsyncIterator[bytes | dict[str, Any]]:
        """Audio payloads (bytes) and events (dicts), ending after the terminal event: done,
        cancelled, or a final error (refused or ended by the server, or `connection_closed`)."""
        while True:
            while not self._items:
                if self._stream_over:
                    return
                self._readable.clear()
                await self._readable.wait()
            item, cost = self._items.popleft()
            self._buffered -= cost
            if self._limit is None or self._buffered < self._limit:
                self._writable.set()
            if item is _END:
                self._stream_over = True
                return
            yield item

    async def collect_audio(self) -> bytes:
        """Every audio byte of the context (after `end`); raises GatewayError on an error event
        (a refusal, a failed segment, or the connection closing before `done`)."""
        parts: list[bytes] = []
        async for item in self.stream():
            if isinstance(item, bytes):
                parts.append(item)
            elif item.get("type") == "error":
                raise GatewayError(str(item.get("code", "")), str(item.get("message", "")), item.get("close_code"))
        return b"".join(parts)

    def _append(self, item: Any, cost: int) -> None:
        self._items.append((item, cost))
        self._buffered += cost
        self._readable.set()

    async def _put(self, item: bytes | dict[str, Any], cost: int) -> None:
        """Called by the reader: waits while the buffer is full, so that the socket is not
        read (and the server holds back) until the consumer catches up."""
        # Not when a later handle of the id waits for this context's end: its sender waits
        # too, and a reader stopped here would never read that end.
        while (self._limit is not None and self._buffered >= self._limit
               and not self._cancelled and not self.finished and not self.client._has_successor(self)):
            self._writable.clear()
            await self._writable.wait()
        if isinstance(item, bytes):
            if self._cancelled or self.finished:
                return  # audio of a cancelled context is not wanted
        else:
            self.events.append(item)
        self._append(item, cost)

    def _finish(self, terminal: dict[str, Any], deliver: bool = False) -> None:
        """The terminal event was received (and queued, unless `deliver`): end the stream."""
        if self.finished:
            return
        if deliver:
            self.events.append(terminal)
            self._append(terminal, 0)
        self.finished = True
        self._terminal = terminal
        if terminal.get("type") == "error":
            self.error = terminal
        self._append(_END, 0)
        self._live.set()  # a send waiting for its turn raises now
        self._writable.set()

    def _drop_audio(self) -> None:
        kept = deque((item, cost) for item, cost in self._items if not isinstance(item, bytes))
        self._items = kept
        self._buffered = sum(cost for _, cost in kept)
        self._writable.set()


class GatewayClient:
    """One socket to the gateway. Use `connect()`.

    `events` holds the socket-level events (`keepalive`, `stats`, errors without a
    context, events of ids without a handle), at most `max_events` (the oldest are
    dropped, counted in `events_dropped`); once the socket closes, its last item is an
    `error` event with code `connection_closed` and the `close_code`.
    """

    def __init__(self, ws: Any, *, max_buffered_bytes: int | None = DEFAULT_MAX_BUFFERED_BYTES,
                 max_events: int | None = DEFAULT_MAX_EVENTS) -> None:
        self.ws = ws
        self.session: dict[str, Any] = {}
        self.max_buffered_bytes = max_buffered_bytes
        self.events: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize=max_events or 0)
        self.events_dropped = 0
        # Per context id, the handles in the order the server serves them: the first is the
        # one its frames belong to; the others wait for it to be over (an id reused while its
        # earlier context is still ending).
        self._contexts: dict[str, list[Context]] = {}
        self._refusal: dict[str, Any] | None = None  # an error before session_started
        self.reader_error: Exception | None = None  # why the reader stopped, if not the socket
        self._tasks: set[asyncio.Task[Any]] = set()
        self._started = asyncio.Event()
        self._reader = asyncio.create_task(self._read())
        # A done callback rather than the reader's `finally`: registered first, it runs before
        # any callback a user adds later (e.g. a bridge reporting the lost socket), and also
        # when the reader was cancelled before it started.
        self._reader.add_done_callback(self._closed)

    @classmethod
    async def connect(cls, url: str, api_key: str | None = None, *, open_timeout_s: float = 30.0,
                      max_buffered_bytes: int | None = DEFAULT_MAX_BUFFERED_BYTES,
                      max_events: int | None = DEFAULT_MAX_EVENTS, **kwargs: Any) -> "GatewayClient":
        """Connect and wait for `session_started`. A gateway that refuses the session (bad
        credentials: 1008 `unauthorized`; loading or full: 1013 `not_ready` /
        `too_many_sessions`) raises GatewayError with its code; network failures raise
        OSError / websockets exceptions as `websockets.connect` does."""
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        try:
            parse_uri(url)
        except ValueError as exc:  # urllib's, for a bad port or IPv6 host: websockets lets it through
            raise InvalidURI(url, str(exc)) from None
        ws = await websockets.connect(url, additional_headers=headers, max_size=None, **kwargs)
        client = cls(ws, max_buffered_bytes=max_buffered_bytes, max_events=max_events)
        try:
            await asyncio.wait_for(client._started.wait(), timeout=open_timeout_s)
        except BaseException:
            await client.aclose()
            raise
        if not client.session:
            await client.aclose()
            refusal = client._refusal or {}
            raise GatewayError(str(refusal.get("code", CONNECTION_CLOSED)),
                               str(refusal.get("message", "the gateway closed the connection before the session started")),
                               client.close_code)
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

    @property
    def close_code(self) -> int | None:
        """The WebSocket close code once the socket closed (1006: dropped without one)."""
        return self.ws.close_code

    @property
    def close_reason(self) -> str:
        return str(getattr(self.ws, "close_reason", "") or "")

    async def send(self, message: dict[str, Any]) -> None:
        """Send one protocol message; GatewayError `connection_closed` once the socket closed."""
        try:
            await self.ws.send(json.dumps(message))
        except websockets.ConnectionClosed as exc:
            raise self._closed_error() from exc

    def _closed_error(self) -> GatewayError:
        return GatewayError(CONNECTION_CLOSED, "the gateway connection is closed", self.close_code)

    async def configure(self, **settings: Any) -> None:
        await self.send({"type": "config", **settings})

    @property
    def connected(self) -> bool:
        """False once the socket closed (by either side): no context can start then."""
        return not self._reader.done()

    def context(self, context_id: str) -> Context:
        """A handle for ``context_id`` (opened on the server by its first text).

        An id may be used again once its earlier handle was ended or cancelled (e.g.
        ``await ctx.cancel(); ctx = gw.context("agent")``): the new handle's messages
        then wait until the server has finished the old context (its `cancelled` or
        `done`), so none of them can land in it. Raises ValueError for an id the server
        would refuse, or one whose earlier handle is still open (neither ended nor
        cancelled)."""
        if not isinstance(context_id, str) or not _CONTEXT_ID.fullmatch(context_id):
            raise ValueError(f"context id {context_id!r}: must be 1..64 characters of [A-Za-z0-9_.:-]")
        if not self.connected:
            raise self._closed_error()
        line = self._contexts.get(context_id, [])
        if any(not h.finished and not h._ended and not h._cancelled for h in line):
            raise ValueError(f"context {context_id!r} is still open: end() or cancel() it before using "
                             f"its id again, or use a new id")
        ctx = Context(self, context_id, self.max_buffered_bytes)
        if not line:
            ctx._live.set()
        for earlier in line:
            earlier._writable.set()  # a reader held on a full earlier handle reads on (`_put`)
        self._contexts.setdefault(context_id, []).append(ctx)
        return ctx

    def _has_successor(self, ctx: Context) -> bool:
        """Whether a later handle of `ctx`'s id waits for `ctx`'s context to end."""
        line = self._contexts.get(ctx.context_id, [])
        return ctx in line and line[-1] is not ctx

    async def open(self, context_id: str, **settings: Any) -> Context:
        ctx = self.context(context_id)
        await ctx._send({"type": "open", "context_id": context_id, **settings})
        return ctx

    async def cancel_all(self) -> None:
        """Cancel every context of this client, then any other on the socket."""
        for line in list(self._contexts.values()):
            for ctx in list(line):
                await ctx.cancel()
        with contextlib.suppress(websockets.ConnectionClosed):
            await self.send({"type": "cancel"})

    async def aclose(self) -> None:
        with contextlib.suppress(Exception):
            await self.ws.close()
        self._reader.cancel()
        # `wait`, not `await`: the reader's end is no error of ours, but our own
        # cancellation (Ctrl-C) must still propagate.
        await asyncio.wait({self._reader})

    # -- routing ---------------------------------------------------------------------------

    def _post_event(self, event: dict[str, Any]) -> None:
        if self.events.full():
            self.events.get_nowait()
            self.events_dropped += 1
        self.events.put_nowait(event)

    def _withdraw(self, ctx: Context) -> None:
        """A handle cancelled while waiting behind the id's earlier one: over at once."""
        line = self._contexts.get(ctx.context_id, [])
        if ctx in line:
            line.remove(ctx)
        ctx._finish({"type": "cancelled", "context_id": ctx.context_id, "active": False, "audio_samples": 0,
                     "text_end": 0, "segments_started": 0}, deliver=True)

    def _retire(self, context_id: str) -> None:
        """Drop the finished handles at the head of the id's line (each only once no
        `cancelled` it asked for is still to come); the next handle's messages may go now."""
        line = self._contexts.get(context_id)
        while line and line[0].finished and line[0]._cancels_pending == 0:
            line.pop(0)
            if line:
                line[0]._live.set()
        if not line:
            self._contexts.pop(context_id, None)

    async def _route(self, context_id: str, item: bytes | dict[str, Any], cost: int) -> None:
        line = self._contexts.get(context_id)
        if not line:
            if isinstance(item, dict):
                self._post_event(item)
            return  # audio of a context without a handle has no reader
        head = line[0]
        if isinstance(item, bytes):
            await head._put(item, cost)  # dropped there once cancelled or finished
            return
        if item.get("type") == "cancelled" and head._cancels_pending > 0:
            head._cancels_pending -= 1
            if head.finished:  # the answer to a cancel of a context that had ended meanwhile
                self._retire(context_id)
                return
        elif head.finished:
            return  # frames of a context its handle cleaned up (see below)
        await head._put(item, cost)
        if _is_terminal(item):
            head._finish(item)
            if item.get("type") == "error" and head._sent > 1 and head._cancels_pending == 0:
                # Refused (or ended) while more of its messages were on the way: a later text
                # may have opened a fresh context with the default settings. Cancel that one;
                # a new handle for the id waits for the answer.
                head._cancels_pending += 1
                self._spawn(self._send_quietly({"type": "cancel", "context_id": context_id}))
            self._retire(context_id)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send_quietly(self, message: dict[str, Any]) -> None:
        with contextlib.suppress(websockets.ConnectionClosed):
            await self.send(message)

    async def _read(self) -> None:
        try:
            await self._read_frames()
        except websockets.ConnectionClosed:
            pass
        except Exception as exc:
            # A frame this client cannot handle: without its reader the socket is of no use,
            # and a socket nobody reads would only hold the server back. Reported through
            # the `connection_closed` events.
            self.reader_error = exc
            with contextlib.suppress(Exception):
                await self.ws.close(1011, "client error")

    async def _read_frames(self) -> None:
        async for msg in self.ws:
            if isinstance(msg, bytes):
                if not msg:
                    continue
                n = msg[0]
                await self._route(msg[1 : 1 + n].decode("utf-8", "replace"), msg[1 + n :], len(msg))
                continue
            try:
                ev = json.loads(msg)
            except ValueError:
                continue
            if not isinstance(ev, dict):
                continue
            if ev.get("type") == "session_started":
                self.session = ev
                self._started.set()
                continue
            if not self.session and ev.get("type") == "error" and self._refusal is None:
                self._refusal = ev  # why the server is about to close (unauthorized, not_ready, ...)
            cid = ev.get("context_id")
            if not isinstance(cid, str) or not cid:
                self._post_event(ev)
            elif ev.get("type") == "audio":
                data = base64.b64decode(ev.get("data", ""))
                await self._route(cid, data, len(msg))
            else:
                await self._route(cid, ev, len(msg))

    def _closed(self, _reader: asyncio.Task[None]) -> None:
        """The socket is over: every context that did not finish ends with a final
        `connection_closed` error, and so does `events`."""
        code = self.ws.close_code
        reason = self.close_reason
        why = f"the gateway connection closed (code {code}{': ' + reason if reason else ''})"
        if self.reader_error is not None:
            why += f" after a frame the client could not read ({self.reader_error!r})"
        for context_id, line in self._contexts.items():
            for ctx in line:
                if ctx.finished:
                    continue
                if ctx._cancelled:
                    # Its `cancelled` did not come back in time, but a closed socket stops every
                    # context: it ended as asked, which is no failure.
                    ctx._finish({"type": "cancelled", "context_id": context_id, "close_code": code}, deliver=True)
                else:
                    ctx._finish({"type": "error", "code": CONNECTION_CLOSED, "message": f"{why} before the context finished",
                                 "context_id": context_id, "final": True, "close_code": code}, deliver=True)
        self._contexts.clear()
        self._post_event({"type": "error", "code": CONNECTION_CLOSED, "message": why, "final": True, "close_code": code})
        self._started.set()
