"""Llama 2 and 3.x (meta-llama/Llama-3.1-8B, 3.2-1B, ...), Seed-OSS, SmolLM3 (HuggingFaceTB/SmolLM3-3B), Mistral
(mistralai/Mistral-7B-*), Phi-3 / Phi-4 (microsoft/Phi-3-mini-4k-instruct, Phi-3.5-mini-instruct,
Phi-4-mini-instruct, phi-4) and Granite 3 (ibm-granite/granite-3.1-8b-instruct): the plain decoder; Llama's
`attention_bias` / `mlp_bias` when set, Llama 3's rope scaling, SmolLM3's layers without rope, Mistral's and Phi-3's
sliding window; Phi-3 stores q, k and v as one tensor and gate and up as another, which the loader splits, and its
long-context models take LongRoPE (Phi-4-mini's over 3/4 of each head); Granite scales the embeddings, the attention
scores, each layer's outputs before the residual add and the logits by its config's multipliers."""
from __future__ import annotations

import dataclasses

from worker_svc.model.config import ModelConfig, optional_windows, query_log_scale
from worker_svc.model.layers import CausalLM
from worker_svc.model.multimodal import TextOfMultimodal, text_config


class LlamaForCausalLM(CausalLM):
    @classmethod
    def config(cls, raw: dict) -> ModelConfig:
        bias = bool(raw.get("attention_bias"))
        return ModelConfig.common(raw, qkv_bias=bias, o_bias=bias, mlp_bias=bool(raw.get("mlp_bias")))


class SeedOssForCausalLM(CausalLM):
    """Seed-OSS (ByteDance-Seed/Seed-OSS-36B-Instruct): Llama's layers, the q, k and v biases (`attention_bias`) apart
    from the output's (`attention_out_bias`)."""

    @classmethod
    def config(cls, raw: dict) -> ModelConfig:
        return ModelConfig.common(raw, qkv_bias=bool(raw.get("attention_bias")),
                                  o_bias=bool(raw.get("attention_out_bias")), mlp_bias=bool(raw.get("mlp_bias")))


class GraniteForCausalLM(CausalLM):
    @classmethod
    def config(cls, raw: dict) -> ModelConfig:
        return dataclasses.replace(LlamaForCausalLM.config(raw), embed_scale=raw.get("embedding_multiplier", 1.0),
                                   attention_scale=raw.get("attention_multiplier"),
                                   residual_scale=raw.get("residual_multiplier", 1.0),
                                   logit_scale=1.0 / raw.get("logits_scaling", 1.0))


class SmolLM3ForCausalLM(CausalLM):
    """Llama's layers with every no_rope_layer_interval-th one (or those `no_rope_layers` marks 0) without rope,
    and, with use_sliding_window, windows on those (or on the layers `layer_types` marks)."""

    @classmethod
    def config(cls, raw: dict) -> ModelConfig:
        interval = raw.get("no_rope_layer_interval", 4)
        rope = raw.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(raw["num_hidden_layers"])]
        nope = tuple(i for i, on in enumerate(rope) if not on)
        return dataclasses.replace(LlamaForCausalLM.config(raw), nope_layers=nope,
                                   layer_windows=optional_windows(raw, lambda i: i in nope))


class MistralForCausalLM(CausalLM):
    @classmethod
    def config(cls, raw: dict) -> ModelConfig:
        return ModelConfig.common(raw, sliding_window=raw.get("sliding_window"))


class Ministral3ForCausalLM(CausalLM):
    """Ministral 3 (mistralai/Ministral-3-3B / 8B / 14B, the text model): Mistral's layers with q scaled by position
    (Llama 4's log scaling, `llama_4_scaling_beta`)."""

    @classmethod
    def config(cls, raw: dict) -> ModelConfig:
        return dataclasses.replace(MistralForCausalLM.config(raw), query_log_scale=query_log_scale(raw))


class Phi3ForCausalLM(MistralForCausalLM):
    """Mistral's reading of the config; its fused q, k, v and gate, up tensors are split by the loader."""


class Mistral3ForConditionalGeneration(TextOfMultimodal, MistralForCausalLM):
    """A multimodal Mistral 3 checkpoint (Mistral-Small-3.1 / 3.2-24B) served as text
    (model/multimodal.py): Mistral's layers from its text_config."""

    @classmethod
    def config(cls, raw: dict) -> ModelConfig:
        text = text_config(raw)
        if text.get("model_type", "mistral") not in ("mistral", "ministral3"):
            raise ValueError(f"Mistral3ForConditionalGeneration with a {text['model_type']!r} text model is not "
                             "supported (its text_config must be Mistral's or Ministral 3's)")
        return dataclasses.replace(super().config(raw), query_log_scale=query_log_scale(text))
