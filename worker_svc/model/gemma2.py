"""Gemma 2 (google/gemma-2-2b, 9b, 27b): sliding-window and global layers alternating (one rope for both),
(1 + w) RMSNorms, norms around the attention and MLP outputs, embeddings scaled by sqrt(hidden), GeGLU,
query_pre_attn_scalar, and both logit caps: attention scores and final logits through c * tanh(x / c)."""
from __future__ import annotations

from worker_svc.model.config import ModelConfig
from worker_svc.model.layers import CausalLM


def gemma_config(raw: dict, pattern: int, **features) -> ModelConfig:
    """What Gemma 2 and 3 read alike, plus their `features`: (1 + w) norms around the attention and the MLP,
    embeddings times sqrt(hidden), query_pre_attn_scalar, both logit caps, each layer's window from `layer_types` or
    else every `pattern`-th layer global, and the MLP's activation from `hidden_activation`, which transformers'
    Gemma reads whatever `hidden_act` says (Gemma 2's configs carry both)."""
    types = raw.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                       for i in range(raw["num_hidden_layers"])]
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    bias = bool(raw.get("attention_bias"))
    return ModelConfig.common(
        raw | {"hidden_act": act}, qkv_bias=bias, o_bias=bias, norm_offset=1.0, sandwich_norms=True,
        layer_windows=tuple(raw.get("sliding_window") if t == "sliding_attention" else None for t in types),
        embed_scale=raw["hidden_size"] ** 0.5, attention_scale=raw["query_pre_attn_scalar"] ** -0.5,
        final_logit_softcapping=raw.get("final_logit_softcapping"),
        attn_logit_softcapping=raw.get("attn_logit_softcapping"), **features)


class Gemma2ForCausalLM(CausalLM):
    @classmethod
    def config(cls, raw: dict) -> ModelConfig:
        return gemma_config(raw, 2)
