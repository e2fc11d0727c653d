"""Where the audio stage makes the host wait for the GPU, and how busy the GPU is in a batch.

    python -m bench.stage_syncs --device cuda --batches 1,8,32,64 --json out.json

Under load the stage was ~90% busy while the GPU ran kernels only ~65% of the time. Every
point where the host waits for the device (a device-to-host copy, a pageable host-to-device
copy, `.item()`) empties the GPU's queue: the Python work after it runs with the GPU idle.
This tool builds the stage the engine builds (`engine.build_stage` with the default
`EngineConfig`: bf16 flow, compiled DiT, CUDA graphs, prompt cache; `--config k=v` changes a
field) on a full-size random model and runs batches of chunks shaped like the load
benchmark's (prompt `--prompt-tokens`, 50 tokens of left context, 25/20/15 new tokens + 3
lookahead; every row its own vocoder stream, advanced batch after batch; `--opening N`: every
row an utterance's first chunk of N new tokens instead, the round a burst of sessions
starting together opens with). Per batch size:

* `wall_ms`: the mean over `--reps` batches of `AudioStage._compute` (flow, vocoder, PCM
  to host); `gpu_busy_ms`: the mean union of the CUDA kernel intervals per batch, and
  `gpu_busy_share` their ratio (kernels only are recorded: cheap to read back);
* `syncs`: each line of this repository whose call made the host wait for the device during
  one batch (`torch.cuda.set_sync_debug_mode`), with how often; CUDA only;
* `kernels` (`--kernels N`): the N kernels with the most device time per batch, and
  `families`, the share of each kernel family (GEMM, attention, copies, ...) in it;
* `host` (`--host N`): the N functions of this repository with the most host time per
  batch (cumulative, under `cProfile`, whose own cost inflates call-heavy code: a ranking,
  not a timing). At one chunk the GPU sits idle while the host prepares the flow's inputs
  (round 14 of docs/benchmarks.md): this says which of our functions that time is in;
* `--busy N,M,...`: each batch size measured once per count of Python threads kept busy
  beside it (pure-Python loops, no I/O, for `--busy-duty` of every 10 ms: they hold the
  GIL as the gateway's event loop does under load, while the stage thread needs it for
  every launch; `bench.gil_contention` models the mechanism), `busy` in each result. In the gateway a 64-session opening round took 3-4x the same round alone (round
  17 of docs/benchmarks.md); this says how much of that one busy thread can cause.
  `--switch-ms A,B`: the measurements beside busy threads again under each interpreter
  switch interval (`sys.setswitchinterval`; Python's default 5 ms, the gateway's
  `--gil-switch-interval-ms`): how long a thread that gave the lock up waits to get it back;
* `--trace FILE` (CUDA): a timeline of two more batches per size, host operators and
  kernels (gzipped Chrome trace, `FILE`'s stem + `_rows<n>.json.gz`): where the GPU waits
  between kernels and what the host runs meanwhile;
* `--pcm FILE`: the PCM of one more batch per size, saved (`.npz`, `rows_<n>` per size):
  the same seeds give two runs the same inputs, so two builds or settings (say
  `--config flow_attention=cudnn`, which one process cannot hold twice) compare by
  `pcm_difference`.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import gzip
import json
import math
import pstats
import shutil
import statistics
import sys
import threading
import time
import traceback
import typing
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from bench.flow_profile import family
from bench.gil_contention import loop_thread
from engine.config import EngineConfig
from engine.config_values import convert_value
from engine.stage_pool import build_stage
from engine.hub import resolve_model
from engine.models.flow import FlowChunk
from engine.models.loader import LoadedModel, load_model
from engine.stage_profile import union_within, kernel_intervals
from engine.token2wav import AudioStage, ChunkJob

ROOT = Path(__file__).resolve().parents[1]
LEFT, LOOKAHEAD = 50, 3


def make_batch(stage: AudioStage, streams: list[object], prompt: tuple[torch.Tensor, ...], step: int,
               opening: int = 0) -> list[ChunkJob]:
    """One chunk per stream, as the engine's `_flow_job` cuts them, `step` chunks into each
    utterance (the window slides with it); `opening` > 0: every row an utterance's first
    chunk of that many new tokens instead (no left context, a fresh vocoder stream: a
    burst of sessions starting together)."""
    tokens, feat, emb = prompt
    p = int(tokens.numel())
    gen = torch.Generator().manual_seed(step)
    jobs = []
    if opening:
        for _ in streams:
            window = torch.randint(0, 6561, (opening + LOOKAHEAD,), generator=gen)
            chunk = FlowChunk(tokens=torch.cat([tokens, window]), prompt_feat=feat, embedding=emb,
                              num_prompt_tokens=p, out_start=p, finalize=False, noise_offset=0)
            jobs.append(ChunkJob(flow=chunk, hift_stream=stage.new_stream(), speed=1.0, chunk_index=0,
                                 is_cancelled=lambda: False))
        return jobs
    for i, stream in enumerate(streams):
        new = (25, 20, 15)[i % 3]
        offset = LEFT + 25 * step
        window = torch.randint(0, 6561, (LEFT + new + LOOKAHEAD,), generator=gen)
        chunk = FlowChunk(tokens=torch.cat([tokens, window]), prompt_feat=feat, embedding=emb,
                          num_prompt_tokens=p, out_start=p + LEFT, finalize=False, noise_offset=2 * (offset - LEFT))
        jobs.append(ChunkJob(flow=chunk, hift_stream=stream, speed=1.0, chunk_index=step + 1,
                             is_cancelled=lambda: False))
    return jobs


def find_syncs(stage: AudioStage, batch: list[ChunkJob]) -> dict[str, int]:
    """Lines of this repository that made the host wait for the device in one `_compute`."""
    seen: Counter[str] = Counter()

    def hook(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001
        if "synchronizing" not in str(message):
            return
        ours = [f for f in traceback.extract_stack()[:-1]
                if f.filename.startswith(str(ROOT)) and not f.filename.endswith("stage_syncs.py")
                and "site-packages" not in f.filename]  # a virtualenv inside the repository
        where = ours[-1] if ours else None
        seen[f"{Path(where.filename).relative_to(ROOT)}:{where.lineno} {where.line}" if where else filename] += 1

    previous = warnings.showwarning
    warnings.showwarning = hook
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = hook
            torch.cuda.set_sync_debug_mode("warn")
            try:
                stage._compute(batch)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        warnings.showwarning = previous
    return dict(seen.most_common())


def kernel_table(events: Any, reps: int, top: int) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """The `top` kernels by device time per batch, and each family's share of all of it."""
    per_name: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    for e in events:
        if (e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
                and not e.name.startswith("stage_batch_")):
            per_name[e.name] += e.time_range.end - e.time_range.start
            calls[e.name] += 1
    total = sum(per_name.values()) or 1.0
    families: Counter[str] = Counter()
    for name, us in per_name.items():
        families[family(name)] += us
    table = [{"ms": us / 1e3 / reps, "share": us / total, "calls": round(calls[name] / reps, 1), "kernel": name[:120]}
             for name, us in per_name.most_common(top)]
    return table, {k: round(v / total, 3) for k, v in families.most_common()}


