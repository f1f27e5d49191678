"""Split-KV paged decode attention over DeepSeek's latent cache (multi-head latent attention, model/mla.py).

Every query head reads the one cached "KV head": a token's kv_lora_rank latent and its rope dims, stored as the rope
kernels pair them (layers.rotary_order): [rope dims' firsts | latent's first half | rope dims' seconds | latent's
second half]. The score is q's dot with all of it; the value is the latent alone, so the output is
[batch, heads, kv_lora_rank] with the latent's halves in order, what the head's W_UV takes.

The generic decode kernel (decode_attention.py) serves this cache as a head of 576 padded to 1,024 in 16-token tiles,
its V tile loaded again from the same plane. Here the four parts are loaded as they lie (no padding for DeepSeek's
32 + 256 halves), once per tile for both dots, in tiles of tile_config's tokens. Splits and their merge are the
generic kernel's: one program per (block of heads, split, sequence), the last program of a (sequence, head block)
merges (decode_attention.merge_if_last). The grid depends only on the batch, the heads and the page table's width,
so the call can be captured in a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from common.util import cdiv

from worker_svc.kernels.decode_attention import (LOG2E, has_tma, merge_counters, merge_if_last, page_of,
                                                 split_size)
from worker_svc.kernels.precision import dot

MIN_BLOCK_H = 16  # query heads a program takes at the least: the tensor core's rows



@triton.jit
def _part(rows, col0, cols, mask, WIDTH: tl.constexpr):
    """[rows, cols] values of a part WIDTH wide starting at column col0 of each row (rows: pointers)."""
    return tl.load(rows[:, None] + col0 + cols[None, :], mask=mask & (cols[None, :] < WIDTH), other=0.0)


@triton.jit
def _latent_kernel(Q, Cache, RopeTiles, LatentTiles, PageTable, SeqUsed, PartO, PartLse, Out, Counters, scale_log2e,
                   v_scale, stride_qt, stride_qh, stride_cb, stride_ct, stride_pt, stride_ob, stride_oh, stride_os,
                   stride_lb, stride_lh, stride_out_t, stride_out_h,
                   HEADS: tl.constexpr, ROPE: tl.constexpr, ROPE_PAD: tl.constexpr, LATENT: tl.constexpr,
                   LATENT_PAD: tl.constexpr, PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                   SPLIT: tl.constexpr, TMA: tl.constexpr):
    # ROPE and LATENT are halves: a token's row is [ROPE | LATENT | ROPE | LATENT]
    hb, split, seq = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ctx = tl.load(SeqUsed + seq)
    start = split * SPLIT
    if start >= ctx:
        return
    end = tl.minimum(start + SPLIT, ctx)
    h, r, c, n = tl.arange(0, BLOCK_H), tl.arange(0, ROPE_PAD), tl.arange(0, LATENT_PAD), tl.arange(0, BLOCK_N)
    heads = hb * BLOCK_H + h
    head_live = heads < HEADS
    q_rows = Q + seq * stride_qt + heads * stride_qh
    q_live = head_live[:, None]
    q_ra = _part(q_rows, 0, r, q_live, ROPE)
    q_la = _part(q_rows, ROPE, c, q_live, LATENT)
    q_rb = _part(q_rows, ROPE + LATENT, r, q_live, ROPE)
    q_lb = _part(q_rows, 2 * ROPE + LATENT, c, q_live, LATENT)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc_a = tl.zeros([BLOCK_H, LATENT_PAD], tl.float32)
    acc_b = tl.zeros([BLOCK_H, LATENT_PAD], tl.float32)
    pages = PageTable + seq.to(tl.int64) * stride_pt
    for t0 in tl.range(start, end, BLOCK_N):
        t = t0 + n
        valid = t < end
        if TMA:  # the cache as [blocks x page, row] descriptors of each part's width; a tile lies in one page.
            # Rows past the context are read as stored: finite (the cache starts zeroed), and p is 0 there
            row = (tl.load(pages + t0 // PAGE) * PAGE + t0 % PAGE).to(tl.int32)
            k_ra = RopeTiles.load([row, 0]).to(q_ra.dtype)
            k_la = LatentTiles.load([row, ROPE]).to(q_ra.dtype)
            k_rb = RopeTiles.load([row, ROPE + LATENT]).to(q_ra.dtype)
            k_lb = LatentTiles.load([row, 2 * ROPE + LATENT]).to(q_ra.dtype)
        else:
            page, offset = page_of(pages, t0, t, valid, PAGE, BLOCK_N)
            rows = Cache + page * stride_cb + offset * stride_ct
            live = valid[:, None]
            k_ra = _part(rows, 0, r, live, ROPE).to(q_ra.dtype)
            k_la = _part(rows, ROPE, c, live, LATENT).to(q_ra.dtype)
            k_rb = _part(rows, ROPE + LATENT, r, live, ROPE).to(q_ra.dtype)
            k_lb = _part(rows, 2 * ROPE + LATENT, c, live, LATENT).to(q_ra.dtype)
        s = dot(q_la, tl.trans(k_la)) + dot(q_lb, tl.trans(k_lb))
        s = (s + dot(q_ra, tl.trans(k_ra)) + dot(q_rb, tl.trans(k_rb))) * scale_log2e
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        p = p.to(q_ra.dtype)
        acc_a = acc_a * alpha[:, None] + dot(p, k_la)
        acc_b = acc_b * alpha[:, None] + dot(p, k_lb)
        m = m_new
    out_a = Out + seq * stride_out_t + heads[:, None] * stride_out_h + c[None, :]
    out_live = q_live & (c[None, :] < LATENT)
    if tl.cdiv(ctx, SPLIT) == 1:  # the whole context in one split: no partials, no merge
        tl.store(out_a, (acc_a / l[:, None] * v_scale).to(Out.dtype.element_ty), mask=out_live)
        tl.store(out_a + LATENT, (acc_b / l[:, None] * v_scale).to(Out.dtype.element_ty), mask=out_live)
        return
    # partials hold both halves in one row of 2 * LATENT_PAD, which the merge reads whole
    o_a = PartO + seq * stride_ob + heads[:, None] * stride_oh + c[None, :]
    lse_ptrs = PartLse + seq * stride_lb + heads * stride_lh
    tl.store(o_a + split * stride_os, acc_a / l[:, None], mask=q_live)
    tl.store(o_a + split * stride_os + LATENT_PAD, acc_b / l[:, None], mask=q_live)
    tl.store(lse_ptrs + split, m + tl.log2(l), mask=head_live)
    w = tl.arange(0, 2 * LATENT_PAD)
    o_ptrs = PartO + seq * stride_ob + heads[:, None] * stride_oh + w[None, :]
    out_cols = w // LATENT_PAD * LATENT + w % LATENT_PAD
    out = Out + seq * stride_out_t + heads[:, None] * stride_out_h + out_cols[None, :]
    merge_if_last(Counters + seq * tl.num_programs(0) + hb, 0, tl.cdiv(ctx, SPLIT), o_ptrs, lse_ptrs, stride_os, out,
                  q_live & (w % LATENT_PAD < LATENT)[None, :], head_live, PartLse, heads, v_scale, BLOCK_H, False)


def head_blocks(heads: int, block_h: int = MIN_BLOCK_H) -> int:
    """Programs a (sequence, split) takes: the query heads in blocks of block_h (by default the most there can be)."""
    return cdiv(heads, block_h)


def tile_config(batch: int, heads: int) -> dict:
    """Tokens per tile and per split, warps, stages, TMA and query heads a program for a decode batch, the best
    measured on the H200 (bench/results/latent_attention_*.md): 64-token tiles by TMA, in 256-token splits up to 32
    sequences (more programs for a few sequences), in 512-token splits past that; 16 heads a program (4 warps), or
    past 32 sequences over 64 heads and more 64 of them (8 warps): each block of heads reads the whole cache, and
    one block for 64 heads took 15 % less time than four (at 32 heads two blocks of 16 beat one of 32). The bound is
    a CUDA-graph batch size (decode_step.capture_sizes), so a batch and its graph's padded batch take the same."""
    many = heads >= 64 and batch > 32
    return dict(base_split=256 if batch <= 32 else 512, block_n=64, num_warps=8 if many else 4, num_stages=2,
                tma=True, block_h=64 if many else MIN_BLOCK_H)


