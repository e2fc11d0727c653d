"""deploy/entrypoint.sh (the GPU image's entrypoint), run with stand-ins for the gateway and
for nvidia-cuda-mps-control on PATH that write what they were asked to a log."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENTRYPOINT = ROOT / "deploy" / "entrypoint.sh"

FAKE_MPS = """#!/bin/sh
if [ "$1" = -d ]; then
  echo "start pipe=$CUDA_MPS_PIPE_DIRECTORY log=$CUDA_MPS_LOG_DIRECTORY" >> "$LOG"
  exit "${FAKE_MPS_RC:-0}"
fi
read -r command
echo "control $command" >> "$LOG"
"""

# FAKE_GW: "exit N" ends at once with N; "serve" says ready and runs until SIGTERM, then
# exits 0; "serve-hard" the same, but SIGTERM kills it.
FAKE_GATEWAY = """#!/bin/sh
echo "gateway $* pipe=${CUDA_MPS_PIPE_DIRECTORY:-none}" >> "$LOG"
case "$FAKE_GW" in
  exit*) exit "${FAKE_GW#exit }" ;;
  serve) trap 'echo "gateway term" >> "$LOG"; exit 0' TERM ;;
esac
echo ready
while :; do sleep 1 > /dev/null 2>&1 & wait $!; done
"""


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("nvidia-cuda-mps-control", FAKE_MPS), ("cosyvoice-gateway", FAKE_GATEWAY)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_MPS_", "COSYVOICE_MPS"))}
    return environ | {"PATH": f"{bin_dir}:{environ['PATH']}", "LOG": str(tmp_path / "log"),
                      "CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "mps" / "pipe"),
                      "CUDA_MPS_LOG_DIRECTORY": str(tmp_path / "mps" / "log")}


def log(env: dict[str, str]) -> list[str]:
    path = Path(env["LOG"])
    return path.read_text().splitlines() if path.exists() else []


def run(env: dict[str, str], **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["sh", str(ENTRYPOINT), "--port", "8080"], env=env | extra, capture_output=True,
                          text=True, timeout=30)


def test_without_mps_it_is_the_gateway_itself(env: dict[str, str]) -> None:
    plain = {k: v for k, v in env.items() if not k.startswith("CUDA_MPS_")}
    done = run(plain, FAKE_GW="exit 3")
    assert done.returncode == 3  # the gateway's own status
    assert log(plain) == ["gateway --port 8080 pipe=none"]  # no daemon, no MPS environment


def test_with_mps_the_gateway_runs_under_the_daemon_which_quits_after(env: dict[str, str]) -> None:
    done = run(env, COSYVOICE_MPS="1", FAKE_GW="exit 5")
    assert done.returncode == 5
    pipe = env["CUDA_MPS_PIPE_DIRECTORY"]
    assert log(env) == [f"start pipe={pipe} log={env['CUDA_MPS_LOG_DIRECTORY']}",
                        f"gateway --port 8080 pipe={pipe}", "control quit"]
    assert Path(pipe).is_dir() and Path(env["CUDA_MPS_LOG_DIRECTORY"]).is_dir()
    assert "MPS daemon started" in done.stderr


def test_a_daemon_that_does_not_start_stops_the_container(env: dict[str, str]) -> None:
    done = run(env, COSYVOICE_MPS="1", FAKE_GW="exit 0", FAKE_MPS_RC="1")
    assert done.returncode == 1
    assert "did not start" in done.stderr
    assert [line for line in log(env) if line.startswith("gateway")] == []  # not served without it


def terminated(env: dict[str, str], gateway: str) -> int:
    """The entrypoint's status after a SIGTERM sent once its gateway serves."""
    proc = subprocess.Popen(["sh", str(ENTRYPOINT)], env=env | {"COSYVOICE_MPS": "1", "FAKE_GW": gateway},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"  # the gateway is serving
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode


def test_sigterm_reaches_the_gateway_and_then_the_daemon_quits(env: dict[str, str]) -> None:
    assert terminated(env, "serve") == 0  # the gateway's status after draining, not the wait's 143
    assert log(env)[-2:] == ["gateway term", "control quit"]


def test_a_gateway_killed_by_sigterm_gives_its_status(env: dict[str, str]) -> None:
    assert terminated(env, "serve-hard") == 128 + signal.SIGTERM
    assert log(env)[-1] == "control quit"
