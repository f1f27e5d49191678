"""Shared pytest fixtures."""

from __future__ import annotations

import os
from pathlib import Path

# Without a GPU, the GPU's Triton kernels run in Triton's CPU interpreter (tests/test_triton_kernels.py).
# Set before anything imports triton: it reads it when kernels are defined.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """qwen3-tiny written with seed 0 (Hugging Face layout, single safetensors file)."""
    from worker_svc.checkpoints.writer import make_model

    return make_model("qwen3-tiny", tmp_path_factory.mktemp("qwen3-tiny") / "model", seed=0)
