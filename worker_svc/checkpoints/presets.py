"""Named model configurations, as the fields of a Hugging Face `config.json`.

The real presets copy the published shapes (Qwen/Qwen3-*, Qwen/Qwen3-30B-A3B, meta-llama/Llama-3.1-8B,
Qwen/Qwen2.5-7B, HuggingFaceTB/SmolLM3-3B, zai-org/GLM-4-9B-0414, mistralai/Mistral-7B-v0.1,
mistralai/Mixtral-8x7B-v0.1, google/gemma-3-1b-pt, microsoft/phi-4, microsoft/Phi-3-mini-4k-instruct,
Phi-3.5-mini-instruct, Phi-4-mini-instruct, Qwen/Qwen1.5-MoE-A2.7B, google/gemma-2-2b,
ibm-granite/granite-3.1-8b-instruct, granite-3.0-1b-a400m) except the vocabulary: every preset keeps Qwen's (151,936
rows), as the tokenizer written beside the weights is Qwen's (no other is at hand offline). The test presets shrink
everything else.
"""

from __future__ import annotations

import copy

VOCAB_SIZE = 151936
BOS_TOKEN_ID = 151643  # <|endoftext|>
EOS_TOKEN_ID = 151645  # <|im_end|>
ROPE_THETA = 1000000.0

DEFAULT_PRESET = "qwen3-small"


def _qwen3(
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    intermediate: int,
    tied: bool,
    max_pos: int = 40960,
    dtype: str = "bfloat16",
) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": intermediate,
        "max_position_embeddings": max_pos,
        "max_window_layers": layers,
        "model_type": "qwen3",
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-06,
        # Published Qwen3 configs carry `rope_theta` at top level; transformers 5 reads `rope_parameters`.
        "rope_parameters": {"rope_theta": ROPE_THETA, "rope_type": "default"},
        "rope_scaling": None,
        "rope_theta": ROPE_THETA,
        "sliding_window": None,
        "tie_word_embeddings": tied,
        # transformers < 5 reads `torch_dtype`, transformers 5 `dtype`.
        "dtype": dtype,
        "torch_dtype": dtype,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": VOCAB_SIZE,
    }


def _other(architecture: str, model_type: str, hidden: int, layers: int, heads: int, kv_heads: int,
           intermediate: int, tied: bool, max_pos: int, rope_theta: float, dtype: str = "bfloat16",
           **extra) -> dict:
    """A Llama-family config (Llama, Mistral, Qwen2) in its published field names."""
    return {
        "architectures": [architecture], "model_type": model_type, "attention_dropout": 0.0,
        "bos_token_id": BOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID, "hidden_act": "silu", "hidden_size": hidden,
        "initializer_range": 0.02, "intermediate_size": intermediate, "max_position_embeddings": max_pos,
        "num_attention_heads": heads, "num_hidden_layers": layers, "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-05, "rope_theta": rope_theta, "tie_word_embeddings": tied, "dtype": dtype,
        "torch_dtype": dtype, "use_cache": True, "vocab_size": VOCAB_SIZE, **extra,
    }


_LLAMA3_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192, "rope_type": "llama3"}


