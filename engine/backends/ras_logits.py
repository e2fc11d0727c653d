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

Text-in streaming (bistream) sends one resumable vLLM request per utterance, one
input chunk per run, each chunk with its own args. vLLM 0.26 hands a new chunk to
the processors as a *re-added* row: the worker removes the request from the
persistent batch and adds it again with the chunk's SamplingParams, the whole
context so far as prompt ids and a fresh (emptied) output list
(gpu_model_runner.py `_update_streaming_request`). Because a wrong forced id would
be wrong audio, each chunk's args also say what the processor must observe when the
chunk arrives (`context_len`, the fill position implied by the context); any
mismatch -- params of an older chunk, a stop token left in the context by async
scheduling, outputs restarting without a re-add -- makes the row draw only
`desync_id`, which ends the chunk and makes the client raise.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from engine.compile_errors import is_compile_error
from engine.device_copy import tensor_on

EXTRA_KEY = "cosyvoice"
_NEG_INF = float("-inf")
log = logging.getLogger(__name__)
# The compiler backend for `ras_log_probs` in vLLM's engine core ("inductor"), set in the
# environment it starts with (`VLLMBackend`, `engine.vllm_compile_sampling`); unset: eager.
COMPILE_ENV = "COSYVOICE_RAS_COMPILE"
# The CosyVoice defaults the compiled function is warmed up for at engine start (others
# compile on first use): top_p, top_k, win_size * tau_r, and the speech vocabulary's width.
_WARM_ARGS = (0.8, 25, 10 * 0.1, 6761)


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
    # Checks of a bistream chunk against what the processor observes (-1/0 = off):
    # the number of prompt ids the chunk must arrive with (the whole context so far),
    # the block size that fixes where fill falls given that context, and the id the
    # row is forced to when a check fails.
    context_len: int = -1
    fill_period: int = 0
    desync_id: int = -1

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


def ras_probs(logits: torch.Tensor, windows: torch.Tensor, top_p: torch.Tensor | float, top_k: torch.Tensor | int,
              thresholds: torch.Tensor | float, k_max: int | None = None) -> torch.Tensor:
    """The exact RAS output distribution for a batch of rows.

    logits:     [B, V] float32, masks already applied (-inf).
    windows:    [B, W] int64, the last W generated tokens of each row, -1 = empty slot.
    top_p:      [B] float32; top_k: [B] int64, the nucleus size limit of each row.
    thresholds: [B] float32, win_size * tau_r per row.
    (Each of the three may be one Python number for all rows: fewer operators per step,
    the same result.)
    k_max:      max(top_k) if the caller knows it on the host (saves a GPU->CPU sync).
    Returns P as [B, V] float32 (rows sum to 1).
    """
    def per_row(v: torch.Tensor | float) -> torch.Tensor | float:
        return v[:, None] if isinstance(v, torch.Tensor) else v

    # Each operator below costs vLLM's engine core ~30-50 us of host time a decode step
    # (round 33 of docs/benchmarks.md), so none is spent on what cannot change the result.
    p = (logits if logits.dtype == torch.float32 else logits.float()).softmax(dim=-1)
    if k_max is None:
        k_max = int(top_k.max()) if isinstance(top_k, torch.Tensor) else int(top_k)
    k = min(int(k_max), p.shape[-1])
    # The official code sorts stably (ties -> lower id first); topk's tie order is
    # unspecified, which only matters for exactly equal probabilities.
    top_val, top_idx = p.topk(k, dim=-1, sorted=True)
    cum_before = top_val.cumsum(dim=-1) - top_val
    in_nucleus = cum_before < per_row(top_p)
    if isinstance(top_k, torch.Tensor):  # one number for all rows: topk(k) is the limit already
        in_nucleus &= torch.arange(k, device=p.device)[None, :] < top_k[:, None]
    # An id of probability 0 (masked) that stands in the nucleus (rounding, top_p 1) adds
    # nothing: its q and its weight below are 0.
    q_top = torch.where(in_nucleus, top_val, 0.0)
    total = q_top.sum(dim=-1, keepdim=True)
    if not (isinstance(top_p, float) and top_p > 0):  # else the likeliest id is in: total > 0
        total = total.clamp_min(torch.finfo(torch.float32).tiny)
    q_top = q_top / total

    counts = (windows[:, None, :] == top_idx[:, :, None]).sum(dim=-1)  # [B, K]
    one_minus = 1.0 - top_val
    # If x holds all the mass, resampling without x is undefined (the official code
    # would hit an all -inf softmax); keep x then. (Where it holds it, the division below
    # is not taken.)
    repeated = in_nucleus & (counts >= per_row(thresholds)) & (one_minus > 1e-6)
    weight = torch.where(repeated, q_top / one_minus, 0.0)
    c = weight.sum(dim=-1, keepdim=True)  # [B, 1]

    out = p * c  # resample branch, spread over every id ...
    # ... except that a repeated x never resamples itself (-p(x) w(x)), and a kept x adds
    # q(x): both are q(x) - w(x), as w(x) = q(x) / (1 - p(x)) is 0 for a kept x.
    out.scatter_add_(1, top_idx, q_top - weight)
    return out.clamp_min_(0.0)


