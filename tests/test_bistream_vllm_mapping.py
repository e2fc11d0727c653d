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
from engine.backends.ras_logits import RASArgs, RASBatchState
from engine.backends.vllm_backend import bistream_chunk_kwargs, bistream_spec
from engine.bistream import BistreamRequest, BistreamSpec, LengthLimits
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
    assert kw["stop_token_ids"] == [spec.fill] and kw["max_tokens"] == 901 and kw["seed"] == 3
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
