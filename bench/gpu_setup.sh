#!/usr/bin/env bash
# On the GPU machine, at the start of bench/gpu_run.sh: assembles flash-attn-4's split wheel from the parts the first
# two calls copied to /tmp/fa4 (see bench/gpu_run.sh), and installs it, the rest of flash-attn-4's wheels and the
# project's small wheels from .whl into /tmp/site.
# Then: export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD
set -euo pipefail
mkdir -p /tmp/fa4
WHEEL=/tmp/fa4/nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
if [ -f /tmp/fa4/cu13.part.aa ]; then  # all three parts there: a wheel assembled from fewer would be broken
  (cd /tmp/fa4 && cat cu13.part.* > $WHEEL && rm cu13.part.*)
fi
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/fa4/*.whl .whl/*.whl
