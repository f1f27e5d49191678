"""The checked-in generated code is exactly what the pinned grpcio-tools makes of the .proto files."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from protos import generate


def test_generated_code_matches_protos(tmp_path: Path):
    fresh = generate.generate(tmp_path)
    assert fresh, "no code generated"
    names = {p.name for p in fresh}
    checked_in = {p.name for p in generate.HERE.glob("*_pb2*.py*")}
    assert names == checked_in, "generated files differ from the checked-in set; run python -m protos.generate"
    for path in fresh:
        assert path.read_bytes() == (generate.HERE / path.name).read_bytes(), (
            f"protos/{path.name} is stale; run python -m protos.generate")


def _load_as_new_module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", sorted(generate.HERE.glob("*_pb2_grpc.py")), ids=lambda p: p.name)
def test_generated_code_runs_on_grpcio_184(path, monkeypatch):
    """The GPU machine has grpcio 1.84.0: each generated module's own version check passes under it (code
    from a newer grpcio-tools refuses to import there), and the check does refuse an older grpcio."""
    import grpc

    monkeypatch.setattr(grpc, "__version__", "1.84.0")
    module = _load_as_new_module(path, f"_check_{path.stem}")
    assert any(name.endswith("Stub") for name in vars(module))
    monkeypatch.setattr(grpc, "__version__", "1.83.9")
    with pytest.raises(RuntimeError, match="depends on grpcio>="):
        _load_as_new_module(path, f"_check_old_{path.stem}")
