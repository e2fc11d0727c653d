"""vLLM vs torch parity and vLLM decode speed for the CosyVoice LMs (run on the H200).

    PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 \
        python3 -m bench.lm_parity --out $OUT [--prompts 8 --tokens 200]

CosyVoice2 (`Qwen2LM`: llm_embedding sos/task_id rows, llm_decoder with bias), exact
fp32 token parity, exit status 1 if any greedy sequence differs:

    PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 TRITON_F32_DEFAULT=ieee \
        python3 -m bench.lm_parity --model full-random-cv2 --mode parity --dtype float32 \
        --enforce-eager --out $OUT --json $OUT/lm_parity_cv2.json

1. Builds the LM: --model names a random model of `engine.hub` (full-random,
   full-random-cv2, tiny-...; built in memory, nothing is written) or a model
   directory (its llm.pt, real weights). For random weights `init_random_` gives
   N(0, 0.02) everywhere, which makes the speech logits nearly flat (std ~0.6) and
   greedy decoding a string of near-ties; `llm_decoder` is therefore re-drawn with a
   larger std (--decoder-std, default 0.5: logit std ~15, typical top-2 gap ~3) so a
   greedy mismatch means a real difference, not a coin flip. CosyVoice2's decoder
   bias is re-drawn too (--bias-std, default 2.0), large enough that a dropped bias
   changes most greedy tokens.
2. Greedy, fixed-length decoding of N prompts of different lengths with the torch
   model (fp32 and bf16, on cuda, KV cache) and with vLLM (bf16) over the export.
   Reports per-prompt first divergence, whole-sequence match rate and the top-2
   logit gap (fp32 torch, teacher-forced on vLLM's own tokens) at every step where
   vLLM's choice differs from fp32's arg-max.
3. vLLM RAS sampling sanity (no text/stop ids, repetition rate) and decode speed:
   tokens/s at 1/16/64 concurrent streams, first-token latency, engine start time.
Writes lm_parity.json to --out.

--mode speed runs only the vLLM decode-speed part (e.g. to compare --head unified vs
--head speech in one job); --mode parity runs only torch fp32 vs vLLM greedy, for
exact parity use `--dtype float32` (vLLM then picks TRITON_ATTN; also set
TRITON_F32_DEFAULT=ieee so Triton's fp32 dots are not TF32). The JSON name carries
the mode, dtype and head: lm_parity[-<mode>-<dtype>-<head>][-cv2].json (or --json).

--head auto (default) is the unified head for CosyVoice3 and the speech head (the
only one that carries a bias) for CosyVoice2; the speech head needs our vLLM plugin,
whose entry point this script makes visible itself when it is not installed.

Exit status: 2 if the vLLM part failed, 1 if --check tokens (the default for
--dtype float32 outside --mode speed) finds a greedy sequence of vLLM that differs
from torch fp32's, else 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from engine.backends.base import LMRequest, SamplingParams
from engine.backends.vllm_backend import CUDAGRAPH_MODES
from engine.backends.vllm_export import export_from_module, speech_head_plugin_installed
from engine.hub import RANDOM_MODELS
from engine.config import DEFAULT_VLLM_GRAPH_MODE
from engine.models.config import ModelConfig
from engine.models.cv2_config import cv2_model_config
from engine.models.lm import CosyVoice3LM, build_prompt, init_random_, unified_vocab
from engine.models.loader import load_state_strict, module_classes, read_model_config


def log(msg: str) -> None:
    print(f"[lm_parity {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def make_prompts(cfg: Any, n: int, seed: int) -> list[list[int]]:
    """Prompts of varied length: [sos, text, task_id, prompt speech]."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        n_text = 8 + (i * 37) % 90
        n_speech = 0 if i % 4 == 3 else 20 + (i * 53) % 200  # some with no prompt speech
        text = torch.randint(0, 151643, (n_text,), generator=g).tolist()
        speech = torch.randint(0, cfg.speech_token_size, (n_speech,), generator=g).tolist()
        out.append(build_prompt(cfg, [], text, speech))
    return out


