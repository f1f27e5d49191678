"""Qwen3 dense (Qwen/Qwen3-0.6B ... Qwen3-32B) on the paged KV runtime, tensor-parallel ready."""
from __future__ import annotations

import torch
from torch import nn

from worker_svc.attention import AttentionBackend, AttentionMetadata, store_kv
from worker_svc.config import ModelConfig
from worker_svc.layers import RMSNorm, RotaryEmbedding, qk_norm_rope, silu_and_mul
from worker_svc.parallel import (MergedColumnParallelLinear, ParallelLMHead, QKVParallelLinear,
                                 RowParallelLinear, VocabParallelEmbedding)


class Qwen3Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.rotary = rotary
        self.scale = cfg.head_dim ** -0.5
        self.k_cache = self.v_cache = torch.empty(0)  # bound by the ModelRunner once allocated

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata,
                backend: AttentionBackend) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        if qkv.is_cuda:  # one kernel for norms, rope and the KV store; triton is a GPU-only dependency
            from worker_svc.layers_triton import qk_norm_rope_store

            q = qk_norm_rope_store(qkv, positions, self.rotary.cos_sin, self.q_norm.weight, self.k_norm.weight,
                                   self.q_norm.eps, self.k_cache, self.v_cache, meta.slot_mapping,
                                   self.num_heads, self.num_kv_heads)
        else:
            q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q, k = qk_norm_rope(q.view(-1, self.num_heads, self.head_dim),
                                k.view(-1, self.num_kv_heads, self.head_dim), positions, self.rotary.cos_sin,
                                self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
            store_kv(k, v.view(-1, self.num_kv_heads, self.head_dim), self.k_cache, self.v_cache,
                     meta.slot_mapping)
        o = backend.forward(q, self.k_cache, self.v_cache, meta, self.scale)
        return self.o_proj(o.flatten(1))


class Qwen3MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding):
        super().__init__()
        self.self_attn = Qwen3Attention(cfg, rotary)
        self.mlp = Qwen3MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, x, residual, meta, backend):
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, meta, backend)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Qwen3ForCausalLM(nn.Module):
    # checkpoint name fragment -> (our packed parameter fragment, shard id)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(cfg, rotary) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                backend: AttentionBackend) -> torch.Tensor:
        """Returns the final hidden states of every input token; `compute_logits` takes the rows needed."""
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta, backend)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head(hidden, out)
