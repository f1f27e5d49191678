"""GLM-4.5 and GLM-4.6 (zai-org/GLM-4.5, GLM-4.5-Air, GLM-4.6): attention with q, k and v biases (and, where
`use_qk_norm` is set, Qwen3's q/k norms) and rope over the first half of each head, its dims paired as Llama pairs
them (not GLM-4's neighbouring dims); dense MLPs on the first `first_k_dense_replace` layers, then routed experts
beside an ungated shared expert, routed by DeepSeek-V3's sigmoid scores with a correction bias (model/moe.py). The
published checkpoints store a multi-token-prediction layer after the last one, which this model leaves."""
from __future__ import annotations

from worker_svc.model.config import ModelConfig, MoeConfig
from worker_svc.model.layers import CausalLM


def sigmoid_routed_experts(raw: dict) -> MoeConfig:
    """DeepSeek-V3's experts as GLM-4.5, dots.llm1 and Solar Open configure them: n_routed_experts sigmoid-routed
    beside n_shared_experts shared ones (one MLP of their summed width), dense MLPs on the first first_k_dense_replace
    layers."""
    expert_size = raw["moe_intermediate_size"]
    return MoeConfig(num_experts=raw.get("n_routed_experts") or raw["num_local_experts"],
                     top_k=raw["num_experts_per_tok"], intermediate_size=expert_size,
                     norm_topk_prob=raw.get("norm_topk_prob", True),
                     layers=tuple(range(raw.get("first_k_dense_replace", 1), raw["num_hidden_layers"])),
                     shared_intermediate_size=expert_size * (raw.get("n_shared_experts") or 0),
                     shared_expert_gated=False, scoring="sigmoid", score_correction_bias=True, router="deepseek",
                     num_groups=raw.get("n_group") or 1,
                     topk_groups=raw.get("topk_group") or 1,
                     routed_scaling_factor=raw.get("routed_scaling_factor", 1.0))


class Glm4MoeForCausalLM(CausalLM):
    renamed_fragments = {".mlp.shared_experts.": ".mlp.shared_expert."}

    @classmethod
    def config(cls, raw: dict) -> ModelConfig:
        return ModelConfig.common(raw, qkv_bias=bool(raw.get("attention_bias")), qk_norm=bool(raw.get("use_qk_norm")),
                                  moe=sigmoid_routed_experts(raw), mtp_layers=raw.get("num_nextn_predict_layers", 0))


class SolarOpenForCausalLM(CausalLM):
    """Solar Open (upstage/Solar-Open-100B): GLM-4.5's layers without q/k norms, rope over whole heads, and experts on
    every layer (no dense MLP)."""
    renamed_fragments = Glm4MoeForCausalLM.renamed_fragments

    @classmethod
    def config(cls, raw: dict) -> ModelConfig:
        raw = raw | {"first_k_dense_replace": 0, "intermediate_size": raw.get("intermediate_size", 0)}
        return ModelConfig.common(raw, qkv_bias=bool(raw.get("attention_bias")), moe=sigmoid_routed_experts(raw))
