"""DeepSeek-V2 and V3 (deepseek-ai/DeepSeek-V2-Lite, DeepSeek-V2, DeepSeek-Coder-V2; DeepSeek-V3, DeepSeek-R1,
moonshotai/Moonlight-16B-A3B, Kimi-K2): multi-head latent attention (model/mla.py) and, after the first
`first_k_dense_replace` dense layers, routed experts beside shared ones. V2 routes by softmax scores, greedily or
(`group_limited_greedy`) within the best groups of experts by their best score, weights not renormalised; V3 as
GLM-4.5 (model/glm4_moe.py): sigmoid scores, a correction bias, groups by their two best; GLM-4.7-Flash is V3's
architecture. The published V3 checkpoints store a multi-token-prediction layer after the last one, which this model
leaves."""
from __future__ import annotations

import dataclasses

from worker_svc.model.config import MlaConfig, ModelConfig, MoeConfig, _yarn_mscale
from worker_svc.model.glm4_moe import sigmoid_routed_experts
from worker_svc.model.layers import CausalLM


def mla_config(raw: dict, moe: MoeConfig, interleaved: bool) -> ModelConfig:
    """The reading V2 and V3 share: one "KV head" cached, the latent and K's rope dims (head_dim: kv_lora_rank +
    qk_rope_head_dim), rope over the rope dims, the softmax scale qk_head_dim^-0.5 times YaRN's
    mscale(mscale_all_dim) squared."""
    if raw.get("attention_bias"):  # on q_a_proj, kv_a_proj_with_mqa and o_proj: no published model sets it
        raise ValueError("DeepSeek attention with attention_bias is not supported")
    mla = MlaConfig(raw.get("q_lora_rank"), raw["kv_lora_rank"], raw["qk_nope_head_dim"], raw["qk_rope_head_dim"],
                    raw["v_head_dim"])
    cfg = ModelConfig.common(raw | {"head_dim": mla.kv_lora_rank + mla.qk_rope_head_dim, "num_key_value_heads": 1,
                                    "partial_rotary_factor": None},
                             mla=mla, moe=moe, rope_interleaved=interleaved,
                             mtp_layers=raw.get("num_nextn_predict_layers", 0))
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    mscale = _yarn_mscale(rope["factor"], rope.get("mscale_all_dim") or 0) if cfg.rope_scaling and rope.get(
        "mscale_all_dim") else 1.0
    qk_head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    return dataclasses.replace(cfg, rotary_dim=mla.qk_rope_head_dim, attention_scale=qk_head_dim ** -0.5 * mscale ** 2)


class DeepseekV2ForCausalLM(CausalLM):
    renamed_fragments = {".mlp.shared_experts.": ".mlp.shared_expert."}
    packed_modules = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}  # q_proj is MLA's own

    @classmethod
    def config(cls, raw: dict) -> ModelConfig:
        layers, expert_size = raw["num_hidden_layers"], raw["moe_intermediate_size"]
        grouped = raw.get("topk_method", "greedy") == "group_limited_greedy"
        moe = MoeConfig(num_experts=raw["n_routed_experts"], top_k=raw["num_experts_per_tok"],
                        intermediate_size=expert_size, norm_topk_prob=False,
                        layers=tuple(range(raw.get("first_k_dense_replace", 0), layers)),
                        shared_intermediate_size=expert_size * (raw.get("n_shared_experts") or 0),
                        shared_expert_gated=False, router="deepseek",
                        num_groups=raw.get("n_group") or 1 if grouped else 1,
                        topk_groups=raw.get("topk_group") or 1 if grouped else 1, group_score="max",
                        routed_scaling_factor=raw.get("routed_scaling_factor", 1.0))
        return mla_config(raw, moe, interleaved=True)


class DeepseekV3ForCausalLM(CausalLM):
    renamed_fragments, packed_modules = DeepseekV2ForCausalLM.renamed_fragments, DeepseekV2ForCausalLM.packed_modules

    @classmethod
    def config(cls, raw: dict) -> ModelConfig:
        return mla_config(raw, sigmoid_routed_experts(raw), interleaved=raw.get("rope_interleave", True))


class Glm4MoeLiteForCausalLM(DeepseekV3ForCausalLM):
    """GLM-4.7-Flash (zai-org/GLM-4.7-Flash): DeepSeek-V3's latent attention and routing, the experts on the layers
    `mlp_layer_types` marks sparse (or past first_k_dense_replace)."""

    @classmethod
    def config(cls, raw: dict) -> ModelConfig:
        types = raw.get("mlp_layer_types")
        if types:
            dense = types.index("sparse") if "sparse" in types else len(types)
            if types != ["dense"] * dense + ["sparse"] * (len(types) - dense):
                raise ValueError("GLM-4.7-Flash with dense layers after its first sparse one is not supported")
            raw = raw | {"first_k_dense_replace": dense}
        return super().config(raw)

