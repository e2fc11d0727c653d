"""Shared fixtures: one tiny random-weight model directory per test run.

The directory is written by the same writer users run and loaded by the same loader a
real Fun-CosyVoice3 download goes through.

Hypothesis runs under the "ci" profile: derandomized (the same examples every run, so a
failure is reproducible and the suite's result does not depend on the draw), no deadline
(a wall-clock limit per example fails on a busy machine, not on a bug) and no example
database (nothing carried from one run to the next). A test's own `@settings(...)`
still overrides these (its `max_examples`, e.g. FUZZ_WS_EXAMPLES). For exploratory long
fuzz runs, `HYPOTHESIS_PROFILE=explore` draws fresh random examples each run instead.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True, deadline=None, database=None)
settings.register_profile("explore", derandomize=False, deadline=None, database=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.models.writer import write_model_dir

    return write_model_dir(tmp_path_factory.mktemp("models") / "tiny-random", "tiny", seed=0)
