"""Multimodal checkpoints served as text (Gemma 3's and Mistral 3's larger models, Qwen2.5-VL, Qwen3-VL): their
language model's tensors and config; the vision tower and the projector are left unloaded, so prompts are text."""
from __future__ import annotations

from worker_svc.model.config import ModelConfig


class TextOfMultimodal:
    """Mixed in before a text architecture: its checkpoint names (`language_model.model.*` and
    `language_model.lm_head.*` as published; `model.language_model.*` and `lm_head.*` as some transformers releases
    save them) and its config, the text architecture's reading of text_config(raw)."""
    checkpoint_prefixes = ("language_model.model.", "language_model.", "model.language_model.")
    ignored_prefixes = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                        "model.multi_modal_projector.")

    @classmethod
    def config(cls, raw: dict) -> ModelConfig:
        return super().config(text_config(raw))  # the text architecture's, next in the subclass's order


def text_config(raw: dict) -> dict:
    """A multimodal config.json's language model, as transformers builds it: its text_config (or, in configs
    written before there was one, the outer fields: Qwen2.5-VL's), the outer dtype where that names none, the
    outer tie_word_embeddings where set (the whole model ties its head by it) and the outer quantization_config."""
    dtype = {k: raw[k] for k in ("dtype", "torch_dtype") if k in raw}
    tie = {"tie_word_embeddings": raw["tie_word_embeddings"]} if "tie_word_embeddings" in raw else {}
    quantized = {"quantization_config": raw["quantization_config"]} if "quantization_config" in raw else {}
    text = raw.get("text_config") or {k: v for k, v in raw.items() if k != "vision_config"}
    return dtype | text | tie | quantized | {"architectures": raw["architectures"]}
