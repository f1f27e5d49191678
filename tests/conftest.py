"""Shared pytest fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """qwen3-tiny written with seed 0 (Hugging Face layout, single safetensors file)."""
    from worker_svc.make_model import make_model

    return make_model("qwen3-tiny", tmp_path_factory.mktemp("qwen3-tiny") / "model", seed=0)
