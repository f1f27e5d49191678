"""Qwen2 and Qwen2.5 (Qwen/Qwen2.5-0.5B ... 72B): biases on q, k and v, none on the output; no q/k norm."""
from __future__ import annotations

from worker_svc.model.config import ModelConfig, optional_windows
from worker_svc.model.layers import CausalLM
from worker_svc.model.qwen3 import max_window_layers


class Qwen2ForCausalLM(CausalLM):
    @classmethod
    def config(cls, raw: dict) -> ModelConfig:
        return ModelConfig.common(raw, qkv_bias=True,
                                  layer_windows=optional_windows(raw, lambda i: i >= max_window_layers(raw)))
