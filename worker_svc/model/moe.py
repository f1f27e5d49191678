"""A sparse mixture-of-experts MLP: a router picks each token's top-k experts, whose SwiGLU outputs are summed
by their routing weights (kernels.fused_moe: grouped GEMMs on a GPU, a loop over experts elsewhere), plus, where
the config has one, a shared expert every token takes (Qwen2-MoE's scaled by sigmoid(x . shared_expert_gate)).
Under tensor parallelism the experts are sharded whole across the ranks (each computes its own experts for every
token), the shared expert as a dense MLP, and one all-reduce adds both up; the routers are replicated."""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from worker_svc.kernels import Kernels
from worker_svc.model.config import ModelConfig, MoeConfig
from worker_svc.model.layers import GatedMLP, scale_rows
from worker_svc.model.parallel import _divide, projection_weight, tp_rank, tp_size
from worker_svc.model.quantized import quantize_blocks


class ExpertWeights(nn.Module):
    """One projection of this rank's experts as one [experts, out, in] tensor. Its loader takes expert e's
    checkpoint tensor (for gate_up: its half, 0 gate, 1 up) and skips the experts of other ranks; a checkpoint
    tensor of every expert at once is split into those: [experts, out, in] (GraniteMoE's, Qwen3-VL-MoE's as
    transformers saves it) or [experts, in, out] (Qwen3-VL-MoE's as published), told apart by shape as transformers
    does. Where the weight is FP8 (model/quantized.py) each part is quantised as it loads: every part is whole
    128 x 128 blocks."""
    weight_scale = None  # [experts, out / 128, in / 128] where the weight is FP8

    def __init__(self, num_experts: int, out_features: int, in_features: int, halves: tuple | None,
                 bias: bool = False):
        super().__init__()
        local = _divide(num_experts, tp_size())
        self.first, self.out = tp_rank() * local, out_features
        self.weight = projection_weight(local, out_features * len(halves or (None,)), in_features)
        self.weight.weight_loader = self.weight_loader
        self.weight.shard_ids = [(e, h) for e in range(num_experts) for h in (halves or (None,))]
        self.weight.split_fused = self.split_fused
        self.bias = None
        if bias:  # [experts, out] of every expert at once (gpt-oss's): this rank's rows
            self.bias = nn.Parameter(torch.empty(local, self.weight.shape[1]), requires_grad=False)
            self.bias.weight_loader = lambda param, b: param.data.copy_(b.narrow(0, self.first, local))
            self.bias.shard_ids = [None]  # one tensor, however the weight is stored

    def split_fused(self, loaded: torch.Tensor) -> list[tuple[tuple[int, int | None], torch.Tensor]]:
        if loaded.shape[1:] != self.weight.shape[1:]:
            loaded = loaded.transpose(1, 2)
        return [((e, h), loaded[e] if h is None else loaded[e].narrow(0, h * self.out, self.out))
                for e, h in self.weight.shard_ids]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, int | None]) -> None:
        expert, half = shard_id
        if not self.first <= expert < self.first + param.shape[0]:
            return
        rows = param.data[expert - self.first]
        if half is not None:
            rows = rows.narrow(0, half * self.out, self.out)
        if param.dtype != torch.float8_e4m3fn:
            rows.copy_(loaded)
            return
        codes, scale = quantize_blocks(loaded.to(rows.device))
        rows.copy_(codes)
        self.weight_scale[expert - self.first].narrow(0, (half or 0) * scale.shape[0], scale.shape[0]).copy_(scale)


class FusedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.gate_up_proj = ExpertWeights(num_experts, intermediate, hidden, halves=(0, 1), bias=bias)
        self.down_proj = ExpertWeights(num_experts, hidden, intermediate, halves=None, bias=bias)


class Gate(nn.Module):
    """A projection onto one logit per expert (or one, the shared expert's gate)."""

    def __init__(self, hidden: int, outputs: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(outputs, hidden, dtype=dtype), requires_grad=False)


class SoftmaxRouter(Gate):
    """Each token's top_k experts by softmax probability (one kernel on a GPU), renormalised with norm_topk_prob;
    gpt-oss's logits take a bias (its softmax over the top k logits is the same renormalised choice)."""

    def __init__(self, hidden: int, moe: MoeConfig, kernels: Kernels):
        super().__init__(hidden, moe.num_experts)
        self.kernels, self.top_k, self.renormalize = kernels, moe.top_k, moe.norm_topk_prob
        self.bias = nn.Parameter(torch.empty(moe.num_experts), requires_grad=False) if moe.bias else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kernels.router_topk(self.kernels.linear(x, self.weight, self.bias), self.top_k, self.renormalize)


