"""The decode projections alone: cuBLAS (F.linear) against worker_svc/kernels/skinny_gemm.py, per call.

Qwen3-0.6B's four projections (qkv, o, gate_up, down) at a few rows, or Llama-3.1-8B's (qkv_8b, ...).
Each call reads a different copy of the weight (copies fill well past the 50 MB L2, as 28 layers do), 20
calls per CUDA graph, replayed; so the time is GPU time with cold weights. Bandwidth counts the weight
bytes. Checks every kernel against F.linear in float32.

python -m bench skinny-gemm
python -m bench skinny-gemm --rows 1,16,64 --configs 16:256:4:4,32:128:6:4
python -m bench skinny-gemm --shapes qkv_8b,o_8b,gate_up_8b,down_8b --rows 64,128,256 --configs 64:64:4:4,128:64:4:8
python -m bench skinny-gemm --rows 16,64,128,256 --configs "" --split-k 64:128:2:4:4,128:64:2:8:4
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from bench.common import replay_ms
from bench.record import record
from common.util import cdiv

# (N, K): Qwen3-0.6B's four projections, and Llama-3.1-8B's (the _8b ones)
SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072),
          "qkv_8b": (6144, 4096), "o_8b": (4096, 4096), "gate_up_8b": (28672, 4096), "down_8b": (4096, 14336)}


def time_us(fn, weights: list[torch.Tensor], x: torch.Tensor, replays: int = 10) -> float:
    fn(x, weights[0])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    calls = max(20, len(weights))
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(x, weights[i % len(weights)])
    return replay_ms(graph, replays) * 1e3 / calls


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,8,16,32,64")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--configs", default="16:256:4:4,32:256:4:4",
                    help="block_n:block_k:num_stages:num_warps, comma-separated")
    ap.add_argument("--split-k", default="",
                    help="skinny_gemm.split_k_linear's tilings too: block_n:block_k:waves:num_warps:num_stages[:tma], "
                         "comma-separated (tma: 1 loads the tiles by the tensor memory accelerator)")
    ap.add_argument("--quack", action="store_true", help="also quack's autotuned CuTe-DSL GEMMs (with and without "
                                                            "split-K in the search)")
    ap.add_argument("--out", default="bench/results/skinny_gemm.json")
    args = ap.parse_args(argv)
    from worker_svc.kernels.skinny_gemm import skinny_linear, split_k_linear

    gen = torch.Generator().manual_seed(0)
    rows_out = []
    for shape in args.shapes.split(","):
        n, k = SHAPES[shape]
        copies = cdiv(200_000_000, n * k * 2)
        weights = [(torch.randn(n, k, generator=gen) * 0.02).to("cuda", torch.bfloat16) for _ in range(copies)]
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, generator=gen).to("cuda", torch.bfloat16)
            reference = F.linear(x.float(), weights[0].float())
            kernels = {"cublas": F.linear}
            if args.quack:
                from quack.gemm_interface import gemm as quack_gemm
                kernels["quack"] = lambda x, w: quack_gemm(x, w.t(), tuned=True)
                kernels["quack split-k"] = lambda x, w: quack_gemm(x, w.t(), tuned=True, split_k=None)
            for config in filter(None, args.configs.split(",")):
                bn, bk, st, wp = (int(v) for v in config.split(":"))
                kernels[f"triton {config}"] = (lambda x, w, bn=bn, bk=bk, st=st, wp=wp:
                                               skinny_linear(x, w, BLOCK_N=bn, BLOCK_K=bk, num_stages=st,
                                                             num_warps=wp))
            for config in filter(None, args.split_k.split(",")):
                bn, bk, wv, wp, st, *tma = (int(v) for v in config.split(":"))
                kernels[f"split-k {config}"] = (lambda x, w, bn=bn, bk=bk, wv=wv, wp=wp, st=st, tma=any(tma):
                                                split_k_linear(x, w, block_n=bn, block_k=bk, waves=wv, num_warps=wp,
                                                               num_stages=st, tma=tma))
            for name, fn in kernels.items():
                try:
                    err = (fn(x, weights[0]).float() - reference).abs().max().item()
                    us = time_us(fn, weights, x)
                except Exception as e:  # a tile too large for shared memory: skipped, and said so
                    print(json.dumps({"shape": shape, "rows": rows, "kernel": name, "error": type(e).__name__}))
                    continue
                rows_out.append({"shape": shape, "rows": rows, "kernel": name, "us": round(us, 2),
                                 "tb_per_s": round(n * k * 2 / us / 1e6, 2), "max_abs_diff": round(err, 4)})
                print(json.dumps(rows_out[-1]), flush=True)
        del weights
        torch.cuda.empty_cache()
    record(args.out, "skinny_gemm", vars(args), rows_out)


if __name__ == "__main__":
    main()
