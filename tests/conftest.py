"""Session fixtures shared by every test package."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default model (SmolLM2-135M-Instruct) as a converted Hugging Face folder
    (converted once into the pagewire cache, then reused across runs)."""
    from common.model_store import resolve_model

    return resolve_model(None)
