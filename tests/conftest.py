"""Shared pytest fixtures."""

from __future__ import annotations

import os
from pathlib import Path

# Without a GPU, the GPU's Triton kernels run in Triton's CPU interpreter (tests/test_triton_kernels.py).
# Set before anything imports triton: it reads it when kernels are defined.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

# The longest modules, run first: scripts/test.sh hands whole modules to its processes in this order, and a long one
# handed out last would run alone at the end.
LONGEST_FIRST = ("test_architectures", "test_triton_kernels", "test_faults", "test_tensor_parallel", "test_load",
                 "test_bench_smoke")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: LONGEST_FIRST.index(item.path.stem) if item.path.stem in LONGEST_FIRST
               else len(LONGEST_FIRST))  # stable: each module's tests keep their order


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """qwen3-tiny written with seed 0 (Hugging Face layout, single safetensors file)."""
    from worker_svc.checkpoints.writer import make_model

    return make_model("qwen3-tiny", tmp_path_factory.mktemp("qwen3-tiny") / "model", seed=0)


HARMONY_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")


@pytest.fixture(scope="session")
def harmony_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """qwen3-tiny whose tokenizer also has gpt-oss's harmony markers as special tokens (ids past Qwen's, inside the
    model's vocabulary), as gpt-oss's tokenizer has them."""
    from tokenizers import AddedToken, Tokenizer

    out = tmp_path_factory.mktemp("harmony-tiny") / "model"
    out.mkdir()
    for f in tiny_model_dir.iterdir():
        (out / f.name).symlink_to(f)
    (out / "tokenizer.json").unlink()
    tok = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in HARMONY_TOKENS])
    tok.save(str(out / "tokenizer.json"))
    return out
