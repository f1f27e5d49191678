"""Qwen2.5-VL and Qwen3-VL (Qwen/Qwen2.5-VL-7B-Instruct, Qwen3-VL-8B-Instruct, Qwen3-VL-30B-A3B-Instruct, ...)
served as text (model/multimodal.py): Qwen2's, Qwen3's and Qwen3-MoE's layers from the text config, Qwen3-VL-MoE's
experts stored as one tensor per projection. Their multimodal rope (mrope) gives each of three sections of the
frequencies its own position stream (time, height, width), which are the same position for text, so over a text
prompt it is plain rope."""
from __future__ import annotations

import dataclasses

from worker_svc.model.config import ModelConfig
from worker_svc.model.multimodal import TextOfMultimodal
from worker_svc.model.qwen2 import Qwen2ForCausalLM
from worker_svc.model.qwen3 import Qwen3ForCausalLM
from worker_svc.model.qwen3_moe import Qwen3MoeForCausalLM


class QwenVLText(TextOfMultimodal):
    """Qwen-VL's layout: the text model's tensors as published (`model.layers.*`) or as transformers 5 saves
    Qwen3-VL (`model.language_model.layers.*`); the vision tower's left."""
    checkpoint_prefixes = ("model.language_model.", "model.")
    ignored_prefixes = ("visual.", "model.visual.")


class Qwen2_5_VLForConditionalGeneration(QwenVLText, Qwen2ForCausalLM):  # noqa: N801 (transformers' name)
    pass


class Qwen3VLForConditionalGeneration(QwenVLText, Qwen3ForCausalLM):
    pass


class Qwen3VLMoeForConditionalGeneration(QwenVLText, Qwen3MoeForCausalLM):
    @classmethod
    def config(cls, raw: dict) -> ModelConfig:
        cfg = super().config(raw)  # its router always renormalises the top k
        return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, norm_topk_prob=True))
