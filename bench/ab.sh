#!/usr/bin/env bash
# A/B on the GPU machine: an older tree against the working tree, alternating, two rounds of each:
#   bash bench/ab.sh latency   batch 1 through the services (REPEATS requests a side and round, default 10)
#   bash bench/ab.sh offline   the offline workload (OFFLINE_ARGS: bench.offline's, e.g. "--mode services --runs 2")
# Here: mkdir -p .gpu/old && git archive <rev> | tar -x -C .gpu/old; then run it there carrying .whl and .gpu (FA4=1
# where flash-attn-4 is installed in /tmp/site already: bench/gpu_setup.sh).
set -u
export OUT=${OUT:-/tmp/out} PYTHONUNBUFFERED=1 MODEL=/tmp/qwen3-0.6b
case ${1:-} in
  latency) cmd="python3 -m bench latency --model $MODEL --device cuda --mode services --repeats ${REPEATS:-10}"
           keep="^\\{'path'" ;;
  offline) cmd="python3 -m bench.offline --model $MODEL ${OFFLINE_ARGS:-}"; keep="by batch|^[|]" ;;
  *) echo "usage: bash bench/ab.sh latency|offline" >&2; exit 2 ;;
esac
mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
[ -n "${FA4:-}" ] || mkdir -p /tmp/site/flash_attn  # an empty package: flash-attn-4 counts as not installed
PYTHONPATH=/tmp/site:$PWD python3 -m worker_svc.cli make-model --preset qwen3-0.6b --out $MODEL >/dev/null
for round in 1 2; do
  for side in old new; do
    dir=$PWD; [ $side = old ] && dir=$PWD/.gpu/old
    (cd $dir && PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$dir timeout 280 \
      $cmd --out $OUT/${1}_${side}_$round.json 2>&1 | grep -E "$keep" | sed "s/^/$side $round /")
  done
done
