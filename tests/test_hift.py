"""CausalHiFTGenerator: official names/shapes, weight-norm folding, official non-final semantics,
the replayed noise table, and incremental streaming == whole-utterance inference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

from engine import ragged
from engine.models.config import HiFTConfig, ModelConfig
from engine.models.hift import CausalHiFTGenerator, HiFTStream, decoder_context_frames, init_random_

# The official hift.pt's tensor names and shapes (a copy of shared/reference/cosyvoice3/hift_keys.txt).
KEYS_FILE = Path(__file__).parent / "data" / "cosyvoice3_hift_keys.txt"
SPF = 480
# Streamed pieces vs whole inference: the same float ops on windows of different lengths; the
# measured difference is ~3e-8 on this config.
STREAM_TOL = 1e-5


@pytest.fixture(scope="module")
def gen() -> CausalHiFTGenerator:
    g = init_random_(CausalHiFTGenerator(ModelConfig.tiny().hift), seed=3)
    g.fold_weight_norm()  # 4x faster forward; folding itself is tested below
    return g.eval()


def _mel(frames: int, seed: int, batch: int | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (80, frames) if batch is None else (batch, 80, frames)
    return torch.randn(shape, generator=g) * 1.5 - 4.0


def _stream(gen: CausalHiFTGenerator, mel: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """Feed `mel` [80, T] in the given chunk sizes (non-final), then finalize with the rest."""
    st = gen.new_stream()
    pieces, pos = [], 0
    for c in chunks:
        pieces.append(gen.stream_step([st], [mel[:, pos : pos + c]], [False])[0])
        pos += c
    pieces.append(gen.stream_step([st], [mel[:, pos:]], [True])[0])
    return torch.cat(pieces)


def test_full_size_state_dict_matches_official_keys() -> None:
    expected = {}
    for line in KEYS_FILE.read_text().splitlines():
        if line and not line.startswith("#"):
            name, shape, _ = line.split("\t")
            expected[name] = [int(x) for x in shape.strip("[]").split(",")]
    sd = CausalHiFTGenerator(HiFTConfig()).state_dict()
    assert {k: list(v.shape) for k, v in sd.items()} == expected
    assert all(v.dtype == torch.float32 for v in sd.values())


def test_fold_weight_norm_keeps_numerics() -> None:
    g = init_random_(CausalHiFTGenerator(ModelConfig.tiny().hift), seed=5).eval()
    mel = _mel(12, seed=1, batch=1)
    before = g.inference(mel)
    assert any("parametrizations" in k for k in g.state_dict())
    g.fold_weight_norm()
    keys = g.state_dict().keys()
    assert not any("parametrizations" in k for k in keys)
    assert "conv_pre.weight" in keys and "f0_predictor.condnet.8.weight" in keys
    torch.testing.assert_close(g.inference(mel), before, rtol=0, atol=1e-6)


def test_noise_table_replays_official_build_order() -> None:
    """The official table is `torch.rand` in SineGen2.__init__, after set_all_random_seed(0) in the
    flow decoder and the module inits in between; replay them with real torch modules."""
    cfg = ModelConfig.tiny().hift
    c = cfg.f0_cond_channels
    with torch.random.fork_rng():
        torch.manual_seed(0)
        torch.randn([1, 80, 50 * 300])  # CausalConditionalCFM.rand_noise
        nn.Embedding(6561, 80)  # flow.input_embedding
        nn.Linear(192, 80)  # flow.spk_embed_affine_layer
        weight_norm(nn.Conv1d(80, c, 4))  # F0 predictor (weight norm draws nothing)
        for _ in range(4):
            weight_norm(nn.Conv1d(c, c, 3))
        nn.Linear(c, 1)
        torch.rand(1, 9)  # SineGen2.rand_ini
        official_prefix = torch.rand(1, 3 * SPF, 9)[0]  # start of SineGen2.sine_waves
    g = torch.Generator()
    g.set_state(CausalHiFTGenerator(cfg).noise_state)
    assert torch.equal(torch.rand(3 * SPF, 9, generator=g), official_prefix)


def test_device_noise_table_continues_into_the_stream_generator() -> None:
    """Noise rows come from the device table, then from the stream's generator past its end:
    together the same sequence as drawing the official table from its start."""
    cfg = ModelConfig.tiny().hift
    g = CausalHiFTGenerator(cfg, noise_table_seconds=2.5 * SPF / cfg.sampling_rate)  # 2.5 frames
    ref = torch.Generator()
    ref.set_state(g.noise_state)
    expected = torch.rand(9 * SPF, 9, generator=ref)
    stream_gen = g.new_stream().noise
    spans = [(0, 1), (1, 3), (4, 2), (6, 3)]  # inside, across the end, past it (in order)
    got = torch.cat([g._noise(stream_gen, start, n) for start, n in spans])
    assert torch.equal(got, expected)


def test_a_short_noise_table_changes_nothing(gen: CausalHiFTGenerator) -> None:
    """Streams that outrun the device table (here after 7.5 frames) sound the same."""
    short = init_random_(CausalHiFTGenerator(ModelConfig.tiny().hift,
                                             noise_table_seconds=7.5 * SPF / gen.cfg.sampling_rate), seed=3)
    short.fold_weight_norm()
    mel = _mel(40, seed=8)
    torch.testing.assert_close(_stream(short.eval(), mel, [12, 9, 11]), _stream(gen, mel, [12, 9, 11]), rtol=0, atol=0)
    torch.testing.assert_close(short.inference(mel[None]), gen.inference(mel[None]), rtol=0, atol=0)


def test_noise_table_is_built_ahead_and_follows_the_module() -> None:
    g = CausalHiFTGenerator(ModelConfig.tiny().hift)
    g.build_noise_table()  # what AudioStage.start does on its worker
    assert g._noise_table is not None and g._noise_table.rows.dtype == torch.float32
    g.double()  # a module move or cast drops the table; the next use rebuilds it to match
    assert g._noise_table is None
    g.new_stream()
    assert g._noise_table is not None and g._noise_table.rows.dtype == torch.float64


def test_random_init_gives_nontrivial_audio(gen: CausalHiFTGenerator) -> None:
    wav = gen.inference(_mel(30, seed=2, batch=2))
    assert wav.shape == (2, 30 * SPF)
    assert torch.isfinite(wav).all()
    assert wav.abs().max() <= gen.cfg.audio_limit
    rms = wav.pow(2).mean().sqrt()
    assert 1e-3 < rms < 0.5
    assert not torch.allclose(wav[0], wav[1])  # depends on the mel


def test_nonfinal_inference_withholds_eight_frames(gen: CausalHiFTGenerator) -> None:
    mel = _mel(40, seed=4, batch=1)
    whole = gen.inference(mel, finalize=True)
    assert whole.shape == (1, 40 * SPF)
    for t in (9, 12, 30):
        part = gen.inference(mel[:, :, :t], finalize=False)
        # 3 frames of F0 look-ahead, 4 of conv_pre look-ahead, 1 of iSTFT overlap are withheld
        assert part.shape == (1, (t - 8) * SPF)
        # ... and what is released never changes once more mel arrives
        torch.testing.assert_close(part, whole[:, : part.shape[1]], rtol=0, atol=1e-6)
    assert gen.inference(mel[:, :, :8], finalize=False).shape == (1, 0)
    # The withheld frames really are not final: a final call over the same prefix differs there.
    tail_final = gen.inference(mel[:, :, :30], finalize=True)[0, 22 * SPF :]
    assert (tail_final - whole[0, 22 * SPF : 30 * SPF]).abs().max() > 1e-4


@pytest.mark.parametrize(
    "chunks",
    [[1] * 44, [7] * 6, [3, 17, 1, 9], [45], [], [2, 0, 5, 0, 30]],
    ids=["1-frame", "7-frame", "irregular", "all-nonfinal", "single-final", "with-empty"],
)
def test_streaming_equals_whole_inference(gen: CausalHiFTGenerator, chunks: list[int]) -> None:
    mel = _mel(45, seed=7)
    whole = gen.inference(mel[None], finalize=True)[0]
    streamed = _stream(gen, mel, chunks)
    assert streamed.shape == whole.shape
    torch.testing.assert_close(streamed, whole, rtol=0, atol=STREAM_TOL)


def test_nonfinal_stream_steps_release_what_official_nonfinal_releases(gen: CausalHiFTGenerator) -> None:
    mel = _mel(30, seed=8)
    st = gen.new_stream()
    total = 0
    for end in (5, 9, 10, 21, 30):
        piece = gen.stream_step([st], [mel[:, st.received : end]], [False])[0]
        total += piece.numel()
        assert total == max(0, end - 8) * SPF
        ref = gen.inference(mel[None, :, :end], finalize=False)[0]
        assert ref.numel() == total


def test_batched_streams_with_different_chunkings(gen: CausalHiFTGenerator) -> None:
    lengths = [40, 23, 52]
    mels = [_mel(n, seed=10 + i) for i, n in enumerate(lengths)]
    schedules = [[1] * 5 + [6, 14, 16], [5, 0, 18], [13, 13, 13, 13]]  # last entry of each: rest
    streams = [gen.new_stream() for _ in mels]
    pieces: list[list[torch.Tensor]] = [[] for _ in mels]
    pos = [0, 0, 0]
    for step in range(max(len(s) for s in schedules)):
        active = [i for i in range(3) if step < len(schedules[i])]
        new = []
        fin = []
        for i in active:
            last = step == len(schedules[i]) - 1
            end = lengths[i] if last else pos[i] + schedules[i][step]
            new.append(mels[i][:, pos[i] : end])
            fin.append(last)
            pos[i] = end
        outs = gen.stream_step([streams[i] for i in active], new, fin)
        for i, o in zip(active, outs):
            assert o.dim() == 1
            pieces[i].append(o)
    for i, mel in enumerate(mels):
        assert streams[i].finished
        whole = gen.inference(mel[None], finalize=True)[0]
        torch.testing.assert_close(torch.cat(pieces[i]), whole, rtol=0, atol=STREAM_TOL)


def test_per_step_work_and_state_are_bounded(gen: CausalHiFTGenerator) -> None:
    chunk, ctx = 8, gen.context_frames
    mel = _mel(104, seed=20)
    st = gen.new_stream()
    windows = []
    for pos in range(0, 104, chunk):
        gen.stream_step([st], [mel[:, pos : pos + chunk]], [False])
        windows.append((st.last_f0_window, st.last_decode_window, st.mel.shape[1], st.source.numel(),
                        st.mel.untyped_storage().nbytes() // (80 * st.mel.element_size()),
                        st.source.untyped_storage().nbytes() // st.source.element_size()))
    late = windows[len(windows) // 2 :]
    # The state is kept as views of the last step's tensors: those stay bounded too.
    assert max(w[4] for w in late) <= ctx + 8 + 2 * chunk
    assert max(w[5] for w in late) <= (ctx + 5 + 2 * chunk) * SPF
    # Late steps (past 1.5x the context) process a window that depends on the chunk, not on T.
    assert max(w[0] for w in late) <= 8 + chunk + 3
    assert max(w[1] for w in late) <= ctx + chunk + 4 + 1
    assert max(w[2] for w in late) <= ctx + 8 + chunk
    assert max(w[3] for w in late) <= (ctx + 5 + chunk) * SPF
    assert st.received == 104 and st.emitted == 96


def test_context_is_what_makes_streaming_exact() -> None:
    """Guard for the test above: with too little context the stream is no longer exact."""
    cfg = ModelConfig.tiny().hift
    assert decoder_context_frames(cfg) >= 30  # stage-0 source branch alone spans ~29 frames
    short = init_random_(CausalHiFTGenerator(cfg, context_frames=2), seed=3)
    short.fold_weight_norm()
    mel = _mel(24, seed=7)
    whole = short.inference(mel[None])[0]
    assert (_stream(short, mel, [3] * 7) - whole).abs().max() > 1e-3


def test_stream_api_contract(gen: CausalHiFTGenerator) -> None:
    st = gen.new_stream()
    assert isinstance(st, HiFTStream)
    assert not any(isinstance(v, nn.Module) for v in vars(st).values())
    out = gen.stream_step([st], [torch.zeros(80, 0)], [True])
    assert out[0].numel() == 0 and st.finished
    with pytest.raises(RuntimeError):
        gen.stream_step([st], [torch.zeros(80, 1)], [False])
    with pytest.raises(ValueError):
        gen.stream_step([gen.new_stream()], [torch.zeros(81, 3)], [False])


def test_f0_predictor_as_matrix_products_is_its_convs() -> None:
    """The F0 predictor's convs run as one matrix product each, time-major (cuDNN has only a
    slow generic kernel in float64): the same numbers as the conv modules' own calls, to
    the order of the sums, in float64 and float32, one row or several."""
    from engine.models.hift import CausalF0Predictor

    torch.manual_seed(3)
    predictor = CausalF0Predictor(80, 64).requires_grad_(False)
    for dtype, tol in ((torch.float64, 1e-13), (torch.float32, 1e-5)):
        predictor.to(dtype)
        assert predictor(torch.zeros(0, 80, 10, dtype=dtype)).shape == (0, 7)  # no rows: none out
        for batch, frames in ((1, 4), (1, 25), (3, 60)):
            mel = torch.randn(batch, 80, frames, dtype=dtype)
            h = mel
            for layer in predictor.condnet:  # each conv through its own forward (cuDNN / ATen)
                h = layer(h)
            want = predictor.classifier(h.transpose(1, 2)).squeeze(-1).abs()
            got = predictor(mel)
            assert got.shape == (batch, frames - 3) and got.dtype == dtype
            assert torch.allclose(got, want, rtol=0, atol=tol * float(want.abs().max())), (dtype, batch, frames)


def test_snake_follows_every_change_of_alpha() -> None:
    """Snake keeps alpha's reshape and inverse between calls; they must follow alpha through
    in-place updates, loads, casts and copies (the official formula, bit for bit)."""
    import copy

    from engine.models.hift import Snake

    def official(m: Snake, x: torch.Tensor) -> torch.Tensor:
        a = m.alpha[None, :, None]
        return x + (1.0 / (a + 1e-9)) * torch.sin(x * a).pow(2)

    torch.manual_seed(0)
    snake = Snake(8)
    x = torch.randn(2, 8, 30)
    changes = [
        lambda m: m.alpha.uniform_(0.2, 3.0),  # in place
        lambda m: m.load_state_dict({"alpha": torch.full((8,), 0.5)}),
        lambda m: m.double(),
        lambda m: m.float(),
    ]
    with torch.no_grad():
        assert torch.equal(snake(x), official(snake, x))
        for change in changes:
            change(snake)
            xi = x.to(snake.alpha.dtype)
            assert torch.equal(snake(xi), official(snake, xi))
        clone = copy.deepcopy(snake)
        clone.alpha.fill_(1.5)
        assert torch.equal(clone(x), official(clone, x)) and torch.equal(snake(x), official(snake, x))
        assert not torch.equal(clone(x), snake(x))
    with torch.inference_mode():  # a module made under inference_mode has no version counter
        made_here = Snake(8)
        made_here.alpha.uniform_(0.2, 3.0)
        assert torch.equal(made_here(x), official(made_here, x))
        made_here.alpha.mul_(2.0)
        assert torch.equal(made_here(x), official(made_here, x))


def test_stft_and_inverse_are_torchs_without_cufft() -> None:
    """The vocoder's STFT and inverse FFT are matrix products (no cuFFT plan for a CUDA graph
    to lose): the same numbers as torch.stft / torch.fft.irfft up to float32 rounding."""
    from engine.models.hift import _dft_bases, _hann_window

    n_fft, hop = 16, 4
    window = _hann_window(n_fft)
    analysis, synthesis = _dft_bases(n_fft, window)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, n_fft + hop * 99, generator=g)
    ref = torch.view_as_real(torch.stft(x, n_fft, hop, n_fft, window=window, center=False, return_complex=True))
    ref = torch.cat([ref[..., 0], ref[..., 1]], dim=1)  # [B, 2 bins, frames]
    got = (x.unfold(1, n_fft, hop) @ analysis).transpose(1, 2)
    assert got.shape == ref.shape and torch.allclose(got, ref, atol=1e-5, rtol=0)
    magnitude, phase = torch.rand(3, 9, 50, generator=g) * 3, torch.randn(3, 9, 50, generator=g) * 3
    spec = torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
    ref = torch.fft.irfft(spec, n=n_fft, dim=1) * window[None, :, None]
    got = synthesis.T @ torch.cat((magnitude * torch.cos(phase), magnitude * torch.sin(phase)), dim=1)
    assert got.shape == ref.shape and torch.allclose(got, ref, atol=1e-5, rtol=0)
    # The generator's own _stft uses them: one frame of a sine at bin 2 lands in bin 2.
    gen = CausalHiFTGenerator(ModelConfig.tiny().hift)
    tone = torch.sin(2 * torch.pi * 2 * torch.arange(n_fft) / n_fft)[None]
    bins = gen._stft(tone, 1)[0, :, 0]
    assert bins[: n_fft // 2 + 1].abs().argmax() == 2 or bins[n_fft // 2 + 1 :].abs().argmax() == 2


@pytest.mark.parametrize("gather_from", [1, 100])
def test_ragged_rows_and_pieces_are_the_per_stream_slices(gather_from: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch windows of a vocoder step, gathered (from `GATHER_MIN_ROWS` streams) or
    sliced, equal slicing each stream, F.pad's reflect padding and right zero padding, row
    by row; the output pieces are views of the rows' own ranges."""
    monkeypatch.setattr(ragged, "GATHER_MIN_ROWS", gather_from)
    g = torch.Generator().manual_seed(4)
    parts = [torch.randn(5, n, generator=g) for n in (12, 30, 9)]
    starts, lengths = [2, 10, 0], [7, 20, 9]
    got = ragged.ragged_rows(parts, starts, lengths, 24)
    for b, (p, s, n) in enumerate(zip(parts, starts, lengths)):
        assert torch.equal(got[b], F.pad(p[:, s : s + n], (0, 24 - n)))
    flat = [torch.randn(n, generator=g) for n in (40, 25)]
    got = ragged.ragged_rows(flat, [5, 0], [20, 25], 25 + 16, reflect=8)
    for b, (p, s, n) in enumerate(zip(flat, [5, 0], [20, 25])):
        want = F.pad(F.pad(p[s : s + n][None, None], (8, 8), mode="reflect")[0, 0], (0, 41 - n - 16))
        assert torch.equal(got[b], want)
    with pytest.raises(ValueError, match="reflect"):
        ragged.ragged_rows(flat, [0, 0], [8, 20], 40, reflect=8)
    grid = torch.randn(3, 11, generator=g)
    got = ragged.row_windows(grid, [0, 4, 9], [5, 7, 2], 8)
    for b, (s, n) in enumerate(zip([0, 4, 9], [5, 7, 2])):
        assert torch.equal(got[b], F.pad(grid[b, s : s + n], (0, 8 - n)))
    rows = torch.arange(30.0).view(3, 10)
    pieces = ragged.row_ranges(rows, [2, 0, 7], [3, 10, 0])
    assert [p.tolist() for p in pieces] == [[2.0, 3.0, 4.0], list(map(float, range(10, 20))), []]
    assert all(p.untyped_storage().data_ptr() == rows.untyped_storage().data_ptr() for p in pieces)
