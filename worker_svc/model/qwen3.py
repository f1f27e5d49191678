"""Qwen3 dense (Qwen/Qwen3-0.6B ... Qwen3-32B): per-head RMSNorm of q and k before rope, no biases."""
from __future__ import annotations

from worker_svc.model.config import ModelConfig, optional_windows
from worker_svc.model.layers import CausalLM


class Qwen3ForCausalLM(CausalLM):
    @classmethod
    def config(cls, raw: dict) -> ModelConfig:
        return ModelConfig.common(raw, qk_norm=True, qkv_bias=bool(raw.get("attention_bias")),
                                  o_bias=bool(raw.get("attention_bias")),
                                  layer_windows=optional_windows(raw, lambda i: i >= max_window_layers(raw)))


def max_window_layers(raw: dict) -> int:
    return raw.get("max_window_layers", 28)  # transformers' default
