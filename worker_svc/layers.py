"""Elementwise pieces of the transformer: RMSNorm (with fused residual add), rotary embedding, SwiGLU."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: norm(x). With it: (norm(x + residual), x + residual)."""
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (rotate-half layout, as Qwen3) from a precomputed cos/sin table."""

    def __init__(self, head_dim: int, max_positions: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos, sin = self.cos_sin[positions].unsqueeze(-2).chunk(2, dim=-1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
