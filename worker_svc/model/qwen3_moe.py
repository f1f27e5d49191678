"""Qwen3-MoE (Qwen/Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention, routed experts instead of the MLP on every
`decoder_sparse_step`-th layer not in `mlp_only_layers`, top-k renormalised with `norm_topk_prob`."""
from __future__ import annotations

import dataclasses

from worker_svc.model.config import ModelConfig, MoeConfig, optional_windows
from worker_svc.model.layers import CausalLM
from worker_svc.model.qwen3 import Qwen3ForCausalLM


def routed_experts(raw: dict) -> MoeConfig | None:
    """Qwen's MoE fields (Qwen3-MoE, Qwen2-MoE): experts on every `decoder_sparse_step`-th layer not in
    `mlp_only_layers`; None without experts."""
    layers, step = raw["num_hidden_layers"], raw.get("decoder_sparse_step", 1)
    dense = set(raw.get("mlp_only_layers") or [])
    experts = raw.get("num_experts", raw.get("num_local_experts", 0))  # transformers 5 writes the latter
    if not experts:
        return None
    return MoeConfig(num_experts=experts, top_k=raw["num_experts_per_tok"],
                     intermediate_size=raw["moe_intermediate_size"], norm_topk_prob=raw.get("norm_topk_prob", False),
                     layers=tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0))


class Qwen3MoeForCausalLM(CausalLM):
    @classmethod
    def config(cls, raw: dict) -> ModelConfig:
        # transformers' Qwen3-MoE windows every layer when use_sliding_window is set
        return dataclasses.replace(Qwen3ForCausalLM.config(raw), moe=routed_experts(raw),
                                   layer_windows=optional_windows(raw | {"layer_types": None}, lambda i: True))
