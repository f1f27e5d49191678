"""Qwen3 dense (Qwen/Qwen3-0.6B ... Qwen3-32B): per-head RMSNorm of q and k before rope, no biases."""
from __future__ import annotations

from worker_svc.model.config import ModelConfig
from worker_svc.model.layers import CausalLM


class Qwen3ForCausalLM(CausalLM):
    @classmethod
    def config(cls, raw: dict) -> ModelConfig:
        return ModelConfig.common(raw, qk_norm=True, qkv_bias=bool(raw.get("attention_bias")),
                                  o_bias=bool(raw.get("attention_bias")), sliding_window=_window(raw))


def _window(raw: dict) -> int | None:
    """Qwen2 and Qwen3 configs carry a sliding_window that applies only with use_sliding_window."""
    if not raw.get("use_sliding_window"):
        return None
    if raw.get("max_window_layers", raw["num_hidden_layers"]) < raw["num_hidden_layers"]:
        raise ValueError("use_sliding_window on only some layers (max_window_layers) is not supported")
    return raw.get("sliding_window")
