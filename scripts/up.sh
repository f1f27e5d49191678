#!/usr/bin/env bash
# The README's first command: sets up .venv if needed, then starts a scheduler and a CPU worker on the
# embedded default model (written into ~/.cache/splitserve on first use) and streams a first generation.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/splitserve ] || bash scripts/setup-dev.sh
exec .venv/bin/splitserve up "$@"
