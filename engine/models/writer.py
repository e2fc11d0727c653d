"""Write random-weight model directories in the official Fun-CosyVoice3 layout.

`tiny` loads and speaks in seconds on a CPU (tests, CI); `full` has the released
dimensions (GPU benchmarks). Both go through exactly the loader a real download uses.
The audio they make is noise-like: the weights are random, the shapes and the code
path are real.

    python -m engine.models.writer --size tiny --out /tmp/cv3-tiny
    python -m engine.models.writer --size tiny --version cosyvoice2 --out /tmp/cv2-tiny
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import torch

from .config import ModelConfig

YAML_TEMPLATE = """\
# Random-weight model written by cosyvoice-gateway (engine.models.writer), size: {size}.
# Same HyperPyYAML dialect as the released cosyvoice3.yaml, and the same keys in the
# sections a model is built from (the top-level numbers, llm, flow, hift, feat_extractor).
# Left out: the released file's frontend and training entries (get_tokenizer,
# allowed_special, __set_seed2..4, the data pipeline steps, hifigan, train_conf*).
__set_seed1: !apply:random.seed [1986]
sample_rate: {sample_rate}
llm_input_size: {hidden}
llm_output_size: {hidden}
spk_embed_dim: {spk_embed_dim}
qwen_pretrain_path: ''
token_frame_rate: {token_frame_rate}
token_mel_ratio: {token_mel_ratio}
chunk_size: {chunk_size}
num_decoding_left_chunks: -1

llm: !new:cosyvoice.llm.llm.CosyVoice3LM
    llm_input_size: !ref <llm_input_size>
    llm_output_size: !ref <llm_output_size>
    speech_token_size: {speech_token_size}
    length_normalized_loss: True
    lsm_weight: 0
    mix_ratio: [{mix0}, {mix1}]
    llm: !new:cosyvoice.llm.llm.Qwen2Encoder
        pretrain_path: !ref <qwen_pretrain_path>
    sampling: !name:cosyvoice.utils.common.ras_sampling
        top_p: {top_p}
        top_k: {top_k}
        win_size: {win_size}
        tau_r: {tau_r}

flow: !new:cosyvoice.flow.flow.CausalMaskedDiffWithDiT
    input_size: {flow_input}
    output_size: {flow_output}
    spk_embed_dim: !ref <spk_embed_dim>
    output_type: 'mel'
    vocab_size: {flow_vocab}
    input_frame_rate: !ref <token_frame_rate>
    only_mask_loss: True
    token_mel_ratio: !ref <token_mel_ratio>
    pre_lookahead_len: {pre_len}
    pre_lookahead_layer: !new:cosyvoice.transformer.upsample_encoder.PreLookaheadLayer
        in_channels: {flow_input}
        channels: {pre_channels}
        pre_lookahead_len: {pre_len}
    decoder: !new:cosyvoice.flow.flow_matching.CausalConditionalCFM
        in_channels: 240
        n_spks: 1
        spk_emb_dim: 80
        cfm_params: !new:omegaconf.DictConfig
            content:
                sigma_min: {sigma_min}
                solver: 'euler'
                t_scheduler: 'cosine'
                training_cfg_rate: 0.2
                inference_cfg_rate: {cfg_rate}
                reg_loss_type: 'l1'
        estimator: !new:cosyvoice.flow.DiT.dit.DiT
            dim: {dim}
            depth: {depth}
            heads: {heads}
            dim_head: {dim_head}
            ff_mult: {ff_mult}
            mel_dim: 80
            mu_dim: 80
            spk_dim: 80
            out_channels: 80
            static_chunk_size: !ref <chunk_size> * <token_mel_ratio>
            num_decoding_left_chunks: !ref <num_decoding_left_chunks>

