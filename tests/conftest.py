"""Shared pytest fixtures."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
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
def session_tmp(tmp_path_factory) -> Path:
    """A folder for the session-scoped fixtures' files, which outlive the module that first asks for them."""
    return tmp_path_factory.mktemp("session")


@pytest.fixture(scope="module", autouse=True)
def _remove_module_tmp(request, tmp_path_factory, session_tmp) -> Iterator[None]:
    """Removes the temporary folders a module made once it ends, but where one of its tests failed: the whole suite's
    checkpoints (tens of MB each, real vocabulary) would fill a small disk."""
    base = tmp_path_factory.getbasetemp()
    before, failed = set(base.iterdir()), request.session.testsfailed
    yield
    if request.session.testsfailed == failed:
        for path in set(base.iterdir()) - before:
            shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_model_dir(session_tmp) -> Path:
    """qwen3-tiny written with seed 0 (Hugging Face layout, single safetensors file)."""
    from worker_svc.checkpoints.writer import make_model

    return make_model("qwen3-tiny", session_tmp / "qwen3-tiny" / "model", seed=0)


HARMONY_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")


@pytest.fixture(scope="session")
def harmony_model_dir(tiny_model_dir, session_tmp) -> Path:
    """qwen3-tiny whose tokenizer also has gpt-oss's harmony markers as special tokens (ids past Qwen's, inside the
    model's vocabulary), as gpt-oss's tokenizer has them."""
    from tokenizers import AddedToken, Tokenizer

    out = session_tmp / "harmony-tiny" / "model"
    out.mkdir(parents=True)
    for f in tiny_model_dir.iterdir():
        (out / f.name).symlink_to(f)
    (out / "tokenizer.json").unlink()
    tok = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in HARMONY_TOKENS])
    tok.save(str(out / "tokenizer.json"))
    return out


@pytest.fixture
def faithful_fp8(monkeypatch):
    """Triton's interpreter rounds float32 -> e4m3 wrongly (it truncates by default, and its round-to-nearest
    ORs the mantissa's carry into the exponent: 1.97 becomes 1.0); the GPU's cvt.rn.satfinite does not. The
    kernels' own arithmetic is what these tests check, so the interpreter converts with torch's
    round-to-nearest-even instead."""
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._convert_float

    def convert(data, input_dtype, output_dtype, rounding_mode):
        if output_dtype == tl.float8e4nv and input_dtype in (tl.float32, tl.float16):
            x = np.frombuffer(data.tobytes(), dtype=np.float32 if input_dtype == tl.float32 else np.float16)
            e4m3 = torch.from_numpy(x.astype(np.float32)).to(torch.float8_e4m3fn)
            return e4m3.view(torch.uint8).numpy().reshape(data.shape)
        return original(data, input_dtype, output_dtype, rounding_mode)

    monkeypatch.setattr(interpreter, "_convert_float", convert)
