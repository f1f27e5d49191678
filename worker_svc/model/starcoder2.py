"""StarCoder 2 (bigcode/starcoder2-3b, 7b, 15b): Llama's layout with LayerNorms that have biases, biases on every
projection (`use_bias`), a plain MLP (`c_fc`, tanh GELU, `c_proj`: not gated), tied embeddings and a sliding window
where the config sets one."""
from __future__ import annotations

import dataclasses

from worker_svc.model.config import ModelConfig
from worker_svc.model.layers import PLAIN_MLP_PACKED, CausalLM


class Starcoder2ForCausalLM(CausalLM):
    renamed_fragments = {".mlp.c_fc.": ".mlp.up_proj.", ".mlp.c_proj.": ".mlp.down_proj."}
    packed_modules = PLAIN_MLP_PACKED

    @classmethod
    def config(cls, raw: dict) -> ModelConfig:
        bias = raw.get("use_bias", True)
        config = ModelConfig.common({"hidden_act": "gelu_pytorch_tanh", **raw}, layer_norm=True, norm_bias=True,
                                    gated_mlp=False, qkv_bias=bias, o_bias=bias, mlp_bias=bias,
                                    sliding_window=raw.get("sliding_window"))
        return dataclasses.replace(config, rms_norm_eps=raw.get("norm_epsilon", 1e-5),
                                   tie_word_embeddings=raw.get("tie_word_embeddings", True))
