"""bench/dispatch_count.py: operator dispatches per small-batch engine step, counted on the CPU."""

from __future__ import annotations

import json

import torch

from bench import dispatch_count


def test_counts_the_vocoder_step_and_the_logits_processor(tmp_path) -> None:  # noqa: ANN001
    out = tmp_path / "dispatch.json"
    report = dispatch_count.main(["--tiny", "--vocoder-batches", "1,2,8,16", "--ras-batches", "1,3", "--top", "50",
                                  "--flow-batches", "8,16", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    one, two = report["vocoder"][1], report["vocoder"][2]
    assert 0 < one["dispatches"] < two["dispatches"]  # per-stream slicing grows with the batch
    # From `engine.ragged.GATHER_MIN_ROWS` streams the step gathers its windows for all streams at once:
    # ~5 more operators a stream (32 before round 17), each one a hand-off of the interpreter
    # lock beside a busy event loop; no clones of state the next step copies anyway.
    eight, sixteen = report["vocoder"][8]["dispatches"], report["vocoder"][16]["dispatches"]
    assert sixteen - eight <= 8 * 6
    assert "aten.clone.default" not in report["vocoder"][16]["top"]
    # The Snake activations reuse alpha's inverse: no reciprocal per call, and one sin each.
    assert "aten.reciprocal.default" not in one["top"]
    assert one["top"]["aten.sin.default"] > 10
    assert all(report["ras"][b]["dispatches"] > 0 for b in (1, 3))
    # A one-voice flow batch around its graph: ~5 calls a chunk (the prompt-cache key from
    # remembered digests, the outputs from one split; ~22 a chunk before round 17).
    f8, f16 = report["flow"][8]["dispatches"], report["flow"][16]["dispatches"]
    assert 0 < f8 < f16 and f16 - f8 <= 8 * 6


def test_the_ras_step_keeps_its_operator_count() -> None:
    """Each operator of the RAS processor costs vLLM's engine core ~30-50 us a decode step
    at one stream (round 33 of docs/benchmarks.md): the step with the speech-only head,
    one row past min_tokens, took 42 dispatches before round 34 and 29 since."""
    from types import SimpleNamespace

    from engine.backends.ras_logits import RASArgs, RASBatchState

    state = RASBatchState()
    args = RASArgs(speech_token_size=6561, speech_vocab_size=6761, min_tokens=5)
    g = torch.Generator().manual_seed(0)
    state.update(added=[(0, SimpleNamespace(extra_args=args.to_extra()), None,
                         torch.randint(0, 6561, (100,), generator=g).tolist())], removed=[], moved=[])
    logits = torch.randn(1, 6761, generator=g)
    assert dispatch_count.count(lambda: state.apply(logits), 5)["dispatches"] <= 30
