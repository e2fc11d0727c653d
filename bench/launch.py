"""A gateway process for the benchmark tools: `python -m gateway` on a free loopback port.

Both `bench.ws_load` and `bench.soak` drive a real server the way a deployment runs it, and
read its resident memory from /proc, so they need its PID: they start it themselves.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Sequence

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_bytes(pid: int) -> int | None:
    """Resident set size of a process from /proc (Linux; psutil is not a dependency),
    None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class LaunchedGateway:
    """`python -m gateway --model MODEL` with its data and assets under `workdir`, any other
    flags passed through. The environment's COSYVOICE_GW_* variables and the repository's
    config/default.yaml (the process runs in `workdir`) do not reach it: a run is defined by
    its flags alone."""

    def __init__(self, model: str | Path, flags: Sequence[str], workdir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ws_url = f"ws://127.0.0.1:{self.port}/v1/tts/stream"
        self.log: list[str] = []
        # Seconds from the launch to the first 200 from /ready (model load, warm-up, CUDA
        # graph captures, compiles): set by `wait_ready`.
        self.ready_s: float | None = None
        self._launched = time.monotonic()
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "assets").mkdir(exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("COSYVOICE_GW_")}
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        self.command = [sys.executable, "-m", "gateway", "--model", str(model), "--host", "127.0.0.1",
                        "--port", str(self.port), "--data-dir", str(workdir / "data"),
                        "--assets-dir", str(workdir / "assets"), "--log-level", "warning", *flags]
        self.proc = subprocess.Popen(self.command, cwd=workdir, env=env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        threading.Thread(target=self._drain, daemon=True).start()

    @property
    def pid(self) -> int:
        return int(self.proc.pid)

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line.rstrip())

    def wait_ready(self, timeout: float) -> "LaunchedGateway":
        # A tool polling a readiness endpoint (not a test): loading a model may take minutes.
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("gateway exited:\n" + "\n".join(self.log[-30:]))
            try:
                if httpx.get(self.url + "/ready", timeout=5).status_code == 200:
                    self.ready_s = time.monotonic() - self._launched
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError("gateway not ready in time:\n" + "\n".join(self.log[-30:]))

    def stop(self) -> int:
        """SIGTERM (the gateway drains its sessions, then exits); its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(30)
