"""Every architecture of the registry (worker_svc/model/registry.py) against transformers, on checkpoints that
transformers itself writes (`from_config(...).save_pretrained(...)`, random weights, several shards) in shapes the
project's presets do not use: odd head counts and GQA ratios, untied heads, biases, Llama 3 rope scaling, a
sliding window shorter than the prompts. fp32 on the CPU: logits within 1e-4, greedy tokens equal to
`generate` through chunked prefill, prefix reuse and drop/recompute, and through client -> scheduler -> worker."""
from __future__ import annotations

import dataclasses
import json
import math
import random
import shutil
import subprocess
import sys

import pytest
import tiktoken
import torch
import transformers

from client import Client
from client.launcher import LocalCluster, free_port
from common.limits import Limits
from gateway.backend import token_limit as gateway_token_limit
from tests.paged_driver import PagedDriver, prefill_logits, run_with_drops
from tests.sim_cluster import sample, scrape, wait_for
from tests.test_faults import all_idle, join, start_streams
from worker_svc.checkpoints.presets import BOS_TOKEN_ID, EOS_TOKEN_ID, VOCAB_SIZE
from worker_svc.checkpoints.tokenizer_files import write_qwen_tokenizer
from worker_svc.model.config import ModelConfig
from worker_svc.model.registry import ARCHITECTURES
from worker_svc.runtime.model_runner import ModelRunner, RunnerConfig

COMMON = dict(vocab_size=VOCAB_SIZE, num_hidden_layers=3, max_position_embeddings=512, bos_token_id=BOS_TOKEN_ID,
              eos_token_id=EOS_TOKEN_ID, initializer_range=0.25, tie_word_embeddings=False)


def LONGROPE(n: int) -> dict:  # noqa: N802 (a constant's shape)
    """LongRoPE parameters for n frequencies: short factors near 1, long ones growing to ~8 (as published ones do)."""
    return {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.05 * i for i in range(n)],
            "long_factor": [1.0 + 7.0 * (i / (n - 1)) ** 2 for i in range(n)]}


