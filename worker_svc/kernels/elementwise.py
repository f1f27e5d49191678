"""The transformer's elementwise pieces as Triton kernels for the GPU, each rounding to the activation
dtype where the references (reference.py) do, so both paths give the same values:

- RMSNorm, with the residual add fused;
- SwiGLU (silu(gate) * up) and GeGLU (gelu(gate) * up, tanh approximation);
- between the QKV projection and attention, one kernel for per-head RMSNorm of q and k (Qwen3), rotary
  embedding, and the store of k and v into the paged KV cache (eight kernels when compiled separately),
  quantised to fp8 there when the cache is fp8.

Hand-written rather than torch.compile'd: compiled ops cost host time on every call of an eager (mixed)
step, guards of dynamic shapes included, and their SwiGLU fell short of the bandwidth on long prefills
(bench/NOTES.md)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def tanh(x):
    """tanh from exp of a non-positive argument (no overflow)."""
    t = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - t) / (1.0 + t)
    return tl.where(x >= 0, t, -t)


@triton.jit
def _weighted(x, r, w, dtype: tl.constexpr):
    """RMSNorm's output from float32 x, its 1/rms r and weight w, rounded to `dtype` where the eager
    pieces round: the normalised x, then its product with the weight."""
    return ((x * r).to(dtype).to(tl.float32) * w.to(tl.float32)).to(dtype)


@triton.jit
def _to_cache(x, dst, scale_inv, dtype: tl.constexpr):
    """x rounded to the activation `dtype`; into an fp8 cache (dst's dtype other than `dtype`) as x / scale,
    saturated to e4m3's largest finite value."""
    x = x.to(dtype)
    if dst.dtype.element_ty != dtype:
        x = tl.clamp(x.to(tl.float32) * scale_inv, -448.0, 448.0).to(dst.dtype.element_ty)
    return x


@triton.jit
def _norm_rope_store(src, dst, W, cos, sin, eps, live, scale_inv, dtype: tl.constexpr, HALF: tl.constexpr,
                     HALF_PAD: tl.constexpr, NORM: tl.constexpr):
    """src, dst: [heads, HALF_PAD] pointers to the first half of each head, `live` masking the heads and, where
    HALF is padded to a power of two, the columns past it. RMSNorm with weight W (if NORM), rotate, store
    (rounded to the activation `dtype`, then divided by the scale where dst is an fp8 cache)."""
    c = tl.arange(0, HALF_PAD)
    n1 = tl.load(src, mask=live, other=0.0).to(tl.float32)
    n2 = tl.load(src + HALF, mask=live, other=0.0).to(tl.float32)
    if NORM:
        r = tl.rsqrt((tl.sum(n1 * n1, 1) + tl.sum(n2 * n2, 1)) / (2 * HALF) + eps)[:, None]
        n1 = _weighted(n1, r, tl.load(W + c, mask=c < HALF)[None, :], dtype).to(tl.float32)
        n2 = _weighted(n2, r, tl.load(W + HALF + c, mask=c < HALF)[None, :], dtype).to(tl.float32)
    tl.store(dst, _to_cache(n1 * cos[None, :] - n2 * sin[None, :], dst, scale_inv, dtype), mask=live)
    tl.store(dst + HALF, _to_cache(n2 * cos[None, :] + n1 * sin[None, :], dst, scale_inv, dtype), mask=live)


@triton.jit
def _qk_norm_rope_store(QKV, Pos, CosSin, QW, KW, QOut, KCache, VCache, Slots, eps, k_scale_inv, v_scale_inv,
                        stride_qkv, stride_cs, stride_qo_t, stride_qo_h, stride_kc_s, stride_kc_h,
                        stride_vc_s, stride_vc_h,
                        HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                        BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, NORM: tl.constexpr,
                        STORE_V: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    dtype = QOut.dtype.element_ty
    pos = tl.load(Pos + t)
    c = tl.arange(0, HALF_PAD)
    cols = c < HALF  # all true unless a head's half is padded to a power of two (Phi-3-mini's 48)
    cos = tl.load(CosSin + pos * stride_cs + c, mask=cols)
    sin = tl.load(CosSin + pos * stride_cs + HALF + c, mask=cols)
    row = QKV + t * stride_qkv  # q heads, then k heads, then v heads
    slot = tl.load(Slots + t)

    h = tl.arange(0, BLOCK_Q)
    _norm_rope_store(row + h[:, None] * (2 * HALF) + c[None, :],
                     QOut + t * stride_qo_t + h[:, None] * stride_qo_h + c[None, :],
                     QW, cos, sin, eps, (h < HEADS)[:, None] & cols[None, :], 1.0, dtype, HALF, HALF_PAD, NORM)
    h = tl.arange(0, BLOCK_KV)
    live = (h < KV_HEADS)[:, None] & cols[None, :]
    _norm_rope_store(row + (HEADS + h[:, None]) * (2 * HALF) + c[None, :],
                     KCache + slot * stride_kc_s + h[:, None] * stride_kc_h + c[None, :],
                     KW, cos, sin, eps, live, k_scale_inv, dtype, HALF, HALF_PAD, NORM)
    if STORE_V:
        src = row + (HEADS + KV_HEADS + h[:, None]) * (2 * HALF) + c[None, :]
        dst = VCache + slot * stride_vc_s + h[:, None] * stride_vc_h + c[None, :]
        tl.store(dst, _to_cache(tl.load(src, mask=live), dst, v_scale_inv, dtype), mask=live)
        tl.store(dst + HALF, _to_cache(tl.load(src + HALF, mask=live), dst, v_scale_inv, dtype), mask=live)


def qk_norm_rope_store(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                       q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int, k_scale: float = 1.0,
                       v_scale: float = 1.0) -> torch.Tensor:
    """qkv: [tokens, (heads + 2 kv_heads) * head_dim] straight from the projection. Writes k and v at
    slot_mapping in the caches ([num_blocks, block_size, kv_heads, head_dim]; into fp8 ones as k / k_scale and
    v / v_scale); returns q [tokens, heads, head_dim]. Without norm weights, rope and the store only. Where the V
    cache is the K cache (latent attention's), V is not written: K, rotated, is what the cache holds."""
    tokens, head_dim = qkv.shape[0], k_cache.shape[-1]
    for cache in (k_cache, v_cache):  # slots index (block, offset) pairs flattened
        assert cache.stride(0) == cache.shape[1] * cache.stride(1) and cache.stride(3) == 1
    assert qkv.stride(1) == 1 and head_dim % 2 == 0
    q = torch.empty(tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    norm = q_weight is not None
    if tokens:
        _qk_norm_rope_store[(tokens,)](
            qkv, positions, cos_sin, q_weight if norm else q, k_weight if norm else q, q, k_cache, v_cache, slot_mapping, eps, 1.0 / k_scale,
            1.0 / v_scale, qkv.stride(0), cos_sin.stride(0), q.stride(0), q.stride(1), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(1), v_cache.stride(2), HEADS=num_heads, KV_HEADS=num_kv_heads, HALF=head_dim // 2,
            HALF_PAD=triton.next_power_of_2(head_dim // 2), BLOCK_Q=triton.next_power_of_2(num_heads),
            BLOCK_KV=triton.next_power_of_2(num_kv_heads), NORM=norm,
            STORE_V=v_cache.data_ptr() != k_cache.data_ptr(), num_warps=4)
    return q


@triton.jit
def _rms_norm(X, Res, W, Out, ResOut, eps, stride_x, stride_r, stride_o, stride_ro, N: tl.constexpr,
              BLOCK: tl.constexpr, HAS_RES: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    live = c < N
    x = tl.load(X + row * stride_x + c, mask=live, other=0.0)
    dtype = x.dtype
    if HAS_RES:  # the sum is rounded to the activation dtype before the norm, as x + residual is
        x = (x.to(tl.float32) + tl.load(Res + row * stride_r + c, mask=live, other=0.0).to(tl.float32)).to(dtype)
        tl.store(ResOut + row * stride_ro + c, x, mask=live)
    x = x.to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, 0) / N + eps)
    tl.store(Out + row * stride_o + c, _weighted(x, r, tl.load(W + c, mask=live, other=0.0), dtype), mask=live)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x: [rows, hidden]. norm(x), or with `residual` (norm(x + residual), x + residual)."""
    rows, n = x.shape
    assert x.stride(1) == 1 and (residual is None or residual.stride(1) == 1)
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else out
    res = residual if residual is not None else x
    if rows:
        _rms_norm[(rows,)](x, res, weight, out, res_out, eps, x.stride(0), res.stride(0), out.stride(0),
                           res_out.stride(0), N=n, BLOCK=triton.next_power_of_2(n),
                           HAS_RES=residual is not None, num_warps=4 if n <= 2048 else 8)
    return out if residual is None else (out, res_out)


SILU, GELU, CLAMPED_SWIGLU = 0, 1, 2  # _act_and_mul's activations


@triton.jit
def _act_and_mul(X, Out, stride_x, stride_o, limit, alpha, N: tl.constexpr, BLOCK: tl.constexpr,
                 ACT: tl.constexpr):
    row, col = tl.program_id(0).to(tl.int64), tl.program_id(1)
    c = col * BLOCK + tl.arange(0, BLOCK)
    live = c < N
    gate = tl.load(X + row * stride_x + c, mask=live, other=0.0)
    up = tl.load(X + row * stride_x + N + c, mask=live, other=0.0)
    g = gate.to(tl.float32)
    if ACT == 2:  # gpt-oss's, in float32 throughout
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(up.to(tl.float32), -limit), limit)
        out = g / (1.0 + tl.exp(-alpha * g)) * (u + 1.0)
    else:
        if ACT == 1:  # tanh approximation
            act = 0.5 * g * (1.0 + tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)))
        else:
            act = g / (1.0 + tl.exp(-g))
        act = act.to(gate.dtype)  # rounded, as F.silu's and F.gelu's outputs are
        out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(Out + row * stride_o + c, out.to(gate.dtype), mask=live)


def _gated(x: torch.Tensor, act: int, limit: float = 0.0, alpha: float = 0.0) -> torch.Tensor:
    rows, n = x.shape[0], x.shape[1] // 2
    assert x.stride(1) == 1
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(n))
    if rows:
        _act_and_mul[(rows, triton.cdiv(n, block))](x, out, x.stride(0), out.stride(0), limit, alpha, N=n,
                                                     BLOCK=block, ACT=act, num_warps=4)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [rows, 2 * n], gate then up. Returns silu(gate) * up, [rows, n]."""
    return _gated(x, SILU)


def gelu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [rows, 2 * n], gate then up. Returns gelu(gate) * up (tanh approximation: GeGLU, Gemma), [rows, n]."""
    return _gated(x, GELU)


def clamped_swiglu(x: torch.Tensor, limit: float, alpha: float = 1.702) -> torch.Tensor:
    """reference.clamped_swiglu (gpt-oss's experts' activation) in one kernel."""
    return _gated(x, CLAMPED_SWIGLU, limit, alpha)
