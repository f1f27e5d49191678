"""Llama 2 and 3.x (meta-llama/Llama-3.1-8B, 3.2-1B, ...), Mistral (mistralai/Mistral-7B-*), Phi-3 / Phi-4
(microsoft/Phi-3-mini-4k-instruct, Phi-3.5-mini-instruct, Phi-4-mini-instruct, phi-4) and Granite 3
(ibm-granite/granite-3.1-8b-instruct): the plain decoder; Llama's `attention_bias` / `mlp_bias` when set, Llama 3's
rope scaling, Mistral's and Phi-3's sliding window; Phi-3 stores q, k and v as one tensor and gate and up as
another, which the loader splits, and its long-context models take LongRoPE (Phi-4-mini's over 3/4 of each head);
Granite scales the embeddings, the attention scores, each layer's outputs before the residual add and the logits by
its config's multipliers."""
from __future__ import annotations

import dataclasses

from worker_svc.model.config import ModelConfig
from worker_svc.model.layers import CausalLM


class LlamaForCausalLM(CausalLM):
    @classmethod
    def config(cls, raw: dict) -> ModelConfig:
        bias = bool(raw.get("attention_bias"))
        return ModelConfig.common(raw, qkv_bias=bias, o_bias=bias, mlp_bias=bool(raw.get("mlp_bias")))


class GraniteForCausalLM(CausalLM):
    @classmethod
    def config(cls, raw: dict) -> ModelConfig:
        return dataclasses.replace(LlamaForCausalLM.config(raw), embed_scale=raw.get("embedding_multiplier", 1.0),
                                   attention_scale=raw.get("attention_multiplier"),
                                   residual_scale=raw.get("residual_multiplier", 1.0),
                                   logit_scale=1.0 / raw.get("logits_scaling", 1.0))


class MistralForCausalLM(CausalLM):
    @classmethod
    def config(cls, raw: dict) -> ModelConfig:
        return ModelConfig.common(raw, sliding_window=raw.get("sliding_window"))


class Phi3ForCausalLM(CausalLM):
    @classmethod
    def config(cls, raw: dict) -> ModelConfig:
        return MistralForCausalLM.config(raw)
