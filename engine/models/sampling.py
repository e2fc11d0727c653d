"""Repetition-aware sampling (RAS), the official CosyVoice speech-token sampler.

One RAS draw, as in the official `ras_sampling` (cosyvoice/utils/common.py):

1. nucleus: softmax, stable descending sort, keep the head of the list while the
   probability mass *before* an entry is < top_p and fewer than top_k entries are
   kept (so the first entry is always kept); draw x from the kept entries in
   proportion to their probabilities;
2. if x occurs at least `win_size * tau_r` times among the last `win_size`
   *generated* tokens, forbid x and draw again from the full softmax.

Three entry points share that definition:

* `ras_sample_batch` draws for a batch, with per-row parameters and a per-request
  `torch.Generator` (no global RNG). It uses inverse-CDF sampling on uniforms drawn
  from the generator, which has the same distribution as the official multinomial.
* `ras_sample` is the single-row convenience wrapper.
* `ras_logits` returns logits whose softmax is the *exact* output distribution of
  one RAS draw, so an engine that can only do plain random sampling (vLLM, through a
  logits processor, with temperature 1 and top-p/top-k disabled) reproduces RAS.

EOS handling (`suppress_stop_ids_`): before `min_tokens` every stop id (all reserved
ids >= speech_token_size) is set to -inf before sampling. Deviation from the official
HF path, which masks only index `speech_token_size` -- for CosyVoice3 that is `sos`
(6561), not `eos` (6562), so there the min-length guard does not block eos.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class RASParams:
    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10
    tau_r: float = 0.1

    @property
    def repeat_threshold(self) -> float:
        # The official comparison is `count >= win_size * tau_r` on floats.
        return self.win_size * self.tau_r


def _as_column(value: float | int | Tensor | Sequence[float], rows: int, like: Tensor) -> Tensor:
    """Broadcast a scalar or per-row value to a [rows, 1] float tensor on `like`'s device."""
    t = torch.as_tensor(value, dtype=torch.float32, device=like.device)
    return t.reshape(-1, 1).expand(rows, 1) if t.numel() == 1 else t.reshape(rows, 1)


def nucleus_mask_sorted(
    sorted_probs: Tensor, top_p: float | Tensor, top_k: int | Tensor
) -> Tensor:
    """Which entries of descending-sorted probabilities [B, V] the nucleus keeps."""
    b, v = sorted_probs.shape
    # Exclusive running sum, accumulated left to right like the official Python loop.
    running = torch.cumsum(sorted_probs, dim=-1)
    mass_before = torch.cat([torch.zeros_like(running[:, :1]), running[:, :-1]], dim=-1)
    rank = torch.arange(v, device=sorted_probs.device)[None, :]
    keep = (mass_before < _as_column(top_p, b, sorted_probs)) & (
        rank < _as_column(top_k, b, sorted_probs)
    )
    keep[:, 0] = True  # the official loop always takes the first entry
    return keep


