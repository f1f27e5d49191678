"""Qwen3 dense (Qwen/Qwen3-0.6B ... Qwen3-32B): per-head RMSNorm of q and k before rope, no biases."""
from __future__ import annotations

from typing import Callable

from worker_svc.model.config import ModelConfig
from worker_svc.model.layers import CausalLM


class Qwen3ForCausalLM(CausalLM):
    @classmethod
    def config(cls, raw: dict) -> ModelConfig:
        return ModelConfig.common(raw, qk_norm=True, qkv_bias=bool(raw.get("attention_bias")),
                                  o_bias=bool(raw.get("attention_bias")),
                                  layer_windows=qwen_windows(raw, lambda i: i >= max_window_layers(raw)))


def max_window_layers(raw: dict) -> int:
    return raw.get("max_window_layers", 28)  # transformers' default


def qwen_windows(raw: dict, derived: Callable[[int], bool]) -> tuple[int | None, ...] | None:
    """The sliding window of Qwen's configs, as transformers reads them: only with use_sliding_window (the published
    configs leave it off), on the layers `layer_types` marks, or where it does not (configs written before it), on
    the layers `derived` picks: each Qwen architecture has its own rule."""
    if not raw.get("use_sliding_window") or not raw.get("sliding_window"):
        return None
    types = raw.get("layer_types") or ["sliding_attention" if derived(i) else "full_attention"
                                       for i in range(raw["num_hidden_layers"])]
    return tuple(raw["sliding_window"] if t == "sliding_attention" else None for t in types)