CONFIGS = {
    "llama": transformers.LlamaConfig(
        hidden_size=120, intermediate_size=200, num_attention_heads=10, num_key_value_heads=5, attention_bias=True,
        mlp_bias=True, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 32}, **COMMON),
    "llama-tied": transformers.LlamaConfig(
        hidden_size=96, intermediate_size=160, num_attention_heads=6, num_key_value_heads=6, head_dim=24,
        **(COMMON | {"tie_word_embeddings": True})),
    # OLMo 2: q and k normed over all their heads, norms only on the attention's and the MLP's outputs
    "olmo2": transformers.Olmo2Config(
        hidden_size=96, intermediate_size=160, num_attention_heads=6, num_key_value_heads=2, **COMMON),
    # OLMo 3: OLMo 2's layers, a 12-token window on layers 0-1 (3 of 4), the global layer 2's rope scaled (YaRN)
    "olmo3": transformers.Olmo3Config(
        hidden_size=96, intermediate_size=160, num_attention_heads=6, num_key_value_heads=3, sliding_window=12,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                            "rope_theta": 500000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0}}, **COMMON),
    # EXAONE 4: OLMo 2's output norms, per-head q/k norms, 12-token windows with rope on layers 0-1, layer 2 global
    # without rope (its sliding_window_pattern of 3)
    "exaone4": transformers.Exaone4Config(
        hidden_size=96, intermediate_size=160, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
        sliding_window=12, sliding_window_pattern=3, **COMMON),
    # Command R: parallel blocks under one LayerNorm, rope on neighbouring dims, attention biases, a logit scale
    "cohere": transformers.CohereConfig(
        hidden_size=96, intermediate_size=160, num_attention_heads=6, num_key_value_heads=2, attention_bias=True,
        logit_scale=0.5, layer_norm_eps=1e-5, **{**COMMON, "tie_word_embeddings": True}),
    # Command R+: each head's q and k LayerNormed with a weight of its own
    "cohere-qk_norm": transformers.CohereConfig(
        hidden_size=96, intermediate_size=160, num_attention_heads=6, num_key_value_heads=2, use_qk_norm=True,
        logit_scale=0.5, **{**COMMON, "tie_word_embeddings": True}),
    # Command R7B / A: Cohere's layers, 12-token windows with rope on layers 0-1, layer 2 global without rope
    "cohere2": transformers.Cohere2Config(
        hidden_size=96, intermediate_size=160, num_attention_heads=6, num_key_value_heads=3, sliding_window=12,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], logit_scale=0.25, **COMMON),
    # Aya Vision (language_model.*, vision_tower.*, multi_modal_projector.*) served as text: Cohere 2's layers
    "aya_vision": transformers.AyaVisionConfig(
        text_config=transformers.Cohere2Config(
            hidden_size=96, intermediate_size=160, num_attention_heads=6, num_key_value_heads=3, sliding_window=12,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"], logit_scale=0.25,
            **{**COMMON, "tie_word_embeddings": True}),
        vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                           num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14)),
    # StarCoder 2: LayerNorms with biases, biases on every projection, a plain tanh-GELU MLP, a 12-token window
    "starcoder2": transformers.Starcoder2Config(
        hidden_size=96, intermediate_size=160, num_attention_heads=6, num_key_value_heads=2, sliding_window=12,
        **{**COMMON, "tie_word_embeddings": True}),
    # Nemotron: LayerNorm1P norms ((1 + w), biases), a plain relu-squared MLP, rope over half of each head
    "nemotron": transformers.NemotronConfig(
        hidden_size=96, intermediate_size=160, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}, **COMMON),
    # Granite 3: the embeddings, attention scores, residual branches and logits scaled by its multipliers
    "granite": transformers.GraniteConfig(
        hidden_size=96, intermediate_size=160, num_attention_heads=6, num_key_value_heads=2, embedding_multiplier=3.0,
        attention_multiplier=0.2, residual_multiplier=0.5, logits_scaling=4.0, **COMMON),
    # SmolLM3: layer 1 without rope (every 2nd), and with use_sliding_window a 12-token window on it
    "smollm3": transformers.SmolLM3Config(
        hidden_size=96, intermediate_size=160, num_attention_heads=6, num_key_value_heads=3, no_rope_layer_interval=2,
        use_sliding_window=True, sliding_window=12, **COMMON),
    # Seed-OSS: q/k/v biases without the output's
    "seed_oss": transformers.SeedOssConfig(
        hidden_size=96, intermediate_size=160, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
        attention_bias=True, attention_out_bias=False, **COMMON),
    # Ministral 3: Mistral's layers, q scaled by position from 32 on (Llama 4's log scaling), YaRN
    "ministral3": transformers.Ministral3Config(
        hidden_size=96, intermediate_size=160, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
        rope_parameters={"type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 32,
                         "max_position_embeddings": 512, "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0,
                         "mscale": 1.0, "llama_4_scaling_beta": 0.3}, **COMMON),
    "qwen2": transformers.Qwen2Config(
        hidden_size=112, intermediate_size=176, num_attention_heads=7, num_key_value_heads=1, **COMMON),
    # Qwen2's window where use_sliding_window sets it: layers 1 and 2 (from max_window_layers on), 12 tokens
    "qwen2-window": transformers.Qwen2Config(
        hidden_size=96, intermediate_size=160, num_attention_heads=6, num_key_value_heads=2, use_sliding_window=True,
        sliding_window=12, max_window_layers=1, **COMMON),
    "mistral": transformers.MistralConfig(
        hidden_size=96, intermediate_size=160, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
        sliding_window=12, **COMMON),
    # q, k and v in one tensor, gate and up in another; a 16-token window on every layer
    "phi3": transformers.Phi3Config(
        hidden_size=96, intermediate_size=136, num_attention_heads=6, num_key_value_heads=2, sliding_window=16,
        **COMMON),
    # Phi-3.5-mini's LongRoPE (a divisor per frequency; cos and sin scaled by sqrt(1 + ln 2 / ln 256)): served up to
    # its original 256 positions, so with its short factors (the long ones: test_longrope_past_the_original_length)
    "phi3-longrope": transformers.Phi3Config(
        hidden_size=96, intermediate_size=136, num_attention_heads=6, num_key_value_heads=3,
        original_max_position_embeddings=256, rope_parameters=LONGROPE(8), **COMMON),
    # Phi-4-mini's: rope over 3/4 of each head (24 of 32 dims) with LongRoPE, a tied head
    "phi4-mini": transformers.Phi3Config(
        hidden_size=128, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
        partial_rotary_factor=0.75, original_max_position_embeddings=256, rope_parameters=LONGROPE(12),
        **(COMMON | {"tie_word_embeddings": True})),
    # GLM-4: q/k/v biases, gate and up in one tensor, rope over half of each head turning dims 2i and 2i + 1
    # together; GLM-4-0414 with norms on the attention's and MLP's outputs too
    "glm": transformers.GlmConfig(
        hidden_size=96, intermediate_size=136, num_attention_heads=6, num_key_value_heads=2, head_dim=16, **COMMON),
    "glm4": transformers.Glm4Config(
        hidden_size=96, intermediate_size=136, num_attention_heads=6, num_key_value_heads=3, head_dim=16, **COMMON),
    "qwen3": transformers.Qwen3Config(
        hidden_size=96, intermediate_size=160, num_attention_heads=6, num_key_value_heads=3, head_dim=32, **COMMON),
    # Qwen3's long-context setting: YaRN over an original length of 64 (the prompts and generations pass it), a
    # rope base that puts the ramp between kept and interpolated frequencies over dimensions 0-9 of 16
    "qwen3-yarn": transformers.Qwen3Config(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        rope_parameters={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
                         "rope_theta": 100.0}, **COMMON),
    # sliding layers 0 and 2 (window 8, rope base 1e4), a global layer 1 (base 1e6, linear scaling 2)
    "gemma3": transformers.Gemma3TextConfig(
        hidden_size=80, intermediate_size=144, num_attention_heads=5, num_key_value_heads=1, head_dim=32,
        query_pre_attn_scalar=24, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}},
        final_logit_softcapping=30.0, **(COMMON | {"tie_word_embeddings": True})),
    # Gemma 2: layers 0 and 2 sliding (window 8), layer 1 global, one rope; attention scores capped at 3 (50 in the
    # published ones: small random weights would not reach that), final logits at 20
    "gemma2": transformers.Gemma2Config(
        hidden_size=64, intermediate_size=112, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        query_pre_attn_scalar=24, sliding_window=8, attn_logit_softcapping=3.0, final_logit_softcapping=20.0,
        **(COMMON | {"tie_word_embeddings": True})),
    # a multimodal checkpoint (language_model.*, vision_tower.*, multi_modal_projector.*) served as text: layers 0
    # and 1 sliding (window 8), layer 2 global
    "gemma3_mm": transformers.Gemma3Config(
        text_config=transformers.Gemma3TextConfig(
            hidden_size=64, intermediate_size=112, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            query_pre_attn_scalar=16, sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            **(COMMON | {"tie_word_embeddings": True})),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14),
        mm_tokens_per_image=4, tie_word_embeddings=True),
    # Mistral Small 3.1's layout (language_model.*, vision_tower.*, multi_modal_projector.*) served as text, its head
    # untied by the outer config; a 16-token window
    "mistral3_mm": transformers.Mistral3Config(
        text_config=transformers.MistralConfig(
            hidden_size=64, intermediate_size=112, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            sliding_window=16, **COMMON),
        vision_config=transformers.PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                       num_attention_heads=2, image_size=28, patch_size=14),
        tie_word_embeddings=False),
    # Ministral 3's multimodal checkpoints: its text model (q scaled by position from 32 on) from text_config
    "mistral3_mm-ministral3": transformers.Mistral3Config(
        text_config=transformers.Ministral3Config(
            hidden_size=64, intermediate_size=112, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            rope_parameters={"type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                             "original_max_position_embeddings": 32, "max_position_embeddings": 512,
                             "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0,
                             "llama_4_scaling_beta": 0.3}, **COMMON),
        vision_config=transformers.PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                       num_attention_heads=2, image_size=28, patch_size=14),
        tie_word_embeddings=False),
    # Qwen2.5-VL and Qwen3-VL served as text: their multimodal rope's three sections (2 + 3 + 3 of 8 frequencies)
    # over text positions, Qwen3-VL's interleaved
    "qwen2_5_vl": transformers.Qwen2_5_VLConfig(
        text_config=dict(hidden_size=64, intermediate_size=112, num_attention_heads=4, num_key_value_heads=2,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                         **COMMON),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=14, fullatt_block_indexes=[0]), tie_word_embeddings=False),
    "qwen3_vl": transformers.Qwen3VLConfig(
        text_config=dict(hidden_size=64, intermediate_size=112, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                       "mrope_section": [2, 3, 3], "mrope_interleaved": True},
                         **COMMON),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=14, deepstack_visual_indexes=[0]), tie_word_embeddings=False),
    # Qwen3-VL-MoE as text: 2 of 6 experts on every layer, each projection's experts in one tensor
    "qwen3_vl_moe": transformers.Qwen3VLMoeConfig(
        text_config=dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=40, num_experts=6,
                         num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [2, 3, 3], "mrope_interleaved": True}, **COMMON),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=14, deepstack_visual_indexes=[0]), tie_word_embeddings=False),
    # GLM-4.1V and GLM-4.5V served as text: GLM-4-0414's and GLM-4.5's layers, their multimodal rope's three sections
    # (2 + 1 + 1 of the 4 rotated frequencies) over text positions
    "glm4v": transformers.Glm4vConfig(
        text_config=dict(hidden_size=64, intermediate_size=112, num_attention_heads=4, num_key_value_heads=2,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                                          "partial_rotary_factor": 0.5}, **COMMON),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=14), tie_word_embeddings=False),
    "glm4v_moe": transformers.Glm4vMoeConfig(
        text_config=dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=24, n_routed_experts=8,
                         num_experts_per_tok=3, n_shared_experts=1, first_k_dense_replace=1, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, attention_bias=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                                          "partial_rotary_factor": 0.5}, **COMMON),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=14), tie_word_embeddings=False),
    # experts on layers 0 and 2, a dense MLP on layer 1; 3 of 10 experts per token, renormalised
    "qwen3_moe": transformers.Qwen3MoeConfig(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=40, num_experts=10, num_experts_per_tok=3,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1], num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, **COMMON),
    # Mixtral's names (block_sparse_moe.experts.N.w1 / w2 / w3), 2 of 6 experts on every layer, a 16-token window
    "mixtral_moe": transformers.MixtralConfig(
        hidden_size=64, intermediate_size=48, num_local_experts=6, num_experts_per_tok=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=16, **COMMON),
    # Qwen2-MoE: q/k/v biases, 2 of 6 experts (not renormalised) beside a gated shared expert on layers 0 and 2
    "qwen2_moe": transformers.Qwen2MoeConfig(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=40, shared_expert_intermediate_size=56,
        num_experts=6, num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[1], num_attention_heads=4,
        num_key_value_heads=2, **COMMON),
    # GraniteMoE: Granite's multipliers, 2 of 6 experts on every layer, each projection's experts in one tensor
    "granite_moe": transformers.GraniteMoeConfig(
        hidden_size=64, intermediate_size=40, num_local_experts=6, num_experts_per_tok=2, num_attention_heads=4,
        num_key_value_heads=2, embedding_multiplier=3.0, attention_multiplier=0.2, residual_multiplier=0.5,
        logits_scaling=4.0, **COMMON),
    # GLM-4.5: a dense layer 0, then 3 of 8 experts within the better of 2 groups beside an ungated shared expert,
    # sigmoid routing with a correction bias, weights times 2.5; q/k norms, biases, rope over half of each head
    "glm4_moe": transformers.Glm4MoeConfig(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=40, n_routed_experts=8, num_experts_per_tok=3,
        n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
        num_attention_heads=6, num_key_value_heads=2, head_dim=16, attention_bias=True, use_qk_norm=True,
        partial_rotary_factor=0.5, **COMMON),
    # dots.llm1: Qwen3's attention with biases on all four projections, GLM-4.5's routing (2 of 8 experts, not
    # renormalised, times 2.5) beside two shared experts from layer 1 on; a 12-token window on layer 2
    "dots1_moe": transformers.Dots1Config(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=24, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=2, first_k_dense_replace=1, norm_topk_prob=False, routed_scaling_factor=2.5,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_bias=True, sliding_window=12,
        max_window_layers=2, **COMMON),
    # ERNIE 4.5: rope on neighbouring dims, a tied head; 3 of 8 experts on layers 1 and 2 beside a shared one, chosen
    # by softmax score plus a correction bias
    "ernie4_5": transformers.Ernie4_5Config(
        hidden_size=96, intermediate_size=160, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
        **(COMMON | {"tie_word_embeddings": True})),
    "ernie4_5_moe": transformers.Ernie4_5_MoeConfig(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=24, moe_num_experts=8, moe_k=3,
        moe_num_shared_experts=1, moe_layer_start_index=1, moe_layer_end_index=2, num_attention_heads=4,
        num_key_value_heads=2, **(COMMON | {"tie_word_embeddings": True})),
    # Solar Open: GLM-4.5's routing (3 of 8 experts beside a shared one) on every layer, q/k/v biases
    "solar_open_moe": transformers.SolarOpenConfig(
        hidden_size=64, moe_intermediate_size=24, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1,
        n_group=2, topk_group=1, routed_scaling_factor=2.0, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, attention_bias=True, **COMMON),
    # OLMoE: Llama's pre-norms, q and k normed over all their heads, 3 of 8 experts on every layer, not renormalised
    "olmoe_moe": transformers.OlmoeConfig(
        hidden_size=64, intermediate_size=40, num_experts=8, num_experts_per_tok=3, num_attention_heads=4,
        num_key_value_heads=4, **COMMON),
    # MiniMax-M2: OLMo's q/k norms under pre-norms, rope over half of each head, 3 of 8 experts on every layer by
    # sigmoid score plus a correction bias, renormalised
    "minimax_m2_moe": transformers.MiniMaxM2Config(
        hidden_size=64, intermediate_size=24, num_local_experts=8, num_experts_per_tok=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                             "partial_rotary_factor": 0.5}, **COMMON),
    # gpt-oss: 2 of 6 experts with biases and the clamped SwiGLU on every layer, a biased router; an 8-token window on
    # layers 0 and 2, a sink per head, q/k/v/o biases, YaRN over an original length of 64
    "gpt_oss_moe": transformers.GptOssConfig(
        hidden_size=64, intermediate_size=64, num_local_experts=6, num_experts_per_tok=2, num_attention_heads=6,
        num_key_value_heads=2, head_dim=16, sliding_window=8,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 64, "rope_theta": 150000.0}, **COMMON),
    # DeepSeek-V2-Lite's shape: latent attention with q straight from the hidden state (no q_lora_rank), rope on
    # interleaved pairs; a dense layer 0, then 2 of 6 experts by softmax score beside 2 shared ones, not renormalised
    "deepseek_v2_moe": transformers.DeepseekV2Config(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=24, n_routed_experts=6, num_experts_per_tok=2,
        n_shared_experts=2, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=12, num_attention_heads=8, topk_method="greedy", **COMMON),
    # DeepSeek-V2's (236B): q through a rank-24 bottleneck; 2 of 6 experts within the best of 3 groups by their best
    # softmax score (group_limited_greedy), weights times 4
    "deepseek_v2_moe-grouped": transformers.DeepseekV2Config(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=24, n_routed_experts=6, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=0, n_group=3, topk_group=1, topk_method="group_limited_greedy",
        routed_scaling_factor=4.0, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, num_attention_heads=4, **COMMON),
    # GLM-4.7-Flash: DeepSeek-V3's attention (V wider than the nope dims) and GLM-4.5's routing, layer 0 dense
    "glm4_moe_lite_moe": transformers.Glm4MoeLiteConfig(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=24, n_routed_experts=8, num_experts_per_tok=3,
        n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=1.8, q_lora_rank=24, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24, num_attention_heads=4, num_key_value_heads=4,
        **COMMON),
    # DeepSeek-V3's: q through a rank-24 bottleneck, YaRN with mscale_all_dim (the softmax scale grows with it);
    # 3 of 8 experts within the better of 2 groups by sigmoid score plus a correction bias, times 2.5
    "deepseek_v3_moe": transformers.DeepseekV3Config(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=24, n_routed_experts=8, num_experts_per_tok=3,
        n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
        q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        num_attention_heads=4, rope_parameters={"rope_type": "yarn", "factor": 4.0, "mscale": 1.0,
                                                "mscale_all_dim": 1.0, "original_max_position_embeddings": 64,
                                                "beta_fast": 32.0, "beta_slow": 1.0, "rope_theta": 10000.0},
        **COMMON),
    "qwen3_moe-unnormalised": transformers.Qwen3MoeConfig(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_experts=6, num_experts_per_tok=2,
        norm_topk_prob=False, decoder_sparse_step=2, num_attention_heads=4, num_key_value_heads=4, **COMMON),
}
PROMPT_LENS = [5, 17, 1, 33, 16, 9, 40, 24]


