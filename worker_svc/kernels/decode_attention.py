"""Split-KV paged decode attention in Triton: one query token per sequence, GQA heads packed.

flash-attn-4's varlen kernel handles a decode as a 128-row query tile with one live row per head and
one CTA per (sequence, head), so a batch whose contexts vary from 100 to 2,000 tokens ends on a tail
of long sequences. This kernel is flash-decoding over pages, close to the bandwidth of a device-to-device
copy (bench/results/decode_attention.md):

- one program per (KV head, split of SPLIT tokens, sequence) reads its split's K and V once for all
  query heads of the group (their rows padded to a tensor-core tile) and writes a partial output and
  log-sum-exp, or the output itself when the context fits one split;
- the last program of a (sequence, KV head) to finish, counted on an atomic counter, merges the splits
  (a second kernel would cost a launch and its ramp per layer for a few microseconds of work);
- a tile's K and V rows come by pointer loads or, where tile_config says so, by the tensor memory
  accelerator (one instruction per tile instead of an address and a mask per element).

Splits have a fixed token count, so work per program is even whatever the mix of context lengths, and
the grid depends only on the batch size and the page table's width: it can be captured in a CUDA graph
(programs past a sequence's context return at once).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from common.util import cdiv
from worker_svc.kernels.attention import cuda_capability_at_least
from worker_svc.kernels.elementwise import tanh
from worker_svc.kernels.precision import dot

NO_WINDOW = 1 << 30  # the window of a layer without one: longer than any context
LOG2E = 1.4426950408889634  # the kernels' scores are in log2 units (exp2)
MAX_SPLITS = 32  # bounds the partial-output buffer; long contexts get longer splits instead
WIDE_HEAD = 256  # heads wider than this (DeepSeek's cached latent, 576) take narrower tiles: wide_head_tiles


@triton.jit
def page_of(pages, t0, t, valid, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """(cache block, offset in it) of tokens t = t0 + arange(BLOCK_N) of the sequence whose page table
    row is `pages`; tokens past `valid` read block 0."""
    if BLOCK_N <= PAGE:  # the tile lies in one page
        page = tl.load(pages + t0 // PAGE).to(tl.int64)
    else:
        page = tl.load(pages + t // PAGE, mask=valid, other=0).to(tl.int64)
    return page, t % PAGE


@triton.jit
def head_cols(rows, d, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr):
    """The mask `rows` [R, 1] of a tile whose columns d = arange(HEAD_PAD) hold a head of HEAD_DIM: the columns
    past it masked too where the head is padded to a power of two (Phi-3-mini's 96), else `rows` as it is."""
    mask = rows
    if HEAD_PAD != HEAD_DIM:
        mask = rows & (d[None, :] < HEAD_DIM)
    return mask


@triton.jit
def capped(s, softcap_log2, SOFTCAP: tl.constexpr):
    """Scores (log2 units) through Gemma 2's logit cap, softcap_log2 * tanh(s / softcap_log2), where SOFTCAP."""
    if SOFTCAP:
        s = softcap_log2 * tanh(s / softcap_log2)
    return s


@triton.jit
def with_sinks(l, m, Sinks, heads, live, SINKS: tl.constexpr):
    """A softmax denominator l over scores whose max is m (log2 units) with each head's sink added where SINKS
    (gpt-oss's: one more logit per head, which takes a share of the weight and adds nothing to the output). A sink
    far above m makes l infinite and the output 0, its limit."""
    if SINKS:
        l = l + tl.exp2(tl.load(Sinks + heads, mask=live, other=0.0).to(tl.float32) * 1.4426950408889634 - m)
    return l


@triton.jit
def _split_kernel(Q, K, V, PageTable, SeqUsed, PartO, PartLse, Out, Counters, Sinks, scale_log2e, v_scale, window,
                  softcap_log2,
                  stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                  stride_pt, stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_out_t, stride_out_h,
                  KV_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
                  HEAD_PAD: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                  TMA: tl.constexpr, F16_DOTS: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr):
    # KV heads vary fastest: the programs running side by side read neighbouring 256-byte rows of the
    # same pages (3 % faster than sequence-major at 256 x 800)
    kvh, split, seq = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ctx = tl.load(SeqUsed + seq)
    lo = tl.maximum(ctx - window, 0)  # the first key inside the sliding window
    first_split = lo // SPLIT
    start = split * SPLIT
    if start >= ctx or split < first_split:
        return
    end = tl.minimum(start + SPLIT, ctx)
    h, d, n = tl.arange(0, BLOCK_H), tl.arange(0, HEAD_PAD), tl.arange(0, BLOCK_N)
    live = head_cols((h < GROUP)[:, None], d, HEAD_DIM, HEAD_PAD)
    heads = kvh * GROUP + h
    q = tl.load(Q + seq * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=live, other=0.0)
    if F16_DOTS:  # an fp8 tile becomes an fp16 operand in one conversion per pair (bf16 takes one more per value);
        # q by a power of two into fp16's range, which the scores take back
        q_scale = tl.maximum(tl.exp2(tl.ceil(tl.log2(tl.max(tl.abs(q.to(tl.float32))) / 16384.0))), 1.0)
        q = (q.to(tl.float32) / q_scale).to(tl.float16)
        scale_log2e = scale_log2e * q_scale
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_PAD], tl.float32)
    pages = PageTable + seq.to(tl.int64) * stride_pt
    for t0 in tl.range(tl.maximum(start, lo // BLOCK_N * BLOCK_N), end, BLOCK_N):
        t = t0 + n
        valid = (t < end) & (t >= lo)
        if TMA:  # K and V are [blocks x page, kv_heads x head_dim] descriptors; a tile lies in one page
            row = (tl.load(pages + t0 // PAGE) * PAGE + t0 % PAGE).to(tl.int32)
            k = K.load([row, kvh * HEAD_DIM])
        else:
            page, offset = page_of(pages, t0, t, valid, PAGE, BLOCK_N)
            k_rows = page * stride_kb + offset * stride_kt
            v_rows = page * stride_vb + offset * stride_vt
            kv_mask = head_cols(valid[:, None], d, HEAD_DIM, HEAD_PAD)
            k = tl.load(K + kvh * stride_kh + k_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = capped(dot(q, tl.trans(k.to(q.dtype))) * scale_log2e, softcap_log2, SOFTCAP)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        if TMA:  # rows past the context are read as stored: finite (the cache starts zeroed), and p is 0 there
            v = V.load([row, kvh * HEAD_DIM])
        else:
            v = tl.load(V + kvh * stride_vh + v_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + dot(p.to(q.dtype), v.to(q.dtype))
        m = m_new
    out = Out + seq * stride_out_t + heads[:, None] * stride_out_h + d[None, :]
    splits = tl.cdiv(ctx, SPLIT)
    if splits - first_split == 1:  # the whole context (window) in one split: no partials, no merge
        l = with_sinks(l, m, Sinks, heads, h < GROUP, SINKS)
        tl.store(out, (acc / l[:, None] * v_scale).to(Out.dtype.element_ty), mask=live)
        return
    o_ptrs = PartO + seq * stride_ob + heads[:, None] * stride_oh + d[None, :]
    lse_ptrs = PartLse + seq * stride_lb + heads * stride_lh
    tl.store(o_ptrs + split * stride_os, acc / l[:, None], mask=live)
    tl.store(lse_ptrs + split, m + tl.log2(l), mask=h < GROUP)
    merge_if_last(Counters + seq * KV_HEADS + kvh, first_split, splits, o_ptrs, lse_ptrs, stride_os, out, live,
                  h < GROUP, Sinks, heads, v_scale, BLOCK_H, SINKS)


@triton.jit
def merge_if_last(counter, first_split, splits, o_ptrs, lse_ptrs, stride_os, out, live, head_live, Sinks, heads,
                  v_scale, BLOCK_H: tl.constexpr, SINKS: tl.constexpr):
    """After a split program stored its partial output (at o_ptrs + split * stride_os, [BLOCK_H, width]) and its
    log-sum-exp (lse_ptrs + split): the last of splits first_split..splits - 1 to get here merges them all into
    `out`. Every thread's stores come before the counter's release; the program that finds the count of the others
    there is the last, and its acquire makes their partials visible to it. It resets the counter for the next
    layer (and graph replay)."""
    tl.debug_barrier()
    if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == splits - first_split - 1:
        tl.debug_barrier()
        tl.store(counter, 0)
        # the partials are read past L1, which another program's stores did not go through
        m = tl.load(lse_ptrs + first_split, mask=head_live, other=0.0, cache_modifier=".cg")
        acc = tl.load(o_ptrs + first_split * stride_os, mask=live, other=0.0, cache_modifier=".cg")
        l = tl.full([BLOCK_H], 1.0, tl.float32)
        for i in range(first_split + 1, splits):
            lse = tl.load(lse_ptrs + i, mask=head_live, other=0.0, cache_modifier=".cg")
            m_new = tl.maximum(m, lse)
            a, b = tl.exp2(m - m_new), tl.exp2(lse - m_new)
            part = tl.load(o_ptrs + i * stride_os, mask=live, other=0.0, cache_modifier=".cg")
            acc = acc * a[:, None] + part * b[:, None]
            l = l * a + b
            m = m_new
        l = with_sinks(l, m, Sinks, heads, head_live, SINKS)
        tl.store(out, (acc / l[:, None] * v_scale).to(out.dtype.element_ty), mask=live)


def wide_head_tiles(head_dim: int, block_n: int, num_stages: int) -> tuple[int, int]:
    """(block_n, num_stages) for both attention kernels: heads past WIDE_HEAD (padded to 1,024 for latent
    attention's 576) take 16-token K and V tiles in at most two stages, which fit shared memory."""
    return (min(block_n, 16), min(num_stages, 2)) if head_dim > WIDE_HEAD else (block_n, num_stages)


def split_size(page_table_width: int, page: int, block_n: int, base: int) -> int:
    """Tokens per split: `base`, or more when the page table is so wide that MAX_SPLITS would not cover it."""
    longest = page_table_width * page
    split = max(base, cdiv(longest, MAX_SPLITS))
    return cdiv(split, block_n) * block_n


def tile_config(batch: int, fp8: bool = False) -> dict:
    """Tiles and splits for a decode batch, the best measured on the H200 (bench/results/decode_attention.md,
    decode_attention_*tma*.md, decode_attention_f16_*.md): up to 8 sequences, short splits of 64-token tiles spread
    the few sequences over the GPU; past that, 128-token tiles in 512-token splits (longer splits save a merge but
    add as much tail), or over an fp8 cache 64-token tiles (in 256-token splits up to 16 sequences). Tiles are
    loaded by the tensor memory accelerator except for a bf16 batch past 8 sequences: TMA takes the per-element
    addresses and masks out of the fp8 kernel's loop, and small batches gain from its shorter issue, but where
    the bf16 kernel's pointer loads already keep DRAM busy, TMA's path makes it slower. Over an fp8 cache both
    dots run in fp16 (f16_dots: e4m3 unpacks in one instruction per pair of values); that pays only in 512-token
    splits, whose longer loops hide each tile's latency. The bound is a CUDA-graph batch size
    (decode_step.capture_sizes), so a batch and the padded batch of its graph take the same tiles and compute
    the same values."""
    if batch <= 8:
        return dict(base_split=128, block_n=64, tma=True, f16_dots=fp8)
    if fp8:  # 512-token splits from 17 sequences: up to 16, they would leave half the GPU's program slots idle
        return dict(base_split=256 if batch <= 16 else 512, block_n=64, tma=True, f16_dots=True)
    return dict(base_split=512, block_n=128, tma=False, f16_dots=False)


def tma_fits(k_cache: torch.Tensor, v_cache: torch.Tensor, block_n: int) -> bool:
    """Whether TMA loads the caches' tiles: each inside one page, of a token-major cache whose rows of one
    token are contiguous (the worker's; not the head-major views bench decode-attention times), with heads of
    128 (the size measured and checked on the H200: Gemma 3's 256 keep pointer loads), on a GPU with the unit
    (Hopper and later) or under the interpreter."""
    page, kv_heads, head_dim = k_cache.shape[1:]
    layout = all(c.stride(0) == page * c.stride(1) and c.stride(1) == kv_heads * head_dim and c.stride(2) == head_dim
                 for c in (k_cache, v_cache))
    return block_n <= page and head_dim == 128 and layout and has_tma(k_cache.device)


def has_tma(device: torch.device) -> bool:
    """Whether tiles can come by the tensor memory accelerator: a GPU with the unit (Hopper and later), or Triton's
    interpreter."""
    return device.type != "cuda" or cuda_capability_at_least(device, 9)


def query_rows(group: int) -> int:
    """A program's query tile: the GQA group's heads padded to the tensor core's 16 rows."""
    return max(16, triton.next_power_of_2(group))


def merge_counters(batch: int, kv_heads: int, device: torch.device | str) -> torch.Tensor:
    """The split counters of paged_decode_attention: zeros, which every call leaves zero again."""
    return torch.zeros(batch * kv_heads, dtype=torch.int32, device=device)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           seqused_k: torch.Tensor, page_table: torch.Tensor, scale: float, *,
                           k_scale: float = 1.0, v_scale: float = 1.0, window: int | None = None,
                           softcap: float | None = None, sinks: torch.Tensor | None = None,
                           counters: torch.Tensor | None = None,
                           base_split: int | None = None, block_n: int | None = None, num_warps: int = 4,
                           num_stages: int = 3, tma: bool | None = None, f16_dots: bool | None = None) -> torch.Tensor:
    """q: [batch, heads, head_dim], one token per sequence whose K/V are already in the cache.
    k_cache/v_cache: [num_blocks, page, kv_heads, head_dim], q's dtype or fp8 (read in q's dtype, k_scale
    folded into the softmax scale, the output times v_scale). With a sliding `window`, the last `window` tokens
    only; with `softcap`, scores capped to softcap * tanh(score / softcap) (Gemma 2); with `sinks` ([heads]), each
    head's sink as one more logit of its softmax (gpt-oss). Returns q's shape and dtype.
    counters: from merge_counters, for at least this batch (default: fresh ones, a memset per call).
    Tiles default to tile_config(batch); `tma` (K and V tiles loaded by the tensor memory accelerator, where
    tma_fits) to tile_config's choice. f16_dots: both dots in fp16 rather than q's dtype, q scaled by a power
    of two into fp16's range (an fp8 tile then converts in one instruction per pair of values, where bf16 takes
    one more per value: `bench kernel-sass`); by default tile_config's choice where q is 16-bit (a float32 q
    keeps float32 dots)."""
    q = q.contiguous()  # the kernels take unit stride along head_dim
    batch, heads, head_dim = q.shape
    tiles = tile_config(batch, k_cache.element_size() == 1)
    base_split, block_n = base_split or tiles["base_split"], block_n or tiles["block_n"]
    page, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    block_n = min(block_n, base_split)
    block_n, num_stages = wide_head_tiles(head_dim, block_n, num_stages)
    if page % block_n and block_n % page:
        raise ValueError(f"block size {page} and tile {block_n} must divide one another")
    split = split_size(page_table.shape[1], page, block_n, base_split)
    num_splits = cdiv(page_table.shape[1] * page, split)
    part_o = torch.empty(batch, heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch, heads, num_splits, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    if counters is None:
        counters = merge_counters(batch, kv_heads, q.device)
    assert counters.numel() >= batch * kv_heads and counters.dtype == torch.int32
    kv = (k_cache, v_cache)
    tma = (tiles["tma"] if tma is None else tma) and tma_fits(k_cache, v_cache, block_n)
    f16_dots = tiles["f16_dots"] and q.element_size() == 2 if f16_dots is None else f16_dots
    if tma:  # each cache as [blocks x page, kv_heads x head_dim]: a tile is BLOCK_N consecutive rows
        kv = tuple(TensorDescriptor(c, [c.shape[0] * page, kv_heads * head_dim], [c.stride(1), 1], [block_n, head_dim])
                   for c in kv)
    _split_kernel[(kv_heads, num_splits, batch)](
        q, *kv, page_table, seqused_k, part_o, part_lse, out, counters, q if sinks is None else sinks,
        scale * k_scale * LOG2E, v_scale, window or NO_WINDOW, (softcap or 0.0) * LOG2E, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), page_table.stride(0),
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1), KV_HEADS=kv_heads, GROUP=group, BLOCK_H=query_rows(group), HEAD_DIM=head_dim,
        HEAD_PAD=triton.next_power_of_2(head_dim), PAGE=page, BLOCK_N=block_n, SPLIT=split, TMA=tma,
        F16_DOTS=f16_dots, SOFTCAP=bool(softcap), SINKS=sinks is not None, num_warps=num_warps,
        num_stages=num_stages)
    return out
