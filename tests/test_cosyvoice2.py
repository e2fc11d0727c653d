"""CosyVoice2-0.5B behind the same engine: names/shapes, loader, LM vocabulary, flow and
vocoder streaming, and the tiny CV2 model end to end through the WebSocket and the
OpenAI speech endpoint.

Tolerances: the flow's chunked decoding equals whole-utterance decoding to 1e-5 (same
maths, different batch shapes). The vocoder's streaming output is compared exactly
(1e-6) with the official cache + Hamming cross-fade *scheme* re-implemented here from
CosyVoice2Model.token2wav; it is NOT compared with a whole-utterance run, from which it
differs inside every cross-fade by design. For that, continuity at the joins and the
total length are checked instead.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch
import websockets

from engine.frontend.prompt import build_lm_text
from engine.frontend.tokenizer import TextTokenizer
from engine.models.conformer import RelPositionAttention, relative_sinusoids
from engine.models.cv2_config import CV2LMConfig, cv2_model_config
from engine.models.cv2_flow import CausalMaskedDiffWithXvec
from engine.models.cv2_hift import MEL_CACHE_FRAMES, HiFTGenerator
from engine.models.cv2_hift import init_random_ as init_hift
from engine.models.cv2_lm import Qwen2LM
from engine.models.flow import FlowChunk
from engine.models.flow import init_random_ as init_flow
from engine.models.lm import build_prompt, init_random_, stop_ids, unified_vocab
from engine.models.loader import load_model, read_model_config
from helpers import AUTH, FAST, SAMPLES_PER_TOKEN, LiveServer, WsRecorder, live_gateway, register, tone_wav

KEYS_FILE = Path(__file__).parent / "data" / "cosyvoice2_keys.txt"
SPF = 480  # samples per mel frame


@pytest.fixture(scope="module")
def cv2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.models.writer import write_model_dir

    # The directory name makes the gateway apply its random-weights length default.
    return write_model_dir(tmp_path_factory.mktemp("cv2") / "tiny-random-cv2", "tiny", seed=0, version="cosyvoice2")


# ----------------------------------------------------------------------------- names and shapes


def _official_keys() -> dict[str, dict[str, tuple[int, ...]]]:
    out: dict[str, dict[str, tuple[int, ...]]] = {}
    for line in KEYS_FILE.read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        file, key, shape = line.split()
        out.setdefault(file, {})[key] = tuple(int(s) for s in shape.split(","))
    return out


def test_full_size_names_and_shapes_equal_the_official_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    ref = _official_keys()
    assert {f: len(k) for f, k in ref.items()} == {"llm.pt": 295, "flow.pt": 1121, "hift.pt": 328}
    cfg = cv2_model_config("full")
    # Shapes only: meta tensors need no memory, and the (slow on meta) default init of the
    # big embedding tables is skipped.
    monkeypatch.setattr(torch.nn.Embedding, "reset_parameters", lambda self: None)
    with torch.device("meta"):
        modules = {"llm.pt": Qwen2LM(cfg.lm), "flow.pt": CausalMaskedDiffWithXvec(cfg.flow), "hift.pt": HiFTGenerator(cfg.hift)}
    for file, module in modules.items():
        ours = {k: tuple(v.shape) for k, v in module.state_dict().items()}
        assert ours == ref[file], file
    assert ref["llm.pt"]["llm_decoder.bias"] == (6564,) and ref["llm.pt"]["llm_embedding.weight"] == (2, 896)


# ----------------------------------------------------------------------------- loader / writer


def test_tiny_cv2_dir_reads_back_and_loads_strictly(cv2_dir: Path) -> None:
    assert (cv2_dir / "cosyvoice2.yaml").is_file() and (cv2_dir / "speech_tokenizer_v2.onnx").is_file()
    assert not (cv2_dir / "cosyvoice3.yaml").exists()
    cfg = read_model_config(cv2_dir)
    assert cfg == cv2_model_config("tiny")
    assert cfg.version == "cosyvoice2" and cfg.mel.fmax == 8000.0 and isinstance(cfg.lm, CV2LMConfig)
    m = load_model(cv2_dir)
    assert (type(m.lm), type(m.flow), type(m.hift)) == (Qwen2LM, CausalMaskedDiffWithXvec, HiFTGenerator)
    saved = torch.load(cv2_dir / "llm.pt", weights_only=True)
    assert all(torch.equal(saved[k], v) for k, v in m.lm.state_dict().items())


def test_writer_cli_version_flag(tmp_path: Path) -> None:
    from engine.models.writer import main

    main(["--size", "tiny", "--version", "cosyvoice2", "--out", str(tmp_path / "d")])
    assert read_model_config(tmp_path / "d").version == "cosyvoice2"


def test_hub_names_resolve_to_cv2_dirs(tmp_path: Path) -> None:
    from engine.hub import RANDOM_MODELS, resolve_model

    assert RANDOM_MODELS["tiny-random-cv2"] == ("tiny", "cosyvoice2")
    path = resolve_model("tiny-random-cv2", tmp_path)
    assert read_model_config(path).version == "cosyvoice2"
    assert resolve_model("tiny-random-cv2", tmp_path) == path  # written once, then reused


# ----------------------------------------------------------------------------- LM


@pytest.fixture(scope="module")
def tiny_lm() -> Qwen2LM:
    return init_random_(Qwen2LM(cv2_model_config("tiny").lm), seed=0).eval()  # type: ignore[return-value]


def test_unified_vocab_prompt_and_stop_ids() -> None:
    cfg = cv2_model_config("tiny").lm
    assert (cfg.speech_vocab_size, cfg.eos, cfg.fill_token, cfg.sos, cfg.task_id) == (6564, 6561, 6563, 6564, 6565)
    vocab = unified_vocab(cfg)
    assert vocab.text_offset == 6566 and vocab.size == 6566 + cfg.qwen.vocab_size
    assert build_prompt(cfg, [1, 2], [3], [7, 8]) == [6564, 6567, 6568, 6569, 6565, 7, 8]
    assert stop_ids(cfg) == [6561, 6562, 6563]
    # CosyVoice3 is unchanged: no extra rows, text right after the 6761 speech rows.
    cv3 = unified_vocab(read_cv3_lm_config())
    assert cv3.text_offset == 6761 and cv3.extra_rows == 0


def read_cv3_lm_config():  # type: ignore[no-untyped-def]
    from engine.models.config import ModelConfig

    return ModelConfig.tiny().lm


def test_embed_routes_each_range_to_its_table(tiny_lm: Qwen2LM) -> None:
    ids = torch.tensor([[5, 6563, 6564, 6565, 6566, 6566 + 42]])
    emb = tiny_lm.embed(ids)[0]
    assert torch.equal(emb[0], tiny_lm.speech_embedding.weight[5])
    assert torch.equal(emb[1], tiny_lm.speech_embedding.weight[6563])
    assert torch.equal(emb[2], tiny_lm.llm_embedding.weight[0])  # sos
    assert torch.equal(emb[3], tiny_lm.llm_embedding.weight[1])  # task_id
    assert torch.equal(emb[4], tiny_lm.llm.backbone.embed_tokens.weight[0])
    assert torch.equal(emb[5], tiny_lm.llm.backbone.embed_tokens.weight[42])
    hidden = torch.randn(3, tiny_lm.cfg.qwen.hidden_size, generator=torch.Generator().manual_seed(0))
    logits = tiny_lm.speech_logits(hidden)
    assert logits.shape == (3, 6564)
    assert torch.allclose(logits, hidden @ tiny_lm.llm_decoder.weight.T + tiny_lm.llm_decoder.bias, atol=1e-5)
    assert tiny_lm.llm_decoder.bias.abs().sum() > 0  # the bias is real and used


def test_torch_backend_decodes_cv2_like_a_full_forward(tiny_lm: Qwen2LM) -> None:
    from engine.backends.base import LMRequest, SamplingParams
    from engine.backends.torch_backend import TorchLMBackend

    cfg = tiny_lm.cfg
    prompt = build_prompt(cfg, [11, 12], [13, 14, 15], [100, 200, 300])

    async def generate() -> list[int]:
        backend = TorchLMBackend(tiny_lm, unified_vocab(cfg))
        try:
            req = LMRequest("r", tuple(prompt), SamplingParams(greedy=True, fixed_length=6, seed=0))
            return [t async for t in backend.generate(req)]
        finally:
            await backend.close()

    got = asyncio.run(generate())
    # Reference: greedy over full re-forwards (no cache), stop ids suppressed.
    seq, want = list(prompt), []
    with torch.no_grad():
        for _ in range(6):
            logits = tiny_lm.speech_logits(tiny_lm(torch.tensor([seq]))[:, -1])[0]
            logits[cfg.speech_token_size :] = -math.inf
            tok = int(logits.argmax())
            want.append(tok)
            seq.append(tok)
    assert got == want and all(t < 6561 for t in got)


# ----------------------------------------------------------------------------- flow


def test_relative_position_attention_matches_explicit_offsets() -> None:
    torch.manual_seed(0)
    heads, dim, t = 2, 8, 5
    attn = RelPositionAttention(heads, dim)
    with torch.no_grad():
        attn.pos_bias_u.normal_()
        attn.pos_bias_v.normal_()
    x = torch.randn(1, t, dim)
    mask = torch.ones(1, t, t, dtype=torch.bool)
    pos = relative_sinusoids(t, dim, x.device, x.dtype)
    out = attn(x, mask, pos)
    # Reference: score(i, j) = (q_i + u).k_j + (q_i + v).P(i - j), P(r) = linear_pos(pe(r)).
    dk = dim // heads
    q = attn.linear_q(x).view(t, heads, dk)
    k = attn.linear_k(x).view(t, heads, dk)
    v = attn.linear_v(x).view(t, heads, dk)
    p = attn.linear_pos(pos).view(2 * t - 1, heads, dk)  # row m holds offset (t-1) - m
    scores = torch.empty(heads, t, t)
    for h in range(heads):
        for i in range(t):
            for j in range(t):
                rel = p[(t - 1) - (i - j), h]
                scores[h, i, j] = (q[i, h] + attn.pos_bias_u[h]) @ k[j, h] + (q[i, h] + attn.pos_bias_v[h]) @ rel
    probs = torch.softmax(scores / math.sqrt(dk), dim=-1)
    ref = attn.linear_out(torch.einsum("hij,jhd->ihd", probs, v).reshape(1, t, dim))
    assert torch.allclose(out, ref, atol=1e-5)
    # Offset 0 is the sinusoid of 0: sin = 0, cos = 1.
    assert torch.equal(pos[t - 1, 0::2], torch.zeros(dim // 2)) and torch.equal(pos[t - 1, 1::2], torch.ones(dim // 2))


@pytest.fixture(scope="module")
def tiny_flow() -> CausalMaskedDiffWithXvec:
    flow = CausalMaskedDiffWithXvec(cv2_model_config("tiny").flow)
    init_flow(flow, 1)
    return flow.eval()


def _flow_inputs(prompt_tokens: int, new_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 6561, (prompt_tokens + new_tokens,), generator=g)
    return tokens, torch.randn(2 * prompt_tokens, 80, generator=g), torch.randn(192, generator=g)


def test_flow_chunks_on_the_grid_equal_the_whole_utterance(tiny_flow: CausalMaskedDiffWithXvec) -> None:
    p = 7
    tokens, feat, emb = _flow_inputs(p, 50, seed=3)
    whole = tiny_flow.inference_chunks([FlowChunk(tokens, feat, emb, p, p, True)])[0]
    assert whole.shape == (100, 80) and torch.isfinite(whole).all()
    end = 50 - p  # first chunk ends on the 25-token grid (prompt included), +3 look-ahead
    first = tiny_flow.inference_chunks([FlowChunk(tokens[: p + end + 3], feat, emb, p, p, False)])[0]
    rest = tiny_flow.inference_chunks([FlowChunk(tokens, feat, emb, p, p + end, True)])[0]
    assert first.shape[0] == 2 * end and rest.shape[0] == 100 - 2 * end
    assert torch.allclose(torch.cat([first, rest]), whole, atol=1e-5)


def test_flow_batch_equals_separate_runs(tiny_flow: CausalMaskedDiffWithXvec) -> None:
    a = FlowChunk(*_flow_inputs(5, 20, seed=4), num_prompt_tokens=5, out_start=5, finalize=True)
    t, f, e = _flow_inputs(9, 33, seed=5)
    b = FlowChunk(t, f, e, num_prompt_tokens=9, out_start=20, finalize=False)
    together = tiny_flow.inference_chunks([a, b])
    alone = [tiny_flow.inference_chunks([c])[0] for c in (a, b)]
    for x, y in zip(together, alone):
        assert x.shape == y.shape and torch.allclose(x, y, atol=1e-5)


# ----------------------------------------------------------------------------- vocoder


@pytest.fixture(scope="module")
def tiny_hift() -> HiFTGenerator:
    hift = init_hift(HiFTGenerator(cv2_model_config("tiny").hift), 2)
    hift.fold_weight_norm()
    return hift.eval()


def _smooth_mel(frames: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    coarse = torch.randn(1, 80, frames // 10 + 2, generator=g)
    return torch.nn.functional.interpolate(coarse, size=frames, mode="linear")[0] - 4.0


def _official_scheme(hift: HiFTGenerator, chunks: list[torch.Tensor]) -> np.ndarray:
    """CosyVoice2Model.token2wav's hift part, step by step (mel/source/speech caches of
    8 frames, np.hamming fade), driven through `HiFTGenerator.inference`."""
    hold = MEL_CACHE_FRAMES * SPF
    window = torch.from_numpy(np.hamming(2 * hold)).float()
    noise = torch.Generator().manual_seed(hift.noise_seed)
    cache = None
    out = []
    for i, mel in enumerate(chunks):
        final = i == len(chunks) - 1
        if cache is not None:
            mel = torch.cat([cache["mel"], mel], dim=1)
        speech, source = hift.inference(mel[None], None if cache is None else cache["source"][None], noise)
        speech, source = speech[0].clone(), source[0]
        if cache is not None:
            speech[:hold] = speech[:hold] * window[:hold] + cache["speech"] * window[hold:]
        if final:
            out.append(speech)
        else:
            cache = {"mel": mel[:, -MEL_CACHE_FRAMES:], "source": source[-hold:], "speech": speech[-hold:]}
            out.append(speech[:-hold])
    return torch.cat(out).numpy()


def test_hift_stream_follows_the_official_cache_and_fade_scheme(tiny_hift: HiFTGenerator) -> None:
    mel = _smooth_mel(130, seed=6)
    sizes = [40, 50, 40]
    chunks = list(torch.split(mel, sizes, dim=1))
    st = tiny_hift.new_stream()
    pieces = tiny_hift.stream_step([st], [chunks[0]], [False])
    pieces += tiny_hift.stream_step([st], [chunks[1]], [False])
    pieces += tiny_hift.stream_step([st], [chunks[2]], [True])
    got = torch.cat(pieces).numpy()
    # Lengths: the first step holds 8 frames back, the last releases everything.
    assert [p.numel() for p in pieces] == [(40 - 8) * SPF, 50 * SPF, (40 + 8) * SPF]
    assert got.size == 130 * SPF and st.runs == [40, 58, 48]
    np.testing.assert_allclose(got, _official_scheme(tiny_hift, chunks), atol=1e-6)


def test_hift_stream_is_continuous_at_the_joins(tiny_hift: HiFTGenerator) -> None:
    mel = _smooth_mel(160, seed=7)
    sizes = [30, 25, 50, 55]
    st = tiny_hift.new_stream()
    pieces = [tiny_hift.stream_step([st], [m], [i == len(sizes) - 1])[0]
              for i, m in enumerate(torch.split(mel, sizes, dim=1))]
    wav = torch.cat(pieces).numpy()
    assert wav.size == 160 * SPF and np.isfinite(wav).all() and np.abs(wav).max() <= 0.99
    step = np.abs(np.diff(wav))
    joins = np.cumsum([p.numel() for p in pieces])[:-1]
    typical = np.percentile(step, 99.9)
    assert all(step[j - 1] <= typical for j in joins), (step[joins - 1], typical)
    # Streaming differs from one whole run only by design (fades, independent runs), not in
    # level: the RMS of the two agrees within 25 %.
    whole = tiny_hift.inference(mel[None])[0][0].numpy()
    assert whole.size == wav.size
    assert 0.75 < np.sqrt(np.mean(wav**2)) / np.sqrt(np.mean(whole**2)) < 1.25


def test_hift_stream_waits_for_more_than_the_cache_and_batches_independently(tiny_hift: HiFTGenerator) -> None:
    mel = _smooth_mel(60, seed=8)
    a, b = tiny_hift.new_stream(), tiny_hift.new_stream()
    # 6 frames cannot release anything (8 are held back): nothing runs yet.
    out = tiny_hift.stream_step([a, b], [mel[:, :6], mel[:, :30]], [False, False])
    assert out[0].numel() == 0 and a.runs == [] and out[1].numel() == 22 * SPF
    out = tiny_hift.stream_step([a, b], [mel[:, 6:], mel[:, 30:]], [True, True])
    assert out[0].numel() == 60 * SPF and out[1].numel() == 38 * SPF
    with pytest.raises(RuntimeError):
        tiny_hift.stream_step([a], [mel[:, :1]], [True])


# ----------------------------------------------------------------------------- frontend


def test_cv2_tokenizer_and_prompts(cv2_dir: Path) -> None:
    cv2 = TextTokenizer.from_dir(cv2_dir / "CosyVoice-BlankEN", version="cosyvoice2")
    cv3 = TextTokenizer.from_dir(cv2_dir / "CosyVoice-BlankEN")
    assert cv2.endofprompt_id == cv3.endofprompt_id == 151646
    assert len(cv2.special_tokens) == 3 + 19 - 2  # base specials + the 19 (two are base ones)
    assert len(cv3.encode("[AA]")) == 1 and len(cv2.encode("[AA]")) > 1  # phones are CV3-only specials
    zs = build_lm_text(cv2, "zero_shot", "Hi.", transcript="Hello there.", version="cosyvoice2")
    assert zs.prompt_ids == tuple(cv2.encode("Hello there.")) and zs.use_prompt_speech
    ins = build_lm_text(cv2, "instruct", "Hi.", instruction="speak happily", version="cosyvoice2")
    assert ins.prompt_ids == tuple(cv2.encode("speak happily<|endofprompt|>")) and not ins.use_prompt_speech
    xl = build_lm_text(cv2, "cross_lingual", "Hi.", version="cosyvoice2")
    assert xl.prompt_ids == () and not xl.use_prompt_speech


# ----------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def cv2_server(cv2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_gateway(cv2_dir, tmp_path_factory.mktemp("cv2-gw")) as srv:
        with srv.client() as c:
            assert register(c, "cv2voice", tone_wav(3.0), transcript="Hello there.").status_code == 201
        yield srv


def test_engine_uses_the_cv2_prompt_and_vocabulary(cv2_server: LiveServer) -> None:
    from engine.types import SessionOptions

    eng = cv2_server.gw.engine
    assert eng.model.config.version == "cosyvoice2" and eng.vocab.text_offset == 6566
    voice = cv2_server.call(cv2_server.gw.voices.get_prompt("cv2voice"))
    text_ids, speech = eng.lm_prefix(voice, SessionOptions())
    assert text_ids == eng.tokenizer.encode("Hello there.")  # no system prefix
    assert speech == voice.speech_tokens.tolist() and len(speech) > 0
    text_ids, speech = eng.lm_prefix(voice, SessionOptions(mode="instruct", instruction="speak slowly"))
    assert text_ids[-1] == 151646 and speech == []


def test_cv2_transcript_is_normalised_like_the_text(cv2_server: LiveServer) -> None:
    """Officially CosyVoice2's zero-shot call normalises the prompt transcript (unsplit: no
    sentence mark added); CosyVoice3's carries <|endofprompt|> and is left alone."""
    from engine.types import SessionOptions

    eng = cv2_server.gw.engine
    voice = cv2_server.call(cv2_server.gw.voices.get_prompt("cv2voice"))
    spoken = eng.voice_from_arrays("digits", "I have 3 cats", voice.speech_tokens, voice.speech_feat,
                                   voice.embedding)
    text_ids, _ = eng.lm_prefix(spoken, SessionOptions())
    assert text_ids == eng.tokenizer.encode("I have three cats")


