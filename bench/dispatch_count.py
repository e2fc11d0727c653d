"""How many torch operators the host dispatches per step of the engine's small-batch paths.

    python -m bench.dispatch_count --json docs/bench/dispatch_count.json

At one session the GPU mostly waits for the host: every operator costs its Python and
dispatcher time plus a kernel launch (roughly 15-20 us each on the H200 box: round 3's
one-chunk vocoder step took 19 ms, and the code then dispatched on the order of 1000
operators per step), whatever the work inside. Counting them on the CPU
is therefore a measure of that host time that needs no GPU. Counted (full-size model,
random weights, `TorchDispatchMode`, views included):

* `vocoder`: one `CausalHiFTGenerator.stream_step` of 50 new mel frames per stream, in the
  third step of each stream (history and context in place), weight norm folded as the
  loader does;
* `ras`: one `RASBatchState.apply` on vLLM-shaped logits (`--ras-head`: the unified
  vocabulary's width, or the speech-only head's, the product's where the plugin is
  installed) with every row a RAS request 100 tokens in (the logits' clone counts one);
* `flow` (`--flow-batches`): one one-voice batch of first chunks (18 new tokens + 3
  lookahead, a 60-token prompt) through the prompt cache and the CUDA-graph runner's
  static buffers, with the solve itself left out (on the GPU it is one graph replay):
  the calls a loaded round makes around the flow's graph.

Per batch size: `dispatches` and the most frequent operators.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.backends.ras_logits import RASArgs, RASBatchState
from engine.models import hift as hift_mod
from engine.models.config import ModelConfig

UNIFIED_VOCAB = 158697  # the exported LM's vocabulary width (speech + text ids)
SPEECH_HEAD = 6761  # the speech-only head's: speech ids and the reserved ones


class _Counter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def count(fn: Callable[[], object], top: int) -> dict[str, Any]:
    counter = _Counter()
    with torch.inference_mode(), counter:
        fn()
    return {"dispatches": sum(counter.ops.values()), "top": dict(counter.ops.most_common(top))}


def vocoder(batch: int, cfg: ModelConfig, top: int) -> dict[str, Any]:
    gen = hift_mod.init_random_(hift_mod.CausalHiFTGenerator(cfg.hift), 0).eval()
    gen.fold_weight_norm()
    streams = [gen.new_stream() for _ in range(batch)]
    g = torch.Generator().manual_seed(0)

    def step() -> None:
        gen.stream_step(streams, [torch.randn(80, 50, generator=g) for _ in streams], [False] * batch)

    with torch.inference_mode():
        step()
        step()
    return count(step, top)


def ras(batch: int, top: int, width: int = UNIFIED_VOCAB) -> dict[str, Any]:
    class Params:
        def __init__(self, args: RASArgs) -> None:
            self.extra_args = args.to_extra()

    g = torch.Generator().manual_seed(0)
    state = RASBatchState()
    args = RASArgs(speech_token_size=6561, speech_vocab_size=6761, min_tokens=10)
    state.update([(i, Params(args), None, torch.randint(0, 6561, (100,), generator=g).tolist())
                  for i in range(batch)], [], [])
    logits = torch.randn(batch, width, generator=g)
    state.apply(logits.clone())
    return count(lambda: state.apply(logits.clone()), top)


def flow(batch: int, cfg: ModelConfig, top: int) -> dict[str, Any]:
    from engine.flow_graphs import FlowGraphRunner, GraphPolicy
    from engine.flow_prompt_cache import PromptCache, decode_with_prompt_cache
    from engine.models.flow import CausalMaskedDiffWithDiT, FlowChunk, init_random_

    model = init_random_(CausalMaskedDiffWithDiT(cfg.flow), 7).eval()
    g = torch.Generator().manual_seed(0)
    p = 60
    prompt, feat, emb = (torch.randint(0, 6561, (p,), generator=g), torch.randn(2 * p, 80, generator=g),
                         torch.randn(192, generator=g))
    chunks = [FlowChunk(tokens=torch.cat((prompt, torch.randint(0, 6561, (21,), generator=g))), prompt_feat=feat,
                        embedding=emb, num_prompt_tokens=p, out_start=p, finalize=False) for _ in range(batch)]
    runner = FlowGraphRunner(model.decoder, GraphPolicy(shared_prefix_max_rows=64), capture=False)
    runner._solve_into = lambda views, streaming: None  # type: ignore[method-assign]
    cache = PromptCache()

    def step() -> None:
        decode_with_prompt_cache(model, chunks, cache.entries_for(model, chunks), solver=runner)

    with torch.inference_mode():
        step()  # builds the voice's cache entry
    return count(step, top)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocoder-batches", default="1,8")
    p.add_argument("--ras-batches", default="1,64")
    p.add_argument("--ras-head", choices=["unified", "speech"], default="unified",
                   help="the logits' width: the unified vocabulary's or the speech-only head's (6761)")
    p.add_argument("--flow-batches", default="", help="one-voice flow batches to count (e.g. 1,8,64)")
    p.add_argument("--tiny", action="store_true", help="the tiny model (tests)")
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, min(4, torch.get_num_threads())))
    cfg = ModelConfig.tiny() if args.tiny else ModelConfig()
    report: dict[str, Any] = {"model": "tiny" if args.tiny else "full", "vocoder": {}, "ras": {}, "flow": {}}
    for b in (int(x) for x in args.vocoder_batches.split(",") if x):
        report["vocoder"][b] = vocoder(b, cfg, args.top)
        print(f"vocoder stream_step, {b} stream(s): {report['vocoder'][b]['dispatches']} dispatches", flush=True)
    for b in (int(x) for x in args.ras_batches.split(",") if x):
        report["ras"][b] = ras(b, args.top, UNIFIED_VOCAB if args.ras_head == "unified" else SPEECH_HEAD)
        print(f"RAS logits processor, {b} row(s): {report['ras'][b]['dispatches']} dispatches", flush=True)
    for b in (int(x) for x in args.flow_batches.split(",") if x):
        report["flow"][b] = flow(b, cfg, args.top)
        print(f"flow batch around its graph, {b} chunk(s): {report['flow'][b]['dispatches']} dispatches", flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.exit(0)
