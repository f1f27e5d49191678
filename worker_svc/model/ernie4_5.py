"""ERNIE 4.5 (baidu/ERNIE-4.5-0.3B-PT: Ernie4_5ForCausalLM; ERNIE-4.5-21B-A3B-PT, 300B-A47B-PT:
Ernie4_5_MoeForCausalLM): Llama's layers with rope turning neighbouring dims together (GLM's pairing,
layers.rotary_order) and a tied head; the MoE models put routed experts on the layers from `moe_layer_start_index` to
`moe_layer_end_index`, every `moe_layer_interval`-th, beside ungated shared experts, chosen by softmax score plus a
correction bias (`moe_statics`) and weighted by their renormalised scores (model/moe.py's DeepSeekRouter). The
published checkpoints' multi-token-prediction tensors (`mtp*`) are left unloaded, as transformers leaves them."""
from __future__ import annotations

from worker_svc.model.config import ModelConfig, MoeConfig
from worker_svc.model.layers import CausalLM


def ernie_config(raw: dict, **features) -> ModelConfig:
    if raw.get("use_bias"):  # every linear's, the LM head's too: no published model sets it
        raise ValueError("ERNIE 4.5 with use_bias is not supported (its LM head would need a bias)")
    return ModelConfig.common(raw, rope_interleaved=True, **features)


class Ernie4_5ForCausalLM(CausalLM):  # noqa: N801 (transformers' name)
    @classmethod
    def config(cls, raw: dict) -> ModelConfig:
        return ernie_config(raw)


class Ernie4_5_MoeForCausalLM(CausalLM):  # noqa: N801
    ignored_prefixes = ("mtp", "model.mtp")
    renamed_fragments = {".mlp.moe_statics.": ".mlp.gate.", ".mlp.shared_experts.": ".mlp.shared_expert."}

    @classmethod
    def config(cls, raw: dict) -> ModelConfig:
        layers, expert_size = raw["num_hidden_layers"], raw["moe_intermediate_size"]
        first, last, step = (raw.get("moe_layer_start_index", 0), raw.get("moe_layer_end_index", layers - 1),
                             raw.get("moe_layer_interval", 1))
        moe = MoeConfig(num_experts=raw["moe_num_experts"], top_k=raw["moe_k"], intermediate_size=expert_size,
                        norm_topk_prob=True, layers=tuple(i for i in range(layers) if first <= i <= last
                                                          and (i + 1) % step == 0),
                        shared_intermediate_size=expert_size * raw.get("moe_num_shared_experts", 0),
                        shared_expert_gated=False, scoring="softmax", score_correction_bias=True,
                        router="deepseek")
        return ernie_config(raw, moe=moe)