hift: !new:cosyvoice.hifigan.generator.CausalHiFTGenerator
    in_channels: {h_in}
    base_channels: {h_base}
    nb_harmonics: {h_harm}
    sampling_rate: !ref <sample_rate>
    nsf_alpha: {nsf_alpha}
    nsf_sigma: {nsf_sigma}
    nsf_voiced_threshold: {nsf_thr}
    upsample_rates: {ups}
    upsample_kernel_sizes: {upk}
    istft_params:
        n_fft: {n_fft}
        hop_len: {hop_len}
    resblock_kernel_sizes: {rk}
    resblock_dilation_sizes: {rd}
    source_resblock_kernel_sizes: {srk}
    source_resblock_dilation_sizes: {srd}
    lrelu_slope: {lrelu}
    audio_limit: {audio_limit}
    conv_pre_look_right: {look_right}
    f0_predictor: !new:cosyvoice.hifigan.f0_predictor.CausalConvRNNF0Predictor
        num_class: 1
        in_channels: {h_in}
        cond_channels: {f0_cond}

feat_extractor: !name:matcha.utils.audio.mel_spectrogram
    n_fft: {m_nfft}
    num_mels: {m_mels}
    sampling_rate: !ref <sample_rate>
    hop_size: {m_hop}
    win_size: {m_win}
    fmin: {m_fmin}
    fmax: null
    center: False
"""


CV2_YAML_TEMPLATE = """\
# Random-weight model written by cosyvoice-gateway (engine.models.writer), size: {size}.
# Same HyperPyYAML dialect as the released CosyVoice2-0.5B cosyvoice2.yaml, and the same
# keys in the sections a model is built from (the top-level numbers, llm, flow, hift,
# feat_extractor), plus flow.encoder.num_up_blocks for a tiny model only.
# Left out: the released file's frontend and training entries (get_tokenizer,
# allowed_special, __set_seed2..4, the data pipeline steps, hifigan, train_conf*).
__set_seed1: !apply:random.seed [1986]
sample_rate: {sample_rate}
llm_input_size: {hidden}
llm_output_size: {hidden}
spk_embed_dim: {spk_embed_dim}
qwen_pretrain_path: ''
token_frame_rate: {token_frame_rate}
token_mel_ratio: {token_mel_ratio}
chunk_size: {chunk_size}
num_decoding_left_chunks: -1

llm: !new:cosyvoice.llm.llm.Qwen2LM
    llm_input_size: !ref <llm_input_size>
    llm_output_size: !ref <llm_output_size>
    speech_token_size: {speech_token_size}
    length_normalized_loss: True
    lsm_weight: 0
    mix_ratio: [{mix0}, {mix1}]
    llm: !new:cosyvoice.llm.llm.Qwen2Encoder
        pretrain_path: !ref <qwen_pretrain_path>
    sampling: !name:cosyvoice.utils.common.ras_sampling
        top_p: {top_p}
        top_k: {top_k}
        win_size: {win_size}
        tau_r: {tau_r}

flow: !new:cosyvoice.flow.flow.CausalMaskedDiffWithXvec
    input_size: {flow_input}
    output_size: {flow_output}
    spk_embed_dim: !ref <spk_embed_dim>
    output_type: 'mel'
    vocab_size: {flow_vocab}
    input_frame_rate: !ref <token_frame_rate>
    only_mask_loss: True
    token_mel_ratio: !ref <token_mel_ratio>
    pre_lookahead_len: {pre_len}
    encoder: !new:cosyvoice.transformer.upsample_encoder.UpsampleConformerEncoder
        output_size: {enc_out}
        attention_heads: {enc_heads}
        linear_units: {enc_units}
        num_blocks: {enc_blocks}
        dropout_rate: 0.1
        positional_dropout_rate: 0.1
        attention_dropout_rate: 0.1
        normalize_before: True
        input_layer: 'linear'
        pos_enc_layer_type: 'rel_pos_espnet'
        selfattention_layer_type: 'rel_selfattn'
        input_size: {flow_input}
        use_cnn_module: False
        macaron_style: False
        static_chunk_size: !ref <chunk_size>{up_blocks_line}
    decoder: !new:cosyvoice.flow.flow_matching.CausalConditionalCFM
        in_channels: 240
        n_spks: 1
        spk_emb_dim: 80
        cfm_params: !new:omegaconf.DictConfig
            content:
                sigma_min: {sigma_min}
                solver: 'euler'
                t_scheduler: 'cosine'
                training_cfg_rate: 0.2
                inference_cfg_rate: {cfg_rate}
                reg_loss_type: 'l1'
        estimator: !new:cosyvoice.flow.decoder.CausalConditionalDecoder
            in_channels: {unet_in}
            out_channels: {flow_output}
            channels: {unet_channels}
            dropout: 0.0
            attention_head_dim: {unet_head_dim}
            n_blocks: {unet_blocks}
            num_mid_blocks: {unet_mid}
            num_heads: {unet_heads}
            act_fn: 'gelu'
            static_chunk_size: !ref <chunk_size> * <token_mel_ratio>
            num_decoding_left_chunks: !ref <num_decoding_left_chunks>

