"""Hyper-parameters of the CosyVoice2 networks (CosyVoice2-0.5B), next to the CosyVoice3 ones.

CosyVoice2 shares the Qwen2 backbone, the flow-matching solver, the HiFT layout and the
25 Hz token rate with CosyVoice3; what differs lives here:

* LM (`Qwen2LM`): the speech table has only 3 extra rows after the 6561 codes (eos 6561,
  6562, fill 6563), while sos and task_id come from a separate 2-row `llm_embedding`. In
  the unified vocabulary those two rows sit between the speech rows and the text, so
  sos = 6564, task_id = 6565 and text starts at 6566.
* flow (`CausalMaskedDiffWithXvec`): a Conformer encoder that upsamples x2 (512 wide) and
  a causal U-Net estimator instead of the DiT.
* vocoder (`HiFTGenerator`): the non-causal HiFT; it uses `HiFTConfig` as is
  (`conv_pre_look_right` means nothing to it).
* prompt mel with fmax 8000 (cosyvoice2.yaml's `feat_extractor`).

Defaults are the released sizes (examples/libritts/cosyvoice2/conf/cosyvoice2.yaml);
`cv2_model_config("tiny")` is the small test variant.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import FlowConfig, HiFTConfig, LMConfig, MelConfig, ModelConfig, Qwen2Config

# Rows of `llm_embedding`: index 0 is sos, index 1 is task_id.
LLM_EMBEDDING_ROWS = 2


@dataclass(frozen=True)
class CV2LMConfig(LMConfig):
    num_reserved: int = 3  # eos (6561), an unused id (6562), fill (6563)

    @property
    def eos(self) -> int:
        return self.speech_token_size  # 6561 (CosyVoice3's 6561 is sos)

    @property
    def sos(self) -> int:
        return self.speech_vocab_size  # llm_embedding row 0

    @property
    def task_id(self) -> int:
        return self.speech_vocab_size + 1  # llm_embedding row 1

    @property
    def fill_token(self) -> int:
        return self.speech_token_size + 2

    @property
    def text_offset(self) -> int:
        return self.speech_vocab_size + LLM_EMBEDDING_ROWS


@dataclass(frozen=True)
class CV2FlowConfig(FlowConfig):
    """`FlowConfig` plus the Conformer encoder and U-Net sizes. Inherited DiT fields are
    unused; `static_chunk_size` is the estimator's block in mel frames (chunk_size x 2)."""

    input_size: int = 512
    # UpsampleConformerEncoder (the official code hard-codes the pre-lookahead and
    # upsampling widths to 512 = output_size, and 4 blocks after the upsampling)
    encoder_output_size: int = 512
    encoder_heads: int = 8
    encoder_linear_units: int = 2048
    encoder_blocks: int = 6
    encoder_up_blocks: int = 4
    encoder_chunk_size: int = 25  # tokens per attention block before the x2 upsampling
    # CausalConditionalDecoder (U-Net)
    unet_in_channels: int = 320  # x, mu, spks, cond stacked: 4 x 80
    unet_channels: tuple[int, ...] = (256,)
    unet_head_dim: int = 64
    unet_heads: int = 8
    unet_blocks: int = 4  # transformer blocks per U-Net stage
    unet_mid_blocks: int = 12


def cv2_model_config(size: str = "full", qwen: Qwen2Config | None = None) -> ModelConfig:
    """The CosyVoice2 ModelConfig: released sizes ("full") or the small test variant ("tiny")."""
    if size == "full":
        return ModelConfig(
            version="cosyvoice2",
            lm=CV2LMConfig(qwen=qwen or Qwen2Config()),
            flow=CV2FlowConfig(),
            hift=HiFTConfig(),
            mel=MelConfig(fmax=8000.0),
        )
    if size != "tiny":
        raise ValueError(f"size must be 'tiny' or 'full', not {size!r}")
    tiny_qwen = qwen or Qwen2Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128
    )
    flow = CV2FlowConfig(
        input_size=64,
        encoder_output_size=64,
        encoder_heads=4,
        encoder_linear_units=128,
        encoder_blocks=2,
        encoder_up_blocks=2,
        unet_channels=(64,),
        unet_head_dim=16,
        unet_heads=4,
        unet_blocks=1,
        unet_mid_blocks=2,
    )
    return ModelConfig(
        version="cosyvoice2",
        lm=CV2LMConfig(qwen=tiny_qwen),
        flow=flow,
        hift=HiFTConfig(base_channels=32, f0_cond_channels=32),
        mel=MelConfig(fmax=8000.0),
    )
