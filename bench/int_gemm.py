"""Projections in packed integer groups (worker_svc/kernels/int_gemm.py: the fused kernel up to its FUSED_ROWS, the
weight dequantised by a Triton kernel then cuBLAS's GEMM past them; `int4 dequantised` is the latter at every row
count) against cuBLAS's bfloat16 GEMM, per call, at decode and prefill rows.

Each call reads a different copy of the weight (copies fill well past the 50 MB L2, as a model's layers do), 20
calls per CUDA graph, replayed: GPU time with cold weights. Reports each against the bfloat16 product of the same
dequantised weight, and the bytes read: the words and the groups' zero points and scales.

python -m bench int-gemm
python -m bench int-gemm --shapes qkv,o,gate_up,down --rows 1,64,256 --bits 4,8 --group 128
python -m bench int-gemm --rows 1,16,64 --bits 4 --configs 64:2:4:3,32:4:4:3   # fused tilings, beside the default
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from bench.record import record
from bench.skinny_gemm import SHAPES, time_us
from common.util import cdiv


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,16,32,64,128,256,16384")
    ap.add_argument("--shapes", default="qkv_8b,o_8b,gate_up_8b,down_8b")
    ap.add_argument("--bits", default="4,8")
    ap.add_argument("--group", type=int, default=128, help="input columns a group (-1: one group a row)")
    ap.add_argument("--configs", default="", help="fused kernel tilings to time at its rows as well: "
                                                   "block_n:waves:num_warps:num_stages[:fma_rows], comma-separated")
    ap.add_argument("--out", default="bench/results/int_gemm.json")
    args = ap.parse_args(argv)
    from worker_svc.kernels import int_gemm, reference

    gen = torch.Generator().manual_seed(0)
    rows_out = []
    for shape in args.shapes.split(","):
        n, k = SHAPES[shape]
        groups = 1 if args.group == -1 else k // args.group
        copies = cdiv(400_000_000, n * k * 2)
        dense = [(torch.randn(n, k, generator=gen) * 0.02).to("cuda", torch.bfloat16) for _ in range(copies)]
        packed = {}
        for bits in (int(b) for b in args.bits.split(",")):
            packed[bits] = [(torch.randint(-2 ** 31, 2 ** 31, (n, k * bits // 32), dtype=torch.int32, device="cuda"),
                             torch.randint(0, 2 ** bits, (n, groups), device="cuda").float(),
                             torch.rand(n, groups, device="cuda") * 0.02)  # random words: random codes
                            for _ in range(cdiv(400_000_000, n * k * bits // 8))]
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, generator=gen).to("cuda", torch.bfloat16)
            kernels = {"bf16": (lambda x, w: F.linear(x, w), dense, n * k * 2, None)}
            for bits, parts in packed.items():
                w = reference.dequantize_ints(*parts[0], bits).to(torch.bfloat16)
                read = n * k * bits // 8 + n * groups * 8  # words, zero points and scales
                kernels[f"int{bits}"] = (lambda x, w: int_gemm.linear(x, *w), parts, read,
                                         F.linear(x.float(), w.float()))
                for config in filter(None, args.configs.split(",")) if rows <= int_gemm.FUSED_ROWS else ():
                    block_n, waves, warps, stages, *fma = map(int, config.split(":"))
                    kernels[f"int{bits} {config}"] = (
                        lambda x, w, b=block_n, v=waves, nw=warps, ns=stages, f=(fma or [int_gemm.FMA_ROWS])[0]:
                        int_gemm.fused(x, *w, block_n=b, waves=v, num_warps=nw, num_stages=ns, fma_rows=f), parts, read,
                        F.linear(x.float(), w.float()))
                if rows <= int_gemm.FUSED_ROWS:
                    kernels[f"int{bits} dequantised"] = (
                        lambda x, w: F.linear(x, int_gemm.dequantize(*w, x.shape[-1], x.dtype)), parts, read,
                        F.linear(x.float(), w.float()))
            for name, (fn, ws, bytes_, expected) in kernels.items():
                y = fn(x, ws[0]).float()
                us = time_us(fn, ws, x)
                rows_out.append({
                    "shape": shape, "rows": rows, "kernel": name, "us": round(us, 2),
                    "tb_per_s": round(bytes_ / us / 1e6, 2), "tflop_per_s": round(2 * rows * n * k / us / 1e6, 1),
                    "vs_dequantised": None if expected is None else round(
                        ((y - expected).norm() / expected.norm()).item(), 5)})
                print(json.dumps(rows_out[-1]), flush=True)
        del dense, packed
        torch.cuda.empty_cache()
    record(args.out, "int_gemm", vars(args), rows_out)


if __name__ == "__main__":
    main()
