"""Regenerates the checked-in Python code from the .proto files beside this module.

Uses grpcio-tools no newer than the grpcio the GPU machine has (1.84), since newer generated code
refuses to import under an older grpcio.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTOS = sorted(HERE.glob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Writes *_pb2.py, *_pb2.pyi and *_pb2_grpc.py for every .proto into out_dir/protos."""
    from grpc_tools import protoc

    (out_dir / "protos").mkdir(parents=True, exist_ok=True)
    import grpc_tools

    include = Path(grpc_tools.__file__).parent / "_proto"
    for proto in PROTOS:
        args = ["protoc", f"-I{HERE.parent}", f"-I{include}", f"--python_out={out_dir}",
                f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", str(proto.relative_to(HERE.parent))]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {proto.name}")
    return sorted((out_dir / "protos").glob("*_pb2*.py*"))


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for path in generate(Path(tmp)):
            (HERE / path.name).write_bytes(path.read_bytes())
            print(f"wrote protos/{path.name}", file=sys.stderr)


if __name__ == "__main__":
    main()
