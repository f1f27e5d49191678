#!/usr/bin/env bash
# A/B of batch-1 latency through the services on the GPU machine: an older tree against the working tree, alternating.
# Here: mkdir -p .gpu/old && git archive <rev> | tar -x -C .gpu/old; then run it there carrying .whl and .gpu (FA4=1
# where flash-attn-4 is installed in /tmp/site already: bench/gpu_setup.sh).
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
[ -n "${FA4:-}" ] || mkdir -p /tmp/site/flash_attn  # an empty package: flash-attn-4 counts as not installed
export PYTHONUNBUFFERED=1 MODEL=/tmp/qwen3-0.6b
PYTHONPATH=/tmp/site:$PWD python3 -m worker_svc.cli make-model --preset qwen3-0.6b --out $MODEL >/dev/null
for round in 1 2; do
  for side in old new; do
    dir=$PWD; [ $side = old ] && dir=$PWD/.gpu/old
    (cd $dir && PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$dir timeout 200 \
      python3 -m bench latency --model $MODEL --device cuda --mode services --repeats ${REPEATS:-10} \
      --out $OUT/latency_${side}_$round.json 2>&1 \
      | grep "^{'path'" | sed "s/^/$side $round /")
  done
done
