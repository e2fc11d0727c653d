"""CPU tests of the vLLM side: the unified-vocab export, the RAS logits transform and
the request mapping. vLLM itself is not needed (it runs only on the GPU machines)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine.backends.base import SamplingParams
from engine.backends.ras_logits import RASArgs, RASBatchState, ras_log_probs, ras_probs
from engine.backends.vllm_backend import vllm_sampling_kwargs
from engine.backends.vllm_export import (
    META_FILE,
    WEIGHTS_FILE,
    ensure_vllm_export,
    export_unified_qwen2,
    read_safetensors,
)
from engine.models.config import ModelConfig
from engine.models.vocab import UnifiedVocab

CFG = ModelConfig.tiny()
LM = CFG.lm
QWEN = LM.qwen
VOCAB = UnifiedVocab(LM.speech_token_size, LM.speech_vocab_size, QWEN.vocab_size)


def official_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """A random state dict with the official llm.pt names, at the tiny sizes."""
    g = torch.Generator().manual_seed(seed)
    h, kv = QWEN.hidden_size, QWEN.num_key_value_heads * QWEN.head_dim

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    sd = {
        "llm.model.model.embed_tokens.weight": r(QWEN.vocab_size, h),
        "llm.model.model.norm.weight": r(h),
        "llm.model.lm_head.weight": r(QWEN.vocab_size, h),
        "llm_decoder.weight": r(LM.speech_vocab_size, h),
        "speech_embedding.weight": r(LM.speech_vocab_size, h),
    }
    for i in range(QWEN.num_hidden_layers):
        p = f"llm.model.model.layers.{i}."
        sd |= {
            p + "self_attn.q_proj.weight": r(h, h), p + "self_attn.q_proj.bias": r(h),
            p + "self_attn.k_proj.weight": r(kv, h), p + "self_attn.k_proj.bias": r(kv),
            p + "self_attn.v_proj.weight": r(kv, h), p + "self_attn.v_proj.bias": r(kv),
            p + "self_attn.o_proj.weight": r(h, h),
            p + "mlp.gate_proj.weight": r(QWEN.intermediate_size, h),
            p + "mlp.up_proj.weight": r(QWEN.intermediate_size, h),
            p + "mlp.down_proj.weight": r(h, QWEN.intermediate_size),
            p + "input_layernorm.weight": r(h), p + "post_attention_layernorm.weight": r(h),
        }
    return sd


# ------------------------------------------------------------------ export


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_export_layout_and_tensors(tmp_path: Path, dtype: torch.dtype) -> None:
    sd = official_state()
    info = export_unified_qwen2(sd, QWEN, LM, VOCAB, tmp_path, dtype=dtype, fingerprint="abc")
    assert info.vocab_size == VOCAB.size == 6761 + 151936

    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"]
    assert cfg["vocab_size"] == VOCAB.size
    assert cfg["tie_word_embeddings"] is False
    assert cfg["hidden_size"] == QWEN.hidden_size and cfg["num_hidden_layers"] == QWEN.num_hidden_layers
    assert cfg["eos_token_id"] == LM.eos and cfg["bos_token_id"] == LM.sos

    t = read_safetensors(tmp_path / WEIGHTS_FILE)
    emb, head = t["model.embed_tokens.weight"], t["lm_head.weight"]
    assert emb.dtype == dtype and emb.shape == (VOCAB.size, QWEN.hidden_size)
    assert head.shape == (VOCAB.size, QWEN.hidden_size)
    off = VOCAB.text_offset
    assert torch.equal(emb[:off], sd["speech_embedding.weight"].to(dtype))
    assert torch.equal(emb[off:], sd["llm.model.model.embed_tokens.weight"].to(dtype))
    assert torch.equal(head[:off], sd["llm_decoder.weight"].to(dtype))
    assert not head[off:].any()  # text rows of the head are zero
    # text token i of the tokenizer lands at unified id text_offset + i
    assert torch.equal(emb[VOCAB.text([151646])[0]], sd["llm.model.model.embed_tokens.weight"][151646].to(dtype))

    # every transformer tensor is present under its HF name, unchanged
    for k, v in sd.items():
        if k.startswith("llm.model.model.") and "embed_tokens" not in k:
            hf = "model." + k[len("llm.model.model."):]
            assert torch.equal(t[hf], v.to(dtype)), hf
    # the unused Qwen text head and the speech tables appear only through the unified ones
    n_qwen = sum(1 for k in sd if k.startswith("llm.model.model."))
    assert set(t) == {"lm_head.weight"} | {"model." + k[len("llm.model.model."):] for k in sd
                                             if k.startswith("llm.model.model.")}
    assert len(t) == n_qwen + 1
    meta = json.loads((tmp_path / META_FILE).read_text())
    assert meta["fingerprint"] == "abc" and meta["text_offset"] == off


def test_export_rejects_wrong_vocab(tmp_path: Path) -> None:
    sd = official_state()
    sd["speech_embedding.weight"] = sd["speech_embedding.weight"][:6564]  # a CosyVoice2-sized table
    with pytest.raises(ValueError):
        export_unified_qwen2(sd, QWEN, LM, VOCAB, tmp_path)


def test_cached_export_follows_checkpoint(tmp_path: Path) -> None:
    torch.save(official_state(0), tmp_path / "llm.pt")
    out = ensure_vllm_export(tmp_path, QWEN, LM, VOCAB, head="unified")
    first = read_safetensors(out / WEIGHTS_FILE)["lm_head.weight"].clone()
    stamp = (out / WEIGHTS_FILE).stat().st_mtime_ns
    # same checkpoint: no re-export
    assert ensure_vllm_export(tmp_path, QWEN, LM, VOCAB, head="unified") == out
    assert (out / WEIGHTS_FILE).stat().st_mtime_ns == stamp
    # changed checkpoint: re-exported with the new weights
    torch.save(official_state(1), tmp_path / "llm.pt")
    ensure_vllm_export(tmp_path, QWEN, LM, VOCAB, head="unified")
    second = read_safetensors(out / WEIGHTS_FILE)["lm_head.weight"]
    assert not torch.equal(first, second)
    sd1 = official_state(1)
    assert torch.equal(second[: VOCAB.text_offset], sd1["llm_decoder.weight"].to(torch.bfloat16))


def test_export_from_lm_module(tmp_path: Path) -> None:
    from engine.backends.vllm_export import export_from_module
    from engine.models.lm import CosyVoice3LM, init_random_

    model = CosyVoice3LM(LM)
    init_random_(model, 0)
    export_from_module(model, QWEN, LM, VOCAB, tmp_path, dtype=torch.float32)
    t = read_safetensors(tmp_path / WEIGHTS_FILE)
    assert torch.equal(t["model.embed_tokens.weight"][: VOCAB.text_offset], model.speech_embedding.weight)
    assert torch.equal(t["lm_head.weight"][: VOCAB.text_offset], model.llm_decoder.weight)


def test_speech_head_export(tmp_path: Path) -> None:
    """head="speech": lm_head = llm_decoder rows only, embeddings still unified, and
    config.json names the plugin class with its row count."""
    from engine.backends.vllm_model import ARCHITECTURE, HEAD_ROWS_KEY

    sd = official_state(3)
    info = export_unified_qwen2(sd, QWEN, LM, VOCAB, tmp_path, dtype=torch.float32, head="speech")
    assert info.head == "speech" and info.head_rows == VOCAB.speech_vocab_size
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == [ARCHITECTURE]
    assert cfg[HEAD_ROWS_KEY] == VOCAB.speech_vocab_size and cfg["vocab_size"] == VOCAB.size
    t = read_safetensors(tmp_path / WEIGHTS_FILE)
    assert torch.equal(t["lm_head.weight"], sd["llm_decoder.weight"])
    assert t["model.embed_tokens.weight"].shape == (VOCAB.size, QWEN.hidden_size)
    with pytest.raises(ValueError):
        export_unified_qwen2(sd, QWEN, LM, VOCAB, tmp_path / "x", head="text")  # type: ignore[arg-type]


def test_cached_speech_head_export_is_separate(tmp_path: Path) -> None:
    torch.save(official_state(0), tmp_path / "llm.pt")
    uni = ensure_vllm_export(tmp_path, QWEN, LM, VOCAB, head="unified")
    sp = ensure_vllm_export(tmp_path, QWEN, LM, VOCAB, head="speech")
    assert uni != sp
    assert read_safetensors(sp / WEIGHTS_FILE)["lm_head.weight"].shape[0] == VOCAB.speech_vocab_size
    assert read_safetensors(uni / WEIGHTS_FILE)["lm_head.weight"].shape[0] == VOCAB.size
    stamp = (sp / WEIGHTS_FILE).stat().st_mtime_ns
    assert ensure_vllm_export(tmp_path, QWEN, LM, VOCAB, head="speech") == sp
    assert (sp / WEIGHTS_FILE).stat().st_mtime_ns == stamp


def test_plugin_entry_point_is_discoverable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The dist-info written for source-checkout runs declares the vLLM general plugin."""
    import importlib.metadata as md

    from engine.backends.vllm_model import PLUGIN_NAME, PLUGIN_TARGET, write_plugin_dist_info

    write_plugin_dist_info(tmp_path)
    # Only the distribution written into tmp_path (an editable install may declare it too).
    dists = list(md.distributions(path=[str(tmp_path)]))
    assert len(dists) == 1
    eps = [ep for ep in dists[0].entry_points if ep.group == "vllm.general_plugins" and ep.name == PLUGIN_NAME]
    assert [ep.value for ep in eps] == [PLUGIN_TARGET]
    monkeypatch.syspath_prepend(str(tmp_path))
    assert PLUGIN_TARGET in {ep.value for ep in md.entry_points(group="vllm.general_plugins")}