def test_openai_speech_endpoint_with_cv2(cv2_server: LiveServer) -> None:
    srv = cv2_server
    text = "Good morning, how are you?"
    from gateway.http_api import speech_pieces

    expected = 2 * sum(len(srv.gw.engine.text_ids(p)) for p in speech_pieces(text)) * SAMPLES_PER_TOKEN
    with srv.client() as c:
        resp = c.post("/v1/audio/speech", headers=AUTH, json={"model": "tts-1", "voice": "cv2voice", "input": text,
                                                             "response_format": "pcm", **FAST})
        assert resp.status_code == 200, resp.text
    pcm = np.frombuffer(resp.content, dtype="<i2")
    assert pcm.size == expected
    assert np.abs(pcm).max() > 100  # audible, not silence


def test_websocket_stream_with_cv2(cv2_server: LiveServer) -> None:
    srv = cv2_server
    text = "This is a longer sentence so that the audio comes in several chunks."
    # Contexts use the gateway's fixed length for random weights (tokens per text token).
    ratio = srv.gw.engine.config.tokens_per_text_token
    expected = max(1, int(round(ratio * len(srv.gw.engine.text_ids(text))))) * SAMPLES_PER_TOKEN
    assert expected > 10 * SAMPLES_PER_TOKEN

    async def speak() -> WsRecorder:
        async with websockets.connect(srv.ws_url, additional_headers=AUTH) as ws:
            rec = WsRecorder(ws)
            await rec.recv_one()  # session_started
            await rec.send(type="text", context_id="c", voice="cv2voice", text=text, end=True)
            return await rec.until(lambda r: r.finished("c"), timeout=120)

    rec = asyncio.run(speak())
    assert not rec.of("error"), rec.events
    (done,) = rec.of("done", "c")
    assert done["audio_samples"] == expected and len(rec.audio["c"]) == 2 * expected


def test_websocket_text_stream_mode_with_cv2(cv2_server: LiveServer) -> None:
    """Bistream (text fed to the LM word by word) runs on the CV2 vocabulary too."""
    srv = cv2_server
    words = "Streaming text goes to the model word by word, and then it ends.".split(" ")

    async def speak() -> WsRecorder:
        async with websockets.connect(srv.ws_url, additional_headers=AUTH) as ws:
            rec = WsRecorder(ws)
            await rec.recv_one()  # session_started
            for i, w in enumerate(words):
                extra = {"text_mode": "stream", "voice": "cv2voice"} if i == 0 else {}
                await rec.send(type="text", context_id="s", text=w if i == 0 else " " + w,
                               end=i == len(words) - 1, **extra)
            return await rec.until(lambda r: r.finished("s"), timeout=120)

    rec = asyncio.run(speak())
    assert not rec.of("error"), rec.events
    assert rec.of("context_started", "s")[0]["text_mode"] == "stream"
    (done,) = rec.of("done", "s")
    assert done["audio_samples"] > 10 * SAMPLES_PER_TOKEN
    assert len(rec.audio["s"]) == 2 * done["audio_samples"]