def _write(name: str, tmp_path_factory, config: transformers.PretrainedConfig | None = None):
    """(name, folder, transformers' model) for one architecture (CONFIGS[name], or `config`), written by
    transformers in 3 MB shards."""
    torch.manual_seed(0)
    config = config or CONFIGS[name]
    # transformers' SDPA attention leaves Gemma 2's score cap out; its eager attention applies it
    eager = getattr(config, "attn_logit_softcapping", None) is not None
    # Mistral 3's and Qwen-VL's multimodal models are no AutoModelForCausalLM (Gemma 3's is)
    multimodal = ("mistral3", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v", "glm4v_moe", "aya_vision")
    auto = transformers.AutoModelForCausalLM
    if config.model_type in multimodal:
        auto = transformers.AutoModelForImageTextToText
    hf = auto.from_config(config, dtype=torch.float32, attn_implementation="eager" if eager else None).eval()
    with torch.no_grad():  # norms away from their init (1, or Gemma's 0), so that a misread one shows
        for param_name, param in hf.named_parameters():
            if "norm" in param_name:
                param.uniform_(-0.5, 0.5).add_(0.0 if "gemma" in name else 1.0)
        for tensor_name, tensor in (*hf.named_buffers(), *hf.named_parameters()):  # routers' biases (zeros at init)
            if tensor_name.endswith("e_score_correction_bias"):  # against sigmoid scores, or softmax ones (ERNIE's)
                bound = 0.03 if "ernie" in name else 0.3
                tensor.uniform_(-bound, bound)
            elif tensor_name.endswith("mlp.gate.weight") and not tensor.any():  # ERNIE's router: zeros at init
                tensor.normal_(0.0, 0.25)
            elif tensor_name.endswith(("self_attn.sinks", "mlp.router.bias", "_proj_bias")):  # gpt-oss's
                tensor.normal_(0.0, 1.0 if tensor_name.endswith("sinks") else 0.3)
    folder = tmp_path_factory.mktemp(name)
    hf.save_pretrained(folder, max_shard_size="3MB")
    write_qwen_tokenizer(folder)
    assert len(list(folder.glob("*.safetensors"))) > 1
    return name, folder, hf


def _written(name: str, tmp_path_factory):
    """_write's, its folder removed once its tests are done (the module writes one for each of CONFIGS)."""
    written = _write(name, tmp_path_factory)
    yield written
    shutil.rmtree(written[1], ignore_errors=True)


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request, tmp_path_factory):
    yield from _written(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=[name for name in CONFIGS if "moe" in name])
