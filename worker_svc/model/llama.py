"""Llama 2 and 3.x (meta-llama/Llama-3.1-8B, 3.2-1B, ...), and Mistral (mistralai/Mistral-7B-*): the plain
decoder; Llama's `attention_bias` / `mlp_bias` when set, Llama 3's rope scaling, Mistral's sliding window."""
from __future__ import annotations

from worker_svc.model.config import ModelConfig
from worker_svc.model.layers import CausalLM


class LlamaForCausalLM(CausalLM):
    @classmethod
    def config(cls, raw: dict) -> ModelConfig:
        bias = bool(raw.get("attention_bias"))
        return ModelConfig.common(raw, qkv_bias=bias, o_bias=bias, mlp_bias=bool(raw.get("mlp_bias")))


class MistralForCausalLM(CausalLM):
    @classmethod
    def config(cls, raw: dict) -> ModelConfig:
        return ModelConfig.common(raw, sliding_window=raw.get("sliding_window"))
