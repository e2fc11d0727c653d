"""Whether a first chunk's flow could run beside a big round instead of after it.

    python -m bench.priority_lanes --big 250,250,250,250 --small 60 --delays 0,25,50 --json out.json

At 192-208 sessions a first chunk waits 77-121 ms for the stage's round in progress before its
own 37-48-ms round (docs/benchmarks.md, round 42): the stage runs one round at a time on one
CUDA stream. This measures the alternative before building it: each lane (a batch of rows
and its ten Euler steps of the DiT, both CFG halves, one voice's prompt prefix) captured as
a CUDA graph with its own memory pool, so two lanes can run at once, then:

* `alone`: each lane by itself;
* `after`: the small lane queued behind the big one on the big one's stream (the stage now);
* `beside`: the small lane on a second stream of the same priority;
* `priority`: the small lane on a stream of higher priority (CUDA schedules its thread
  blocks ahead of the other stream's waiting ones as SMs free up).

The small lane "arrives" `--delays` ms after the big one is launched. Per way and delay,
the medians over `--reps`: `small_ms` from its arrival to its end, `big_ms` from the big
lane's launch to its end, and `small_diff`, the largest difference of the small lane's
output from its output alone (0: the lanes did not touch each other's memory). Random
inputs of the full-size random model: the cost is the shapes', not the values'. The
vocoder and the LM (vLLM, another process beside the stage under MPS) are not in it.

On the CPU there are no streams or graphs: every way runs the lanes one after the other,
eagerly, which checks the bench's bookkeeping (tests), not the idea.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from bench.packed_rows import shared_prefix
from bench.stage_syncs import write_results
from engine.hub import resolve_model
from engine.models.dit import DiT, attention_kernel_for
from engine.models.loader import load_model

WAYS = ("alone", "after", "beside", "priority")


class Lane:
    """One batch's ten-step solve on static buffers; on CUDA a graph of it in its own pool."""

    def __init__(self, dit: DiT, frames: list[int], prefix: int, steps: int, device: torch.device,
                 dtype: torch.dtype, seed: int) -> None:
        lengths = frames + frames  # both CFG halves
        batch, longest = len(lengths), max(lengths)
        gen = torch.Generator().manual_seed(seed)

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen).to(device, dtype)

        self.dit, self.steps, self.device = dit, steps, device
        self.x0, self.mu, self.cond, self.spks = (rand(batch, 80, longest), rand(batch, 80, longest),
                                                  rand(batch, 80, longest), rand(batch, 80))
        mask = torch.arange(longest, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]
        self.mask = mask.to(dtype).unsqueeze(1)
        self.prefix = shared_prefix(dit, batch, prefix, device, dtype) if prefix else None
        self.zero = torch.zeros(1, device=device)
        self.times = [dit.time_conditioning(torch.tensor([k / steps], device=device))[0] for k in range(steps)]
        self.out = torch.empty_like(self.x0)
        self.graph: torch.cuda.CUDAGraph | None = None

    def _solve(self) -> None:
        x = self.x0
        for time_ in self.times:
            v = self.dit(x, self.mask, self.mu, self.zero, self.spks, self.cond, streaming=True,
                         prefix=self.prefix, time=time_)
            x = x + v / self.steps
        self.out.copy_(x)

    def capture(self) -> None:
        """Warm up (compiles, autotunes) and, on CUDA, capture the solve in a pool of its own."""
        if self.device.type != "cuda":
            self._solve()
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._solve()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=torch.cuda.graph_pool_handle()):
            self._solve()
        torch.cuda.synchronize()

    def launch(self) -> None:
        """Queue the solve on the current stream (run it, on the CPU)."""
        if self.graph is not None:
            self.graph.replay()
        else:
            self._solve()


