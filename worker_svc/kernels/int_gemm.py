"""y = x W^T over packed integer groups (model/packed_ints.py: 32 / bits unsigned codes an int32 word along the input
columns, a float32 zero point and scale per output row and group of columns), on a GPU. reference.int_linear computes
the same in torch ops.

Up to FUSED_ROWS rows (decode steps), one kernel reads the words and multiplies as it unpacks (`fused`): a program
takes BLOCK_N weight rows and a range of the input columns (split-K, so that a few rows' product fills the GPU) and
computes y^T = W x^T on the tensor cores, the weight as the MMA's first operand, which it takes from registers. A tile
of 16 words a row holds 16 x (32 / bits) codes; the codes at bit offset j of the 16 words (columns c0 + j, c0 + j +
32 / bits, ...) form a [BLOCK_N, 16] operand against the x columns of the same indices, so unpacking is a shift and a
mask of the words as loaded, with no reshape. A code becomes a 16-bit float by its bits alone (OR-ed into the mantissa
of 128.0 in bfloat16 or 1,024.0 in float16: OFFSET + code exactly), and the group's zero point and scale apply to the
tile's sums, y += scale * (sum((OFFSET + code) x) - (OFFSET + zero) * sum(x)), in float32 throughout. The last
program of a row block to finish, counted on an atomic counter, adds the splits in their fixed order (the same sums
in a graph as eagerly).

Past FUSED_ROWS (prefills), a kernel dequantises the weight into a scratch tensor ((code - zero) * scale in float32,
rounded to x's dtype: the weight the dequantising path stores), then cuBLAS's GEMM multiplies: there the product is
bound by its FLOPs, and reading a 16-bit copy costs little beside them."""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from common.util import cdiv
from worker_svc.kernels import reference, split_k
from worker_svc.kernels.split_k import store_or_merge

BLOCK_N = 64
FUSED_ROWS = 32  # rows multiplied by the fused kernel; more go through a dequantised copy and cuBLAS
FMA_ROWS = 1  # rows the fused kernel multiplies by FMAs rather than on the tensor cores (at most 1)
WORDS = 16  # words of a row in a fused tile: the MMA's depth


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


@triton.jit
def _dot_tile(out, words, x_ptrs, x_row_ptrs, m_ok, zero, scale, BITS: tl.constexpr, MAGIC: tl.constexpr,
              OFFSET: tl.constexpr, PER: tl.constexpr):
    # out [BLOCK_N, BLOCK_M] += the tile's product on the tensor cores, x^T as the MMA's second operand
    x_sum = tl.sum(tl.load(x_row_ptrs, mask=m_ok[:, None], other=0.0).to(tl.float32), axis=1)
    acc = tl.zeros(out.shape, tl.float32)
    for j in tl.static_range(PER):
        codes = (words >> (j * BITS)) & ((1 << BITS) - 1)
        if MAGIC:
            w = (codes | MAGIC).to(tl.int16).to(x_ptrs.dtype.element_ty, bitcast=True)  # OFFSET + code
        else:
            w = codes.to(x_ptrs.dtype.element_ty)
        xt = tl.load(x_ptrs + j, mask=m_ok[None, :], other=0.0)
        acc = tl.dot(w, xt, acc, input_precision="ieee")  # float32 models: no TF32
    return out + scale[:, None] * (acc - (zero + OFFSET)[:, None] * x_sum[None, :])


