"""DeepSeek-V2/V3's multi-head latent attention, served as multi-head attention over a per-head KV cache: each step
projects its new tokens' latent into every head's K (its own qk_nope_head_dim dims and the rope dims shared by all
heads) and V (padded with zeros to K's width, the cache holding one head size), and the paged attention kernels run
unchanged. The cache holds heads x (nope + rope) x 2 values a token where MLA's own would hold the latent
(kv_lora_rank + rope): several times the memory, for every attention backend as it is.

Each head's dims are stored as the rope kernels pair them (layers.rotary_order over [rope dims, nope dims]): q's by
a reordering of its projection's rows at load, the rope dims of K by one of kv_a_proj's rows, and K assembled in that
order; q's and K's dot products are unchanged."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker_svc.kernels import Kernels
from worker_svc.kernels.attention import AttentionMetadata
from worker_svc.model.config import MlaConfig, ModelConfig
from worker_svc.model.layers import RMSNorm, RotaryEmbedding
from worker_svc.model.parallel import (ColumnParallelLinear, HeadParallelLinear, ReplicatedLinear, RowParallelLinear,
                                       _divide, tp_size)


def rope_pairs(mla: MlaConfig, interleaved: bool) -> tuple[list[int], list[int]]:
    """The rope dims' pairs: (2i, 2i + 1) where interleaved (DeepSeek-V2's, V3's rope_interleave), else
    (i, i + rope / 2); as the first and the second of each pair."""
    rope = mla.qk_rope_head_dim
    if interleaved:
        return list(range(0, rope, 2)), list(range(1, rope, 2))
    return list(range(rope // 2)), list(range(rope // 2, rope))


def q_head_order(mla: MlaConfig, interleaved: bool) -> list[int]:
    """A q head's stored dims, from its checkpoint order [nope dims, rope dims]: [first of each rope pair, first half
    of the nope dims, second of each rope pair, second half of the nope dims]."""
    nope = mla.qk_nope_head_dim
    first, second = rope_pairs(mla, interleaved)
    return [nope + i for i in first] + list(range(nope // 2)) + [nope + i for i in second] + list(range(nope // 2, nope))


class MultiLatentAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding, kernels: Kernels):
        super().__init__()
        mla = self.mla = cfg.mla
        heads, hidden = cfg.num_attention_heads, cfg.hidden_size
        self.kernels, self.rotary, self.eps = kernels, rotary, cfg.rms_norm_eps
        self.num_heads = self.num_kv_heads = _divide(heads, tp_size())
        self.head_dim = cfg.head_dim  # nope + rope
        order = q_head_order(mla, cfg.rope_interleaved)
        if mla.q_lora_rank is None:
            self.q_proj = HeadParallelLinear(hidden, heads, self.head_dim, kernels, order)
        else:
            self.q_a_proj = ReplicatedLinear(hidden, mla.q_lora_rank, kernels)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, cfg.rms_norm_eps, kernels)
            self.q_b_proj = HeadParallelLinear(mla.q_lora_rank, heads, self.head_dim, kernels, order)
        first, second = rope_pairs(mla, cfg.rope_interleaved)
        latent = mla.kv_lora_rank
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, latent + mla.qk_rope_head_dim, kernels,
                                                   list(range(latent)) + [latent + i for i in first + second])
        self.kv_a_layernorm = RMSNorm(latent, cfg.rms_norm_eps, kernels)
        self.kv_b_proj = ColumnParallelLinear(latent, heads * (mla.qk_nope_head_dim + mla.v_head_dim), kernels)
        self.o_proj = RowParallelLinear(heads * mla.v_head_dim, hidden, kernels)
        self.scale = cfg.attention_scale
        # bound by the ModelRunner once allocated, as Attention's
        self.k_cache = self.v_cache = torch.empty(0)
        self.k_scale = self.v_scale = 1.0

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        mla, heads, tokens = self.mla, self.num_heads, x.shape[0]
        if mla.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent.contiguous())).view(tokens, heads, -1)
        k_nope, v = kv.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
        half, nope_half = mla.qk_rope_head_dim // 2, mla.qk_nope_head_dim // 2
        k_rope = k_rope[:, None, :].expand(tokens, heads, mla.qk_rope_head_dim)
        k = torch.cat([k_rope[..., :half], k_nope[..., :nope_half], k_rope[..., half:], k_nope[..., nope_half:]], -1)
        v = F.pad(v, (0, self.head_dim - mla.v_head_dim))
        qkv = torch.cat([q, k.flatten(1), v.flatten(1)], dim=-1)
        q = self.kernels.qk_norm_rope_store(qkv, positions, self.rotary.cos_sin, None, None, self.eps, self.k_cache,
                                            self.v_cache, meta.slot_mapping, heads, heads, self.k_scale, self.v_scale)
        o = self.kernels.attention.forward(q, self.k_cache, self.v_cache, meta, self.scale, self.k_scale,
                                           self.v_scale)
        return self.o_proj(o[..., :mla.v_head_dim].reshape(tokens, -1))