def moe_checkpoint(request, tmp_path_factory):
    yield from _written(request.param, tmp_path_factory)


def _prompts(n: int = 8, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 150000) for _ in range(PROMPT_LENS[i % len(PROMPT_LENS)])] for i in range(n)]


def _runner(folder, **kw) -> ModelRunner:
    return ModelRunner(folder, RunnerConfig(device="cpu", dtype="float32", num_blocks=160, block_size=8,
                                            limits=Limits(max_num_seqs=16, max_model_len=256), **kw))


def _generate_hf(hf, prompt: list[int], n: int) -> list[int]:
    (out,) = _generate_hf_batch(hf, [prompt], n)
    return out


def _generate_hf_batch(hf, prompts: list[list[int]], n: int) -> list[list[int]]:
    """transformers' greedy `generate` of n tokens after each prompt, the prompts left-padded into one batch (as its
    docs batch them: the same tokens as one call a prompt, for every architecture here, in a quarter of the time)."""
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          pad_token_id=0)
    return out[:, width:].tolist()


@pytest.fixture(scope="module")
def reference(checkpoint):
    _, _, hf = checkpoint
    return _generate_hf_batch(hf, _prompts(), 24)


def test_the_registry_serves_the_architecture_transformers_wrote(checkpoint):
    name, folder, hf = checkpoint
    arch = json.loads((folder / "config.json").read_text())["architectures"][0]
    assert arch == type(hf).__name__ and arch in ARCHITECTURES
    runner = _runner(folder)
    assert type(runner.model).__name__ == arch
    # its weights read again in place (UpdateWeights), names checked first as that load checks them: the same logits
    before = prefill_logits(runner, _prompts(2))
    assert runner.reload_weights(str(folder)) == ""
    for ours, theirs in zip(prefill_logits(runner, _prompts(2)), before):
        torch.testing.assert_close(ours, theirs, atol=0, rtol=0)


def test_logits_match_transformers(checkpoint):
    _, folder, hf = checkpoint
    runner, prompts = _runner(folder), _prompts()
    with torch.inference_mode():
        for p, ours in zip(prompts, prefill_logits(runner, prompts)):
            torch.testing.assert_close(ours, hf(torch.tensor([p])).logits[0], atol=1e-4, rtol=0)


def test_an_fp8_cache_holds_what_each_architecture_writes(checkpoint):
    """Every architecture over an fp8 KV cache: the logits of a float32 cache holding the same K and V rounded through
    e4m3, so windows, score caps, experts and every rope variant reach an fp8 cache as Qwen3's do (the fp8 cache's
    own accuracy: tests/test_fp8_kv.py)."""
    from tests.test_fp8_kv import _e4m3_in_full_precision

    _, folder, _ = checkpoint
    fp8, emulated = _runner(folder, kv_cache_dtype="fp8"), _runner(folder)
    _e4m3_in_full_precision(emulated)
    assert fp8.kv_cache.dtype == torch.float8_e4m3fn
    prompts = _prompts()
    for ours, rounded in zip(prefill_logits(fp8, prompts), prefill_logits(emulated, prompts)):
        torch.testing.assert_close(ours, rounded, atol=2e-4, rtol=1e-5)


@pytest.mark.parametrize("chunk", [1 << 30, 7])
def test_greedy_equals_generate_through_chunks_and_drops(checkpoint, reference, chunk):
    """Chunks that do not divide the block size; blocks scattered; every third sequence dropped and
    recomputed twice mid-generation (as a preemption does)."""
    driver = PagedDriver(_runner(checkpoint[1]), chunk=chunk, shuffle_seed=chunk % 97)
    seqs = [driver.add(p, 24) for p in _prompts()]
    run_with_drops(driver, seqs, drop_at=(3, 7))
    assert [s.generated for s in seqs] == reference


def test_greedy_with_prefix_reuse(checkpoint):
    """A second sequence over the first one's cached blocks (three of 8 tokens: past the sliding window)."""
    _, folder, hf = checkpoint
    driver = PagedDriver(_runner(folder), shuffle_seed=3)
    first = driver.add(_prompts()[6], 8)  # 40 tokens: five full blocks
    driver.run_step()
    extended = first.tokens[:24] + _prompts()[3]
    second = driver.add(extended, 16, prefix_blocks=first.blocks[:3])
    driver.run_all()
    assert second.generated == _generate_hf(hf, extended, 16)


