"""Mixtral (mistralai/Mixtral-8x7B-*, 8x22B): Mistral's attention (its window where set), routed experts on every
layer (model/moe.py, as Qwen3-MoE's), the top k renormalised; its checkpoints name them
`block_sparse_moe.experts.N.w1` (gate), `w3` (up) and `w2` (down)."""
from __future__ import annotations

import dataclasses

from worker_svc.model.config import ModelConfig, MoeConfig
from worker_svc.model.layers import CausalLM
from worker_svc.model.llama import GraniteForCausalLM, MistralForCausalLM


def experts_on_every_layer(raw: dict) -> MoeConfig:
    """Mixtral's and GraniteMoE's experts: `num_local_experts` of `intermediate_size` on every layer, the top k
    renormalised."""
    return MoeConfig(num_experts=raw["num_local_experts"], top_k=raw["num_experts_per_tok"],
                     intermediate_size=raw["intermediate_size"], norm_topk_prob=True,
                     layers=tuple(range(raw["num_hidden_layers"])))


class MixtralForCausalLM(CausalLM):
    renamed_fragments = {".block_sparse_moe.": ".mlp.", ".w1.": ".gate_proj.", ".w3.": ".up_proj.",
                         ".w2.": ".down_proj."}

    @classmethod
    def config(cls, raw: dict) -> ModelConfig:
        return dataclasses.replace(MistralForCausalLM.config(raw), moe=experts_on_every_layer(raw))


class GraniteMoeForCausalLM(CausalLM):
    """GraniteMoE (ibm-granite/granite-3.0-1b-a400m, 3b-a800m, granite-3.1 MoE): Granite's multipliers and routed
    experts on every layer, each layer's experts stored as one tensor per projection (`input_linear`: gate then up;
    `output_linear`: down), the top k softmaxed among themselves (= the top k of a softmax, renormalised)."""
    renamed_fragments = {".block_sparse_moe.input_linear.": ".mlp.experts.gate_up_proj.",
                         ".block_sparse_moe.output_linear.": ".mlp.experts.down_proj.",
                         ".block_sparse_moe.router.layer.": ".mlp.gate."}

    @classmethod
    def config(cls, raw: dict) -> ModelConfig:
        return dataclasses.replace(GraniteForCausalLM.config(raw), moe=experts_on_every_layer(raw))
