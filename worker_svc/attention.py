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


class TritonAttention:
    """Triton on the GPU: the split-KV kernel of decode_attention.py for decode-only batches (captured in
    CUDA graphs), the paged prefill kernel of prefill_attention.py for steps with prefills."""

    name = "triton"

    def __init__(self):
        from worker_svc import decode_attention, prefill_attention  # triton: a GPU-only dependency

        self._decode_kernel, self._prefill_kernel = decode_attention, prefill_attention
        self._blocks: tuple[torch.Tensor, torch.Tensor] | None = None
        self._blocks_of: AttentionMetadata | None = None  # the step whose query blocks _blocks lists
        # The decode kernel's split counters, shared by every layer (each call leaves them zero). Sized by
        # the first, largest call: CUDA graphs are captured largest first, after an eager warm-up. A larger
        # batch later gets larger ones; the old stay allocated, as captured graphs may still use them.
        self._counters: list[torch.Tensor] = []

    def forward(self, q, k_cache, v_cache, meta, scale):
        if meta.max_seqlen_q == 1:
            kernel = self._decode_kernel
            if not self._counters or self._counters[-1].numel() < q.shape[0] * k_cache.shape[2]:
                self._counters.append(kernel.merge_counters(q.shape[0], k_cache.shape[2], q.device))
            return kernel.paged_decode_attention(q, k_cache, v_cache, meta.seqused_k, meta.page_table, scale,
                                                 counters=self._counters[-1])
        return self._prefill(q, k_cache, v_cache, meta, scale)

    def _prefill(self, q, k_cache, v_cache, meta, scale):
        kernel = self._prefill_kernel
        if self._blocks_of is not meta:  # once per step, not per layer
            self._blocks, self._blocks_of = kernel.query_blocks(meta.query_lens, kernel.BLOCK_M, q.device), meta
        return kernel.paged_prefill_attention(q, k_cache, v_cache, meta.cu_seqlens_q, meta.seqused_k,
                                              meta.page_table, self._blocks, scale)


class FlashAttention(TritonAttention):
    """flash-attn-4 (CuTe DSL, Hopper/Blackwell) for steps with prefills, one paged varlen call; decodes
    as TritonAttention (faster: bench/results/decode_attention.md). Its prefills take 0.4-0.7x the
    Triton kernel's GPU time, at ~160 us of Python per call against ~60 (bench/results/prefill_attention.md)."""

    name = "flash_attn"

    def __init__(self):
        super().__init__()
        from flash_attn.cute import flash_attn_varlen_func

        self._fn = flash_attn_varlen_func

    def _prefill(self, q, k_cache, v_cache, meta, scale):
        out = self._fn(q, k_cache, v_cache, cu_seqlens_q=meta.cu_seqlens_q, seqused_k=meta.seqused_k,
                       page_table=meta.page_table, max_seqlen_q=meta.max_seqlen_q,
                       softmax_scale=scale, causal=True)
        return out[0] if isinstance(out, tuple) else out


def flash_attn_available(device: torch.device) -> bool:
    if not _cuda_capability_at_least(device, 9):
        return False
    try:
        import flash_attn.cute  # noqa: F401
    except Exception:
        return False
    return True


def _cuda_capability_at_least(device: torch.device, major: int) -> bool:
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device)[0] >= major


def make_backend(name: str, device: torch.device) -> AttentionBackend:
    """"auto" picks flash_attn where flash-attn-4 imports (Hopper/Blackwell: its prefills take 0.4-0.7x the
    Triton kernel's GPU time, bench/results/prefill_attention.md), else triton on a CUDA GPU (Ampere or
    later), else torch."""
    if name == "auto":
        if flash_attn_available(device):
            name = "flash_attn"
        else:
            name = "triton" if _cuda_capability_at_least(device, 8) else "torch"
    if name == "triton":
        return TritonAttention()
    if name == "flash_attn":
        return FlashAttention()
    if name == "torch":
        return TorchAttention()
    raise ValueError(f"unknown attention backend {name!r} (auto, triton, flash_attn, torch)")