def test_auto_head_follows_plugin_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """head="auto" exports the speech head exactly when vLLM can find the plugin class."""
    from engine.backends import vllm_export

    torch.save(official_state(0), tmp_path / "llm.pt")
    for installed, subdir in ((False, vllm_export.EXPORT_SUBDIR), (True, vllm_export.SPEECH_HEAD_SUBDIR)):
        monkeypatch.setattr(vllm_export, "speech_head_plugin_installed", lambda v=installed: v)
        assert ensure_vllm_export(tmp_path, QWEN, LM, VOCAB) == tmp_path / subdir


# ------------------------------------------------------------------ RAS as a distribution


def official_ras_distribution(scores: torch.Tensor, decoded: list[int], top_p: float, top_k: int,
                              win_size: int, tau_r: float) -> torch.Tensor:
    """RAS's output distribution, enumerated step by step like the official sampler:
    sequential nucleus over a stable sort, then per nucleus id either keep it or
    resample from the full softmax with that id removed."""
    p = scores.double().softmax(0)
    vals, idx = p.sort(descending=True, stable=True)
    nucleus: list[tuple[int, float]] = []
    cum = 0.0
    for v, i in zip(vals.tolist(), idx.tolist()):
        if cum < top_p and len(nucleus) < top_k:
            cum += v
            nucleus.append((i, v))
        else:
            break
    z = sum(v for _, v in nucleus)
    window = decoded[-win_size:]
    out = torch.zeros_like(p)
    for i, v in nucleus:
        q = v / z
        if window.count(i) >= win_size * tau_r:
            masked = scores.double().clone()
            masked[i] = float("-inf")
            out += q * masked.softmax(0)
        else:
            out[i] += q
    return out


