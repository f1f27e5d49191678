"""Layers the architectures compose; each calls the kernels its runner selected (worker_svc.kernels)."""
from __future__ import annotations

import torch
from torch import nn

from worker_svc.kernels import Kernels


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, kernels: Kernels):
        super().__init__()
        self.eps, self.kernels = eps, kernels
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: norm(x). With it: (norm(x + residual), x + residual)."""
        return self.kernels.rms_norm(x, self.weight, self.eps, residual)


class RotaryEmbedding(nn.Module):
    """The cos/sin table of rotary position embedding, shared by every layer."""

    def __init__(self, head_dim: int, max_positions: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)
