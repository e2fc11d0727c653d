"""Load a model directory in the official Fun-CosyVoice3 (or CosyVoice2-0.5B) layout.

    <model_dir>/cosyvoice3.yaml                 hyper-parameters (read safely, see hyperyaml);
                                                cosyvoice2.yaml for a CosyVoice2 model
    <model_dir>/llm.pt, flow.pt, hift.pt        state dicts (torch.load(weights_only=True))
    <model_dir>/CosyVoice-BlankEN/              Qwen2 config.json + BPE tokenizer files
    <model_dir>/speech_tokenizer_v3.onnx        25 Hz speech tokenizer (v2 for CosyVoice2)
    <model_dir>/campplus.onnx                   speaker embedding

The yaml's name picks the model family; `FAMILIES` maps it to the yaml class names and
the module classes (CosyVoice3: CosyVoice3LM / CausalMaskedDiffWithDiT /
CausalHiFTGenerator; CosyVoice2: Qwen2LM / CausalMaskedDiffWithXvec / HiFTGenerator).

The same code path loads a real download and the random-weight directories that
`engine.models.writer` produces for tests and benchmarks.

`check_model_dir` (run first by `read_model_config`, and by `engine.hub.resolve_model`
for a local directory) refuses a partial directory before anything loads, naming every
required file that is missing, empty or a Git LFS pointer in one ModelDirError.
"""

from __future__ import annotations

import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn

from .config import FlowConfig, HiFTConfig, LMConfig, MelConfig, ModelConfig, Qwen2Config, SamplingConfig
from .cv2_config import CV2FlowConfig, CV2LMConfig
from .hyperyaml import Node, load_hyper_yaml

YAML_NAMES = {"cosyvoice3.yaml": "cosyvoice3", "cosyvoice2.yaml": "cosyvoice2", "cosyvoice.yaml": "cosyvoice1"}


@dataclass(frozen=True)
class Family:
    """What differs between supported model versions, as far as loading goes."""

    yaml_name: str
    llm_class: str  # class names in the yaml's `!new:` tags
    flow_class: str
    hift_class: str
    speech_tokenizer: str  # ONNX file name in the model directory


FAMILIES = {
    "cosyvoice3": Family("cosyvoice3.yaml", "CosyVoice3LM", "CausalMaskedDiffWithDiT", "CausalHiFTGenerator",
                         "speech_tokenizer_v3.onnx"),
    "cosyvoice2": Family("cosyvoice2.yaml", "Qwen2LM", "CausalMaskedDiffWithXvec", "HiFTGenerator",
                         "speech_tokenizer_v2.onnx"),
}


# What the tokenizer (`engine.frontend.tokenizer.TextTokenizer.from_dir`) opens, plus the
# Qwen2 config.json the loader reads. generation_config.json and model.safetensors (the
# Qwen2 text weights: CosyVoice's copy lives in llm.pt) are read by nothing here.
TOKENIZER_DIR = "CosyVoice-BlankEN"
TOKENIZER_FILES = ("config.json", "vocab.json", "merges.txt", "tokenizer_config.json")
LFS_POINTER = b"version https://git-lfs"
CHECKPOINT_MAGIC = (b"PK", b"\x80")  # torch.save's zip format; the legacy pickle format


def family(version: str) -> Family:
    if version not in FAMILIES:
        raise ModelDirError(f"{version} models are not supported (CosyVoice3 and CosyVoice2 are)")
    return FAMILIES[version]


class ModelDirError(ValueError):
    """The directory is not a usable model directory; the message says what is wrong."""


class CheckpointMismatch(ModelDirError):
    """A state dict does not match the module it should load into."""


def detect_version(model_dir: Path) -> str:
    for name, version in YAML_NAMES.items():
        if (model_dir / name).is_file():
            return version
    raise ModelDirError(f"{model_dir}: no cosyvoice3.yaml (or cosyvoice2.yaml) found; is this a CosyVoice model directory?")


def required_files(version: str) -> list[str]:
    """Every file of a model directory that serving `version` reads (relative paths)."""
    fam = family(version)
    return [fam.yaml_name, "llm.pt", "flow.pt", "hift.pt", "campplus.onnx", fam.speech_tokenizer,
            *(f"{TOKENIZER_DIR}/{name}" for name in TOKENIZER_FILES)]


