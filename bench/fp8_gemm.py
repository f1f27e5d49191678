"""The projections in FP8 blocks (worker_svc/kernels/fp8_gemm.py: the input quantised per token and 128 columns,
then cuBLAS's block-scaled GEMM) against cuBLAS's bfloat16 GEMM, per call, at decode and prefill rows.

Each call reads a different copy of the weight (copies fill well past the 50 MB L2, as a model's layers do), 20
calls per CUDA graph, replayed: GPU time with cold weights. `fp8` is the whole linear, `fp8 gemm` cuBLAS's part
alone (the input quantised once, outside the graph). Checks each against reference.fp8_linear (the same
quantisation in float32 torch ops) and reports its error against the bfloat16 product.

python -m bench fp8-gemm
python -m bench fp8-gemm --shapes qkv,o,gate_up,down --rows 1,64,256,16384
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
    ap.add_argument("--rows", default="1,16,64,128,256,1024,16384")
    ap.add_argument("--shapes", default="qkv_8b,o_8b,gate_up_8b,down_8b")
    ap.add_argument("--out", default="bench/results/fp8_gemm.json")
    args = ap.parse_args(argv)
    from worker_svc.kernels import fp8_gemm, reference
    from worker_svc.model.quantized import quantize_blocks

    gen = torch.Generator().manual_seed(0)
    rows_out = []
    for shape in args.shapes.split(","):
        n, k = SHAPES[shape]
        copies = cdiv(400_000_000, n * k * 2)
        weights = [(torch.randn(n, k, generator=gen) * 0.02).to("cuda", torch.bfloat16) for _ in range(copies)]
        fp8 = [quantize_blocks(w) for w in weights]
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, generator=gen).to("cuda", torch.bfloat16)
            exact = F.linear(x.float(), weights[0].float())
            expected = reference.fp8_linear(x, *fp8[0]).float()
            q, x_scale = fp8_gemm.quantize_rows(x)
            kernels = {
                "bf16": (lambda x, w: F.linear(x, w), weights),
                "fp8": (lambda x, w: fp8_gemm.linear(x, *w), fp8),
                "fp8 gemm": (lambda x, w: torch._scaled_mm(q, w[0].t(), scale_a=x_scale, scale_b=w[1].t(),
                                                           out_dtype=torch.bfloat16), fp8),
            }
            for name, (fn, ws) in kernels.items():
                try:
                    y = fn(x, ws[0])[:rows].float()
                    us = time_us(fn, ws, x)
                except Exception as e:  # a GEMM cuBLAS lacks: said, skipped
                    print(json.dumps({"shape": shape, "rows": rows, "kernel": name, "error": repr(e)[:300]}))
                    continue
                bytes_ = n * k * (2 if name == "bf16" else 1)
                rows_out.append({
                    "shape": shape, "rows": rows, "kernel": name, "us": round(us, 2),
                    "tb_per_s": round(bytes_ / us / 1e6, 2), "tflop_per_s": round(2 * rows * n * k / us / 1e6, 1),
                    "vs_reference": round(((y - expected).norm() / expected.norm()).item(), 5),
                    "vs_bf16_exact": round(((y - exact).norm() / exact.norm()).item(), 5)})
                print(json.dumps(rows_out[-1]), flush=True)
        del weights, fp8
        torch.cuda.empty_cache()
    record(args.out, "fp8_gemm", vars(args), rows_out)


if __name__ == "__main__":
    main()
