"""Turn the CosyVoice LM into a plain HF Qwen2 directory that vLLM loads.

vLLM knows `Qwen2ForCausalLM`, so instead of registering a custom model we rewrite
the checkpoint over the *unified vocabulary* (`engine.models.vocab.UnifiedVocab`).
CosyVoice3 (`CosyVoice3LM`):

    embed_tokens[0:6761)        = speech_embedding      (speech codes + sos/eos/task/fill/...)
    embed_tokens[6761:158697)   = Qwen2 embed_tokens    (text ids, shifted by text_offset)
    lm_head[0:6761)             = llm_decoder           (the speech head, no bias in CV3)
    lm_head[6761:158697)        = 0                     (text ids are masked to -inf anyway)

CosyVoice2 (`Qwen2LM`) keeps sos/task_id in a separate 2-row `llm_embedding` and its
`llm_decoder` has a bias:

    embed_tokens[0:6564)        = speech_embedding      (6561 codes + eos 6561, 6562, fill 6563)
    embed_tokens[6564:6566)     = llm_embedding         (sos 6564, task_id 6565: prompt-only rows)
    embed_tokens[6566:158502)   = Qwen2 embed_tokens
    lm_head[0:6564)             = llm_decoder.weight
    lm_head.bias[0:6564)        = llm_decoder.bias

With head="speech" lm_head keeps only the speech rows and config.json names our
`CosyVoiceQwen2ForCausalLM` (`vllm_model.py`, a vLLM plugin), which projects onto those
rows (adding the bias when config.json says so) and fills the other columns with
-inf: the same logits without reading 151936 zero rows every decode step.
head="unified" needs nothing but stock vLLM, which is why it cannot serve CosyVoice2:
stock Qwen2ForCausalLM has no lm_head bias, and vLLM's weight loader silently skips
unexpected `.bias` tensors, so the export refuses instead of decoding with a
different head.

Prompts are then plain token ids (no `prompt_embeds`), which keeps vLLM's prefix
caching, its fast prompt path and, later, streaming input.

vLLM pads the vocabulary itself (VocabParallelEmbedding / ParallelLMHead round the
row count up to a multiple of 64 and slice the logits back to `vocab_size`), so the
export keeps the exact unified size and no pad rows exist for the sampler to pick.

The tensors are written as safetensors by a small writer here (the format is one
JSON header plus raw little-endian bytes), so the CPU install needs no extra
package. The export is cached beside the model in `<model_dir>/vllm-unified/` and is
redone whenever the fingerprint of `llm.pt` (or the export format) changes.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Literal, Mapping

import torch

from engine.models.config import LMConfig, Qwen2Config
from engine.models.vocab import UnifiedVocab

HeadKind = Literal["unified", "speech"]

# Bump when the layout of the exported directory changes: old caches re-export.
EXPORT_FORMAT_VERSION = 1
EXPORT_SUBDIR = "vllm-unified"
SPEECH_HEAD_SUBDIR = "vllm-speech-head"
WEIGHTS_FILE = "model.safetensors"
META_FILE = "cosyvoice_export.json"

# Official llm.pt key prefixes (see shared/reference/cosyvoice3/llm_keys.txt).
_QWEN_PREFIX = "llm.model.model."
_SPEECH_EMB = "speech_embedding.weight"
_SPEECH_HEAD = "llm_decoder.weight"
_TEXT_EMB = _QWEN_PREFIX + "embed_tokens.weight"
# CosyVoice2 only (shared/reference: official cosyvoice/llm/llm.py, Qwen2LM).
_PROMPT_EMB = "llm_embedding.weight"  # [2, hidden]: sos, task_id
_SPEECH_HEAD_BIAS = "llm_decoder.bias"
# The Qwen2 text head is never used by CosyVoice (speech comes from llm_decoder).
_UNUSED = ("llm.model.lm_head.weight",)

_ST_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
}
_ST_DTYPES_INV = {v: k for k, v in _ST_DTYPES.items()}


@dataclass(frozen=True)
class ExportInfo:
    """What `export_unified_qwen2` wrote (also stored as META_FILE)."""

    path: Path
    fingerprint: str
    vocab_size: int
    speech_vocab_size: int
    speech_token_size: int
    text_offset: int
    dtype: str
    head: str = "unified"
    head_rows: int = 0  # rows of lm_head in the export
    head_bias: bool = False  # lm_head.bias written (CosyVoice2)


# ---------------------------------------------------------------- safetensors I/O


def write_safetensors(path: Path, tensors: Iterable[tuple[str, torch.Tensor]],
                      metadata: Mapping[str, str] | None = None) -> None:
    """Write tensors in the safetensors layout, streaming one tensor at a time.

    Only the header needs all shapes up front; the data is then appended tensor by
    tensor so a 1 GB export never holds a second full copy in memory.
    """
    items = [(name, t.detach()) for name, t in tensors]
    header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for name, t in items:
        if t.dtype not in _ST_DTYPES:
            raise TypeError(f"{name}: dtype {t.dtype} not supported by the writer")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the spec asks for 8-byte aligned data
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, t in items:
            # A uint8 view of the contiguous CPU tensor is its little-endian bytes
            # (every supported target is little-endian); works for bf16 too.
            f.write(t.to("cpu").contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    os.replace(tmp, path)


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Read a safetensors file written by anyone (used by tests and checks)."""
    data = Path(path).read_bytes()
    (hlen,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + hlen])
    base = 8 + hlen
    out: dict[str, torch.Tensor] = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        start, end = spec["data_offsets"]
        dtype = _ST_DTYPES_INV[spec["dtype"]]
        buf = bytearray(data[base + start:base + end])
        t = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
        out[name] = t.view(dtype).reshape(spec["shape"])
    return out