@torch.no_grad()
def torch_greedy(lm: CosyVoice3LM, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Greedy decode with the KV cache; all prompts decode together after per-row prefill.
    Only codebook ids may be chosen (fixed length: stop ids masked, text ids never)."""
    dev = next(lm.parameters()).device
    speech = lm.cfg.speech_token_size
    cache = lm.new_cache(rows=len(prompts), length=max(map(len, prompts)) + steps + 1)
    last = []
    for r, p in enumerate(prompts):
        cache.add_row()
        h = lm(torch.tensor([p], device=dev), cache, start_row=r)
        last.append(lm.speech_logits(h[:, -1])[0])
    logits = torch.stack(last)
    seqs: list[list[int]] = [[] for _ in prompts]
    for _ in range(steps):
        nxt = logits[:, :speech].float().argmax(-1)
        for r, t in enumerate(nxt.tolist()):
            seqs[r].append(t)
        h = lm(nxt[:, None], cache, start_row=0)
        logits = lm.speech_logits(h[:, -1])
    return seqs


@torch.no_grad()
def teacher_forced_logits(lm: CosyVoice3LM, prompt: list[int], seq: list[int]) -> torch.Tensor:
    """Speech-code logits [len(seq), 6561] predicting each token of seq from its prefix."""
    dev = next(lm.parameters()).device
    ids = torch.tensor([prompt + seq[:-1]], device=dev)
    h = lm(ids)[0, len(prompt) - 1:]
    return lm.speech_logits(h)[:, : lm.cfg.speech_token_size].float()


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(name: str, ref: list[list[int]], other: list[list[int]]) -> dict[str, Any]:
    divs = [first_divergence(r, o) for r, o in zip(ref, other)]
    same = sum(x == y for r, o in zip(ref, other) for x, y in zip(r, o))
    total = sum(len(r) for r in ref)
    res = {"pair": name, "identical_sequences": sum(d is None for d in divs), "num_sequences": len(ref),
           "first_divergence": divs, "positionwise_match_rate": same / max(total, 1)}
    log(f"{name}: identical {res['identical_sequences']}/{len(ref)}, first divergence {divs}, "
        f"position match {res['positionwise_match_rate']:.4f}")
    return res


def teacher_forced_agreement(lm32: CosyVoice3LM, prompts: list[list[int]], seqs: list[list[int]],
                             name: str) -> dict[str, Any]:
    """Per-step agreement of vLLM's tokens with fp32's arg-max given vLLM's own prefix:
    no compounding, and the top-2 gap tells whether a mismatch was a near-tie."""
    agree = total = 0
    mismatches: list[dict[str, float]] = []
    gaps_all: list[float] = []
    for k, (p, s) in enumerate(zip(prompts, seqs)):
        lg = teacher_forced_logits(lm32, p, s)
        top2 = lg.topk(2, dim=-1)
        gaps = (top2.values[:, 0] - top2.values[:, 1]).tolist()
        gaps_all += gaps
        for i, t in enumerate(s):
            total += 1
            if top2.indices[i, 0].item() == t:
                agree += 1
            else:
                mismatches.append({"prompt": k, "step": i, "top2_gap_fp32": gaps[i],
                                   "fp32_logit_gap_to_vllm_choice": float(lg[i].max() - lg[i, t])})
    res = {"agreement": agree / max(total, 1), "steps": total, "mismatches": mismatches[:50],
           "median_top2_gap": statistics.median(gaps_all), "min_top2_gap": min(gaps_all)}
    log(f"teacher-forced fp32 argmax vs {name}: agreement {res['agreement']:.4f} over {total} steps; "
        f"{len(mismatches)} mismatches; gaps at mismatches "
        f"{[round(m['top2_gap_fp32'], 3) for m in mismatches[:10]]}; median top-2 gap {res['median_top2_gap']:.3f}")
    return res


async def run_requests(backend: Any, prompts: list[list[int]], sp: SamplingParams, tag: str
                       ) -> tuple[list[list[int]], list[float], float]:
    """Run all prompts concurrently; returns (tokens, first-token latencies, wall seconds)."""
    t0 = time.perf_counter()
    firsts: list[float] = [0.0] * len(prompts)

    async def one(i: int, p: list[int]) -> list[int]:
        toks: list[int] = []
        start = time.perf_counter()
        async for t in backend.generate(LMRequest(f"{tag}-{i}", tuple(p), sp)):
            if not toks:
                firsts[i] = time.perf_counter() - start
            toks.append(t)
        return toks

    seqs = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return list(seqs), firsts, time.perf_counter() - t0


def repeat_rate(seqs: list[list[int]], win: int = 10) -> float:
    hits = total = 0
    for s in seqs:
        for i in range(1, len(s)):
            total += 1
            hits += s[i] in s[max(0, i - win):i]
    return hits / max(total, 1)


async def vllm_part(args: argparse.Namespace, export_dir: Path, vocab: Any, prompts: list[list[int]],
                    lm_cfg: Any, res: dict[str, Any]) -> None:
    """Fills `res` as it goes, so a failure late in the run keeps the earlier numbers."""
    from engine.backends.vllm_backend import VLLMBackend

    backend = VLLMBackend(export_dir, vocab, gpu_memory_utilization=args.gpu_mem,
                          max_model_len=args.max_model_len, max_num_seqs=max(args.concurrency),
                          dtype=args.dtype, enforce_eager=args.enforce_eager,
                          async_scheduling=args.async_scheduling, cudagraph_mode=args.cudagraph_mode)
    t = time.perf_counter()
    await backend.start()
    res["engine_start_s"] = time.perf_counter() - t
    log(f"vLLM engine started in {res['engine_start_s']:.1f} s")

    greedy = SamplingParams(greedy=True, fixed_length=args.tokens)
    await run_requests(backend, prompts[:2], replace(greedy, fixed_length=8), "warm")
    if args.mode == "speed":
        await vllm_speed(args, backend, lm_cfg, res)
        await backend.close()
        return
    seqs, _, _ = await run_requests(backend, prompts, greedy, "greedy")
    res["greedy_tokens"] = seqs
    # Same greedy requests again, one at a time: batch composition must not change results much.
    seqs_solo = []
    for i, p in enumerate(prompts[:2]):
        s, _, _ = await run_requests(backend, [p], greedy, f"solo{i}")
        seqs_solo += s
    res["greedy_solo_vs_batched_identical"] = [a == b for a, b in zip(seqs_solo, seqs[:2])]
    if args.mode == "parity":
        await backend.close()
        return

    # RAS sampling sanity: only codebook ids, exact lengths, repetition rate vs greedy.
    ras = SamplingParams(fixed_length=args.tokens, seed=1234)
    ras_seqs, _, _ = await run_requests(backend, prompts, ras, "ras")
    ras2, _, _ = await run_requests(backend, prompts[:2], ras, "ras-again")
    res["ras"] = {
        "lengths_ok": all(len(s) == args.tokens for s in ras_seqs),
        "all_codebook_ids": all(0 <= t < lm_cfg.speech_token_size for s in ras_seqs for t in s),
        "repeat_rate_in_window10": repeat_rate(ras_seqs),
        "greedy_repeat_rate_in_window10": repeat_rate(seqs),
        "seeded_runs_identical": [a == b for a, b in zip(ras2, ras_seqs[:2])],
        "distinct_ids": len({t for s in ras_seqs for t in s}),
    }
    log(f"RAS sanity: {res['ras']}")

    # Early stop: with min_tokens and no fixed length the stream may end on any stop id;
    # check that min_tokens is honoured and no stop id is yielded.
    stop_sp = SamplingParams(min_tokens=5, max_tokens=60, seed=7)
    st, _, _ = await run_requests(backend, prompts[:4], stop_sp, "stop")
    res["stop_check"] = {"lengths": [len(s) for s in st],
                         "ok": all(5 <= len(s) <= 60 and all(t < lm_cfg.speech_token_size for t in s) for s in st)}

    # Abort: close a stream after a few tokens; the slot must be freed.
    agen = backend.generate(LMRequest("abort-me", tuple(prompts[0]), SamplingParams(fixed_length=500)))
    got = [await agen.__anext__() for _ in range(3)]
    await backend.abort("abort-me")
    rest = [t async for t in agen]
    res["abort_check"] = {"tokens_before": len(got), "tokens_after_abort": len(rest),
                          "active_after": backend.num_active()}
    log(f"stop check {res['stop_check']}, abort check {res['abort_check']}")
    await vllm_speed(args, backend, lm_cfg, res)
    await backend.close()


async def vllm_speed(args: argparse.Namespace, backend: Any, lm_cfg: Any, res: dict[str, Any]) -> None:
    # Throughput: c concurrent RAS streams of args.speed_tokens each; warm each shape first.
    speed = []
    g = torch.Generator().manual_seed(99)
    for c in args.concurrency:
        ps = [build_prompt(lm_cfg, [], torch.randint(0, 151643, (40,), generator=g).tolist(),
                           torch.randint(0, 6561, (100,), generator=g).tolist()) for _ in range(c)]
        await run_requests(backend, ps, SamplingParams(fixed_length=32, seed=1), f"w{c}")
        ps = [[*p[:-1], (p[-1] + 1) % 6561] for p in ps]  # new last token: no full prefix hit
        toks, firsts, wall = await run_requests(backend, ps, SamplingParams(fixed_length=args.speed_tokens, seed=2),
                                                f"s{c}")
        n = sum(len(s) for s in toks)
        row = {"concurrency": c, "tokens": n, "wall_s": wall, "tokens_per_s": n / wall,
               "tokens_per_s_per_stream": n / wall / c,
               "first_token_ms_median": 1000 * statistics.median(firsts),
               "first_token_ms_max": 1000 * max(firsts),
               "realtime_factor_per_stream": (n / wall / c) / 25.0}
        speed.append(row)
        log(f"c={c}: {row['tokens_per_s']:.0f} tok/s total, {row['tokens_per_s_per_stream']:.0f} tok/s/stream "
            f"(x{row['realtime_factor_per_stream']:.1f} real time), first token median "
            f"{row['first_token_ms_median']:.1f} ms, max {row['first_token_ms_max']:.1f} ms")
    res["speed"] = speed


def build_lm(args: argparse.Namespace) -> tuple[CosyVoice3LM, Any, str]:
    """(fp32 LM in eval mode on the CPU, its LMConfig, model version) for --model."""
    if args.model in RANDOM_MODELS:
        size, version = RANDOM_MODELS[args.model]
        mc = cv2_model_config(size) if version == "cosyvoice2" else (ModelConfig.tiny() if size == "tiny" else ModelConfig())
        lm_cls = module_classes(version)[0]
        lm = lm_cls(mc.lm)
        init_random_(lm, args.seed)
        with torch.no_grad():
            g = torch.Generator().manual_seed(args.seed + 1)
            lm.llm_decoder.weight.copy_(torch.randn(lm.llm_decoder.weight.shape, generator=g) * args.decoder_std)
            if lm.llm_decoder.bias is not None:  # CosyVoice2: make the bias decide arg-maxes
                lm.llm_decoder.bias.copy_(torch.randn(lm.llm_decoder.bias.shape, generator=g) * args.bias_std)
        return lm.eval(), mc.lm, version
    model_dir = Path(args.model)
    if not model_dir.is_dir():
        raise SystemExit(f"--model {args.model!r}: neither {sorted(RANDOM_MODELS)} nor a model directory")
    mc = read_model_config(model_dir)
    lm = module_classes(mc.version)[0](mc.lm)
    load_state_strict(lm, model_dir / "llm.pt", "llm.pt")
    return lm.eval(), mc.lm, mc.version


def make_plugin_visible(site_dir: Path) -> None:
    """Let vLLM find the speech-head model class in a source checkout: declare the
    plugin in site_dir and put site_dir on this process's path and PYTHONPATH (which
    vLLM's engine-core process inherits)."""
    from engine.backends.vllm_model import write_plugin_dist_info

    write_plugin_dist_info(site_dir)
    sys.path.insert(0, str(site_dir))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(site_dir), os.environ.get("PYTHONPATH")) if p)
    if not speech_head_plugin_installed():
        raise SystemExit(f"the vLLM plugin entry point written into {site_dir} is not visible")
    log(f"vLLM plugin entry point declared in {site_dir}")


