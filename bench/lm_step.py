"""Where a lone session's LM time goes on vLLM: the first token, the first chunk's decode
steps, a long decode (run on the H200).

    python -m bench.lm_step --variant default --out $OUT [--pyspy /tmp/site_bin/py-spy] [--profile]

At one session the gateway's first audio is the LM's first token (~14 ms), ten decode steps
for an 8-token first chunk and its 3 lookahead tokens (~34 ms), then one stage round (~27 ms)
(round 32 of docs/benchmarks.md). This runs the product's vLLM backend alone on prompts
shaped like the load benchmark's (a 106-token voice prompt, 15 prompt-text tokens, 30 new
text tokens a request, so the prefix cache holds only what it holds in the gateway):

* `first_chunk`: `--requests` requests one after the other, each `--chunk-tokens` tokens:
  time to the first and to the last token where the backend's stream yields them, and vLLM's
  own timings of the same requests (engine core: scheduled -> first token, then per token);
* `decode`: one request of `--decode-tokens`: the gaps between tokens at the stream;
* `--pyspy`: py-spy samples vLLM's engine-core process while each phase runs again
  (`--idle`: waiting counts too, so the samples are the step's wall time) -> raw stacks
  (`lm_step_<variant>_<phase>.txt`) and `bench.stack_summary`'s reading of them;
* `--profile`: vLLM's torch profiler over `--profile-requests` first chunks and a short
  decode: its kernel table and trace (`<out>/profile_<variant>/`).

Variants, one per process (`--variant`):
  default  the product's engine settings
  compiled the RAS processor's per-step function compiled (`engine.vllm_compile_sampling`)
  noseed   requests without a seed (vLLM's sampler then keeps no generator per request)
  nolp     no logits processor: prices the RAS processor (tokens are then any id, not speech)
  vllmmin  vLLM's own min-tokens processor engaged as well (the product before round 34:
           min_tokens passed to vLLM too, repeating our processor's stop mask)
  async    vLLM's async scheduling (the product keeps it off: text-in streaming needs it off)
  piecewise vLLM's own CUDA graph mode, full_and_piecewise: prefills run piecewise (the product
           through round 36; since round 37 `engine.vllm_cudagraph_mode` is "full")
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from engine.backends.base import SamplingParams
from engine.backends.vllm_backend import VLLMBackend
from engine.backends.vllm_export import export_from_module, speech_head_plugin_installed
from engine.config import DEFAULT_VLLM_GRAPH_MODE
from engine.models.lm import build_prompt, unified_vocab

VARIANTS = ("default", "compiled", "noseed", "nolp", "async", "vllmmin", "piecewise")
PROMPT_TEXT_TOKENS = 15
TEXT_TOKENS = 30
PROMPT_SPEECH_TOKENS = 106


def log(msg: str) -> None:
    print(f"[lm_step {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {"p50": round(1000 * statistics.median(values), 3), "p90": round(1000 * percentile(values, 0.9), 3),
            "min": round(1000 * min(values), 3), "max": round(1000 * max(values), 3), "n": len(values)}


class Prompts:
    """Load-benchmark-shaped prompts: one voice (prompt text and speech fixed), new text each."""

    def __init__(self, cfg: Any, seed: int) -> None:
        self.cfg = cfg
        self.g = torch.Generator().manual_seed(seed)
        self.prompt_text = torch.randint(0, 151643, (PROMPT_TEXT_TOKENS,), generator=self.g).tolist()
        self.speech = torch.randint(0, cfg.speech_token_size, (PROMPT_SPEECH_TOKENS,), generator=self.g).tolist()

    def next(self) -> list[int]:
        text = torch.randint(0, 151643, (TEXT_TOKENS,), generator=self.g).tolist()
        return build_prompt(self.cfg, self.prompt_text, text, self.speech)


async def stream_times(backend: VLLMBackend, prompt: list[int], tokens: int, seed: int | None,
                       rid: str) -> list[tuple[float, int]]:
    """(seconds since submission, tokens so far) at each output the stream yields. Reads
    vLLM's stream itself, not `backend.generate`, so that the `nolp` variant's non-speech
    ids count as tokens instead of ending the stream."""
    params = backend._params(SamplingParams(fixed_length=tokens, seed=seed))
    start = time.perf_counter()
    marks: list[tuple[float, int]] = []
    count = 0
    async for out in backend._llm.generate({"prompt_token_ids": prompt}, params, rid):
        count += len(out.outputs[0].token_ids)
        marks.append((time.perf_counter() - start, count))
    return marks


def token_times(marks: list[tuple[float, int]]) -> list[float]:
    """Arrival time of each token (a delta of several tokens gives them one time)."""
    times: list[float] = []
    for t, count in marks:
        times.extend([t] * (count - len(times)))
    return times


async def first_chunks(backend: VLLMBackend, prompts: Prompts, n: int, tokens: int, seed: int | None,
                       tag: str) -> dict[str, Any]:
    firsts, lasts, steps = [], [], []
    for i in range(n):
        times = token_times(await stream_times(backend, prompts.next(), tokens, seed, f"{tag}-{i}"))
        firsts.append(times[0])
        lasts.append(times[-1])
        steps.extend(b - a for a, b in zip(times, times[1:]))
    return {"first_token_ms": ms(firsts), "last_token_ms": ms(lasts), "step_ms": ms(steps)}


async def decode(backend: VLLMBackend, prompts: Prompts, tokens: int, seed: int | None, tag: str) -> dict[str, Any]:
    marks = await stream_times(backend, prompts.next(), tokens, seed, tag)
    gaps = [b[0] - a[0] for a, b in zip(marks, marks[1:])]
    per_output = [(b[1] - a[1]) for a, b in zip(marks, marks[1:])]
    wall = marks[-1][0] - marks[0][0]
    return {"tokens": marks[-1][1], "outputs": len(marks), "gap_ms": ms(gaps),
            "mean_tokens_per_output": round(statistics.mean(per_output), 3) if per_output else None,
            "ms_per_token": round(1000 * wall / max(1, marks[-1][1] - marks[0][1]), 3)}


def engine_core_pid() -> int | None:
    """vLLM's engine-core child of this process (its title starts `VLLM::Engine`)."""
    me, found = os.getpid(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            comm = (entry / "comm").read_text().strip()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == me:
            found.append((not comm.startswith("VLLM::Engine"), int(entry.name)))
    return min(found)[1] if found else None


async def spied(args: argparse.Namespace, phase: str, run_once: Any) -> dict[str, Any]:
    """Runs `run_once` over and over while py-spy records the engine core for
    `--pyspy-seconds`; returns where the raw stacks and their summary are."""
    pid = engine_core_pid()
    if pid is None:
        return {"error": "no engine-core child process"}
    out = Path(args.out)
    raw = out / f"lm_step_{args.variant}_{phase}.txt"
    spy = subprocess.Popen([args.pyspy, "record", "--pid", str(pid), "--rate", str(args.pyspy_rate),
                            "--duration", str(args.pyspy_seconds), "--idle", "--threads", "--nonblocking",
                            "--format", "raw", "-o", str(raw)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    runs = 0
    while spy.poll() is None:
        await run_once(runs)
        runs += 1
    spy_log = spy.stdout.read().decode(errors="replace")[-2000:] if spy.stdout else ""
    summary = out / f"lm_step_{args.variant}_{phase}_top.txt"
    with summary.open("w") as f:
        subprocess.run([sys.executable, "-m", "bench.stack_summary", str(raw), "--rate", str(args.pyspy_rate),
                        "--duration", str(args.pyspy_seconds), "--top", "45"], stdout=f, stderr=subprocess.STDOUT)
    return {"engine_core_pid": pid, "runs": runs, "raw": raw.name, "summary": summary.name,
            "pyspy_rc": spy.returncode, "pyspy_log": spy_log}


async def run(args: argparse.Namespace, export_dir: Path, cfg: Any, vocab: Any, res: dict[str, Any],
              save: Any) -> None:
    """Fills `res`, saved after each phase: a run cut short (vLLM's profiler can take
    long to write its trace) keeps what it measured."""
    engine_args: dict[str, Any] = {}
    if args.variant == "nolp":
        engine_args["logits_processors"] = []
    profile_dir = Path(args.out) / f"profile_{args.variant}"
    if args.profile:
        from vllm.config import ProfilerConfig

        engine_args["profiler_config"] = ProfilerConfig(profiler="torch", torch_profiler_dir=str(profile_dir),
                                                        torch_profiler_with_stack=False, ignore_frontend=True)
    backend = VLLMBackend(export_dir, vocab, gpu_memory_utilization=args.gpu_mem, max_num_seqs=args.max_num_seqs,
                          async_scheduling=args.variant == "async", timing=True, engine_args=engine_args,
                          compile_sampling=args.variant == "compiled",
                          cudagraph_mode="full_and_piecewise" if args.variant == "piecewise" else DEFAULT_VLLM_GRAPH_MODE)
    t = time.perf_counter()
    await backend.start()
    res["engine_start_s"] = round(time.perf_counter() - t, 1)
    log(f"engine started in {res['engine_start_s']} s")
    seed = None if args.variant == "noseed" else 1234
    if args.variant == "vllmmin":
        product_params = backend._params

        def with_vllm_min(sp: SamplingParams) -> Any:
            params = product_params(sp)
            params.min_tokens = params.max_tokens  # every request here is fixed-length
            return params

        backend._params = with_vllm_min  # type: ignore[method-assign]
    prompts = Prompts(cfg, args.seed)
    await first_chunks(backend, prompts, 8, args.chunk_tokens, seed, "warm")
    await decode(backend, prompts, 64, seed, "warm-decode")
    times = backend._times
    before = times.stats_fields() if times else {}
    res["first_chunk"] = await first_chunks(backend, prompts, args.requests, args.chunk_tokens, seed, "chunk")
    if times:
        after = times.stats_fields()
        d = {k: after[k] - before[k] for k in after}
        n = max(1, d["lm_server_requests"])
        res["first_chunk"]["vllm"] = {
            "requests": d["lm_server_requests"],
            "queued_ms": round(1000 * d["lm_server_queued_seconds"] / n, 3),
            "prefill_ms": round(1000 * d["lm_server_prefill_seconds"] / n, 3),
            "decode_ms_per_token": round(1000 * d["lm_server_decode_seconds"] / max(1, d["lm_server_decode_tokens"]), 3),
            "first_token_ms": round(1000 * d["lm_server_first_token_seconds"] / max(1, d["lm_server_first_tokens"]), 3)}
    log(f"first chunks: {json.dumps(res['first_chunk'])}")
    save()
    res["decode"] = await decode(backend, prompts, args.decode_tokens, seed, "decode")
    log(f"decode: {json.dumps(res['decode'])}")
    save()
    if args.pyspy:
        res["pyspy_first_chunk"] = await spied(
            args, "first_chunk", lambda i: stream_times(backend, prompts.next(), args.chunk_tokens, seed, f"spy-c{i}"))
        res["pyspy_decode"] = await spied(
            args, "decode", lambda i: stream_times(backend, prompts.next(), args.decode_tokens, seed, f"spy-d{i}"))
        log(f"py-spy: {res['pyspy_first_chunk'].get('runs')} first chunks, {res['pyspy_decode'].get('runs')} decodes")
        save()
    if args.profile:
        await backend._llm.start_profile()
        await first_chunks(backend, prompts, args.profile_requests, args.chunk_tokens, seed, "prof")
        await decode(backend, prompts, 100, seed, "prof-decode")
        await backend._llm.stop_profile()
        res["profile_dir"] = profile_dir.name
        save()
    await backend.close()


def main() -> None:
    from bench.lm_parity import build_lm, make_plugin_visible

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", choices=VARIANTS, default="default")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--model", default="full-random")
    ap.add_argument("--export-dir", default="/tmp/lm-step-export")
    ap.add_argument("--head", choices=["speech", "unified"], default="speech",
                    help="lm_head rows exported: speech (the engine's choice where the plugin is installed)")
    ap.add_argument("--requests", type=int, default=40, help="first chunks timed, one after the other")
    ap.add_argument("--chunk-tokens", type=int, default=11, help="a first chunk: 8 tokens and 3 of lookahead")
    ap.add_argument("--decode-tokens", type=int, default=1500)
    ap.add_argument("--gpu-mem", type=float, default=0.35)
    ap.add_argument("--max-num-seqs", type=int, default=256, help="the engine's default lm_max_batch")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pyspy", default=None, help="py-spy binary: sample the engine core in each phase")
    ap.add_argument("--pyspy-seconds", type=int, default=6)
    ap.add_argument("--pyspy-rate", type=int, default=1000)
    ap.add_argument("--profile", action="store_true", help="vLLM's torch profiler over a few first chunks")
    ap.add_argument("--profile-requests", type=int, default=5)
    args = ap.parse_args()
    args.decoder_std, args.bias_std = 0.5, 2.0  # what bench.lm_parity's random LM uses
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.head == "speech" and not speech_head_plugin_installed():
        make_plugin_visible(Path("/tmp/cosyvoice-vllm-plugin"))
    t = time.perf_counter()
    lm, cfg, _ = build_lm(args)
    vocab = unified_vocab(cfg)
    export_dir = Path(args.export_dir)
    export_from_module(lm, cfg.qwen, cfg, vocab, export_dir, fingerprint=f"random-{args.seed}", head=args.head)
    del lm
    log(f"built and exported {args.model} in {time.perf_counter() - t:.1f} s")
    result: dict[str, Any] = {"variant": args.variant, "args": vars(args), "torch": torch.__version__,
                              "prompt_tokens": PROMPT_TEXT_TOKENS + TEXT_TOKENS + PROMPT_SPEECH_TOKENS + 2}
    path = Path(args.out) / f"lm_step_{args.variant}.json"

    def save() -> None:
        path.write_text(json.dumps(result, indent=1))

    try:
        asyncio.run(run(args, export_dir, cfg, vocab, result, save))
    except Exception:
        import traceback

        result["error"] = traceback.format_exc()
        log("failed:\n" + result["error"])
    save()
    sys.exit(2 if "error" in result else 0)


if __name__ == "__main__":
    main()
