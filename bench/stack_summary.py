"""Where a sampled process spent its time, per thread, from py-spy's raw stacks.

    py-spy record --pid PID --duration 20 --rate 100 --threads --nonblocking --format raw -o stacks.txt
    python -m bench.stack_summary stacks.txt [--thread MainThread] [--top 40] [--rate 100]

`bench/gpu/ws_load_run.sh` records the gateway process this way under load (`PYSPY=20`):
the gateway's event loop runs every WebSocket, the engine's per-token and per-chunk work and
vLLM's output handler, and its CPU per second of audio (`server.event_loop.cpu_ms_per_audio_s`,
3.6 ms at 160 sessions in round 29 of docs/benchmarks.md) sets how many sessions one loop
can carry. py-spy leaves out idle samples (a thread waiting in epoll or on a lock), so a
thread's samples are its busy time, waiting for the GIL included (py-spy's `--gil` keeps
only the samples of the thread holding it).

Each raw line is `thread (TID): NAME;frame;...;frame COUNT`, a frame `function (file:line)`.
Prints, per thread, its samples (and its busy share of the recording with `--rate` and
`--duration`), then for the chosen thread (the busiest, or `--thread`) the functions by
inclusive and by self samples, a function counted once per stack however often it recurs.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

_LINE = re.compile(r"^thread \((?P<tid>[^)]*)\): (?P<stack>.*) (?P<count>\d+)$")
_FRAME_LINE = re.compile(r":\d+\)$")


@dataclass
class ThreadStacks:
    name: str
    samples: int = 0
    inclusive: Counter[str] = field(default_factory=Counter)
    self_: Counter[str] = field(default_factory=Counter)


def frame_key(frame: str) -> str:
    """`function (file:line)` -> `function (file)`: a function's lines summed."""
    return _FRAME_LINE.sub(")", frame.strip())


def parse(text: str) -> dict[str, ThreadStacks]:
    """Per thread (`NAME (TID)`), its samples and functions. Lines that are not stacks
    (py-spy's own messages) are skipped."""
    threads: dict[str, ThreadStacks] = {}
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if m is None:
            continue
        name, *frames = m["stack"].split(";")
        count = int(m["count"])
        key = f"{name} ({m['tid']})"
        t = threads.setdefault(key, ThreadStacks(key))
        t.samples += count
        keys = [frame_key(f) for f in frames if f.strip()]
        for k in set(keys):
            t.inclusive[k] += count
        if keys:
            t.self_[keys[-1]] += count
    return threads


def summary(threads: dict[str, ThreadStacks], thread: str | None = None, top: int = 40,
            rate: float | None = None, duration: float | None = None) -> str:
    if not threads:
        return "no stacks"
    span = rate * duration if rate and duration else None
    lines = ["samples per thread" + (f" (busy share of {duration:g} s at {rate:g} Hz)" if span else "") + ":"]
    ranked = sorted(threads.values(), key=lambda t: -t.samples)
    for t in ranked:
        share = f"  {100 * t.samples / span:5.1f}%" if span else ""
        lines.append(f"  {t.samples:7d}{share}  {t.name}")
    chosen = ranked[0] if thread is None else next((t for t in ranked if t.name.startswith(thread)), None)
    if chosen is None:
        return "\n".join(lines + [f"no thread named {thread!r}"])
    for title, counts in (("inclusive", chosen.inclusive), ("self", chosen.self_)):
        lines.append(f"\n{chosen.name}: top {top} functions by {title} samples (% of the thread's {chosen.samples})")
        for k, n in counts.most_common(top):
            lines.append(f"  {100 * n / chosen.samples:5.1f}%  {n:6d}  {k}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stacks", type=Path, help="py-spy record --format raw --threads output")
    ap.add_argument("--thread", default=None, help="the thread to break down (a name prefix; default: the busiest)")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--rate", type=float, default=None, help="py-spy's --rate, for busy shares")
    ap.add_argument("--duration", type=float, default=None, help="py-spy's --duration, for busy shares")
    args = ap.parse_args(argv)
    print(summary(parse(args.stacks.read_text()), args.thread, args.top, args.rate, args.duration))


if __name__ == "__main__":
    main()
