"""The architectures the worker serves, by the name in config.json's `architectures`."""
from __future__ import annotations

from common.model_files import CLASSIFIER_SUFFIX
from worker_svc.model.bert import BertModel, RobertaModel, XLMRobertaModel
from worker_svc.model.cohere import AyaVisionForConditionalGeneration, Cohere2ForCausalLM, CohereForCausalLM
from worker_svc.model.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM, Glm4MoeLiteForCausalLM
from worker_svc.model.dots1 import Dots1ForCausalLM
from worker_svc.model.ernie4_5 import Ernie4_5_MoeForCausalLM, Ernie4_5ForCausalLM
from worker_svc.model.gemma2 import Gemma2ForCausalLM
from worker_svc.model.gemma3 import Gemma3ForCausalLM, Gemma3ForConditionalGeneration
from worker_svc.model.glm import Glm4ForCausalLM, GlmForCausalLM
from worker_svc.model.glm4_moe import Glm4MoeForCausalLM, SolarOpenForCausalLM
from worker_svc.model.glm_vl import Glm4vForConditionalGeneration, Glm4vMoeForConditionalGeneration
from worker_svc.model.gpt_oss import GptOssForCausalLM
from worker_svc.model.layers import CausalLM
from worker_svc.model.llama import (GraniteForCausalLM, LlamaForCausalLM, Ministral3ForCausalLM,
                                    Mistral3ForConditionalGeneration, MistralForCausalLM, Phi3ForCausalLM,
                                    SeedOssForCausalLM, SmolLM3ForCausalLM)
from worker_svc.model.minimax_m2 import MiniMaxM2ForCausalLM
from worker_svc.model.mixtral import GraniteMoeForCausalLM, MixtralForCausalLM
from worker_svc.model.nemotron import NemotronForCausalLM
from worker_svc.model.olmo import Exaone4ForCausalLM, Olmo2ForCausalLM, Olmo3ForCausalLM, OlmoeForCausalLM
from worker_svc.model.qwen2 import Qwen2ForCausalLM
from worker_svc.model.qwen2_moe import Qwen2MoeForCausalLM
from worker_svc.model.qwen3 import Qwen3ForCausalLM
from worker_svc.model.qwen3_moe import Qwen3MoeForCausalLM
from worker_svc.model.qwen_vl import (Qwen2_5_VLForConditionalGeneration, Qwen3VLForConditionalGeneration,
                                     Qwen3VLMoeForConditionalGeneration)
from worker_svc.model.starcoder2 import Starcoder2ForCausalLM

ARCHITECTURES: dict[str, type[CausalLM | BertModel]] = {
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3VLForConditionalGeneration": Qwen3VLForConditionalGeneration,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen3VLMoeForConditionalGeneration": Qwen3VLMoeForConditionalGeneration,
    "MixtralForCausalLM": MixtralForCausalLM,
    "MiniMaxM2ForCausalLM": MiniMaxM2ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "GraniteMoeForCausalLM": GraniteMoeForCausalLM,
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
    "SeedOssForCausalLM": SeedOssForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Ministral3ForCausalLM": Ministral3ForCausalLM,
    "Mistral3ForConditionalGeneration": Mistral3ForConditionalGeneration,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "GlmForCausalLM": GlmForCausalLM,
    "Glm4ForCausalLM": Glm4ForCausalLM,
    "Glm4MoeForCausalLM": Glm4MoeForCausalLM,
    "Glm4vForConditionalGeneration": Glm4vForConditionalGeneration,
    "Glm4vMoeForConditionalGeneration": Glm4vMoeForConditionalGeneration,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "Glm4MoeLiteForCausalLM": Glm4MoeLiteForCausalLM,
    "Dots1ForCausalLM": Dots1ForCausalLM,
    "SolarOpenForCausalLM": SolarOpenForCausalLM,
    "Ernie4_5ForCausalLM": Ernie4_5ForCausalLM,
    "Ernie4_5_MoeForCausalLM": Ernie4_5_MoeForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "Olmo3ForCausalLM": Olmo3ForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    "Exaone4ForCausalLM": Exaone4ForCausalLM,
    "CohereForCausalLM": CohereForCausalLM,
    "Cohere2ForCausalLM": Cohere2ForCausalLM,
    "AyaVisionForConditionalGeneration": AyaVisionForConditionalGeneration,
    "Starcoder2ForCausalLM": Starcoder2ForCausalLM,
    "NemotronForCausalLM": NemotronForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
    "BertModel": BertModel,
    "RobertaModel": RobertaModel,
    "XLMRobertaModel": XLMRobertaModel,
}


def architecture_of(raw: dict) -> type[CausalLM | BertModel]:
    """The model class for a config.json's contents (a sequence classifier's, `XForSequenceClassification`, is X's
    causal LM's, the runner swapping its LM head for the classification head, or encoder X's, which has its own); a
    clear error for any other."""
    names = raw.get("architectures") or []
    for name in names:
        base = name.removesuffix(CLASSIFIER_SUFFIX)
        for model in (base + "ForCausalLM", base + "Model") if name.endswith(CLASSIFIER_SUFFIX) else (name,):
            if model in ARCHITECTURES:
                return ARCHITECTURES[model]
    raise ValueError(f"unsupported architecture {', '.join(names) or '(config.json names none)'}: this worker "
                     f"serves {', '.join(ARCHITECTURES)}, and the {CLASSIFIER_SUFFIX} of each ForCausalLM and "
                     "encoder Model")
