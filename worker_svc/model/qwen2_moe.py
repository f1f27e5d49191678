"""Qwen2-MoE (Qwen/Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (q, k and v biases), Qwen3-MoE's routed
experts (not renormalised unless `norm_topk_prob`), and beside them a shared expert every token takes, its output
scaled by sigmoid(x . shared_expert_gate) (model/moe.py)."""
from __future__ import annotations

import dataclasses

from worker_svc.model.config import ModelConfig, optional_windows
from worker_svc.model.layers import CausalLM
from worker_svc.model.qwen2 import Qwen2ForCausalLM
from worker_svc.model.qwen3 import max_window_layers
from worker_svc.model.qwen3_moe import routed_experts


class Qwen2MoeForCausalLM(CausalLM):
    @classmethod
    def config(cls, raw: dict) -> ModelConfig:
        moe = routed_experts(raw)
        if moe is not None:
            moe = dataclasses.replace(moe, shared_intermediate_size=raw.get("shared_expert_intermediate_size", 0))
        # transformers' Qwen2-MoE windows the even layers below max_window_layers (Qwen2's rule is the opposite)
        windows = optional_windows(raw, lambda i: i % 2 == 0 and i < max_window_layers(raw))
        return dataclasses.replace(Qwen2ForCausalLM.config(raw), qkv_bias=raw.get("qkv_bias", True), moe=moe,
                                   layer_windows=windows)