@triton.jit
def _fma_tile(out, words, x_ptrs, zero, scale, BITS: tl.constexpr, PER: tl.constexpr):
    # out [BLOCK_N, WORDS] += the tile's products with one row of x by float32 FMAs (an MMA would pad it to 16 rows).
    # A code as a float without shifting it down: a half word in the mantissa of 2^23, masked to one code's field,
    # less 2^23, is the code times 2^(BITS h) (h: its place in the half), which x's column takes back exactly.
    HALF: tl.constexpr = PER // 2
    t = tl.zeros(out.shape, tl.float32)
    x_sum = tl.zeros([out.shape[1]], tl.float32)
    for half in tl.static_range(2):
        part = ((words >> (16 * half)) & 0xFFFF) | 0x4B000000
        factor = 1.0  # 2^-(BITS h)
        for h in tl.static_range(HALF):
            field = part & ((((1 << BITS) - 1) << (h * BITS)) | 0x4B000000)
            f = field.to(tl.float32, bitcast=True) - 8388608.0
            xj = tl.load(x_ptrs + half * HALF + h).to(tl.float32)
            t += f * (xj * factor)[None, :]
            x_sum += xj
            factor = factor / (1 << BITS)
    return out + scale[:, None] * (t - zero[:, None] * x_sum[None, :])


