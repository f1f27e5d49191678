"""A LoRA-adapted projection's delta for a few tokens in one kernel: y[t] += (x[t] A_s^T) B_s^T, with s the slot of
token t's adapter (none: y[t] stays), where model/lora.py's dense path runs three kernels (x A^T over every slot, the
mask of each token's slot, the B product). Each program takes one token and a range of output columns: it reduces
x[t] against its slot's rows of A (recomputed by each of the token's programs: the slot's A is small and stays in
L2), then adds the B product to its columns. The work grows with the tokens, not with the slots, so decode steps of
a few sequences use it (MAX_ROWS) and larger ones the dense GEMMs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 8  # tokens up to which a step takes this kernel (bench/NOTES.md, "LoRA")


@triton.jit
def _lora_delta(X, Y, A, B, SLOT, N, K, stride_x, stride_y, stride_a, stride_b, N_PER_PROGRAM,
                W: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(SLOT + t)
    if slot >= 0:
        w = tl.arange(0, BLOCK_W)
        k = tl.arange(0, BLOCK_K)
        rows = (slot * W + w).to(tl.int64)
        h = tl.zeros([BLOCK_W], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + k
            x = tl.load(X + t * stride_x + ks, mask=ks < K, other=0.0).to(tl.float32)
            a = tl.load(A + rows[:, None] * stride_a + ks[None, :], mask=(w[:, None] < W) & (ks[None, :] < K),
                        other=0.0).to(tl.float32)
            h += tl.sum(a * x[None, :], axis=1)
        start = tl.program_id(1) * N_PER_PROGRAM
        for n0 in range(start, start + N_PER_PROGRAM, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            cols = n < N
            b = tl.load(B + n[:, None].to(tl.int64) * stride_b + (slot * W + w)[None, :],
                        mask=cols[:, None] & (w[None, :] < W), other=0.0).to(tl.float32)
            delta = tl.sum(b * h[None, :], axis=1)
            y = tl.load(Y + t * stride_y + n, mask=cols, other=0.0).to(tl.float32)
            tl.store(Y + t * stride_y + n, (y + delta).to(Y.dtype.element_ty), mask=cols)


def lora_delta(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slot_of_token: torch.Tensor,
               width: int) -> torch.Tensor | None:
    """y (x's projection, [T, N]) plus each token's adapter's delta, in place; None where this kernel does not
    take the step (more than MAX_ROWS tokens, or strides it does not expect): the caller runs the dense path.
    a: [slots * width, K]; b: [N, slots * width]; slot_of_token: int64 [T], -1 where a token has no adapter."""
    t, k = x.shape
    n = y.shape[1]
    if t > MAX_ROWS or x.stride(1) != 1 or y.stride(1) != 1 or a.stride(1) != 1 or b.stride(1) != 1:
        return None
    block_n = 128
    programs = min(triton.cdiv(n, block_n), 8)  # per token
    per_program = triton.cdiv(triton.cdiv(n, programs), block_n) * block_n
    _lora_delta[(t, triton.cdiv(n, per_program))](
        x, y, a, b, slot_of_token, n, k, x.stride(0), y.stride(0), a.stride(0), b.stride(0), per_program,
        W=width, BLOCK_W=max(16, triton.next_power_of_2(width)), BLOCK_K=128, BLOCK_N=block_n, num_warps=4)
    return y
