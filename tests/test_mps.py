"""Whether an NVIDIA MPS daemon runs, as the benchmark's machine record and /metrics say:
without one the stage's and vLLM's MPS settings do nothing."""

from __future__ import annotations

import os

from bench.machine import describe_machine, summary
from engine.mps import MPS_PIPE_ENV, daemon_pipe_directory
from gateway.metrics import Metrics


def test_a_daemon_is_seen_by_its_control_pipe(tmp_path, monkeypatch) -> None:
    pipes = tmp_path / "mps-pipe"
    pipes.mkdir()
    monkeypatch.setenv(MPS_PIPE_ENV, str(pipes))
    assert daemon_pipe_directory() is None  # the directory alone: no daemon
    assert "cosyvoice_mps_daemon 0" in Metrics().render().splitlines()
    machine = describe_machine(use_cuda=False)
    assert machine["mps_pipe"] is None and "no MPS daemon" in summary(machine)

    os.mkfifo(pipes / "control")  # what a running daemon keeps there
    assert daemon_pipe_directory() == str(pipes)
    assert "cosyvoice_mps_daemon 1" in Metrics().render().splitlines()
    machine = describe_machine(use_cuda=False)
    assert machine["mps_pipe"] == str(pipes) and f"MPS daemon at {pipes}" in summary(machine)


def test_unset_or_empty_the_variable_means_nvidias_default_directory(tmp_path, monkeypatch) -> None:
    import engine.mps

    assert engine.mps.DEFAULT_PIPE_DIRECTORY == "/tmp/nvidia-mps"  # NVIDIA's documented default
    monkeypatch.setattr(engine.mps, "DEFAULT_PIPE_DIRECTORY", str(tmp_path))
    os.mkfifo(tmp_path / "control")
    assert daemon_pipe_directory({}) == daemon_pipe_directory({MPS_PIPE_ENV: ""}) == str(tmp_path)
    assert daemon_pipe_directory({MPS_PIPE_ENV: str(tmp_path / "elsewhere")}) is None
