"""A second process that keeps the GPU busy the way the LM's decode loop does.

    python -m bench.decode_load --rows 64 --steps-per-s 100 --seconds 60 &
    python -m bench.stage_syncs --batches 8,16,64

In the gateway the flow/vocoder stage shares the GPU with vLLM's engine-core process, and
round 6 found the stage 2-3x slower per frame there than alone. Kernels of two processes
do not run side by side on a GPU without MPS: they take turns. This load stands in for the
LM: it launches a Qwen2-0.5B-sized decode step (24 layers of the matrix products a step of
`--rows` sequences does, `--layers`, `--hidden`, `--ffn`; bf16 on CUDA) `--steps-per-s`
times a second, each step one CUDA-graph replay, so its own host cost is nil. Run the
stage bench beside it and without it: the difference is what sharing the GPU with another
process costs the stage, with no vLLM and no event loop involved.

It prints one line when its loop starts (`decode load running`) and its achieved step
rate at the end (after `--seconds`, or on SIGTERM).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from typing import Callable

import torch


class DecodeStep:
    """`layers` decoder layers' matrix products for one step of `rows` sequences."""

    def __init__(self, rows: int, layers: int, hidden: int, ffn: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        g = torch.Generator(device="cpu").manual_seed(0)

        def w(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=g) / shape[0] ** 0.5).to(device=device, dtype=dtype)

        self.weights = [(w(hidden, 3 * hidden), w(hidden, hidden), w(hidden, 2 * ffn), w(ffn, hidden))
                        for _ in range(layers)]
        self.x = torch.randn(rows, hidden, generator=g).to(device=device, dtype=dtype)

    def __call__(self) -> torch.Tensor:
        x = self.x
        for qkv, out, up, down in self.weights:
            h = x @ qkv
            x = x + h[:, : x.shape[1]] @ out
            gate, lin = (x @ up).chunk(2, dim=-1)
            x = x + (torch.nn.functional.silu(gate) * lin) @ down
            x = x / (x.float().pow(2).mean(-1, keepdim=True).add(1e-6).sqrt().to(x.dtype))
        return x


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rows", type=int, default=64, help="sequences decoded per step")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--ffn", type=int, default=4864)
    p.add_argument("--steps-per-s", type=float, default=100.0, help="0: back to back")
    p.add_argument("--seconds", type=float, default=60.0)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    decode = DecodeStep(args.rows, args.layers, args.hidden, args.ffn, device, dtype)
    with torch.inference_mode():
        run: Callable[[], object] = decode
        if cuda:
            decode()  # warm-up (cuBLAS handles) before the capture
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                decode()
            run = graph.replay
        stopped: list[int] = []  # SIGTERM ends the loop early, with the report still printed
        signal.signal(signal.SIGTERM, lambda signum, frame: stopped.append(signum))
        print("decode load running", flush=True)
        period = 1.0 / args.steps_per_s if args.steps_per_s > 0 else 0.0
        start = time.perf_counter()
        steps = 0
        while time.perf_counter() - start < args.seconds and not stopped:
            run()
            steps += 1
            if cuda:
                torch.cuda.synchronize(device)  # one step in flight, as a decode loop has
            due = start + steps * period
            if due > time.perf_counter():
                time.sleep(due - time.perf_counter())  # pacing a load, not synchronising
    elapsed = time.perf_counter() - start
    report = {"steps": steps, "seconds": elapsed, "steps_per_s": steps / elapsed}
    print(f"decode load done: {steps} steps in {elapsed:.1f} s ({steps / elapsed:.1f} steps/s)", flush=True)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.exit(0)
