"""The two ONNX frontend models (speech tokenizer v3, CAM++) and their stand-ins.

Runners mirror the official frontend: inputs are addressed by *position* (the
official code never names them), output 0 is the result. Sessions are created once
per process and are safe to share: `InferenceSession.run` is thread-safe and holds
no per-request state.

Stand-ins are tiny deterministic graphs built with `onnx.helper` that keep the
official signatures, so the whole pipeline runs without the real files:

* speech tokenizer: feats [1, 128, T] f32, feats_length [1] i32 -> tokens [1, T//4]
  i64 in [0, 6561): 4x average pooling in time (100 Hz -> 25 Hz), per-frame mean
  removal, a random projection to 8 dims, FSQ rounding of tanh to 3 levels per dim,
  digits combined base 3 (3^8 = 6561 codes, like the real FSQ codebook).
* CAM++: input [1, T, 80] f32 -> output [1, 192] f32: per-bin RMS over time (the
  input is mean-normalised, so a plain mean would be ~0), then a random MLP.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

# Opset 17 / IR 8 load on every onnxruntime >= 1.14 (the GPU image may be older than
# the CPU one); nothing newer is needed for these graphs.
STANDIN_OPSET = 17
STANDIN_IR_VERSION = 8

SPEECH_TOKEN_SIZE = 6561  # 3 ** 8
FSQ_DIMS = 8
TOKEN_HOP = 4  # whisper mel frames (100 Hz) per speech token (25 Hz)
SPEAKER_DIM = 192


def _session(path: Path | str, prefer_gpu: bool) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # One intra-op thread, as the official frontend: many sessions share few cores.
    options.intra_op_num_threads = 1
    providers = ["CPUExecutionProvider"]
    if prefer_gpu and "CUDAExecutionProvider" in ort.get_available_providers():
        providers.insert(0, "CUDAExecutionProvider")
    return ort.InferenceSession(str(path), sess_options=options, providers=providers)


class SpeechTokenizer:
    """`speech_tokenizer_v3.onnx`: whisper log-mel [128, T] -> 25 Hz speech tokens."""

    def __init__(self, path: Path | str, prefer_gpu: bool = True) -> None:
        self.path = Path(path)
        self._session = _session(path, prefer_gpu)
        inputs = self._session.get_inputs()
        self._feat_name = inputs[0].name
        self._len_name = inputs[1].name

    def __call__(self, log_mel: np.ndarray) -> np.ndarray:
        """log_mel: [128, T] (or [1, 128, T]) float32 -> tokens [P] int64."""
        feats = np.ascontiguousarray(log_mel, dtype=np.float32)
        if feats.ndim == 2:
            feats = feats[None]
        lengths = np.array([feats.shape[2]], dtype=np.int32)
        out = self._session.run(None, {self._feat_name: feats, self._len_name: lengths})[0]
        return np.asarray(out).reshape(-1).astype(np.int64)


class SpeakerEncoder:
    """`campplus.onnx`: mean-normalised kaldi fbank [T, 80] -> x-vector [192]."""

    def __init__(self, path: Path | str, prefer_gpu: bool = False) -> None:
        # The official frontend runs CAM++ on CPU: it is small and runs once per voice.
        self.path = Path(path)
        self._session = _session(path, prefer_gpu)
        self._input_name = self._session.get_inputs()[0].name

    def __call__(self, fbank: np.ndarray) -> np.ndarray:
        """fbank: [T, 80] (or [1, T, 80]) float32 -> embedding [192] float32."""
        feats = np.ascontiguousarray(fbank, dtype=np.float32)
        if feats.ndim == 2:
            feats = feats[None]
        out = self._session.run(None, {self._input_name: feats})[0]
        return np.asarray(out, dtype=np.float32).reshape(-1)


# --- stand-in graphs -------------------------------------------------------------------


def _const(name: str, value: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(value, name=name)


def _finish(graph: onnx.GraphProto, producer: str) -> onnx.ModelProto:
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", STANDIN_OPSET)],
        producer_name=producer,
    )
    model.ir_version = STANDIN_IR_VERSION
    onnx.checker.check_model(model)
    return model


def build_speech_tokenizer_standin(seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    # Scale so the projected values spread over tanh's range and all 3 levels occur.
    proj = (rng.standard_normal((128, FSQ_DIMS)) * 4.0 / np.sqrt(128)).astype(np.float32)
    powers = (3.0 ** np.arange(FSQ_DIMS)).astype(np.float32)
    nodes = [
        # [1, 128, T] -> [1, 128, T//4]: 100 Hz mel frames to 25 Hz token frames.
        helper.make_node("AveragePool", ["feats"], ["pooled"], kernel_shape=[TOKEN_HOP], strides=[TOKEN_HOP]),
        # Remove each frame's mean over mel bins: log-mel levels share a big offset.
        helper.make_node("ReduceMean", ["pooled"], ["frame_mean"], axes=[1], keepdims=1),
        helper.make_node("Sub", ["pooled", "frame_mean"], ["centred"]),
        helper.make_node("Transpose", ["centred"], ["frames"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["frames", "proj"], ["projected"]),
        # FSQ with 3 levels: round(tanh(x)) in {-1, 0, 1} -> digit in {0, 1, 2}.
        helper.make_node("Tanh", ["projected"], ["bounded"]),
        helper.make_node("Round", ["bounded"], ["levels"]),
        helper.make_node("Add", ["levels", "one"], ["digits"]),
        helper.make_node("MatMul", ["digits", "powers"], ["code_f"]),
        helper.make_node("Cast", ["code_f"], ["codes"], to=TensorProto.INT64),
        # Honour feats_length: keep the first feats_length // 4 tokens.
        helper.make_node("Cast", ["feats_length"], ["length64"], to=TensorProto.INT64),
        helper.make_node("Div", ["length64", "hop"], ["n_tokens"]),
        helper.make_node("Slice", ["codes", "zero", "n_tokens", "axis1"], ["tokens"]),
    ]
    graph = helper.make_graph(
        nodes,
        "speech_tokenizer_v3_standin",
        inputs=[
            helper.make_tensor_value_info("feats", TensorProto.FLOAT, [1, 128, "T"]),
            helper.make_tensor_value_info("feats_length", TensorProto.INT32, [1]),
        ],
        outputs=[helper.make_tensor_value_info("tokens", TensorProto.INT64, [1, "P"])],
        initializer=[
            _const("proj", proj),
            _const("powers", powers),
            _const("one", np.array(1.0, dtype=np.float32)),
            _const("hop", np.array([TOKEN_HOP], dtype=np.int64)),
            _const("zero", np.array([0], dtype=np.int64)),
            _const("axis1", np.array([1], dtype=np.int64)),
        ],
    )
    return _finish(graph, "cosyvoice-gateway-standin")


def build_campplus_standin(seed: int = 1, hidden: int = 256) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    w1 = (rng.standard_normal((80, hidden)) / np.sqrt(80)).astype(np.float32)
    b1 = (rng.standard_normal(hidden) * 0.1).astype(np.float32)
    w2 = (rng.standard_normal((hidden, SPEAKER_DIM)) / np.sqrt(hidden)).astype(np.float32)
    b2 = (rng.standard_normal(SPEAKER_DIM) * 0.1).astype(np.float32)
    nodes = [
        helper.make_node("Mul", ["input", "input"], ["squared"]),
        helper.make_node("ReduceMean", ["squared"], ["mean_sq"], axes=[1], keepdims=0),
        helper.make_node("Sqrt", ["mean_sq"], ["rms"]),  # [1, 80]
        helper.make_node("Gemm", ["rms", "w1", "b1"], ["h_pre"]),
        helper.make_node("Tanh", ["h_pre"], ["h"]),
        helper.make_node("Gemm", ["h", "w2", "b2"], ["output"]),  # [1, 192]
    ]
    graph = helper.make_graph(
        nodes,
        "campplus_standin",
        inputs=[helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, "T", 80])],
        outputs=[helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, SPEAKER_DIM])],
        initializer=[_const("w1", w1), _const("b1", b1), _const("w2", w2), _const("b2", b2)],
    )
    return _finish(graph, "cosyvoice-gateway-standin")


def save_model(model: onnx.ModelProto, path: Path | str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, str(path))
