"""y = x W^T over FP8 weights in 128 x 128 blocks, each with its float32 scale (DeepSeek's recipe, the one FP8
checkpoints are published in; model/quantized.py makes the blocks), on an sm_90 GPU: one Triton kernel quantises x as
it arrives, per token and 128 columns (1 x 128 groups, each group's largest magnitude at e4m3's 448), then cuBLAS's
block-scaled GEMM (torch._scaled_mm, CUDA >= 12.9) multiplies, accumulating in float32 over the groups' and the
blocks' scales. reference.fp8_linear computes the same in torch ops."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker_svc.kernels.reference import E4M3_MAX, FP8_GROUP

GROUPS_PER_PROGRAM = 4
# A weight's input width, in 128-column blocks, must be a multiple of this: torch's check of the weight's scales asks
# for rows of K / 128 packed while cuBLAS reads them padded to 4 blocks (torch 2.11, CUDA 13, H100: a weight 128 wide
# multiplied its second row of blocks by the wrong scale), and at whole multiples of 4 the two layouts are one.
K_BLOCKS = 4


@triton.jit(do_not_specialize=["rows", "stride_s"])  # one build whatever a step's token count (stride_s: rows)
def _quantize_rows(X, Q, S, rows, groups, stride_x, stride_q, stride_s,
                   GROUPS: tl.constexpr, GROUP: tl.constexpr, E4M3_MAX: tl.constexpr):
    # GROUPS groups of GROUP columns of one row; rows past `rows` (cuBLAS's padding to 4) become 0 with scale 1
    row = tl.program_id(0)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    present = cols < groups * GROUP
    x = tl.load(X + row.to(tl.int64) * stride_x + cols, mask=present & (cols * 0 + row < rows), other=0.0)
    x = x.to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1) / E4M3_MAX, 1e-12)
    q = tl.clamp(x / scale[:, None], -E4M3_MAX, E4M3_MAX)
    tl.store(Q + row.to(tl.int64) * stride_q + cols, q.to(Q.dtype.element_ty), mask=present)
    tl.store(S + g * stride_s + row, tl.where(row < rows, scale, 1.0), mask=g < groups)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M4, K], float32 scales [M4, K / 128] with the rows innermost, as cuBLAS reads them); M4: M
    rounded up to 4 (cuBLAS's least), the padding rows 0."""
    m, k = x.shape
    m4, groups = -(-m // 4) * 4, k // FP8_GROUP
    q = torch.empty(m4, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(groups, m4, dtype=torch.float32, device=x.device)
    _quantize_rows[(m4, triton.cdiv(groups, GROUPS_PER_PROGRAM))](
        x, q, scale, m, groups, x.stride(0), q.stride(0), scale.stride(0), GROUPS=GROUPS_PER_PROGRAM,
        GROUP=FP8_GROUP, E4M3_MAX=E4M3_MAX, num_warps=4)
    return q, scale.t()


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """y = x W^T: `weight` e4m3 [N, K] (K a multiple of K_BLOCKS blocks), `scale` its block scales [N / 128, K / 128]
    (model/quantized.py); y in x's dtype."""
    rows = x.shape[:-1]
    x = x.reshape(-1, x.shape[-1])
    if x.stride(-1) != 1:
        x = x.contiguous()
    q, x_scale = quantize_rows(x)
    y = torch._scaled_mm(q, weight.t(), scale_a=x_scale, scale_b=scale.t(), out_dtype=x.dtype)[:x.shape[0]]
    if bias is not None:
        y = y + bias
    return y.unflatten(0, rows)
