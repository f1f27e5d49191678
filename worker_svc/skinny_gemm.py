"""y = x W^T for a handful of tokens (decode batches), in Triton.

At a few rows the projection is a stream of the weight matrix: 0.88 GB per step for Qwen3-0.6B's layers,
0.21 ms at the H200's bandwidth. cuBLAS picks 64-column tiles there (one CTA per SM or fewer, each
reading one long strip) and moved 1.0-1.6 TB/s (bench/results/skinny_gemm.md). Here every program
owns BLOCK_N output columns for all rows, so the grid has N / BLOCK_N programs (64-384 for these
shapes), several per SM, each with num_stages loads in flight; the rows are padded to a tensor-core
tile of 16, whose wasted multiply-adds cost nothing while the loads bound the time.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


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


MAX_ROWS = 64  # a CUDA-graph batch size (cuda_graphs.capture_sizes): a batch and its padded graph agree


def tiles(rows: int, n: int, k: int) -> dict:
    """Measured best on the H200 for Qwen3-0.6B's shapes (bench/results/skinny_gemm.md). Row tiles are
    powers of two from 16, whose bounds (16, 32, 64) are CUDA-graph batch sizes too."""
    block_k = 256 if k % 256 == 0 else 128
    return dict(BLOCK_M=max(16, triton.next_power_of_2(rows)), BLOCK_N=16 if n <= 2048 else 32,
                BLOCK_K=block_k, num_stages=4, num_warps=4)


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.stride(1) == 1 and weight.stride(1) == 1
            and weight.shape[1] % 128 == 0 and x.dtype == weight.dtype)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, **overrides) -> torch.Tensor:
    """x: [rows, K]; weight: [N, K] (nn.Linear's layout). Returns [rows, N] in x's dtype. `overrides`
    replace entries of tiles() (the benchmark's sweep)."""
    rows, k = x.shape
    n = weight.shape[0]
    meta = tiles(rows, n, k) | overrides
    if k % meta["BLOCK_K"]:
        raise ValueError(f"K={k} is not a multiple of the {meta['BLOCK_K']}-wide tile")
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    _skinny_gemm[(triton.cdiv(n, meta["BLOCK_N"]),)](x, weight, y, rows, n, k, x.stride(0), weight.stride(0),
                                                    y.stride(0), **meta)
    return y
