"""vLLM model class for the speech-head export: Qwen2 whose lm_head holds only the speech rows.

The unified export (`vllm_export.py`, head="unified") gives vLLM a stock Qwen2 whose
lm_head spans the whole unified vocabulary (158697 rows, 151936 of them zeros), so
every decode step multiplies by ~272 MB of rows that can never be chosen. With
head="speech" the export keeps embed_tokens over the unified vocabulary (prompts
still carry text ids) but writes only the 6761 speech rows of lm_head, and names
this class as the architecture. `compute_logits` projects onto those rows and
returns them inside a full-width row of -inf, because vLLM's sampler and batch
bookkeeping size their buffers by `config.vocab_size`.

CosyVoice2's `llm_decoder` has a bias. Its export sets `cosyvoice_head_bias: true`
in config.json, and the class then builds lm_head with a bias parameter (loaded
from `lm_head.bias` by vLLM's ordinary weight loader) and passes it to the logits
processor, which adds it after the projection. Without the key (CosyVoice3 exports)
the head has no bias and the logits are computed exactly as before.

vLLM finds the class through its general-plugin entry point
(`vllm.general_plugins`, see `register`), which it loads in every process it starts
(the API process and the spawned engine core). The entry point is declared in the
package metadata; `write_plugin_dist_info` writes the same metadata into a
directory on sys.path for runs from a source checkout (the GPU bench scripts).

vLLM is imported lazily: this module imports on CPU installs without vLLM.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

ARCHITECTURE = "CosyVoiceQwen2ForCausalLM"
CLASS_FQCN = "engine.backends.vllm_model:CosyVoiceQwen2ForCausalLM"
# config.json key holding the number of lm_head rows (the speech vocabulary).
HEAD_ROWS_KEY = "cosyvoice_head_rows"
# config.json key: true when lm_head has a bias (CosyVoice2's llm_decoder); absent = no bias.
HEAD_BIAS_KEY = "cosyvoice_head_bias"
PLUGIN_NAME = "cosyvoice_speech_head"
PLUGIN_TARGET = "engine.backends.vllm_model:register"


def register() -> None:
    """vLLM general plugin: make ARCHITECTURE resolvable (idempotent; runs once per process)."""
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        # By name, so importing this plugin never imports CUDA-touching code early.
        ModelRegistry.register_model(ARCHITECTURE, CLASS_FQCN)


def write_plugin_dist_info(site_dir: Path | str, version: str = "0.1") -> Path:
    """Write a minimal *.dist-info declaring the entry point into site_dir (on sys.path).

    Equivalent to installing the package with the entry point in its metadata;
    importlib.metadata discovers it in every process whose sys.path has site_dir.
    """
    d = Path(site_dir) / f"cosyvoice_vllm_plugin-{version}.dist-info"
    d.mkdir(parents=True, exist_ok=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: cosyvoice-vllm-plugin\nVersion: {version}\n")
    (d / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{PLUGIN_NAME} = {PLUGIN_TARGET}\n")
    return d


def _build_class() -> type:
    import torch
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
    from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
    from vllm.model_executor.models.utils import maybe_prefix

    class _CosyVoiceQwen2ForCausalLM(Qwen2ForCausalLM):  # type: ignore[misc,valid-type]
        """Qwen2ForCausalLM with an lm_head over the first `cosyvoice_head_rows` ids only,
        with a bias when config.json sets `cosyvoice_head_bias`."""

        def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            config = self.config
            rows = int(getattr(config, HEAD_ROWS_KEY))
            if not 0 < rows <= config.vocab_size:
                raise ValueError(f"{HEAD_ROWS_KEY}={rows} outside (0, {config.vocab_size}]")
            if config.tie_word_embeddings:
                raise ValueError("the speech-head export never ties embeddings")
            self.head_rows = rows
            self.full_vocab = int(config.vocab_size)
            # A real bool only: a stray string "false" must not switch the bias on.
            bias = getattr(config, HEAD_BIAS_KEY, False) is True
            # Replaces the full-vocabulary head built by the parent (freed before loading).
            self.lm_head = ParallelLMHead(rows, config.hidden_size, bias=bias, quant_config=self.quant_config,
                                          prefix=maybe_prefix(prefix, "lm_head"))
            self.logits_processor = LogitsProcessor(rows)

        def load_weights(self, weights: Any) -> set[str]:
            loaded = super().load_weights(weights)
            # vLLM's unloaded-weights check skips layers with a quant method (lm_head
            # included), so a bias missing from the file would stay uninitialised memory.
            if getattr(self.lm_head, "bias", None) is not None and "lm_head.bias" not in loaded:
                raise ValueError(f"config.json sets {HEAD_BIAS_KEY} but the checkpoint has no lm_head.bias")
            return loaded

        def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
            # lm_head.bias is None without the config key: then exactly the unbiased call.
            speech = self.logits_processor(self.lm_head, hidden_states, self.lm_head.bias)
            if speech is None:  # non-last pipeline rank
                return None
            # Ids past the head (text ids; CosyVoice2's sos/task_id rows) are never generated: -inf.
            full = speech.new_full((*speech.shape[:-1], self.full_vocab), float("-inf"))
            full[..., : self.head_rows] = speech
            return full

    _CosyVoiceQwen2ForCausalLM.__name__ = ARCHITECTURE
    _CosyVoiceQwen2ForCausalLM.__qualname__ = ARCHITECTURE
    return _CosyVoiceQwen2ForCausalLM


def __getattr__(name: str) -> Any:
    # The class exists only where vLLM is importable; built on first access
    # (vLLM's registry imports `CLASS_FQCN` lazily, inside its own processes).
    if name == ARCHITECTURE:
        cls = _build_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