def _file_problem(path: Path) -> str | None:
    if not path.is_file():
        return "missing" if not path.exists() else "not a regular file"
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(64)
    checkpoint = path.suffix == ".pt"
    if head.startswith(LFS_POINTER):
        return f"a Git LFS pointer, not the {'checkpoint' if checkpoint else 'file'}: run `git lfs pull` in the model directory"
    if checkpoint and not head.startswith(CHECKPOINT_MAGIC):
        return f"truncated or not a checkpoint ({size} bytes)"
    if size == 0:
        return "empty (0 bytes)"
    return None


def check_model_dir(model_dir: Path | str, version: str) -> None:
    """Raise one ModelDirError naming every required file that is missing, empty or a
    Git LFS pointer (a clone without git-lfs), before anything is loaded.

    Cheap (a stat and the first bytes of each file), so a partial download is refused
    in milliseconds instead of after llm.pt and flow.pt loaded, and every problem is
    listed at once rather than one per start."""
    model_dir = Path(model_dir)
    problems = [(name, why) for name in required_files(version)
                if (why := _file_problem(model_dir / name)) is not None]
    if problems:
        lines = "\n".join(f"  {name}: {why}" for name, why in problems)
        raise ModelDirError(
            f"{model_dir} is not a complete {version} model directory "
            f"({len(problems)} of {len(required_files(version))} required files unusable):\n{lines}"
        )


def _node(raw: dict[str, Any], key: str) -> Node:
    value = raw.get(key)
    if not isinstance(value, Node):
        raise ModelDirError(f"yaml: '{key}' must be a !new: entry")
    return value


def read_model_config(model_dir: Path) -> ModelConfig:
    """Build a ModelConfig from the yaml and CosyVoice-BlankEN/config.json.

    First checks that every file serving needs is there (`check_model_dir`), so a partial
    directory is refused before anything loads."""
    model_dir = Path(model_dir)
    version = detect_version(model_dir)
    fam = family(version)
    check_model_dir(model_dir, version)
    yaml_path = model_dir / fam.yaml_name
    try:
        raw = load_hyper_yaml(yaml_path)
    except (yaml.YAMLError, ValueError, UnicodeDecodeError) as exc:  # HyperYamlError is a ValueError
        raise ModelDirError(f"{yaml_path}: {exc}") from exc
    qwen_json = model_dir / TOKENIZER_DIR / "config.json"
    try:
        qwen = Qwen2Config.from_hf_json(qwen_json)
    except (ValueError, TypeError, UnicodeDecodeError) as exc:  # json.JSONDecodeError is a ValueError
        raise ModelDirError(f"{qwen_json}: {exc}") from exc

    llm = _node(raw, "llm")
    if llm.class_name != fam.llm_class:
        raise ModelDirError(f"yaml: llm is {llm.class_name}, expected {fam.llm_class}")
    samp = llm.get("sampling")
    samp_args = samp.value if isinstance(samp, Node) and isinstance(samp.value, dict) else {}
    lm_cls = CV2LMConfig if version == "cosyvoice2" else LMConfig
    lm = lm_cls(
        qwen=qwen,
        speech_token_size=int(llm.get("speech_token_size", 6561)),
        mix_ratio=tuple(llm.get("mix_ratio", (5, 15))),  # type: ignore[arg-type]
        sampling=SamplingConfig(**{k: samp_args[k] for k in ("top_p", "top_k", "win_size", "tau_r") if k in samp_args}),
    )

    flow_node = _node(raw, "flow")
    if flow_node.class_name != fam.flow_class:
        raise ModelDirError(f"yaml: flow is {flow_node.class_name}, expected {fam.flow_class}")
    flow = _read_cv2_flow(flow_node) if version == "cosyvoice2" else _read_cv3_flow(flow_node)

    hift_node = _node(raw, "hift")
    if hift_node.class_name != fam.hift_class:
        raise ModelDirError(f"yaml: hift is {hift_node.class_name}, expected {fam.hift_class}")
    hift = _read_hift(hift_node)

    mel = MelConfig()
    feat = raw.get("feat_extractor")
    if isinstance(feat, Node):
        mel = MelConfig(
            n_fft=int(feat.get("n_fft", mel.n_fft)),
            num_mels=int(feat.get("num_mels", mel.num_mels)),
            sampling_rate=int(feat.get("sampling_rate", mel.sampling_rate)),
            hop_size=int(feat.get("hop_size", mel.hop_size)),
            win_size=int(feat.get("win_size", mel.win_size)),
            fmin=float(feat.get("fmin", mel.fmin) or 0),
            fmax=None if feat.get("fmax") is None else float(feat.get("fmax")),
            center=bool(feat.get("center", mel.center)),
        )
    return ModelConfig(
        version=version,
        sample_rate=int(raw.get("sample_rate", 24000)),
        token_frame_rate=int(raw.get("token_frame_rate", 25)),
        chunk_size=int(raw.get("chunk_size", 25)),
        lm=lm,
        flow=flow,
        hift=hift,
        mel=mel,
    )


