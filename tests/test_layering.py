"""The layering of the packages, read from the sources (every import statement, those inside functions too):
the worker ships without the scheduler's code and the scheduler without the worker's, the offline room
(offline/) being the one place both meet; the client and the gateway import no service; common/ imports
nothing of the project but the protos; torch stays out of everything that runs without it."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("protos", "common", "scheduler_svc", "worker_svc", "client", "gateway", "offline", "bench")

# package -> first-party packages (or modules) it must never import
FORBIDDEN = {
    # the worker's rooms, bottom up: kernels, model, runtime, service
    "worker_svc/kernels": {"worker_svc.model", "worker_svc.runtime", "worker_svc.service", "worker_svc.cli",
                           "worker_svc.checkpoints"},
    "worker_svc/model": {"worker_svc.runtime", "worker_svc.service", "worker_svc.cli", "worker_svc.checkpoints"},
    "worker_svc/runtime": {"worker_svc.service", "worker_svc.cli", "worker_svc.checkpoints"},
    "worker_svc/checkpoints": {"worker_svc.kernels", "worker_svc.model", "worker_svc.runtime", "worker_svc.service",
                               "worker_svc.cli"},
    "worker_svc": {"scheduler_svc", "offline", "client", "gateway", "bench"},
    "scheduler_svc": {"worker_svc", "offline", "client", "gateway", "bench"},
    "client": {"scheduler_svc", "worker_svc", "offline", "gateway", "bench"},
    "gateway": {"scheduler_svc", "worker_svc", "offline", "bench"},
    "common": {"scheduler_svc", "worker_svc", "offline", "client", "gateway", "bench"},
    "protos": {"common", "scheduler_svc", "worker_svc", "offline", "client", "gateway", "bench"},
}
# packages (or modules) that must run without torch installed
TORCH_FREE = ["scheduler_svc", "client", "gateway", "common", "protos", "worker_svc/runtime/batch.py",
              "worker_svc/runtime/simulated.py", "worker_svc/runtime/kernel_builds.py", "worker_svc/cli.py",
              "worker_svc/service",
              "worker_svc/checkpoints/presets.py", "worker_svc/checkpoints/__main__.py"]


def imported_modules(path: Path) -> set[str]:
    """Every module an import statement in the file names (absolute imports; the project has no relative
    ones)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import"
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def sources(where: str) -> list[Path]:
    path = REPO / where
    return [path] if path.suffix == ".py" else sorted(path.rglob("*.py"))


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_packages_import_only_what_their_layer_allows(package):
    bad = []
    for path in sources(package):
        for name in imported_modules(path):
            if any(name == f or name.startswith(f + ".") for f in FORBIDDEN[package]):
                bad.append(f"{path.relative_to(REPO)} imports {name}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("where", TORCH_FREE)
def test_torch_free_code_imports_no_torch(where):
    bad = [f"{path.relative_to(REPO)} imports {name}" for path in sources(where)
           for name in imported_modules(path) if name.split(".")[0] in ("torch", "triton", "transformers")]
    assert not bad, "\n".join(bad)


def test_the_check_sees_imports_inside_functions(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from scheduler_svc.engine import LLMEngine\n    import torch.nn\n")
    assert {"scheduler_svc.engine", "scheduler_svc.engine.LLMEngine", "torch.nn"} <= imported_modules(module)


def test_only_the_offline_room_joins_scheduler_and_worker():
    joins = []
    for package in PACKAGES:
        for path in sources(package):
            tops = {name.split(".")[0] for name in imported_modules(path)}
            if {"scheduler_svc", "worker_svc"} <= tops:
                joins.append(str(path.relative_to(REPO)))
    assert joins and all(p.startswith(("offline/", "bench/")) for p in joins), joins
