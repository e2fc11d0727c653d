"""By-hand numerical parity (not run by pytest): the official CosyVoice2 flow and HiFT at full
size vs ours, with the same random weights loaded into both (strict load_state_dict).

Same environment as derive_cosyvoice2_keys.py (official `cosyvoice/` + `matcha/` trees and
their deps on PYTHONPATH); run from anywhere:

    PYTHONPATH=<deps>:<official trees> python tests/data/parity_cosyvoice2_official.py

Result on CPU, float32 (2026-11-29):
    flow streaming=True finalize=True   (1, 80, 80)  max|diff| 2.38e-07  (max|mel| 3.87)
    flow streaming=True finalize=False  (1, 80, 74)  max|diff| 2.38e-07
    flow streaming=False finalize=True  (1, 80, 80)  max|diff| 2.38e-07 (3.58e-07 when rerun on 2026-12-05)
    f0 predictor                        max|diff| 0
    decode (same excitation)            max|diff| 0
    source, noise off on both sides     max|diff| 0
"""
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent.parent))
import derive_cosyvoice2_keys  # noqa: E402,F401  (installs the import stubs)
import torch  # noqa: E402
from engine.models.cv2_config import cv2_model_config
from engine.models.cv2_flow import CausalMaskedDiffWithXvec as Ours
from engine.models.cv2_hift import HiFTGenerator as OursHiFT, init_random_ as init_hift
from engine.models.flow import init_random_ as init_flow

from cosyvoice.flow.decoder import CausalConditionalDecoder
from cosyvoice.flow.flow import CausalMaskedDiffWithXvec
from cosyvoice.flow.flow_matching import CausalConditionalCFM
from cosyvoice.hifigan.f0_predictor import ConvRNNF0Predictor
from cosyvoice.hifigan.generator import HiFTGenerator
from cosyvoice.transformer.upsample_encoder import UpsampleConformerEncoder
from omegaconf import DictConfig

cfg = cv2_model_config("full")
torch.manual_seed(0)
ours = Ours(cfg.flow); init_flow(ours, 1); ours.eval()
encoder = UpsampleConformerEncoder(input_size=512, output_size=512, attention_heads=8, linear_units=2048, num_blocks=6,
    dropout_rate=0.1, positional_dropout_rate=0.1, attention_dropout_rate=0.1, normalize_before=True, input_layer="linear",
    pos_enc_layer_type="rel_pos_espnet", selfattention_layer_type="rel_selfattn", use_cnn_module=False, macaron_style=False,
    static_chunk_size=25)
est = CausalConditionalDecoder(in_channels=320, out_channels=80, channels=[256], dropout=0.0, attention_head_dim=64,
    n_blocks=4, num_mid_blocks=12, num_heads=8, act_fn="gelu", static_chunk_size=50, num_decoding_left_chunks=-1)
cfm = DictConfig({"sigma_min": 1e-06, "solver": "euler", "t_scheduler": "cosine", "training_cfg_rate": 0.2,
                  "inference_cfg_rate": 0.7, "reg_loss_type": "l1"})
dec = CausalConditionalCFM(in_channels=240, n_spks=1, spk_emb_dim=80, cfm_params=cfm, estimator=est)
off = CausalMaskedDiffWithXvec(input_size=512, output_size=80, spk_embed_dim=192, output_type="mel", vocab_size=6561,
    input_frame_rate=25, only_mask_loss=True, token_mel_ratio=2, pre_lookahead_len=3, encoder=encoder, decoder=dec)
off.load_state_dict(ours.state_dict(), strict=True); off.eval()

g = torch.Generator().manual_seed(5)
P, N = 13, 40
ptok = torch.randint(0, 6561, (1, P), generator=g); tok = torch.randint(0, 6561, (1, N), generator=g)
pfeat = torch.randn(1, 2 * P, 80, generator=g); emb = torch.randn(1, 192, generator=g)
for streaming, finalize in ((True, True), (True, False), (False, True)):
    o, _ = off.inference(tok, torch.tensor([N]), ptok, torch.tensor([P]), pfeat, torch.tensor([2 * P]), emb, streaming, finalize)
    m = ours.inference(tok, ptok, pfeat, emb, streaming, finalize)
    print("flow streaming=%s finalize=%s" % (streaming, finalize), tuple(o.shape), tuple(m.shape),
          "max|diff| %.2e  max|mel| %.2f" % ((o - m).abs().max().item(), o.abs().max().item()))

# HiFT
h_ours = init_hift(OursHiFT(cfg.hift), 2); h_ours.eval()
h_off = HiFTGenerator(in_channels=80, base_channels=512, nb_harmonics=8, sampling_rate=24000, nsf_alpha=0.1, nsf_sigma=0.003,
    nsf_voiced_threshold=10, upsample_rates=[8, 5, 3], upsample_kernel_sizes=[16, 11, 7], istft_params={"n_fft": 16, "hop_len": 4},
    resblock_kernel_sizes=[3, 7, 11], resblock_dilation_sizes=[[1, 3, 5]] * 3, source_resblock_kernel_sizes=[7, 7, 11],
    source_resblock_dilation_sizes=[[1, 3, 5]] * 3, lrelu_slope=0.1, audio_limit=0.99,
    f0_predictor=ConvRNNF0Predictor(num_class=1, in_channels=80, cond_channels=512))
h_off.load_state_dict(h_ours.state_dict(), strict=True); h_off.eval()
mel = torch.nn.functional.interpolate(torch.randn(1, 80, 8, generator=g), size=60, mode="linear") - 4
with torch.inference_mode():
    f0a, f0b = h_off.f0_predictor(mel), h_ours.f0_predictor(mel)
    print("f0 max|diff| %.2e (f0 range %.0f..%.0f Hz)" % ((f0a - f0b).abs().max().item(), f0a.min().item(), f0a.max().item()))
    s = torch.randn(1, 60 * 480, generator=g) * 0.1
    wa, wb = h_off.decode(mel, s[:, None]), h_ours.decode(mel, s)
    print("decode max|diff| %.2e (max|wav| %.3f)" % ((wa - wb).abs().max().item(), wa.abs().max().item()))
    # source with the noise switched off on both sides
    real_randn_like, real_randn = torch.randn_like, torch.randn
    torch.randn_like = lambda x, *a, **k: torch.zeros_like(x)
    torch.randn = lambda *a, **k: torch.zeros(*(a[0] if isinstance(a[0], (tuple, list, torch.Size)) else a), dtype=k.get("dtype"))
    sa = h_off.m_source(h_off.f0_upsamp(f0a[:, None]).transpose(1, 2))[0].transpose(1, 2)[:, 0]
    sb = h_ours.m_source(f0b, torch.Generator())
    torch.randn_like, torch.randn = real_randn_like, real_randn
    print("source (noise off) max|diff| %.2e (max|s| %.3f)" % ((sa - sb).abs().max().item(), sa.abs().max().item()))