# ---------------------------------------------------------------- the export


def has_head_bias(state: Mapping[str, torch.Tensor]) -> bool:
    """True for a CosyVoice2 checkpoint: its `llm_decoder` is a Linear with bias."""
    return _SPEECH_HEAD_BIAS in state


def unified_tensors(state: Mapping[str, torch.Tensor], vocab: UnifiedVocab,
                    dtype: torch.dtype, head: HeadKind = "unified") -> list[tuple[str, torch.Tensor]]:
    """Map an official CosyVoice3 or CosyVoice2 LM state dict to HF Qwen2 names over the
    unified vocab.

    head="unified": lm_head has vocab.size rows (text rows zero); head="speech": only
    the speech rows (for `vllm_model.CosyVoiceQwen2ForCausalLM`), plus lm_head.bias when
    the checkpoint's llm_decoder has one (CosyVoice2; speech head only)."""
    if head not in ("unified", "speech"):
        raise ValueError(f"unknown head kind {head!r}")
    for key in (_SPEECH_EMB, _SPEECH_HEAD, _TEXT_EMB):
        if key not in state:
            raise KeyError(f"state dict lacks {key!r}: not a CosyVoice LM checkpoint?")
    speech_emb, speech_head, text_emb = state[_SPEECH_EMB], state[_SPEECH_HEAD], state[_TEXT_EMB]
    if speech_emb.shape[0] != vocab.speech_vocab_size or speech_head.shape[0] != vocab.speech_vocab_size:
        raise ValueError(f"speech tables have {speech_emb.shape[0]}/{speech_head.shape[0]} rows, "
                         f"vocab expects {vocab.speech_vocab_size}")
    if text_emb.shape[0] != vocab.text_vocab_size:
        raise ValueError(f"embed_tokens has {text_emb.shape[0]} rows, vocab expects {vocab.text_vocab_size}")
    hidden = text_emb.shape[1]

    # Prompt-only rows between speech and text (CosyVoice2's llm_embedding: sos, task_id).
    tables = [speech_emb]
    if vocab.extra_rows:
        prompt_emb = state.get(_PROMPT_EMB)
        if prompt_emb is None or prompt_emb.shape[0] != vocab.extra_rows:
            rows = None if prompt_emb is None else prompt_emb.shape[0]
            raise ValueError(f"vocab has {vocab.extra_rows} prompt rows but {_PROMPT_EMB} has {rows}")
        tables.append(prompt_emb)
    elif _PROMPT_EMB in state:
        raise ValueError(f"{_PROMPT_EMB} present but the vocab has no rows for it (a CosyVoice2 "
                         "checkpoint with a CosyVoice3 vocab?)")
    tables.append(text_emb)

    bias = state.get(_SPEECH_HEAD_BIAS)
    if bias is not None:
        if head != "speech":
            raise ValueError("this LM's llm_decoder has a bias (CosyVoice2): stock vLLM Qwen2 has no "
                             "lm_head bias and would silently skip it, so export head='speech' (the "
                             "CosyVoiceQwen2ForCausalLM plugin, which applies it)")
        if bias.shape != (vocab.speech_vocab_size,):
            raise ValueError(f"{_SPEECH_HEAD_BIAS} has shape {tuple(bias.shape)}, "
                             f"expected ({vocab.speech_vocab_size},)")

    embed = torch.cat([t.to(dtype) for t in tables], dim=0)
    if head == "speech":
        head_w = speech_head.to(dtype)
    else:
        head_w = torch.zeros(vocab.size, hidden, dtype=dtype)
        head_w[: vocab.speech_vocab_size] = speech_head.to(dtype)

    out: list[tuple[str, torch.Tensor]] = [("model.embed_tokens.weight", embed)]
    for key in sorted(state):
        if not key.startswith(_QWEN_PREFIX) or key == _TEXT_EMB:
            continue
        out.append(("model." + key[len(_QWEN_PREFIX):], state[key].to(dtype)))
    out.append(("lm_head.weight", head_w))
    if bias is not None:
        out.append(("lm_head.bias", bias.to(dtype)))
    known = {_SPEECH_EMB, _SPEECH_HEAD, _PROMPT_EMB, _SPEECH_HEAD_BIAS, *_UNUSED}
    stray = [k for k in state if not k.startswith(_QWEN_PREFIX) and k not in known]
    if stray:
        raise KeyError(f"unexpected keys in the LM state dict: {stray[:5]}")
    return out