@pytest.mark.parametrize("seed", range(6))
def test_ras_probs_equal_official_distribution(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    V, B = 300, 4
    logits = torch.randn(B, V, generator=g) * 3.0
    top_ps = [0.8, 0.5, 0.95, 0.8]
    top_ks = [25, 5, 25, 10]
    windows = []
    for b in range(B):
        # recent tokens drawn from the row's likeliest ids so repetitions really happen
        likely = logits[b].topk(6).indices
        windows.append(likely[torch.randint(0, 6, (10,), generator=g)].tolist())
    win = torch.tensor(windows)
    got = ras_probs(logits, win, torch.tensor(top_ps), torch.tensor(top_ks), torch.full((B,), 1.0))
    for b in range(B):
        want = official_ras_distribution(logits[b], windows[b], top_ps[b], top_ks[b], 10, 0.1)
        assert torch.allclose(got[b].double(), want, atol=1e-6), (b, (got[b] - want).abs().max())
        assert abs(got[b].sum().item() - 1.0) < 1e-5
    # repetition really mattered in at least one row: mass left the nucleus
    no_window = ras_probs(logits, torch.full_like(win, -1), torch.tensor(top_ps), torch.tensor(top_ks),
                          torch.full((B,), 1.0))
    assert not torch.allclose(got, no_window)


def test_ras_probs_edge_cases_stay_a_distribution() -> None:
    """The scalar path (the decode step's usual batch) at its edges: an id holding all the
    mass that is repeated is kept (resampling without it is undefined); with top_p 1 the
    masked ids (probability 0) that round into the nucleus take nothing."""
    logits = torch.full((1, 50), -1e4)
    logits[0, 7] = 100.0  # p = 1.0 exactly in float32
    out = ras_probs(logits, torch.tensor([[7] * 10]), 0.8, 25, 1.0, k_max=25)
    assert torch.equal(out[0], torch.nn.functional.one_hot(torch.tensor(7), 50).float())
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(60, generator=g) * 2
    scores[30:] = float("-inf")  # masked: fewer live ids than top_k
    window = scores[:30].topk(3).indices[torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2, 0])]
    got = ras_probs(scores[None], window[None], 1.0, 40, 1.0, k_max=40)[0]
    want = official_ras_distribution(scores, window.tolist(), 1.0, 40, 10, 0.1)
    assert torch.allclose(got.double(), want, atol=1e-6) and (got[30:] == 0).all()


