"""`engine.flow_compile`: the DiT blocks through torch.compile trace as one graph without
breaks (plain batches and batches over cached prompt prefixes), and give the eager
frames. The `aot_eager` backend runs the traced graph without code generation, which
keeps this test fast on CPU; the GPU uses inductor (`bench.stage_bench --compile`)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo

from engine.flow_prompt_cache import PromptCache, decode_with_prompt_cache
from engine.models.config import ModelConfig
from engine.models.flow import CausalMaskedDiffWithDiT, FlowChunk, init_random_


def _chunk(g: torch.Generator, new: int, prompt: int = 60) -> FlowChunk:
    return FlowChunk(tokens=torch.randint(0, 6561, (prompt + new + 3,), generator=g),
                     prompt_feat=torch.randn(2 * prompt, 80, generator=g), embedding=torch.randn(192, generator=g),
                     num_prompt_tokens=prompt, out_start=prompt, finalize=False)


@pytest.fixture(scope="module")
def flows() -> tuple[CausalMaskedDiffWithDiT, CausalMaskedDiffWithDiT]:
    torch.set_num_threads(1)
    flow = init_random_(CausalMaskedDiffWithDiT(ModelConfig.tiny().flow), 7).eval()
    compiled = copy.deepcopy(flow)
    compiled.decoder.estimator.compile_blocks(backend="aot_eager")
    return flow, compiled


def test_compiled_blocks_give_the_eager_frames(flows: tuple[CausalMaskedDiffWithDiT, ...]) -> None:
    flow, compiled = flows
    g = torch.Generator().manual_seed(0)
    torch._dynamo.utils.counters.clear()
    batches = [[_chunk(g, 20), _chunk(g, 25)], [_chunk(g, 40), _chunk(g, 10), _chunk(g, 33)]]
    for chunks in batches:  # two shapes: the dynamic graph serves both
        ref, _ = flow.decode_chunks(chunks)
        got, _ = compiled.decode_chunks(chunks)
        for r, x in zip(ref, got):
            assert x.shape == r.shape and (x - r).abs().max().item() <= 1e-5
    cache = PromptCache()
    chunks = batches[1]
    ref, _ = flow.decode_chunks(chunks)
    got, shape = decode_with_prompt_cache(compiled, chunks, cache.entries_for(compiled, chunks))
    assert shape.frames < 2 * 73  # the cached path really ran
    for r, x in zip(ref, got):
        assert (x - r).abs().max().item() <= 1e-5
    # One voice for every row: its prefix is broadcast inside the compiled attention.
    voice = _chunk(g, 30)
    p = voice.num_prompt_tokens
    chunks = [FlowChunk(tokens=torch.cat((voice.tokens[:p], torch.randint(0, 6561, (n + 3,), generator=g))),
                        prompt_feat=voice.prompt_feat, embedding=voice.embedding, num_prompt_tokens=p,
                        out_start=p, finalize=False) for n in (12, 20, 7)]
    entries = cache.entries_for(compiled, chunks)
    assert entries[0] is not None and all(e is entries[0] for e in entries)
    ref, _ = flow.decode_chunks(chunks)
    got, _ = decode_with_prompt_cache(compiled, chunks, entries)
    for r, x in zip(ref, got):
        assert (x - r).abs().max().item() <= 1e-5
    # ... and attended apart from each row's own frames (`split_prefix_attention`).
    estimator = compiled.decoder.estimator
    estimator.split_prefix_rows = 1
    try:
        got, _ = decode_with_prompt_cache(compiled, chunks, entries)
    finally:
        estimator.split_prefix_rows = 8
    for r, x in zip(ref, got):
        assert (x - r).abs().max().item() <= 1e-5
    counters = torch._dynamo.utils.counters
    assert not counters["graph_break"], dict(counters["graph_break"])
    # One graph for plain batches, one for per-row cached prefixes (per-row rotary
    # positions), one for a prefix shared by all rows, one for that prefix attended apart.
    assert counters["stats"]["unique_graphs"] == 4


def test_a_deep_copy_starts_uncompiled(flows: tuple[CausalMaskedDiffWithDiT, ...]) -> None:
    _, compiled = flows
    assert compiled.decoder.estimator._compiled_block is not None
    assert copy.deepcopy(compiled).decoder.estimator._compiled_block is None


def test_the_setting_reaches_the_stage(tmp_path) -> None:  # noqa: ANN001
    from engine.token2wav import AudioStage
    from gateway.app import engine_config
    from gateway.settings import load_settings

    s, _ = load_settings(["--engine.flow-compile", "false"], environ={})
    assert engine_config(s, tmp_path).flow_compile is False
    assert engine_config(load_settings([], environ={})[0], tmp_path).flow_compile is True  # the default
    flow = init_random_(CausalMaskedDiffWithDiT(ModelConfig.tiny().flow), 7)
    stage = AudioStage(flow, torch.nn.Linear(1, 1), torch.device("cpu"), flow_compile=True)
    try:  # CUDA only, like the flow's CUDA graphs: CPU ignores it
        assert not stage.flow_compile and flow.decoder.estimator._compiled_block is None
    finally:
        stage._pool.shutdown(wait=True)
    stage = AudioStage(flow, torch.nn.Linear(1, 1), torch.device("cuda"), flow_compile=True)  # never run here
    try:
        assert stage.flow_compile and flow.decoder.estimator._compiled_block is not None
    finally:
        stage._pool.shutdown(wait=True)


def test_a_failing_compiler_falls_back_to_eager(flows: tuple[CausalMaskedDiffWithDiT, ...], caplog) -> None:  # noqa: ANN001
    flow, _ = flows
    broken = copy.deepcopy(flow)

    def no_compiler(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> object:
        raise RuntimeError("no compiler here")

    broken.decoder.estimator.compile_blocks(backend=no_compiler)
    chunks = [_chunk(torch.Generator().manual_seed(3), 20)]
    ref, _ = flow.decode_chunks(chunks)
    with caplog.at_level("ERROR"):
        got, _ = broken.decode_chunks(chunks)
    assert (got[0] - ref[0]).abs().max().item() <= 1e-6
    assert broken.decoder.estimator._compiled_block is None
    assert "torch.compile of the DiT blocks failed" in caplog.text


@pytest.mark.parametrize("family", ["cosyvoice3", "cosyvoice2"])
def test_the_stage_runs_the_flow_in_bf16(family: str) -> None:
    """The GPU default (bf16 weights and activations, float32 ODE state) exercised on CPU for
    both flows: every input reaches the networks in the weights' dtype, and the mel stays
    close to float32 (bf16 rounding only)."""
    from engine.models.cv2_config import cv2_model_config
    from engine.models.cv2_flow import CausalMaskedDiffWithXvec
    from engine.models.hift import CausalHiFTGenerator
    from engine.token2wav import AudioStage

    if family == "cosyvoice3":
        flow = init_random_(CausalMaskedDiffWithDiT(ModelConfig.tiny().flow), 7).eval()
    else:
        flow = init_random_(CausalMaskedDiffWithXvec(cv2_model_config("tiny").flow), 7).eval()
    g = torch.Generator().manual_seed(1)
    chunks = [_chunk(g, 20, prompt=30), _chunk(g, 31, prompt=30)]
    ref, _ = flow.decode_chunks(chunks)
    stage = AudioStage(flow, CausalHiFTGenerator(ModelConfig.tiny().hift), torch.device("cpu"),
                       flow_dtype=torch.bfloat16)
    try:
        assert next(flow.parameters()).dtype is torch.bfloat16
        got, _ = flow.decode_chunks(chunks)
    finally:
        stage._pool.shutdown(wait=True)
    for r, x in zip(ref, got):
        assert x.dtype is torch.float32 and torch.isfinite(x).all()
        rel = ((x - r).norm() / r.norm()).item()
        assert 0 < rel < 0.05, rel  # bf16 changed the numbers, by rounding only


def test_a_bf16_flow_keeps_exact_rotary_positions() -> None:
    """Casting the flow to bf16 must not round the rotary frequencies or positions: frame
    257 would become 256 and angles past frame 1000 would be off by radians."""
    flow = init_random_(CausalMaskedDiffWithDiT(ModelConfig.tiny().flow), 7)
    rotary = flow.decoder.estimator.rotary_embed
    ref_seq, ref_at = rotary(1500), rotary.at(torch.tensor([[257, 777, 1499]]))
    flow.to(torch.bfloat16)
    assert rotary.inv_freq.dtype is torch.float32 and flow.decoder.estimator.proj_out.weight.dtype is torch.bfloat16
    assert torch.equal(rotary(1500), ref_seq) and torch.equal(rotary.at(torch.tensor([[257, 777, 1499]])), ref_at)
    flow.to(torch.float32)
    assert torch.equal(rotary(1500), ref_seq)


def test_only_compile_errors_fall_back() -> None:
    from torch._dynamo.exc import BackendCompilerFailed

    from engine.compile_errors import is_compile_error

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> object:
        raise RuntimeError("no compiler here")

    try:
        torch.compile(lambda x: x + 1, backend=backend)(torch.ones(2))
    except Exception as exc:  # noqa: BLE001 (whatever dynamo raises for a failing backend)
        compile_error = exc
    assert is_compile_error(compile_error) and isinstance(compile_error, BackendCompilerFailed)
    # A runtime error of the call itself (e.g. out of memory) is not a reason to stop compiling.
    assert not is_compile_error(torch.OutOfMemoryError("CUDA out of memory"))
    assert not is_compile_error(RuntimeError("shape mismatch"))