# Every architecture's tokens are proven in-process above, by the runner the worker serves. Through the services, the
# kinds of model the scheduler and the worker's start see differently: rope scaling past the original length, sliding
# windows (the blocks behind them given back), nested multimodal configs, latent attention's cache, expert layouts.
THROUGH_THE_SERVICES = ["qwen3", "llama-tied", "phi3-longrope", "qwen3-yarn", "mistral", "qwen2-window", "gemma2",
                        "gemma3", "gemma3_mm", "mistral3_mm", "glm4v", "qwen3_vl_moe", "qwen3_moe", "gpt_oss_moe",
                        "minimax_m2_moe", "deepseek_v3_moe", "glm4_moe_lite_moe"]


@pytest.mark.parametrize("checkpoint", THROUGH_THE_SERVICES, indirect=True)
def test_greedy_through_the_services(checkpoint, tmp_path):
    """client -> scheduler -> worker, requests at once (chunked prefill under a small token budget)."""
    _, folder, hf = checkpoint
    prompts = _prompts(4, seed=5)
    limits = ["--max-num-batched-tokens", "32", "--max-model-len", "256"]
    with LocalCluster(folder, worker_args=["--num-blocks", "96", "--block-size", "8", *limits],
                      scheduler_args=limits, log_dir=tmp_path) as cluster, Client(cluster.address, timeout=120) as c:
        outs = [c.complete(token_ids=p, max_tokens=12, temperature=0.0, ignore_eos=True) for p in prompts]
    assert [o[0].token_ids for o in outs] == _generate_hf_batch(hf, prompts, 12)


def test_a_checkpoint_shipping_tiktoken_ranks_serves_text(tmp_path_factory, tmp_path):
    """Kimi-K2's layout (DeepSeek-V3's architecture, tiktoken.model and tokenization_kimi's config, no tokenizer.json):
    a text prompt is encoded as tiktoken encodes it and generated as transformers generates."""
    from tests.test_tokenizer import KIMI_PATTERN, KIMI_NAMED, _write_kimi_layout
    from worker_svc.checkpoints.tokenizer_files import load_ranks

    _, folder, hf = _write("deepseek_v3_moe", tmp_path_factory)
    for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        (folder / f).unlink()
    config = json.loads((folder / "config.json").read_text())
    _write_kimi_layout(folder)
    (folder / "config.json").write_text(json.dumps(config))  # the model's own, not the layout's stand-in
    n = len(load_ranks())
    tiktoken_ids = tiktoken.Encoding("kimi", pat_str=KIMI_PATTERN, mergeable_ranks=load_ranks(), special_tokens={
        KIMI_NAMED.get(i - n, (f"<|reserved_token_{i}|>",))[0]: i for i in range(n, n + 256)})
    prompt = "<|im_user|>中文English混合, HELLOWorld 12345<|im_end|><|im_assistant|>"
    ids = tiktoken_ids.encode(prompt, allowed_special="all")
    with LocalCluster(folder, worker_args=["--num-blocks", "64", "--block-size", "8"], log_dir=tmp_path) as cluster, \
            Client(cluster.address, timeout=120) as c:
        out = c.complete(prompt, max_tokens=10, temperature=0.0, ignore_eos=True, prompt_logprobs=0)[0]
    assert out.prompt_token_ids == ids
    assert out.token_ids == _generate_hf(hf, ids, 10)


def test_a_window_model_gives_back_the_blocks_behind_its_window(tmp_path_factory, tmp_path):
    """Mistral with a 12-token window on 14 blocks of 8: four sequences of 60 positions would need 32 blocks at
    once, but each gives its blocks back as its window passes them, so all four run side by side with no
    preemption, and a fifth of 170 positions (22 blocks: more than the pool) is served alone after them, again with
    no preemption; their greedy tokens equal transformers' `generate`, and every block is free afterwards."""
    _, folder, hf = _write("mistral", tmp_path_factory)
    rng = random.Random(9)
    prompts = [[rng.randrange(0, 150000) for _ in range(n)] for n in (40, 40, 40, 40, 150)]
    metrics = free_port()
    limits = ["--max-num-batched-tokens", "16", "--max-model-len", "256"]
    with LocalCluster(folder, worker_args=["--num-blocks", "14", "--block-size", "8", *limits],
                      scheduler_args=[*limits, "--metrics-port", str(metrics)], log_dir=tmp_path) as cluster, \
            Client(cluster.address, timeout=120) as c:
        streams = join(start_streams(c, [dict(token_ids=p, max_tokens=20, temperature=0.0, ignore_eos=True)
                                         for p in prompts[:4]]))
        streams += join(start_streams(c, [dict(token_ids=prompts[4], max_tokens=20, temperature=0.0,
                                               ignore_eos=True)]))
        assert [s.error for s in streams] == [None] * 5
        assert [s.token_ids for s in streams] == _generate_hf_batch(hf, prompts, 20)
        wait_for("every block free", lambda: all_idle(c), timeout=60)
        samples = scrape(metrics)
        assert sample(samples, "splitserve:num_preemptions_total") == 0
        assert sample(samples, "splitserve:kv_blocks_released_total") >= 4 * 5 + 19  # 5 behind a 60-position one
        info = c.model_info()
        # The gateway's default max_tokens reaches max_model_len, not the pool's 14 x 8 + 1 positions.
        assert info["workers"][0]["sliding_window"] == 12 and gateway_token_limit(info) == 256
        assert gateway_token_limit({**info, "workers": [{**info["workers"][0], "sliding_window": 0}]}) == 113


def test_the_gateway_lets_a_window_model_fill_its_length(tmp_path_factory, tmp_path):
    """Chat without max_tokens runs up to the model's length (OpenAI's default): 256 positions, on a pool of 14
    blocks of 8 (112 positions) that a sequence behind a 12-token window may outgrow."""
    from tests.test_gateway import Gateway

    _, folder, _ = _write("mistral", tmp_path_factory)
    limits = ["--max-num-batched-tokens", "16", "--max-model-len", "256"]
    with LocalCluster(folder, worker_args=["--num-blocks", "14", "--block-size", "8", *limits],
                      scheduler_args=limits, log_dir=tmp_path) as cluster:
        gateway = Gateway(cluster.address, tmp_path / "gateway.log", "--tokenizer", str(folder)).wait_healthy()
        try:
            out = gateway.openai().chat.completions.create(
                model="", messages=[{"role": "user", "content": "Hello"}], temperature=0,
                extra_body={"ignore_eos": True})
        finally:
            gateway.stop()
    assert out.choices[0].finish_reason == "length" and out.usage.total_tokens == 256


