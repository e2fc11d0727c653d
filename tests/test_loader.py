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


class _TouchOnLoad:
    """Pickles as a call that creates `marker`: code a checkpoint would run when unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_pickled_code_is_refused(tiny_model_dir, tmp_path):
    d = _copy(tiny_model_dir, tmp_path / "m")
    marker = tmp_path / "ran"
    torch.save({"x": _TouchOnLoad(marker)}, d / "hift.pt")
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


# ----------------------------------------------------------------------------- broken directories

LFS_POINTER_TEXT = "version https://git-lfs.github.com/spec/v1\noid sha256:4d7a0b6f0e8c1c2f\nsize 2023316821\n"


def test_written_dirs_have_every_required_file(tiny_model_dir, tmp_path):
    from engine.models.loader import check_model_dir, required_files
    from engine.models.writer import write_model_dir

    check_model_dir(tiny_model_dir, "cosyvoice3")
    cv2 = write_model_dir(tmp_path / "cv2", "tiny", version="cosyvoice2")
    check_model_dir(cv2, "cosyvoice2")
    assert "speech_tokenizer_v2.onnx" in required_files("cosyvoice2")
    assert {"campplus.onnx", "speech_tokenizer_v3.onnx", "CosyVoice-BlankEN/vocab.json", "CosyVoice-BlankEN/merges.txt",
            "CosyVoice-BlankEN/tokenizer_config.json", "CosyVoice-BlankEN/config.json"} <= set(required_files("cosyvoice3"))


def test_partial_dir_is_refused_at_once_with_every_problem_listed(tiny_model_dir, tmp_path, monkeypatch):
    d = _copy(tiny_model_dir, tmp_path / "m")
    (d / "hift.pt").unlink()
    (d / "campplus.onnx").unlink()
    (d / "CosyVoice-BlankEN" / "vocab.json").unlink()
    (d / "speech_tokenizer_v3.onnx").write_text(LFS_POINTER_TEXT)
    (d / "CosyVoice-BlankEN" / "merges.txt").write_text(LFS_POINTER_TEXT)
    (d / "CosyVoice-BlankEN" / "tokenizer_config.json").write_bytes(b"")
    (d / "llm.pt").write_text(LFS_POINTER_TEXT)

    def no_load(*a, **k):
        raise AssertionError("a checkpoint was loaded before the directory was checked")

    monkeypatch.setattr(torch, "load", no_load)
    with pytest.raises(ModelDirError) as exc:
        load_model(d)
    msg = str(exc.value)
    assert "7 of 10 required files" in msg, msg
    for line in ("hift.pt: missing", "campplus.onnx: missing", "CosyVoice-BlankEN/vocab.json: missing",
                 "speech_tokenizer_v3.onnx: a Git LFS pointer", "CosyVoice-BlankEN/merges.txt: a Git LFS pointer",
                 "CosyVoice-BlankEN/tokenizer_config.json: empty", "llm.pt: a Git LFS pointer"):
        assert line in msg, (line, msg)
    assert "git lfs pull" in msg
    assert "flow.pt" not in msg and "cosyvoice3.yaml" not in msg
    with pytest.raises(ModelDirError, match="7 of 10"):
        read_model_config(d)


def test_bad_checkpoint_files_get_plain_reasons(tiny_model_dir, tmp_path):
    from engine.models.lm import CosyVoice3LM
    from engine.models.loader import load_state_strict

    module = CosyVoice3LM(ModelConfig.tiny().lm)
    p = tmp_path / "llm.pt"
    cases = {
        LFS_POINTER_TEXT.encode(): r"a Git LFS pointer, not the checkpoint: run `git lfs pull`",
        b"": r"truncated or not a checkpoint \(0 bytes\)",
        b"<html>not found</html>": r"truncated or not a checkpoint \(22 bytes\)",
        (tiny_model_dir / "llm.pt").read_bytes()[:5000]: r"truncated or not a checkpoint \(5000 bytes\)",
    }
    for data, pattern in cases.items():
        p.write_bytes(data)
        with pytest.raises(ModelDirError, match=pattern) as exc:
            load_state_strict(module, p, "llm.pt")
        assert "weights_only" not in str(exc.value), str(exc.value)

    d = _copy(tiny_model_dir, tmp_path / "m")
    (d / "flow.pt").write_bytes((tiny_model_dir / "flow.pt").read_bytes()[:5000])
    with pytest.raises(ModelDirError, match=r"flow.pt: truncated or not a checkpoint \(5000 bytes\)"):
        load_model(d)


def test_pickled_code_is_refused_without_torch_advice(tiny_model_dir, tmp_path):
    d = _copy(tiny_model_dir, tmp_path / "m")
    marker = tmp_path / "ran"
    torch.save({"x": _TouchOnLoad(marker)}, d / "flow.pt")
    with pytest.raises(ModelDirError, match=r"needs code to load \(refused\)") as exc:
        load_model(d)
    assert "weights_only" not in str(exc.value) and "Re-running" not in str(exc.value), str(exc.value)
    assert not marker.exists()


def test_yaml_and_config_json_errors_name_the_file(tiny_model_dir, tmp_path):
    d = _copy(tiny_model_dir, tmp_path / "m")
    y = d / "cosyvoice3.yaml"
    good = y.read_text()
    for text, pattern in [
        ("llm: !new:x\n  a: [1,\n", "while parsing"),
        ("# nothing but a comment\n", "the file is empty"),
        ("- 1\n- 2\n", "top level must be a mapping"),
        (good + "extra: !ref <no_such_key>\n", r"!ref <no_such_key>: no such key"),
        (good + "extra: !ref <llm.no_such_arg>\n", r"!ref <llm.no_such_arg>: no such key"),
    ]:
        y.write_text(text)
        with pytest.raises(ModelDirError, match=pattern) as exc:
            read_model_config(d)
        assert str(y) in str(exc.value), str(exc.value)
    y.write_text(good)
    cfg_json = d / "CosyVoice-BlankEN" / "config.json"
    cfg_json.write_text("{")
    with pytest.raises(ModelDirError, match="Expecting property name") as exc:
        read_model_config(d)
    assert str(cfg_json) in str(exc.value)


def test_ref_lookup_indexes_lists_and_joins_strings(tmp_path):
    p = tmp_path / "x.yaml"
    p.write_text("a: [1, 2]\nb: !ref <a[1]>\nd: /x\ne: !ref <d>/y\n")
    raw = load_hyper_yaml(p)
    assert raw["b"] == 2 and raw["e"] == "/x/y"
    p.write_text("a: [1, 2]\nb: !ref <a[5]>\n")
    with pytest.raises(ValueError, match=r"!ref <a\[5\]>: no such key"):
        load_hyper_yaml(p)


def test_yaml_alias_bomb_is_refused_cheaply(tiny_model_dir, tmp_path, monkeypatch):
    from engine.models import hyperyaml

    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 7)]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(lines) + "\n")  # 393 bytes, 10^7 leaves once expanded
    # Refused at the first anchor, on line 1, before any alias is followed.
    with pytest.raises(ValueError, match=r"anchors \(&a0\)[\s\S]*line 1,"):  # HyperYamlError, a ValueError
        load_hyper_yaml(bomb)
    bomb.write_text("a: [1]\nb: *a\n")
    with pytest.raises(ValueError, match="aliases"):
        load_hyper_yaml(bomb)
    # The same blow-up through !ref copies stops at a node budget: exactly MAX_NODES
    # nodes are built, not the 10^7 the file asks for.
    built = 0
    resolve = hyperyaml._Resolver.__call__

    def counting(self, value, depth=0):
        nonlocal built
        built += 1
        return resolve(self, value, depth)

    monkeypatch.setattr(hyperyaml._Resolver, "__call__", counting)
    lines = ["a0: [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: [" + ", ".join([f"!ref <a{i - 1}>"] * 10) + "]" for i in range(1, 7)]
    bomb.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=f"more than {hyperyaml.MAX_NODES} nodes"):
        load_hyper_yaml(bomb)
    assert built == hyperyaml.MAX_NODES + 1
    monkeypatch.undo()

    d = _copy(tiny_model_dir, tmp_path / "m")
    (d / "cosyvoice3.yaml").write_text("x: &x 1\ny: *x\n" + (d / "cosyvoice3.yaml").read_text())
    with pytest.raises(ModelDirError, match="anchors"):
        read_model_config(d)


def test_state_dict_problems_are_all_reported(tiny_model_dir, tmp_path):
    d = _copy(tiny_model_dir, tmp_path / "m")
    sd = torch.load(d / "flow.pt", weights_only=True)
    keys = list(sd)
    for k in keys[:7]:  # 7 missing
        del sd[k]
    sd[keys[7]] = [0.0]  # a non-tensor under an expected key
    sd[keys[8]] = torch.zeros(3, 3, 3, 3)  # mis-shaped
    sd["epoch"] = 3  # unexpected, and not a tensor either
    sd["step"] = 1200
    torch.save(sd, d / "flow.pt")
    with pytest.raises(CheckpointMismatch) as exc:
        load_model(d)
    msg = str(exc.value)
    assert msg.startswith("flow.pt: "), msg
    assert "(7 missing keys in all)" in msg and f"missing key '{keys[0]}'" in msg and f"'{keys[6]}'" not in msg
    assert "unexpected key 'epoch', unexpected key 'step' (2 unexpected keys)" in msg
    assert f"key '{keys[7]}' is a list, not a tensor" in msg
    assert f"key '{keys[8]}' has shape [3, 3, 3, 3]" in msg


def test_tied_and_untied_lm_head_both_load(tiny_model_dir, tmp_path):
    """A real llm.pt stores lm_head sharing embed_tokens' storage (tie_word_embeddings);
    the writer's is independent. Both load, to the same values as the file."""
    d = _copy(tiny_model_dir, tmp_path / "m")
    sd = torch.load(d / "llm.pt", weights_only=True)
    emb = "llm.model.model.embed_tokens.weight"
    sd["llm.model.lm_head.weight"] = sd[emb]  # one storage, saved once
    torch.save(sd, d / "llm.pt")
    back = torch.load(d / "llm.pt", weights_only=True)
    assert back["llm.model.lm_head.weight"].untyped_storage().data_ptr() == back[emb].untyped_storage().data_ptr()
    lm = load_model(d).lm.state_dict()
    assert torch.equal(lm["llm.model.lm_head.weight"], sd[emb]) and torch.equal(lm[emb], sd[emb])
    assert load_model(tiny_model_dir).lm is not None
