"""Hyper-parameters of the CosyVoice3 networks, as plain frozen dataclasses.

The defaults are the released Fun-CosyVoice3-0.5B sizes. `ModelConfig.from_yaml`
reads an official `cosyvoice3.yaml` (through the safe reader in `hyperyaml`) and the
Qwen2 `config.json` of `CosyVoice-BlankEN/`; `tiny()` gives the small variant used by
tests. Every network module takes exactly one of these objects.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Qwen2Config:
    hidden_size: int = 896
    num_hidden_layers: int = 24
    num_attention_heads: int = 14
    num_key_value_heads: int = 2
    intermediate_size: int = 4864
    vocab_size: int = 151936
    rope_theta: float = 1000000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf_json(cls, path: Path) -> "Qwen2Config":
        raw = json.loads(Path(path).read_text())
        names = {f for f in cls.__dataclass_fields__}
        return cls(**{k: raw[k] for k in names if k in raw})

    def to_hf_json(self) -> dict[str, Any]:
        return {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "vocab_size": self.vocab_size,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "max_window_layers": self.num_hidden_layers,
            "tie_word_embeddings": False,
            "use_sliding_window": False,
            "torch_dtype": "bfloat16",
            "bos_token_id": 151643,
            "eos_token_id": 151643,
        }


@dataclass(frozen=True)
class SamplingConfig:
    """RAS (repetition-aware sampling) parameters from the yaml's `sampling` entry."""

    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10
    tau_r: float = 0.1


@dataclass(frozen=True)
class LMConfig:
    qwen: Qwen2Config = field(default_factory=Qwen2Config)
    speech_token_size: int = 6561
    # CosyVoice3 keeps 200 reserved ids after the codebook: sos, eos, task_id, fill, ...
    num_reserved: int = 200
    mix_ratio: tuple[int, int] = (5, 15)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    min_token_text_ratio: float = 2.0
    max_token_text_ratio: float = 20.0

    @property
    def speech_vocab_size(self) -> int:
        return self.speech_token_size + self.num_reserved

    @property
    def sos(self) -> int:
        return self.speech_token_size

    @property
    def eos(self) -> int:
        return self.speech_token_size + 1

    @property
    def task_id(self) -> int:
        return self.speech_token_size + 2

    @property
    def fill_token(self) -> int:
        return self.speech_token_size + 3

    @property
    def text_offset(self) -> int:
        """First text id of the unified vocabulary (`engine.models.vocab`). CosyVoice3 keeps
        sos/task_id inside the speech table, so text follows it directly; CosyVoice2's LM
        config (`engine.models.cv2_config.CV2LMConfig`) puts two more rows in between."""
        return self.speech_vocab_size


@dataclass(frozen=True)
class FlowConfig:
    input_size: int = 80
    output_size: int = 80
    spk_embed_dim: int = 192
    vocab_size: int = 6561
    token_mel_ratio: int = 2
    pre_lookahead_len: int = 3
    pre_lookahead_channels: int = 1024
    # DiT estimator
    dim: int = 1024
    depth: int = 22
    heads: int = 16
    dim_head: int = 64
    ff_mult: int = 2
    static_chunk_size: int = 50
    # conditional flow matching
    n_timesteps: int = 10
    inference_cfg_rate: float = 0.7
    sigma_min: float = 1e-6


@dataclass(frozen=True)
class HiFTConfig:
    in_channels: int = 80
    base_channels: int = 512
    nb_harmonics: int = 8
    sampling_rate: int = 24000
    nsf_alpha: float = 0.1
    nsf_sigma: float = 0.003
    nsf_voiced_threshold: float = 10.0
    upsample_rates: tuple[int, ...] = (8, 5, 3)
    upsample_kernel_sizes: tuple[int, ...] = (16, 11, 7)
    n_fft: int = 16
    hop_len: int = 4
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    source_resblock_kernel_sizes: tuple[int, ...] = (7, 7, 11)
    source_resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    lrelu_slope: float = 0.1
    audio_limit: float = 0.99
    conv_pre_look_right: int = 4
    f0_cond_channels: int = 512

    @property
    def samples_per_frame(self) -> int:
        n = self.hop_len
        for r in self.upsample_rates:
            n *= r
        return n


@dataclass(frozen=True)
class MelConfig:
    """Parameters of the 24 kHz prompt mel (`feat_extractor` in the yaml)."""

    n_fft: int = 1920
    num_mels: int = 80
    sampling_rate: int = 24000
    hop_size: int = 480
    win_size: int = 1920
    fmin: float = 0.0
    fmax: float | None = None
    center: bool = False


@dataclass(frozen=True)
class ModelConfig:
    """Everything needed to build the three CosyVoice3 networks and their frontend."""

    version: str = "cosyvoice3"
    sample_rate: int = 24000
    token_frame_rate: int = 25
    chunk_size: int = 25
    lm: LMConfig = field(default_factory=LMConfig)
    flow: FlowConfig = field(default_factory=FlowConfig)
    hift: HiFTConfig = field(default_factory=HiFTConfig)
    mel: MelConfig = field(default_factory=MelConfig)

    @classmethod
    def tiny(cls) -> "ModelConfig":
        """Small random-weight variant: real vocabularies, small widths and depths."""
        qwen = Qwen2Config(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
        )
        return cls(
            lm=LMConfig(qwen=qwen),
            flow=FlowConfig(pre_lookahead_channels=64, dim=64, depth=2, heads=4, dim_head=16),
            hift=HiFTConfig(base_channels=32, f0_cond_channels=32),
        )

    def with_qwen(self, qwen: Qwen2Config) -> "ModelConfig":
        return replace(self, lm=replace(self.lm, qwen=qwen))
