"""A decode layer's four projections chained over 28 layers: cuBLAS against Triton GEMMs launched plainly,
with programmatic dependent launch (PDL: the next kernel's programs start while this one drains and wait
at griddepcontrol.wait), and with PDL plus an L2 prefetch of each program's weight slice before that wait.

The question it answers: how much of a decode step's time outside attention is launch gaps and ramps
between small kernels, which PDL overlaps, rather than weight bytes. Each GEMM reads the previous one's
output (qkv -> o -> gate_up -> down -> the next layer's qkv), every layer has its own weights (28 layers
fill well past the L2), the chain is captured in one CUDA graph and replayed: GPU time per layer.

python -m bench pdl-chain
python -m bench pdl-chain --rows 64,128,256 --layers 28
"""
from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from bench.decode_attention import graph_time_us
from bench.record import record

SHAPES = [("qkv", 4096, 1024), ("o", 1024, 2048), ("gate_up", 6144, 1024), ("down", 1024, 3072)]  # (N, K)


@triton.jit
def _prefetch_l2(ptrs):
    return tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n mov.u32 $0, 0;", "=r,l", [ptrs],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _gemm(X, W, Y, M, N, K, stride_xm, stride_wn, stride_ym,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
          PREFETCH: tl.constexpr):
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    w_rows = W + n[:, None].to(tl.int64) * stride_wn
    if PREFETCH:  # the weights do not depend on the kernel before: pull this program's slice into L2 now
        line = tl.arange(0, BLOCK_K // 64) * 64  # one pointer per 128-byte line
        for k0 in range(0, K, BLOCK_K):
            _prefetch_l2(w_rows + k0 + line[None, :])
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x_ptrs = X + m[:, None] * stride_xm + k[None, :]
    w_ptrs = w_rows + k[None, :]
    rows = m[:, None] < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for _ in range(0, K, BLOCK_K):
        x = tl.load(x_ptrs, mask=rows, other=0.0)
        w = tl.load(w_ptrs)
        acc += tl.dot(x, tl.trans(w))
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    tl.store(Y + m[:, None] * stride_ym + n[None, :], acc.to(Y.dtype.element_ty), mask=rows)


def gemm(x, w, y, cfg: tuple[int, int, int, int, int], pdl: bool, prefetch: bool) -> None:
    bm, bn, bk, stages, warps = cfg
    rows, k = x.shape
    grid = (w.shape[0] // bn, triton.cdiv(rows, bm))
    _gemm[grid](x, w, y, rows, w.shape[0], k, x.stride(0), w.stride(0), y.stride(0), BLOCK_M=bm, BLOCK_N=bn,
                BLOCK_K=bk, PDL=pdl, PREFETCH=prefetch, num_stages=stages, num_warps=warps, launch_pdl=pdl)


def configs(rows: int) -> list[tuple[int, int, int, int, int]]:
    tiles_m = sorted({min(bm, max(16, triton.next_power_of_2(rows))) for bm in (64, 128)})
    return [(bm, bn, bk, 4, 4) for bm in tiles_m for bn in (16, 32, 64) for bk in (64, 128)]


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="64,128,256")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--out", default="bench/results/pdl_chain.json")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    weights = [[torch.randn(n, k, device=dev, dtype=dt) * k ** -0.5 for _, n, k in SHAPES]
               for _ in range(args.layers)]
    rows_out = []
    for rows in [int(r) for r in args.rows.split(",")]:
        x0 = torch.randn(rows, 1024, device=dev, dtype=dt)
        outs = [torch.empty(rows, n, device=dev, dtype=dt) for _, n, _ in SHAPES]

        def inputs(i):  # what GEMM i reads: a prefix of the previous output, as a strided view
            prev = outs[i - 1] if i else outs[-1]
            return prev[:, :SHAPES[i][2]]

        def chain(op):
            outs[-1].copy_(x0)
            for layer in weights:
                for i, w in enumerate(layer):
                    op(i, inputs(i), w, outs[i])

        # the best config per GEMM shape, timed one GEMM at a time over the layers' weights
        best = []
        for i, (name, n, k) in enumerate(SHAPES):
            timed = []
            for cfg in configs(rows):
                if n % cfg[1] or k % cfg[2]:
                    continue
                try:
                    timed.append((graph_time_us(lambda: [gemm(inputs(i), layer[i], outs[i], cfg, False, False)
                                                         for layer in weights], 1, args.replays) / args.layers, cfg))
                except Exception as e:  # a config that does not fit (shared memory): skip it
                    print(f"skip {name} {cfg}: {type(e).__name__}")
            best.append(min(timed)[1])
            print(f"rows {rows} {name}: best {min(timed)}")

        ref = None
        row = {"rows": rows, "configs": {s[0]: c for s, c in zip(SHAPES, best)}}
        variants = {
            "cublas": lambda i, x, w, y: torch.mm(x, w.t(), out=y),
            "triton": lambda i, x, w, y: gemm(x, w, y, best[i], False, False),
            "triton_pdl": lambda i, x, w, y: gemm(x, w, y, best[i], True, False),
            "triton_pdl_prefetch": lambda i, x, w, y: gemm(x, w, y, best[i], True, True),
            "triton_prefetch": lambda i, x, w, y: gemm(x, w, y, best[i], False, True),
        }
        for name, op in variants.items():
            row[f"{name}_us_per_layer"] = round(graph_time_us(lambda: chain(op), 1, args.replays) / args.layers, 2)
            chain(op)
            torch.cuda.synchronize()
            got = outs[-1].float().clone()
            if ref is None:
                ref = got
            row[f"{name}_max_err"] = round(float((got - ref).abs().max() / ref.abs().max()), 4)
        weight_mb = sum(n * k * 2 for _, n, k in SHAPES) / 1e6
        row["weights_mb_per_layer"] = round(weight_mb, 2)
        row["floor_us_per_layer_at_4_3_tb_s"] = round(weight_mb / 4.3e6 * 1e6, 2)
        print(row)
        rows_out.append(row)
    record(args.out, "pdl_chain", vars(args), rows_out)


if __name__ == "__main__":
    main()