def test_ras_probs_without_repeats_is_plain_nucleus() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]])
    got = ras_probs(logits, torch.full((1, 10), -1), torch.tensor([0.8]), torch.tensor([25]), torch.tensor([1.0]))
    p = logits.softmax(-1)[0]
    keep = 2 if p[0] < 0.8 else 1  # ids enter while the mass before them is < top_p
    assert (got[0, keep:] == 0).all()
    assert torch.allclose(got[0, :keep], p[:keep] / p[:keep].sum())


# ------------------------------------------------------------------ the batch processor


def _params(**kw: object) -> SimpleNamespace:
    args = RASArgs(speech_token_size=VOCAB.speech_token_size, speech_vocab_size=VOCAB.speech_vocab_size, **kw)
    return SimpleNamespace(extra_args=args.to_extra())


def test_batch_state_masks_and_bookkeeping() -> None:
    V = VOCAB.size
    state = RASBatchState()
    greedy_out: list[int] = [5]
    ras_out: list[int] = [7, 7]
    state.update(
        added=[(0, _params(greedy=True, min_tokens=3), None, greedy_out),
               (1, SimpleNamespace(extra_args=None), None, []),  # a foreign request: untouched
               (2, _params(min_tokens=0), None, ras_out)],
        removed=[], moved=[])
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, V, generator=g)
    logits[:, 6600] = 50.0  # a stop id is the arg-max everywhere
    logits[:, VOCAB.text_offset + 3] = 100.0  # and a text id even more so
    before = logits.clone()
    out = state.apply(logits)
    # greedy row: text ids and (before min_tokens) stop ids masked; the rest untouched
    assert torch.isinf(out[0, VOCAB.speech_token_size:]).all()
    assert torch.equal(out[0, : VOCAB.speech_token_size], before[0, : VOCAB.speech_token_size])
    assert out[0].argmax() < VOCAB.speech_token_size
    # foreign row untouched
    assert torch.equal(out[1], before[1])
    # RAS row: stop allowed (min_tokens 0), text masked, a proper distribution
    assert torch.isinf(out[2, VOCAB.text_offset:]).all()
    assert out[2].argmax() == 6600
    assert abs(out[2].exp().sum().item() - 1.0) < 1e-4

    # move the RAS request 2 -> 0 and swap it back; remove the greedy one
    state.update(added=[], removed=[0], moved=[(2, 0, False)])
    assert set(state.rows) == {0} and state.rows[0].output_ids is ras_out
    state.update(added=[], removed=[], moved=[(0, 1, True)])
    assert set(state.rows) == {1}
    # once min_tokens is reached, stops are allowed for the greedy request
    state.update(added=[(0, _params(greedy=True, min_tokens=3), None, greedy_out)], removed=[], moved=[])
    greedy_out.extend([1, 2])
    out = state.apply(before.clone())
    assert out[0].argmax() == 6600