@pytest.mark.parametrize("name", ["mistral", "phi3"])
def test_tp2_window_model_gives_back_blocks_on_every_rank(name, tmp_path_factory, tmp_path):
    """Mistral (a 12-token window) and Phi-3 (16, its q, k, v and gate, up stored fused: each rank takes its slices
    of them) with 6 heads over 2 KV heads under TP = 2 with blocks of 8: prompts longer than the window leave blocks
    behind it, the plan releases them on both ranks (each rank's batch refuses a release the window still covers),
    and the greedy tokens equal transformers'."""
    _, folder, hf = _write(name, tmp_path_factory)
    prompts = _prompts(4, seed=6)
    metrics = free_port()
    with LocalCluster(folder, worker_args=["--tensor-parallel-size", "2", "--num-blocks", "32", "--block-size", "8"],
                      scheduler_args=["--metrics-port", str(metrics)], log_dir=tmp_path) as cluster, \
            Client(cluster.address, timeout=120) as c:
        streams = join(start_streams(c, [dict(token_ids=p, max_tokens=12, temperature=0.0, ignore_eos=True)
                                         for p in prompts]))
        assert [s.token_ids for s in streams] == _generate_hf_batch(hf, prompts, 12)
        wait_for("blocks released", lambda: sample(scrape(metrics), "splitserve:kv_blocks_released_total") > 0)


def test_every_expert_is_used(moe_checkpoint):
    """The comparisons above cover every expert of every sparse layer: each is some token's choice."""
    _, folder, _ = moe_checkpoint
    from worker_svc.model.moe import SparseMoE

    runner = _runner(folder)
    chosen: dict[int, set[int]] = {}
    for i, layer in enumerate(runner.model.layers):
        if isinstance(layer.mlp, SparseMoE):
            chosen[i] = set()
            fused = layer.mlp.kernels.fused_moe
            layer.mlp.kernels = dataclasses.replace(
                layer.mlp.kernels, fused_moe=lambda *a, _s=chosen[i], _f=fused, **kw: (
                    _s.update(a[4].flatten().tolist()), _f(*a, **kw))[1])
    driver = PagedDriver(runner)
    for p in _prompts():
        driver.add(p, 4)
    driver.run_all()
    experts = runner.model_config.moe.num_experts
    assert chosen and all(c == set(range(experts)) for c in chosen.values()), chosen


def test_gpt_oss_loads_its_experts_from_mxfp4_as_transformers_does(tmp_path_factory):
    """gpt-oss's published layout: each expert projection as MXFP4 `_blocks` and `_scales` ([experts, out, in / 32,
    16] and [experts, out, in / 32]; quantised here by the project's writer), the scales in a file of their own.
    transformers dequantises them on a CPU; our logits equal its logits on the same checkpoint, and differ from the
    unquantised model's."""
    from safetensors.torch import load_file, save_file

    from worker_svc.checkpoints.writer import quantize_mxfp4

    _, folder, hf = _write("gpt_oss_moe", tmp_path_factory)
    mx = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    weight_map, scales = {}, {}
    for file in sorted(set(index["weight_map"].values())):
        tensors = {}
        for name, t in load_file(folder / file).items():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                tensors[f"{name}_blocks"], scales[f"{name}_scales"] = quantize_mxfp4(t.transpose(1, 2))
            else:
                tensors[name] = t
        save_file(tensors, mx / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, file)
    save_file(scales, mx / "scales.safetensors", metadata={"format": "pt"})
    weight_map |= dict.fromkeys(scales, "scales.safetensors")
    (mx / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (mx / "config.json").write_text(json.dumps(config))
    write_qwen_tokenizer(mx)
    hf_mx = transformers.AutoModelForCausalLM.from_pretrained(
        mx, quantization_config=transformers.Mxfp4Config(dequantize=True)).float().eval()  # bf16 values: exact
    prompts = _prompts(4)
    with torch.inference_mode():
        for p, ours in zip(prompts, prefill_logits(_runner(mx), prompts)):
            theirs = hf_mx(torch.tensor([p])).logits[0]
            torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
            assert (theirs - hf(torch.tensor([p])).logits[0]).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["qwen3", "qwen3_vl"])
def test_fp8_block_scaled_checkpoints_load_as_transformers_dequantises_them(name, tmp_path_factory):
    """Qwen3's -FP8 checkpoints' layout (DeepSeek-V3's too): every projection in e4m3 with its weight_scale_inv per
    block (8 x 8 here), `quant_method: fp8` in config.json (the outer one of a multimodal model). Our logits equal
    transformers' on the same weights dequantised by transformers' own Fp8Dequantize, and differ from the
    unquantised model's."""
    from safetensors.torch import load_file, save_file

    from tests.hf_reference import from_pretrained
    from worker_svc.checkpoints.writer import quantize_fp8_blocks

    _, folder, hf = _write(name, tmp_path_factory)
    fp8 = tmp_path_factory.mktemp(f"{name}_fp8")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    weight_map = {}
    for file in sorted(set(index["weight_map"].values())):
        tensors = {}
        for tensor_name, t in load_file(folder / file).items():
            if tensor_name.endswith("_proj.weight") and "visual" not in tensor_name:
                tensors[tensor_name], tensors[f"{tensor_name}_scale_inv"] = quantize_fp8_blocks(t, (8, 8))
            else:
                tensors[tensor_name] = t
        save_file(tensors, fp8 / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, file)
    (fp8 / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [8, 8]}
    (fp8 / "config.json").write_text(json.dumps(config))
    write_qwen_tokenizer(fp8)
    prompts = _prompts(4)
    ours = prefill_logits(_runner(fp8), prompts)
    if name == "qwen3_vl":  # the multimodal model is no AutoModelForCausalLM: its float weights, in the test
        return _check_multimodal_fp8(fp8, hf, prompts, ours)
    hf_fp8 = from_pretrained(fp8)
    with torch.inference_mode():
        for p, logits in zip(prompts, ours):
            theirs = hf_fp8(torch.tensor([p])).logits[0]
            torch.testing.assert_close(logits, theirs, atol=1e-4, rtol=0)
            assert (theirs - hf(torch.tensor([p])).logits[0]).abs().max() > 1e-3


def _check_multimodal_fp8(fp8, hf, prompts, ours) -> None:
    """Qwen3-VL's FP8 text model: transformers' model with each projection set to Fp8Dequantize's values."""
    from safetensors.torch import load_file
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    stored = {}
    for path in fp8.glob("*.safetensors"):
        stored |= load_file(path)
    params = dict(hf.named_parameters())
    with torch.no_grad(), torch.inference_mode():
        for scale_name in [n for n in stored if n.endswith("_scale_inv")]:
            weight = scale_name.removesuffix("_scale_inv")
            params[weight].copy_(Fp8Dequantize(None)._dequantize_one(stored[weight], stored[scale_name], torch.float32))
        for p, logits in zip(prompts, ours):
            torch.testing.assert_close(logits, hf(torch.tensor([p])).logits[0], atol=1e-4, rtol=0)