def _cfm_args(dec: Any) -> dict[str, Any]:
    cfm = dec.get("cfm_params") if isinstance(dec, Node) else None
    return cfm.get("content", {}) if isinstance(cfm, Node) else (cfm or {})


def _read_cv3_flow(flow_node: Node) -> FlowConfig:
    pre = flow_node.get("pre_lookahead_layer")
    dec = flow_node.get("decoder")
    est = dec.get("estimator") if isinstance(dec, Node) else None
    if not isinstance(pre, Node) or not isinstance(est, Node):
        raise ModelDirError("yaml: flow needs pre_lookahead_layer and decoder.estimator entries")
    cfm_args = _cfm_args(dec)
    return FlowConfig(
        input_size=int(flow_node.get("input_size", 80)),
        output_size=int(flow_node.get("output_size", 80)),
        spk_embed_dim=int(flow_node.get("spk_embed_dim", 192)),
        vocab_size=int(flow_node.get("vocab_size", 6561)),
        token_mel_ratio=int(flow_node.get("token_mel_ratio", 2)),
        pre_lookahead_len=int(flow_node.get("pre_lookahead_len", 3)),
        pre_lookahead_channels=int(pre.get("channels", 1024)),
        dim=int(est.get("dim", 1024)),
        depth=int(est.get("depth", 22)),
        heads=int(est.get("heads", 16)),
        dim_head=int(est.get("dim_head", 64)),
        ff_mult=int(est.get("ff_mult", 2)),
        static_chunk_size=int(est.get("static_chunk_size", 50)),
        inference_cfg_rate=float(cfm_args.get("inference_cfg_rate", 0.7)),
        sigma_min=float(cfm_args.get("sigma_min", 1e-6)),
    )


def _read_cv2_flow(flow_node: Node) -> CV2FlowConfig:
    enc = flow_node.get("encoder")
    dec = flow_node.get("decoder")
    est = dec.get("estimator") if isinstance(dec, Node) else None
    if not isinstance(enc, Node) or not isinstance(est, Node):
        raise ModelDirError("yaml: flow needs encoder and decoder.estimator entries")
    if enc.class_name != "UpsampleConformerEncoder" or est.class_name != "CausalConditionalDecoder":
        raise ModelDirError(
            f"yaml: flow encoder/estimator are {enc.class_name}/{est.class_name}, "
            "expected UpsampleConformerEncoder/CausalConditionalDecoder"
        )
    for key, want in (("use_cnn_module", False), ("macaron_style", False), ("input_layer", "linear"),
                      ("pos_enc_layer_type", "rel_pos_espnet"), ("selfattention_layer_type", "rel_selfattn")):
        if enc.get(key, want) != want:
            raise ModelDirError(f"yaml: flow.encoder.{key} must be {want!r} (the CosyVoice2 encoder)")
    if str(est.get("act_fn", "gelu")) != "gelu":
        raise ModelDirError("yaml: flow.decoder.estimator.act_fn must be 'gelu'")
    cfm_args = _cfm_args(dec)
    d = CV2FlowConfig()
    return CV2FlowConfig(
        input_size=int(flow_node.get("input_size", d.input_size)),
        output_size=int(flow_node.get("output_size", d.output_size)),
        spk_embed_dim=int(flow_node.get("spk_embed_dim", d.spk_embed_dim)),
        vocab_size=int(flow_node.get("vocab_size", d.vocab_size)),
        token_mel_ratio=int(flow_node.get("token_mel_ratio", d.token_mel_ratio)),
        pre_lookahead_len=int(flow_node.get("pre_lookahead_len", d.pre_lookahead_len)),
        encoder_output_size=int(enc.get("output_size", d.encoder_output_size)),
        encoder_heads=int(enc.get("attention_heads", d.encoder_heads)),
        encoder_linear_units=int(enc.get("linear_units", d.encoder_linear_units)),
        encoder_blocks=int(enc.get("num_blocks", d.encoder_blocks)),
        # Not a yaml key officially (hard-coded 4); our writer records it for tiny models.
        encoder_up_blocks=int(enc.get("num_up_blocks", d.encoder_up_blocks)),
        encoder_chunk_size=int(enc.get("static_chunk_size", d.encoder_chunk_size)),
        static_chunk_size=int(est.get("static_chunk_size", d.static_chunk_size)),
        unet_in_channels=int(est.get("in_channels", d.unet_in_channels)),
        unet_channels=tuple(int(c) for c in est.get("channels", d.unet_channels)),
        unet_head_dim=int(est.get("attention_head_dim", d.unet_head_dim)),
        unet_heads=int(est.get("num_heads", d.unet_heads)),
        unet_blocks=int(est.get("n_blocks", d.unet_blocks)),
        unet_mid_blocks=int(est.get("num_mid_blocks", d.unet_mid_blocks)),
        inference_cfg_rate=float(cfm_args.get("inference_cfg_rate", d.inference_cfg_rate)),
        sigma_min=float(cfm_args.get("sigma_min", d.sigma_min)),
    )