def ras_log_probs(logits: torch.Tensor, windows: torch.Tensor, top_p: float, top_k: int, thresholds: float,
                  k_max: int) -> torch.Tensor:
    """log of `ras_probs` with one set of parameters for every row: the decode step's usual
    batch, and the function `RASBatchState` compiles. Eager, its operators (~30 in round 33,
    ~20 since round 34) cost vLLM's engine core ~30-50 us of host time each at one stream
    (docs/benchmarks.md); compiled they are a few fused kernels."""
    return ras_probs(logits, windows, top_p, top_k, thresholds, k_max=k_max).log()


def expected_fill_at(prompt_ids: Sequence[int], speech_token_size: int, period: int) -> int:
    """Where a streaming bistream chunk must draw fill, from its context alone.

    A fill closes a speech block of `period` tokens that starts after the last text
    token; the speech ids at the end of the context (the voice prompt's last partial
    block, or none after a fresh text block) count towards it. A full trailing block
    does not close it (the official `next_fill_index` then asks for a whole new
    block), hence the modulo. Equals `BistreamState`'s `Run.fill_at` for every layout.
    """
    trailing = 0
    for t in reversed(prompt_ids):
        if not 0 <= int(t) < speech_token_size:
            break
        trailing += 1
    return period - trailing % period


def chunk_mismatch(args: RASArgs, prompt_ids: Sequence[int] | None) -> str | None:
    """Why a chunk's args do not fit the context it arrived with (None: they fit)."""
    if prompt_ids is None or args.context_len < 0:
        return None
    if len(prompt_ids) != args.context_len:
        return (f"chunk arrived with {len(prompt_ids)} context ids, its params expect {args.context_len} "
                "(params of another chunk, or a sampled stop id kept in the context)")
    if args.fill_period > 0 and args.force_at >= 0:
        want = expected_fill_at(prompt_ids, args.speech_token_size, args.fill_period)
        if want != args.force_at:
            return f"chunk forces fill at {args.force_at}, its context implies {want}"
    return None


@dataclass
class _Row:
    args: RASArgs
    output_ids: Sequence[int]  # a live reference: vLLM appends to it every step
    desync: str | None = None  # set once a check fails; the row then only draws desync_id
    seen: int = 0  # len(output_ids) at the last step: it never shrinks within one chunk


