"""CosyVoice2 on the vLLM backend, checked on CPU (vLLM itself runs only on the GPU machines).

1. The CV2 export holds the torch model's tables row for row: speech_embedding, then
   llm_embedding (sos, task_id), then Qwen2's embed_tokens; lm_head = llm_decoder
   weight *and bias*; config.json asks the plugin class for a biased head.
2. `vllm_logits` below re-implements, in plain torch, what vLLM computes over an export
   directory: it reads only config.json and model.safetensors, loads them the way
   vLLM's loader does (head rows padded to a multiple of 64 then sliced, stock Qwen2's
   loader dropping an unexpected `lm_head.bias`), runs the Qwen2 forward over
   `embed_tokens[ids]` and applies the head as `vllm_model.CosyVoiceQwen2ForCausalLM`
   does. Its logits must equal our LM's, for CosyVoice2 and CosyVoice3, and greedy
   decoding through it plus our vLLM logits processor must give TorchLMBackend's tokens.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.backends.base import LMRequest, SamplingParams
from engine.backends.ras_logits import RASBatchState
from engine.backends.torch_backend import TorchLMBackend
from engine.backends.vllm_backend import vllm_sampling_kwargs
from engine.backends.vllm_export import (
    META_FILE,
    WEIGHTS_FILE,
    ensure_vllm_export,
    export_from_module,
    read_safetensors,
)
from engine.backends.vllm_model import ARCHITECTURE, HEAD_BIAS_KEY, HEAD_ROWS_KEY
from engine.models.config import ModelConfig, Qwen2Config
from engine.models.cv2_config import cv2_model_config
from engine.models.cv2_lm import Qwen2LM
from engine.models.lm import CosyVoice3LM, build_prompt, init_random_, unified_vocab
from engine.models.qwen2 import Qwen2Model
from engine.models.vocab import UnifiedVocab

CV2 = cv2_model_config("tiny").lm
CV3 = ModelConfig.tiny().lm
VOCAB_PAD = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE (vocab_parallel_embedding.py)


def peaked(lm: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Seeded random weights with a decoder (and bias) large enough that the speech
    logits are peaked: a dropped or misplaced bias changes the arg-max."""
    init_random_(lm, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        lm.llm_decoder.weight.copy_(torch.randn(lm.llm_decoder.weight.shape, generator=g) * 0.5)
        if lm.llm_decoder.bias is not None:
            lm.llm_decoder.bias.copy_(torch.randn(lm.llm_decoder.bias.shape, generator=g) * 2.0)
    return lm.eval()


@pytest.fixture(scope="module")
def cv2_lm() -> Qwen2LM:
    return peaked(Qwen2LM(CV2), 5)  # type: ignore[return-value]


@pytest.fixture(scope="module")
def cv3_lm() -> CosyVoice3LM:
    return peaked(CosyVoice3LM(CV3), 6)  # type: ignore[return-value]


# --------------------------------------------------------------- what vLLM computes


class VLLMEmulation:
    """The logits vLLM produces for an export directory, from its files alone."""

    def __init__(self, export_dir: Path) -> None:
        cfg = json.loads((export_dir / "config.json").read_text())
        t = read_safetensors(export_dir / WEIGHTS_FILE)
        self.vocab_size = int(cfg["vocab_size"])
        (arch,) = cfg["architectures"]
        if arch == "Qwen2ForCausalLM":
            # Stock class: head over the whole vocab, no bias parameter; AutoWeightsLoader
            # ignores unexpected ".bias" tensors, so a bias in the file would be dropped.
            self.rows, bias = self.vocab_size, None
        elif arch == ARCHITECTURE:
            self.rows = int(cfg[HEAD_ROWS_KEY])
            bias = None
            if cfg.get(HEAD_BIAS_KEY, False) is True:
                if "lm_head.bias" not in t:  # CosyVoiceQwen2ForCausalLM.load_weights refuses
                    raise ValueError("lm_head.bias missing")
                bias = t["lm_head.bias"]
        else:
            raise AssertionError(f"vLLM would not know {arch}")
        # ParallelLMHead pads its rows to a multiple of 64; the loader zero-fills the pad
        # and LogitsProcessor slices the logits back to the head's row count.
        padded = math.ceil(self.rows / VOCAB_PAD) * VOCAB_PAD
        w = t["lm_head.weight"]
        assert w.shape[0] == self.rows, "vLLM's weight loader asserts the row count"
        self.head_w = torch.zeros(padded, w.shape[1], dtype=w.dtype)
        self.head_w[: self.rows] = w
        self.head_b = None
        if bias is not None:
            assert bias.shape == (self.rows,)
            self.head_b = torch.zeros(padded, dtype=bias.dtype)
            self.head_b[: self.rows] = bias
        qwen = Qwen2Config.from_hf_json(export_dir / "config.json")
        assert qwen.vocab_size == self.vocab_size
        self.model = Qwen2Model(qwen)
        self.model.load_state_dict({k[len("model."):]: v for k, v in t.items() if k.startswith("model.")},
                                   strict=True)
        self.model.eval()

    @torch.no_grad()
    def logits(self, ids: list[int]) -> torch.Tensor:
        """Full-width logits [len(ids), vocab_size] for every position of one sequence."""
        x = self.model.embed_tokens(torch.tensor([ids]))  # one table, no routing
        h = self.model(x)[0]
        speech = F.linear(h, self.head_w, self.head_b)[:, : self.rows]
        full = speech.new_full((len(ids), self.vocab_size), float("-inf"))
        full[:, : self.rows] = speech
        return full


# --------------------------------------------------------------- 1. the export


def test_cv2_export_equals_model_row_for_row(tmp_path: Path, cv2_lm: Qwen2LM) -> None:
    vocab = unified_vocab(CV2)
    assert (vocab.speech_vocab_size, vocab.extra_rows, vocab.text_offset) == (6564, 2, 6566)
    assert (CV2.eos, CV2.fill_token, CV2.sos, CV2.task_id) == (6561, 6563, 6564, 6565)
    info = export_from_module(cv2_lm, CV2.qwen, CV2, vocab, tmp_path, dtype=torch.float32, head="speech")
    assert info.head == "speech" and info.head_bias and info.head_rows == 6564 and info.text_offset == 6566
    assert json.loads((tmp_path / META_FILE).read_text())["head_bias"] is True

    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == [ARCHITECTURE]
    assert cfg[HEAD_ROWS_KEY] == 6564 and cfg[HEAD_BIAS_KEY] is True
    assert cfg["vocab_size"] == vocab.size == 6566 + 151936
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (6564, 6561)

    t = read_safetensors(tmp_path / WEIGHTS_FILE)
    emb = t["model.embed_tokens.weight"]
    # Every unified id looks up exactly the row our LM's routed embedding gives it.
    with torch.no_grad():
        assert torch.equal(emb, cv2_lm.embed(torch.arange(vocab.size)))
    assert torch.equal(emb[:6564], cv2_lm.speech_embedding.weight)
    assert torch.equal(emb[6564], cv2_lm.llm_embedding.weight[0])  # sos
    assert torch.equal(emb[6565], cv2_lm.llm_embedding.weight[1])  # task_id
    assert torch.equal(emb[6566:], cv2_lm.llm.backbone.embed_tokens.weight)
    assert torch.equal(t["lm_head.weight"], cv2_lm.llm_decoder.weight)
    assert torch.equal(t["lm_head.bias"], cv2_lm.llm_decoder.bias)
    state = cv2_lm.state_dict()
    for k, v in state.items():
        if k.startswith("llm.model.model.") and "embed_tokens" not in k:
            assert torch.equal(t["model." + k[len("llm.model.model."):]], v), k
    n_layers = sum(1 for k in state if k.startswith("llm.model.model.") and "embed_tokens" not in k)
    assert len(t) == 1 + n_layers + 2  # embed_tokens, backbone, lm_head weight + bias


def test_cv2_bf16_export_rounds_the_bias_like_the_weights(tmp_path: Path, cv2_lm: Qwen2LM) -> None:
    export_from_module(cv2_lm, CV2.qwen, CV2, unified_vocab(CV2), tmp_path, head="speech")  # default bf16
    t = read_safetensors(tmp_path / WEIGHTS_FILE)
    assert t["lm_head.bias"].dtype == torch.bfloat16
    assert torch.equal(t["lm_head.bias"], cv2_lm.llm_decoder.bias.to(torch.bfloat16))


def test_cv2_unified_head_is_refused(tmp_path: Path, cv2_lm: Qwen2LM) -> None:
    # Stock vLLM Qwen2 would silently drop the bias: the export refuses instead.
    with pytest.raises(ValueError, match="bias"):
        export_from_module(cv2_lm, CV2.qwen, CV2, unified_vocab(CV2), tmp_path, head="unified")


def test_cv2_checkpoint_needs_cv2_vocab(tmp_path: Path, cv2_lm: Qwen2LM) -> None:
    from engine.backends.vllm_export import export_unified_qwen2

    state = cv2_lm.state_dict()
    # A CV3-shaped vocab over the same 6564-row speech table (no rows for llm_embedding).
    no_extra = UnifiedVocab(6561, 6564, CV2.qwen.vocab_size, extra_rows=0)
    with pytest.raises(ValueError, match="llm_embedding"):
        export_unified_qwen2(state, CV2.qwen, CV2, no_extra, tmp_path, head="speech")
    missing = {k: v for k, v in state.items() if k != "llm_embedding.weight"}
    with pytest.raises(ValueError, match="llm_embedding"):
        export_unified_qwen2(missing, CV2.qwen, CV2, unified_vocab(CV2), tmp_path, head="speech")


def test_cv2_cached_export_needs_the_plugin(tmp_path: Path, cv2_lm: Qwen2LM,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.backends import vllm_export

    torch.save(cv2_lm.state_dict(), tmp_path / "llm.pt")
    vocab = unified_vocab(CV2)
    monkeypatch.setattr(vllm_export, "speech_head_plugin_installed", lambda: False)
    with pytest.raises(ValueError, match="plugin"):
        ensure_vllm_export(tmp_path, CV2.qwen, CV2, vocab)
    monkeypatch.setattr(vllm_export, "speech_head_plugin_installed", lambda: True)
    out = ensure_vllm_export(tmp_path, CV2.qwen, CV2, vocab)
    assert out == tmp_path / vllm_export.SPEECH_HEAD_SUBDIR
    t = read_safetensors(out / WEIGHTS_FILE)
    assert torch.equal(t["lm_head.bias"], cv2_lm.llm_decoder.bias.to(torch.bfloat16))


def test_cv3_speech_head_config_has_no_bias_key(tmp_path: Path, cv3_lm: CosyVoice3LM) -> None:
    """CosyVoice3 exports are unchanged: no bias tensor, no bias key."""
    info = export_from_module(cv3_lm, CV3.qwen, CV3, unified_vocab(CV3), tmp_path, head="speech")
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert HEAD_BIAS_KEY not in cfg and not info.head_bias
    assert "lm_head.bias" not in read_safetensors(tmp_path / WEIGHTS_FILE)


# --------------------------------------------------------------- 2. what vLLM computes


CASES = [("cosyvoice2", "speech"), ("cosyvoice3", "speech"), ("cosyvoice3", "unified")]


def _lm(version: str, cv2_lm: Qwen2LM, cv3_lm: CosyVoice3LM) -> CosyVoice3LM:
    return cv2_lm if version == "cosyvoice2" else cv3_lm


@pytest.mark.parametrize(("version", "head"), CASES)
def test_vllm_logits_equal_torch_lm(tmp_path: Path, version: str, head: str,
                                    cv2_lm: Qwen2LM, cv3_lm: CosyVoice3LM) -> None:
    lm = _lm(version, cv2_lm, cv3_lm)
    cfg = lm.cfg
    vocab = unified_vocab(cfg)
    export_from_module(lm, cfg.qwen, cfg, vocab, tmp_path, dtype=torch.float32, head=head)  # type: ignore[arg-type]
    vm = VLLMEmulation(tmp_path)
    prompt = build_prompt(cfg, [11, 12, 151646], [13, 14, 15, 151000], [100, 200, 6000, 5])
    assert prompt[0] == cfg.sos and cfg.task_id in prompt
    got = vm.logits(prompt)
    with torch.no_grad():
        want = lm.speech_logits(lm(torch.tensor([prompt])))[0]
    n = vocab.speech_vocab_size
    assert got.shape == (len(prompt), vocab.size)
    torch.testing.assert_close(got[:, :n], want, rtol=1e-5, atol=1e-5)
    if head == "speech":
        assert torch.isinf(got[:, n:]).all()  # prompt-only rows and text ids never win
    else:
        assert not got[:, n:].any()  # stock head: zero rows, masked later by the logits processor
    assert torch.equal(got[:, :n].argmax(-1), want.argmax(-1))


def test_dropped_bias_would_be_caught(tmp_path: Path, cv2_lm: Qwen2LM) -> None:
    """The comparison above is sensitive to the bias: without it the arg-max moves."""
    export_from_module(cv2_lm, CV2.qwen, CV2, unified_vocab(CV2), tmp_path, dtype=torch.float32, head="speech")
    cfg_path = tmp_path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    del cfg[HEAD_BIAS_KEY]
    cfg_path.write_text(json.dumps(cfg))
    prompt = build_prompt(CV2, [], [13, 14, 15], [100, 200])
    got = VLLMEmulation(tmp_path).logits(prompt)[:, : CV2.speech_vocab_size]
    with torch.no_grad():
        want = cv2_lm.speech_logits(cv2_lm(torch.tensor([prompt])))[0]
    assert (got.argmax(-1) != want.argmax(-1)).float().mean() > 0.3


def test_bias_key_without_tensor_is_refused(tmp_path: Path, cv3_lm: CosyVoice3LM) -> None:
    export_from_module(cv3_lm, CV3.qwen, CV3, unified_vocab(CV3), tmp_path, dtype=torch.float32, head="speech")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg[HEAD_BIAS_KEY] = True
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="lm_head.bias"):
        VLLMEmulation(tmp_path)


@pytest.mark.parametrize(("version", "head"), CASES)
def test_vllm_greedy_path_equals_torch_backend(tmp_path: Path, version: str, head: str,
                                               cv2_lm: Qwen2LM, cv3_lm: CosyVoice3LM) -> None:
    """Greedy decode as vLLM runs it: model logits -> our logits processor (the same
    RASBatchState code the vLLM adapter calls) -> arg-max, over the same prompt ids
    the engine builds; equals TorchLMBackend's greedy tokens."""
    lm = _lm(version, cv2_lm, cv3_lm)
    cfg = lm.cfg
    vocab = unified_vocab(cfg)
    export_from_module(lm, cfg.qwen, cfg, vocab, tmp_path, dtype=torch.float32, head=head)  # type: ignore[arg-type]
    vm = VLLMEmulation(tmp_path)
    prompt = build_prompt(cfg, [11, 12], [13, 14, 15, 16], [100, 200, 300])
    steps = 8
    sp = SamplingParams(greedy=True, fixed_length=steps, seed=0)

    params = type("P", (), {"extra_args": vllm_sampling_kwargs(sp, vocab)["extra_args"]})()
    out: list[int] = []
    state = RASBatchState()
    state.update(added=[(0, params, prompt, out)], removed=[], moved=[])
    for _ in range(steps):
        logits = vm.logits(prompt + out)[-1:].clone()
        out.append(int(state.apply(logits)[0].argmax()))

    async def torch_tokens() -> list[int]:
        backend = TorchLMBackend(lm, vocab)
        try:
            return [t async for t in backend.generate(LMRequest("r", tuple(prompt), sp))]
        finally:
            await backend.close()

    want = asyncio.run(torch_tokens())
    assert out == want and len(out) == steps and all(t < cfg.speech_token_size for t in out)


# --------------------------------------------------------------- 3. the engine


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="would start a real vLLM engine")
def test_engine_routes_cv2_to_the_vllm_export(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No more refusal: Engine.create exports the CV2 LM (speech head with bias) and gets
    as far as starting vLLM, which is absent on the CPU machines."""
    from engine.backends import vllm_export
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.models.writer import write_model_dir

    model_dir = write_model_dir(tmp_path / "cv2", "tiny", seed=0, version="cosyvoice2")
    monkeypatch.setattr(vllm_export, "speech_head_plugin_installed", lambda: True)
    cfg = EngineConfig(model_dir=model_dir, device="cpu", lm_backend="vllm", warmup=False)
    with pytest.raises(ModuleNotFoundError) as err:
        asyncio.run(Engine.create(cfg))
    assert err.value.name is not None and err.value.name.split(".")[0] == "vllm"
    export = model_dir / vllm_export.SPEECH_HEAD_SUBDIR
    assert json.loads((export / "config.json").read_text())[HEAD_BIAS_KEY] is True
    saved = torch.load(model_dir / "llm.pt", weights_only=True)
    t = read_safetensors(export / WEIGHTS_FILE)
    assert torch.equal(t["lm_head.bias"], saved["llm_decoder.bias"].to(torch.bfloat16))
    assert torch.equal(t["model.embed_tokens.weight"][6564:6566], saved["llm_embedding.weight"].to(torch.bfloat16))


# --------------------------------------------------------------- 4. the H200 parity bench


def test_lm_parity_builds_cv2_and_fails_on_token_mismatch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from bench import lm_parity

    args = argparse.Namespace(model="tiny-random-cv2", seed=0, decoder_std=0.5, bias_std=2.0)
    lm, cfg, version = lm_parity.build_lm(args)
    assert version == "cosyvoice2" and isinstance(lm, Qwen2LM) and cfg == CV2
    assert 1.5 < float(lm.llm_decoder.bias.detach().std()) < 2.5  # re-drawn large: it decides arg-maxes
    prompts = lm_parity.make_prompts(cfg, 2, 0)
    assert all(p[0] == 6564 and 6565 in p for p in prompts)  # CV2's sos / task_id rows

    same = {"parity": [lm_parity.compare("torch_fp32 vs vllm_float32_speech", [[1, 2], [3]], [[1, 2], [3]])]}
    differ = {"parity": [lm_parity.compare("torch_fp32 vs vllm_float32_speech", [[1, 2], [3]], [[1, 5], [3]])]}
    assert lm_parity.check_tokens(same) == []
    assert lm_parity.check_tokens(differ) and "1/2" in lm_parity.check_tokens(differ)[0]
    assert lm_parity.check_tokens({"parity": []})  # no vLLM tokens is a failure too

    # Source-checkout runs: the plugin entry point is declared where vLLM's processes see it.
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    lm_parity.make_plugin_visible(tmp_path / "site")
    assert os.environ["PYTHONPATH"].split(":")[:2] == [str(tmp_path / "site"), "/somewhere"]
    assert list((tmp_path / "site").glob("*.dist-info/entry_points.txt"))
