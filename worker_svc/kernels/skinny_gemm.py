"""y = x W^T for a single token, in Triton: one decoding sequence's projections.

At 1-64 rows cuBLAS and this kernel run at the same per-kernel floor for the projections of small models,
except for a single row with K <= 2048, where cuBLAS takes a split-K kernel about twice as slow
(bench/results/skinny_gemm.md). So a batch of one uses this kernel for those shapes, cuBLAS does the rest. Every
program owns BLOCK_N output columns and streams them through num_stages loads in flight; the row is padded to a
tensor-core tile of 16.

`split_k_linear` (timed against cuBLAS by `bench skinny-gemm --split-k`, not served yet) takes a few rows the other
way round: y^T = W x^T, the weight as the MMA's first operand (BLOCK_N of its rows a program, so that the rows of x
are the narrow side of the tile) over one range of the input columns (split_k.py: the splits give every SM programs,
the last one of a row block adds them).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from common.util import cdiv
from worker_svc.kernels import fp8_gemm, int_gemm, split_k
from worker_svc.kernels.precision import dot
from worker_svc.kernels.split_k import store_or_merge


@triton.jit
def _skinny_gemm(X, W, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    k = tl.arange(0, BLOCK_K)
    x_ptrs = X + m[:, None] * stride_xm + k[None, :]
    w_ptrs = W + n[:, None].to(tl.int64) * stride_wn + k[None, :]
    rows, cols = m[:, None] < M, n[:, None] < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for _ in range(0, K, BLOCK_K):  # the host checks that BLOCK_K divides K
        x = tl.load(x_ptrs, mask=rows, other=0.0)
        w = tl.load(w_ptrs, mask=cols, other=0.0)
        acc += tl.dot(x, tl.trans(w))
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    tl.store(Y + m[:, None] * stride_ym + n[None, :], acc.to(Y.dtype.element_ty), mask=rows & (n[None, :] < N))


@triton.jit(do_not_specialize=["M"])
def _split_k_gemm(X, W, Bias, Y, Part, Counters, M, N, stride_x, stride_w, stride_y, k_per_split,
                  HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                  SPLITS: tl.constexpr, TMA: tl.constexpr):
    # TMA: X and W are tensor descriptors ([BLOCK_M, BLOCK_K] and [BLOCK_N, BLOCK_K] tiles, zeros past the edges)
    block, split = tl.program_id(0), tl.program_id(1)
    n = block * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    k0 = split * k_per_split
    row_ok, m_ok = n < N, m < M
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    if TMA:
        for k in range(k0, k0 + k_per_split, BLOCK_K):
            acc += dot(W.load([block * BLOCK_N, k]), tl.trans(X.load([0, k])))
    else:
        k = k0 + tl.arange(0, BLOCK_K)
        w_ptrs = W + n[:, None].to(tl.int64) * stride_w + k[None, :]
        x_ptrs = X + m[None, :] * stride_x + k[:, None]  # x^T's tile [BLOCK_K, BLOCK_M]
        for _ in range(0, k_per_split, BLOCK_K):
            w = tl.load(w_ptrs, mask=row_ok[:, None], other=0.0)
            xt = tl.load(x_ptrs, mask=m_ok[None, :], other=0.0)
            acc += dot(w, xt)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
    store_or_merge(acc, Y, Part, Counters, Bias, n, m, row_ok, m_ok, block, split, N, stride_y, HAS_BIAS, BLOCK_M,
                   SPLITS)


def split_k_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, block_n: int = 64,
                   block_k: int = 128, waves: int = 2, num_warps: int = 4, num_stages: int = 4,
                   tma: bool = False) -> torch.Tensor:
    """x: [rows, K] (K a multiple of block_k); weight: [N, K]. Returns [rows, N] in x's dtype: each output column's
    sum in float32 over the splits' partials in split order. tma: the tiles loaded by the tensor memory accelerator
    (Hopper and later, or Triton's interpreter)."""
    rows, k = x.shape
    n = weight.shape[0]
    if k % block_k:
        raise ValueError(f"K={k} is not a multiple of the {block_k}-wide tile")
    x = x if x.stride(1) == 1 else x.contiguous()
    tiles = k // block_k
    block_m = max(16, triton.next_power_of_2(rows))
    splits, part, counters = split_k.plan(n, tiles, block_n, block_m, waves, x.device)
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    xs, ws = x, weight
    if tma:
        xs = TensorDescriptor(x, [rows, k], [x.stride(0), 1], [block_m, block_k])
        ws = TensorDescriptor(weight, [n, k], [weight.stride(0), 1], [block_n, block_k])
    _split_k_gemm[(cdiv(n, block_n), splits)](
        xs, ws, y if bias is None else bias, y, part, counters, rows, n, x.stride(0), weight.stride(0), y.stride(0),
        tiles // splits * block_k,
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_M=block_m, BLOCK_K=block_k, SPLITS=splits, TMA=tma,
        num_warps=num_warps, num_stages=num_stages)
    return y


def tiles(n: int) -> dict:
    """The best measured for one row and N output columns on the H200 (bench/results/skinny_gemm.md)."""
    if n <= 2048:
        return dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=256, num_stages=5, num_warps=4)
    return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_stages=5, num_warps=4)


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """One row (a decode step of one sequence: a CUDA-graph batch size of its own), K <= 2048, 16-bit
    weights (float32 would go through TF32 here, coarser than cuBLAS's float32)."""
    return (x.dim() == 2 and x.shape[0] == 1 and weight.shape[1] <= 2048 and weight.shape[1] % 256 == 0
            and x.stride(1) == 1 and weight.stride(1) == 1 and x.dtype == weight.dtype
            and x.dtype in (torch.bfloat16, torch.float16))


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, **overrides) -> torch.Tensor:
    """x: [rows, K]; weight: [N, K] (nn.Linear's layout). Returns [rows, N] in x's dtype. Any row count
    works; `overrides` replace entries of tiles() (the benchmark's sweep)."""
    rows, k = x.shape
    n = weight.shape[0]
    meta = tiles(n) | {"BLOCK_M": max(16, triton.next_power_of_2(rows))} | overrides
    if k % meta["BLOCK_K"]:
        raise ValueError(f"K={k} is not a multiple of the {meta['BLOCK_K']}-wide tile")
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    _skinny_gemm[(triton.cdiv(n, meta["BLOCK_N"]),)](x, weight, y, rows, n, k, x.stride(0), weight.stride(0),
                                                    y.stride(0), **meta)
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           scale: torch.Tensor | None = None, zero: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, with this kernel where supported() (no bias); with `zero`, `weight` is packed integer groups with
    those zero points and `scale`s (int_gemm.py); with `scale` alone, FP8 in blocks with those scales (fp8_gemm.py)."""
    if zero is not None:
        return int_gemm.linear(x, weight, zero, scale, bias)
    if scale is not None:
        return fp8_gemm.linear(x, weight, scale, bias)
    if bias is None and supported(x, weight):
        return skinny_linear(x, weight)
    return torch.nn.functional.linear(x, weight, bias)