def _read_hift(hift_node: Node) -> HiFTConfig:
    istft = hift_node.get("istft_params", {}) or {}
    f0 = hift_node.get("f0_predictor")
    d = HiFTConfig()
    return HiFTConfig(
        in_channels=int(hift_node.get("in_channels", d.in_channels)),
        base_channels=int(hift_node.get("base_channels", d.base_channels)),
        nb_harmonics=int(hift_node.get("nb_harmonics", d.nb_harmonics)),
        sampling_rate=int(hift_node.get("sampling_rate", d.sampling_rate)),
        nsf_alpha=float(hift_node.get("nsf_alpha", d.nsf_alpha)),
        nsf_sigma=float(hift_node.get("nsf_sigma", d.nsf_sigma)),
        nsf_voiced_threshold=float(hift_node.get("nsf_voiced_threshold", d.nsf_voiced_threshold)),
        upsample_rates=tuple(hift_node.get("upsample_rates", d.upsample_rates)),
        upsample_kernel_sizes=tuple(hift_node.get("upsample_kernel_sizes", d.upsample_kernel_sizes)),
        n_fft=int(istft.get("n_fft", d.n_fft)),
        hop_len=int(istft.get("hop_len", d.hop_len)),
        resblock_kernel_sizes=tuple(hift_node.get("resblock_kernel_sizes", d.resblock_kernel_sizes)),
        resblock_dilation_sizes=tuple(tuple(x) for x in hift_node.get("resblock_dilation_sizes", d.resblock_dilation_sizes)),
        source_resblock_kernel_sizes=tuple(hift_node.get("source_resblock_kernel_sizes", d.source_resblock_kernel_sizes)),
        source_resblock_dilation_sizes=tuple(
            tuple(x) for x in hift_node.get("source_resblock_dilation_sizes", d.source_resblock_dilation_sizes)
        ),
        lrelu_slope=float(hift_node.get("lrelu_slope", d.lrelu_slope)),
        audio_limit=float(hift_node.get("audio_limit", d.audio_limit)),
        conv_pre_look_right=int(hift_node.get("conv_pre_look_right", d.conv_pre_look_right)),
        f0_cond_channels=int(f0.get("cond_channels", d.f0_cond_channels)) if isinstance(f0, Node) else d.f0_cond_channels,
    )


