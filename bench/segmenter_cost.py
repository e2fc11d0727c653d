"""What segmenting a context's text costs the event loop (CPU, no model).

The WebSocket reader runs `gateway.segmenter.Segmenter.push` inline for every text
message, so its time is time every socket on that loop waits. Prints, per input, the
time it took, the longest one message took, and the segments it made:

    python -m bench.segmenter_cost                          # this tree's segmenter
    python -m bench.segmenter_cost --module old_segmenter.py  # another copy, for an A/B

(e.g. `git show <rev>:gateway/segmenter.py > old_segmenter.py`).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path
from types import ModuleType


def load(path: str | None) -> ModuleType:
    if path is None:
        import gateway.segmenter

        return gateway.segmenter
    spec = importlib.util.spec_from_file_location("segmenter_under_test", Path(path))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def cases() -> list[tuple[str, list[str], dict[str, int]]]:
    """(name, the context's text messages, segmentation settings): LLM-sized token
    messages, and a whole 20,000-character context (the default `max_text_chars`) in one
    message, of short lines or short sentences, and sent sentence by sentence with cuts
    only allowed at 100,000 characters (a client's `min_chars`/`max_chars`). Then what
    a client can send to make each message cost more than the last: a run of marks,
    newlines or spaces one character a message that nothing may cut, blank lines
    after a word with `min_chars` too high for them to end a segment, and one dotted word
    ("a.a.a.") that grows a part a message. Last, one message of a long run of marks or
    newlines at `max_chars` 8 (a session setting), cut every 8 characters inside the run."""
    words = ("Hello there, this is a sentence. " * 600).split()
    no_cut = {"first_min_chars": 0, "min_chars": 100_000, "max_chars": 100_000}
    max_8 = {"first_min_chars": 0, "max_chars": 8}
    return [
        ("LLM tokens, 20k chars", [w + " " for w in words], {}),
        ("one message, 1666 lines", ["- Item one.\n" * 1666], {}),
        ("one message, 5000 sentences", ["Hi. " * 5000], {}),
        ("5000 messages, no cut allowed", ["Hi. "] * 5000, no_cut),
        ("20000 messages of '.', no cut", ["."] * 20_000, no_cut),
        ("20000 messages of '\\n', no cut", ["\n"] * 20_000, no_cut),
        ("20000 messages of ' ', no cut", [" "] * 20_000, no_cut),
        ("1500 messages of '\\n ', min_chars", ["Hi. x"] + ["\n "] * 1500,
         {"first_min_chars": 0, "min_chars": 1000, "max_chars": 100_000}),
        ("10000 messages of 'a.', no cut", ["a."] * 10_000, no_cut),
        ("'。' * 20000, max_chars 8", ["。" * 20_000], max_8),
        ("'好' + '!' * 20000 + '。', max_chars 8", ["好" + "!" * 20_000 + "。"], max_8),
        ("'a' + '.' * 20000, max_chars 8", ["a" + "." * 20_000], max_8),
        ("'a' + '!' * 20000 + ' ', max_chars 8", ["a" + "!" * 20_000 + " "], max_8),
        ("'a' + '\\n' * 20000, max_chars 8", ["a" + "\n" * 20_000], max_8),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--module", help="a segmenter.py to load instead of gateway.segmenter")
    parser.add_argument("--repeat", type=int, default=3, help="runs per input; the fastest is printed")
    args = parser.parse_args()
    seg = load(args.module)
    for name, messages, settings in cases():
        best, worst, count = float("inf"), float("inf"), 0
        for _ in range(args.repeat):
            s = seg.Segmenter(seg.SegmenterConfig(**settings))
            longest = 0.0
            t0 = time.perf_counter()
            count = 0
            for m in messages:
                t1 = time.perf_counter()
                count += len(s.push(m))
                longest = max(longest, time.perf_counter() - t1)
            count += len(s.end())
            best = min(best, time.perf_counter() - t0)
            worst = min(worst, longest)
        print(f"{name:40s} {best * 1000:10.1f} ms  longest message {worst * 1000:8.2f} ms  {count:5d} segments")


if __name__ == "__main__":
    main()
