"""Settings of a process as an NVIDIA MPS client (Multi-Process Service), as environment
variables that its CUDA context reads when it is created.

Under an MPS daemon the gateway's GPU processes (vLLM's engine core, the audio stage's
process) run their kernels side by side instead of in time slices. NVIDIA's MPS
documentation, "Environment Variables": CUDA_MPS_ACTIVE_THREAD_PERCENTAGE caps the share of
the SMs a client's kernels may occupy, CUDA_MPS_CLIENT_PRIORITY (0 normal, 1 below normal)
orders the clients' waiting kernels. Without a daemon both do nothing.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator, Literal, Mapping

MPSPriority = Literal["normal", "below_normal"]

MPS_PERCENT_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
MPS_PRIORITY_ENV = "CUDA_MPS_CLIENT_PRIORITY"
MPS_PRIORITY_VALUES: dict[str, str] = {"normal": "0", "below_normal": "1"}
MPS_PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"


def daemon_pipe_directory(environ: Mapping[str, str] | None = None) -> str | None:
    """The pipe directory of the MPS control daemon this process's CUDA contexts would join,
    None where none runs. A daemon keeps its `control` pipe there while it runs. Why ask:
    without a daemon the settings above do nothing, and nothing else says so."""
    env = os.environ if environ is None else environ
    directory = Path(env.get(MPS_PIPE_ENV) or DEFAULT_PIPE_DIRECTORY)
    return str(directory) if (directory / "control").exists() else None


def mps_client_env(thread_percent: int | None, priority: MPSPriority | None = None) -> dict[str, str]:
    """The variables for an SM share (percent) and a priority; None leaves MPS's default."""
    env = {}
    if thread_percent is not None:
        env[MPS_PERCENT_ENV] = str(thread_percent)
    if priority is not None:
        env[MPS_PRIORITY_ENV] = MPS_PRIORITY_VALUES[priority]
    return env


@contextlib.contextmanager
def child_env(env: dict[str, str]) -> Iterator[None]:
    """While a child process starts: it inherits this environment, so settings read when its
    CUDA context is created are its own (this process's context, if any, exists by then).
    Restored after, whatever was there."""
    before = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
