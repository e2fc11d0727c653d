"""Context starts of a `/v1/tts/stream` socket (`gateway.ws`).

A context whose voice prompt is cached starts at once, in the reader, in the order of
the client's messages. Any other may take a disk read, a re-made prompt or a database
round trip, so it starts in a task of its own (`_Starting`), and the commands for that
context wait in order behind it while the other contexts' (a cancel, say) do not.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.types import SessionOptions

from .errors import ApiError
from .protocol import CancelContext, Command, ConnectionState, ProtocolError, Send, StartContext, WsLimits, echo
from .ws_context import SendEvent, _ContextRuntime, open_runtime
from .ws_pump import AudioPump

# The socket's log keeps its one name, whichever of its modules writes.
log = logging.getLogger("gateway.ws")


@dataclass
class _Starting:
    """A context being started (`ContextStarts._start_then_catch_up`): its voice may take a
    disk read, a re-made prompt or a database round trip, which must not hold the reader,
    so the context's own commands that come meanwhile wait here, in order, and run once it
    has started (or been refused). A cancel does not wait: while the voice loads it marks
    the start `cancelled` (the load goes on, to be cached, and opens nothing), after that
    it stops the task."""

    backlog: deque[Command] = field(default_factory=deque)
    cancelled: bool = False
    loaded: bool = False  # the start itself is over (opened or refused): catching up
    task: asyncio.Task[None] | None = None  # set right after the task is made


# Commands one starting context holds for it; past them the reader waits for the start, as
# it did for every start before starts ran in the background (a client sending this much
# while its voice loads is not reading its own errors either).
STARTING_BACKLOG_MAX = 256


def _context_of(cmd: Command) -> str | None:
    """The context a command is about (a `Send` by its event's id), None for the socket's."""
    if isinstance(cmd, Send):
        cid = cmd.event.get("context_id") if isinstance(cmd.event, dict) else None
        return cid if isinstance(cid, str) else None
    cid = getattr(cmd, "context_id", None)
    return cid if isinstance(cid, str) else None


class StartHost(Protocol):
    """What context starts need of their connection (`gateway.ws._Connection`)."""

    gw: Any
    session_id: str
    limits: WsLimits
    state: ConnectionState
    contexts: dict[str, _ContextRuntime]
    pump: AudioPump

    send_event: SendEvent

    def maybe_close(self) -> None: ...

    async def run_command(self, cmd: Command) -> None: ...


class ContextStarts:
    """A connection's context starts, and the ones still running in the background."""

    def __init__(self, conn: StartHost) -> None:
        self.conn = conn
        self.starting: dict[str, _Starting] = {}
        # Every start task still running, a cancelled start's load included; at most
        # `max_contexts` (the reader waits for one to end before it makes another).
        self.tasks: set[asyncio.Task[None]] = set()
        # Tests may fix engine options (e.g. a deterministic speech-token count).
        self.base_options: SessionOptions = getattr(conn.gw, "session_defaults", None) or SessionOptions()

    # -- background starts -------------------------------------------------------------

    async def hold(self, cmd: Command) -> bool:
        """Whether `cmd` waits behind its context's start (queued in its backlog, in order):
        then the caller is done with it. A cancel is never held. Past the backlog's cap the
        caller waits here for the start to end, then it is looked at again, as any command
        now (False once nothing holds it)."""
        while True:
            cid = _context_of(cmd)
            starting = self.starting.get(cid) if cid is not None else None
            if starting is None or isinstance(cmd, CancelContext):
                return False
            if len(starting.backlog) < STARTING_BACKLOG_MAX:
                starting.backlog.append(cmd)  # behind its context's start, in order
                return True
            assert starting.task is not None
            await asyncio.wait([starting.task])

    def at_once(self, voice: str) -> bool:
        """Whether a context of this voice starts without waiting (its prompt cached, or
        the id unknown: refused at once), so that it starts right here, in the order of
        the client's messages; otherwise in the background (`_Starting`)."""
        peek = getattr(self.conn.gw.voices, "cached_prompt", None)
        if peek is None:
            return True  # a store that cannot tell
        try:
            return peek(voice) is not None
        except KeyError:
            return True

    async def begin(self, cmd: StartContext) -> None:
        """Start the context in a task of its own; with `max_contexts` start tasks running
        the caller (the reader) waits for one to end first."""
        while len(self.tasks) >= self.conn.limits.max_contexts:
            await asyncio.wait(self.tasks, return_when=asyncio.FIRST_COMPLETED)
        starting = self.starting[cmd.context_id] = _Starting()
        task = starting.task = asyncio.create_task(self._start_then_catch_up(cmd, starting),
                                                   name=f"{self.conn.session_id}-{cmd.context_id}-start")
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _start_then_catch_up(self, cmd: StartContext, starting: _Starting) -> None:
        """A context's start, then the commands for it that came meanwhile (`_Starting`).
        An error in one of them costs that command an `internal_error`, as in the reader."""
        conn = self.conn
        cid = cmd.context_id
        try:
            await self.start(cmd, starting)
            starting.loaded = True
            while starting.backlog and not starting.cancelled:  # it grows while a command here waits
                queued = starting.backlog.popleft()
                try:
                    await conn.run_command(queued)
                except Exception:
                    log.exception("websocket command %r failed", queued)
                    conn.send_event(ProtocolError("internal_error", "internal error").event())
        except Exception:  # a bug: the id must not stay open with nothing left to end it
            log.exception("%s: context %s failed to start", conn.session_id, cid)
            if cid not in conn.contexts and self.starting.get(cid) is starting:  # not cancelled or reopened
                conn.state.context_finished(cid)
                conn.send_event(ProtocolError("internal_error", "context could not be started", cid).event())
                conn.maybe_close()
        finally:
            # No await since the backlog was last found empty: a command for this
            # context from now on runs directly.
            if self.starting.get(cid) is starting:
                del self.starting[cid]

    async def cancel(self, cid: str) -> None:
        """A cancel of the context, as far as its start goes (nothing if none is running)."""
        starting = self.starting.pop(cid, None)
        if starting is None:
            return
        # Still loading its voice: it will open nothing, and ends here without a
        # runtime (`cancelled` says not active; it sent no `context_started`).
        # Catching up on its commands: the task stops in the one in progress (a
        # reopened start's load too), and a runtime it has is stopped by the caller.
        starting.cancelled = True
        if starting.loaded and starting.task is not None:
            starting.task.cancel()
            await asyncio.wait([starting.task])
        # What the state machine had to say about the context's messages still goes
        # out (a text too long, say), before its `cancelled`.
        for queued in starting.backlog:
            if isinstance(queued, Send):
                self.conn.send_event(queued.event)
        starting.backlog.clear()

    async def cancel_all(self) -> None:
        """The socket's end: every start task stopped (a load in progress too)."""
        starts = list(self.tasks)
        for t in starts:
            t.cancel()
        if starts:
            await asyncio.wait(starts)

    # -- the start itself --------------------------------------------------------------

    async def start(self, cmd: StartContext, starting: _Starting | None = None) -> None:
        """Open the context (voice, encoder, engine session, pump) and say so. `starting`:
        it runs in the background, and a cancel may come while its voice loads."""
        conn = self.conn
        cid, settings = cmd.context_id, cmd.settings
        started: _ContextRuntime | ProtocolError
        try:
            voice = await self._voice(cid, settings.voice)
            if starting is not None and starting.cancelled:
                return  # its `cancelled` was sent: open nothing (no await from here on)
            started = voice if isinstance(voice, ProtocolError) else await open_runtime(
                conn.gw, cid, settings, voice, self.base_options)
        except Exception:
            log.exception("%s: context %s failed to start", conn.session_id, cid)
            started = ProtocolError("internal_error", "context could not be started", cid)
        if starting is not None and starting.cancelled:
            return
        if isinstance(started, ProtocolError):
            held = self.starting.get(cid)
            if held is not None:
                # Its messages read while it started (all of this context: a new one of
                # the id comes only after the refusal): what the state machine said of
                # them goes out before the refusal, its last event, as before a cancel's
                # `cancelled`. The rest of them needs the runtime it will not have.
                for queued in held.backlog:
                    if isinstance(queued, Send):
                        conn.send_event(queued.event)
                held.backlog.clear()
            # The state machine opened it: without this its later text would be dropped
            # silently and `close` would wait for a `done` that never comes.
            conn.state.context_finished(cid)
            conn.send_event(started.event())
            conn.maybe_close()  # a start in the background may end after the `close` came
            return
        rt = started
        conn.contexts[cid] = rt
        conn.pump.start(rt)
        # Not tied to the context: a cancel right after must not drop it (its `cancelled`
        # says `active: true`, which a client reads as after its `context_started`).
        conn.send_event({"type": "context_started", "context_id": cid, **settings.describe()})

    async def _voice(self, cid: str, voice_id: str) -> Any:
        """The voice's prompt, or the refusal the client can act on."""
        try:
            return await self.conn.gw.voices.get_prompt(voice_id)
        except KeyError:
            return ProtocolError("voice_not_found", f"voice {echo(voice_id)!r} is not registered", cid)
        except ApiError as exc:  # e.g. the shared voice store is unreachable
            return ProtocolError(exc.code, exc.message, cid)