def print_kernels(kernels: list[dict[str, Any]]) -> None:
    """`kernel_table`'s rows, one indented line each, under a bench's result line."""
    for k in kernels:
        print(f"        {k['ms']:8.2f} ms x{k['calls']:<5} {k['kernel'][:100]}")


def write_results(path: Path | None, device: torch.device, args: argparse.Namespace, results: list[Any]) -> None:
    """A kernel bench's JSON: its device, its arguments as given and its rows (none without `path`)."""
    if path:
        path.write_text(json.dumps({"device": str(device), "args": {k: str(v) for k, v in vars(args).items()},
                                    "results": results}, indent=1))


def host_table(stage: AudioStage, batches: list[list[ChunkJob]], top: int) -> list[dict[str, Any]]:
    """The `top` functions of this repository by cumulative host time per batch, over
    `_compute` of each batch under cProfile (each batch's PCM copy waits for the GPU, so
    the GPU's time shows up in `_start_host_copy`)."""
    prof = cProfile.Profile()
    for batch in batches:
        prof.runcall(stage._compute, batch)
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    rows = []
    for (filename, line, name), (_, calls, tottime, cumtime, _) in stats.items():
        if not filename.startswith(str(ROOT)) or "site-packages" in filename:
            continue
        where = f"{Path(filename).relative_to(ROOT)}:{line} {name}"
        rows.append({"function": where, "cum_ms": 1e3 * cumtime / len(batches),
                     "self_ms": 1e3 * tottime / len(batches), "calls": calls / len(batches)})
    rows.sort(key=lambda r: -r["cum_ms"])
    return rows[:top]


def pcm_difference(a: Path, b: Path) -> dict[str, float]:
    """Per batch size saved in both `--pcm` files: the RMS of the difference of their PCM
    relative to the RMS of the first's."""
    import numpy as np

    with np.load(a) as x, np.load(b) as y:
        return {k: float(np.sqrt(np.mean((x[k] - y[k]) ** 2)) / max(float(np.sqrt(np.mean(x[k] ** 2))), 1e-12))
                for k in x.files if k in y.files}