def nucleus_probs(logits: Tensor, top_p: float | Tensor, top_k: int | Tensor) -> Tensor:
    """The normalised nucleus distribution [B, V] (zero outside the kept set)."""
    probs = torch.softmax(logits.float(), dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    kept = torch.where(nucleus_mask_sorted(sorted_probs, top_p, top_k), sorted_probs, 0.0)
    out = torch.zeros_like(probs).scatter_(-1, order, kept)
    return out / out.sum(dim=-1, keepdim=True)


def window_tensor(windows: Sequence[Sequence[int]], win_size: int, device: torch.device | str = "cpu") -> Tensor:
    """Last `win_size` generated tokens of each row as [B, win_size] long, padded with -1."""
    out = torch.full((len(windows), win_size), -1, dtype=torch.long)
    for r, tokens in enumerate(windows):
        recent = list(tokens)[-win_size:] if win_size > 0 else []
        if recent:
            out[r, : len(recent)] = torch.tensor(recent, dtype=torch.long)
    return out.to(device)


def _inverse_cdf(weights: Tensor, u: Tensor) -> Tensor:
    """Index drawn from each row of non-negative `weights` [B, N] given uniforms u [B]."""
    cdf = torch.cumsum(weights, dim=-1)
    target = (u * cdf[:, -1]).unsqueeze(-1)
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    # u*total can round up to the last cdf value; fall back to the last positive entry.
    last_positive = weights.shape[-1] - 1 - torch.argmax((weights.flip(-1) > 0).int(), dim=-1)
    return torch.minimum(idx, last_positive)


def ras_sample_batch(
    logits: Tensor,  # [B, V]
    windows: Tensor,  # [B, W] long, recent generated tokens, -1 = empty
    uniforms: Tensor,  # [B, 2] in [0, 1): one for the nucleus draw, one for the fallback
    top_p: float | Tensor = 0.8,
    top_k: int | Tensor = 25,
    repeat_threshold: float | Tensor = 1.0,
) -> Tensor:
    """One RAS draw per row; returns token ids [B] (long, on logits' device)."""
    logits = logits.float()
    b = logits.shape[0]
    probs = torch.softmax(logits, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    kept = torch.where(nucleus_mask_sorted(sorted_probs, top_p, top_k), sorted_probs, 0.0)
    first = order.gather(-1, _inverse_cdf(kept, uniforms[:, 0])[:, None]).squeeze(-1)

    repeats = (windows == first[:, None]).sum(-1).float()
    resample = repeats >= _as_column(repeat_threshold, b, logits).squeeze(-1)
    if not bool(resample.any()):
        return first
    # Fallback: the full softmax with the repeated id forbidden.
    rows = resample.nonzero().squeeze(-1)
    masked = logits[rows].clone()
    masked.scatter_(-1, first[rows, None], float("-inf"))
    fallback_probs = torch.softmax(masked, dim=-1).nan_to_num(0.0)
    second = _inverse_cdf(fallback_probs, uniforms[rows, 1])
    # A row whose whole mass sat on the forbidden id has nothing to fall back to
    # (the official code would fail); keep the first draw there.
    nothing_left = fallback_probs.sum(-1) <= 0
    second = torch.where(nothing_left, first[rows], second)
    out = first.clone()
    out[rows] = second
    return out


def ras_sample(
    logits: Tensor,  # [V]
    recent: Sequence[int],
    params: RASParams,
    generator: torch.Generator,
) -> int:
    """Single-row RAS draw (all generated tokens so far, or at least the last win_size)."""
    windows = window_tensor([recent], params.win_size, logits.device)
    uniforms = torch.rand((1, 2), generator=generator, device=generator.device).to(logits.device)
    token = ras_sample_batch(
        logits[None], windows, uniforms, params.top_p, params.top_k, params.repeat_threshold
    )
    return int(token.item())


def greedy(logits: Tensor) -> Tensor:
    """Arg-max per row (parity checks between backends)."""
    return torch.argmax(logits, dim=-1)


def suppress_stop_ids_(logits: Tensor, first_stop_id: int, rows: Tensor | None = None) -> Tensor:
    """In place: make every id >= first_stop_id impossible (all rows, or the bool `rows`)."""
    if rows is None:
        logits[..., first_stop_id:] = float("-inf")
    else:
        logits[rows, first_stop_id:] = float("-inf")
    return logits


def ras_logits(
    logits: Tensor,  # [B, V]
    windows: Tensor,  # [B, W] long, -1 = empty
    top_p: float | Tensor = 0.8,
    top_k: int | Tensor = 25,
    repeat_threshold: float | Tensor = 1.0,
) -> Tensor:
    """Log-probabilities [B, V] of the exact distribution of one RAS draw.

    With q the nucleus distribution, p the full softmax and R the set of repeated ids
    (count in the window >= threshold; every repeated id is in the window):

        P(y) = q(y) * [y not in R]  +  sum_{x in R, x != y} q(x) * p_{-x}(y)

    where p_{-x} is the full softmax with x forbidden (x drawn from the nucleus but
    repeated -> redraw from p_{-x}). p_{-x} is computed from the logits with x masked,
    which stays accurate even when p(x) is close to 1. Sampling from softmax of the
    result (temperature 1, no top-p/top-k) is distributed exactly like RAS. No
    data-dependent shapes, so it runs on the GPU without host syncs.
    """
    logits = logits.float()
    b, v = logits.shape
    q = nucleus_probs(logits, top_p, top_k)

    valid = windows >= 0
    ids = windows.clamp(min=0)
    counts = ((windows[:, :, None] == windows[:, None, :]) & valid[:, None, :]).sum(-1)
    repeated = valid & (counts.float() >= _as_column(repeat_threshold, b, logits))
    # Each repeated id must contribute once, however often it sits in the window.
    w = windows.shape[1]
    earlier = torch.ones(w, w, dtype=torch.bool, device=windows.device).tril(-1)
    seen_before = ((windows[:, :, None] == windows[:, None, :]) & earlier[None]).any(-1)
    contributes = repeated & ~seen_before  # [B, W]

    is_repeated = torch.zeros(b, v, device=logits.device).scatter_add_(
        -1, ids, repeated.float()
    ) > 0
    out = torch.where(is_repeated, 0.0, q)

    # Redraw term, one masked softmax per window slot: [B, W, V].
    masked = logits[:, None, :].expand(b, w, v).clone()
    masked.scatter_(-1, ids[:, :, None], float("-inf"))
    lse = torch.logsumexp(masked, dim=-1, keepdim=True)
    redraw = torch.exp(masked - lse).nan_to_num(0.0)  # p_{-x}(y); 0 at y = x
    weight = torch.where(contributes, q.gather(-1, ids), 0.0)  # q(x) per slot
    # If x held all the mass (lse = -inf) the redraw is impossible; RAS keeps x then.
    stuck = torch.isinf(lse.squeeze(-1))
    out = out + (weight[:, :, None] * redraw).sum(1)
    out = out.scatter_add(-1, ids, torch.where(stuck, weight, 0.0))
    return out.log()
