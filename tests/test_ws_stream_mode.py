"""WebSocket `text_mode: "stream"`: text goes to the LM as it arrives (bistream),
the segmenter only bounding utterances. Protocol rules (pure) and end to end."""

from __future__ import annotations

from typing import Any

from gateway.protocol import (
    ConnectionState,
    ContextSettings,
    EndContext,
    FlushMark,
    Speak,
    StreamText,
    WsLimits,
    parse_client_message,
)
from test_ws_integration import Recording, has_done, receive_until, run, send, server  # noqa: F401

LIMITS = WsLimits()


def _state() -> ConnectionState:
    return ConnectionState(ContextSettings(voice="v"), LIMITS)


def _text(state: ConnectionState, text: str, **kw: Any) -> list[Any]:
    import json

    return state.handle(parse_client_message(json.dumps({"type": "text", "context_id": "c", "text": text, **kw}), LIMITS))


def _streamed(cmds: list[Any]) -> list[StreamText]:
    return [c for c in cmds if isinstance(c, StreamText)]


def test_stream_mode_feeds_words_before_the_sentence_ends() -> None:
    st = _state()
    out = _text(st, "Hello th", text_mode="stream")
    assert _streamed(out) == [StreamText("c", 0, 0, "Hello")]  # the open word waits
    assert not any(isinstance(c, Speak) for c in out)
    out = _text(st, "ere, my fri")
    # "Hello there," is the first segment (clause); " my" already belongs to the next.
    assert _streamed(out) == [
        StreamText("c", 0, 5, " there,", close=True, reason="clause"),
        StreamText("c", 1, 12, " my"),
    ]
    out = _text(st, "end. Bye")
    assert _streamed(out) == [StreamText("c", 1, 15, " friend.", close=True, reason="sentence")]
    out = _text(st, " now", end=True)
    streamed = _streamed(out)
    assert streamed[0] == StreamText("c", 2, 23, " Bye")
    assert streamed[-1].close and streamed[-1].index == 2
    assert isinstance(out[-1], EndContext)
    # Every character went out exactly once, in order.
    full = "Hello there, my friend. Bye now"
    pieces = [StreamText("c", 0, 0, "Hello"), StreamText("c", 0, 5, " there,"), StreamText("c", 1, 12, " my"),
              StreamText("c", 1, 15, " friend."), *streamed]
    assert "".join(p.text for p in pieces) == full
    assert [p.start for p in pieces] == [sum(len(q.text) for q in pieces[:i]) for i in range(len(pieces))]


def test_stream_mode_feeds_chinese_as_it_comes() -> None:
    """No spaces between Chinese words: each piece goes to the LM when it arrives, not
    the whole sentence at its mark."""
    st = _state()
    pieces = ["今天", "天气", "很好", "，我们", "去公园", "散步吧", "。"]
    sent: list[StreamText] = []
    first = _streamed(_text(st, pieces[0], text_mode="stream"))
    assert first == [StreamText("c", 0, 0, "今天")]
    sent += first
    for piece in pieces[1:]:
        got = _streamed(_text(st, piece))
        assert got, piece  # every piece moves the stream on
        sent += got
    sent += _streamed(_text(st, "", end=True))
    assert "".join(p.text for p in sent) == "".join(pieces)
    assert [p.start for p in sent] == [sum(len(q.text) for q in sent[:i]) for i in range(len(sent))]
    # a Latin word after Chinese still waits for its end
    st = _state()
    assert _streamed(_text(st, "好的 GP", text_mode="stream")) == [StreamText("c", 0, 0, "好的")]


def test_stream_mode_flush_closes_the_open_utterance() -> None:
    st = _state()
    _text(st, "no punctuation ", text_mode="stream")
    out = st.handle(parse_client_message('{"type": "flush", "context_id": "c"}', LIMITS))
    streamed = _streamed(out)
    assert streamed and streamed[-1].close and streamed[-1].index == 0
    assert isinstance(out[-1], FlushMark)
    out = _text(st, "next words ")
    assert _streamed(out)[0].index == 1  # a new utterance after the flush


def test_forced_cut_never_splits_text_already_streamed() -> None:
    """An over-long sentence is cut back at a clause mark by the segmenter; text that
    was already streamed past that mark stays with the first utterance."""
    st = _state()
    _text(st, "x", text_mode="stream", segmentation={"max_chars": 40, "first_min_chars": 40})
    words = "alpha, beta gamma delta epsilon zeta eta theta iota kappa lambda mu."
    sent: list[StreamText] = []
    for ch in words:
        sent += _streamed(_text(st, ch))
    sent += _streamed(_text(st, "", end=True))
    assert "".join(s.text for s in sent) == "x" + words
    for a, b in zip(sent, sent[1:]):
        assert b.start == a.start + len(a.text)
        if a.close:
            assert b.index == a.index + 1 and (a.start + len(a.text) == len("x" + words) or ("x" + words)[b.start].isspace())


