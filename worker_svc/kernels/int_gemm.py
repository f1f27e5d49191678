"""y = x W^T over packed integer groups (model/packed_ints.py: 32 / bits unsigned codes an int32 word along the input
columns, a float32 zero point and scale per output row and group of columns), on a GPU: one Triton kernel dequantises
the weight into a scratch tensor ((code - zero) * scale in float32, rounded to x's dtype: the weight the dequantising
path stores), then cuBLAS's GEMM. reference.int_linear computes the same in torch ops.

A step reads the packed weight and writes and reads its 16-bit copy, so each GEMM takes about twice a 16-bit one's
time at decode rows, the price of a quarter of the memory at 4 bits (bench/NOTES.md, "Packed integer groups": a
kernel multiplying the tiles as it dequantises them was slower still)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from worker_svc.kernels import reference

BLOCK_N = 64


@triton.jit
def _dequantize(W, Z, S, OUT, N, stride_w, stride_g, stride_o, BITS: tl.constexpr, GROUP: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # rows n, columns [k0, k0 + BLOCK_K) (within one group)
    PER: tl.constexpr = 32 // BITS
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    present = n < N
    words = tl.load(W + n[:, None].to(tl.int64) * stride_w + (k0 // PER + tl.arange(0, BLOCK_K // PER))[None, :],
                    mask=present[:, None], other=0)
    codes = (words[:, :, None] >> (tl.arange(0, PER) * BITS)[None, None, :]) & ((1 << BITS) - 1)
    codes = tl.reshape(codes, (BLOCK_N, BLOCK_K))
    zero = tl.load(Z + n.to(tl.int64) * stride_g + k0 // GROUP, mask=present, other=0.0)
    scale = tl.load(S + n.to(tl.int64) * stride_g + k0 // GROUP, mask=present, other=0.0)
    w = ((codes.to(tl.float32) - zero[:, None]) * scale[:, None]).to(OUT.dtype.element_ty)
    tl.store(OUT + n[:, None].to(tl.int64) * stride_o + (k0 + tl.arange(0, BLOCK_K))[None, :], w,
             mask=present[:, None])


def supported(k: int, groups: int) -> bool:
    """Whether the kernel takes a weight `k` columns wide in `groups` groups: of 16, 32, 64 or a multiple of 128
    columns (the torch reference does the rest)."""
    group = k // groups
    return k % groups == 0 and (group % 128 == 0 or group in (16, 32, 64))


def block_k(group: int) -> int:
    """The columns a program dequantises: within one group, whole words."""
    return 128 if group % 128 == 0 else group


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
    if not supported(x.shape[-1], scale.shape[1]):
        return reference.int_linear(x, weight, zero, scale, bias)
    return F.linear(x, dequantize(weight, zero, scale, x.shape[-1], x.dtype), bias)
