"""The vLLM bistream mapping on CPU: chunk parameters + logits processor, driven by a
small simulation of vLLM's resumable streaming-input semantics (each chunk's prompt is
appended after the previous chunk's outputs minus its last sampled token; output ids
restart per chunk). The result must equal the torch backend's decoding. vLLM itself
is exercised by bench/bistream_parity.py on the GPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.backends.base import SamplingParams
from engine.backends.ras_logits import RASArgs, RASBatchState, chunk_mismatch, expected_fill_at
from engine.backends.vllm_backend import bistream_chunk_kwargs, bistream_spec, desync_id
from engine.bistream import BistreamRequest, BistreamSpec, BistreamState, LengthLimits
from engine.models.config import ModelConfig
from engine.models.lm import END_OF_PROMPT_ID, CosyVoice3LM, init_random_, unified_vocab
from test_bistream_backend import reference


@pytest.fixture(scope="module")
def lm() -> CosyVoice3LM:
    torch.set_num_threads(1)
    return init_random_(CosyVoice3LM(ModelConfig.tiny().lm), seed=0).eval()


@torch.inference_mode()
def simulate_vllm(lm: CosyVoice3LM, req: BistreamRequest, arrivals: list[list[int]]) -> tuple[list[int], list[int]]:
    vocab = unified_vocab(lm.cfg)
    st = req.new_state(bistream_spec(vocab))
    for a in arrivals:
        st.push_text(a)
    st.close_text()
    context: list[int] = []
    processor = RASBatchState()
    speech: list[int] = []
    while not st.done:
        run = st.next_run()
        if run is None:
            break
        kw = bistream_chunk_kwargs(st, run, req.sampling, vocab)
        output_ids: list[int] = []
        processor.update([(0, SimpleNamespace(extra_args=kw["extra_args"]), None, output_ids)], [], [])
        context += list(run.feed)
        while True:
            hidden = lm(torch.tensor([context]))[0, -1]
            text_cols = torch.zeros(vocab.size - vocab.speech_vocab_size)
            logits = torch.cat([lm.speech_logits(hidden).float(), text_cols])[None]
            tok = int(torch.argmax(processor.apply(logits)[0]))
            output_ids.append(tok)
            rule = st.token_rule()
            if rule.forced is not None:
                assert tok == rule.forced  # the processor forced it
            emitted = st.on_token(tok)
            if emitted is not None:
                speech.append(emitted)
            chunk_over = tok in kw["stop_token_ids"] or len(output_ids) >= kw["max_tokens"]
            if chunk_over or st.done:
                break  # vLLM drops the chunk's last sampled token from the context
            context.append(tok)
        assert st.done or not st.in_run  # a chunk ends exactly where the run ends
    return speech, context


@pytest.mark.parametrize("ratio", [2.0, 3.5])
def test_chunked_mapping_equals_torch_reference(lm: CosyVoice3LM, ratio: float) -> None:
    req = BistreamRequest("v", (100, END_OF_PROMPT_ID, 102, 103), tuple(range(40, 63)), SamplingParams(greedy=True),
                          LengthLimits(fixed_ratio=ratio))
    arrivals = [[200 + i] for i in range(26)]
    speech, context = simulate_vllm(lm, req, arrivals)
    expected, ref_context = reference(lm, req, arrivals)
    assert speech == expected and len(speech) == max(round(ratio * 26), len(speech))
    assert context == ref_context[: len(context)]


def test_chunk_kwargs_streaming_and_final(lm: CosyVoice3LM) -> None:
    vocab = unified_vocab(lm.cfg)
    spec = bistream_spec(vocab)
    assert spec == BistreamSpec.from_lm_config(lm.cfg)
    req = BistreamRequest("k", (100, END_OF_PROMPT_ID), tuple(range(20)), SamplingParams(seed=3),
                          LengthLimits(min_ratio=2.0, max_ratio=20.0, hard_max=900))
    st = req.new_state(spec)
    for t in range(10):
        st.push_text([300 + t])
    run = st.next_run()
    assert run is not None and not run.final
    kw = bistream_chunk_kwargs(st, run, req.sampling, vocab)
    args = RASArgs.from_extra(kw["extra_args"])
    assert args is not None and args.mask_stops and args.keep_id == spec.fill
    assert args.force_at == run.fill_at == 10 and args.force_id == spec.fill
    assert kw["stop_token_ids"] == [spec.fill, desync_id(vocab)] and kw["max_tokens"] == 901 and kw["seed"] == 3
    # What the chunk must arrive with: the whole context so far, ending in 5 prompt speech tokens.
    assert args.context_len == len(st.context) and args.fill_period == 15 and args.desync_id == vocab.speech_vocab_size - 1
    assert chunk_mismatch(args, st.context) is None
    assert chunk_mismatch(args, [*st.context, spec.fill]) is not None  # a stop id left in the context
    for i in range(10):
        st.on_token(500 + i)
    st.on_token(spec.fill)
    st.close_text()
    run = st.next_run()
    assert run is not None and run.final
    kw = bistream_chunk_kwargs(st, run, req.sampling, vocab)
    args = RASArgs.from_extra(kw["extra_args"])
    assert args is not None and not args.mask_stops
    assert args.history == (*range(501, 510), spec.fill)  # the RAS window spans chunks
    assert args.min_tokens == 20 - 10 and args.force_at == 200 - 10 and args.force_id == vocab.speech_token_size + 1
    assert args.context_len == len(st.context) and args.fill_period == 0 and chunk_mismatch(args, st.context) is None
    assert kw["stop_token_ids"] == list(range(vocab.speech_token_size, vocab.speech_vocab_size))
    assert kw["seed"] != 3  # a chunk's random stream differs from the first chunk's


def test_processor_keep_and_force() -> None:
    sts, svs = 10, 14
    state = RASBatchState()
    out_a: list[int] = []
    out_b: list[int] = [1, 2]
    a = RASArgs(sts, svs, greedy=True, mask_stops=True, keep_id=13)
    b = RASArgs(sts, svs, greedy=True, force_at=2, force_id=11)
    state.update([(0, SimpleNamespace(extra_args=a.to_extra()), None, out_a),
                  (1, SimpleNamespace(extra_args=b.to_extra()), None, out_b)], [], [])
    logits = torch.zeros(2, 20)
    res = state.apply(logits.clone())
    assert torch.isinf(res[0, 10:13]).all() and res[0, 13] == 0 and torch.isinf(res[0, 14:]).all()
    assert int(torch.argmax(res[1])) == 11 and torch.isinf(res[1, :11]).all()


@pytest.mark.parametrize("quirks", [False, True])
@pytest.mark.parametrize("cv2", [False, True])
def test_fill_position_follows_from_the_context(quirks: bool, cv2: bool) -> None:
    """For every prompt speech length, arrival pattern and free fills, the fill index
    the processor derives from a chunk's context equals the state machine's."""
    spec = BistreamSpec(sos=6561, task_id=6563, fill=6564, speech_token_size=6561, text_offset=6761,
                        end_of_prompt=None if cv2 else END_OF_PROMPT_ID)
    g = torch.Generator().manual_seed(1 + quirks + 2 * cv2)
    checked = 0
    for p in range(0, 50, 3):
        for case in range(3):
            prompt_text = (7, 8, 9) if cv2 else (7, END_OF_PROMPT_ID, 9)
            st = BistreamState(spec, prompt_text, tuple(range(p)), LengthLimits(fixed_ratio=2.0), quirks)
            sizes = torch.randint(1, 4 + 3 * case, (40,), generator=g).tolist()
            for k, n in enumerate(sizes):
                st.push_text([100 + k] * n)
            st.close_text()
            while not st.done:
                run = st.next_run()
                if run is None or run.final:
                    break
                assert expected_fill_at(st.context, spec.speech_token_size, spec.mix_speech) == run.fill_at
                checked += 1
                while st.in_run:  # speech, and now and then a fill before its forced index
                    rule = st.token_rule()
                    free_fill = rule.forced is None and int(torch.randint(0, 9, (1,), generator=g)) == 0
                    st.on_token(rule.forced if rule.forced is not None else spec.fill if free_fill else 5)
    assert checked > 100


def _rows(state: RASBatchState, n: int = 12) -> torch.Tensor:
    return state.apply(torch.zeros(1, n))


def test_processor_refuses_chunks_that_do_not_fit() -> None:
    sts, svs, bad = 6, 10, 9  # speech ids 0..5, reserved 6..9 (8 = fill), text >= 10
    assert expected_fill_at([7, 1, 1, 1], sts, 3) == 3  # a full trailing block asks for a whole new one
    assert expected_fill_at([7, 12], sts, 3) == 3
    ok_context = [7, 1]  # one speech token after the last non-speech id: fill after 2 more
    assert expected_fill_at(ok_context, sts, 3) == 2
    args = RASArgs(sts, svs, greedy=True, mask_stops=True, keep_id=8, force_at=2, force_id=8,
                   context_len=2, fill_period=3, desync_id=bad)
    params = SimpleNamespace(extra_args=args.to_extra())

    state = RASBatchState()
    out: list[int] = []
    state.update([(0, params, ok_context, out)], [], [])
    assert int(torch.argmax(_rows(state)[0])) != bad
    out += [1, 2]
    assert int(torch.argmax(_rows(state)[0])) == 8  # the forced fill at index 2
    out.clear()  # a new chunk began (outputs restart) but no re-add brought its params
    assert int(torch.argmax(_rows(state)[0])) == bad

    for context in ([7, 1, 8], [7, 7]):  # a stop id kept in the context / wrong fill position
        state = RASBatchState()
        state.update([(3, params, context, [])], [], [])
        res = state.apply(torch.zeros(4, 12))
        assert int(torch.argmax(res[3])) == bad and torch.isinf(res[3, :bad]).all()
        assert (res[:3] == 0).all()  # other rows untouched

    # A re-add of the same chunk (resume after preemption) keeps its outputs: fine.
    state = RASBatchState()
    state.update([(0, params, ok_context, [1])], [], [])
    assert int(torch.argmax(_rows(state)[0])) not in (bad, 8)
    # Removed, then added at the same index in one update: the added row stays.
    state.update([(0, params, ok_context, [1, 2])], [0], [])
    assert int(torch.argmax(_rows(state)[0])) == 8


def test_parity_bench_verdict() -> None:
    """bench/bistream_parity.py exits 1 exactly on these (the GPU run's pass/fail)."""
    import argparse

    from bench.bistream_parity import verdict

    def pair(name: str, identical: int) -> dict:
        return {"pair": name, "identical": identical, "cases": 4, "first_divergence": [None] * identical + [3] * (4 - identical)}

    fp32 = argparse.Namespace(dtype="float32", tiny=False, require_vllm=False)
    bf16 = argparse.Namespace(dtype="bfloat16", tiny=False, require_vllm=False)
    ok = {"active_after": 0, "same_tokens_when_text_arrives_at_once": [True] * 4}
    good = [pair("reference_fp32 vs TorchLMBackend_fp32", 4), pair("TorchLMBackend_fp32 vs vllm_float32", 4)]
    assert verdict(fp32, good, ok) == []
    assert len(verdict(fp32, [good[0], pair("TorchLMBackend_fp32 vs vllm_float32", 3)], ok)) == 1
    assert verdict(bf16, [good[0], pair("TorchLMBackend_fp32 vs vllm_bfloat16", 3)], ok) == []  # near-ties in bf16
    assert verdict(bf16, [pair("reference_fp32 vs TorchLMBackend_fp32", 3)], ok) != []
    assert "raised" in verdict(fp32, good, {"error": "Traceback\nRuntimeError: boom\n"})[0]
    assert verdict(fp32, good, {"skipped": "vllm is not installed"}) != []  # the GPU run must run vLLM
    assert verdict(fp32, good, {**ok, "same_tokens_when_text_arrives_at_once": [True, False]}) != []
