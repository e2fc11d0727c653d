"""Turn the `model` setting into a local model directory.

    /path/to/dir            used as it is
    tiny-random             random weights, official layout, written once into the cache
    full-random             the same at the released dimensions (GPU benchmarks)
    tiny-random-cv2         the same two for CosyVoice2-0.5B (cosyvoice2.yaml layout)
    full-random-cv2
    Owner/Repo              downloaded from Hugging Face (ModelScope as fallback) into the cache

Downloads go into `<cache>/<Owner>--<Repo>/` file by file (temp name, then rename), with
a progress bar, and a `.complete` marker at the end, so an interrupted download resumes
and is never mistaken for a whole model.
"""

from __future__ import annotations

import json
import logging
import os
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from .models.loader import FAMILIES, ModelDirError, check_model_dir, detect_version

log = logging.getLogger(__name__)

# name -> (size, model version) of the random-weight directories `write_model_dir` makes.
RANDOM_MODELS: dict[str, tuple[str, str]] = {
    "tiny-random": ("tiny", "cosyvoice3"),
    "full-random": ("full", "cosyvoice3"),
    "tiny-random-cv2": ("tiny", "cosyvoice2"),
    "full-random-cv2": ("full", "cosyvoice2"),
}
# Files the runtime needs; training-only extras (llm.rl.pt, batch ONNX, TRT ONNX) are skipped.
SKIP = {"llm.rl.pt", "speech_tokenizer_v3.batch.onnx", "speech_tokenizer_v2.batch.onnx", "flow.decoder.estimator.fp32.onnx",
        "flow.encoder.fp16.zip", "flow.encoder.fp32.zip", ".gitattributes"}
# Skipped by path: CosyVoice-BlankEN/model.safetensors holds the plain Qwen2 text weights
# (~988 MB). Nothing here opens it: the tokenizer reads vocab.json, merges.txt and
# tokenizer_config.json, the loader reads config.json, CosyVoice's own copy of the Qwen2
# weights comes from llm.pt, and the vLLM export writes its own model.safetensors from
# llm.pt into <model_dir>/vllm-*/ (vLLM runs with skip_tokenizer_init).
SKIP_PATHS = {"CosyVoice-BlankEN/model.safetensors"}
TIMEOUT = 30


def resolve_model(model: str, cache_dir: Path) -> Path:
    if model in RANDOM_MODELS:
        path = cache_dir / model
        size, version = RANDOM_MODELS[model]
        if not (path / FAMILIES[version].yaml_name).is_file():
            from .models.writer import write_model_dir

            log.info("writing random-weight model %s into %s", model, path)
            write_model_dir(path, size, overwrite=path.exists(), version=version)
        return path
    local = Path(model).expanduser()
    if local.is_dir():
        # Every file the engine will read, checked now: a partial directory is refused
        # in one message before anything loads.
        check_model_dir(local, detect_version(local))
        return local
    if model.count("/") != 1 or model.startswith((".", "/")):
        raise ModelDirError(f"model {model!r} is neither a directory nor a hub repo id (Owner/Name)")
    target = cache_dir / model.replace("/", "--")
    if (target / ".complete").is_file():
        return target
    errors = []
    for hub in (_HuggingFace(), _ModelScope()):
        try:
            hub.download(model, target)
            (target / ".complete").write_text(hub.name)
            return target
        except (urllib.error.URLError, OSError, ValueError) as exc:
            errors.append(f"{hub.name}: {exc}")
    raise ModelDirError(
        f"cannot download {model} ({'; '.join(errors)}). Offline? Try the gateway without a download: --model tiny-random"
    )


class _Hub:
    name = ""

    def files(self, repo: str) -> list[str]:
        raise NotImplementedError

    def url(self, repo: str, path: str) -> str:
        raise NotImplementedError

    def download(self, repo: str, target: Path) -> None:
        from tqdm import tqdm

        names = [f for f in self.files(repo)
                 if Path(f).name not in SKIP and f not in SKIP_PATHS and not f.startswith("asset/")]
        if not any(n.endswith("cosyvoice3.yaml") or n.endswith("cosyvoice2.yaml") for n in names):
            raise ValueError(f"{repo} has no cosyvoice3.yaml or cosyvoice2.yaml")
        for name in names:
            dest = target / name
            if dest.is_file():
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(dest.name + ".part")
            try:
                with urllib.request.urlopen(self.url(repo, name), timeout=TIMEOUT) as resp, open(tmp, "wb") as out:
                    total = int(resp.headers.get("Content-Length") or 0) or None
                    got = 0
                    with tqdm(total=total, unit="B", unit_scale=True, desc=name, leave=False) as bar:
                        while chunk := resp.read(1 << 20):
                            out.write(chunk)
                            got += len(chunk)
                            bar.update(len(chunk))
                # A connection closed early ends the reads quietly, as if the file were whole:
                # renamed into place and marked complete, it would fail every later start.
                if total is not None and got != total:
                    raise ConnectionError(f"{name}: got {got} of {total} bytes")
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            os.replace(tmp, dest)


class _HuggingFace(_Hub):
    name = "huggingface"

    @property
    def base(self) -> str:
        return os.environ.get("HF_ENDPOINT", "https://huggingface.co")

    def files(self, repo: str) -> list[str]:
        with urllib.request.urlopen(f"{self.base}/api/models/{repo}", timeout=TIMEOUT) as r:
            return [s["rfilename"] for s in json.load(r).get("siblings", [])]

    def url(self, repo: str, path: str) -> str:
        return f"{self.base}/{repo}/resolve/main/{urllib.parse.quote(path)}"


class _ModelScope(_Hub):
    name = "modelscope"

    @property
    def base(self) -> str:
        return os.environ.get("MODELSCOPE_ENDPOINT", "https://modelscope.cn")

    def files(self, repo: str) -> list[str]:
        with urllib.request.urlopen(f"{self.base}/api/v1/models/{repo}/repo/files?Recursive=true", timeout=TIMEOUT) as r:
            data = json.load(r)
        return [f["Path"] for f in data.get("Data", {}).get("Files", []) if f.get("Type") == "blob"]

    def url(self, repo: str, path: str) -> str:
        return f"{self.base}/models/{repo}/resolve/master/{urllib.parse.quote(path)}"
