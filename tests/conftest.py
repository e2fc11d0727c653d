"""Shared fixtures: one tiny random-weight model directory per test run.

The directory is written by the same writer users run and loaded by the same loader a
real Fun-CosyVoice3 download goes through.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.models.writer import write_model_dir

    return write_model_dir(tmp_path_factory.mktemp("models") / "tiny-random", "tiny", seed=0)
