"""GLM-4 (THUDM/glm-4-9b-chat-hf: GlmForCausalLM; zai-org/GLM-4-9B-0414, GLM-4-32B-0414: Glm4ForCausalLM): Llama's
layers with q, k and v biases (none on the output), gate and up stored as one tensor, and rope over the first half of
each head turning neighbouring dims together (layers.rotary_order); GLM-4-0414 adds norms on the attention's and the
MLP's outputs (the sandwich norms of Gemma, here without Gemma's 1 + w)."""
from __future__ import annotations

from worker_svc.model.config import ModelConfig
from worker_svc.model.layers import CausalLM


def glm_config(raw: dict, **features) -> ModelConfig:
    return ModelConfig.common(raw, qkv_bias=bool(raw.get("attention_bias", True)), rope_interleaved=True,
                              **features)


class GlmForCausalLM(CausalLM):
    @classmethod
    def config(cls, raw: dict) -> ModelConfig:
        return glm_config(raw)


class Glm4ForCausalLM(CausalLM):
    # its names for the four norms, as ours (layers.DecoderLayer); in this order, as each renaming sees the last's
    renamed_fragments = {".post_attention_layernorm.": ".pre_feedforward_layernorm.",
                         ".post_self_attn_layernorm.": ".post_attention_layernorm.",
                         ".post_mlp_layernorm.": ".post_feedforward_layernorm."}

    @classmethod
    def config(cls, raw: dict) -> ModelConfig:
        return glm_config(raw, sandwich_norms=True)
