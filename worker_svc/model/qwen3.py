"""Qwen3 dense (Qwen/Qwen3-0.6B ... Qwen3-32B) on the paged KV runtime, tensor-parallel ready."""
from __future__ import annotations

import torch
from torch import nn

from worker_svc.kernels import Kernels
from worker_svc.kernels.attention import AttentionMetadata
from worker_svc.model.config import ModelConfig
from worker_svc.model.layers import RMSNorm, RotaryEmbedding
from worker_svc.model.parallel import (MergedColumnParallelLinear, ParallelLMHead, QKVParallelLinear,
                                       RowParallelLinear, VocabParallelEmbedding)


class Qwen3Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, kernels: Kernels):
        super().__init__()
        self.kernels = kernels
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, kernels)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, kernels)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, kernels)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, kernels)
        self.rotary = rotary
        self.scale = cfg.head_dim ** -0.5
        # bound by the ModelRunner once allocated; an fp8 cache holds k / k_scale and v / v_scale
        self.k_cache = self.v_cache = torch.empty(0)
        self.k_scale = self.v_scale = 1.0

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q = self.kernels.qk_norm_rope_store(self.qkv_proj(x), positions, self.rotary.cos_sin, self.q_norm.weight,
                                            self.k_norm.weight, self.q_norm.eps, self.k_cache, self.v_cache,
                                            meta.slot_mapping, self.num_heads, self.num_kv_heads,
                                            self.k_scale, self.v_scale)
        o = self.kernels.attention.forward(q, self.k_cache, self.v_cache, meta, self.scale, self.k_scale,
                                           self.v_scale)
        return self.o_proj(o.flatten(1))


class Qwen3MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, kernels: Kernels):
        super().__init__()
        self.kernels = kernels
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, kernels)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.kernels.silu_and_mul(self.gate_up_proj(x)))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, kernels: Kernels):
        super().__init__()
        self.self_attn = Qwen3Attention(cfg, rotary, kernels)
        self.mlp = Qwen3MLP(cfg, kernels)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)

    def forward(self, positions, x, residual, meta):
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Qwen3ForCausalLM(nn.Module):
    # checkpoint name fragment -> (our packed parameter fragment, shard id)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, kernels: Kernels):
        super().__init__()
        self.config = cfg
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(cfg, rotary, kernels) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Returns the final hidden states of every input token; `compute_logits` takes the rows needed."""
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head(hidden, out)