def hf_config(qwen: Qwen2Config, lm: LMConfig, vocab: UnifiedVocab, dtype: torch.dtype,
              head: HeadKind = "unified", head_bias: bool = False) -> dict[str, object]:
    """The config.json vLLM reads: a Qwen2 over the unified vocabulary (stock class for
    head="unified", the speech-head plugin class for head="speech"; `head_bias` adds
    the key that makes the plugin build its lm_head with a bias)."""
    if head_bias and head != "speech":
        raise ValueError("an lm_head bias needs head='speech' (stock vLLM Qwen2 has none)")
    cfg = dict(qwen.to_hf_json())
    dname = str(dtype).removeprefix("torch.")
    cfg.update(
        vocab_size=vocab.size,
        # sos/eos of the LM in unified ids. vLLM only uses eos when a request does
        # not set ignore_eos; our stop ids (all >= speech_token_size) cover it anyway.
        bos_token_id=lm.sos,
        eos_token_id=lm.eos,
        torch_dtype=dname,
        dtype=dname,
        # transformers 5 reads rope settings from rope_parameters; 4.x from rope_theta.
        rope_parameters={"rope_type": "default", "rope_theta": qwen.rope_theta},
    )
    if head == "speech":
        from engine.backends.vllm_model import ARCHITECTURE, HEAD_BIAS_KEY, HEAD_ROWS_KEY

        cfg["architectures"] = [ARCHITECTURE]
        cfg[HEAD_ROWS_KEY] = vocab.speech_vocab_size
        if head_bias:  # absent for CosyVoice3, whose config stays as it was
            cfg[HEAD_BIAS_KEY] = True
    return cfg