def _llama(hidden, layers, heads, kv_heads, intermediate, tied, max_pos=131072, dtype="bfloat16",
           rope_original=8192, bias=False):
    rope = _LLAMA3_ROPE | {"original_max_position_embeddings": rope_original}
    return _other("LlamaForCausalLM", "llama", hidden, layers, heads, kv_heads, intermediate, tied, max_pos,
                  500000.0, dtype, attention_bias=bias, mlp_bias=bias, rope_scaling=rope, head_dim=hidden // heads)


def _qwen2(hidden, layers, heads, kv_heads, intermediate, tied, max_pos=32768, dtype="bfloat16"):
    return _other("Qwen2ForCausalLM", "qwen2", hidden, layers, heads, kv_heads, intermediate, tied, max_pos,
                  1000000.0, dtype, rms_norm_eps=1e-06, sliding_window=None, use_sliding_window=False,
                  max_window_layers=layers)


def _smollm3(hidden, layers, heads, kv_heads, intermediate, max_pos=65536, dtype="bfloat16", interval=4):
    return _other("SmolLM3ForCausalLM", "smollm3", hidden, layers, heads, kv_heads, intermediate, True, max_pos,
                  5000000.0, dtype, rms_norm_eps=1e-06, no_rope_layer_interval=interval, use_sliding_window=False,
                  sliding_window=None, attention_bias=False, mlp_bias=False)


def _glm4(hidden, layers, heads, kv_heads, head_dim, intermediate, max_pos=32768, dtype="bfloat16"):
    return _other("Glm4ForCausalLM", "glm4", hidden, layers, heads, kv_heads, intermediate, False, max_pos, 10000.0,
                  dtype, head_dim=head_dim, partial_rotary_factor=0.5, attention_bias=True)


def _cohere(version: int, hidden, layers, heads, kv_heads, intermediate, max_pos=131072, dtype="bfloat16",
            window=4096, rope_theta=50000.0, logit_scale=0.25, qk_norm=False):
    """Command R (version 1; R+ with qk_norm) or Command R7B / A (2: windows on three layers of four, the fourth
    global)."""
    extra = {"sliding_window": window, "sliding_window_pattern": 4} if version == 2 else {"use_qk_norm": qk_norm}
    return _other(f"Cohere{version if version == 2 else ''}ForCausalLM", f"cohere{version if version == 2 else ''}",
                  hidden, layers, heads, kv_heads, intermediate, True, max_pos, rope_theta, dtype,
                  layer_norm_eps=1e-05, logit_scale=logit_scale, attention_bias=False, **extra)


def _starcoder2(hidden, layers, heads, kv_heads, intermediate, max_pos=16384, dtype="bfloat16", window=4096):
    return _other("Starcoder2ForCausalLM", "starcoder2", hidden, layers, heads, kv_heads, intermediate, True, max_pos,
                  999999.4420358813, dtype, hidden_act="gelu_pytorch_tanh", norm_epsilon=1e-05, use_bias=True,
                  sliding_window=window, residual_dropout=0.0, embedding_dropout=0.0)


def _nemotron(hidden, layers, heads, kv_heads, head_dim, intermediate, max_pos=4096, dtype="bfloat16"):
    return _other("NemotronForCausalLM", "nemotron", hidden, layers, heads, kv_heads, intermediate, False, max_pos,
                  10000.0, dtype, hidden_act="relu2", head_dim=head_dim, norm_eps=1e-05, partial_rotary_factor=0.5,
                  attention_bias=False, mlp_bias=False)


def _mistral(hidden, layers, heads, kv_heads, intermediate, window, max_pos=32768, dtype="bfloat16"):
    return _other("MistralForCausalLM", "mistral", hidden, layers, heads, kv_heads, intermediate, False, max_pos,
                  10000.0, dtype, sliding_window=window, head_dim=hidden // heads)


def _phi3(hidden, layers, heads, kv_heads, intermediate, max_pos, rope_theta, window=None, dtype="bfloat16",
          tied=False, original=None, partial=1.0):
    """Phi-3 / Phi-4; with `original` (< max_pos), the long-context models' LongRoPE over `partial` of each head.
    Their factors are not at hand offline: short ones near 1 and long ones rising to ~50, shaped as published."""
    rope, rotated = None, int(hidden // heads * partial) // 2
    if original:
        rope = {"type": "longrope", "short_factor": [1.0 + 0.05 * (i / rotated) ** 2 for i in range(rotated)],
                "long_factor": [1.0 + 50.0 * (i / rotated) ** 3 for i in range(rotated)]}
    extra = {"partial_rotary_factor": partial} if partial != 1.0 else {}
    return _other("Phi3ForCausalLM", "phi3", hidden, layers, heads, kv_heads, intermediate, tied, max_pos,
                  rope_theta, dtype, original_max_position_embeddings=original or max_pos, rope_scaling=rope,
                  sliding_window=window, resid_pdrop=0.0, embd_pdrop=0.0, **extra)


def _mixtral(hidden, layers, heads, kv_heads, intermediate, experts, top_k, max_pos=32768, dtype="bfloat16"):
    return _other("MixtralForCausalLM", "mixtral", hidden, layers, heads, kv_heads, intermediate, False, max_pos,
                  1000000.0, dtype, num_local_experts=experts, num_experts_per_tok=top_k, sliding_window=None,
                  router_aux_loss_coef=0.02, output_router_logits=False, head_dim=hidden // heads)


def _qwen3_moe(hidden, layers, heads, kv_heads, head_dim, intermediate, experts, top_k, expert_intermediate,
               max_pos=40960, dtype="bfloat16"):
    return _qwen3(hidden, layers, heads, kv_heads, head_dim, intermediate, tied=False, max_pos=max_pos,
                  dtype=dtype) | {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": experts,
        "num_experts_per_tok": top_k, "moe_intermediate_size": expert_intermediate, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "output_router_logits": False,
        "router_aux_loss_coef": 0.001}


def _qwen2_moe(hidden, layers, heads, kv_heads, intermediate, experts, top_k, expert_intermediate,
               shared_intermediate, max_pos=8192, dtype="bfloat16"):
    return _other("Qwen2MoeForCausalLM", "qwen2_moe", hidden, layers, heads, kv_heads, intermediate, False, max_pos,
                  1000000.0, dtype, rms_norm_eps=1e-06, sliding_window=None, use_sliding_window=False,
                  max_window_layers=layers, num_experts=experts, num_experts_per_tok=top_k,
                  moe_intermediate_size=expert_intermediate, shared_expert_intermediate_size=shared_intermediate,
                  norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[], qkv_bias=True,
                  output_router_logits=False, router_aux_loss_coef=0.001)


def _glm4_moe(hidden, layers, heads, kv_heads, head_dim, intermediate, experts, top_k, expert_intermediate,
              dense_layers, qk_norm, scaling, groups=1, max_pos=131072, dtype="bfloat16"):
    """GLM-4.5 / 4.6: a shared expert beside the routed ones, sigmoid-routed; rope over half of each head."""
    return _other("Glm4MoeForCausalLM", "glm4_moe", hidden, layers, heads, kv_heads, intermediate, False, max_pos,
                  1000000.0, dtype, head_dim=head_dim, partial_rotary_factor=0.5, attention_bias=True,
                  use_qk_norm=qk_norm, n_routed_experts=experts, num_experts_per_tok=top_k,
                  moe_intermediate_size=expert_intermediate, n_shared_experts=1, first_k_dense_replace=dense_layers,
                  n_group=groups, topk_group=1, routed_scaling_factor=scaling, norm_topk_prob=True,
                  num_nextn_predict_layers=1)


def _dots1(hidden, layers, heads, kv_heads, head_dim, intermediate, experts, top_k, expert_intermediate, shared,
           max_pos=32768, dtype="bfloat16"):
    """dots.llm1: Qwen3's attention over GLM-4.5's sigmoid-routed experts beside `shared` shared ones."""
    return _other("Dots1ForCausalLM", "dots1", hidden, layers, heads, kv_heads, intermediate, False, max_pos,
                  10000000.0, dtype, head_dim=head_dim, rms_norm_eps=1e-06, attention_bias=False,
                  n_routed_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=expert_intermediate,
                  n_shared_experts=shared, first_k_dense_replace=1, n_group=1, topk_group=1,
                  routed_scaling_factor=2.5, norm_topk_prob=True, sliding_window=None, max_window_layers=layers)


def _ernie4_5(hidden, layers, heads, kv_heads, head_dim, intermediate, max_pos=131072, dtype="bfloat16", **moe):
    """ERNIE 4.5 (a tied head); with `moe` (experts, top_k, expert_intermediate, shared) Ernie4_5_MoeForCausalLM's
    experts from layer 1 on."""
    arch, kind, extra = "Ernie4_5ForCausalLM", "ernie4_5", {"head_dim": head_dim}
    if moe:
        arch, kind = "Ernie4_5_MoeForCausalLM", "ernie4_5_moe"
        extra |= {"moe_num_experts": moe["experts"], "moe_k": moe["top_k"], "moe_num_shared_experts": moe["shared"],
                  "moe_intermediate_size": moe["expert_intermediate"], "moe_layer_start_index": 1,
                  "moe_layer_end_index": layers - 1, "moe_layer_interval": 1, "moe_norm_min": 1e-12}
    return _other(arch, kind, hidden, layers, heads, kv_heads, intermediate, True, max_pos, 500000.0, dtype,
                  use_bias=False, **extra)


def _seed_oss(hidden, layers, heads, kv_heads, head_dim, intermediate, max_pos=524288, dtype="bfloat16"):
    return _other("SeedOssForCausalLM", "seed_oss", hidden, layers, heads, kv_heads, intermediate, False, max_pos,
                  10000000.0, dtype, head_dim=head_dim, rms_norm_eps=1e-06, attention_bias=True,
                  attention_out_bias=False, mlp_bias=False)


def _solar_open(hidden, layers, heads, kv_heads, head_dim, experts, top_k, expert_intermediate, max_pos=131072,
                dtype="bfloat16"):
    """Solar Open: sigmoid-routed experts beside a shared one on every layer (no dense MLP: no intermediate_size)."""
    config = _other("SolarOpenForCausalLM", "solar_open", hidden, layers, heads, kv_heads, 0, False, max_pos,
                    1000000.0, dtype, head_dim=head_dim, attention_bias=False,
                    n_routed_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=expert_intermediate,
                    n_shared_experts=1, n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True)
    del config["intermediate_size"]
    return config


def _gemma3(hidden, layers, heads, kv_heads, head_dim, intermediate, window, max_pos=32768, dtype="bfloat16"):
    return _other("Gemma3ForCausalLM", "gemma3_text", hidden, layers, heads, kv_heads, intermediate, True, max_pos,
                  1000000.0, dtype, head_dim=head_dim, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-06,
                  rope_local_base_freq=10000.0, rope_scaling=None, query_pre_attn_scalar=head_dim,
                  sliding_window=window, sliding_window_pattern=6, final_logit_softcapping=None,
                  attn_logit_softcapping=None, attention_bias=False)


def _granite(hidden, layers, heads, kv_heads, intermediate, max_pos=131072, dtype="bfloat16", embedding=12.0,
             attention=0.0078125, residual=0.22, logits=16.0):
    return _other("GraniteForCausalLM", "granite", hidden, layers, heads, kv_heads, intermediate, True, max_pos,
                  10000000.0, dtype, embedding_multiplier=embedding, attention_multiplier=attention,
                  residual_multiplier=residual, logits_scaling=logits, attention_bias=False, mlp_bias=False)


def _granite_moe(hidden, layers, heads, kv_heads, intermediate, experts, top_k, max_pos=4096, dtype="bfloat16",
                 **multipliers):
    config = _granite(hidden, layers, heads, kv_heads, intermediate, max_pos, dtype, **multipliers)
    return config | {"architectures": ["GraniteMoeForCausalLM"], "model_type": "granitemoe",
                     "num_local_experts": experts, "num_experts_per_tok": top_k, "rope_theta": 10000.0,
                     "output_router_logits": False, "router_aux_loss_coef": 0.0}


def _gemma2(hidden, layers, heads, kv_heads, head_dim, intermediate, window, attn_cap=50.0, max_pos=8192,
            dtype="bfloat16"):
    return _other("Gemma2ForCausalLM", "gemma2", hidden, layers, heads, kv_heads, intermediate, True, max_pos,
                  10000.0, dtype, head_dim=head_dim, hidden_activation="gelu_pytorch_tanh",
                  hidden_act="gelu_pytorch_tanh", rms_norm_eps=1e-06, query_pre_attn_scalar=head_dim,
                  sliding_window=window, final_logit_softcapping=30.0, attn_logit_softcapping=attn_cap,
                  attention_bias=False)


def _olmo(version, hidden, layers, heads, kv_heads, intermediate, max_pos=4096, dtype="bfloat16", window=4096,
          **rope):
    """OLMo 2 or 3 (3: windows on three layers of four; `rope`: its global layers' scaling, as published)."""
    arch, kind = ("Olmo2ForCausalLM", "olmo2") if version == 2 else ("Olmo3ForCausalLM", "olmo3")
    extra = {} if version == 2 else {
        "sliding_window": window, "rope_scaling": rope or None,
        "layer_types": ["sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(layers)]}
    return _other(arch, kind, hidden, layers, heads, kv_heads, intermediate, False, max_pos, 500000.0, dtype,
                  rms_norm_eps=1e-06, attention_bias=False, **extra)


def _olmoe(hidden, layers, heads, intermediate, experts, top_k, max_pos=4096, dtype="bfloat16"):
    return _other("OlmoeForCausalLM", "olmoe", hidden, layers, heads, heads, intermediate, False, max_pos, 10000.0,
                  dtype, num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=False, clip_qkv=None,
                  attention_bias=False, output_router_logits=False, router_aux_loss_coef=0.01)


def _minimax_m2(hidden, layers, heads, kv_heads, head_dim, experts, top_k, expert_intermediate, rotary_dim,
                max_pos=196608, dtype="bfloat16", **extra):
    """MiniMax-M2: q/k norms over all heads, partial rope, sigmoid-routed experts with a correction bias."""
    return _other("MiniMaxM2ForCausalLM", "minimax_m2", hidden, layers, heads, kv_heads, expert_intermediate, False,
                  max_pos, 5000000.0, dtype, head_dim=head_dim, rotary_dim=rotary_dim,
                  partial_rotary_factor=rotary_dim / head_dim, rms_norm_eps=1e-06,
                  num_local_experts=experts, num_experts_per_tok=top_k, scoring_func="sigmoid",
                  use_routing_bias=True, use_qk_norm=True, qk_norm_type="per_layer", num_mtp_modules=0,
                  router_aux_loss_coef=0.001, output_router_logits=False, **extra)


# DeepSeek-V3's published quantization: every projection in e4m3 with a float32 scale per 128 x 128 block
FP8_BLOCKS = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def _deepseek(version, hidden, layers, heads, intermediate, experts, top_k, expert_intermediate, shared, dense_layers,
              q_lora, mscale, kv_lora=512, nope=128, rope=64, v=128, original=4096, factor=40.0, max_pos=163840,
              dtype="bfloat16", theta=10000.0, **routing):
    """DeepSeek-V2 (softmax-routed) or V3 (sigmoid-routed with a correction bias, an MTP layer published after the
    last; "glm": GLM-4.7-Flash, V3's architecture): latent attention, dense first layers, shared experts beside the
    routed ones; YaRN as published."""
    arch, kind = {2: ("DeepseekV2ForCausalLM", "deepseek_v2"), 3: ("DeepseekV3ForCausalLM", "deepseek_v3"),
                  "glm": ("Glm4MoeLiteForCausalLM", "glm4_moe_lite")}[version]
    extra = ({"topk_method": "greedy", "norm_topk_prob": False, "n_group": 1, "topk_group": 1,
              "routed_scaling_factor": 1.0} if version == 2 else
             {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
              "num_nextn_predict_layers": 1})
    return _other(arch, kind, hidden, layers, heads, heads, intermediate, False, max_pos, theta, dtype,
                  rms_norm_eps=1e-06, attention_bias=False, q_lora_rank=q_lora, kv_lora_rank=kv_lora,
                  qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=v, n_routed_experts=experts,
                  num_experts_per_tok=top_k, moe_intermediate_size=expert_intermediate, n_shared_experts=shared,
                  first_k_dense_replace=dense_layers, moe_layer_freq=1,
                  **({"rope_scaling": {"type": "yarn", "factor": factor, "beta_fast": 32, "beta_slow": 1,
                                       "mscale": mscale, "mscale_all_dim": mscale,
                                       "original_max_position_embeddings": original}} | extra | routing))


def _gpt_oss(layers, experts, hidden=2880, heads=64, kv_heads=8, head_dim=64, intermediate=2880, top_k=4, window=128,
             original=4096, factor=32.0, max_pos=131072, dtype="bfloat16"):
    """gpt-oss: windowed and global layers alternating, its experts in MXFP4 as published."""
    return _other("GptOssForCausalLM", "gpt_oss", hidden, layers, heads, kv_heads, intermediate, False, max_pos,
                  150000.0, dtype, head_dim=head_dim, attention_bias=True, num_local_experts=experts,
                  num_experts_per_tok=top_k, experts_per_token=top_k, sliding_window=window, swiglu_limit=7.0,
                  initial_context_length=original, router_aux_loss_coef=0.9, output_router_logits=False,
                  layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
                  rope_scaling={"rope_type": "yarn", "factor": factor, "beta_fast": 32.0, "beta_slow": 1.0,
                                "truncate": False, "original_max_position_embeddings": original},
                  quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": [
                      "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]})


def _bert(hidden: int, layers: int, heads: int, intermediate: int, max_pos: int = 512, dtype: str = "bfloat16",
          model_type: str = "bert") -> dict:
    """An encoder (BAAI/bge-base-en-v1.5's BertModel; XLM-RoBERTa's with model_type "xlm-roberta": positions past
    pad_token_id 1, one token type)."""
    roberta = model_type == "xlm-roberta"
    return {
        "architectures": ["XLMRobertaModel" if roberta else "BertModel"],
        "attention_probs_dropout_prob": 0.1,
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.1,
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": intermediate,
        "layer_norm_eps": 1e-05 if roberta else 1e-12,
        "max_position_embeddings": max_pos + 2 if roberta else max_pos,
        "model_type": model_type,
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "pad_token_id": 1 if roberta else 0,
        "position_embedding_type": "absolute",
        "rope_theta": 10000.0,  # none: the worker's reading of a config takes one (no layer turns by it)
        "tie_word_embeddings": False,
        "type_vocab_size": 1 if roberta else 2,
        "vocab_size": VOCAB_SIZE,
        "dtype": dtype,
        "torch_dtype": dtype,
    }


PRESETS: dict[str, dict] = {
    "qwen3-0.6b": _qwen3(1024, 28, 16, 8, 128, 3072, tied=True),
    "qwen3-1.7b": _qwen3(2048, 28, 16, 8, 128, 6144, tied=True),
    "qwen3-4b": _qwen3(2560, 36, 32, 8, 128, 9728, tied=True),
    "qwen3-8b": _qwen3(4096, 36, 32, 8, 128, 12288, tied=False),
    "qwen3-tiny": _qwen3(64, 2, 4, 2, 16, 128, tied=True, max_pos=512, dtype="float32"),
    "bge-base-en-v1.5": _bert(768, 12, 12, 3072),
    "bge-m3": _bert(1024, 24, 16, 4096, max_pos=8192, model_type="xlm-roberta"),
    "bert-tiny": _bert(96, 2, 6, 160, max_pos=128, dtype="float32"),
    "xlm-roberta-tiny": _bert(96, 2, 6, 160, max_pos=128, dtype="float32", model_type="xlm-roberta"),
    "qwen3-tiny-untied": _qwen3(64, 2, 4, 2, 16, 128, tied=False, max_pos=512, dtype="float32"),
    "qwen3-small": _qwen3(128, 4, 4, 2, 32, 256, tied=True, max_pos=1024, dtype="float32"),
    # Heads, KV heads and intermediate size divisible by 2 and 4 for tensor-parallel tests.
    "qwen3-tiny-tp": _qwen3(128, 2, 8, 4, 16, 256, tied=True, max_pos=512, dtype="float32"),
    "llama-3.1-8b": _llama(4096, 32, 32, 8, 14336, tied=False),
    "llama-3.2-1b": _llama(2048, 16, 32, 8, 8192, tied=True),
    "smollm3-3b": _smollm3(2048, 36, 16, 4, 11008),
    "glm-4-9b": _glm4(4096, 40, 32, 2, 128, 13696),
    "glm-4.5-air": _glm4_moe(4096, 46, 96, 8, 128, 10944, experts=128, top_k=8, expert_intermediate=1408,
                             dense_layers=1, qk_norm=False, scaling=1.0),
    "dots.llm1": _dots1(4096, 62, 32, 32, 128, 10944, experts=128, top_k=6, expert_intermediate=1408, shared=2),
    "ernie-4.5-0.3b": _ernie4_5(1024, 18, 16, 2, 128, 3072),
    "ernie-4.5-21b-a3b": _ernie4_5(2560, 28, 20, 4, 128, 12288, experts=64, top_k=6, expert_intermediate=1536,
                                   shared=2),
    "seed-oss-36b": _seed_oss(5120, 64, 80, 8, 128, 27648),
    "solar-open-100b": _solar_open(4096, 48, 64, 8, 128, experts=128, top_k=8, expert_intermediate=1280),
    "glm-4.5": _glm4_moe(5120, 92, 96, 8, 128, 12288, experts=160, top_k=8, expert_intermediate=1536, dense_layers=3,
                         qk_norm=True, scaling=2.5),
    "deepseek-v2-lite": _deepseek(2, 2048, 27, 16, 10944, experts=64, top_k=6, expert_intermediate=1408, shared=2,
                                  dense_layers=1, q_lora=None, mscale=0.707),
    "deepseek-v3": _deepseek(3, 7168, 61, 128, 18432, experts=256, top_k=8, expert_intermediate=2048, shared=1,
                             dense_layers=3, q_lora=1536, mscale=1.0, n_group=8, topk_group=4,
                             routed_scaling_factor=2.5, quantization_config=FP8_BLOCKS),
    "minimax-m2": _minimax_m2(3072, 62, 48, 8, 128, experts=256, top_k=8, expert_intermediate=1536, rotary_dim=64,
                              quantization_config=FP8_BLOCKS),
    "olmo-2-7b": _olmo(2, 4096, 32, 32, 32, 11008),
    "olmo-3-7b": _olmo(3, 4096, 32, 32, 32, 11008, max_pos=65536, rope_type="yarn", factor=8.0,
                       original_max_position_embeddings=8192, beta_fast=32.0, beta_slow=1.0,
                       attention_factor=1.2079441541679836),
    "olmoe-1b-7b": _olmoe(2048, 16, 16, 1024, experts=64, top_k=8),
    "glm-4.7-flash": _deepseek("glm", 2048, 47, 20, 10240, experts=64, top_k=4, expert_intermediate=1536, shared=1,
                               dense_layers=1, q_lora=768, mscale=1.0, nope=192, v=256, max_pos=202752,
                               routed_scaling_factor=1.8, n_group=1, topk_group=1, rope_scaling=None,
                               theta=1000000.0),
    "gpt-oss-20b": _gpt_oss(24, experts=32),
    "gpt-oss-120b": _gpt_oss(36, experts=128),
    "qwen2.5-7b": _qwen2(3584, 28, 28, 4, 18944, tied=False, max_pos=131072),
    "qwen2.5-0.5b": _qwen2(896, 24, 14, 2, 4864, tied=True),
    "mistral-7b": _mistral(4096, 32, 32, 8, 14336, window=4096),
    "command-r7b": _cohere(2, 4096, 32, 32, 8, 14336),
    "starcoder2-3b": _starcoder2(3072, 30, 24, 2, 12288),
    "command-r-08-2024": _cohere(1, 8192, 40, 64, 8, 22528, rope_theta=4000000.0, logit_scale=0.0625),
    "mixtral-8x7b": _mixtral(4096, 32, 32, 8, 14336, experts=8, top_k=2),
    "phi-4": _phi3(5120, 40, 40, 10, 17920, max_pos=16384, rope_theta=250000.0),
    "phi-3-mini": _phi3(3072, 32, 32, 32, 8192, max_pos=4096, rope_theta=10000.0, window=2047),
    "phi-3.5-mini": _phi3(3072, 32, 32, 32, 8192, max_pos=131072, rope_theta=10000.0, window=262144,
                          original=4096),
    "phi-4-mini": _phi3(3072, 32, 24, 8, 8192, max_pos=131072, rope_theta=10000.0, window=262144, tied=True,
                        original=4096, partial=0.75),
    # rope scaled from position 64 on (the real 8,192 lies past a tiny model's length); biases on
    "qwen3-30b-a3b": _qwen3_moe(2048, 48, 32, 4, 128, 6144, experts=128, top_k=8, expert_intermediate=768),
    "qwen3-moe-tiny": _qwen3_moe(64, 2, 4, 2, 16, 128, experts=8, top_k=2, expert_intermediate=32, max_pos=512,
                                 dtype="float32"),
    # Every projection's and expert's shard on each of 2 ranks whole 128 x 128 blocks (heads of 128): FP8 under TP
    "qwen3-moe-fp8": _qwen3_moe(256, 2, 4, 2, 128, 256, experts=8, top_k=2, expert_intermediate=128, max_pos=512,
                                dtype="float32"),
    "qwen1.5-moe-a2.7b": _qwen2_moe(2048, 24, 16, 16, 5632, experts=60, top_k=4, expert_intermediate=1408,
                                    shared_intermediate=5632),
    "qwen2-moe-tiny": _qwen2_moe(64, 2, 4, 2, 128, experts=8, top_k=2, expert_intermediate=32,
                                 shared_intermediate=48, max_pos=512, dtype="float32"),
    "granite-3.1-8b": _granite(4096, 40, 32, 8, 12800),
    "granite-tiny": _granite(96, 2, 6, 2, 160, max_pos=512, dtype="float32", embedding=3.0, attention=0.2,
                             residual=0.5, logits=4.0),
    "granite-3.0-1b-a400m": _granite_moe(1024, 24, 16, 8, 512, experts=32, top_k=8, attention=0.015625, logits=6.0),
    "granite-moe-tiny": _granite_moe(64, 2, 4, 2, 48, experts=8, top_k=2, max_pos=512, dtype="float32",
                                     embedding=3.0, attention=0.2, residual=0.5, logits=4.0),
    "gemma-2-2b": _gemma2(2304, 26, 8, 4, 256, 9216, window=4096),
    # a cap of 5 on attention scores (50 in the real ones): tiny random weights reach it
    "gemma2-tiny": _gemma2(64, 4, 4, 2, 16, 128, window=16, attn_cap=5.0, max_pos=512, dtype="float32"),
    "gemma-3-1b": _gemma3(1152, 26, 4, 1, 256, 6912, window=512),
    # layers 0-4 sliding (window 16), layer 5 global, 6-7 sliding
    "gemma3-tiny": _gemma3(96, 8, 3, 1, 32, 160, window=16, max_pos=512, dtype="float32"),
    "llama-tiny": _llama(96, 2, 6, 2, 160, tied=False, max_pos=512, dtype="float32", rope_original=64, bias=True),
    # layers 1 and 3 without rope (every 2nd: the real one's every 4th)
    "smollm3-tiny": _smollm3(96, 4, 6, 2, 160, max_pos=512, dtype="float32", interval=2),
    # two groups of 4 experts (a token's 3 from the better group), q/k norms, weights times 2.5
    "glm4-moe-tiny": _glm4_moe(96, 3, 6, 2, 16, 160, experts=8, top_k=3, expert_intermediate=32, dense_layers=1,
                               qk_norm=True, scaling=2.5, groups=2, max_pos=512, dtype="float32"),
    "dots1-tiny": _dots1(64, 3, 4, 2, 16, 96, experts=8, top_k=2, expert_intermediate=24, shared=2, max_pos=512,
                         dtype="float32"),
    "ernie4_5-tiny": _ernie4_5(96, 2, 6, 2, 32, 160, max_pos=512, dtype="float32"),
    "ernie4_5-moe-tiny": _ernie4_5(64, 3, 4, 2, 16, 96, max_pos=512, dtype="float32", experts=8, top_k=3,
                                   expert_intermediate=24, shared=1),
    # rope scaled from position 64 on; V3's: q through a rank-24 bottleneck, 3 of 8 experts from the better of 2 groups,
    # its projections in FP8 in blocks of 8 x 8 (as published: 128 x 128)
    "deepseek-v2-tiny": _deepseek(2, 64, 3, 4, 96, experts=8, top_k=2, expert_intermediate=24, shared=2,
                                  dense_layers=1, q_lora=None, mscale=0.707, kv_lora=32, nope=16, rope=8, v=16,
                                  original=64, factor=4.0, max_pos=512, dtype="float32"),
    "deepseek-v3-tiny": _deepseek(3, 64, 3, 4, 96, experts=8, top_k=3, expert_intermediate=24, shared=1,
                                  dense_layers=1, q_lora=24, mscale=1.0, kv_lora=32, nope=16, rope=8, v=16,
                                  original=64, factor=4.0, max_pos=512, dtype="float32", n_group=2, topk_group=1,
                                  routed_scaling_factor=2.5,
                                  quantization_config=FP8_BLOCKS | {"weight_block_size": [8, 8]}),
    # V wider than the nope dims, as GLM-4.7-Flash's
    "glm4-moe-lite-tiny": _deepseek("glm", 64, 3, 4, 96, experts=8, top_k=3, expert_intermediate=24, shared=1,
                                    dense_layers=1, q_lora=24, mscale=1.0, kv_lora=32, nope=16, rope=8, v=24,
                                    max_pos=512, dtype="float32", routed_scaling_factor=1.8, n_group=1, topk_group=1,
                                    rope_scaling=None),
    # OLMo 3: windows of 16 on layers 0-2, a global layer 3 with YaRN from position 64 on
    "minimax-m2-tiny": _minimax_m2(64, 2, 4, 2, 16, experts=8, top_k=3, expert_intermediate=24, rotary_dim=8,
                                   max_pos=512, dtype="float32"),
    "olmo2-tiny": _olmo(2, 96, 2, 6, 2, 160, max_pos=512, dtype="float32"),
    "olmo3-tiny": _olmo(3, 96, 4, 6, 3, 160, max_pos=512, dtype="float32", window=16, rope_type="yarn", factor=4.0,
                        original_max_position_embeddings=64),
    "olmoe-tiny": _olmoe(64, 2, 4, 32, experts=8, top_k=3, max_pos=512, dtype="float32"),
    # 2 of 8 experts, 16-token windows on layers 0 and 2, rope scaled from position 64 on
    "gpt-oss-tiny": _gpt_oss(3, experts=8, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=64, top_k=2,
                             window=16, original=64, factor=4.0, max_pos=512, dtype="float32"),
    "seed-oss-tiny": _seed_oss(96, 2, 6, 2, 16, 160, max_pos=512, dtype="float32"),
    "solar-open-tiny": _solar_open(64, 2, 4, 2, 16, experts=8, top_k=3, expert_intermediate=24, max_pos=512,
                                   dtype="float32"),
    "glm4-tiny": _glm4(96, 2, 6, 2, 16, 160, max_pos=512, dtype="float32"),
    "qwen2-tiny": _qwen2(96, 2, 6, 2, 160, tied=True, max_pos=512, dtype="float32"),
    "mistral-tiny": _mistral(96, 2, 6, 3, 160, window=24, max_pos=512, dtype="float32"),
    # rope over half of each head, (1 + w) LayerNorms with biases, a relu-squared MLP
    "nemotron-tiny": _nemotron(96, 2, 6, 2, 16, 160, max_pos=512, dtype="float32"),
    # a 24-token window, biases everywhere, a plain MLP
    "starcoder2-tiny": _starcoder2(96, 2, 6, 2, 160, max_pos=512, dtype="float32", window=24),
    # Command R+'s q/k norms (a weight per head)
    "cohere-tiny": _cohere(1, 96, 2, 6, 2, 160, max_pos=512, dtype="float32", qk_norm=True),
    # Cohere 2: 24-token windows on layers 0-2, layer 3 global without rope
    "cohere2-tiny": _cohere(2, 96, 4, 6, 2, 160, max_pos=512, dtype="float32", window=24),
    "mixtral-tiny": _mixtral(64, 2, 4, 2, 48, experts=8, top_k=2, max_pos=512, dtype="float32"),
    # heads of 24: as Phi-3-mini's 96, not a power of two
    "phi3-tiny": _phi3(96, 2, 4, 2, 160, max_pos=512, rope_theta=10000.0, window=24, dtype="float32"),
    # Phi-4-mini's rope (LongRoPE over 24 of 32 dims); served to its whole length, which is the original one (so
    # the short factors, as transformers takes them at every length here)
    "phi4-mini-tiny": _phi3(128, 2, 4, 2, 160, max_pos=512, rope_theta=10000.0, dtype="float32", tied=True,
                            original=512, partial=0.75),
}

GENERATION_CONFIG: dict = {
    "bos_token_id": BOS_TOKEN_ID,
    "do_sample": True,
    "eos_token_id": [EOS_TOKEN_ID, BOS_TOKEN_ID],
    "pad_token_id": BOS_TOKEN_ID,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
}


def get_preset(name: str) -> dict:
    """A copy of the named preset's config fields; KeyError lists the known names."""
    try:
        return copy.deepcopy(PRESETS[name])
    except KeyError:
        raise KeyError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None
