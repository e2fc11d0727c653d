"""How tests/data/cosyvoice2_keys.txt was made (run by hand, not by pytest).

It instantiates the *official* CosyVoice2 modules at the sizes of
examples/libritts/cosyvoice2/conf/cosyvoice2.yaml (FunAudioLLM/CosyVoice at ace7c47, with
Matcha-TTS's matcha/ package for the U-Net blocks) and writes every state-dict key with its
shape. No weights are involved: only the constructors run. Needs, on PYTHONPATH, the
official `cosyvoice/` and `matcha/` source trees plus diffusers, transformers, einops,
omegaconf, conformer and scipy (none of which the gateway itself uses); torchaudio,
whisper and pyworld are only imported at module level by files we do not call, so they
are stubbed.

    PYTHONPATH=<deps>:<official trees> python tests/data/derive_cosyvoice2_keys.py > tests/data/cosyvoice2_keys.txt

The LM's Qwen2 backbone is built from a Qwen2Config with Qwen2.5-0.5B's sizes (the
official Qwen2Encoder loads it with from_pretrained, which needs the real files).
"""

from __future__ import annotations

import sys
import types


class _Dummy:
    """Any name imported from a stubbed module: a base class, or a pass-through decorator."""

    def __new__(cls, *args: object, **kwargs: object) -> object:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return object.__new__(cls)


class _StubModule(types.ModuleType):
    def __getattr__(self, attr: str) -> object:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return type(attr, (_Dummy,), {})


def _stub(name: str) -> None:
    import importlib.machinery

    mod = _StubModule(name)
    mod.__path__ = []  # type: ignore[attr-defined]
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    sys.modules[name] = mod
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, mod)


_STUBS = (
    "torchaudio", "torchaudio.compliance", "torchaudio.compliance.kaldi", "whisper", "pyworld",
    # matcha/utils/__init__ imports its training helpers (hydra, lightning, rich, ...)
    "hydra", "hydra.core", "hydra.core.hydra_config", "lightning", "lightning.pytorch",
    "lightning.pytorch.utilities", "lightning.pytorch.loggers", "lightning.pytorch.callbacks",
    "lightning_utilities", "lightning_utilities.core", "lightning_utilities.core.rank_zero",
    "rich", "rich.syntax", "rich.tree", "rich.prompt", "gdown", "wget", "matplotlib", "matplotlib.pyplot",
)
for _name in _STUBS:
    _stub(_name)

import torch  # noqa: E402


def main() -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from cosyvoice.flow.decoder import CausalConditionalDecoder
    from cosyvoice.flow.flow import CausalMaskedDiffWithXvec
    from cosyvoice.flow.flow_matching import CausalConditionalCFM
    from cosyvoice.hifigan.f0_predictor import ConvRNNF0Predictor
    from cosyvoice.hifigan.generator import HiFTGenerator
    from cosyvoice.llm.llm import Qwen2LM
    from cosyvoice.transformer.upsample_encoder import UpsampleConformerEncoder
    from omegaconf import DictConfig

    class Backbone(torch.nn.Module):  # stands in for cosyvoice.llm.llm.Qwen2Encoder
        def __init__(self) -> None:
            super().__init__()
            cfg = Qwen2Config(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                              intermediate_size=4864, vocab_size=151936, tie_word_embeddings=False)
            self.model = Qwen2ForCausalLM(cfg)

    llm = Qwen2LM(llm_input_size=896, llm_output_size=896, speech_token_size=6561, llm=Backbone(), sampling=None)
    encoder = UpsampleConformerEncoder(
        input_size=512, output_size=512, attention_heads=8, linear_units=2048, num_blocks=6, dropout_rate=0.1,
        positional_dropout_rate=0.1, attention_dropout_rate=0.1, normalize_before=True, input_layer="linear",
        pos_enc_layer_type="rel_pos_espnet", selfattention_layer_type="rel_selfattn", use_cnn_module=False,
        macaron_style=False, static_chunk_size=25,
    )
    estimator = CausalConditionalDecoder(
        in_channels=320, out_channels=80, channels=[256], dropout=0.0, attention_head_dim=64, n_blocks=4,
        num_mid_blocks=12, num_heads=8, act_fn="gelu", static_chunk_size=50, num_decoding_left_chunks=-1,
    )
    cfm_params = DictConfig({"sigma_min": 1e-06, "solver": "euler", "t_scheduler": "cosine",
                             "training_cfg_rate": 0.2, "inference_cfg_rate": 0.7, "reg_loss_type": "l1"})
    decoder = CausalConditionalCFM(in_channels=240, n_spks=1, spk_emb_dim=80, cfm_params=cfm_params, estimator=estimator)
    flow = CausalMaskedDiffWithXvec(input_size=512, output_size=80, spk_embed_dim=192, output_type="mel",
                                    vocab_size=6561, input_frame_rate=25, only_mask_loss=True, token_mel_ratio=2,
                                    pre_lookahead_len=3, encoder=encoder, decoder=decoder)
    hift = HiFTGenerator(
        in_channels=80, base_channels=512, nb_harmonics=8, sampling_rate=24000, nsf_alpha=0.1, nsf_sigma=0.003,
        nsf_voiced_threshold=10, upsample_rates=[8, 5, 3], upsample_kernel_sizes=[16, 11, 7],
        istft_params={"n_fft": 16, "hop_len": 4}, resblock_kernel_sizes=[3, 7, 11],
        resblock_dilation_sizes=[[1, 3, 5], [1, 3, 5], [1, 3, 5]], source_resblock_kernel_sizes=[7, 7, 11],
        source_resblock_dilation_sizes=[[1, 3, 5], [1, 3, 5], [1, 3, 5]], lrelu_slope=0.1, audio_limit=0.99,
        f0_predictor=ConvRNNF0Predictor(num_class=1, in_channels=80, cond_channels=512),
    )
    print("# CosyVoice2-0.5B state-dict keys and shapes, derived by tests/data/derive_cosyvoice2_keys.py")
    print("# from the official constructors (FunAudioLLM/CosyVoice ace7c47 + Matcha-TTS), cosyvoice2.yaml sizes.")
    print("# Format: <file> <key> <shape as comma-separated ints>")
    for file, module in (("llm.pt", llm), ("flow.pt", flow), ("hift.pt", hift)):
        for key, value in module.state_dict().items():
            print(file, key, ",".join(str(s) for s in value.shape))


if __name__ == "__main__":
    main()
