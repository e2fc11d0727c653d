"""RAS (repetition-aware sampling) as a logits transform, for vLLM's batched sampler.

The official sampler (`ras_sampling` in CosyVoice's `cosyvoice/utils/common.py`)
draws x from the nucleus (top-p 0.8 AND top-k 25 of softmax, renormalised); if x
already occurs in the last `win_size` generated tokens at least `win_size * tau_r`
times it discards x and draws again from the *full* softmax with x removed. That is
a two-stage random process, but its output distribution has a closed form:

    q(x)  = nucleus probability of x (0 outside the nucleus N)
    R     = {x in N : x is repeated in the window}
    P(y)  = q(y) [y not in R]  +  p(y) * sum_{x in R, x != y} q(x) / (1 - p(x))

so writing log P(y) as the logits and letting vLLM sample plainly (temperature 1,
no top-k/top-p) draws from exactly RAS's distribution, one batched op per step.

Masks applied before the transform (and for greedy requests, alone):
  * text ids (>= speech_vocab_size of the unified vocab) are never generated;
  * stop ids ([speech_token_size, speech_vocab_size)) are masked while fewer than
    min_tokens tokens exist, and always for fixed-length requests.

The per-request parameters travel in `SamplingParams.extra_args[EXTRA_KEY]` so one
engine serves RAS, greedy and plain requests side by side. The batch bookkeeping
(`RASBatchState`) is plain torch so it is tested on CPU; the vLLM class at the bottom
only exists when vLLM is importable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

EXTRA_KEY = "cosyvoice"
_NEG_INF = float("-inf")


@dataclass(frozen=True)
class RASArgs:
    """Per-request sampling arguments, as carried in extra_args (a plain dict)."""

    speech_token_size: int  # first stop id (6561)
    speech_vocab_size: int  # first text id of the unified vocab (6761)
    greedy: bool = False
    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10
    tau_r: float = 0.1
    min_tokens: int = 0
    mask_stops: bool = False  # fixed-length requests: never stop
    # Text-in streaming (engine.bistream): each input chunk of a resumable vLLM request
    # carries its own args. `history` = tokens generated before this chunk (the RAS
    # window continues across chunks); `keep_id` = one reserved id the stop mask
    # leaves open (fill, "more text please"); at output index `force_at` of the chunk
    # only `force_id` may be drawn (the forced fill / the length-limit stop). -1 = off.
    history: tuple[int, ...] = ()
    keep_id: int = -1
    force_at: int = -1
    force_id: int = -1

    def to_extra(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["history"] = list(self.history)
        return {EXTRA_KEY: d}

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> "RASArgs | None":
        if not extra or EXTRA_KEY not in extra:
            return None
        d = dict(extra[EXTRA_KEY])
        d["history"] = tuple(d.get("history", ()))
        return cls(**d)


def ras_probs(logits: torch.Tensor, windows: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
              thresholds: torch.Tensor, k_max: int | None = None) -> torch.Tensor:
    """The exact RAS output distribution for a batch of rows.

    logits:     [B, V] float32, masks already applied (-inf).
    windows:    [B, W] int64, the last W generated tokens of each row, -1 = empty slot.
    top_p:      [B] float32; top_k: [B] int64, the nucleus size limit of each row.
    thresholds: [B] float32, win_size * tau_r per row.
    k_max:      max(top_k) if the caller knows it on the host (saves a GPU->CPU sync).
    Returns P as [B, V] float32 (rows sum to 1).
    """
    p = logits.float().softmax(dim=-1)
    k = min(int(top_k.max()) if k_max is None else int(k_max), p.shape[-1])
    # The official code sorts stably (ties -> lower id first); topk's tie order is
    # unspecified, which only matters for exactly equal probabilities.
    top_val, top_idx = p.topk(k, dim=-1, sorted=True)
    cum_before = top_val.cumsum(dim=-1) - top_val
    rank = torch.arange(k, device=p.device)
    in_nucleus = (cum_before < top_p[:, None]) & (rank[None, :] < top_k[:, None])
    # An id with probability 0 (masked) can never enter the nucleus.
    in_nucleus &= top_val > 0
    q_top = torch.where(in_nucleus, top_val, torch.zeros_like(top_val))
    q_top = q_top / q_top.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)

    counts = (windows[:, None, :] == top_idx[:, :, None]).sum(dim=-1).float()  # [B, K]
    one_minus = 1.0 - top_val
    # If x holds all the mass, resampling without x is undefined (the official code
    # would hit an all -inf softmax); keep x then.
    repeated = in_nucleus & (counts >= thresholds[:, None]) & (one_minus > 1e-6)
    weight = torch.where(repeated, q_top / one_minus.clamp_min(1e-6), torch.zeros_like(q_top))
    c = weight.sum(dim=-1, keepdim=True)  # [B, 1]

    out = p * c  # resample branch, spread over every id ...
    # ... except that a repeated x never resamples itself, and a kept x adds q(x).
    correction = torch.where(repeated, -top_val * weight, q_top)
    out.scatter_add_(1, top_idx, correction)
    return out.clamp_min_(0.0)


def _host_to(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host-built tensor on `device` without stalling the CPU.

    A plain copy from pageable memory makes the CPU wait for the GPU to drain its
    stream (PyTorch synchronizes), which undoes vLLM's overlap of step N+1's
    scheduling with step N's kernels. Pinned memory + non_blocking queues the copy
    in stream order instead; the caching host allocator keeps the buffer alive
    until the copy has run.
    """
    t = torch.tensor(data, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@dataclass
class _Row:
    args: RASArgs
    output_ids: Sequence[int]  # a live reference: vLLM appends to it every step


class RASBatchState:
    """Tracks which batch rows carry CosyVoice requests and transforms their logits.

    Mirrors vLLM v1's persistent-batch protocol: `update(added, removed, moved)` is
    called before each step with added = (index, params, prompt_ids, output_ids),
    removed = [index], moved = (a, b, swap?) in that order.
    """

    def __init__(self) -> None:
        self.rows: dict[int, _Row] = {}

    def update(self, added: Sequence[tuple[int, Any, Any, Sequence[int]]], removed: Sequence[int],
               moved: Sequence[tuple[int, int, bool]]) -> None:
        for index, params, _prompt, output_ids in added:
            args = RASArgs.from_extra(getattr(params, "extra_args", None))
            if args is None:
                self.rows.pop(index, None)  # the slot now holds a foreign request
            else:
                self.rows[index] = _Row(args, output_ids)
        for index in removed:
            self.rows.pop(index, None)
        for a, b, swap in moved:
            ra, rb = self.rows.pop(a, None), self.rows.pop(b, None)
            if ra is not None:
                self.rows[b] = ra
            if swap and rb is not None:
                self.rows[a] = rb

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        items = sorted(self.rows.items())
        dev = logits.device
        idx = _host_to([i for i, _ in items], torch.long, dev)
        first = items[0][1].args
        speech_size, speech_vocab = first.speech_token_size, first.speech_vocab_size
        # All CosyVoice requests share one vocabulary layout (one exported model).
        rows = logits[:, :speech_vocab].index_select(0, idx).float()  # slice first: 6761 of 158697 columns
        stop_mask = _host_to([r.args.mask_stops or len(r.output_ids) < r.args.min_tokens for _, r in items],
                             torch.bool, dev)
        keep = [(n, r.args.keep_id) for n, (_, r) in enumerate(items) if r.args.keep_id >= 0]
        kept = [rows[n, k].clone() for n, k in keep]  # bistream: fill survives the stop mask
        rows[:, speech_size:] = rows[:, speech_size:].masked_fill(stop_mask[:, None], _NEG_INF)
        for (n, k), v in zip(keep, kept):
            rows[n, k] = v

        ras_pos = [n for n, (_, r) in enumerate(items) if not r.args.greedy]
        if ras_pos:
            sub = [items[n][1] for n in ras_pos]
            width = max(r.args.win_size for r in sub)
            win_rows = []
            for r in sub:
                seen = [*r.args.history, *r.output_ids] if r.args.history else r.output_ids
                recent = [int(t) for t in seen[-r.args.win_size:]] if r.args.win_size > 0 else []
                win_rows.append(recent + [-1] * (max(width, 1) - len(recent)))
            win = _host_to(win_rows, torch.long, dev)
            top_p = _host_to([r.args.top_p for r in sub], torch.float32, dev)
            thr = _host_to([r.args.win_size * r.args.tau_r for r in sub], torch.float32, dev)
            top_k = _host_to([r.args.top_k for r in sub], torch.long, dev)
            sel = _host_to(ras_pos, torch.long, dev)
            sub_logits = rows.index_select(0, sel)
            probs = ras_probs(sub_logits, win, top_p, top_k, thr, k_max=max(r.args.top_k for r in sub))
            rows.index_copy_(0, sel, probs.log())

        for n, (_, r) in enumerate(items):
            if r.args.force_at >= 0 and len(r.output_ids) == r.args.force_at:
                rows[n] = _NEG_INF
                rows[n, r.args.force_id] = 0.0

        logits[idx, :speech_vocab] = rows.to(logits.dtype)
        logits[idx, speech_vocab:] = _NEG_INF
        return logits


try:  # the vLLM adapter; vLLM exists only on the GPU machines
    from vllm.v1.sample.logits_processor import BatchUpdate as _BatchUpdate
    from vllm.v1.sample.logits_processor import LogitsProcessor as _VLLMLogitsProcessor
    from vllm.v1.sample.logits_processor import MoveDirectionality as _MoveDir
except ImportError:  # pragma: no cover - CPU installs
    _VLLMLogitsProcessor = None

if _VLLMLogitsProcessor is not None:

    class CosyVoiceLogitsProcessor(_VLLMLogitsProcessor):  # type: ignore[misc,valid-type]
        """vLLM v1 batch-level logits processor running `RASBatchState`.

        Not argmax-invariant (the masks change the arg-max), so vLLM applies it to
        greedy rows too, before temperature and before its own top-k/top-p.
        """

        def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
            self.state = RASBatchState()

        def is_argmax_invariant(self) -> bool:
            return False

        def update_state(self, batch_update: "_BatchUpdate | None") -> None:
            if batch_update is None:
                return
            moved = [(a, b, d == _MoveDir.SWAP) for a, b, d in batch_update.moved]
            self.state.update(batch_update.added, batch_update.removed, moved)

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            return self.state.apply(logits)
