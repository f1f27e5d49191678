"""Paged causal attention for steps with prefills (chunks over cached prefixes, decodes mixed in), in Triton; or
an encoder's, every query over every key of its sequence (CAUSAL off).

The prefill path of the `triton` backend, for CUDA GPUs that flash-attn-4 does not run on (it needs
Hopper or Blackwell); how the two compare: bench/results/prefill_attention.md.

One program per (block of BLOCK_M query tokens of one sequence, KV head): its rows are the BLOCK_M
tokens times the GQA group's query heads, so K and V are read once per group. Query token i of a
sequence with n new tokens and a context of c sits at position c - n + i and sees keys 0..c - n + i.
The host lists the (sequence, first token) of every block, so no program is idle.
"""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from common.util import cdiv
from worker_svc.kernels.decode_attention import (LOG2E, NO_WINDOW, capped, head_cols, page_of, wide_head_tiles,
                                                 with_sinks)
from worker_svc.kernels.precision import dot
from worker_svc.kernels.uploads import upload


@triton.jit
def _prefill_kernel(Q, K, V, Out, CuQ, SeqUsed, PageTable, BlockSeq, BlockStart, Sinks, scale_log2e, v_scale, window,
                    softcap_log2,
                    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                    stride_pt, stride_ot, stride_oh,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, PAGE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr, SOFTCAP: tl.constexpr,
                    SINKS: tl.constexpr, CAUSAL: tl.constexpr):
    blk, kvh = tl.program_id(0), tl.program_id(1)
    seq = tl.load(BlockSeq + blk)
    start = tl.load(BlockStart + blk)
    q_begin = tl.load(CuQ + seq)
    q_len = tl.load(CuQ + seq + 1) - q_begin
    ctx = tl.load(SeqUsed + seq)
    r = tl.arange(0, ROWS)  # row = token * GROUP + head within the group; ROWS >= BLOCK_M * GROUP
    token = start + r // GROUP
    head = kvh * GROUP + r % GROUP
    live = (r < BLOCK_M * GROUP) & (token < q_len)
    pos = ctx - q_len + token
    d, n = tl.arange(0, HEAD_PAD), tl.arange(0, BLOCK_N)
    q_rows = (q_begin + token).to(tl.int64) * stride_qt + head * stride_qh
    q_mask = head_cols(live[:, None], d, HEAD_DIM, HEAD_PAD)
    q = tl.load(Q + q_rows[:, None] + d[None, :], mask=q_mask, other=0.0)
    m = tl.full([ROWS], float("-inf"), tl.float32)
    l = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_PAD], tl.float32)
    pages = PageTable + seq.to(tl.int64) * stride_pt
    if CAUSAL:
        last = ctx - q_len + tl.minimum(start + BLOCK_M, q_len)  # one past the block's last query position
        first = tl.maximum(ctx - q_len + start - window + 1, 0)  # the first key the block's first query sees
    else:
        last = ctx
        first = 0
    for t0 in tl.range(first // BLOCK_N * BLOCK_N, last, BLOCK_N):
        t = t0 + n
        valid = t < last
        page, offset = page_of(pages, t0, t, valid, PAGE, BLOCK_N)
        k_rows = page * stride_kb + offset * stride_kt
        v_rows = page * stride_vb + offset * stride_vt
        kv_mask = head_cols(valid[:, None], d, HEAD_DIM, HEAD_PAD)
        k = tl.load(K + kvh * stride_kh + k_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = capped(dot(q, tl.trans(k.to(q.dtype))) * scale_log2e, softcap_log2, SOFTCAP)
        if CAUSAL:
            seen = (t[None, :] <= pos[:, None]) & (t[None, :] > pos[:, None] - window) & valid[None, :]
        else:
            seen = valid[None, :] & live[:, None]
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows of dead tokens see no key at all
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m - m_safe)
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(V + kvh * stride_vh + v_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + dot(p.to(q.dtype), v.to(q.dtype))
        m = m_new
    l = with_sinks(l, m, Sinks, head, live, SINKS)
    out = acc / tl.where(l > 0, l, 1.0)[:, None] * v_scale
    o_rows = (q_begin + token).to(tl.int64) * stride_ot + head * stride_oh
    tl.store(Out + o_rows[:, None] + d[None, :], out.to(Out.dtype.element_ty), mask=q_mask)


BLOCK_M = 64  # query tokens per program: 128 rows of a GQA group of 2, two warpgroups
MAX_TILE = 256 * 128  # rows x head_dim of one program: Q and two stages of K and V in shared memory, acc in registers


def block_m_for(group: int, head_dim: int) -> int:
    """Query tokens per program for a GQA group and head size: BLOCK_M, fewer where its rows would not fit
    (head_dim 256 with a group of 4, groups of 7 or 8)."""
    return max(1, min(BLOCK_M, min(256, MAX_TILE // triton.next_power_of_2(head_dim)) // group))


def query_blocks(query_lens: list[int], block_m: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, first query token) of every BLOCK_M-token block of every sequence's new tokens: one
    pinned, asynchronous copy (a mixed step must not wait for the GPU)."""
    lens = np.asarray(query_lens, dtype=np.int64)
    counts = cdiv(lens, block_m)
    first = np.cumsum(counts) - counts
    total = int(counts.sum())
    seqs = np.repeat(np.arange(len(lens)), counts).astype(np.int32)
    starts = ((np.arange(total) - np.repeat(first, counts)) * block_m).astype(np.int32)
    return tuple(upload([seqs, starts], device))


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, seqused_k: torch.Tensor, page_table: torch.Tensor,
                            blocks: tuple[torch.Tensor, torch.Tensor], scale: float, *, k_scale: float = 1.0,
                            v_scale: float = 1.0, window: int | None = None, softcap: float | None = None,
                            sinks: torch.Tensor | None = None, block_m: int | None = None, block_n: int = 64,
                            num_warps: int = 8, num_stages: int = 2, causal: bool = True) -> torch.Tensor:
    """q: [tokens, heads, head_dim], the new tokens of each sequence (K/V already in the cache, q's dtype or
    fp8: see paged_decode_attention); `blocks` = query_blocks(query lens, block_m), block_m by default
    block_m_for(the GQA group, head_dim). With a sliding `window`, the
    query at position p sees keys in (p - window, p]; `softcap` caps scores and `sinks` join each head's softmax as
    paged_decode_attention's; causal False: every query sees every key of its sequence (an encoder's, the sequence
    whole in this step). Returns q's shape and dtype."""
    q = q.contiguous()
    tokens, heads, head_dim = q.shape
    page, kv_heads = k_cache.shape[1], k_cache.shape[2]
    block_n, num_stages = wide_head_tiles(head_dim, block_n, num_stages)
    if page % block_n and block_n % page:
        raise ValueError(f"block size {page} and tile {block_n} must divide one another")
    block_m = block_m or block_m_for(heads // kv_heads, head_dim)
    out = torch.empty_like(q)
    block_seq, block_start = blocks
    if block_seq.numel():
        _prefill_kernel[(block_seq.numel(), kv_heads)](
            q, k_cache, v_cache, out, cu_seqlens_q, seqused_k, page_table, block_seq, block_start,
            q if sinks is None else sinks,
            scale * k_scale * LOG2E, v_scale, window or NO_WINDOW, (softcap or 0.0) * LOG2E, q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), page_table.stride(0),
            out.stride(0), out.stride(1), GROUP=heads // kv_heads, HEAD_DIM=head_dim,
            HEAD_PAD=triton.next_power_of_2(head_dim), PAGE=page,
            BLOCK_M=block_m, BLOCK_N=block_n, ROWS=triton.next_power_of_2(block_m * heads // kv_heads),
            SOFTCAP=bool(softcap), SINKS=sinks is not None, CAUSAL=causal, num_warps=num_warps, num_stages=num_stages)
    return out
