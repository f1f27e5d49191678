"""python -m bench {offline,online,latency,prefix,multiturn,embed,scale,floor,scheduler-cpu,runner-step,lora-loads,
                 weight-updates,decode-attention,kernel-sass,prefill-attention,attention-policy,skinny-gemm,fp8-gemm,
                 int-gemm,pdl-chain,l2-weights,fused-layer,moe-kernel,fp8-accuracy,grpc-stream,grpc-accept,
                 thirdparty,all}
                 [flags]

`all` runs offline (in-process and services), latency, online and
prefix with the shared flags, writing the checkpoint once, and prints every results table at the end:

    python -m bench all --preset qwen3-0.6b --device cuda
    python -m bench all --simulate --online-args "--rates 8,32 --num-requests 64"
"""
from __future__ import annotations

import argparse
import importlib
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

MODULES = {
    "offline": "bench.offline",
    "online": "bench.online",
    "latency": "bench.latency",
    "prefix": "bench.prefix",
    "multiturn": "bench.multiturn",
    "embed": "bench.embed",
    "scheduler-cpu": "bench.scheduler_cpu",
    "runner-step": "bench.runner_step",
    "lora-loads": "bench.lora_loads",
    "weight-updates": "bench.weight_updates",
    "decode-attention": "bench.decode_attention",
    "latent-attention": "bench.latent_attention",
    "kernel-sass": "bench.kernel_sass",
    "skinny-gemm": "bench.skinny_gemm",
    "fp8-gemm": "bench.fp8_gemm",
    "int-gemm": "bench.int_gemm",
    "pdl-chain": "bench.pdl_chain",
    "l2-weights": "bench.l2_weights",
    "fused-layer": "bench.fused_layer",
    "moe-kernel": "bench.moe_kernel",
    "prefill-attention": "bench.prefill_attention",
    "attention-policy": "bench.attention_policy",
    "fp8-accuracy": "bench.fp8_accuracy",
    "scale": "bench.scale",
    "grpc-stream": "bench.grpc_stream",
    "grpc-accept": "bench.grpc_accept",
    "floor": "bench.floor",
    "thirdparty": "bench.thirdparty",
}
ALL = ("offline", "latency", "online", "prefix")


def run(name: str, argv: Sequence[str]) -> None:
    """The benchmark's main() with `argv` as its command line (whether its main takes argv or reads sys.argv)."""
    module = importlib.import_module(MODULES[name])
    saved = sys.argv
    sys.argv = [f"-m {MODULES[name]}", *argv]  # argparse's prog, and record()'s command: python -m bench.x ...
    try:
        module.main()
    finally:
        sys.argv = saved


def run_all(argv: Sequence[str]) -> None:
    from bench import common

    ap = argparse.ArgumentParser(prog="python -m bench all", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_args(ap, out=None)
    ap.add_argument("--results-dir", type=Path, default=Path("bench/results"))
    for name in ALL:
        ap.add_argument(f"--{name}-args", default="", help=f"more flags for {name}, one string")
    ap.add_argument("--only", default=",".join(ALL), help="comma-separated subset of " + ",".join(ALL))
    args = ap.parse_args(argv)
    only = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = set(only) - set(ALL)
    if unknown:
        ap.error(f"unknown benchmarks in --only: {sorted(unknown)}")
    with common.model_dir(args) as model:
        shared = ["--model", str(model), "--device", args.device, "--block-size", str(args.block_size),
                  "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens",
                  str(args.max_num_batched_tokens), "--max-model-len", str(args.max_model_len),
                  "--pipeline-depth", str(args.pipeline_depth)]
        if args.simulate:
            shared.append("--simulate")
        outs = []
        for name in ALL:
            if name not in only:
                continue
            out = args.results_dir / f"{name}.json"
            extra = shlex.split(getattr(args, f"{name}_args"))
            print(f"\n=== {name} ===", flush=True)
            run(name, [*shared, "--out", str(out), *extra])
            outs.append(out)
    print()
    for out in outs:
        md = out.with_suffix(".md")
        if md.exists():
            print(md.read_text())


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in (*MODULES, "all"):
        print(__doc__)
        raise SystemExit(0 if argv and argv[0] in ("-h", "--help") else 2)
    name, rest = argv[0], argv[1:]
    if name == "all":
        run_all(rest)
    else:
        run(name, rest)


if __name__ == "__main__":
    main()
