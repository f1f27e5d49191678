"""Cohere's Command R and R+ (CohereForAI/c4ai-command-r-v01, c4ai-command-r-plus, c4ai-command-r-08-2024,
aya-expanse-8b / 32b) and Command R7B / Command A (Cohere 2: c4ai-command-r7b-12-2024, c4ai-command-a-03-2025):
parallel blocks (one LayerNorm without bias, its output read by both the attention and the MLP, whose outputs join
the residual together), rope on neighbouring dims (q and k rows reordered at load, as GLM's), tied embeddings and
logits times `logit_scale` (folded into the final norm's weight); with `use_qk_norm` (Command R+) each head's q and k
LayerNormed with a weight of its own before rope. Cohere 2 puts a sliding window on three layers of four
(`layer_types`, else `sliding_window_pattern`); its global layers take no rope. Aya Vision (CohereForAI/aya-vision-8b:
Cohere 2's layers; 32b: Cohere's) is served as text, its language model read as its text_config's model_type says."""
from __future__ import annotations

import dataclasses

from worker_svc.model.config import ModelConfig, hybrid_windows
from worker_svc.model.layers import CausalLM
from worker_svc.model.multimodal import TextOfMultimodal, text_config


def cohere_config(raw: dict, **features) -> ModelConfig:
    bias = bool(raw.get("attention_bias"))
    config = ModelConfig.common(raw, layer_norm=True, parallel_block=True, rope_interleaved=True, qkv_bias=bias,
                                o_bias=bias, qk_layer_norm=bool(raw.get("use_qk_norm")),
                                logit_scale=raw.get("logit_scale", 0.0625), **features)
    return dataclasses.replace(config, rms_norm_eps=raw.get("layer_norm_eps", 1e-5),
                               tie_word_embeddings=raw.get("tie_word_embeddings", True))


class CohereForCausalLM(CausalLM):
    @classmethod
    def config(cls, raw: dict) -> ModelConfig:
        return cohere_config(raw)


class Cohere2ForCausalLM(CausalLM):
    @classmethod
    def config(cls, raw: dict) -> ModelConfig:
        windows = hybrid_windows({"sliding_window": 4096, "sliding_window_pattern": 4, **raw})  # its defaults
        return cohere_config(raw, layer_windows=windows,
                             nope_layers=tuple(i for i, w in enumerate(windows) if w is None))


class AyaVisionForConditionalGeneration(TextOfMultimodal, CausalLM):
    """A multimodal Aya Vision checkpoint served as text (model/multimodal.py). Its logits are the LM head's,
    without its text model's logit_scale, as transformers computes them (vLLM scales them: the same greedy tokens,
    sharper distributions)."""

    @classmethod
    def config(cls, raw: dict) -> ModelConfig:
        text = text_config(raw)
        kinds = {"cohere": CohereForCausalLM, "cohere2": Cohere2ForCausalLM}
        kind = text.get("model_type", "cohere2")  # transformers' default text model
        if kind not in kinds:
            raise ValueError(f"AyaVisionForConditionalGeneration with a {kind!r} text model is not supported (its "
                             "text_config must be Cohere's or Cohere 2's)")
        return dataclasses.replace(kinds[kind].config(text), logit_scale=1.0)