def check_tokens(result: dict[str, Any]) -> list[str]:
    """Problems that make the token check fail: missing vLLM tokens or any torch fp32
    vs vLLM greedy sequence that differs."""
    pairs = [p for p in result["parity"] if p["pair"].startswith("torch_fp32 vs vllm")]
    if not pairs:
        return ["no vLLM greedy tokens to compare"]
    p = pairs[0]
    if p["identical_sequences"] != p["num_sequences"]:
        return [f"{p['pair']}: {p['identical_sequences']}/{p['num_sequences']} identical, "
                f"first divergence {p['first_divergence']}"]
    return []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--speed-tokens", type=int, default=256)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--decoder-std", type=float, default=0.5)
    ap.add_argument("--bias-std", type=float, default=2.0, help="CosyVoice2 llm_decoder bias std (random models)")
    ap.add_argument("--model", default=None,
                    help=f"random model name ({', '.join(RANDOM_MODELS)}) or a model directory; "
                         "default full-random (tiny-random with --tiny)")
    ap.add_argument("--export-dir", default=None, help="default /tmp/cv3-vllm-unified (CosyVoice2: /tmp/cv2-vllm-speech)")
    ap.add_argument("--gpu-mem", type=float, default=0.3)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="small model (CPU smoke test of the script)")
    ap.add_argument("--mode", choices=["full", "speed", "parity"], default="full")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="vLLM export + engine dtype")
    ap.add_argument("--head", choices=["auto", "unified", "speech"], default="auto",
                    help="vLLM lm_head: all unified-vocab rows, or speech rows only (plugin class); "
                         "auto = unified for CosyVoice3, speech for CosyVoice2 (its head has a bias)")
    ap.add_argument("--enforce-eager", action="store_true", help="vLLM without torch.compile/CUDA graphs")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="vLLM schedules one step ahead (the engine's default is off: bistream needs it off)")
    ap.add_argument("--cudagraph-mode", default=DEFAULT_VLLM_GRAPH_MODE, choices=CUDAGRAPH_MODES,
                    help=f"vLLM's CUDA graph mode (default {DEFAULT_VLLM_GRAPH_MODE}, the engine's)")
    ap.add_argument("--json", default=None, help="result path (default <out>/lm_parity[-tag].json)")
    ap.add_argument("--check", choices=["auto", "tokens", "off"], default="auto",
                    help="tokens: exit 1 unless every vLLM greedy sequence equals torch fp32's; "
                         "auto = tokens for --dtype float32 outside --mode speed")
    ap.add_argument("--plugin-dir", default="/tmp/cosyvoice-vllm-plugin",
                    help="where to declare the vLLM plugin if it is not installed (speech head)")
    args = ap.parse_args()
    if args.model is None:
        args.model = "tiny-random" if args.tiny else "full-random"
    # The fp32 reference must be IEEE fp32, not TF32 (these are torch's defaults; be explicit).
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    t = time.perf_counter()
    lm32, cfg, version = build_lm(args)
    cv2 = version == "cosyvoice2"
    if args.head == "auto":
        args.head = "speech" if lm32.llm_decoder.bias is not None else "unified"
    if args.export_dir is None:
        args.export_dir = "/tmp/cv2-vllm-speech" if cv2 else "/tmp/cv3-vllm-unified"
    check = args.check if args.check != "auto" else ("tokens" if args.dtype == "float32" and args.mode != "speed"
                                                     else "off")
    tag = "" if args.mode == "full" and args.dtype == "bfloat16" and args.head == "unified" else \
        f"-{args.mode}-{args.dtype}-{args.head}"
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = Path(args.json) if args.json else out_dir / f"lm_parity{tag}{'-cv2' if cv2 else ''}.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    dev = torch.device(args.device)

    vocab = unified_vocab(cfg)
    lm32 = lm32.to(dev)
    log(f"built {args.model} ({version}) LM in {time.perf_counter() - t:.1f} s")
    if args.head == "speech" and not speech_head_plugin_installed():
        make_plugin_visible(Path(args.plugin_dir))
    t = time.perf_counter()
    export_dir = Path(args.export_dir)
    export_from_module(lm32, cfg.qwen, cfg, vocab, export_dir, dtype=getattr(torch, args.dtype),
                       fingerprint=f"random-{args.seed}", head=args.head)
    log(f"exported to {export_dir} in {time.perf_counter() - t:.1f} s")

    prompts = make_prompts(cfg, args.prompts, args.seed)
    result: dict[str, Any] = {"args": vars(args), "version": version, "check": check,
                              "prompt_lengths": [len(p) for p in prompts],
                              "torch": torch.__version__,
                              "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"}
    ref32 = ref16 = backend_seqs = None
    if args.mode != "speed":
        t = time.perf_counter()
        ref32 = torch_greedy(lm32, prompts, args.tokens)
        log(f"torch fp32 greedy in {time.perf_counter() - t:.1f} s")
    result["parity"] = []
    if args.mode == "full":
        ref16, backend_seqs = torch_bf16_part(args, lm32, cfg, vocab, prompts, ref32, dev, result)
    vres: dict[str, Any] = {"speed": []}
    result["vllm"] = vres
    json_path.write_text(json.dumps(result, indent=1))  # in case vLLM dies hard
    try:
        asyncio.run(vllm_part(args, export_dir, vocab, prompts, cfg, vres))
    except Exception:  # keep what was measured; the traceback goes into the JSON too
        import traceback

        vres["error"] = traceback.format_exc()
        log("vLLM part failed:\n" + vres["error"])
    vseqs = vres.pop("greedy_tokens", None)
    vname = f"vllm_{args.dtype}_{args.head}"
    if vseqs is not None and ref32 is not None:
        result["parity"].append(compare(f"torch_fp32 vs {vname}", ref32, vseqs))
        if ref16 is not None:
            result["parity"].append(compare(f"torch_bf16 vs {vname}", ref16, vseqs))
        if backend_seqs is not None:
            result["parity"].append(compare(f"TorchLMBackend_bf16 vs {vname}", backend_seqs, vseqs))
        result[f"teacher_forced_{vname}_vs_fp32"] = teacher_forced_agreement(lm32, prompts, vseqs, vname)
    result["sequences"] = {"torch_fp32": ref32, "torch_bf16": ref16, vname: vseqs,
                           "torch_backend_bf16": backend_seqs}
    json_path.write_text(json.dumps(result, indent=1))
    log("summary:")
    for p in result["parity"]:
        print(f"  {p['pair']:28s} identical {p['identical_sequences']}/{p['num_sequences']} "
              f"match {p['positionwise_match_rate']:.4f} first_div {p['first_divergence']}")
    for s in vres["speed"]:
        print(f"  vllm c={s['concurrency']:3d}: {s['tokens_per_s']:8.0f} tok/s  {s['tokens_per_s_per_stream']:6.0f}/stream"
              f"  first token {s['first_token_ms_median']:.1f} ms (max {s['first_token_ms_max']:.1f})")
    print(f"  engine start {vres.get('engine_start_s', float('nan')):.1f} s", flush=True)
    sys.stdout.flush()
    if "error" in vres:
        log(f"FAILED: the vLLM part raised (traceback in {json_path})")
        sys.exit(2)
    if check == "tokens":
        problems = check_tokens(result)
        result["check_failures"] = problems
        json_path.write_text(json.dumps(result, indent=1))
        if problems:
            log("FAILED token check: " + "; ".join(problems))
            sys.exit(1)
        log("token check passed: every vLLM greedy sequence equals torch fp32's")


