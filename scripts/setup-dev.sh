#!/usr/bin/env bash
# Creates .venv with CPU torch, triton (its CPU interpreter runs the GPU kernels in tests) and every
# dependency at the versions in constraints.txt (torch and triton are pinned here: the GPU image pins its own).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0" "triton==3.9.0"
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[dev]"
