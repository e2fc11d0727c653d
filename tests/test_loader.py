"""The official-layout loader: safe yaml, strict state dicts, clear errors."""

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from engine.models.config import ModelConfig
from engine.models.hyperyaml import Node, load_hyper_yaml
from engine.models.loader import CheckpointMismatch, ModelDirError, load_model, read_model_config

OFFICIAL_YAML_EXCERPT = """
__set_seed1: !apply:random.seed [1986]
sample_rate: 24000
token_mel_ratio: 2
chunk_size: 25
llm: !new:cosyvoice.llm.llm.CosyVoice3LM
    speech_token_size: 6561
    sampling: !name:cosyvoice.utils.common.ras_sampling
        top_p: 0.8
        top_k: 25
flow: !new:cosyvoice.flow.flow.CausalMaskedDiffWithDiT
    decoder: !new:cosyvoice.flow.flow_matching.CausalConditionalCFM
        estimator: !new:cosyvoice.flow.DiT.dit.DiT
            static_chunk_size: !ref <chunk_size> * <token_mel_ratio>
"""


def test_hyper_yaml_tags_are_inert_data(tmp_path):
    p = tmp_path / "x.yaml"
    marker = tmp_path / "pwned"
    p.write_text(OFFICIAL_YAML_EXCERPT + f"evil: !apply:os.system ['touch {marker}']\n")
    raw = load_hyper_yaml(p)
    assert not marker.exists()
    assert raw["evil"] == Node("apply", "os.system", [f"touch {marker}"])
    assert raw["llm"].class_name == "CosyVoice3LM"
    assert raw["llm"]["sampling"]["top_k"] == 25
    assert raw["flow"]["decoder"]["estimator"]["static_chunk_size"] == 50


def test_ref_arithmetic_rejects_code(tmp_path):
    p = tmp_path / "x.yaml"
    p.write_text("a: 2\nb: !ref <a>.__class__\n")
    with pytest.raises(ValueError, match="unsupported expression"):
        load_hyper_yaml(p)
    p.write_text("a: 2\nb: !ref __import__('os').getcwd() + <a>\n")
    with pytest.raises(ValueError, match="unsupported expression"):
        load_hyper_yaml(p)


def test_tiny_dir_reads_back_its_config(tiny_model_dir):
    cfg = read_model_config(tiny_model_dir)
    tiny = ModelConfig.tiny()
    assert cfg.lm == tiny.lm and cfg.flow == tiny.flow and cfg.hift == tiny.hift and cfg.mel == tiny.mel


def test_tiny_dir_goes_through_the_strict_loader(tiny_model_dir):
    m = load_model(tiny_model_dir)
    assert m.config.version == "cosyvoice3"
    assert m.lm.speech_embedding.weight.shape == (6761, 64)
    for name in ("llm.pt", "flow.pt", "hift.pt", "cosyvoice3.yaml", "campplus.onnx", "speech_tokenizer_v3.onnx",
                 "CosyVoice-BlankEN/config.json", "CosyVoice-BlankEN/vocab.json", "CosyVoice-BlankEN/merges.txt"):
        assert (tiny_model_dir / name).is_file(), name


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_missing_key_is_named(tiny_model_dir, tmp_path):
    d = _copy(tiny_model_dir, tmp_path / "m")
    sd = torch.load(d / "flow.pt", weights_only=True)
    del sd["decoder.estimator.proj_out.bias"]
    torch.save(sd, d / "flow.pt")
    with pytest.raises(CheckpointMismatch, match="flow.pt: missing key 'decoder.estimator.proj_out.bias'"):
        load_model(d)


def test_wrong_shape_and_unexpected_key_are_named(tiny_model_dir, tmp_path):
    d = _copy(tiny_model_dir, tmp_path / "m")
    sd = torch.load(d / "llm.pt", weights_only=True)
    sd["llm_decoder.weight"] = torch.zeros(10, 64)
    torch.save(sd, d / "llm.pt")
    with pytest.raises(CheckpointMismatch, match=r"llm_decoder.weight' has shape \[10, 64\], expected \[6761, 64\]"):
        load_model(d)
    sd = torch.load(tiny_model_dir / "llm.pt", weights_only=True)
    sd["extra.weight"] = torch.zeros(1)
    torch.save(sd, d / "llm.pt")
    with pytest.raises(CheckpointMismatch, match="unexpected key 'extra.weight'"):
        load_model(d)


def test_hift_released_forms_are_accepted(tiny_model_dir, tmp_path):
    """`generator.` prefixes and old-style weight_g / weight_v names load to the same weights."""
    d = _copy(tiny_model_dir, tmp_path / "m")
    sd = torch.load(d / "hift.pt", weights_only=True)
    old = {}
    for k, v in sd.items():
        k = k.replace(".parametrizations.weight.original0", ".weight_g").replace(".parametrizations.weight.original1", ".weight_v")
        old["generator." + k] = v
    torch.save(old, d / "hift.pt")
    a, b = load_model(tiny_model_dir).hift, load_model(d).hift
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)


def test_pickled_code_is_refused(tiny_model_dir, tmp_path):
    d = _copy(tiny_model_dir, tmp_path / "m")
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (Path.touch, (marker,))

    torch.save({"x": Evil()}, d / "hift.pt")
    with pytest.raises(ModelDirError, match="cannot be loaded safely"):
        load_model(d)
    assert not marker.exists()


def test_not_a_model_dir_and_cosyvoice1_are_clear(tmp_path):
    with pytest.raises(ModelDirError, match="no cosyvoice3.yaml"):
        read_model_config(tmp_path)
    (tmp_path / "cosyvoice.yaml").write_text("sample_rate: 22050\n")
    with pytest.raises(ModelDirError, match="cosyvoice1 models are not supported"):
        read_model_config(tmp_path)


def test_writer_cli_writes_a_loadable_dir(tmp_path):
    import sys

    out = tmp_path / "cli-tiny"
    r = subprocess.run([sys.executable, "-m", "engine.models.writer", "--size", "tiny", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert read_model_config(out).flow.depth == 2