class DeepSeekRouter(Gate):
    """DeepSeek's routing (V2's and V3's; GLM-4.5's, ERNIE 4.5's, dots.llm1's, Solar Open's), in float32 as transformers
    computes it: sigmoid (or softmax) scores; a token's experts the top_k of score (+ e_score_correction_bias, where
    the model has one) within its best topk_groups of num_groups groups of experts (a group ranked by the sum of its
    two best or by its best, moe.group_score); their weights the scores themselves, renormalised with
    norm_topk_prob, times routed_scaling_factor. The choice is kernels.router_topk's (one kernel on a GPU); the groups
    reach it as a bias of -inf on the experts outside a token's, from torch ops of static shapes (a decode step stays
    one CUDA graph)."""

    def __init__(self, hidden: int, moe: MoeConfig, kernels: Kernels):
        super().__init__(hidden, moe.num_experts, torch.float32)
        self.e_score_correction_bias = None
        if moe.score_correction_bias:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(moe.num_experts), requires_grad=False)
            # ERNIE 4.5 stores it as [1, experts]
            self.e_score_correction_bias.weight_loader = lambda param, w: param.data.copy_(w.reshape(-1))
        self.moe, self.kernels = moe, kernels

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        moe, bias = self.moe, self.e_score_correction_bias
        logits = F.linear(x.float(), self.weight)
        sigmoid = moe.scoring == "sigmoid"
        if moe.num_groups > 1:
            scores = torch.sigmoid(logits) if sigmoid else logits.softmax(-1)
            groups = (scores if bias is None else scores + bias).view(len(x), moe.num_groups, -1)
            rank = groups.topk(2, dim=-1).values.sum(-1) if moe.group_score == "top2" else groups.amax(-1)
            best = rank.topk(moe.topk_groups, dim=-1).indices
            kept = torch.zeros_like(groups[..., 0], dtype=torch.bool).scatter_(1, best, True)
            outside = torch.zeros_like(groups).masked_fill_(~kept[..., None], float("-inf")).view_as(logits)
            bias = outside if bias is None else bias + outside
        return self.kernels.router_topk(logits, moe.top_k, moe.norm_topk_prob, sigmoid=sigmoid, bias=bias,
                                        scale=moe.routed_scaling_factor)


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, kernels: Kernels):
        super().__init__()
        moe = cfg.moe
        self.kernels = kernels
        self.gate = (DeepSeekRouter if moe.router == "deepseek" else SoftmaxRouter)(cfg.hidden_size, moe, kernels)
        self.experts = FusedExperts(moe.num_experts, cfg.hidden_size, moe.intermediate_size, moe.bias)
        self.act = None if moe.swiglu_limit is None else functools.partial(kernels.clamped_swiglu,
                                                                           limit=moe.swiglu_limit)
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_intermediate_size:
            self.shared_expert = GatedMLP(cfg, kernels, moe.shared_intermediate_size, reduce=False)
            if moe.shared_expert_gated:
                self.shared_expert_gate = Gate(cfg.hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        experts = self.experts
        y = self.kernels.fused_moe(x, experts.gate_up_proj.weight, experts.down_proj.weight, weights, ids,
                                   experts.gate_up_proj.first, b13=experts.gate_up_proj.bias,
                                   b2=experts.down_proj.bias, act=self.act, s13=experts.gate_up_proj.weight_scale,
                                   s2=experts.down_proj.weight_scale)
        if self.shared_expert_gate is not None:  # rounded as transformers rounds: the gated output, then the sum
            y = y + torch.sigmoid(self.kernels.linear(x, self.shared_expert_gate.weight)) * self.shared_expert(x)
        elif self.shared_expert is not None:
            y = y + self.shared_expert(x)
        if tp_size() > 1:
            dist.all_reduce(y)
        return y

    def scale_output(self, factor: float) -> None:
        scale_rows(self.experts.down_proj, factor)  # each expert's output, so their weighted sum
        if self.shared_expert is not None:
            self.shared_expert.scale_output(factor)
