"""Text-in streaming (bistream) parity: torch backend vs vLLM backend, greedy (run on the H200).

    PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 TRITON_F32_DEFAULT=ieee \\
        python3 -m bench.bistream_parity --out $OUT --dtype float32 --enforce-eager [--cases 8]

Exits 1 when the backends disagree (see `verdict`) or the vLLM part fails, and
prints PARITY OK / PARITY FAILED as its last line.

Builds the full-size CosyVoice3 LM with seeded random weights (llm_decoder re-drawn
with a larger std, as in bench/lm_parity.py, so greedy choices are not near-ties),
exports it for vLLM, then decodes the SAME bistream requests (prompt text with
<|endofprompt|>, prompt speech of 0..100 tokens, target text arriving one token per
arrival) with

* `TorchLMBackend.generate_streaming` (fp32 and the export dtype, on cuda),
* an uncached fp32 reference that re-runs the full context each step
  (engine.bistream's state machine, no KV cache, no batching),
* `VLLMBackend.generate_streaming` (one resumable request per utterance, one
  `StreamingInput` chunk per run),

all requests of a backend concurrently, and with text arriving slowly (--text-rate)
so requests really pause and resume. Reports per-case first divergence and match
rates and, for every vLLM token that differs from the fp32 reference, the fp32 top-2
gap at that step (a near-tie, or a real difference?). Writes bistream_parity.json.
`--tiny` runs the torch part on the CPU (smoke test; vLLM is skipped if missing).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
import traceback
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch

from engine.backends.base import SamplingParams
from engine.backends.vllm_backend import CUDAGRAPH_MODES
from engine.bistream import BistreamRequest, BistreamSpec, LengthLimits
from engine.config import DEFAULT_VLLM_GRAPH_MODE
from engine.models.config import ModelConfig
from engine.models.lm import END_OF_PROMPT_ID, CosyVoice3LM, init_random_, unified_vocab


def log(msg: str) -> None:
    print(f"[bistream_parity {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def make_cases(n: int, seed: int, speech_size: int, text_vocab: int) -> list[tuple[BistreamRequest, list[list[int]]]]:
    g = torch.Generator().manual_seed(seed)
    cases = []
    for i in range(n):
        system = torch.randint(0, text_vocab, (4,), generator=g).tolist()
        transcript = torch.randint(0, text_vocab, (3 + (i * 5) % 20,), generator=g).tolist()
        n_speech = [0, 20, 45, 100][i % 4]
        prompt_speech = torch.randint(0, speech_size, (n_speech,), generator=g).tolist()
        n_text = 10 + (i * 13) % 50
        text = torch.randint(0, text_vocab, (n_text,), generator=g).tolist()
        req = BistreamRequest(f"case{i}", tuple([*system, END_OF_PROMPT_ID, *transcript]), tuple(prompt_speech),
                              SamplingParams(greedy=True), LengthLimits(fixed_ratio=3.0, hard_max=1000))
        cases.append((req, [[t] for t in text]))
    return cases


async def paced(arrivals: list[list[int]], rate: float) -> AsyncIterator[list[int]]:
    start = time.perf_counter()
    for k, a in enumerate(arrivals):
        if rate > 0:
            delay = start + k / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
        yield a


async def run_backend(backend: Any, cases: list, rate: float, tag: str) -> tuple[list[list[int]], float]:
    t0 = time.perf_counter()

    async def one(req: BistreamRequest, arrivals: list[list[int]]) -> list[int]:
        from dataclasses import replace

        r = replace(req, request_id=f"{tag}-{req.request_id}")
        return [t async for t in backend.generate_streaming(r, paced(arrivals, rate))]

    seqs = await asyncio.gather(*(one(r, a) for r, a in cases))
    return list(seqs), time.perf_counter() - t0


@torch.no_grad()
def uncached_reference(lm: CosyVoice3LM, req: BistreamRequest, arrivals: list[list[int]]) -> dict[str, Any]:
    """Greedy decoding without a KV cache: each step re-runs the whole context the state
    machine says was fed (fp32 for the parity runs). Returns the speech tokens, the run
    history, the context and the per-step top-2 logit gaps. The CPU tests use it too."""
    dev = next(lm.parameters()).device
    st = req.new_state(BistreamSpec.from_lm_config(lm.cfg))
    for a in arrivals:
        st.push_text(a)
    st.close_text()
    sts, fill = lm.cfg.speech_token_size, lm.cfg.fill_token
    gaps: list[float] = []
    while not st.done:
        run = st.next_run()
        if run is None:
            break
        while st.in_run:
            rule = st.token_rule()
            if rule.forced is not None:
                st.on_token(rule.forced)
                gaps.append(float("inf"))
                continue
            logits = lm.speech_logits(lm(torch.tensor([st.context], device=dev))[0, -1]).float()
            if not rule.allow_stop:
                keep = logits[fill].clone()
                logits[sts:] = float("-inf")
                if rule.allow_fill:
                    logits[fill] = keep
            top2 = logits.topk(2).values
            gaps.append(float(top2[0] - top2[1]))
            st.on_token(int(torch.argmax(logits)))  # argmax, like the backends (first index on ties)
    return {"speech": st.speech, "history": st.history, "context": st.context, "context_len": len(st.context),
            "gaps": gaps}


def compare(name: str, ref: list[list[int]], other: list[list[int]]) -> dict[str, Any]:
    divs = []
    for r, o in zip(ref, other):
        d = next((i for i, (x, y) in enumerate(zip(r, o)) if x != y), None)
        divs.append(d if d is not None or len(r) == len(o) else min(len(r), len(o)))
    same = sum(x == y for r, o in zip(ref, other) for x, y in zip(r, o))
    total = sum(len(r) for r in ref)
    res = {"pair": name, "identical": sum(d is None for d in divs), "cases": len(ref), "first_divergence": divs,
           "positionwise_match_rate": same / max(total, 1), "lengths": [[len(r), len(o)] for r, o in zip(ref, other)]}
    log(f"{name}: identical {res['identical']}/{len(ref)}, first divergence {divs}, match {res['positionwise_match_rate']:.4f}")
    return res


async def torch_part(lm: CosyVoice3LM, vocab: Any, cases: list, rate: float, dev: torch.device, dtype: torch.dtype,
                     tag: str) -> tuple[list[list[int]], float]:
    from engine.backends.torch_backend import TorchLMBackend

    backend = TorchLMBackend(lm, vocab, device=dev, dtype=dtype)
    try:
        return await run_backend(backend, cases, rate, tag)
    finally:
        await backend.close()


async def vllm_part(args: argparse.Namespace, export_dir: Path, vocab: Any, cases: list, res: dict[str, Any]) -> None:
    from engine.backends.vllm_backend import VLLMBackend

    backend = VLLMBackend(export_dir, vocab, gpu_memory_utilization=args.gpu_mem, max_model_len=args.max_model_len,
                          max_num_seqs=64, dtype=args.dtype, enforce_eager=args.enforce_eager,
                          async_scheduling=args.async_scheduling, cudagraph_mode=args.cudagraph_mode)
    t = time.perf_counter()
    await backend.start()
    res["engine_start_s"] = time.perf_counter() - t
    res["async_scheduling"] = backend._async_scheduling_on()
    try:
        seqs, wall = await run_backend(backend, cases, args.text_rate, "vllm")
        res["tokens"], res["wall_s"] = seqs, wall
        fast, _ = await run_backend(backend, cases, 0.0, "vllm-fast")  # all text at once: same layout
        res["same_tokens_when_text_arrives_at_once"] = [a == b for a, b in zip(seqs, fast)]
        res["active_after"] = backend.num_active()
    finally:
        await backend.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--cases", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--decoder-std", type=float, default=0.5)
    ap.add_argument("--text-rate", type=float, default=30.0, help="text tokens/s per request (0 = all at once)")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="vLLM export + engine dtype")
    ap.add_argument("--export-dir", default="/tmp/cv3-vllm-bistream")
    ap.add_argument("--gpu-mem", type=float, default=0.3)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="small model on the CPU (smoke test)")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="start vLLM with async scheduling (expected: generate_streaming refuses; exit 1)")
    ap.add_argument("--cudagraph-mode", default=DEFAULT_VLLM_GRAPH_MODE, choices=CUDAGRAPH_MODES,
                    help=f"vLLM's CUDA graph mode (default {DEFAULT_VLLM_GRAPH_MODE}, the engine's)")
    ap.add_argument("--require-vllm", action="store_true", help="exit 1 when vLLM is not installed")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / f"bistream_parity-{args.dtype}.json"
    dev = torch.device("cpu" if args.tiny else args.device)

    cfg = (ModelConfig.tiny() if args.tiny else ModelConfig()).lm
    vocab = unified_vocab(cfg)
    lm = init_random_(CosyVoice3LM(cfg), args.seed)
    with torch.no_grad():
        g = torch.Generator().manual_seed(args.seed + 1)
        lm.llm_decoder.weight.copy_(torch.randn(lm.llm_decoder.weight.shape, generator=g) * args.decoder_std)
    lm = lm.to(dev).eval()
    cases = make_cases(args.cases, args.seed, cfg.speech_token_size, min(cfg.qwen.vocab_size, 151643))
    result: dict[str, Any] = {"args": vars(args), "torch": torch.__version__,
                              "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                              "cases": [{"prompt_text": len(r.prompt_text), "prompt_speech": len(r.prompt_speech),
                                         "text": len(a)} for r, a in cases]}

    t = time.perf_counter()
    refs = [uncached_reference(lm, r, a) for r, a in cases]
    ref = [x["speech"] for x in refs]
    result["reference"] = {"seconds": time.perf_counter() - t, "fills": [x["history"].count(cfg.fill_token) for x in refs],
                           "context_len": [x["context_len"] for x in refs]}
    log(f"uncached fp32 reference in {result['reference']['seconds']:.1f} s; fills per case {result['reference']['fills']}")
    parity = result["parity"] = []
    seqs: dict[str, list[list[int]]] = {"reference_fp32": ref}

    seqs["torch_fp32"], wall = asyncio.run(torch_part(lm, vocab, cases, args.text_rate, dev, torch.float32, "t32"))
    parity.append(compare("reference_fp32 vs TorchLMBackend_fp32", ref, seqs["torch_fp32"]))
    if dev.type == "cuda" and args.dtype == "bfloat16":
        lm16 = CosyVoice3LM(cfg)
        lm16.load_state_dict(lm.state_dict())
        seqs["torch_bf16"], _ = asyncio.run(torch_part(lm16, vocab, cases, args.text_rate, dev, torch.bfloat16, "t16"))
        parity.append(compare("TorchLMBackend_fp32 vs TorchLMBackend_bf16", seqs["torch_fp32"], seqs["torch_bf16"]))
    json_path.write_text(json.dumps(result, indent=1))

    vres: dict[str, Any] = {}
    result["vllm"] = vres
    try:
        import vllm  # noqa: F401
    except ImportError:
        vres["skipped"] = "vllm is not installed"
        log("vLLM not installed: torch part only")
    else:
        try:
            from engine.backends.vllm_export import export_from_module

            export_from_module(lm, cfg.qwen, cfg, vocab, Path(args.export_dir), dtype=getattr(torch, args.dtype),
                               fingerprint=f"bistream-random-{args.seed}")
            asyncio.run(vllm_part(args, Path(args.export_dir), vocab, cases, vres))
        except Exception:
            vres["error"] = traceback.format_exc()
            log("vLLM part failed:\n" + vres["error"])
    vseqs = vres.pop("tokens", None)
    if vseqs is not None:
        name = f"vllm_{args.dtype}"
        seqs[name] = vseqs
        parity.append(compare(f"reference_fp32 vs {name}", ref, vseqs))
        parity.append(compare(f"TorchLMBackend_fp32 vs {name}", seqs["torch_fp32"], vseqs))
        if "torch_bf16" in seqs:
            parity.append(compare(f"TorchLMBackend_bf16 vs {name}", seqs["torch_bf16"], vseqs))
        near = []
        for k, (r, v) in enumerate(zip(refs, vseqs)):
            d = next((i for i, (x, y) in enumerate(zip(r["speech"], v)) if x != y), None)
            if d is not None:
                # the gap of the reference's sampling step that produced speech token d
                steps = [i for i, tkn in enumerate(r["history"]) if tkn != cfg.fill_token]
                near.append({"case": k, "speech_index": d, "fp32_top2_gap": r["gaps"][steps[d]] if d < len(steps) else None})
        result["vllm_divergence_gaps"] = near
    result["sequences"] = seqs
    failures = verdict(args, parity, vres)
    result["verdict"] = {"ok": not failures, "failures": failures}
    json_path.write_text(json.dumps(result, indent=1))
    log("summary:")
    for p in parity:
        print(f"  {p['pair']:45s} identical {p['identical']}/{p['cases']} match {p['positionwise_match_rate']:.4f}")
    if failures:
        print("PARITY FAILED: " + "; ".join(failures), flush=True)
        raise SystemExit(1)
    print("PARITY OK", flush=True)


def verdict(args: argparse.Namespace, parity: list[dict[str, Any]], vres: dict[str, Any]) -> list[str]:
    """What makes the run a failure (exit status 1).

    fp32 everywhere: every pair must be identical (greedy; the reference's top-2 gaps
    say whether a near-tie could excuse a difference, so none is excused). bf16: the
    torch fp32 pair must still be identical; bf16 pairs are reported, not judged
    (different kernels legitimately flip near-ties), but vLLM must have run cleanly.
    """
    failures: list[str] = []
    if "error" in vres:
        failures.append("the vLLM part raised: " + vres["error"].strip().splitlines()[-1])
    elif "skipped" in vres and (args.require_vllm or not args.tiny):
        failures.append("vLLM was not run: " + vres["skipped"])
    if vres.get("active_after", 0):
        failures.append(f"{vres['active_after']} vLLM requests still active after the run")
    if not all(vres.get("same_tokens_when_text_arrives_at_once", [True])):
        failures.append("vLLM tokens depend on text arrival timing")
    for p in parity:
        judged = args.dtype == "float32" or "bf16" not in p["pair"] and "bfloat16" not in p["pair"]
        if judged and p["identical"] != p["cases"]:
            failures.append(f"{p['pair']}: identical {p['identical']}/{p['cases']}, first divergence {p['first_divergence']}")
    return failures


if __name__ == "__main__":
    main()