def export_unified_qwen2(state: Mapping[str, torch.Tensor], qwen: Qwen2Config, lm: LMConfig,
                         vocab: UnifiedVocab, out_dir: Path, *, dtype: torch.dtype = torch.bfloat16,
                         fingerprint: str = "", head: HeadKind = "unified") -> ExportInfo:
    """Write config.json + model.safetensors (+ our metadata) into out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # Metadata goes last: its presence (with the right fingerprint) marks a complete export.
    (out_dir / META_FILE).unlink(missing_ok=True)
    tensors = unified_tensors(state, vocab, dtype, head)
    bias = has_head_bias(state)
    write_safetensors(out_dir / WEIGHTS_FILE, tensors)
    del tensors
    (out_dir / "config.json").write_text(json.dumps(hf_config(qwen, lm, vocab, dtype, head, bias), indent=2))
    (out_dir / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": lm.sos, "eos_token_id": lm.eos}, indent=2))
    info = ExportInfo(path=out_dir, fingerprint=fingerprint, vocab_size=vocab.size,
                      speech_vocab_size=vocab.speech_vocab_size,
                      speech_token_size=vocab.speech_token_size,
                      text_offset=vocab.text_offset, dtype=str(dtype).removeprefix("torch."), head=head,
                      head_rows=vocab.speech_vocab_size if head == "speech" else vocab.size,
                      head_bias=bias)
    meta = {**info.__dict__, "path": str(out_dir), "format_version": EXPORT_FORMAT_VERSION}
    (out_dir / META_FILE).write_text(json.dumps(meta, indent=2))
    return info


def export_from_module(lm_module: torch.nn.Module, qwen: Qwen2Config, lm: LMConfig, vocab: UnifiedVocab,
                       out_dir: Path, *, dtype: torch.dtype = torch.bfloat16,
                       fingerprint: str = "", head: HeadKind = "unified") -> ExportInfo:
    """Export a loaded CosyVoice3LM or CosyVoice2 Qwen2LM (parameter names equal the official ones)."""
    state = {k: v.detach() for k, v in lm_module.state_dict().items()}
    return export_unified_qwen2(state, qwen, lm, vocab, out_dir, dtype=dtype, fingerprint=fingerprint, head=head)


# ---------------------------------------------------------------- cache beside the model


def file_fingerprint(path: Path, chunk: int = 1 << 24) -> str:
    """sha256 of the checkpoint plus the export format (a 2 GB llm.pt hashes in ~2 s)."""
    h = hashlib.sha256(f"cosyvoice-vllm-export-v{EXPORT_FORMAT_VERSION}".encode())
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()[:32]


def read_export_info(export_dir: Path) -> dict[str, object] | None:
    meta = Path(export_dir) / META_FILE
    if not meta.is_file() or not (Path(export_dir) / WEIGHTS_FILE).is_file():
        return None
    try:
        return json.loads(meta.read_text())
    except json.JSONDecodeError:
        return None


def speech_head_plugin_installed() -> bool:
    """True when vLLM will find `CosyVoiceQwen2ForCausalLM`: our general-plugin entry
    point is in the installed metadata (pyproject's entry point, or the dist-info that
    `vllm_model.write_plugin_dist_info` writes for source-checkout runs)."""
    from importlib.metadata import entry_points

    from engine.backends.vllm_model import PLUGIN_TARGET

    return any(ep.value == PLUGIN_TARGET for ep in entry_points(group="vllm.general_plugins"))


# Beside the checkpoint: held while an export is checked and written (`ensure_vllm_export`).
EXPORT_LOCK_FILE = ".vllm-export.lock"


def ensure_vllm_export(model_dir: Path, qwen: Qwen2Config, lm: LMConfig, vocab: UnifiedVocab, *,
                       dtype: torch.dtype = torch.bfloat16, checkpoint: str = "llm.pt",
                       head: HeadKind | Literal["auto"] = "auto") -> Path:
    """Return `<model_dir>/vllm-unified` (head="speech": `vllm-speech-head`),
    (re-)exporting it if llm.pt, the dtype or the head kind changed.

    head="auto" picks the speech-only head (measured +24% decode tokens/s at 1 stream,
    +41% at 64 on the H200) when its vLLM plugin is installed, else the unified head,
    which stock vLLM loads as is. A CosyVoice2 checkpoint (llm_decoder with bias) has
    only the speech head: without the plugin it fails here with the fix in the message."""
    auto = head == "auto"
    if head == "auto":
        head = "speech" if speech_head_plugin_installed() else "unified"
    model_dir = Path(model_dir)
    ckpt = model_dir / checkpoint
    out = model_dir / (SPEECH_HEAD_SUBDIR if head == "speech" else EXPORT_SUBDIR)
    fp = file_fingerprint(ckpt)
    # Gateways that share a model directory (one per GPU, replicas on one volume) start
    # together: one exports while the others wait, then find its export complete.
    with open(model_dir / EXPORT_LOCK_FILE, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return _export_unless_current(ckpt, out, fp, qwen, lm, vocab, dtype, head, auto)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _export_unless_current(ckpt: Path, out: Path, fp: str, qwen: Qwen2Config, lm: LMConfig, vocab: UnifiedVocab,
                           dtype: torch.dtype, head: HeadKind, auto: bool) -> Path:
    meta = read_export_info(out)
    if (meta is not None and meta.get("fingerprint") == fp and meta.get("vocab_size") == vocab.size
            and meta.get("dtype") == str(dtype).removeprefix("torch.") and meta.get("head", "unified") == head):
        return out
    if out.exists():
        shutil.rmtree(out)
    # mmap keeps the 2 GB fp32 checkpoint out of RAM until each tensor is converted.
    state = torch.load(ckpt, map_location="cpu", weights_only=True, mmap=True)
    if has_head_bias(state) and head != "speech":
        hint = ("the speech-head vLLM plugin is not installed: install this package (it declares the "
                "vllm.general_plugins entry point) or call vllm_model.write_plugin_dist_info(<dir on "
                "sys.path>)") if auto else "use head='speech'"
        raise ValueError(f"{ckpt}: llm_decoder has a bias (CosyVoice2), which only the speech-head "
                         f"export can carry; {hint}")
    export_unified_qwen2(state, qwen, lm, vocab, out, dtype=dtype, fingerprint=fp, head=head)
    return out
