#!/usr/bin/env bash
# The project's test command (README): sets up .venv if needed, then runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/pytest ] || bash scripts/setup-dev.sh
exec .venv/bin/python -m pytest -q "$@"