def test_a_multimodal_gemma3_saved_in_the_newer_layout_loads_the_same(tmp_path_factory, tmp_path):
    """Some transformers releases saved Gemma3ForConditionalGeneration as `model.language_model.*`,
    `model.vision_tower.*`, `lm_head.*`: the same weights give the same logits."""
    from safetensors.torch import load_file

    _, folder, _ = _write("gemma3_mm", tmp_path_factory)
    tensors = {}
    for path in folder.glob("*.safetensors"):
        for name, t in load_file(path).items():
            name = name.replace("language_model.model.", "model.language_model.")
            name = name.replace("language_model.lm_head.", "lm_head.")
            tensors["model." + name if name.startswith(("vision_tower.", "multi_modal")) else name] = t
    assert any(n.startswith("model.vision_tower.") for n in tensors)
    _assert_same_logits(folder, tensors, tmp_path)


def _assert_same_logits(folder, tensors: dict[str, torch.Tensor], tmp_path) -> None:
    """`tensors` (the checkpoint in `folder`, stored another way) saved beside folder's other files in tmp_path give
    the same logits as the checkpoint itself."""
    from safetensors.torch import save_file

    for path in folder.iterdir():
        if path.suffix != ".safetensors" and path.name != "model.safetensors.index.json":
            (tmp_path / path.name).write_bytes(path.read_bytes())
    save_file(tensors, tmp_path / "model.safetensors")
    prompts = _prompts(3)
    for ours, theirs in zip(prefill_logits(_runner(tmp_path), prompts), prefill_logits(_runner(folder), prompts)):
        torch.testing.assert_close(ours, theirs, atol=0, rtol=0)


def test_qwen3_vl_moe_experts_as_published_load_the_same(tmp_path_factory, tmp_path):
    """Qwen3-VL-MoE's published checkpoints store each projection's experts as [experts, in, out]; transformers 5
    saves [experts, out, in]: both give the same logits."""
    from safetensors.torch import load_file

    _, folder, _ = _write("qwen3_vl_moe", tmp_path_factory)
    tensors = {}
    for path in folder.glob("*.safetensors"):
        tensors |= {n: t.transpose(1, 2).contiguous() if ".experts." in n else t for n, t in load_file(path).items()}
    assert any(".experts.gate_up_proj" in n for n in tensors)
    _assert_same_logits(folder, tensors, tmp_path)


@pytest.mark.parametrize("name,block,extras", [
    # GLM-4.5: a decoder layer after the last of the 3 (num_nextn_predict_layers 1), with its own norms and projection
    ("glm4_moe", "model.layers.3.", ("model.layers.3.eh_proj", "model.layers.3.enorm", "model.layers.3.hnorm",
                                     "model.layers.3.shared_head.norm")),
    # ERNIE 4.5 MoE: `model.mtp_block.0.*`, its norms and projection (transformers leaves every `mtp` tensor)
    ("ernie4_5_moe", "model.mtp_block.0.", ("model.mtp_emb_norm.0", "model.mtp_hidden_norm.0",
                                            "model.mtp_linear_proj.0")),
])
def test_the_published_multi_token_prediction_tensors_are_left(name, block, extras, tmp_path_factory, tmp_path):
    """GLM-4.5's and ERNIE 4.5's published checkpoints store a multi-token-prediction block beside the model's layers;
    transformers leaves it, and so does the worker: the same logits."""
    from safetensors.torch import load_file

    _, folder, hf = _write(name, tmp_path_factory)
    h = hf.config.hidden_size
    if name == "glm4_moe":
        assert (hf.config.num_hidden_layers, hf.config.num_nextn_predict_layers) == (3, 1)
    tensors = {n: t for path in folder.glob("*.safetensors") for n, t in load_file(path).items()}
    tensors |= {n.replace("model.layers.1.", block): t.clone() for n, t in tensors.items() if "model.layers.1." in n}
    tensors |= {f"{e}.weight": torch.randn(h, 2 * h) if "proj" in e else torch.ones(h) for e in extras}
    _assert_same_logits(folder, tensors, tmp_path)


def test_a_published_multimodal_gemma3_config_reads_as_transformers_reads_it(tmp_path):
    """gemma-3-4b-it's config.json lists in its text_config only what differs from Gemma3TextConfig's defaults; the
    rest (heads, head_dim, vocabulary, query_pre_attn_scalar, the layer pattern, tied head) comes from those, read
    here as transformers reads them."""
    published = {
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "torch_dtype": "bfloat16",
        "boi_token_index": 255999, "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144,
        "initializer_range": 0.02, "mm_tokens_per_image": 256,
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                        "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                        "sliding_window": 1024},
        "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                          "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                          "patch_size": 14, "vision_use_head": False},
    }
    (tmp_path / "config.json").write_text(json.dumps(published))
    ours = ModelConfig.from_dir(tmp_path)
    text = transformers.Gemma3Config.from_dict(published).text_config
    assert ours.architecture == "Gemma3ForConditionalGeneration" and ours.dtype == torch.bfloat16
    assert (ours.vocab_size, ours.hidden_size, ours.intermediate_size, ours.num_hidden_layers,
            ours.num_attention_heads, ours.num_key_value_heads, ours.head_dim, ours.max_position_embeddings) == (
        text.vocab_size, text.hidden_size, text.intermediate_size, text.num_hidden_layers, text.num_attention_heads,
        text.num_key_value_heads, text.head_dim, text.max_position_embeddings)
    assert ours.layer_windows == tuple(text.sliding_window if t == "sliding_attention" else None
                                       for t in text.layer_types)
    assert ours.attention_scale == text.query_pre_attn_scalar ** -0.5 and ours.hidden_act == text.hidden_activation
    full, local = text.rope_parameters["full_attention"], text.rope_parameters["sliding_attention"]
    assert (ours.rope_scaling.kind, ours.rope_scaling.factor) == (full["rope_type"], full["factor"])
    assert (ours.rope_theta, ours.local_rope_theta) == (full["rope_theta"], local["rope_theta"])
    assert ours.tie_word_embeddings == text.tie_word_embeddings and ours.rms_norm_eps == text.rms_norm_eps


def test_a_published_qwen2_5_vl_config_reads_as_transformers_reads_it(tmp_path):
    """Qwen2.5-VL-7B-Instruct's config.json keeps its text model's fields at the top (no text_config) and names its
    rope `mrope`: the same shape as transformers reads, plain rope (text positions), untied."""
    published = {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl", "torch_dtype": "bfloat16",
        "hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28, "num_hidden_layers": 28,
        "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "max_position_embeddings": 128000,
        "vocab_size": 152064, "tie_word_embeddings": False, "sliding_window": 32768, "use_sliding_window": False,
        "max_window_layers": 28, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "vision_config": {"depth": 32, "hidden_size": 1280, "out_hidden_size": 3584, "fullatt_block_indexes": [7]},
    }
    (tmp_path / "config.json").write_text(json.dumps(published))
    ours = ModelConfig.from_dir(tmp_path)
    text = transformers.Qwen2_5_VLConfig.from_dict(published).text_config
    assert (ours.hidden_size, ours.intermediate_size, ours.num_hidden_layers, ours.num_attention_heads,
            ours.num_key_value_heads, ours.head_dim, ours.vocab_size, ours.max_position_embeddings) == (
        text.hidden_size, text.intermediate_size, text.num_hidden_layers, text.num_attention_heads,
        text.num_key_value_heads, text.hidden_size // text.num_attention_heads, text.vocab_size,
        text.max_position_embeddings)
    assert ours.rope_theta == text.rope_parameters["rope_theta"] and ours.rope_scaling is None
    assert ours.qkv_bias and not ours.tie_word_embeddings and ours.layer_windows is None
    assert ours.dtype == torch.bfloat16