def tma_fits(cache: torch.Tensor, block_n: int, unpadded: bool) -> bool:
    """Whether TMA loads the cache's tiles: each inside one page, of a contiguous cache whose parts need no padding
    (DeepSeek's 32 and 256), on a GPU with the unit (Hopper and later) or under the interpreter."""
    return block_n <= cache.shape[1] and cache.is_contiguous() and unpadded and has_tma(cache.device)


def paged_latent_decode_attention(q: torch.Tensor, cache: torch.Tensor, seqused_k: torch.Tensor,
                                  page_table: torch.Tensor, scale: float, rope_dim: int, *, k_scale: float = 1.0,
                                  counters: torch.Tensor | None = None, base_split: int | None = None,
                                  block_n: int | None = None, num_warps: int | None = None,
                                  num_stages: int | None = None, tma: bool | None = None,
                                  block_h: int | None = None) -> torch.Tensor:
    """q: [batch, heads, rope_dim + latent], one token per sequence whose latent is already in the cache
    ([num_blocks, page, 1, rope_dim + latent], q's dtype or fp8 holding values / k_scale; both in the order the
    module's docstring gives). Returns [batch, heads, latent] in q's dtype: each head's softmax-weighted sum of the
    latents. counters: int32 zeros, at least batch x head_blocks(heads, block_h), which the call leaves zero
    (default: fresh ones). Tiles, splits, warps, stages, TMA (where tma_fits) and block_h, the query heads a program
    takes, default to tile_config's."""
    q = q.contiguous()
    batch, heads, head_dim = q.shape
    page = cache.shape[1]
    assert cache.shape[2] == 1 and cache.shape[3] == head_dim and cache.stride(3) == 1
    rope, latent = rope_dim // 2, (head_dim - rope_dim) // 2
    tiles = tile_config(batch, heads)
    block_h = block_h or tiles["block_h"]
    base_split = base_split or tiles["base_split"]
    block_n = min(block_n or tiles["block_n"], base_split)
    if page % block_n and block_n % page:
        raise ValueError(f"block size {page} and tile {block_n} must divide one another")
    split = split_size(page_table.shape[1], page, block_n, base_split)
    num_splits = cdiv(page_table.shape[1] * page, split)
    latent_pad = max(16, triton.next_power_of_2(latent))  # a dot's K dimension takes at least 16
    part_o = torch.empty(batch, heads, num_splits, 2 * latent_pad, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch, heads, num_splits, dtype=torch.float32, device=q.device)
    out = torch.empty(batch, heads, 2 * latent, dtype=q.dtype, device=q.device)
    if counters is None:
        counters = merge_counters(batch, head_blocks(heads, block_h), q.device)
    assert counters.numel() >= batch * head_blocks(heads, block_h) and counters.dtype == torch.int32
    rope_pad, parts = max(16, triton.next_power_of_2(rope)), (cache, cache)
    tma = (tiles["tma"] if tma is None else tma) and tma_fits(cache, block_n, rope == rope_pad and latent == latent_pad)
    if tma:
        rows = cache.view(-1, head_dim)
        parts = tuple(TensorDescriptor(rows, list(rows.shape), [head_dim, 1], [block_n, w]) for w in (rope, latent))
    _latent_kernel[(head_blocks(heads, block_h), num_splits, batch)](
        q, cache, *parts, page_table, seqused_k, part_o, part_lse, out, counters, scale * k_scale * LOG2E, k_scale,
        q.stride(0), q.stride(1), cache.stride(0), cache.stride(1), page_table.stride(0),
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1), HEADS=heads, ROPE=rope, ROPE_PAD=rope_pad,
        LATENT=latent, LATENT_PAD=latent_pad, PAGE=page, BLOCK_H=block_h, BLOCK_N=block_n, SPLIT=split, TMA=tma,
        num_warps=num_warps or tiles["num_warps"], num_stages=num_stages or tiles["num_stages"])
    return out