def _normalise_hift_keys(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Released hift.pt files may carry a `generator.` prefix and the old weight-norm names."""
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        if not isinstance(key, str):  # left for check_state_dict to report
            out[key] = value
            continue
        if key.startswith("generator."):
            key = key[len("generator.") :]
        if key.endswith(".weight_g"):
            key = key[: -len(".weight_g")] + ".parametrizations.weight.original0"
        elif key.endswith(".weight_v"):
            key = key[: -len(".weight_v")] + ".parametrizations.weight.original1"
        out[key] = value
    return out


SHOWN_KEYS = 5  # keys named per kind of problem; the rest are counted


def check_state_dict(module: nn.Module, sd: dict[str, Any], what: str) -> None:
    """Raise one CheckpointMismatch listing the missing, unexpected, non-tensor and
    mis-shaped keys: the first few of each kind by name, with counts."""
    expected = module.state_dict()
    groups: list[tuple[str, list[str]]] = [
        ("missing", [f"missing key '{k}' (expected shape {list(ref.shape)})"
                     for k, ref in expected.items() if k not in sd]),
        ("unexpected", [f"unexpected key '{k}'" for k in sd if k not in expected]),
        ("non-tensor", [f"key '{k}' is a {type(v).__name__}, not a tensor"
                        for k, v in sd.items() if k in expected and not isinstance(v, torch.Tensor)]),
        ("mis-shaped", [f"key '{k}' has shape {list(v.shape)}, expected {list(expected[k].shape)}"
                        for k, v in sd.items()
                        if k in expected and isinstance(v, torch.Tensor) and tuple(v.shape) != tuple(expected[k].shape)]),
    ]
    parts = []
    for label, items in groups:
        if not items:
            continue
        text = ", ".join(items[:SHOWN_KEYS])
        if len(items) > SHOWN_KEYS:
            text += f", ... ({len(items)} {label} keys in all)"
        elif len(items) > 1:
            text += f" ({len(items)} {label} keys)"
        parts.append(text)
    if parts:
        raise CheckpointMismatch(f"{what}: " + "; ".join(parts))


def _unpickling_detail(exc: BaseException) -> str:
    """What the weights-only unpickler refused, without torch's advice to turn it off."""
    text = str(exc)
    m = re.search(r"WeightsUnpickler error:\s*(.*?)(?:\.\s+Please|\n|$)", text)
    detail = m.group(1) if m else text.splitlines()[0] if text else type(exc).__name__
    return detail.strip()


def load_state_strict(module: nn.Module, path: Path, what: str, *, hift: bool = False) -> None:
    if not path.is_file():
        raise ModelDirError(f"missing {path.name} in {path.parent}")
    if (problem := _file_problem(path)) is not None:  # the directory check's, for a file loaded alone
        raise ModelDirError(f"{path}: {problem}")
    size = path.stat().st_size
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:  # a pickle that needs code to load is refused here
        raise ModelDirError(
            f"{path}: cannot be loaded safely as a state dict: it needs code to load (refused): {_unpickling_detail(exc)}"
        ) from exc
    except Exception as exc:  # a cut-off zip or pickle
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelDirError(f"{path}: truncated or not a checkpoint ({size} bytes): {reason}") from exc
    if not isinstance(sd, dict):
        raise ModelDirError(f"{path}: expected a state dict, got {type(sd).__name__}")
    if hift:
        sd = _normalise_hift_keys(sd)
    check_state_dict(module, sd, what)
    module.load_state_dict(sd, strict=True)


@dataclass
class LoadedModel:
    """The three networks plus the config they were built from (weights on CPU, eval mode)."""

    model_dir: Path
    config: ModelConfig
    lm: nn.Module
    flow: nn.Module
    hift: nn.Module


def module_classes(version: str) -> tuple[type[nn.Module], type[nn.Module], type[nn.Module]]:
    """(LM, flow, vocoder) module classes of a model version; each takes its config section."""
    if version == "cosyvoice2":
        from .cv2_flow import CausalMaskedDiffWithXvec
        from .cv2_hift import HiFTGenerator
        from .cv2_lm import Qwen2LM

        return Qwen2LM, CausalMaskedDiffWithXvec, HiFTGenerator
    family(version)  # unknown versions fail with a clear message
    from .flow import CausalMaskedDiffWithDiT
    from .hift import CausalHiFTGenerator
    from .lm import CosyVoice3LM

    return CosyVoice3LM, CausalMaskedDiffWithDiT, CausalHiFTGenerator


def load_model(model_dir: Path | str, *, load_lm: bool = True) -> LoadedModel:
    """Build the networks from the yaml and load the three state dicts strictly.

    load_lm=False skips llm.pt when another backend (vLLM) owns the LM weights.
    """
    model_dir = Path(model_dir)
    cfg = read_model_config(model_dir)
    lm_cls, flow_cls, hift_cls = module_classes(cfg.version)
    lm: nn.Module
    if load_lm:
        lm = lm_cls(cfg.lm)
        load_state_strict(lm, model_dir / "llm.pt", "llm.pt")
        lm.eval()
    else:
        lm = nn.Module()
    flow = flow_cls(cfg.flow)
    load_state_strict(flow, model_dir / "flow.pt", "flow.pt")
    flow.eval()
    hift = hift_cls(cfg.hift)
    load_state_strict(hift, model_dir / "hift.pt", "hift.pt", hift=True)
    hift.fold_weight_norm()
    hift.eval()
    return LoadedModel(model_dir=model_dir, config=cfg, lm=lm, flow=flow, hift=hift)


__all__ = [
    "CheckpointMismatch",
    "FAMILIES",
    "Family",
    "LoadedModel",
    "ModelDirError",
    "check_model_dir",
    "check_state_dict",
    "detect_version",
    "load_model",
    "family",
    "load_state_strict",
    "module_classes",
    "read_model_config",
    "required_files",
]