@pytest.mark.parametrize("rope", [
    {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},  # Qwen3's card
    {"rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                      "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707}},  # DeepSeek's attention factor
    {"rope_scaling": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16384,
                      "truncate": False}},
    {"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.5},
     "original_max_position_embeddings": 65536},  # the top-level length wins, as transformers reads it
])
def test_yarn_frequencies_and_scale_are_transformers(rope, tmp_path):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from worker_svc.model.layers import rope_frequencies

    raw = transformers.Qwen3Config(head_dim=128, rope_theta=1e6, max_position_embeddings=131072, **rope).to_dict()
    raw["architectures"] = ["Qwen3ForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ours = ModelConfig.from_dir(tmp_path)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](transformers.Qwen3Config(**raw), "cpu")
    torch.testing.assert_close(rope_frequencies(128, ours.rope_theta, ours.rope_scaling), inv_freq, rtol=1e-6, atol=0)
    assert ours.rope_scaling.attention_factor == pytest.approx(attention_factor, rel=1e-12)


def test_longrope_past_the_original_length(tmp_path_factory):
    """Phi-4-mini's rope (LongRoPE over 24 of 32 dims per head) served to 256 positions past its original 32: the long
    factors for every sequence, as transformers takes them for a sequence past 32, so prompts of 33-60 tokens give
    transformers' logits, and greedy tokens equal to `generate` through chunks and drops."""
    # weights of std 0.1 (the others' 0.25): the longer prompts' float32 rounding stays well inside 1e-4
    config = transformers.Phi3Config(**(CONFIGS["phi4-mini"].to_dict() | {"original_max_position_embeddings": 32,
                                                                          "initializer_range": 0.1}))
    config.rope_parameters["original_max_position_embeddings"] = 32
    _, folder, hf = _write("phi4-mini-long", tmp_path_factory, config)
    rng = random.Random(4)
    prompts = [[rng.randrange(0, 150000) for _ in range(n)] for n in (33, 40, 47, 60)]
    runner = _runner(folder)
    assert runner.model.config.max_position_embeddings == 256
    with torch.inference_mode():
        for p, ours in zip(prompts, prefill_logits(runner, prompts)):
            torch.testing.assert_close(ours, hf(torch.tensor([p])).logits[0], atol=1e-4, rtol=0)
    driver = PagedDriver(_runner(folder), chunk=13, shuffle_seed=5)
    seqs = [driver.add(p, 16) for p in prompts]
    run_with_drops(driver, seqs, drop_at=(3, 7))
    assert [s.generated for s in seqs] == _generate_hf_batch(hf, prompts, 16)


@pytest.mark.parametrize("served", [4096, 131072])
def test_longrope_frequencies_and_scale_are_transformers(served):
    """Phi-3.5-mini's published rope settings (heads of 96, original 4,096 of 131,072 positions; its factor values
    drawn here): the short factors for a worker serving 4,096 positions, the long ones for 131,072, each as
    transformers computes them for a sequence of that length, and the same attention scale."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from worker_svc.model.layers import rope_frequencies

    rope = {"type": "longrope", "short_factor": [1.0 + 0.02 * i for i in range(48)],
            "long_factor": [1.0 + 0.9 * i for i in range(48)]}
    raw = transformers.Phi3Config(hidden_size=3072, num_attention_heads=32, max_position_embeddings=131072,
                                  original_max_position_embeddings=4096, rope_scaling=rope,
                                  architectures=["Phi3ForCausalLM"]).to_dict()
    ours = ModelConfig.common(raw)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["longrope"](transformers.Phi3Config(**raw), "cpu",
                                                                 seq_len=served)
    torch.testing.assert_close(rope_frequencies(96, ours.rope_theta, ours.rope_scaling, served), inv_freq,
                               rtol=1e-6, atol=0)
    assert ours.rope_scaling.attention_factor == pytest.approx(attention_factor, rel=1e-12)
    assert attention_factor == pytest.approx((1 + math.log(32) / math.log(4096)) ** 0.5)


def test_a_mistral3_checkpoint_whose_text_model_is_neither_mistral_nor_ministral3_is_refused(tmp_path):
    raw = CONFIGS["mistral3_mm"].to_dict() | {"architectures": ["Mistral3ForConditionalGeneration"]}
    raw["text_config"] = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4).to_dict()
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="'llama' text model is not supported"):
        ModelConfig.from_dir(tmp_path)


def test_a_rope_it_does_not_compute_is_refused_by_name(tmp_path):
    raw = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, rope_scaling={
        "rope_type": "dynamic", "factor": 2.0}).to_dict() | {"architectures": ["LlamaForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="unsupported rope_type 'dynamic'"):
        ModelConfig.from_dir(tmp_path)


@pytest.mark.parametrize("config_class", ["Qwen2Config", "Qwen3Config", "Qwen2MoeConfig", "Qwen3MoeConfig"])
@pytest.mark.parametrize("use_sliding_window, max_window_layers", [(True, 0), (True, 3), (True, 6), (False, 3)])
def test_qwen_windows_are_the_layers_transformers_windows(config_class, use_sliding_window, max_window_layers,
                                                         tmp_path):
    """Each Qwen architecture's own rule for which layers use_sliding_window windows (Qwen2 and Qwen3 from
    max_window_layers on, Qwen2-MoE the even ones below it, Qwen3-MoE all), read from a config.json without
    `layer_types` (written before transformers kept it) as transformers' attention layers take it."""
    import importlib

    hf = getattr(transformers, config_class)(
        hidden_size=32, intermediate_size=32, num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1,
        use_sliding_window=use_sliding_window, sliding_window=16, max_window_layers=max_window_layers)
    name = config_class.removesuffix("Config")
    raw = {k: v for k, v in hf.to_dict().items() if k != "layer_types"} | {"architectures": [f"{name}ForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ours = ModelConfig.from_dir(tmp_path)
    module = name.lower().replace("moe", "_moe")
    attention = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), f"{name}Attention")
    theirs = [getattr(attention(hf, i), "sliding_window", None) or None for i in range(6)]
    assert [ours.window_of(i) for i in range(6)] == theirs


def test_an_unsupported_architecture_is_refused_at_start(tmp_path):
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=1000)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"unsupported architecture GPT2LMHeadModel: this worker serves "
                                         r"Qwen3ForCausalLM, .*LlamaForCausalLM"):
        _runner(tmp_path)
    worker = subprocess.run([sys.executable, "-m", "worker_svc.cli", "serve", "--model", str(tmp_path),
                             "--device", "cpu", "--port", "0", "--plaintext"], capture_output=True, text=True,
                            timeout=120)
    assert worker.returncode != 0
    assert "unsupported architecture GPT2LMHeadModel" in worker.stderr and "Traceback" not in worker.stderr