def torch_bf16_part(args: argparse.Namespace, lm32: CosyVoice3LM, cfg: Any, vocab: Any, prompts: list[list[int]],
                    ref32: list[list[int]], dev: torch.device, result: dict[str, Any]) -> tuple[Any, Any]:
    """torch bf16 greedy (own loop and TorchLMBackend) vs fp32; the bf16 baseline."""
    lm16 = type(lm32)(cfg).to(dev)  # CosyVoice3LM or CosyVoice2's Qwen2LM
    lm16.load_state_dict(lm32.state_dict())
    lm16 = lm16.to(torch.bfloat16).eval()
    t = time.perf_counter()
    ref16 = torch_greedy(lm16, prompts, args.tokens)
    log(f"torch bf16 greedy in {time.perf_counter() - t:.1f} s")
    result["parity"].append(compare("torch_fp32 vs torch_bf16", ref32, ref16))
    # The engine's TorchLMBackend (batched decode loop) on the same bf16 weights.
    backend_seqs = None
    try:
        from engine.backends.torch_backend import TorchLMBackend

        async def run_torch_backend() -> list[list[int]]:
            tb = TorchLMBackend(lm16, vocab, dev, torch.bfloat16, max_batch=64)
            seqs, _, wall = await run_requests(tb, prompts, SamplingParams(greedy=True, fixed_length=args.tokens), "tb")
            log(f"TorchLMBackend bf16 greedy in {wall:.1f} s")
            await tb.close()
            return seqs

        backend_seqs = asyncio.run(run_torch_backend())
        result["parity"].append(compare("torch_loop_bf16 vs TorchLMBackend_bf16", ref16, backend_seqs))
    except Exception:
        import traceback

        result["torch_backend_error"] = traceback.format_exc()
        log("TorchLMBackend run failed:\n" + result["torch_backend_error"])
    del lm16
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    result["teacher_forced_torch_bf16_vs_fp32"] = teacher_forced_agreement(lm32, prompts, ref16, "torch_bf16")
    return ref16, backend_seqs


if __name__ == "__main__":
    main()
