"""CosyVoice3 token-to-mel decoder: `CausalMaskedDiffWithDiT` with its conditional flow matching.

Pipeline (same maths as the official `cosyvoice/flow/flow.py` + `flow_matching.py`):

1. speech tokens -> `input_embedding` (80-dim) -> `PreLookaheadLayer` (a conv that sees
   the next `pre_lookahead_len` tokens, then a causal conv, residual) -> repeated x2
   in time = `mu`, one vector per 50 Hz mel frame.
2. speaker vector: L2-normalised CAM++ embedding -> `spk_embed_affine_layer` (192 -> 80).
3. `cond`: the prompt mel on the prompt frames, zeros elsewhere.
4. `CausalConditionalCFM`: 10 Euler steps of dx/dt = DiT(x, t | mu, spks, cond) from
   fixed noise at t=0 to mel at t=1, on a cosine time grid t_k = 1 - cos(pi/2 * k/10),
   with classifier-free guidance v = 1.7 v_cond - 0.7 v_uncond (the unconditional row
   zeroes mu, spks and cond).

The starting noise is *not* random per call: the reference draws one [1, 80, 15000]
tensor with seed 0 at construction and uses frame f's column for mel frame f. That is
what lets a streaming engine recompute a prefix and get the same frames. We keep it as a
non-persistent buffer (it is not in the checkpoint), built on CPU from a local
generator seeded 0 (identical to `torch.manual_seed(0); torch.randn(1, 80, 15000)`).

Streaming: with `streaming=True` the DiT attends block-causally over 50-frame (25-token)
blocks, the conv position embedding is causal and the lookahead layer only needs 3
future tokens. So the frames of a complete block depend only on tokens up to the end of
that block + 3, and chunk-wise decoding reproduces whole-utterance decoding as long as
chunk ends (prompt included) fall on the 25-token grid.

`inference_chunks` decodes several independent chunks (possibly of different requests)
as one padded batch; see `FlowChunk`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..device_copy import to_device
from .config import FlowConfig
from .dit import DiT, DiTPrefix, DiTRecord

# Seed and size of the reference's fixed noise: 50 frames/s x 300 s.
NOISE_SEED = 0
NOISE_FRAMES = 50 * 300


def fixed_noise(channels: int = 80, frames: int = NOISE_FRAMES, seed: int = NOISE_SEED) -> torch.Tensor:
    """The reference's start noise, [1, channels, frames], drawn on CPU from seed 0."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(1, channels, frames, generator=gen, device="cpu", dtype=torch.float32)


