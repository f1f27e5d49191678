#!/usr/bin/env bash
# On the GPU machine, second of the two calls that bring flash-attn-4 (see ../shared/device/README.md;
# the first call copies .fa4/a to /tmp/fa4): assembles the split wheel and installs it, the rest of
# flash-attn-4's wheels and the project's small wheels from .whl into /tmp/site.
# Then: export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD
set -euo pipefail
mkdir -p /tmp/fa4
WHEEL=/tmp/fa4/nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
# an earlier call's .fa4/b stays in the device's copy of the tree: assembling again from it alone would overwrite the
# whole wheel with its last two parts
if [ -d .fa4/b ] && [ ! -f $WHEEL ]; then
  cp .fa4/b/* /tmp/fa4/
  (cd /tmp/fa4 && cat cu13.part.* > $WHEEL && rm cu13.part.*)
fi
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/fa4/*.whl .whl/*.whl