@triton.jit(do_not_specialize=["M"])
def _fused(X, W, Z, S, Bias, Y, Part, Counters, M, N, stride_x, stride_w, stride_g, stride_y, tiles_per_split,
           BITS: tl.constexpr, GROUP: tl.constexpr, MAGIC: tl.constexpr, OFFSET: tl.constexpr, HAS_BIAS: tl.constexpr,
           BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, WORDS: tl.constexpr, SPLITS: tl.constexpr, DOT: tl.constexpr):
    PER: tl.constexpr = 32 // BITS
    TILE_K: tl.constexpr = WORDS * PER
    block, split = tl.program_id(0), tl.program_id(1)
    n = block * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    i = tl.arange(0, WORDS)
    row_ok, m_ok = n < N, m < M
    w_ptrs = W + n[:, None].to(tl.int64) * stride_w + i[None, :]
    if DOT:
        out = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        x_ptrs = X + m[None, :] * stride_x + (i * PER)[:, None]  # x^T's rows c0 + PER i + j: x_ptrs + c0 + j
        x_row_ptrs = X + m[:, None] * stride_x + tl.arange(0, TILE_K)[None, :]
    else:  # one row
        out = tl.zeros([BLOCK_N, WORDS], tl.float32)
        x_ptrs = X + i * PER
    first = split * tiles_per_split
    last = first + tiles_per_split
    g_ptrs = n.to(tl.int64) * stride_g
    if DOT:  # Triton pipelines the words' loads into the MMAs
        for t in tl.range(first, last):
            c0 = t * TILE_K
            words = tl.load(w_ptrs + t * WORDS, mask=row_ok[:, None], other=0)
            zero = tl.load(Z + g_ptrs + c0 // GROUP, mask=row_ok, other=0.0)
            scale = tl.load(S + g_ptrs + c0 // GROUP, mask=row_ok, other=0.0)
            out = _dot_tile(out, words, x_ptrs + c0, x_row_ptrs + c0, m_ok, zero, scale, BITS, MAGIC, OFFSET, PER)
    else:  # nor does it pipeline a loop without a dot: the next tile's loads go out before this one's arithmetic
        words = tl.load(w_ptrs + first * WORDS, mask=row_ok[:, None], other=0)
        zero = tl.load(Z + g_ptrs + first * TILE_K // GROUP, mask=row_ok, other=0.0)
        scale = tl.load(S + g_ptrs + first * TILE_K // GROUP, mask=row_ok, other=0.0)
        for t in tl.range(first, last):
            ahead = n < tl.where(t + 1 < last, N, 0)  # rows present, while a next tile is
            next_words = tl.load(w_ptrs + (t + 1) * WORDS, mask=ahead[:, None], other=0)
            next_zero = tl.load(Z + g_ptrs + (t + 1) * TILE_K // GROUP, mask=ahead, other=0.0)
            next_scale = tl.load(S + g_ptrs + (t + 1) * TILE_K // GROUP, mask=ahead, other=0.0)
            out = _fma_tile(out, words, x_ptrs + t * TILE_K, zero, scale, BITS, PER)
            words, zero, scale = next_words, next_zero, next_scale
        out = tl.sum(out, axis=1)[:, None]
    store_or_merge(out, Y, Part, Counters, Bias, n, m, row_ok, m_ok, block, split, N, stride_y, HAS_BIAS, BLOCK_M,
                   SPLITS)


def supported(k: int, groups: int) -> bool:
    """Whether the kernels take a weight `k` columns wide in `groups` groups: of 16, 32, 64 or a multiple of 128
    columns (the torch reference does the rest)."""
    group = k // groups
    return k % groups == 0 and (group % 128 == 0 or group in (16, 32, 64))


def fused_fits(k: int, groups: int, bits: int) -> bool:
    """Whether the fused kernel takes such a weight: groups of whole tiles (WORDS words a row: 128 columns at 4 bits,
    64 at 8, 256 at 2)."""
    return k % groups == 0 and (k // groups) % (WORDS * 32 // bits) == 0


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


def block_m_for(rows: int, fma_rows: int = FMA_ROWS) -> int:
    """x's rows a fused program holds (the MMA's least is 16): one build of the kernel each."""
    return triton.next_power_of_2(rows) if rows <= fma_rows else max(16, triton.next_power_of_2(rows))


# a row count of each build of the fused kernel, for the runner's warm-up
WARM_UP_ROWS = tuple(sorted({block_m_for(r): r for r in range(FUSED_ROWS, 0, -1)}.values()))


def fused(x: torch.Tensor, weight: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor,
          bias: torch.Tensor | None = None, *, block_n: int = BLOCK_N, waves: int | None = None, num_warps: int = 4,
          num_stages: int = 3, fma_rows: int = FMA_ROWS) -> torch.Tensor:
    """y = x W^T by the fused kernel, for x of at most FUSED_ROWS rows and a weight that fused_fits (the keywords:
    its tiling, for `bench int-gemm`'s sweeps)."""
    rows, k = x.shape
    x = x if x.stride(1) == 1 else x.contiguous()
    n, groups = scale.shape
    bits = 32 * weight.shape[1] // k
    tiles = k // (WORDS * 32 // bits)
    dot = rows > fma_rows
    if waves is None:  # FMA programs are short of loads in flight: more of them an SM
        waves = 2 if dot else 4
    block_m = block_m_for(rows, fma_rows)
    splits, part, counters = split_k.plan(n, tiles, block_n, block_m, waves, x.device)
    magic, offset = {torch.bfloat16: (0x4300, 128.0), torch.float16: (0x6400, 1024.0)}.get(x.dtype, (0, 0.0))
    if x.dtype == torch.bfloat16 and bits > 7:  # 128 + code needs 8 mantissa bits: converted instead
        magic, offset = 0, 0.0
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    _fused[(cdiv(n, block_n), splits)](
        x, weight, zero, scale, y if bias is None else bias, y, part, counters, rows, n, x.stride(0), weight.stride(0),
        scale.stride(0), y.stride(0), tiles // splits, BITS=bits, GROUP=k // groups, MAGIC=magic, OFFSET=offset,
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_M=block_m, WORDS=WORDS, SPLITS=splits, DOT=dot,
        num_warps=num_warps, num_stages=num_stages)
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T: `weight` int32 words [N, K * bits / 32], `zero` and `scale` float32 [N, groups]; y in x's
    dtype."""
    k, groups = x.shape[-1], scale.shape[1]
    if not supported(k, groups):
        return reference.int_linear(x, weight, zero, scale, bias)
    rows = x.numel() // k
    if rows <= FUSED_ROWS and fused_fits(k, groups, 32 * weight.shape[1] // k):
        return fused(x.reshape(rows, k), weight, zero, scale, bias).reshape(*x.shape[:-1], -1)
    return F.linear(x, dequantize(weight, zero, scale, k, x.dtype), bias)
