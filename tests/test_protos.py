"""The checked-in generated code is exactly what the pinned grpcio-tools makes of the .proto files."""
from __future__ import annotations

from pathlib import Path

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

def test_generated_code_runs_on_grpcio_184():
    """The GPU machine has grpcio 1.84: code from a newer grpcio-tools refuses to import there."""
    for name in ("worker_pb2_grpc.py", "splitserve_pb2_grpc.py"):
        text = (generate.HERE / name).read_text()
        assert "GRPC_GENERATED_VERSION = '1.84." in text
