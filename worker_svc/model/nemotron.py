"""Nemotron (nvidia/Nemotron-Mini-4B-Instruct, Minitron-4B / 8B, Nemotron-4-15B / 340B): Llama's layout with
LayerNorm1P norms ((1 + w) weights and biases), a plain MLP (up_proj, relu squared, down_proj: not gated), rope over
part of each head (`partial_rotary_factor`) and optional attention and MLP biases."""
from __future__ import annotations

import dataclasses

from worker_svc.model.config import ModelConfig
from worker_svc.model.layers import PLAIN_MLP_PACKED, CausalLM


class NemotronForCausalLM(CausalLM):
    packed_modules = PLAIN_MLP_PACKED

    @classmethod
    def config(cls, raw: dict) -> ModelConfig:
        bias = bool(raw.get("attention_bias"))
        config = ModelConfig.common({"hidden_act": "relu2", **raw}, layer_norm=True, norm_bias=True, norm_offset=1.0,
                                    gated_mlp=False, qkv_bias=bias, o_bias=bias, mlp_bias=bool(raw.get("mlp_bias")))
        return dataclasses.replace(config, rms_norm_eps=raw.get("norm_eps", 1e-5))
