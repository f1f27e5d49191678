#!/usr/bin/env bash
# The project's test command (README): sets up .venv if needed, then runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
{ [ -x .venv/bin/pytest ] && .venv/bin/python -c "import xdist" 2>/dev/null; } || bash scripts/setup-dev.sh
# Modules spread over two processes (pytest-xdist; a module's tests stay together, so its services start once): the
# suite's services leave a core idle much of the time. SPLITSERVE_TEST_PROCS=0 runs it in one process.
# One torch thread a process (the services the tests start inherit it): the test processes and their services
# share the cores, and torch's default of a thread per core oversubscribes them (bench/NOTES.md, the suite's time).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/python -m pytest -q -n "${SPLITSERVE_TEST_PROCS:-2}" --dist loadfile "$@"
