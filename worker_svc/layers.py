"""Elementwise pieces of the transformer: RMSNorm (with fused residual add), q/k norm with rotary
embedding, SwiGLU. These are the reference (CPU) versions; on a GPU the norms and SwiGLU run as the Triton
kernels of layers_triton.py, which round where these do."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                 q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float):
    """Per-head RMSNorm of q and k, then rotary embedding (rotate-half layout, as Qwen3)."""
    cos, sin = cos_sin[positions].unsqueeze(-2).chunk(2, dim=-1)
    return _rotate(_rms(q, q_weight, eps), cos, sin), _rotate(_rms(k, k_weight, eps), cos, sin)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if x.is_cuda:
        from worker_svc import layers_triton  # triton: a GPU-only dependency

        return layers_triton.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: norm(x). With it: (norm(x + residual), x + residual)."""
        if x.is_cuda:
            from worker_svc import layers_triton  # triton: a GPU-only dependency

            return layers_triton.rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return _rms(x, self.weight, self.eps)
        x = x + residual
        return _rms(x, self.weight, self.eps), x


class RotaryEmbedding(nn.Module):
    """The cos/sin table of rotary position embedding, shared by every layer."""

    def __init__(self, head_dim: int, max_positions: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)