hift: !new:cosyvoice.hifigan.generator.HiFTGenerator
    in_channels: {h_in}
    base_channels: {h_base}
    nb_harmonics: {h_harm}
    sampling_rate: !ref <sample_rate>
    nsf_alpha: {nsf_alpha}
    nsf_sigma: {nsf_sigma}
    nsf_voiced_threshold: {nsf_thr}
    upsample_rates: {ups}
    upsample_kernel_sizes: {upk}
    istft_params:
        n_fft: {n_fft}
        hop_len: {hop_len}
    resblock_kernel_sizes: {rk}
    resblock_dilation_sizes: {rd}
    source_resblock_kernel_sizes: {srk}
    source_resblock_dilation_sizes: {srd}
    lrelu_slope: {lrelu}
    audio_limit: {audio_limit}
    f0_predictor: !new:cosyvoice.hifigan.f0_predictor.ConvRNNF0Predictor
        num_class: 1
        in_channels: {h_in}
        cond_channels: {f0_cond}

feat_extractor: !name:matcha.utils.audio.mel_spectrogram
    n_fft: {m_nfft}
    num_mels: {m_mels}
    sampling_rate: !ref <sample_rate>
    hop_size: {m_hop}
    win_size: {m_win}
    fmin: {m_fmin}
    fmax: {m_fmax}
    center: False