@contextlib.contextmanager
def busy_threads(n: int, duty: float = 1.0, period_s: float = 0.01) -> typing.Iterator[None]:
    """`n` threads running pure-Python work for `duty` of every `period_s` (holding the GIL
    but when the interpreter switches; `bench.gil_contention.loop_thread`) until the block ends."""
    stop = threading.Event()
    threads = [loop_thread(duty, period_s, stop) for _ in range(n)]
    for i, t in enumerate(threads):
        t.name = f"busy-{i}"
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join()


def measure(stage: AudioStage, prompt: tuple[torch.Tensor, ...], rows: int, reps: int, cuda: bool,
            top: int = 0, profile: bool = True, host: int = 0, pcm: dict[str, Any] | None = None,
            opening: int = 0, busy: int = 0, busy_duty: float = 1.0, trace: Path | None = None) -> dict[str, Any]:
    streams = [stage.new_stream() for _ in range(rows)]
    batch_at = functools.partial(make_batch, stage, streams, prompt, opening=opening)

    step = 0
    for _ in range(2):  # compile, graph capture, prompt cache entry
        stage._compute(batch_at(step))
        step += 1
    walls: list[float] = []
    # Kernels only (no CPU operator events): cheap to record and to read back. Each
    # `_compute` ends by copying the PCM to the host, so its kernels finish inside its wall.
    profile = cuda and profile
    activities = [torch.profiler.ProfilerActivity.CUDA] if profile else []
    with (torch.profiler.profile(activities=activities) if profile else contextlib.nullcontext()) as prof, \
            busy_threads(busy, busy_duty):
        for _ in range(reps):
            batch = batch_at(step)
            step += 1
            t0 = time.perf_counter()
            stage._compute(batch)
            walls.append(time.perf_counter() - t0)
    out: dict[str, Any] = {"rows": rows, "busy": busy, "busy_duty": busy_duty if busy else 0.0,
                           "wall_ms": 1e3 * statistics.fmean(walls)}
    if profile:
        kernels = kernel_intervals(prof.events())
        busy_us = union_within(kernels, -math.inf, math.inf)
        out["gpu_busy_ms"] = busy_us / 1e3 / reps
        out["gpu_busy_share"] = out["gpu_busy_ms"] / out["wall_ms"]
        if top:
            out["kernels"], out["families"] = kernel_table(prof.events(), reps, top)
        out["syncs"] = find_syncs(stage, batch_at(step))
        step += 1
    if host:
        batches = [batch_at(step + i) for i in range(reps)]
        out["host"] = host_table(stage, batches, host)
        step += reps
    if pcm is not None:
        import numpy as np

        samples, _, _ = stage._compute(batch_at(step))
        pcm[f"rows_{rows}"] = np.concatenate(samples)
    if trace is not None and cuda:  # after the PCM batch: `--trace` leaves the saved PCM as it was
        step += pcm is not None
        # Host operators and kernels both, for a timeline (GPU idle between kernels and what
        # the host did meanwhile); two batches keep the file small.
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as timeline:
            for _ in range(2):
                stage._compute(batch_at(step))
                step += 1
        path = trace.with_name(f"{trace.stem}_rows{rows}.json")
        timeline.export_chrome_trace(str(path))
        with path.open("rb") as src, gzip.open(f"{path}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        path.unlink()
        out["trace"] = f"{path}.gz"
    return out


def config_overrides(items: list[str]) -> dict[str, Any]:
    """`--config FIELD=VALUE` options as EngineConfig keyword arguments, each value parsed
    as its field is typed (an optional field takes "none" too)."""
    hints = typing.get_type_hints(EngineConfig)
    overrides: dict[str, Any] = {}
    for item in items:
        name, _, value = item.partition("=")
        if name not in hints:
            raise SystemExit(f"unknown EngineConfig field {name!r}")
        overrides[name] = convert_value(value, hints[name], name)
    return overrides


def add_stage_arguments(p: argparse.ArgumentParser, config_example: str) -> None:
    """The options every stage bench takes: where, which model, EngineConfig fields."""
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default="full-random", help="model dir or hub name (default full-random)")
    p.add_argument("--model-cache", type=Path, default=Path("/tmp/models"))
    p.add_argument("--prompt-tokens", type=int, default=106)
    p.add_argument("--config", action="append", default=[], metavar="FIELD=VALUE",
                   help=f"an EngineConfig field for the stage (e.g. {config_example})")


