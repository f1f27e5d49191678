"""DeepSeek-V2/V3's multi-head latent attention over a cache of the latent: a token's K is its normed kv_lora_rank
latent c and its rope dims k_rope (one "KV head" of kv_lora_rank + qk_rope_head_dim for every query head), its V the
same values in the same memory (one cache plane: v_is_k). Each head's projections are absorbed (as DeepSeek's own
inference code and vLLM's MLA do): the query q_nope . (W_UK c) is (W_UK^T q_nope) . c, so the head queries the latent
with q_nope W_UK; its output W_UV (sum p c) is the latent's weighted sum taken through W_UV afterwards. The backend's
`latent` call computes that sum (decode steps on a kernel of their own, kernels/latent_attention.py; prefills on the
paged kernels with K and V of one head size, the rope dims' share of their output left).

Each head's dims are stored as the rope kernels pair them (layers.rotary_order over [rope dims, latent dims]): K
assembled so, q's rope dims by a reordering of its projection's rows at load, of kv_a_proj's for K's; the dot
products are unchanged."""
from __future__ import annotations

import torch
from torch import nn

from worker_svc.kernels import Kernels
from worker_svc.kernels.attention import AttentionMetadata
from worker_svc.model.config import MlaConfig, ModelConfig
from worker_svc.model.layers import RMSNorm, RotaryEmbedding, scale_queries
from worker_svc.model.parallel import (ColumnParallelLinear, HeadParallelLinear, ReplicatedLinear, RowParallelLinear,
                                       _divide, tp_size)


def rope_pairs(mla: MlaConfig, interleaved: bool) -> list[int]:
    """The rope dims as the first of each pair, then the second: pairs (2i, 2i + 1) where interleaved (DeepSeek-V2's,
    V3's rope_interleave), else (i, i + rope / 2)."""
    rope = mla.qk_rope_head_dim
    return [*range(0, rope, 2), *range(1, rope, 2)] if interleaved else list(range(rope))


def in_rope_order(rope: torch.Tensor, rest: torch.Tensor) -> torch.Tensor:
    """[first of each rope pair, first half of the other dims, second of each rope pair, second half of the rest]:
    rope (its pairs' firsts, then their seconds) and the other dims as the rope kernels take a head
    (layers.rotary_order)."""
    half, rest_half = rope.shape[-1] // 2, rest.shape[-1] // 2
    return torch.cat([rope[..., :half], rest[..., :rest_half], rope[..., half:], rest[..., rest_half:]], dim=-1)


class MultiLatentAttention(nn.Module):
    v_is_k = True  # the runner allocates one cache plane: V's view is K's (the store writes the same values twice)

    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding, kernels: Kernels):
        super().__init__()
        mla = self.mla = cfg.mla
        heads, hidden = cfg.num_attention_heads, cfg.hidden_size
        self.kernels, self.rotary, self.eps = kernels, rotary, cfg.rms_norm_eps
        self.num_heads, self.num_kv_heads = _divide(heads, tp_size()), 1
        self.head_dim = cfg.head_dim  # kv_lora_rank + qk_rope_head_dim: what a token caches
        q_dim, nope = mla.qk_nope_head_dim + mla.qk_rope_head_dim, mla.qk_nope_head_dim
        q_order = list(range(nope)) + [nope + i for i in rope_pairs(mla, cfg.rope_interleaved)]
        if mla.q_lora_rank is None:
            self.q_proj = HeadParallelLinear(hidden, heads, q_dim, kernels, q_order)
        else:
            self.q_a_proj = ReplicatedLinear(hidden, mla.q_lora_rank, kernels)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, cfg.rms_norm_eps, kernels)
            self.q_b_proj = HeadParallelLinear(mla.q_lora_rank, heads, q_dim, kernels, q_order)
        latent = mla.kv_lora_rank
        self.kv_a_proj_with_mqa = ReplicatedLinear(
            hidden, latent + mla.qk_rope_head_dim, kernels,
            list(range(latent)) + [latent + i for i in rope_pairs(mla, cfg.rope_interleaved)])
        self.kv_a_layernorm = RMSNorm(latent, cfg.rms_norm_eps, kernels)
        # each head's W_UK (nope rows) then W_UV (v_head_dim rows) over the latent: absorbed, never run as a linear
        self.kv_b_proj = ColumnParallelLinear(latent, heads * (nope + mla.v_head_dim), kernels)
        self.kv_b_proj.absorbed = True  # model/lora.py refuses an adapter of it
        self.o_proj = RowParallelLinear(heads * mla.v_head_dim, hidden, kernels)
        self.scale, self.query_log_scale = cfg.attention_scale, cfg.query_log_scale
        # bound by the ModelRunner once allocated, as Attention's
        self.k_cache = self.v_cache = torch.empty(0)
        self.k_scale = self.v_scale = 1.0

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        mla, heads, tokens = self.mla, self.num_heads, x.shape[0]
        q = self.q_proj(x) if mla.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(tokens, heads, -1).split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        w_uk, w_uv = self.kv_b_proj.weight.view(heads, -1, mla.kv_lora_rank).split(
            [mla.qk_nope_head_dim, mla.v_head_dim], dim=1)
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [tokens, heads, kv_lora_rank]
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        k = in_rope_order(k_rope, self.kv_a_layernorm(latent.contiguous()))  # [tokens, head_dim], V the same
        qkv = torch.cat([in_rope_order(q_rope, q_latent).flatten(1), k, k], dim=-1)
        q = self.kernels.qk_norm_rope_store(qkv, positions, self.rotary.cos_sin, None, None, self.eps, self.k_cache,
                                            self.v_cache, meta.slot_mapping, heads, 1, self.k_scale, self.v_scale)
        q = scale_queries(q, positions, self.query_log_scale)
        o_latent = self.kernels.attention.latent(q, self.k_cache, meta, self.scale, self.k_scale,
                                                 mla.qk_rope_head_dim)
        o = torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [tokens, heads, v_head_dim]
        return self.o_proj(o.reshape(tokens, -1))