class RASBatchState:
    """Tracks which batch rows carry CosyVoice requests and transforms their logits.

    Mirrors vLLM v1's persistent-batch protocol (vllm/v1/sample/logits_processor/
    interface.py `BatchUpdate`): before a step, added = (index, params, prompt_ids,
    output_ids), removed = [index], moved = (a, b, swap?), applied in the order
    removed, added, moved (an added row may take a removed row's index).
    """

    def __init__(self, shortcuts: bool = True, compile_backend: str | None = None) -> None:
        self.rows: dict[int, _Row] = {}
        self.shortcuts = shortcuts  # see `apply`
        self._log_probs: Any = ras_log_probs
        if compile_backend:
            # Dynamic: one graph for every batch size; it compiles on its first call (`warm`).
            self._log_probs = torch.compile(ras_log_probs, dynamic=True, fullgraph=True, backend=compile_backend)

    def warm(self, device: torch.device, row_width: int | None = None) -> None:
        """Compile ahead for the CosyVoice defaults, so that the first request does not
        wait for the compiler: one row and two (a dynamic graph serves every count above
        one), each a view of rows `row_width` wide as vLLM's logits are."""
        top_p, top_k, thr, width = _WARM_ARGS
        for rows in (1, 2):
            logits = torch.randn(rows, max(width, row_width or width), device=device)[:, :width]
            windows = torch.full((rows, 10), -1, dtype=torch.long, device=device)
            self._run_log_probs(logits, windows, top_p, top_k, thr, top_k)

    def _run_log_probs(self, rows: torch.Tensor, win: torch.Tensor, top_p: float, top_k: int, thr: float,
                       k_max: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """`ras_log_probs` of `rows`, compiled or not; written into `out` when given (eager:
        the log itself writes it, one copy fewer)."""
        if self._log_probs is ras_log_probs:
            probs = ras_probs(rows, win, top_p, top_k, thr, k_max=k_max)
            return torch.log(probs, out=out) if out is not None else probs.log_()
        try:
            result = self._log_probs(rows, win, top_p, top_k, thr, k_max)
        except Exception as exc:
            if not is_compile_error(exc):
                raise
            log.exception("torch.compile of the RAS sampler failed; it runs eagerly")
            self._log_probs = ras_log_probs
            return self._run_log_probs(rows, win, top_p, top_k, thr, k_max, out)
        return out.copy_(result) if out is not None else result

    def update(self, added: Sequence[tuple[int, Any, Any, Sequence[int]]], removed: Sequence[int],
               moved: Sequence[tuple[int, int, bool]]) -> None:
        for index in removed:
            self.rows.pop(index, None)
        for index, params, prompt, output_ids in added:
            args = RASArgs.from_extra(getattr(params, "extra_args", None))
            if args is None:
                self.rows.pop(index, None)  # the slot now holds a foreign request
                continue
            row = _Row(args, output_ids, seen=len(output_ids))
            row.desync = chunk_mismatch(args, prompt)
            if row.desync is not None:
                log.error("CosyVoice bistream desync at batch row %d: %s", index, row.desync)
            self.rows[index] = row
        for a, b, swap in moved:
            ra, rb = self.rows.pop(a, None), self.rows.pop(b, None)
            if ra is not None:
                self.rows[b] = ra
            if swap and rb is not None:
                self.rows[a] = rb

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Mask and transform the CosyVoice rows of `logits` (in place; returned).

        Runs once per decode step on vLLM's critical path, where the host's operator count
        is its cost at small batches (`bench.dispatch_count`). So the usual batch takes the
        short ways: rows 0..n-1 all CosyVoice (slices, no index tensors), one stop-mask
        state for all rows, and one set of RAS parameters for all rows (Python numbers).
        `shortcuts=False` (tests) takes the general way everywhere; the logits are the same."""
        if not self.rows:
            return logits
        items = sorted(self.rows.items())
        n, dev = len(items), logits.device
        first = items[0][1].args
        speech_size, speech_vocab = first.speech_token_size, first.speech_vocab_size
        # All CosyVoice requests share one vocabulary layout (one exported model).
        dense = self.shortcuts and items[-1][0] == n - 1  # the CosyVoice rows are rows 0..n-1
        idx = None if dense else tensor_on([i for i, _ in items], torch.long, dev)
        view = logits[:n, :speech_vocab]  # slice first: 6761 of 158697 columns
        rows = view if dense else logits[:, :speech_vocab].index_select(0, idx)
        if rows.dtype != torch.float32:
            rows = rows.float()

        stops = [r.args.mask_stops or len(r.output_ids) < r.args.min_tokens for _, r in items]
        keep = [(n_, r.args.keep_id) for n_, (_, r) in enumerate(items) if r.args.keep_id >= 0]
        kept = [rows[n_, k].clone() for n_, k in keep]  # bistream: fill survives the stop mask
        if self.shortcuts and all(stops):
            rows[:, speech_size:] = _NEG_INF
        elif not self.shortcuts or any(stops):
            stop_mask = tensor_on(stops, torch.bool, dev)
            rows[:, speech_size:] = rows[:, speech_size:].masked_fill(stop_mask[:, None], _NEG_INF)
        for (n_, k), v in zip(keep, kept):
            rows[n_, k] = v

        ras_pos = [n_ for n_, (_, r) in enumerate(items) if not r.args.greedy]
        if ras_pos:
            self._ras(rows, [items[n_][1] for n_ in ras_pos], ras_pos, n, dev)

        for n_, (_, r) in enumerate(items):
            produced = len(r.output_ids)
            if r.desync is None and produced < r.seen and r.args.context_len >= 0:
                # Outputs restarted without a re-add: a new chunk began but its params
                # never reached this processor.
                r.desync = f"outputs went back from {r.seen} to {produced} without new chunk params"
                log.error("CosyVoice bistream desync: %s", r.desync)
            r.seen = produced
            if r.desync is not None and r.args.desync_id >= 0:
                rows[n_] = _NEG_INF
                rows[n_, r.args.desync_id] = 0.0
            elif r.args.force_at >= 0 and produced == r.args.force_at:
                rows[n_] = _NEG_INF
                rows[n_, r.args.force_id] = 0.0

        text_columns = logits.shape[1] > speech_vocab  # none with the speech-only head
        if dense:
            if rows.data_ptr() != view.data_ptr():  # logits not float32: `rows` is a copy
                view.copy_(rows)
            if text_columns:
                logits[:n, speech_vocab:] = _NEG_INF
        else:
            logits[idx, :speech_vocab] = rows.to(logits.dtype)
            if text_columns:
                logits[idx, speech_vocab:] = _NEG_INF
        return logits

    def _ras(self, rows: torch.Tensor, sub: list[_Row], positions: list[int], n: int, dev: torch.device) -> None:
        """Replace `rows[positions]` by the log of their RAS distribution."""
        width = max(r.args.win_size for r in sub)
        win_rows = []
        for r in sub:
            seen = [*r.args.history, *r.output_ids] if r.args.history else r.output_ids
            recent = [int(t) for t in seen[-r.args.win_size:]] if r.args.win_size > 0 else []
            win_rows.append(recent + [-1] * (max(width, 1) - len(recent)))
        win = tensor_on(win_rows, torch.long, dev)
        a = sub[0].args
        top_p: torch.Tensor | float
        top_k: torch.Tensor | int
        thr: torch.Tensor | float
        if self.shortcuts and all((r.args.top_p, r.args.top_k, r.args.win_size, r.args.tau_r)
                                  == (a.top_p, a.top_k, a.win_size, a.tau_r) for r in sub):
            top_p, top_k, thr = a.top_p, a.top_k, a.win_size * a.tau_r
        else:
            top_p = tensor_on([r.args.top_p for r in sub], torch.float32, dev)
            thr = tensor_on([r.args.win_size * r.args.tau_r for r in sub], torch.float32, dev)
            top_k = tensor_on([r.args.top_k for r in sub], torch.long, dev)
        k_max = max(r.args.top_k for r in sub)
        if self.shortcuts and len(positions) == n and not isinstance(top_p, torch.Tensor):
            self._run_log_probs(rows, win, top_p, top_k, thr, k_max, out=rows)  # type: ignore[arg-type]
            return
        sel = tensor_on(positions, torch.long, dev)
        probs = ras_probs(rows.index_select(0, sel), win, top_p, top_k, thr, k_max=k_max)
        rows.index_copy_(0, sel, probs.log())


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
            backend = os.environ.get(COMPILE_ENV) or None
            self.state = RASBatchState(compile_backend=backend)
            if backend and device.type == "cuda":
                model = getattr(vllm_config, "model_config", None)
                self.state.warm(device, model.get_vocab_size() if model is not None else None)

        def is_argmax_invariant(self) -> bool:
            return False

        def update_state(self, batch_update: "_BatchUpdate | None") -> None:
            if batch_update is None:
                return
            moved = [(a, b, d == _MoveDir.SWAP) for a, b, d in batch_update.moved]
            self.state.update(batch_update.added, batch_update.removed, moved)

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            return self.state.apply(logits)
