"""MiniMax-M2 (MiniMaxAI/MiniMax-M2, M2.1): OLMo's q/k norms over all heads (model/olmo.py) under Llama's pre-norms,
rope over the first `rotary_dim` of each head, and routed experts on every layer chosen by sigmoid score plus a
correction bias and weighted by their renormalised scores (DeepSeek-V3's router without groups: model/moe.py). The
published checkpoints name them as Mixtral's (`block_sparse_moe.experts.N.w1`, `w3`, `w2`), the bias beside the
router."""
from __future__ import annotations

from worker_svc.model.config import ModelConfig, MoeConfig
from worker_svc.model.layers import CausalLM
from worker_svc.model.mixtral import MixtralForCausalLM


class MiniMaxM2ForCausalLM(CausalLM):
    renamed_fragments = MixtralForCausalLM.renamed_fragments | {
        ".mlp.e_score_correction_bias": ".mlp.gate.e_score_correction_bias"}

    @classmethod
    def config(cls, raw: dict) -> ModelConfig:
        if raw.get("use_qk_norm", True) is False or raw.get("qk_norm_type", "per_layer") != "per_layer":
            raise ValueError("MiniMax-M2 without its q/k norms over all heads is not supported")
        if raw.get("rotary_dim") and not raw.get("partial_rotary_factor"):  # the published configs' field
            raw = raw | {"partial_rotary_factor": raw["rotary_dim"] / raw["head_dim"]}
        moe = MoeConfig(num_experts=raw["num_local_experts"], top_k=raw["num_experts_per_tok"],
                        intermediate_size=raw["intermediate_size"], norm_topk_prob=True,
                        layers=tuple(range(raw["num_hidden_layers"])), scoring="sigmoid", score_correction_bias=True,
                        router="deepseek")
        return ModelConfig.common(raw, qk_norm_over_heads=True, moe=moe, mtp_layers=raw.get("num_mtp_modules", 0))
