"""What one full pass of the garbage collector costs a gateway process, with and without
its start-up objects frozen (`engine.heap.freeze_startup_objects`).

    python -m bench.gc_pause [--model tiny-random] [--reps 5]

Builds the gateway app with a model (the tiny random one by default; the full-size random
one, or a real one, where its weights are at hand), runs its start-up (engine, warm-up,
voices) in this process, then times full passes (`gc.collect(2)`, which holds the GIL: the
event loop and every thread wait) with every start-up object walked, and after
`gc.freeze` as the gateway does at start. Prints the objects walked and the median pass
in milliseconds for each, as JSON. A process that also imports vLLM holds many more
objects than this one (the gateway's /metrics then says how long its passes take:
`cosyvoice_gc_pause_seconds_total`).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _passes(reps: int) -> dict[str, Any]:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        gc.collect(2)
        times.append(time.perf_counter() - t0)
    return {"objects_walked": len(gc.get_objects()), "pass_ms": round(1e3 * statistics.median(times), 3)}


async def _measure(model: str, reps: int) -> dict[str, Any]:
    from engine.heap import freeze_startup_objects, unfreeze
    from gateway.app import create_app
    from gateway.settings import EngineSettings, Settings

    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(model=model, data_dir=Path(tmp) / "data", assets_dir=Path(tmp) / "none",
                            engine=EngineSettings(device="cpu", lm_backend="torch"))
        app = create_app(settings)
        async with app.router.lifespan_context(app):  # the gateway's start-up, freeze included
            unfreeze()  # the app froze its start-up objects: walk them all first
            walked = _passes(reps)
            freeze_startup_objects()
            frozen = _passes(reps) | {"frozen_objects": gc.get_freeze_count()}
        return {"model": model, "all_walked": walked, "start_up_frozen": frozen}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-random")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    result = asyncio.run(_measure(args.model, args.reps))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
