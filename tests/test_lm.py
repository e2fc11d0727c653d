"""Qwen2 backbone, CosyVoice3 LM wrapper and RAS sampling."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import pytest
import torch

from engine.models.config import LMConfig, ModelConfig
from engine.models.lm import (
    CosyVoice3LM,
    build_prompt,
    init_random_,
    length_limits,
    stop_ids,
    unified_vocab,
)
from engine.models.qwen2 import Qwen2ForCausalLM
from engine.models.sampling import (
    RASParams,
    nucleus_probs,
    ras_logits,
    ras_sample,
    ras_sample_batch,
    suppress_stop_ids_,
    window_tensor,
)

# The official llm.pt's tensor names and shapes (a copy of shared/reference/cosyvoice3/llm_keys.txt,
# read off the official modules).
KEYS_FILE = Path(__file__).parent / "data" / "cosyvoice3_llm_keys.txt"


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    # Tiny matrices: intra-op thread hand-offs cost more than the math (and the CI box
    # is shared), so run this module single-threaded and restore the setting after.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_lm() -> CosyVoice3LM:
    return init_random_(CosyVoice3LM(ModelConfig.tiny().lm), seed=0).eval()


# ----------------------------------------------------------------------------- names


def _official_keys() -> dict[str, list[int]]:
    keys: dict[str, list[int]] = {}
    for line in KEYS_FILE.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        name, shape, _dtype = line.split("\t")
        keys[name] = [int(d) for d in shape.strip("[]").split(",") if d.strip()]
    return keys


def test_state_dict_matches_official_checkpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    official = _official_keys()
    assert len(official) == 293
    # normal_() under a meta device *context* takes ~6 s per 151936x896 table in
    # torch 2.13 (it decomposes); shapes do not depend on initialisation, so skip it.
    monkeypatch.setattr(torch.nn.Embedding, "reset_parameters", lambda self: None)
    with torch.device("meta"):
        lm = CosyVoice3LM(LMConfig())
    ours = {k: list(v.shape) for k, v in lm.state_dict().items()}
    assert sorted(ours) == sorted(official)
    assert ours == official


# ----------------------------------------------------------------------------- numerics

# Final hidden states [:, :3] of Hugging Face transformers' Qwen2ForCausalLM (4.57,
# eager CPU fp32) for the weights below, recorded once; `transformers` is not a
# dependency, so the reference values are kept as data.
HF_HIDDEN_FIRST3 = [
    [0.160256, -0.25717, -0.783791],
    [-1.799627, -0.029236, 0.218933],
    [-0.406907, -0.054119, 1.039166],
    [-0.56999, -0.05608, 1.199951],
    [-0.321646, -0.34779, 0.011843],
    [-0.048921, 0.056783, 0.26163],
    [0.988055, 0.520433, -1.492991],
    [-0.927032, 1.054556, -0.76052],
    [0.157497, 0.075845, -1.265515],
]


def test_qwen2_matches_hugging_face_reference() -> None:
    cfg = dataclasses.replace(ModelConfig.tiny().lm.qwen, vocab_size=1000)
    model = init_random_(Qwen2ForCausalLM(cfg), seed=0, std=0.2).eval()
    x = torch.randn(1, 9, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden = model.model(x)
    torch.testing.assert_close(hidden[0, :, :3], torch.tensor(HF_HIDDEN_FIRST3), atol=2e-5, rtol=0)


def test_incremental_decode_equals_full_forward(tiny_lm: CosyVoice3LM) -> None:
    ids = torch.tensor([[6561, 6761 + 5, 6761 + 77, 6563, 10, 20, 30, 40, 50, 60, 70, 80]])
    with torch.no_grad():
        full = tiny_lm.speech_logits(tiny_lm(ids))
        cache = tiny_lm.new_cache(rows=1, length=4)  # forces a capacity growth too
        cache.add_row()
        steps = [tiny_lm.speech_logits(tiny_lm(ids[:, :5], cache))]
        for t in range(5, ids.shape[1]):
            steps.append(tiny_lm.speech_logits(tiny_lm(ids[:, t : t + 1], cache)))
    assert cache.lengths == [ids.shape[1]]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def _greedy_alone(lm: CosyVoice3LM, prompt: list[int], n: int) -> list[int]:
    cache = lm.new_cache()
    cache.add_row()
    out: list[int] = []
    x = torch.tensor([prompt])
    for _ in range(n):
        tok = int(lm.speech_logits(lm(x, cache)[:, -1]).argmax(-1))
        out.append(tok)
        x = torch.tensor([[tok]])
    return out


def test_batched_decode_equals_unbatched_greedy(tiny_lm: CosyVoice3LM) -> None:
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 6561, (n,), generator=gen).tolist() for n in (3, 11, 7)]
    steps = 12
    with torch.no_grad():
        alone = [_greedy_alone(tiny_lm, p, steps) for p in prompts]
        cache = tiny_lm.new_cache(rows=1)
        # Batched prefill with right padding, then one decode step per token for all rows.
        width = max(map(len, prompts))
        padded = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
        for _ in prompts:
            cache.add_row()
        hidden = tiny_lm(padded, cache, num_new=[len(p) for p in prompts])
        last = torch.stack([hidden[i, len(p) - 1] for i, p in enumerate(prompts)])
        toks = tiny_lm.speech_logits(last).argmax(-1)
        batched = [[int(t)] for t in toks]
        for _ in range(steps - 1):
            toks = tiny_lm.speech_logits(tiny_lm(toks[:, None], cache)[:, -1]).argmax(-1)
            for out, t in zip(batched, toks.tolist()):
                out.append(t)
    assert cache.lengths == [len(p) + steps - 1 for p in prompts]
    assert batched == alone
    assert len({tuple(a) for a in alone}) == 3  # the prompts really differ


def test_cache_remove_row_keeps_other_rows_intact(tiny_lm: CosyVoice3LM) -> None:
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10]]
    with torch.no_grad():
        cache = tiny_lm.new_cache()
        for i, p in enumerate(prompts):
            cache.add_row()
            tiny_lm(torch.tensor([p]), cache, start_row=i)
        cache.remove_row(0)  # row 2 ([9, 10]) moves into row 0
        assert cache.lengths == [2, 5]
        got = tiny_lm.speech_logits(tiny_lm(torch.tensor([[11], [12]]), cache)[:, -1])
        want_a = tiny_lm.speech_logits(tiny_lm(torch.tensor([[9, 10, 11]]))[:, -1])
        want_b = tiny_lm.speech_logits(tiny_lm(torch.tensor([[4, 5, 6, 7, 8, 12]]))[:, -1])
    torch.testing.assert_close(got, torch.cat([want_a, want_b]), atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- LM wrapper


def test_embed_routes_speech_and_text_ids(tiny_lm: CosyVoice3LM) -> None:
    ids = torch.tensor([[0, 6560, 6561, 6760, 6761, 6761 + 151935]])
    emb = tiny_lm.embed(ids)[0]
    speech = tiny_lm.speech_embedding.weight
    text = tiny_lm.llm.model.model.embed_tokens.weight
    torch.testing.assert_close(emb[:4], speech[[0, 6560, 6561, 6760]])
    torch.testing.assert_close(emb[4:], text[[0, 151935]])


def test_prompt_layout_limits_and_stop_ids() -> None:
    cfg = LMConfig()
    prompt = build_prompt(cfg, [1, 151646], [7, 8, 9], [100, 200])
    assert prompt == [6561, 6762, 6761 + 151646, 6768, 6769, 6770, 6563, 100, 200]
    assert build_prompt(cfg, [], [5])[-1] == 6563  # no prompt speech: ends with task_id
    with pytest.raises(ValueError):
        build_prompt(cfg, [1], [2], require_end_of_prompt=True)
    with pytest.raises(ValueError):
        build_prompt(cfg, [], [2], [6561])
    assert length_limits(cfg, 3) == (6, 60)
    stops = stop_ids(cfg)
    assert stops[0] == 6561 and stops[-1] == 6760 and len(stops) == 200
    vocab = unified_vocab(cfg)
    assert all(vocab.is_stop(s) for s in stops) and not vocab.is_stop(6560)


def test_init_random_is_deterministic() -> None:
    tiny = ModelConfig.tiny().lm
    cfg = dataclasses.replace(tiny, qwen=dataclasses.replace(tiny.qwen, vocab_size=1000))
    a = init_random_(CosyVoice3LM(cfg), seed=5).state_dict()
    b = init_random_(CosyVoice3LM(cfg), seed=5).state_dict()
    c = init_random_(CosyVoice3LM(cfg), seed=6).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["llm_decoder.weight"], c["llm_decoder.weight"])


# ----------------------------------------------------------------------------- sampling


def _ras_enumerated(logits: torch.Tensor, recent: list[int], p: RASParams) -> list[float]:
    """Exact RAS output probabilities by walking the official algorithm step by step
    (sequential nucleus loop, then the masked full-softmax redraw) in float64."""
    probs = torch.softmax(logits.double(), -1).tolist()
    order = sorted(range(len(probs)), key=lambda i: -probs[i])  # sorted() is stable
    kept: list[int] = []
    mass = 0.0
    for i in order:
        if mass < p.top_p and len(kept) < p.top_k:
            kept.append(i)
            mass += probs[i]
        else:
            break
    total = sum(probs[i] for i in kept)
    window = recent[-p.win_size :]
    out = [0.0] * len(probs)
    for x in kept:
        qx = probs[x] / total
        if window.count(x) >= p.win_size * p.tau_r:
            rest = 1.0 - probs[x]
            for y in range(len(probs)):
                if y != x:
                    out[y] += qx * probs[y] / rest
        else:
            out[x] += qx
    return out


CASES = [
    # (logits seed, vocab, recent tokens, params)
    (0, 12, [], RASParams()),
    (1, 12, [3, 3, 5], RASParams()),
    (2, 40, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], RASParams(top_k=5)),
    (3, 16, [1, 1, 2, 9, 9, 9], RASParams(top_p=0.95, win_size=6, tau_r=0.5)),
]


def _case_logits(seed: int, vocab: int) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 1.5


@pytest.mark.parametrize("seed,vocab,recent,params", CASES)
def test_ras_logits_equal_enumerated_distribution(
    seed: int, vocab: int, recent: list[int], params: RASParams
) -> None:
    logits = _case_logits(seed, vocab)
    # Make the most recent token also the most likely one so the redraw path matters.
    if recent:
        logits[recent[-1]] = logits.max() + 1.0
    want = torch.tensor(_ras_enumerated(logits, recent, params), dtype=torch.float32)
    windows = window_tensor([recent], params.win_size)
    got = ras_logits(logits[None], windows, params.top_p, params.top_k, params.repeat_threshold)
    torch.testing.assert_close(got.exp()[0], want, atol=1e-6, rtol=1e-5)
    assert abs(float(got.exp().sum()) - 1.0) < 1e-5


@pytest.mark.parametrize("seed,vocab,recent,params", CASES)
def test_ras_sampler_monte_carlo_matches_exact(
    seed: int, vocab: int, recent: list[int], params: RASParams
) -> None:
    logits = _case_logits(seed, vocab)
    if recent:
        logits[recent[-1]] = logits.max() + 1.0
    want = torch.tensor(_ras_enumerated(logits, recent, params))
    n = 200_000
    gen = torch.Generator().manual_seed(1234)
    draws = ras_sample_batch(
        logits.expand(n, vocab),
        window_tensor([recent], params.win_size).expand(n, -1),
        torch.rand(n, 2, generator=gen),
        params.top_p,
        params.top_k,
        params.repeat_threshold,
    )
    freq = torch.bincount(draws, minlength=vocab).double() / n
    # 5 sigma of a binomial proportion, per token.
    tol = 5 * (want * (1 - want) / n).sqrt() + 1e-9
    assert bool(((freq - want).abs() <= tol).all()), (freq, want)
    assert bool((freq[want == 0] == 0).all())


def test_nucleus_keeps_prefix_until_top_p_or_top_k() -> None:
    logits = torch.tensor([[0.5, 0.2, 0.2, 0.1]]).log()
    kept = nucleus_probs(logits, top_p=0.8, top_k=25)[0]
    # mass before entries: 0, .5, .7, .9 -> the first three are kept
    torch.testing.assert_close(kept, torch.tensor([5 / 9, 2 / 9, 2 / 9, 0.0]))
    kept = nucleus_probs(logits, top_p=0.8, top_k=2)[0]
    torch.testing.assert_close(kept, torch.tensor([5 / 7, 2 / 7, 0.0, 0.0]))
    # ties keep index order (stable sort): of the two 0.2 entries only index 1 survives
    kept = nucleus_probs(logits, top_p=0.6, top_k=25)[0]
    torch.testing.assert_close(kept, torch.tensor([5 / 7, 2 / 7, 0.0, 0.0]))


def test_ras_sample_uses_only_its_generator() -> None:
    logits = _case_logits(7, 30)
    global_state = torch.random.get_rng_state()

    def run(seed: int) -> list[int]:
        gen = torch.Generator().manual_seed(seed)
        out: list[int] = []
        for _ in range(40):
            out.append(ras_sample(logits, out, RASParams(), gen))
        return out

    a, b, c = run(1), run(1), run(2)
    assert a == b and a != c
    assert torch.equal(torch.random.get_rng_state(), global_state)
    # RAS: with threshold 1 no token repeats within 10 generated tokens unless the
    # redraw picks it again; the top token alone would otherwise dominate.
    assert len(set(a)) > 5


def test_suppress_stop_ids_only_masked_rows() -> None:
    logits = torch.zeros(2, 6761)
    suppress_stop_ids_(logits, 6561, torch.tensor([True, False]))
    assert torch.isinf(logits[0, 6561:]).all() and not torch.isinf(logits[0, :6561]).any()
    assert not torch.isinf(logits[1]).any()
    out = ras_sample_batch(logits[:1], window_tensor([[]], 10), torch.rand(1, 2, generator=torch.Generator().manual_seed(0)))
    assert int(out) < 6561


def test_ras_logits_batched_rows_are_independent() -> None:
    rows = [(_case_logits(s, 20), r) for s, r in [(0, [1, 2]), (1, []), (2, [5, 5, 5, 5])]]
    windows = window_tensor([r for _, r in rows], 10)
    got = ras_logits(torch.stack([l for l, _ in rows]), windows, 0.8, 25, 1.0).exp()
    for i, (logits, recent) in enumerate(rows):
        want = torch.tensor(_ras_enumerated(logits, recent, RASParams()), dtype=torch.float32)
        torch.testing.assert_close(got[i], want, atol=1e-6, rtol=1e-5)


def test_window_tensor_keeps_last_tokens() -> None:
    w = window_tensor([[1, 2, 3, 4], []], 3)
    assert w.tolist() == [[2, 3, 4], [-1, -1, -1]]
    assert list(itertools.chain(*w.tolist())).count(-1) == 3
