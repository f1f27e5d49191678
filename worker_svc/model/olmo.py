"""OLMo 2 and 3 (allenai/OLMo-2-1124-7B, OLMo-2-0425-1B, Olmo-3-7B, Olmo-3-32B-Think) and OLMoE (allenai/OLMoE-1B-7B):
q and k each normed over all their heads at once (layers.NormOverHeads, before the fused rope kernel). OLMo 2 and 3
norm only the attention's and the MLP's outputs, before their residual adds (no norm before either); OLMo 3 puts a
sliding window on three layers of four, its global layers taking the rope scaling. OLMoE keeps Llama's pre-norms and
routes each token to its top k of 64 experts (not renormalised). EXAONE 4 takes OLMo 2's layers with per-head q/k
norms and global layers without rope."""
from __future__ import annotations

import dataclasses

from worker_svc.model.config import ModelConfig, MoeConfig, hybrid_windows, rope_by_layer_type
from worker_svc.model.layers import CausalLM


def olmo_config(raw: dict, **features) -> ModelConfig:
    if raw.get("clip_qkv") is not None:  # OLMo 1's; no OLMo 2 / OLMoE release sets it
        raise ValueError("OLMo with clip_qkv is not supported")
    return ModelConfig.common(raw, qk_norm_over_heads=True, qkv_bias=bool(raw.get("attention_bias")),
                              o_bias=bool(raw.get("attention_bias")), **features)


class Olmo2ForCausalLM(CausalLM):
    @classmethod
    def config(cls, raw: dict) -> ModelConfig:
        return olmo_config(raw, post_norms=True)


class Olmo3ForCausalLM(CausalLM):
    @classmethod
    def config(cls, raw: dict) -> ModelConfig:
        types = raw.get("layer_types") or ["sliding_attention" if (i + 1) % 4 else "full_attention"
                                           for i in range(raw["num_hidden_layers"])]
        theta, local_theta, scaling = rope_by_layer_type(raw, 500000.0)
        cfg = olmo_config(raw, post_norms=True, local_rope_theta=local_theta, layer_windows=tuple(
            raw.get("sliding_window") if t == "sliding_attention" else None for t in types))
        return dataclasses.replace(cfg, rope_theta=theta, rope_scaling=scaling)


class OlmoeForCausalLM(CausalLM):
    @classmethod
    def config(cls, raw: dict) -> ModelConfig:
        layers = raw["num_hidden_layers"]
        moe = MoeConfig(num_experts=raw["num_experts"], top_k=raw["num_experts_per_tok"],
                        intermediate_size=raw["intermediate_size"], norm_topk_prob=bool(raw.get("norm_topk_prob")),
                        layers=tuple(range(layers)))
        return olmo_config(raw, moe=moe)


class Exaone4ForCausalLM(CausalLM):
    """EXAONE 4.0 (LGAI-EXAONE/EXAONE-4.0-32B, 1.2B): OLMo 2's norms on the attention's and the MLP's outputs only,
    per-head q/k norms, and (with a sliding window) three windowed layers of four with rope, the fourth global and
    without rope (`layer_types`, else `sliding_window_pattern`)."""

    @classmethod
    def config(cls, raw: dict) -> ModelConfig:
        windows = hybrid_windows(raw)
        nope = tuple(i for i, w in enumerate(windows) if raw.get("sliding_window") and w is None)  # global ones
        return ModelConfig.common(raw, qk_norm=True, post_norms=True, layer_windows=windows, nope_layers=nope)
