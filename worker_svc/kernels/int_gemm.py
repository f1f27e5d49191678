"""y = x W^T over packed integer groups (model/packed_ints.py: 32 / bits unsigned codes an int32 word along the input
columns, a float32 zero point and scale per output row and group of columns), on a GPU. reference.int_linear
computes the same in torch ops.

Up to SMALL_M rows (decode steps), one Triton kernel reads each weight tile as its words, unpacks and dequantises it in
registers ((code - zero) * scale in float32, rounded to x's dtype: the weight the dequantising path stores) and
multiplies it on the tensor cores, so a step reads bits / 16 of a 16-bit weight's bytes. Where the rows alone make
too few programs to keep the memory busy, each program takes a share of the input columns (split-K) into a float32
partial, and the partials are summed in a fixed order (no atomics: the same sums every run). More rows (prefills):
the weight dequantised into a scratch tensor by a second kernel, then cuBLAS's GEMM, whose FLOPs dwarf that pass."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

SMALL_M = 64  # rows up to which the fused kernel multiplies; above, dequantise then cuBLAS
BLOCK_N = 64
PROGRAMS_PER_SM = 2  # what split-K aims for


@triton.jit
def _unpacked(W, Z, S, n, k0, stride_w, stride_g, N, BITS: tl.constexpr, GROUP: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, dtype: tl.constexpr):
    # the weight's rows n, columns [k0, k0 + BLOCK_K) (one group), dequantised in float32 and rounded to dtype
    PER: tl.constexpr = 32 // BITS
    present = n < N
    words = tl.load(W + n[:, None].to(tl.int64) * stride_w + (k0 // PER + tl.arange(0, BLOCK_K // PER))[None, :],
                    mask=present[:, None], other=0)
    codes = (words[:, :, None] >> (tl.arange(0, PER) * BITS)[None, None, :]) & ((1 << BITS) - 1)
    codes = tl.reshape(codes, (BLOCK_N, BLOCK_K))
    zero = tl.load(Z + n.to(tl.int64) * stride_g + k0 // GROUP, mask=present, other=0.0)
    scale = tl.load(S + n.to(tl.int64) * stride_g + k0 // GROUP, mask=present, other=0.0)
    return ((codes.to(tl.float32) - zero[:, None]) * scale[:, None]).to(dtype)


@triton.jit(do_not_specialize=["M", "k_split"])  # one build whatever a step's row count
def _int_gemm(X, W, Z, S, Y, M, N, K, k_split, stride_x, stride_w, stride_g, stride_ys, stride_y,
              BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    start = tl.program_id(2) * k_split
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(start, tl.minimum(start + k_split, K), BLOCK_K):
        x = tl.load(X + m[:, None].to(tl.int64) * stride_x + (k0 + tl.arange(0, BLOCK_K))[None, :],
                    mask=m[:, None] < M, other=0.0)
        w = _unpacked(W, Z, S, n, k0, stride_w, stride_g, N, BITS, GROUP, BLOCK_N, BLOCK_K, X.dtype.element_ty)
        acc += tl.dot(x, tl.trans(w))
    out = Y + tl.program_id(2).to(tl.int64) * stride_ys + m[:, None].to(tl.int64) * stride_y + n[None, :]
    tl.store(out, acc.to(Y.dtype.element_ty), mask=(m[:, None] < M) & (n[None, :] < N))


@triton.jit
def _dequantize(W, Z, S, OUT, N, stride_w, stride_g, stride_o, BITS: tl.constexpr, GROUP: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    w = _unpacked(W, Z, S, n, k0, stride_w, stride_g, N, BITS, GROUP, BLOCK_N, BLOCK_K, OUT.dtype.element_ty)
    tl.store(OUT + n[:, None].to(tl.int64) * stride_o + (k0 + tl.arange(0, BLOCK_K))[None, :], w,
             mask=(n < N)[:, None])


@functools.cache
def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def block_k(group: int) -> int:
    """The columns a program takes at a time: within one group, whole words, a tensor-core tile's multiple."""
    return 128 if group % 128 == 0 else group


def supported(k: int, groups: int) -> bool:
    """Whether these kernels take a weight `k` columns wide in `groups` groups (groups of 16, 32, 64 or a multiple
    of 128 columns)."""
    group = k // groups
    return k % groups == 0 and (group % 128 == 0 or group in (16, 32, 64))


def dequantize(weight: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, k: int, dtype: torch.dtype
               ) -> torch.Tensor:
    """The packed weight [N, k] in `dtype`."""
    n, groups = scale.shape
    group = k // groups
    out = torch.empty(n, k, dtype=dtype, device=weight.device)
    _dequantize[(triton.cdiv(n, BLOCK_N), k // block_k(group))](
        weight, zero, scale, out, n, weight.stride(0), scale.stride(0), out.stride(0), BITS=32 * weight.shape[1] // k,
        GROUP=group, BLOCK_N=BLOCK_N, BLOCK_K=block_k(group), num_warps=4)
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T: `weight` int32 words [N, K * bits / 32], `zero` and `scale` float32 [N, groups]; y in x's
    dtype."""
    k = x.shape[-1]
    rows = x.shape[:-1]
    x = x.reshape(-1, k)
    m, (n, groups) = x.shape[0], scale.shape
    if m > SMALL_M or not supported(k, groups):
        return F.linear(x, dequantize(weight, zero, scale, k, x.dtype), bias).unflatten(0, rows)
    if x.stride(-1) != 1:
        x = x.contiguous()
    group = k // groups
    bk, bm = block_k(group), max(16, triton.next_power_of_2(m))
    tiles = triton.cdiv(n, BLOCK_N) * triton.cdiv(m, bm)
    splits = max(1, min(k // bk, PROGRAMS_PER_SM * _sms(x.device) // tiles))
    k_split = triton.cdiv(k // bk, splits) * bk
    splits = triton.cdiv(k, k_split)
    y = torch.empty(splits, m, n, dtype=torch.float32 if splits > 1 else x.dtype, device=x.device)
    _int_gemm[(triton.cdiv(n, BLOCK_N), triton.cdiv(m, bm), splits)](
        x, weight, zero, scale, y, m, n, k, k_split, x.stride(0), weight.stride(0), scale.stride(0), y.stride(0),
        y.stride(1), BITS=32 * weight.shape[1] // k, GROUP=group, BLOCK_M=bm, BLOCK_N=BLOCK_N, BLOCK_K=bk,
        num_warps=4, num_stages=3)
    y = y[0] if splits == 1 else y.sum(0).to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.unflatten(0, rows)