class Clock:
    """Marks on the GPU's timeline (CUDA events) or the host's (perf_counter)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.idle = torch.cuda.Stream() if self.cuda else None  # an arrival is marked here: never waits

    def mark(self, on: torch.cuda.Stream | None = None) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(on or self.idle)
        return event

    def ms(self, start: Any, end: Any) -> float:
        if not self.cuda:
            return 1e3 * (end - start)
        return float(start.elapsed_time(end))


def streams(device: torch.device) -> dict[str, Any]:
    """The big lane's stream and the small lane's per way (None on the CPU)."""
    if device.type != "cuda":
        return {"big": None, "after": None, "beside": None, "priority": None}
    low, high = torch.cuda.Stream.priority_range()  # (least, greatest): greater priority is lower numbers
    big = torch.cuda.Stream(priority=low)
    return {"big": big, "after": big, "beside": torch.cuda.Stream(priority=low),
            "priority": torch.cuda.Stream(priority=high)}


def on(stream: Any) -> contextlib.AbstractContextManager[Any]:
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def wait_until(t: float) -> None:
    while time.perf_counter() < t:
        pass  # a sleep's wake-up jitter (~0.1 ms and more) is the size of what is measured


def trial(way: str, big: Lane, small: Lane, delay_ms: float, lanes: dict[str, Any],
          clock: Clock, sync: Callable[[], None]) -> dict[str, float]:
    sync()
    if way == "alone":
        with on(lanes["big"]):
            b0 = clock.mark(lanes["big"])
            big.launch()
            b1 = clock.mark(lanes["big"])
        sync()
        with on(lanes["priority"]):
            s0 = clock.mark(lanes["priority"])
            small.launch()
            s1 = clock.mark(lanes["priority"])
        sync()
        return {"big_ms": clock.ms(b0, b1), "small_ms": clock.ms(s0, s1)}
    start = time.perf_counter()
    with on(lanes["big"]):
        b0 = clock.mark(lanes["big"])
        big.launch()
        b1 = clock.mark(lanes["big"])
    wait_until(start + delay_ms / 1e3)
    arrive = clock.mark()
    with on(lanes[way]):
        small.launch()
        s1 = clock.mark(lanes[way])
    sync()
    return {"big_ms": clock.ms(b0, b1), "small_ms": clock.ms(arrive, s1)}


def measure(big: Lane, small: Lane, delays: list[float], reps: int, device: torch.device) -> list[dict[str, Any]]:
    lanes, clock = streams(device), Clock(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    trial("alone", big, small, 0.0, lanes, clock, sync)
    sync()
    reference = small.out.clone()
    rows = []
    for delay in delays:
        for way in WAYS:
            if way == "alone" and delay != delays[0]:
                continue
            runs = []
            diff = 0.0
            for _ in range(reps):
                runs.append(trial(way, big, small, delay, lanes, clock, sync))
                diff = max(diff, float((small.out.float() - reference.float()).abs().max()))
            rows.append({"way": way, "delay_ms": 0.0 if way == "alone" else delay,
                         "small_ms": statistics.median(r["small_ms"] for r in runs),
                         "big_ms": statistics.median(r["big_ms"] for r in runs),
                         "small_ms_max": max(r["small_ms"] for r in runs), "small_diff": diff, "reps": reps})
    return rows


@contextlib.contextmanager
def inference() -> Iterator[None]:
    with torch.inference_mode():
        yield


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default="full-random", help="model dir or hub name (default full-random)")
    p.add_argument("--model-cache", type=Path, default=Path("/tmp/models"))
    p.add_argument("--big", default="250,250,250,250", help="the big lane's rows, frames each (one CFG half)")
    p.add_argument("--small", default="60", help="the small lane's rows, frames each (one CFG half)")
    p.add_argument("--prefix", type=int, default=150, help="one voice's prompt prefix, frames (whole blocks; 0: none)")
    p.add_argument("--steps", type=int, default=10, help="Euler steps (the flow's 10)")
    p.add_argument("--delays", default="0,25,50", help="ms after the big lane's launch that the small one arrives")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--attention", default="cudnn", help="the attention kernel (ATTENTION_KERNELS)")
    p.add_argument("--conv-kernel", default="triton", help="the position convolutions' kernel (CONV_KERNELS)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    dit = load_model(resolve_model(args.model, args.model_cache), load_lm=False).flow.decoder.estimator
    dit = dit.to(device, dtype).eval()
    if args.prefix % dit.static_chunk_size:
        p.error(f"--prefix must be whole blocks of {dit.static_chunk_size} frames")
    dit.use_attention_kernel(attention_kernel_for(args.attention, device, dtype))
    dit.use_conv_kernel(args.conv_kernel)
    if args.compile:
        dit.compile_blocks()
    frames = {name: [int(n) for n in getattr(args, name).split(",")] for name in ("big", "small")}
    with inference():
        big = Lane(dit, frames["big"], args.prefix, args.steps, device, dtype, seed=1)
        small = Lane(dit, frames["small"], args.prefix, args.steps, device, dtype, seed=2)
        big.capture()
        small.capture()
        rows = measure(big, small, [float(d) for d in args.delays.split(",")], args.reps, device)
    for row in rows:
        print(f"{row['way']:8s} delay {row['delay_ms']:5.1f} ms  small {row['small_ms']:7.2f} ms "
              f"(max {row['small_ms_max']:7.2f})  big {row['big_ms']:7.2f} ms  small diff {row['small_diff']:.1e}",
              flush=True)
    write_results(args.json, device, args, [{"big": args.big, "small": args.small} | r for r in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
