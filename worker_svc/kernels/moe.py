"""Fused mixture-of-experts in Triton: the routed tokens grouped by expert, then two grouped GEMMs.

For each (token, choice) slot the router picked an expert; `align` sorts the slots by expert into blocks of
BLOCK_M rows of one expert each (padded with an empty slot id), with static shapes and no host sync, so a decode
step with experts can be captured in a CUDA graph. `_moe_gemm` runs one block against its expert's weights:
first [tokens' hidden] x gate_up^T, then (after SwiGLU) x down^T times the slot's routing weight; the top-k
outputs of a token are summed at the end. Experts outside this rank's share (tensor parallelism shards the
experts) get no slot: their rows stay zero, and the all-reduce adds the other ranks' experts.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.util import cdiv


@triton.jit
def _moe_gemm(A, W, C, SortedSlots, BlockExpert, RoutedWeights, N, K, num_slots,
              stride_am, stride_we, stride_wn, stride_cm,
              A_PER_SLOT: tl.constexpr, TOP_K: tl.constexpr, MUL_WEIGHT: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(BlockExpert + pid_m).to(tl.int64)
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(SortedSlots + rows)
    live = slot < num_slots
    a_row = (slot if A_PER_SLOT else slot // TOP_K).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(A + a_row[:, None] * stride_am + k[None, :], mask=live[:, None] & (k[None, :] < K), other=0.0)
        w = tl.load(W + expert * stride_we + n[None, :] * stride_wn + k[:, None],
                    mask=(n[None, :] < N) & (k[:, None] < K), other=0.0)
        acc += tl.dot(a, w)
    if MUL_WEIGHT:
        acc = acc * tl.load(RoutedWeights + slot, mask=live, other=0.0).to(tl.float32)[:, None]
    tl.store(C + slot.to(tl.int64)[:, None] * stride_cm + n[None, :], acc.to(C.dtype.element_ty),
             mask=live[:, None] & (n[None, :] < N))


def align(topk_ids: torch.Tensor, first_expert: int, num_experts: int,
          block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot ids sorted by expert in blocks of block_m, padded with the empty id T*top_k; each block's local
    expert, -1 past the last). Slots routed to experts outside [first_expert, first_expert + num_experts) are
    left out. Static shapes: the slots' count plus every expert's padding, rounded up to a block."""
    slots = topk_ids.numel()
    device = topk_ids.device
    key = topk_ids.flatten() - first_expert
    key = torch.where((key >= 0) & (key < num_experts), key, num_experts)  # elsewhere: sorted last, dropped
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device).scatter_add_(
        0, key, torch.ones_like(key))[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    start = counts.cumsum(0) - counts
    sorted_key = key[order]
    expert = sorted_key.clamp(max=num_experts - 1)
    dest = padded_end[expert] - padded[expert] + torch.arange(slots, device=device) - start[expert]
    size = cdiv(slots + num_experts * (block_m - 1), block_m) * block_m
    dest = torch.where(sorted_key < num_experts, dest, size)  # the dropped land in a spare last entry
    sorted_slots = torch.full((size + 1,), slots, dtype=torch.int32, device=device)
    sorted_slots.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, size, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_slots[:size], block_expert


def _gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, sorted_slots, block_expert, weights, top_k: int,
          a_per_slot: bool, block_m: int) -> None:
    """out[slot] = a[slot or its token] @ w[slot's expert]^T (times the slot's routing weight), for every slot
    the blocks list; out has a row per slot."""
    n, k = w.shape[1], w.shape[2]
    block_n, block_k = 64, 64 if k >= 64 else max(16, triton.next_power_of_2(k))
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    _moe_gemm[grid](a, w, out, sorted_slots, block_expert, weights, n, k, out.shape[0],
                    a.stride(0), w.stride(0), w.stride(1), out.stride(0),
                    A_PER_SLOT=a_per_slot, TOP_K=top_k, MUL_WEIGHT=weights is not None, BLOCK_M=block_m,
                    BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, first_expert: int = 0) -> torch.Tensor:
    """x: [T, H]; w13: [E, 2I, H] (gate rows, then up rows); w2: [E, H, I]; topk_weights / topk_ids: [T, top_k]
    (ids global, this rank holding experts first_expert .. first_expert + E - 1). Returns [T, H] in x's dtype:
    sum over k of weight_k * down(silu(gate(x)) * up(x)) of expert id_k."""
    from worker_svc.kernels.elementwise import silu_and_mul

    tokens, top_k = topk_ids.shape
    block_m = 16 if tokens * top_k <= 1024 else 64
    sorted_slots, block_expert = align(topk_ids, first_expert, w13.shape[0], block_m)
    slots = tokens * top_k
    inter = torch.empty(slots, w13.shape[1], dtype=x.dtype, device=x.device)
    _gemm(x, w13, inter, sorted_slots, block_expert, None, top_k, False, block_m)
    act = silu_and_mul(inter)
    out = torch.zeros(slots, w2.shape[1], dtype=x.dtype, device=x.device)
    _gemm(act, w2, out, sorted_slots, block_expert, topk_weights.flatten(), top_k, True, block_m)
    return out.view(tokens, top_k, -1).sum(1)