def cosine_time_grid(n_steps: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """t_k = 1 - cos(k/n * pi/2), k = 0..n: small steps near the noise end."""
    lin = torch.linspace(0, 1, n_steps + 1, device=device, dtype=dtype)
    return 1 - torch.cos(lin * 0.5 * torch.pi)


class PreLookaheadLayer(nn.Module):
    """Token features with `lookahead` tokens of right context: conv(k=lookahead+1) looking
    ahead, leaky ReLU, causal conv(k=3), plus a residual connection."""

    def __init__(self, channels_in: int, channels: int, lookahead: int) -> None:
        super().__init__()
        self.lookahead = lookahead
        self.conv1 = nn.Conv1d(channels_in, channels, kernel_size=lookahead + 1)
        self.conv2 = nn.Conv1d(channels, channels_in, kernel_size=3)

    def forward(self, padded: torch.Tensor) -> torch.Tensor:
        """padded: [B, N + lookahead, C] = the N main tokens followed by `lookahead` right
        context tokens (real lookahead tokens, or zeros at the end of an utterance).
        Returns [B, N, C]."""
        h = F.leaky_relu(self.conv1(padded.transpose(1, 2)))
        h = self.conv2(F.pad(h, (self.conv2.kernel_size[0] - 1, 0)))
        return h.transpose(1, 2) + padded[:, : h.shape[2]]


class CausalConditionalCFM(nn.Module):
    """Euler ODE solver with classifier-free guidance around the DiT estimator."""

    def __init__(self, cfg: FlowConfig, estimator: nn.Module | None = None) -> None:
        super().__init__()
        self.n_timesteps = cfg.n_timesteps
        self.cfg_rate = cfg.inference_cfg_rate
        # CosyVoice2 runs the same solver around a U-Net (`engine.models.unet1d`); any
        # estimator with the signature (x, mask, mu, t, spks, cond, streaming) fits.
        self.estimator = DiT(cfg) if estimator is None else estimator
        self.register_buffer("rand_noise", fixed_noise(cfg.output_size), persistent=False)

    def solve(
        self,
        noise: torch.Tensor,
        mask: torch.Tensor,
        mu: torch.Tensor,
        spks: torch.Tensor,
        cond: torch.Tensor,
        streaming: bool,
        prefix: Sequence[DiTPrefix] | None = None,
        record: list[DiTRecord] | None = None,
    ) -> torch.Tensor:
        """noise, mu, cond: [B, 80, T]; mask: [B, 1, T]; spks: [B, 80] -> mel [B, 80, T].

        The batch is doubled: rows [0, B) are conditional, rows [B, 2B) unconditional
        (mu, spks, cond zeroed), exactly like the reference's 2-row batch for B = 1.
        `prefix[k]` (DiT only) is step k's cached prefix of all 2B rows; `record` gets
        one `DiTRecord` per step (see `engine.models.dit`).
        """
        extra: list[dict[str, object]] = [{} for _ in range(self.n_timesteps)]
        for k in range(self.n_timesteps):
            if prefix is not None:
                extra[k]["prefix"] = prefix[k]
            if record is not None:
                record.append(DiTRecord())
                extra[k]["record"] = record[-1]
        batch = noise.shape[0]
        # The estimator runs in the inputs' dtype (the weights'); the ODE state and the
        # flow time stay float32, so ten Euler updates do not accumulate bf16 rounding.
        dtype = noise.dtype
        x = noise.float()
        t_span = cosine_time_grid(self.n_timesteps, noise.device, torch.float32)
        mask_in = torch.cat((mask, mask))
        mu_in = torch.cat((mu, torch.zeros_like(mu)))
        spks_in = torch.cat((spks, torch.zeros_like(spks)))
        cond_in = torch.cat((cond, torch.zeros_like(cond)))
        # Accumulate t and recompute dt from the grid the way the reference does, so
        # rounding matches it exactly.
        times, steps = [t_span[0]], []
        for step in range(1, len(t_span)):
            steps.append(t_span[step] - times[-1])
            times.append(times[-1] + steps[-1])
        times.pop()  # the estimator runs at t_0 .. t_{n-1}
        conditioning = getattr(self.estimator, "time_conditioning", None)
        if conditioning is not None:  # the DiT: every step's time vectors in one product
            for k, c in enumerate(conditioning(torch.stack(times))):
                extra[k]["time"] = c
        for k, (t, dt) in enumerate(zip(times, steps)):
            x_in = torch.cat((x, x)).to(dtype)
            v = self.estimator(x_in, mask_in, mu_in, t.expand(2 * batch), spks_in, cond_in, streaming,
                               **extra[k]).float()
            v_cond, v_uncond = v[:batch], v[batch:]
            x = x + dt * ((1.0 + self.cfg_rate) * v_cond - self.cfg_rate * v_uncond)
        return x.float()


@dataclass
class FlowChunk:
    """One decoding job for `CausalMaskedDiffWithDiT.inference_chunks`.

    tokens:            [T] int64 = prompt tokens + (window of) earlier tokens + new tokens
                       (+ `pre_lookahead_len` lookahead tokens when not finalize).
    prompt_feat:       [2*Tp, 80] prompt mel.
    embedding:         [192] speaker embedding (un-normalised CAM++ output).
    num_prompt_tokens: Tp; cond = prompt_feat on the first 2*Tp frames, zeros after.
    out_start:         index into tokens of the first token whose mel is returned.
    finalize:          False: the last `pre_lookahead_len` tokens are lookahead only.
    noise_offset:      added to the frame index used to pick noise for frames after the
                       prompt, so that dropping 2*k earlier frames (k tokens) from the
                       window with noise_offset = 2*k keeps every frame's noise.
    """

    tokens: torch.Tensor
    prompt_feat: torch.Tensor
    embedding: torch.Tensor
    num_prompt_tokens: int
    out_start: int
    finalize: bool
    noise_offset: int = 0


class CausalMaskedDiffWithDiT(nn.Module):
    def __init__(self, cfg: FlowConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.pre_lookahead_len = cfg.pre_lookahead_len
        self.token_mel_ratio = cfg.token_mel_ratio
        self.input_embedding = nn.Embedding(cfg.vocab_size, cfg.input_size)
        self.spk_embed_affine_layer = nn.Linear(cfg.spk_embed_dim, cfg.output_size)
        self.pre_lookahead_layer = PreLookaheadLayer(cfg.input_size, cfg.pre_lookahead_channels, cfg.pre_lookahead_len)
        self.decoder = CausalConditionalCFM(cfg)

    @torch.inference_mode()
    def inference(
        self,
        token: torch.Tensor,
        prompt_token: torch.Tensor,
        prompt_feat: torch.Tensor,
        embedding: torch.Tensor,
        streaming: bool,
        finalize: bool,
    ) -> torch.Tensor:
        """Batch-1 decoding with the reference's semantics.

        token [N] or [1, N]; prompt_token [Tp] or [1, Tp]; prompt_feat [2Tp, 80] or
        [1, 2Tp, 80]; embedding [192] or [1, 192]. Returns the mel after the prompt,
        [1, 80, frames] (channel-major like the reference); when not finalize the last
        `pre_lookahead_len` tokens of `token` are context only and produce no frames.
        """
        prompt = prompt_token.reshape(-1)
        chunk = FlowChunk(
            tokens=torch.cat((prompt, token.reshape(-1))),
            prompt_feat=prompt_feat.reshape(-1, prompt_feat.shape[-1]),
            embedding=embedding.reshape(-1),
            num_prompt_tokens=int(prompt.numel()),
            out_start=int(prompt.numel()),
            finalize=finalize,
        )
        return self.inference_chunks([chunk], streaming=streaming)[0].T.unsqueeze(0)

    def token_features(self, chunks: list[FlowChunk], n_main: list[int], streaming: bool) -> torch.Tensor:
        """`mu` for a batch of chunks: [B, 80, ratio * max(n_main)], the conditioning of every
        mel frame on its tokens (the part CosyVoice2's flow computes differently; this causal
        lookahead layer behaves the same with and without `streaming`)."""
        device = self.input_embedding.weight.device
        dtype = self.spk_embed_affine_layer.weight.dtype
        look, n_max = self.pre_lookahead_len, max(n_main)
        # Token features with right context: the lookahead tokens when not finalizing,
        # zeros otherwise (the reference's right padding); zeros also fill batch padding,
        # which the lookahead conv of real tokens never reaches. One padded id matrix and
        # one embedding lookup for the whole batch (not one per chunk).
        ids, valid = _padded_ids(chunks, n_max + look, device)
        emb = self.input_embedding(ids).to(dtype).masked_fill(~valid.unsqueeze(-1), 0.0)
        h = self.pre_lookahead_layer(emb)  # [B, n_max, 80]
        return h.repeat_interleave(self.token_mel_ratio, dim=1).transpose(1, 2)

    @torch.inference_mode()
    def inference_chunks(
        self, chunks: list[FlowChunk], streaming: bool = True, solver: FlowSolver | None = None
    ) -> list[torch.Tensor]:
        """Decode all chunks as one right-padded batch; returns one [frames, 80] mel per chunk
        (the frames of tokens[out_start : T - lookahead_if_not_finalize])."""
        return self.decode_chunks(chunks, streaming, solver)[0]

    def prepare_batch(
        self, chunks: list[FlowChunk], streaming: bool = True, rows: int | None = None, t_pad: int | None = None
    ) -> FlowBatchInputs:
        """Noise, mask, mu, speaker and prompt condition of a chunk batch, right-padded to
        `rows` x `t_pad` (default: the batch's own size) with mask 0 and zero inputs.
        Does not look at `out_start` (the prompt cache feeds prompt-only chunks here)."""
        device = self.input_embedding.weight.device
        dtype = self.spk_embed_affine_layer.weight.dtype
        ratio, look = self.token_mel_ratio, self.pre_lookahead_len
        n_mel = self.cfg.output_size

        n_main = [len(c.tokens) - (0 if c.finalize else look) for c in chunks]
        for c, n in zip(chunks, n_main):
            tp = c.num_prompt_tokens
            if c.prompt_feat.shape[0] != ratio * tp:
                raise ValueError(f"prompt_feat has {c.prompt_feat.shape[0]} frames, expected {ratio * tp}")
            last_noise = ratio * n - 1 + (c.noise_offset if n > tp else 0)
            if last_noise >= self.decoder.rand_noise.shape[2]:
                raise ValueError(f"utterance too long for the fixed noise ({last_noise + 1} frames)")
        batch, n_max = len(chunks), max(n_main)
        frames = [ratio * n for n in n_main]
        t_max = ratio * n_max
        rows = batch if rows is None else rows
        t_pad = t_max if t_pad is None else t_pad

        mu = self.token_features(chunks, n_main, streaming)  # [B, 80, t_max]
        spk_in = _stack_rows([c.embedding.reshape(-1) for c in chunks], device, dtype)
        spks = self.spk_embed_affine_layer(F.normalize(spk_in, dim=1))
        if rows > batch or t_pad > t_max:
            mu = F.pad(mu, (0, t_pad - t_max, 0, 0, 0, rows - batch))
            spks = F.pad(spks, (0, 0, 0, rows - batch))

        # Noise, prompt condition and mask come from one gather each, driven by index
        # planes built on the host and copied to the device once (not ~6 small kernels
        # and copies per chunk).
        prompt_frames = [ratio * c.num_prompt_tokens for c in chunks]
        feats, feat_base = _prompt_table(chunks, n_mel, device, dtype)
        plan = _gather_plan(frames, prompt_frames, [c.noise_offset for c in chunks], feat_base, rows, t_pad)
        plan = to_device(plan, device)
        noise_idx, cond_idx, valid = plan[0], plan[1], plan[2]
        mask = valid.to(dtype).unsqueeze(1)  # [rows, 1, t_pad]
        source = self.decoder.rand_noise[0]  # [80, NOISE_FRAMES]
        if source.device != device:
            source = source.to(device)
        noise = source.to(dtype)[:, noise_idx.reshape(-1)].view(n_mel, rows, t_pad).transpose(0, 1).contiguous()
        noise = noise * mask  # padding gathered column 0; zero it (exact: x * 1 == x elsewhere)
        cond = feats[cond_idx.reshape(-1)].view(rows, t_pad, n_mel).transpose(1, 2).contiguous()
        return FlowBatchInputs(noise, mask, mu, spks, cond, frames)

    @torch.inference_mode()
    def decode_chunks(
        self, chunks: list[FlowChunk], streaming: bool = True, solver: FlowSolver | None = None
    ) -> tuple[list[torch.Tensor], FlowBatchShape]:
        """`inference_chunks` plus the padded shape the ODE solver ran at.

        `solver` replaces `self.decoder.solve` (e.g. the CUDA-graph runner of
        `engine.flow_graphs`); it may ask for more rows and frames than the chunks need
        (`padded_shape`), which are filled exactly like the ordinary batch padding: mask
        0, zero noise/mu/cond/speaker. Padding cannot change the real frames: every op of
        the estimator is per row, its convolutions are causal, and attention only reads
        keys whose mask is 1.
        """
        if not chunks:
            return [], FlowBatchShape(0, 0, 0)
        ratio, look = self.token_mel_ratio, self.pre_lookahead_len
        n_main = [len(c.tokens) - (0 if c.finalize else look) for c in chunks]
        for c, n in zip(chunks, n_main):
            if not c.num_prompt_tokens <= c.out_start <= n:
                raise ValueError(f"out_start {c.out_start} outside [{c.num_prompt_tokens}, {n}]")
        batch, t_max = len(chunks), ratio * max(n_main)
        rows, t_pad = (batch, t_max) if solver is None else solver.padded_shape(batch, t_max)
        if rows < batch or t_pad < t_max:
            raise ValueError(f"solver padded shape {(rows, t_pad)} is smaller than the batch {(batch, t_max)}")
        inputs = self.prepare_batch(chunks, streaming, rows, t_pad)
        noise, mask, mu, spks, cond = inputs.noise, inputs.mask, inputs.mu, inputs.spks, inputs.cond
        frames = inputs.frames

        run = self.decoder.solve if solver is None else solver
        mel = run(noise, mask, mu, spks, cond, streaming)
        out = [mel[i, :, ratio * c.out_start : frames[i]].T for i, c in enumerate(chunks)]
        return out, FlowBatchShape(rows, t_pad, t_max)


@dataclass
class FlowBatchInputs:
    """The ODE inputs of a chunk batch (see `CausalMaskedDiffWithDiT.prepare_batch`)."""

    noise: torch.Tensor  # [rows, 80, T]
    mask: torch.Tensor  # [rows, 1, T]
    mu: torch.Tensor  # [rows, 80, T]
    spks: torch.Tensor  # [rows, 80]
    cond: torch.Tensor  # [rows, 80, T]
    frames: list[int]  # real frames per chunk (main tokens x ratio)


@dataclass(frozen=True)
class FlowBatchShape:
    """Shape one `decode_chunks` call ran the ODE at: padded rows x padded frames (before
    the classifier-free-guidance doubling), and the call's longest row before its frames
    were padded to a graph's bucket."""

    rows: int
    frames: int
    longest: int


class FlowSolver(Protocol):
    """A stand-in for `CausalConditionalCFM.solve` that may run at a padded shape."""

    def padded_shape(self, rows: int, frames: int) -> tuple[int, int]: ...

    def __call__(
        self,
        noise: torch.Tensor,
        mask: torch.Tensor,
        mu: torch.Tensor,
        spks: torch.Tensor,
        cond: torch.Tensor,
        streaming: bool,
    ) -> torch.Tensor: ...


def _stack_rows(rows: list[torch.Tensor], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Stack 1-D tensors into [B, C] on `device` (host rows: stacked there, one copy)."""
    return to_device(torch.stack(rows), device, dtype)


def _padded_ids(chunks: list[FlowChunk], length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids right-padded to [B, length] (padding id 0, negative ids clamped to 0 like
    the reference) and the matching validity mask, on `device`."""
    seqs = [c.tokens.reshape(-1) for c in chunks]
    lengths = torch.tensor([len(s) for s in seqs])
    ids = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=0)
    ids = F.pad(ids, (0, length - ids.shape[1]))
    ids = to_device(ids, device, torch.long).clamp(min=0)
    valid = torch.arange(length) < lengths.unsqueeze(1)
    return ids, to_device(valid, device)


def _prompt_table(
    chunks: list[FlowChunk], n_mel: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, list[int]]:
    """All distinct prompt mels stacked as rows [1 + sum(frames), n_mel] after one zero row,
    and each chunk's first row in it (chunks of one voice usually share the tensor)."""
    parts = [torch.zeros(1, n_mel, dtype=dtype, device=chunks[0].prompt_feat.device)]
    starts: dict[int, int] = {}
    base, offset = [], 1
    for c in chunks:
        key = id(c.prompt_feat)
        if key not in starts:
            starts[key] = offset
            parts.append(c.prompt_feat.to(device=parts[0].device, dtype=dtype))
            offset += c.prompt_feat.shape[0]
        base.append(starts[key])
    return to_device(torch.cat(parts), device), base


def _gather_plan(
    frames: list[int], prompt_frames: list[int], noise_offsets: list[int], feat_base: list[int], rows: int, t_pad: int
) -> torch.Tensor:
    """Host-side index planes [3, rows, t_pad] (int64) for one batch:

    0: column of the fixed noise for each frame: f for prompt frames, f + noise_offset
       after the prompt (0 on padding, zeroed later by the mask);
    1: row of the prompt table for prompt frames, 0 (the zero row) elsewhere;
    2: 1 on real frames, 0 on padded frames and rows.
    """
    n = len(frames)
    f = torch.arange(t_pad).unsqueeze(0)  # [1, T]
    col = lambda xs: torch.tensor(xs, dtype=torch.long).unsqueeze(1)  # noqa: E731
    n_frames, p, off, base = col(frames), col(prompt_frames), col(noise_offsets), col(feat_base)
    valid = f < n_frames
    noise_idx = torch.where(f >= p, f + off, f) * valid
    cond_idx = torch.where(f < p, base + f, 0)
    plan = torch.zeros(3, rows, t_pad, dtype=torch.long)
    plan[0, :n], plan[1, :n], plan[2, :n] = noise_idx, cond_idx, valid
    return plan


def init_random_(module: nn.Module, seed: int) -> nn.Module:
    """Fill every parameter of `module` with deterministic random values (in place).

    For tests and benchmarks without a checkpoint. Scales are chosen so activations stay
    O(1) through deep stacks and so nothing is trivially zero (the real AdaLN-Zero init
    zeroes the modulation and output layers, which would make the DiT output constant):
    matrices/conv kernels ~ N(0, 1/fan_in), embeddings ~ N(0, 1), biases ~ N(0, 0.02^2),
    and the AdaLN modulation weights small (N(0, 0.02^2)) so gates/scales stay near 0/1.
    Buffers (rotary inv_freq, fixed noise) are left untouched.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            shape = param.shape
            if param.ndim == 1:
                std = 0.02
            elif isinstance(_owner(module, name), nn.Embedding):
                std = 1.0
            elif "attn_norm.linear" in name or "norm_out.linear" in name:
                std = 0.02
            else:
                fan_in = 1
                for s in shape[1:]:
                    fan_in *= s
                std = fan_in**-0.5
            values = torch.randn(shape, generator=gen, dtype=torch.float32) * std
            param.copy_(values.to(device=param.device, dtype=param.dtype))
    return module


def _owner(root: nn.Module, param_name: str) -> nn.Module:
    path = param_name.rsplit(".", 1)[0] if "." in param_name else ""
    return root.get_submodule(path) if path else root
