"""Gemma 3 text (google/gemma-3-1b-it, and the language model of the larger, multimodal ones): interleaved
sliding-window and global layers, each kind with its own rope base (global layers' scaling from rope_scaling),
(1 + w) RMSNorms, q/k norms, norms around the attention and MLP outputs, embeddings scaled by sqrt(hidden), GeGLU,
query_pre_attn_scalar."""
from __future__ import annotations

import dataclasses

from worker_svc.model.config import ModelConfig, rope_by_layer_type
from worker_svc.model.gemma2 import gemma_config
from worker_svc.model.layers import CausalLM
from worker_svc.model.multimodal import TextOfMultimodal


# Gemma3TextConfig's defaults: the published multimodal checkpoints' text_config lists only what differs from them
# (gemma-3-4b: hidden and intermediate sizes, layers, rope_scaling, sliding_window)
TEXT_DEFAULTS = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "tie_word_embeddings": True,
}


class Gemma3ForCausalLM(CausalLM):
    @classmethod
    def config(cls, raw: dict) -> ModelConfig:
        raw = TEXT_DEFAULTS | raw
        if raw.get("use_bidirectional_attention"):
            raise ValueError("Gemma 3 with use_bidirectional_attention is not supported")
        theta, local_theta, scaling = rope_by_layer_type(raw, 1e6, "rope_local_base_freq", 1e4)
        cfg = gemma_config(raw, raw.get("sliding_window_pattern", 6), qk_norm=True, local_rope_theta=local_theta)
        return dataclasses.replace(cfg, rope_theta=theta, rope_scaling=scaling)


class Gemma3ForConditionalGeneration(TextOfMultimodal, Gemma3ForCausalLM):
    """A multimodal Gemma 3 checkpoint (gemma-3-4b-it ... 27b) served as text (model/multimodal.py)."""