def load_stage_model(args: argparse.Namespace) -> tuple[torch.device, Path, LoadedModel]:
    """The flow and vocoder of `args.model` (no LM) on `args.device`, as Engine.create
    places them: a stage runs where its modules are."""
    device = torch.device(args.device)
    model_dir = resolve_model(args.model, args.model_cache)
    model = load_model(model_dir, load_lm=False)
    model.flow.to(device)
    model.hift.to(device)
    return device, model_dir, model


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_stage_arguments(p, "flow_compile=false")
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--opening", type=int, default=0, metavar="N",
                   help="every row an utterance's first chunk of N new tokens (a burst's opening round)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                   help="record the kernels (GPU busy time, --kernels, syncs); --no-profile: wall time alone")
    p.add_argument("--kernels", type=int, default=0, metavar="N", help="list the N kernels with the most device time")
    p.add_argument("--host", type=int, default=0, metavar="N",
                   help="list the N functions of this repository with the most host time (cProfile)")
    p.add_argument("--busy", default="0", metavar="N,M",
                   help="measure each size beside N (then M ...) busy Python threads")
    p.add_argument("--busy-duty", type=float, default=1.0, metavar="F",
                   help="with --busy: the share of every 10 ms each busy thread runs Python (1 = always)")
    p.add_argument("--switch-ms", default="", metavar="A,B",
                   help="with --busy: repeat the busy measurements under each interpreter switch interval (ms)")
    p.add_argument("--pcm", type=Path, default=None, metavar="FILE",
                   help="save one more batch's PCM per size (.npz), to compare two runs (pcm_difference)")
    p.add_argument("--trace", type=Path, default=None, metavar="FILE",
                   help="CUDA: two more batches per size under torch.profiler (host operators and kernels), "
                        "saved as a gzipped Chrome trace, FILE's stem + _rows<n>.json.gz")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.kernels and not args.profile:
        p.error("--kernels needs the profile (drop --no-profile)")
    device, model_dir, model = load_stage_model(args)
    overrides = config_overrides(args.config)
    config = EngineConfig(model_dir=model_dir, device=args.device, **overrides)
    stage = build_stage(model, device, config)
    assert isinstance(stage, AudioStage)
    g = torch.Generator().manual_seed(0)
    n = args.prompt_tokens
    prompt = (torch.randint(0, 6561, (n,), generator=g), torch.randn(2 * n, 80, generator=g) * 2 - 5,
              torch.randn(192, generator=g))
    report: dict[str, Any] = {"device": str(device), "config": overrides, "prompt_tokens": n,
                              "opening": args.opening, "results": []}
    pcm: dict[str, Any] | None = {} if args.pcm else None
    default_switch = sys.getswitchinterval()
    switches = [float(s) / 1e3 for s in args.switch_ms.split(",") if s] or [default_switch]
    sizes = [(int(b), int(n), s) for b in args.batches.split(",") for n in args.busy.split(",")
             for s in (switches if int(n) else [default_switch])]
    for rows, n_busy, switch in sizes:  # printed and saved as they come: a cut-short run keeps them
        sys.setswitchinterval(switch)
        try:
            r = measure(stage, prompt, rows, args.reps, device.type == "cuda", args.kernels, args.profile,
                        args.host, pcm if n_busy == 0 else None, args.opening, n_busy, args.busy_duty,
                        args.trace if n_busy == 0 else None)
        finally:
            sys.setswitchinterval(default_switch)
        r["switch_ms"] = 1e3 * switch
        report["results"].append(r)
        gpu = f" gpu busy {r['gpu_busy_ms']:.1f} ms ({100 * r['gpu_busy_share']:.0f}%)" if "gpu_busy_ms" in r else ""
        beside = (f" beside {n_busy} thread(s) {args.busy_duty:.0%} busy, switch interval {1e3 * switch:g} ms"
                  if n_busy else "")
        print(f"{r['rows']:4d} chunks{beside}: wall {r['wall_ms']:.1f} ms{gpu}", flush=True)
        for where, count in r.get("syncs", {}).items():
            print(f"        sync x{count}: {where}", flush=True)
        if "families" in r:
            print("        families: " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in r["families"].items()), flush=True)
        for k in r.get("kernels", []):
            print(f"        {100 * k['share']:5.1f}% {k['ms']:7.2f} ms x{k['calls']:<5g} {k['kernel'][:90]}", flush=True)
        for h in r.get("host", []):
            print(f"        host {h['cum_ms']:7.2f} ms (self {h['self_ms']:6.2f}) x{h['calls']:<5g} {h['function'][:100]}",
                  flush=True)
        if args.json:
            args.json.write_text(json.dumps(report, indent=2))
        if args.pcm:
            import numpy as np

            with args.pcm.open("wb") as f:
                np.savez(f, **pcm)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
