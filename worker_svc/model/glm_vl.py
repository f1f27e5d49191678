"""GLM-4.1V and GLM-4.5V (zai-org/GLM-4.1V-9B-Thinking, GLM-4.5V) served as text (model/multimodal.py): GLM-4-0414's
and GLM-4.5's layers from the text config, the tensors in Qwen-VL's layout (`model.language_model.*`, the vision tower
under `model.visual.*` left). Their multimodal rope gives each of three sections of the rotated frequencies its own
position stream, which are the same position for text, so over a text prompt it is the text model's partial rope."""
from __future__ import annotations

from worker_svc.model.glm import Glm4ForCausalLM
from worker_svc.model.glm4_moe import Glm4MoeForCausalLM
from worker_svc.model.qwen_vl import QwenVLText


class Glm4vForConditionalGeneration(QwenVLText, Glm4ForCausalLM):
    pass


class Glm4vMoeForConditionalGeneration(QwenVLText, Glm4MoeForCausalLM):
    pass