def test_websocket_stream_mode_end_to_end(server: Any) -> None:  # noqa: F811
    first = "Streaming text goes to the model word by word, "
    second = "and a second sentence follows here. "
    third = "Then it ends"

    async def main() -> Recording:
        rec = Recording()
        async with __import__("websockets").connect(server.url) as ws:
            await receive_until(ws, rec, lambda r: bool(r.of("session_started")))
            words = (first + second + third).split(" ")
            for i, w in enumerate(words):
                await send(ws, type="text", context_id="s", text=(w if i == 0 else " " + w),
                           **({"text_mode": "stream"} if i == 0 else {}))
            await send(ws, type="flush", context_id="s")
            await receive_until(ws, rec, lambda r: bool(r.of("flushed", "s")))
            await send(ws, type="text", context_id="s", text="After the flush.", end=True)
            await receive_until(ws, rec, has_done("s"))
        return rec

    rec = run(main())
    started = rec.of("context_started", "s")[0]
    assert started["text_mode"] == "stream"
    segs = rec.of("segment_started", "s")
    full = first + second + third + "After the flush."
    # Utterances: "...word by word," | " and a second ... here." | " Then it ends" | "After the flush."
    assert [s["segment_index"] for s in segs] == [0, 1, 2, 3]
    assert [s["text_start"] for s in segs] == [0, len(first) - 1, len(first + second) - 1, len(first + second + third)]
    for s in segs:  # text known when its audio started: a prefix of the segment's text
        assert full[s["text_start"] : s["text_end"]] == s["text"] and s["text"].strip()
    done = rec.of("done", "s")[0]
    assert done["segments"] == 4 and done["audio_samples"] > 0
    assert sum(len(f) for f in rec.audio["s"]) // 2 == done["audio_samples"]
    # the flush came after the audio of everything before it
    i_flushed = rec.order.index(("event", "flushed"))
    i_seg4 = [i for i, o in enumerate(rec.order) if o == ("event", "segment_started")][3]
    assert i_flushed < i_seg4


def test_websocket_stream_mode_cancel_while_waiting_for_text(server: Any) -> None:  # noqa: F811
    """The LM request of an open streamed utterance waits for more text; cancel frees it
    at once and the socket goes on."""

    async def main() -> tuple[Recording, int]:
        rec = Recording()
        async with __import__("websockets").connect(server.url) as ws:
            await send(ws, type="text", context_id="w", text="Words keep coming but the sentence never ",
                       text_mode="stream")
            await receive_until(ws, rec, lambda r: bool(r.of("context_started", "w")))
            await send(ws, type="cancel", context_id="w")
            await receive_until(ws, rec, lambda r: bool(r.of("cancelled", "w")))
            active = server.gw.engine.backend.num_active()  # cancel awaited the engine abort
            await send(ws, type="text", context_id="w2", text="A new context speaks.", text_mode="stream", end=True)
            await receive_until(ws, rec, has_done("w2"))
        return rec, active

    rec, active = run(main())
    assert active == 0
    assert rec.of("cancelled", "w")[0]["active"] is True
    assert rec.of("done", "w2")[0]["audio_samples"] > 0


def test_websocket_stream_mode_a_segment_that_cannot_open_fails_once(server: Any, monkeypatch: Any) -> None:  # noqa: F811
    """A streamed utterance the engine refuses to open gets one `synthesis_failed`; its
    later words are not offered again (eight errors before, and an utterance opened mid-
    sentence when a retry worked), and the next segment speaks."""
    from engine.session import Session

    opens: list[str] = []
    submit_stream = Session.submit_stream

    async def refusing(self: Session, *args: Any, utterance_id: str | None = None, **kw: Any) -> Any:
        opens.append(str(utterance_id))
        if utterance_id == "f-0":
            raise RuntimeError("the LM refuses text-in streaming")
        return await submit_stream(self, *args, utterance_id=utterance_id, **kw)

    monkeypatch.setattr(Session, "submit_stream", refusing)

    async def main() -> Recording:
        rec = Recording()
        async with __import__("websockets").connect(server.url) as ws:
            words = "One two three four five six seven eight. Then this one speaks.".split(" ")
            for i, w in enumerate(words):
                await send(ws, type="text", context_id="f", text=(w if i == 0 else " " + w),
                           **({"text_mode": "stream"} if i == 0 else {}))
            await send(ws, type="end", context_id="f")
            await receive_until(ws, rec, has_done("f"))
        return rec

    rec = run(main())
    errors = rec.of("error", "f")
    assert [e["code"] for e in errors] == ["synthesis_failed"] and "segment 0" in errors[0]["message"]
    assert opens == ["f-0", "f-1"], opens
    segs = rec.of("segment_started", "f")
    assert [s["segment_index"] for s in segs] == [1] and segs[0]["text"].strip().startswith("Then")
    assert rec.of("done", "f")[0]["audio_samples"] > 0


