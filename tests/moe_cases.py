"""Inputs of the fused MoE and align() as torch ops, for its tests on the CPU (Triton's interpreter) and
the GPU (tests/gpu/test_gpu_moe.py)."""
from __future__ import annotations

import torch


def routed_tokens(tokens: int, top_k: int, experts: int, hidden: int, gen: torch.Generator, device: str = "cpu",
                  dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, topk_weights and topk_ids: top_k distinct of `experts` per token, from random scores."""
    x = torch.randn(tokens, hidden, generator=gen)
    topk_weights, topk_ids = torch.randn(tokens, experts, generator=gen).softmax(-1).topk(top_k, dim=-1)
    return x.to(device, dtype), topk_weights.to(device, dtype), topk_ids.to(device)


def expert_weights(local: int, hidden: int, inter: int, gen: torch.Generator, device: str = "cpu",
                   dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 [local, 2 * inter, hidden] and w2 [local, hidden, inter], scaled to outputs of unit size."""
    w13 = torch.randn(local, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    w2 = torch.randn(local, hidden, inter, generator=gen) / inter ** 0.5
    return w13.to(device, dtype), w2.to(device, dtype)


def moe_inputs(tokens: int, top_k: int, experts: int, local: int, hidden: int, inter: int,
               seed: int) -> tuple[torch.Tensor, ...]:
    """x, w13, w2 (this rank's `local` experts), topk_weights, topk_ids, in float32 on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    w13, w2 = expert_weights(local, hidden, inter, gen)
    x, topk_weights, topk_ids = routed_tokens(tokens, top_k, experts, hidden, gen)
    return x, w13, w2, topk_weights, topk_ids


def align_by_sorting(topk_ids: torch.Tensor, first_expert: int, num_experts: int, block_m: int,
                     size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels/moe.py's align() as torch ops on the CPU: the slots of each local expert in slot order, each
    expert padded to whole blocks, into `size` rows; each block's expert, -1 past the last."""
    key = topk_ids.cpu().flatten() - first_expert
    key = torch.where((key >= 0) & (key < num_experts), key, num_experts)
    counts = torch.bincount(key, minlength=num_experts + 1)[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    starts = padded.cumsum(0) - padded
    sorted_slots = torch.full((size,), topk_ids.numel(), dtype=torch.int32)
    for e in range(num_experts):
        mine = torch.nonzero(key == e).flatten()
        sorted_slots[starts[e]:starts[e] + mine.numel()] = mine.int()
    block_expert = torch.searchsorted(padded.cumsum(0), torch.arange(0, size, block_m), right=True)
    return sorted_slots, torch.where(block_expert < num_experts, block_expert, -1).int()


def check_router_choice(logits: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, renormalize: bool,
                        tol: float) -> None:
    """weights / ids are a top-k choice of softmax(logits) whatever the order among equal probabilities: distinct
    ids, most probable first, none left out more probable than one taken, each weight its probability (over the
    chosen ones' sum when renormalised) within tol."""
    p = logits.float().softmax(-1)
    chosen = p.gather(1, ids)
    assert (ids.sort(1).values.diff(dim=1) > 0).all(), "an expert chosen twice"
    assert (chosen.diff(dim=1) <= 0).all(), "not most probable first"
    left = p.scatter(1, ids, -1.0)
    assert (left.max(1).values <= chosen.min(1).values).all(), "a more probable expert left out"
    expected = chosen / chosen.sum(1, keepdim=True) if renormalize else chosen
    torch.testing.assert_close(weights.float(), expected, atol=tol, rtol=tol)