"""


def render_cv2_yaml(cfg: ModelConfig, size: str) -> str:
    """cosyvoice2.yaml text for a CosyVoice2 ModelConfig (see `engine.models.cv2_config`)."""
    from .cv2_config import CV2FlowConfig

    lm, fl, h, m = cfg.lm, cfg.flow, cfg.hift, cfg.mel
    if not isinstance(fl, CV2FlowConfig):
        raise TypeError("render_cv2_yaml needs a CosyVoice2 config (CV2FlowConfig)")
    # The official encoder hard-codes 4 blocks after the upsampling; only a smaller
    # (tiny) model records its count, under a key the official yaml does not have.
    up_blocks = "" if fl.encoder_up_blocks == 4 else f"\n        num_up_blocks: {fl.encoder_up_blocks}"
    return CV2_YAML_TEMPLATE.format(
        size=size,
        sample_rate=cfg.sample_rate,
        hidden=lm.qwen.hidden_size,
        spk_embed_dim=fl.spk_embed_dim,
        token_frame_rate=cfg.token_frame_rate,
        token_mel_ratio=fl.token_mel_ratio,
        chunk_size=cfg.chunk_size,
        speech_token_size=lm.speech_token_size,
        mix0=lm.mix_ratio[0],
        mix1=lm.mix_ratio[1],
        top_p=lm.sampling.top_p,
        top_k=lm.sampling.top_k,
        win_size=lm.sampling.win_size,
        tau_r=lm.sampling.tau_r,
        flow_input=fl.input_size,
        flow_output=fl.output_size,
        flow_vocab=fl.vocab_size,
        pre_len=fl.pre_lookahead_len,
        enc_out=fl.encoder_output_size,
        enc_heads=fl.encoder_heads,
        enc_units=fl.encoder_linear_units,
        enc_blocks=fl.encoder_blocks,
        up_blocks_line=up_blocks,
        sigma_min=fl.sigma_min,
        cfg_rate=fl.inference_cfg_rate,
        unet_in=fl.unet_in_channels,
        unet_channels=_lst(list(fl.unet_channels)),
        unet_head_dim=fl.unet_head_dim,
        unet_blocks=fl.unet_blocks,
        unet_mid=fl.unet_mid_blocks,
        unet_heads=fl.unet_heads,
        h_in=h.in_channels,
        h_base=h.base_channels,
        h_harm=h.nb_harmonics,
        nsf_alpha=h.nsf_alpha,
        nsf_sigma=h.nsf_sigma,
        nsf_thr=h.nsf_voiced_threshold,
        ups=_lst(list(h.upsample_rates)),
        upk=_lst(list(h.upsample_kernel_sizes)),
        n_fft=h.n_fft,
        hop_len=h.hop_len,
        rk=_lst(list(h.resblock_kernel_sizes)),
        rd=_lst([list(x) for x in h.resblock_dilation_sizes]),
        srk=_lst(list(h.source_resblock_kernel_sizes)),
        srd=_lst([list(x) for x in h.source_resblock_dilation_sizes]),
        lrelu=h.lrelu_slope,
        audio_limit=h.audio_limit,
        f0_cond=h.f0_cond_channels,
        m_nfft=m.n_fft,
        m_mels=m.num_mels,
        m_hop=m.hop_size,
        m_win=m.win_size,
        m_fmin=int(m.fmin),
        m_fmax="null" if m.fmax is None else int(m.fmax),
    )


def _lst(x: object) -> str:
    return json.dumps(x).replace("(", "[").replace(")", "]")


def render_yaml(cfg: ModelConfig, size: str) -> str:
    lm, fl, h, m = cfg.lm, cfg.flow, cfg.hift, cfg.mel
    return YAML_TEMPLATE.format(
        size=size,
        sample_rate=cfg.sample_rate,
        hidden=lm.qwen.hidden_size,
        spk_embed_dim=fl.spk_embed_dim,
        token_frame_rate=cfg.token_frame_rate,
        token_mel_ratio=fl.token_mel_ratio,
        chunk_size=cfg.chunk_size,
        speech_token_size=lm.speech_token_size,
        mix0=lm.mix_ratio[0],
        mix1=lm.mix_ratio[1],
        top_p=lm.sampling.top_p,
        top_k=lm.sampling.top_k,
        win_size=lm.sampling.win_size,
        tau_r=lm.sampling.tau_r,
        flow_input=fl.input_size,
        flow_output=fl.output_size,
        flow_vocab=fl.vocab_size,
        pre_len=fl.pre_lookahead_len,
        pre_channels=fl.pre_lookahead_channels,
        sigma_min=fl.sigma_min,
        cfg_rate=fl.inference_cfg_rate,
        dim=fl.dim,
        depth=fl.depth,
        heads=fl.heads,
        dim_head=fl.dim_head,
        ff_mult=fl.ff_mult,
        h_in=h.in_channels,
        h_base=h.base_channels,
        h_harm=h.nb_harmonics,
        nsf_alpha=h.nsf_alpha,
        nsf_sigma=h.nsf_sigma,
        nsf_thr=h.nsf_voiced_threshold,
        ups=_lst(list(h.upsample_rates)),
        upk=_lst(list(h.upsample_kernel_sizes)),
        n_fft=h.n_fft,
        hop_len=h.hop_len,
        rk=_lst(list(h.resblock_kernel_sizes)),
        rd=_lst([list(x) for x in h.resblock_dilation_sizes]),
        srk=_lst(list(h.source_resblock_kernel_sizes)),
        srd=_lst([list(x) for x in h.source_resblock_dilation_sizes]),
        lrelu=h.lrelu_slope,
        audio_limit=h.audio_limit,
        look_right=h.conv_pre_look_right,
        f0_cond=h.f0_cond_channels,
        m_nfft=m.n_fft,
        m_mels=m.num_mels,
        m_hop=m.hop_size,
        m_win=m.win_size,
        m_fmin=int(m.fmin),
    )


VERSIONS = ("cosyvoice3", "cosyvoice2")


def write_model_dir(
    out: Path | str, size: str = "tiny", seed: int = 0, *, overwrite: bool = False, version: str = "cosyvoice3"
) -> Path:
    """Write a complete random-weight model directory; atomic (temp dir, then rename).

    version="cosyvoice2" writes the CosyVoice2-0.5B layout (cosyvoice2.yaml, Qwen2LM /
    CausalMaskedDiffWithXvec / HiFTGenerator state dicts, speech_tokenizer_v2.onnx)."""
    from engine.frontend.assets_writer import write_frontend_assets

    from .cv2_config import cv2_model_config
    from .flow import init_random_ as init_flow
    from .hift import init_random_ as init_hift
    from .lm import init_random_ as init_lm
    from .loader import FAMILIES, check_model_dir, module_classes

    if size not in ("tiny", "full"):
        raise ValueError(f"size must be 'tiny' or 'full', not {size!r}")
    if version not in VERSIONS:
        raise ValueError(f"version must be one of {VERSIONS}, not {version!r}")
    out = Path(out)
    if out.exists():
        if not overwrite:
            raise FileExistsError(f"{out} exists (pass overwrite=True to replace it)")
        shutil.rmtree(out)
    if version == "cosyvoice2":
        from .cv2_hift import init_random_ as init_hift  # noqa: F811 (the non-causal vocoder)

        cfg = cv2_model_config(size)
        yaml_text = render_cv2_yaml(cfg, size)
    else:
        cfg = ModelConfig.tiny() if size == "tiny" else ModelConfig()
        yaml_text = render_yaml(cfg, size)
    fam = FAMILIES[version]
    lm_cls, flow_cls, hift_cls = module_classes(version)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        (tmp / fam.yaml_name).write_text(yaml_text, encoding="utf-8")
        blank = tmp / "CosyVoice-BlankEN"
        blank.mkdir()
        # Differs from the released CosyVoice-BlankEN/config.json in its sizes (tiny) and in
        # "tie_word_embeddings": false, where the real Qwen2-0.5B config says true (its
        # llm.pt stores lm_head sharing embed_tokens' storage). Nothing reads the flag: the
        # loader loads llm.model.lm_head.weight from llm.pt tied or not, and the vLLM
        # export drops it. The random llm.pt holds an independent lm_head; no model.safetensors
        # is written (the hub skips the released one, see engine.hub.SKIP_PATHS).
        (blank / "config.json").write_text(json.dumps(cfg.lm.qwen.to_hf_json(), indent=2))
        write_frontend_assets(tmp, tiny=(size == "tiny"), seed=seed, speech_tokenizer_file=fam.speech_tokenizer)

        lm = lm_cls(cfg.lm)
        init_lm(lm, seed)
        torch.save(lm.state_dict(), tmp / "llm.pt")
        del lm
        flow = flow_cls(cfg.flow)
        init_flow(flow, seed + 1)
        # Each tensor on its own, as the official file has them: the DiT's fused projections
        # make some parameters views of one shared tensor (`engine.models.dit.share_storage`).
        torch.save({k: v.clone() for k, v in flow.state_dict().items()}, tmp / "flow.pt")
        del flow
        hift = hift_cls(cfg.hift)
        init_hift(hift, seed + 2)  # type: ignore[arg-type]
        torch.save(hift.state_dict(), tmp / "hift.pt")
        del hift
        (tmp / "configuration.json").write_text(
            json.dumps({"framework": "pytorch", "task": "text-to-speech", "model_type": f"random-{size}"}, indent=2)
        )
        check_model_dir(tmp, version)  # every file a real download must have is here too
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Write a random-weight CosyVoice3/CosyVoice2 model directory (official layout).")
    p.add_argument("--size", choices=["tiny", "full"], default="tiny")
    p.add_argument("--version", choices=list(VERSIONS), default="cosyvoice3")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true")
    a = p.parse_args(argv)
    path = write_model_dir(a.out, a.size, a.seed, overwrite=a.overwrite, version=a.version)
    print(path)


if __name__ == "__main__":
    main()