def test_stream_mode_idle_ends_the_open_utterance_and_the_sentence_goes_on() -> None:
    st = _state()
    _text(st, "Hello there my ", text_mode="stream")
    assert st.stream_idle("c") == [StreamText("c", 0, 14, "", close=True, reason="idle")]
    assert st.stream_idle("c") == []  # nothing open now
    out = _streamed(_text(st, "friend. Bye "))
    # The sentence's rest is the next utterance; no character is handed out twice.
    assert out == [StreamText("c", 1, 14, " friend.", close=True, reason="sentence"), StreamText("c", 2, 22, " Bye")]
    assert st.stream_idle("unknown") == []


def test_websocket_stream_mode_a_quiet_client_does_not_hold_the_lm(server: Any, monkeypatch: Any) -> None:  # noqa: F811
    """A client that stops mid-sentence: after `stream_idle_s` its open utterance ends
    with the words it has, so its LM request ends instead of waiting for text for as long
    as the socket lives; the sentence's later words open the next utterance.

    The connection starts with `stream_idle_s` off, so the waiting request is seen for
    certain (not racing the idle timer); the test then turns it on for that connection."""
    import asyncio
    import dataclasses

    from gateway import ws as ws_mod

    limits = server.gw.settings.ws
    monkeypatch.setattr(server.gw.settings, "ws", dataclasses.replace(limits, stream_idle_s=0.0))
    conns: list[Any] = []
    init = ws_mod._Connection.__init__

    def capture(self: Any, *args: Any, **kw: Any) -> None:
        init(self, *args, **kw)
        conns.append(self)

    monkeypatch.setattr(ws_mod._Connection, "__init__", capture)
    backend = server.gw.engine.backend

    async def main() -> Recording:
        rec = Recording()
        async with __import__("websockets").connect(server.url) as ws:
            await send(ws, type="text", context_id="q", text="The client stops in the middle of ", text_mode="stream")
            await receive_until(ws, rec, lambda r: bool(r.of("segment_started", "q")))
            (conn,) = conns
            assert backend.num_active() == 1  # speaking the words it has, then waiting for more
            # Now the idle limit, on this connection (its monitor reads it on every round).
            server.loop.call_soon_threadsafe(setattr, conn, "limits", dataclasses.replace(conn.limits, stream_idle_s=0.3))
            async with asyncio.timeout(30):  # the request ends once the idle close ended its text
                while backend.num_active():
                    await asyncio.sleep(0.02)
            await send(ws, type="text", context_id="q", text="a sentence.", end=True)
            await receive_until(ws, rec, has_done("q"))
        return rec

    rec = run(main())
    segs = rec.of("segment_started", "q")
    assert [s["segment_index"] for s in segs] == [0, 1]
    assert segs[0]["text"] == "The client stops in the middle of" and segs[1]["text"] == " a sentence."
    assert rec.of("done", "q")[0]["segments"] == 2 and not rec.of("error", "q")


def test_stream_mode_markdown_marks_do_not_reach_the_lm(server: Any, monkeypatch: Any) -> None:  # noqa: F811
    """Stream mode hands the LM the client's text unnormalised; an LLM's bold, code and
    heading marks are left out of the LM's copy (not of the offsets the client sees)."""
    from engine.frontend.text import strip_stream_markdown
    from engine.text_stream import TextFeed

    assert strip_stream_markdown("**Note:** use `pip`") == "Note: use pip"
    assert strip_stream_markdown("x\n## Title\n> quoted") == "x\n Title\n quoted"
    assert strip_stream_markdown("C# is #1 and 3 > 2") == "C# is #1 and 3 > 2"
    assert strip_stream_markdown("plain text, 2 - 3") == "plain text, 2 - 3"
    assert strip_stream_markdown("## Title", line_start=True) == " Title"
    assert strip_stream_markdown("## Title") == "## Title"  # mid-line: as written
    assert strip_stream_markdown("> 2 marks", line_start=True) == "> 2 marks"  # no word after it
    fed: list[str] = []
    append = TextFeed.append

    def spy(self: TextFeed, text: str, word_end: bool = False) -> None:
        fed.append(text)
        append(self, text, word_end)

    monkeypatch.setattr(TextFeed, "append", spy)
    # A heading as the context's first piece, and a quote on a line of its own: stream mode
    # ends a segment at the newline, so the quote's mark starts the next piece.
    pieces = ["# Heading", "\n", "**Bold", "** words", " and `code`", " here.", "\n", "> Quoted", " line."]

    async def main() -> Recording:
        rec = Recording()
        async with __import__("websockets").connect(server.url) as ws:
            await receive_until(ws, rec, lambda r: bool(r.of("session_started")))
            for i, piece in enumerate(pieces):
                await send(ws, type="text", context_id="m", text=piece, end=i == len(pieces) - 1,
                           **({"text_mode": "stream"} if i == 0 else {}))
            await receive_until(ws, rec, has_done("m"))
        return rec

    rec = run(main())
    assert rec.of("done", "m")[0]["audio_samples"] > 0
    assert "".join(fed).split() == "Heading Bold words and code here. Quoted line.".split()
    segs = rec.of("segment_started", "m")
    assert segs and segs[0]["text"].startswith("# Heading")  # the client's own text and offsets
    assert any(s["text"].lstrip().startswith("> Quoted") for s in segs)
