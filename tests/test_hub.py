"""Hub downloads (`engine.hub`) against a local HTTP server standing in for Hugging Face."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from engine.hub import resolve_model
from engine.models.loader import ModelDirError

WEIGHTS = b"\x01" * 4000


class _Hub(BaseHTTPRequestHandler):
    truncate = True  # flow.pt: promise its length, send a quarter, hang up
    listing = ["cosyvoice3.yaml", "flow.pt"]
    requested: list[str] = []  # a fresh list per test (the fixture's subclass)

    def log_message(self, *args: object) -> None:
        pass

    def _send(self, body: bytes, length: int | None = None) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        type(self).requested.append(self.path)
        if self.path.startswith("/api/models/"):
            self._send(json.dumps({"siblings": [{"rfilename": n} for n in type(self).listing]}).encode())
        elif self.path.endswith("cosyvoice3.yaml"):
            self._send(b"x: 1\n")
        elif type(self).truncate:
            self._send(WEIGHTS[:1000], length=len(WEIGHTS))
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True
        else:
            self._send(WEIGHTS)


@pytest.fixture()
def hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[_Hub]]:
    handler = type("Handler", (_Hub,), {"requested": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.setenv("MODELSCOPE_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: the fallback fails
    try:
        yield handler
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_a_download_cut_short_is_neither_kept_nor_marked_complete(hub: type[_Hub], tmp_path: Path) -> None:
    with pytest.raises(ModelDirError, match="got 1000 of 4000 bytes"):
        resolve_model("Owner/Repo", tmp_path)
    target = tmp_path / "Owner--Repo"
    assert sorted(p.name for p in target.iterdir()) == ["cosyvoice3.yaml"]  # no flow.pt, no .part, no .complete

    hub.truncate = False  # the next start resumes: only the missing file is fetched
    assert resolve_model("Owner/Repo", tmp_path) == target
    assert (target / "flow.pt").read_bytes() == WEIGHTS
    assert (target / ".complete").read_text() == "huggingface"


def test_the_unused_qwen2_text_weights_are_not_downloaded(hub: type[_Hub], tmp_path: Path) -> None:
    """CosyVoice-BlankEN/model.safetensors (~988 MB) is read by nothing: the LM weights come from llm.pt."""
    hub.truncate = False
    hub.listing = ["cosyvoice3.yaml", "flow.pt", "CosyVoice-BlankEN/model.safetensors", "CosyVoice-BlankEN/vocab.json"]
    target = resolve_model("Owner/Repo", tmp_path)
    assert (target / "CosyVoice-BlankEN" / "vocab.json").is_file()
    assert not (target / "CosyVoice-BlankEN" / "model.safetensors").exists()
    assert not any("model.safetensors" in p for p in hub.requested), hub.requested


def test_a_partial_local_dir_is_refused_before_loading(tiny_model_dir: Path, tmp_path: Path) -> None:
    import shutil

    d = tmp_path / "model"
    shutil.copytree(tiny_model_dir, d)
    assert resolve_model(str(d), tmp_path / "cache") == d
    (d / "hift.pt").unlink()
    (d / "CosyVoice-BlankEN" / "merges.txt").unlink()
    (d / "campplus.onnx").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:00\nsize 28303423\n")
    with pytest.raises(ModelDirError) as exc:
        resolve_model(str(d), tmp_path / "cache")
    msg = str(exc.value)
    assert "3 of 10 required files" in msg, msg
    assert "hift.pt: missing" in msg and "CosyVoice-BlankEN/merges.txt: missing" in msg
    assert "campplus.onnx: a Git LFS pointer" in msg
