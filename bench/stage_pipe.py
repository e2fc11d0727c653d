"""What the pipe to the stage's process (`engine.stage_process`) adds to a chunk's round.

    python -m bench.stage_pipe --rows 1,64 --audio-s 0.4 --reps 500

A child made the way `RemoteStage.spawn` makes the stage's (spawn, one duplex pipe)
answers every message at once with the "events" message a batch of `rows` chunks of
`audio-s` seconds of 24 kHz PCM gives; the parent sends each batch's "submit" messages
and waits for the answer. Printed per batch size: the round trip's median and 99th
percentile, which is what the stage's process adds to a round beside the stage's own time.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
from multiprocessing.connection import Connection

import numpy as np

from engine.stage_process import ChunkWire

SAMPLE_RATE = 24000


def _echo(conn: Connection, rows: int, samples: int) -> None:
    pcm = [np.zeros(samples, np.float32) for _ in range(rows)]
    while conn.recv() is not None:
        conn.send([("events", [(i, 0.0, rows, False, None) for i in range(rows)], list(enumerate(pcm)), [], [], {}, {})])


def round_trips(rows: int, audio_s: float, reps: int) -> list[float]:
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe(duplex=True)
    child = ctx.Process(target=_echo, args=(theirs, rows, int(audio_s * SAMPLE_RATE)))
    child.start()
    wire = ChunkWire(np.zeros(180, np.int64), 0, 1, 106, 156, False, 0)
    batch = [("submit", i, i, wire, 1.0, 0, True, 0.0, None, None) for i in range(rows)]
    times = []
    try:
        for _ in range(reps + reps // 10):
            t0 = time.perf_counter()
            ours.send(batch)
            ours.recv()
            times.append(time.perf_counter() - t0)
    finally:
        ours.send(None)
        child.join()
    return times[reps // 10:]  # the first tenth warms the pipe up


def main(argv: list[str] | None = None) -> dict[int, dict[str, float]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,64", help="chunks per batch, comma-separated")
    p.add_argument("--audio-s", type=float, default=0.4, help="seconds of PCM per chunk")
    p.add_argument("--reps", type=int, default=500)
    args = p.parse_args(argv)
    out = {}
    for rows in (int(r) for r in args.rows.split(",")):
        t = sorted(round_trips(rows, args.audio_s, args.reps))
        out[rows] = {"p50_ms": 1e3 * statistics.median(t), "p99_ms": 1e3 * t[int(0.99 * (len(t) - 1))]}
        print(f"{rows:3d} chunks of {args.audio_s:g} s: round trip p50 {out[rows]['p50_ms']:.3f} ms, "
              f"p99 {out[rows]['p99_ms']:.3f} ms", flush=True)
    return out


if __name__ == "__main__":
    main()
