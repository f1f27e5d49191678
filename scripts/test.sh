#!/usr/bin/env bash
# The project's test command (README): sets up .venv if needed, then runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
{ [ -x .venv/bin/pytest ] && .venv/bin/python -c "import xdist" 2>/dev/null; } || bash scripts/setup-dev.sh
# Modules spread over two processes (pytest-xdist; a module's tests stay together, so its services start once): the
# suite's services leave a core idle much of the time. SPLITSERVE_TEST_PROCS=0 runs it in one process.
exec .venv/bin/python -m pytest -q -n "${SPLITSERVE_TEST_PROCS:-2}" --dist loadfile "$@"
