"""Paged attention over a mixed batch: prefill chunks, continuations over cached prefixes and decodes
in ONE call per layer, described like flash-attn-4's paged varlen call.

The KV cache of a layer is a K and a V tensor shaped [num_blocks, block_size, num_kv_heads, head_dim];
token t of a sequence lives in block page_table[seq, t // block_size] at offset t % block_size.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class AttentionMetadata:
    cu_seqlens_q: torch.Tensor  # int32 [batch + 1]: query tokens of sequence i are [cu[i], cu[i+1])
    seqused_k: torch.Tensor     # int32 [batch]: context length of each sequence after this step
    page_table: torch.Tensor    # int32 [batch, max_blocks]
    slot_mapping: torch.Tensor  # int64 [tokens]: where each new token's K and V are written
    max_seqlen_q: int
    query_lens: list[int]       # host copies, for backends that loop on the host
    context_lens: list[int]


class AttentionBackend(Protocol):
    name: str

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: [tokens, heads, head_dim]; the new K/V are already in the cache. Returns q's shape."""
        ...


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)


class TorchAttention:
    """Plain reference over the paged layout: gathers each sequence's context and runs causal SDPA.

    One loop iteration per sequence, so it is for CPUs, tests and checking the fast backends."""

    name = "torch"

    def forward(self, q, k_cache, v_cache, meta, scale):
        out = torch.empty_like(q)
        block_size, groups = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
        start = 0
        for i, (n, ctx) in enumerate(zip(meta.query_lens, meta.context_lens)):
            blocks = meta.page_table[i, : -(-ctx // block_size)].long()
            k = k_cache[blocks].flatten(0, 1)[:ctx].transpose(0, 1).repeat_interleave(groups, 0)
            v = v_cache[blocks].flatten(0, 1)[:ctx].transpose(0, 1).repeat_interleave(groups, 0)
            qpos = torch.arange(ctx - n, ctx, device=q.device)
            mask = torch.arange(ctx, device=q.device)[None, :] <= qpos[:, None]
            o = F.scaled_dot_product_attention(q[start:start + n].transpose(0, 1), k, v,
                                               attn_mask=mask, scale=scale)
            out[start:start + n] = o.transpose(0, 1)
            start += n
        return out


class FlashAttention:
    """flash-attn-4 (CuTe DSL, Hopper/Blackwell): one paged varlen call for a batch with prefills;
    decode-only batches go to the split-KV Triton kernel of decode_attention.py, which reads the KV
    cache faster (bench/results/decode_attention.md)."""

    name = "flash_attn"

    def __init__(self):
        from flash_attn.cute import flash_attn_varlen_func

        from worker_svc.decode_attention import paged_decode_attention

        self._fn = flash_attn_varlen_func
        self._decode = paged_decode_attention

    def forward(self, q, k_cache, v_cache, meta, scale):
        if meta.max_seqlen_q == 1:
            return self._decode(q, k_cache, v_cache, meta.seqused_k, meta.page_table, scale)
        out = self._fn(q, k_cache, v_cache, cu_seqlens_q=meta.cu_seqlens_q, seqused_k=meta.seqused_k,
                       page_table=meta.page_table, max_seqlen_q=meta.max_seqlen_q,
                       softmax_scale=scale, causal=True)
        return out[0] if isinstance(out, tuple) else out


def flash_attn_available(device: torch.device) -> bool:
    if device.type != "cuda" or not torch.cuda.is_available() or torch.cuda.get_device_capability(device)[0] < 9:
        return False
    try:
        import flash_attn.cute  # noqa: F401
    except Exception:
        return False
    return True


def make_backend(name: str, device: torch.device) -> AttentionBackend:
    """"auto" picks flash_attn on Hopper/Blackwell when it imports, else torch."""
    if name == "auto":
        name = "flash_attn" if flash_attn_available(device) else "torch"
    if name == "flash_attn":
        return FlashAttention()
    if name == "torch":
        return TorchAttention()
    raise ValueError(f"unknown attention backend {name!r} (auto, flash_attn, torch)")
