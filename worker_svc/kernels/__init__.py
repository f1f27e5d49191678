"""The worker's kernels, and the one place they are picked: `select(device, attention)` returns the Kernels a
runner builds its model with. On a CUDA GPU: splitserve's Triton kernels (elementwise.py, gumbel.py,
skinny_gemm.py, int_gemm.py, moe.py) and the attention backend asked for (attention.py); elsewhere the torch references
(reference.py). Triton and flash-attn-4 are imported only when a GPU's kernels are selected."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from worker_svc.kernels.attention import AttentionBackend, make_attention


@dataclass(frozen=True, slots=True)
class Kernels:
    name: str  # "triton" or "torch"
    # (x, weight, eps, residual=None) -> norm(x), or (norm(x + residual), x + residual)
    rms_norm: Callable
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    gelu_and_mul: Callable[[torch.Tensor], torch.Tensor]  # GeGLU, tanh approximation
    clamped_swiglu: Callable[..., torch.Tensor]  # (x, limit, alpha=1.702): gpt-oss's experts' activation
    # (qkv, positions, cos_sin, q_weight, k_weight, eps, k_cache, v_cache, slot_mapping, heads, kv_heads,
    #  k_scale=1.0, v_scale=1.0) -> q
    qk_norm_rope_store: Callable[..., torch.Tensor]
    # (x, weight, bias=None, scale=None, zero=None): with zero, weight packed integer groups with these zero points
    # and scales (model/packed_ints.py); with scale alone, an FP8 weight's blocks
    linear: Callable[..., torch.Tensor]
    # (router logits, top_k, renormalize) -> each token's top-k (weights, expert ids) (model/moe.py)
    router_topk: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    # (x, w13, w2, topk_weights, topk_ids, first_expert, *, b13=None, b2=None, act=None, s13=None, s2=None) -> the
    # routed experts' weighted sum (act: the activation of [gate | up], SwiGLU if None; s13, s2: FP8 experts' scales)
    fused_moe: Callable[..., torch.Tensor]
    # (logits, temperature, seeds, positions) -> tokens: temperature sampling or greedy, no filters
    gumbel_argmax: Callable[..., torch.Tensor]
    sampling_dtype: torch.dtype | None  # what the sampler computes in; None: the logits' own (16-bit on a GPU)
    attention: AttentionBackend


def select(device: torch.device | str, attention: str = "auto", kv_dtype: torch.dtype = torch.bfloat16,
           head_dim: int = 128) -> Kernels:
    """`kv_dtype`, `head_dim`: the KV cache's dtype and the width of its heads (attention.resolve)."""
    device = torch.device(device)
    backend = make_attention(attention, device, kv_dtype, head_dim)
    if device.type == "cuda":
        from worker_svc.kernels import elementwise, gumbel, moe, skinny_gemm

        return Kernels("triton", elementwise.rms_norm, elementwise.silu_and_mul, elementwise.gelu_and_mul,
                       elementwise.clamped_swiglu, elementwise.qk_norm_rope_store, skinny_gemm.linear,
                       moe.router_topk, moe.fused_moe, gumbel.gumbel_argmax, None, backend)
    from worker_svc.kernels import reference

    return Kernels("torch", reference.rms_norm, reference.silu_and_mul, reference.gelu_and_mul,
                   reference.clamped_swiglu, reference.qk_norm_rope_store, reference.linear, reference.router_topk,
                   reference.fused_moe, reference.gumbel_argmax, torch.float32, backend)