def test_batch_state_fixed_length_masks_stops_always() -> None:
    state = RASBatchState()
    out_ids = list(range(50))
    state.update(added=[(0, _params(mask_stops=True), None, out_ids)], removed=[], moved=[])
    logits = torch.zeros(1, VOCAB.size)
    logits[0, 6562] = 80.0  # eos overwhelming
    out = state.apply(logits)
    assert torch.isinf(out[0, VOCAB.speech_token_size:]).all()
    assert out[0].argmax() < VOCAB.speech_token_size


_SHORTCUT_CASES = ["uniform", "stops_mixed", "args_mixed", "greedy_mixed", "sparse_rows", "keep_force"]


@pytest.mark.parametrize("case", _SHORTCUT_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_state_shortcuts_give_the_general_logits(case: str, dtype: torch.dtype) -> None:
    """The short ways of `RASBatchState.apply` (dense rows, one stop state, one parameter
    set) leave exactly the logits of the general way."""
    g = torch.Generator().manual_seed(_SHORTCUT_CASES.index(case))
    n = 5
    rows: list[tuple[int, SimpleNamespace, None, list[int]]] = []
    for i in range(n):
        out = torch.randint(0, 40, (30,), generator=g).tolist()  # few ids: repeats in the window
        kw: dict[str, object] = {"min_tokens": 10}
        if case == "stops_mixed":
            kw["min_tokens"] = 40 if i % 2 else 0
        if case == "args_mixed":
            kw.update(top_p=0.6 + 0.1 * i, top_k=10 + 5 * i, win_size=6 + i)
        if case == "greedy_mixed" and i % 2:
            kw["greedy"] = True
        if case == "keep_force" and i == 1:
            kw.update(keep_id=VOCAB.speech_token_size + 3, min_tokens=40)
        if case == "keep_force" and i == 3:
            kw.update(force_at=30, force_id=17)
        rows.append((2 * i + 1 if case == "sparse_rows" else i, _params(**kw), None, out))
    batch = 2 * n + 1 if case == "sparse_rows" else n
    logits = (torch.randn(batch, VOCAB.size, generator=g) * 3).to(dtype)
    logits[:, :40] += 4.0  # mass on the ids the windows hold
    got = {}
    for shortcuts in (True, False):
        state = RASBatchState(shortcuts=shortcuts)
        state.update(added=rows, removed=[], moved=[])
        got[shortcuts] = state.apply(logits.clone())
    assert torch.equal(got[True], got[False])
    assert not torch.equal(got[True], logits)  # something was transformed


# ------------------------------------------------------------------ request mapping


def test_sampling_kwargs_mapping() -> None:
    ras = vllm_sampling_kwargs(SamplingParams(min_tokens=4, max_tokens=100, seed=3), VOCAB)
    assert ras["temperature"] == 1.0 and ras["top_p"] == 1.0 and ras["top_k"] == 0
    assert ras["stop_token_ids"] == list(range(6561, 6761)) and not ras["ignore_eos"]
    # the stop ids are masked by our processor until min_tokens; vLLM's own
    # min-tokens processor stays idle
    assert (ras["min_tokens"], ras["max_tokens"], ras["seed"]) == (0, 100, 3)
    a = RASArgs.from_extra(ras["extra_args"])
    assert a is not None and not a.greedy and a.top_k == 25 and a.top_p == 0.8 and a.min_tokens == 4

    greedy = vllm_sampling_kwargs(SamplingParams(greedy=True), VOCAB)
    assert greedy["temperature"] == 0.0 and RASArgs.from_extra(greedy["extra_args"]).greedy

    fixed = vllm_sampling_kwargs(SamplingParams(fixed_length=37, max_tokens=5), VOCAB)
    assert fixed["max_tokens"] == 37 and fixed["min_tokens"] == 0
    assert fixed["ignore_eos"] and fixed["stop_token_ids"] is None
    assert RASArgs.from_extra(fixed["extra_args"]).mask_stops


def test_the_mps_client_settings_are_the_engine_cores_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA_MPS_ACTIVE_THREAD_PERCENTAGE and CUDA_MPS_CLIENT_PRIORITY are set only while
    vLLM starts its engine core (the child inherits them) and restored after, whatever was
    there; None sets nothing."""
    import os

    from engine.backends.vllm_backend import VLLMBackend
    from engine.config import EngineConfig
    from engine.mps import MPS_PERCENT_ENV, MPS_PRIORITY_ENV, child_env, mps_client_env

    monkeypatch.delenv(MPS_PERCENT_ENV, raising=False)
    monkeypatch.delenv(MPS_PRIORITY_ENV, raising=False)
    assert mps_client_env(None, None) == {}
    assert mps_client_env(None, "below_normal") == {MPS_PRIORITY_ENV: "1"}
    assert mps_client_env(40, "normal") == {MPS_PERCENT_ENV: "40", MPS_PRIORITY_ENV: "0"}
    with child_env(mps_client_env(40, "below_normal")):
        assert os.environ[MPS_PERCENT_ENV] == "40" and os.environ[MPS_PRIORITY_ENV] == "1"
    assert MPS_PERCENT_ENV not in os.environ and MPS_PRIORITY_ENV not in os.environ
    monkeypatch.setenv(MPS_PERCENT_ENV, "90")
    with pytest.raises(RuntimeError), child_env(mps_client_env(25, "below_normal")):
        assert os.environ[MPS_PERCENT_ENV] == "25"  # a failed start restores it too
        raise RuntimeError("engine core failed")
    assert os.environ[MPS_PERCENT_ENV] == "90" and MPS_PRIORITY_ENV not in os.environ
    with child_env(mps_client_env(None, None)):
        assert os.environ[MPS_PERCENT_ENV] == "90"
    backend = VLLMBackend(Path("unused"), VOCAB, mps_thread_percent=30, mps_priority="below_normal")
    assert backend.settings.mps_thread_percent == 30 and backend.settings.mps_priority == "below_normal"
    with pytest.raises(ValueError, match="vllm_mps_thread_percent"):
        EngineConfig(model_dir=Path("."), vllm_mps_thread_percent=0)
    with pytest.raises(ValueError, match="vllm_mps_priority must be one of normal, below_normal"):
        EngineConfig(model_dir=Path("."), vllm_mps_priority="high")  # type: ignore[arg-type]


def test_the_cudagraph_mode_reaches_vllms_engine_args(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`--engine.vllm-cudagraph-mode` (full by default): vLLM's compilation config gets that
    mode (upper case, as its enum is named); a backend given none passes no compilation
    config (vLLM's own default); an unknown mode is refused by the config and the backend
    alike. vLLM itself is stood in for by modules that record the engine arguments (it does
    not run on the CPU)."""
    import asyncio
    import sys
    import types

    from engine.backends.vllm_backend import VLLMBackend
    from engine.config import EngineConfig
    from gateway.app import engine_config
    from gateway.settings import load_settings

    seen: list[dict[str, object]] = []

    class AsyncLLM:
        @classmethod
        def from_engine_args(cls, args: dict[str, object], stat_loggers: object = None) -> "AsyncLLM":
            seen.append(args)
            return cls()

    for name in ("vllm", "vllm.engine", "vllm.v1", "vllm.v1.engine"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    arg_utils, async_llm = types.ModuleType("vllm.engine.arg_utils"), types.ModuleType("vllm.v1.engine.async_llm")
    arg_utils.AsyncEngineArgs = lambda **kw: kw  # type: ignore[attr-defined]
    async_llm.AsyncLLM = AsyncLLM  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.engine.arg_utils", arg_utils)
    monkeypatch.setitem(sys.modules, "vllm.v1.engine.async_llm", async_llm)
    s, _ = load_settings(["--engine.vllm-cudagraph-mode", "full_and_piecewise"], environ={})
    assert engine_config(s, tmp_path).vllm_cudagraph_mode == "full_and_piecewise"
    default = engine_config(load_settings([], environ={})[0], tmp_path).vllm_cudagraph_mode
    assert default == EngineConfig(model_dir=tmp_path).vllm_cudagraph_mode == "full"
    for m in (default, "full_and_piecewise", None):
        asyncio.run(VLLMBackend(tmp_path, VOCAB, cudagraph_mode=m).start())
    assert seen[0]["compilation_config"] == {"cudagraph_mode": "FULL"}
    assert seen[1]["compilation_config"] == {"cudagraph_mode": "FULL_AND_PIECEWISE"}
    assert "compilation_config" not in seen[2] and seen[2]["model"] == str(tmp_path)
    with pytest.raises(ValueError, match="vllm_cudagraph_mode must be one of full"):
        EngineConfig(model_dir=tmp_path, vllm_cudagraph_mode="always")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cudagraph_mode must be one of full"):
        VLLMBackend(tmp_path, VOCAB, cudagraph_mode="FULL")


def test_compiled_ras_gives_the_eager_logits_with_one_graph_for_every_batch() -> None:
    """`engine.vllm_compile_sampling`: the per-step RAS function traced whole (fullgraph)
    gives the eager logits; warmed for one row and two, it compiles nothing more for other
    batch sizes (a compile in vLLM's step would stall every stream for seconds). The
    `aot_eager` backend runs the traced graph without code generation (CPU); vLLM's engine
    core uses inductor."""
    import torch._dynamo

    torch._dynamo.reset()
    compiled = RASBatchState(compile_backend="aot_eager")
    compiled.warm(torch.device("cpu"), row_width=VOCAB.size)
    torch._dynamo.utils.counters.clear()
    g = torch.Generator().manual_seed(5)
    for n in (3, 5, 1):
        rows = [(i, _params(min_tokens=10), None, torch.randint(0, 40, (30,), generator=g).tolist()) for i in range(n)]
        logits = torch.randn(n, VOCAB.size, generator=g) * 3
        logits[:, :40] += 4.0
        got = {}
        for name, state in (("eager", RASBatchState()), ("compiled", compiled)):
            state.update(added=rows, removed=[], moved=[])
            got[name] = state.apply(logits.clone())
            state.update(added=[], removed=list(range(n)), moved=[])
        assert torch.equal(got["eager"], got["compiled"]) and not torch.equal(got["eager"], logits)
    assert compiled._log_probs is not ras_log_probs  # still compiled: nothing fell back
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0


def test_processes_sharing_a_model_directory_export_it_once(tmp_path: Path) -> None:
    """Gateways that share a model directory (one per GPU, replicas on one volume) start
    together: each found no export and deleted and wrote the same files, and starts failed
    (a review ran 4 processes at once: failed starts in 8 trials of 8). An export is now
    checked and written under a lock on the directory; one held elsewhere makes a start
    wait, and it then finds a complete export."""
    import fcntl
    import threading

    from engine.backends.vllm_export import EXPORT_LOCK_FILE, read_export_info

    torch.save(official_state(0), tmp_path / "llm.pt")
    done: list[Path] = []
    with open(tmp_path / EXPORT_LOCK_FILE, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another process exporting
        start = threading.Thread(target=lambda: done.append(ensure_vllm_export(tmp_path, QWEN, LM, VOCAB,
                                                                                head="unified")))
        start.start()
        start.join(2.0)
        assert start.is_alive() and not done  # waits for the lock
        assert read_export_info(tmp_path / "vllm-unified") is None
        fcntl.flock(held, fcntl.LOCK_UN)
    start.join()
    assert done and read_export_info(done[0])["fingerprint"]  # complete


@pytest.mark.parametrize("reason, whole", [("stop", True), ("length", True), ("abort", False), ("error", False)])
def test_a_request_vllm_ends_on_its_own_is_an_error_not_whole_speech(tmp_path: Path, reason: str,
                                                                     whole: bool) -> None:
    """vLLM finishes a request with a reason: `stop` and `length` are ends the engine knows
    of; an abort it did not ask for, or an error, ended the stream quietly and the utterance
    was delivered as whole."""
    import asyncio

    from engine.backends.base import LMRequest
    from engine.backends.vllm_backend import VLLMBackend

    class Stub:
        async def generate(self, prompt, params, rid):
            yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=[1, 2], finish_reason=None)], finished=False)
            yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=[3], finish_reason=reason)], finished=True)

    backend = VLLMBackend(tmp_path, VOCAB)
    backend._llm = Stub()
    backend._params = lambda sampling: sampling  # type: ignore[method-assign]

    async def tokens() -> list[int]:
        return [t async for t in backend.generate(LMRequest("r", (1, 2, 3), SamplingParams()))]

    if whole:
        assert asyncio.run(tokens()) == [1, 2, 3]
    else:
        with pytest.raises(RuntimeError, match=reason):
            asyncio.run(tokens())
