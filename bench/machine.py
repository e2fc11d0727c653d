"""What machine a benchmark ran on, for its report.

Two H100 machines of the device tool ran the same build's vLLM decode steps at 4.7 and 7.1
ms a token under the same load (rounds 39 and 40 of docs/benchmarks.md): a figure is only
comparable with another from the same machine, so each report says which one it was.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

from engine.mps import daemon_pipe_directory


def _first_line(path: Path, key: str) -> str | None:
    """The value of the first `key: value` line of a /proc file, None where there is none."""
    try:
        for line in path.read_text().splitlines():
            name, sep, value = line.partition(":")
            if sep and name.strip() == key:
                return value.strip()
    except OSError:
        return None
    return None


def _gpus(use_cuda: bool) -> list[dict[str, Any]] | None:
    if not use_cuda:
        return None
    try:
        import torch

        return [{"name": torch.cuda.get_device_name(i),
                 "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)}
                for i in range(torch.cuda.device_count())]
    except Exception as exc:  # a report without its GPUs beats no report
        return [{"error": f"{type(exc).__name__}: {exc}"}]


def _driver(use_cuda: bool) -> str | None:
    if not use_cuda:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
        return out.splitlines()[0].strip() or None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def _commit(root: Path) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
        return out.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None  # a copy without its history (the device tool sends none)


SOURCE_DIRS = ("engine", "gateway", "bench")


def source_digest(root: Path) -> str:
    """A short digest of the Python sources the run used (`SOURCE_DIRS`, paths and bytes).
    Why beside the commit: the device tool's copy of a checkout may carry a `.git` from an
    earlier call, and its commit then names a build that did not run (round 41 of
    docs/benchmarks.md: bf433d0 for runs of 49d15cf), and a working tree's changes have no
    commit at all. The same sources give the same digest here and there."""
    h = hashlib.sha256()
    for path in sorted(p for d in SOURCE_DIRS for p in (root / d).rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def describe_machine(use_cuda: bool) -> dict[str, Any]:
    """The host's CPU model, CPUs, memory, Python and torch versions, the visible GPUs and
    their driver (with `use_cuda`), an MPS daemon's pipe directory (None: no daemon, so the
    MPS settings did nothing), the repository's commit where it has one and the sources'
    digest (`source_digest`)."""
    mem_kib = _first_line(Path("/proc/meminfo"), "MemTotal")
    try:
        import torch

        torch_version: str | None = torch.__version__
    except ImportError:
        torch_version = None
    return {
        "cpu": _first_line(Path("/proc/cpuinfo"), "model name") or platform.processor() or None,
        "logical_cpus": os.cpu_count(),
        "memory_gib": round(int(mem_kib.split()[0]) / 2**20, 1) if mem_kib else None,
        "python": platform.python_version(),
        "torch": torch_version,
        "gpus": _gpus(use_cuda),
        "driver": _driver(use_cuda),
        "mps_pipe": daemon_pipe_directory(),
        "commit": _commit(Path(__file__).resolve().parent.parent),
        "source_digest": source_digest(Path(__file__).resolve().parent.parent),
    }


def summary(machine: dict[str, Any]) -> str:
    """One line of `describe_machine`'s record, for a log."""
    gpus = machine.get("gpus") or []
    names = ", ".join(g.get("name", g.get("error", "?")) for g in gpus) or "no GPU"
    mps = f"MPS daemon at {machine['mps_pipe']}" if machine.get("mps_pipe") else "no MPS daemon"
    return (f"{names} (driver {machine.get('driver') or 'n/a'}, {mps}); {machine.get('cpu') or 'CPU ?'} x"
            f"{machine.get('logical_cpus')}, {machine.get('memory_gib')} GiB; Python {machine.get('python')}, "
            f"torch {machine.get('torch')}, commit {machine.get('commit') or 'n/a'}, "
            f"sources {machine.get('source_digest') or 'n/a'}")
