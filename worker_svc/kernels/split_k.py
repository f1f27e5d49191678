"""What the split-K GEMMs for a few rows share (int_gemm.py's fused kernel, skinny_gemm.py's): a program computes
y^T's tile [BLOCK_N weight rows, BLOCK_M rows of x] over one range of the input columns, so that a product of a few
rows reads the weight with the whole GPU; the last program of a row block to finish, counted on an atomic counter,
adds the splits' partials in their fixed split order (the same sums in a CUDA graph as eagerly) and leaves its
counter zero for the next product."""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from common.util import cdiv

COUNTERS = 4096  # row blocks of one product at most


@triton.jit
def _store(y_ptrs, out, Bias, n, row_ok, live, HAS_BIAS: tl.constexpr):
    # y^T's tile [BLOCK_N, BLOCK_M], plus the bias (one a weight row), in Y's dtype
    if HAS_BIAS:
        out += tl.load(Bias + n, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(y_ptrs, out.to(y_ptrs.dtype.element_ty), mask=live)


@triton.jit
def store_or_merge(out, Y, Part, Counters, Bias, n, m, row_ok, m_ok, block, split, N, stride_y,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, SPLITS: tl.constexpr):
    """y[m, n] = this program's tile `out` (one split), or its partial; the last split of the row block to store
    one adds them all (Part: [SPLITS, BLOCK_M, N] float32)."""
    live = row_ok[:, None] & m_ok[None, :]
    y_ptrs = Y + m[None, :] * stride_y + n[:, None]
    if SPLITS == 1:
        _store(y_ptrs, out, Bias, n, row_ok, live, HAS_BIAS)
    else:
        part_ptrs = Part + m[None, :] * N + n[:, None]
        tl.store(part_ptrs + split * BLOCK_M * N, out, mask=live)
        tl.debug_barrier()
        if tl.atomic_add(Counters + block, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
            tl.debug_barrier()
            tl.store(Counters + block, 0)  # for the next product (and graph replay)
            total = tl.load(part_ptrs, mask=live, other=0.0, cache_modifier=".cg")
            for s in range(1, SPLITS):
                total += tl.load(part_ptrs + s * BLOCK_M * N, mask=live, other=0.0, cache_modifier=".cg")
            _store(y_ptrs, total, Bias, n, row_ok, live, HAS_BIAS)


@functools.cache
def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


@functools.cache
def counters(device: torch.device) -> torch.Tensor:
    """The split counters: zeros, which every product leaves zero again. Made by the first product on `device` (a
    warm-up's, before any graph is captured); the products run one at a time on the stream, so they share them."""
    return torch.zeros(COUNTERS, dtype=torch.int32, device=device)


@functools.cache  # eager steps ask it for every projection
def splits_for(n: int, tiles: int, sms: int, block_n: int, waves: int = 2) -> int:
    """Splits of the input columns for `n` output rows in `tiles` tiles: the fewest (a divisor of `tiles`) that give
    every SM `waves` programs, so that a product of a few rows reads the weight with the whole GPU."""
    blocks = cdiv(n, block_n)
    for s in range(1, tiles + 1):
        if tiles % s == 0 and blocks * s >= waves * sms:
            return s
    return tiles


def plan(n: int, tiles: int, block_n: int, block_m: int, waves: int, device: torch.device
         ) -> tuple[int, torch.Tensor, torch.Tensor]:
    """A product's launch: (its splits, the partials store_or_merge takes (none for one split), the counters), for
    `n` output rows in `tiles` tiles of the input columns."""
    assert cdiv(n, block_n) <= COUNTERS
    splits = splits_for(n, tiles, sm_count(device), block_n, waves)
    part = torch.empty(splits if splits > 1 else 0, block_m, n, dtype=torch.float32, device=device)
    return splits, part, counters(device)
