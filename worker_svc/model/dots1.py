"""dots.llm1 (rednote-hilab/dots.llm1.base, dots.llm1.inst): Qwen3's attention (per-head q/k norms; biases on all four
projections with `attention_bias`) over DeepSeek-V3's sigmoid-routed experts beside shared ones (as GLM-4.5's,
model/glm4_moe.py), and a window on the layers `layer_types` marks (or, in configs without it, from
`max_window_layers` on where `sliding_window` is set)."""
from __future__ import annotations

from worker_svc.model.config import ModelConfig
from worker_svc.model.glm4_moe import Glm4MoeForCausalLM, sigmoid_routed_experts
from worker_svc.model.layers import CausalLM


class Dots1ForCausalLM(CausalLM):
    renamed_fragments = Glm4MoeForCausalLM.renamed_fragments

    @classmethod
    def config(cls, raw: dict) -> ModelConfig:
        layers, window = raw["num_hidden_layers"], raw.get("sliding_window")
        types = raw.get("layer_types") or ["sliding_attention" if window and i >= raw.get("max_window_layers", layers)
                                           else "full_attention" for i in range(layers)]
        windows = tuple(window if t == "sliding_attention" else None for t in types)
        bias = bool(raw.get("attention_bias"))
        return ModelConfig.common(raw, qk_norm=True, qkv_bias=bias, o_bias=bias, moe=sigmoid_routed_experts(raw),
                                  layer_windows=windows if any(windows) else None)
