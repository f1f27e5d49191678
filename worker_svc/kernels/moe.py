"""Fused mixture-of-experts in Triton: the routed tokens grouped by expert, then two grouped GEMMs.

For each (token, choice) slot the router picked an expert; `align` sorts the slots by expert into blocks of
BLOCK_M rows of one expert each (padded with an empty slot id), with static shapes and no host sync, so a decode
step with experts can be captured in a CUDA graph. `_moe_gemm` runs one block against its expert's weights:
first [tokens' hidden] x gate_up^T, then (after SwiGLU) x down^T times the slot's routing weight; `topk_sum`
adds the top-k outputs of each token. Experts outside this rank's share (tensor parallelism shards the
experts) get no slot: their rows are left out of the sum, and the all-reduce adds the other ranks' experts.

The tiles come from `moe_config` (token count -> MoeConfig): a table per expert shape measured on Hopper by
`python -m bench moe-kernel`, which prints the entry to paste into HOPPER_CONFIGS (HOPPER_FP8_CONFIGS with --fp8).
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from common.util import cdiv
from worker_svc.kernels.fp8_gemm import quantize_rows
from worker_svc.kernels.precision import dot
from worker_svc.kernels.reference import FP8_GROUP


@dataclass(frozen=True)
class Tiles:
    """One grouped GEMM's launch: BLOCK_N x BLOCK_K tiles of its weights, num_warps, num_stages."""
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class MoeConfig:
    """block_m: rows of a block of one expert (align's, so both GEMMs share it); then each GEMM's tiles."""
    block_m: int
    gate_up: Tiles = Tiles()
    down: Tiles = Tiles()


# Hopper, by the experts' (hidden, intermediate) sizes, 16-bit activations (float32 tiles would ask twice the
# shared memory): each table's entry serves the token counts up to its key (a CUDA-graph batch size, so that a batch
# and the padded batch of its graph take the same tiles); past the last key, the last entry. Measured by `python -m
# bench moe-kernel` (bench/results/moe_kernel_*.md). Rows per expert, which set the best block, differ by model at
# one token count: 130 tokens give Qwen3-30B-A3B's 128 experts ~8 rows each, Mixtral's 8 experts ~32.
HOPPER_CONFIGS: dict[tuple[int, int], dict[int, MoeConfig]] = {
    (2048, 768): {  # Qwen3-30B-A3B, Qwen3-MoE: 128 experts, top 8
        8: MoeConfig(16, Tiles(32, 128, 4, 4), Tiles(64, 64, 4, 5)),
        176: MoeConfig(16, Tiles(256, 128, 4, 2), Tiles(128, 128, 4, 2)),
        720: MoeConfig(32, Tiles(128, 128, 4, 2), Tiles(64, 128, 4, 3)),
        2048: MoeConfig(128, Tiles(256, 64, 8, 4), Tiles(256, 64, 8, 4)),
    },
    (2048, 1408): {  # Qwen1.5-MoE-A2.7B: 60 experts, top 4
        2: MoeConfig(16, Tiles(128, 128, 4, 5), Tiles(32, 128, 4, 5)),
        32: MoeConfig(16, Tiles(128, 128, 4, 3), Tiles(128, 128, 4, 2)),
        80: MoeConfig(16, Tiles(128, 128, 4, 4), Tiles(128, 128, 4, 2)),
        176: MoeConfig(16, Tiles(128, 128, 4, 4), Tiles(256, 128, 4, 2)),
        352: MoeConfig(32, Tiles(128, 128, 4, 3), Tiles(128, 128, 4, 3)),
        1024: MoeConfig(64, Tiles(64, 64, 4, 3), Tiles(64, 64, 4, 3)),
        2048: MoeConfig(128, Tiles(256, 64, 8, 4), Tiles(256, 64, 8, 4)),
    },
    (4096, 1408): {  # GLM-4.5-Air: 128 experts, top 8 (dots.llm1's experts too: top 6)
        2: MoeConfig(16, Tiles(64, 128, 4, 3), Tiles(128, 128, 4, 3)),
        16: MoeConfig(16, Tiles(64, 128, 4, 5), Tiles(64, 128, 4, 4)),
        32: MoeConfig(16, Tiles(32, 256, 4, 5), Tiles(128, 128, 4, 4)),
        80: MoeConfig(16, Tiles(64, 256, 4, 2), Tiles(32, 128, 4, 5)),
        176: MoeConfig(16, Tiles(128, 256, 4, 2), Tiles(128, 128, 4, 2)),
        352: MoeConfig(32, Tiles(64, 128, 4, 2), Tiles(256, 128, 4, 2)),
        720: MoeConfig(64, Tiles(64, 64, 4, 3), Tiles(128, 64, 4, 2)),
        2048: MoeConfig(64, Tiles(256, 64, 4, 4), Tiles(256, 64, 8, 4)),
        8192: MoeConfig(128, Tiles(256, 64, 8, 3), Tiles(256, 64, 8, 4)),
        16384: MoeConfig(128, Tiles(256, 64, 8, 4), Tiles(256, 64, 8, 4)),
    },
    (4096, 14336): {  # Mixtral-8x7B: 8 experts, top 2
        2: MoeConfig(16, Tiles(64, 128, 4, 2), Tiles(64, 64, 4, 5)),
        16: MoeConfig(16, Tiles(32, 256, 4, 5), Tiles(64, 64, 4, 3)),
        32: MoeConfig(16, Tiles(32, 256, 4, 5), Tiles(128, 128, 4, 4)),
        80: MoeConfig(16, Tiles(128, 256, 4, 3), Tiles(128, 64, 4, 3)),
        176: MoeConfig(64, Tiles(32, 64, 4, 2), Tiles(128, 128, 4, 2)),
        352: MoeConfig(128, Tiles(256, 64, 8, 4), Tiles(256, 64, 8, 4)),
        720: MoeConfig(128, Tiles(256, 64, 8, 4), Tiles(128, 128, 8, 3)),
        1024: MoeConfig(128, Tiles(256, 64, 8, 3), Tiles(256, 64, 8, 4)),
        2048: MoeConfig(128, Tiles(256, 64, 8, 4), Tiles(256, 64, 8, 4)),
    },
}


# Hopper, e4m3 experts in 128 x 128 blocks (model/quantized.py), by the same keys: `python -m bench moe-kernel --fp8`
# (measured on an H100: bench/results/moe_kernel_fp8_*). A shape measured in 16 bits only serves its 16-bit table's
# tiles made to fit (fp8_config).
HOPPER_FP8_CONFIGS: dict[tuple[int, int], dict[int, MoeConfig]] = {
    (2048, 768): {  # 128 experts, top 8
        2: MoeConfig(16, Tiles(32, 128, 4, 4), Tiles(64, 128, 4, 3)),  # from 1 token
        16: MoeConfig(16, Tiles(64, 128, 4, 3), Tiles(64, 128, 4, 3)),  # from 8 tokens
        32: MoeConfig(16, Tiles(128, 128, 4, 3), Tiles(64, 128, 4, 3)),  # from 32 tokens
        80: MoeConfig(16, Tiles(64, 128, 4, 3), Tiles(64, 128, 4, 3)),  # from 64 tokens
        176: MoeConfig(16, Tiles(256, 128, 4, 3), Tiles(64, 128, 4, 3)),  # from 130 tokens
        352: MoeConfig(16, Tiles(64, 128, 4, 3), Tiles(64, 128, 4, 3)),  # from 256 tokens
        720: MoeConfig(64, Tiles(64, 128, 4, 3), Tiles(128, 128, 8, 3)),  # from 512 tokens
        2048: MoeConfig(64, Tiles(128, 128, 8, 4), Tiles(128, 128, 8, 4)),  # from 1024 tokens
        16384: MoeConfig(128, Tiles(128, 128, 8, 4), Tiles(128, 128, 8, 4)),  # fp8_config's: see bench/NOTES.md
    },
}


def default_config(tokens: int, top_k: int) -> MoeConfig:
    """Elsewhere (other GPUs and shapes, float32, Triton's interpreter): 16-row blocks up to 1,024 slots, 64 past."""
    return MoeConfig(16 if tokens * top_k <= 1024 else 64)


def fp8_config(config: MoeConfig) -> MoeConfig:
    """A 16-bit entry's tiles for e4m3 experts: K tiles of one block of scales (an e4m3 tile of 128 is a 16-bit one
    of 64 in shared memory), and N tiles narrowed until the scaled product fits beside the accumulator (64 fp32
    values a thread each): each tile's product is scaled before it joins the accumulator, so it needs registers of
    its own, and a 16-bit entry's widest tiles would spill."""
    def fit(t: Tiles) -> Tiles:
        block_n = t.block_n
        while config.block_m * block_n > 64 * 32 * t.num_warps and block_n > 16:
            block_n //= 2
        return replace(t, block_n=block_n, block_k=FP8_GROUP)

    return replace(config, gate_up=fit(config.gate_up), down=fit(config.down))


def lookup(table: dict[int, MoeConfig], tokens: int) -> MoeConfig:
    """The entry of the smallest key >= tokens, else the last."""
    keys = sorted(table)
    return table[next((k for k in keys if tokens <= k), keys[-1])]


@functools.lru_cache(maxsize=None)
def _is_hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] == 9


@functools.lru_cache(maxsize=None)
def fp8_table(hidden: int, intermediate: int) -> dict[int, MoeConfig] | None:
    """The Hopper tiles for e4m3 experts of these sizes: their measured table, else the 16-bit one's made to fit."""
    table = HOPPER_CONFIGS.get((hidden, intermediate))
    fitted = {key: fp8_config(config) for key, config in table.items()} if table else None
    return HOPPER_FP8_CONFIGS.get((hidden, intermediate)) or fitted


def hopper_table(hidden: int, intermediate: int, dtype: torch.dtype, device: torch.device,
                 fp8: bool = False) -> dict[int, MoeConfig] | None:
    """The measured table for experts of these sizes computing in `dtype` on `device` (their weights in e4m3 where
    `fp8`), if there is one."""
    if device.type != "cuda" or dtype.itemsize != 2:
        return None
    if not _is_hopper(device.index if device.index is not None else torch.cuda.current_device()):
        return None
    return fp8_table(hidden, intermediate) if fp8 else HOPPER_CONFIGS.get((hidden, intermediate))


def moe_config(tokens: int, top_k: int, table: dict[int, MoeConfig] | None) -> MoeConfig:
    """The tiles fused_moe uses for `tokens` routed tokens, from hopper_table's table: the one place they are
    chosen."""
    return lookup(table, tokens) if table else default_config(tokens, top_k)


def warm_up_token_counts(max_tokens: int, top_k: int, table: dict[int, MoeConfig] | None) -> list[int]:
    """A token count up to max_tokens for each configuration moe_config can choose from `table`: a step of each,
    run before serving, builds every kernel variant a step can hit."""
    edges = [*(table or ()), 1024 // top_k]
    first: dict[MoeConfig, int] = {}
    for n in sorted({1, max_tokens, *edges, *(e + 1 for e in edges)}):
        if 1 <= n <= max_tokens:
            first.setdefault(moe_config(n, top_k, table), n)
    return sorted(first.values())


def num_blocks(slots: int, num_experts: int, block_m: int) -> int:
    """The blocks align() lays out: enough for every slot plus a partly filled block per expert, and at
    most one expert per slot (a decode step of a few tokens reaches only a few experts)."""
    return cdiv(slots + min(num_experts, slots) * (block_m - 1), block_m)


# ---- the router's choice: softmax (or sigmoid, and a bias), top-k and renormalisation in one launch ---------
@triton.jit(do_not_specialize=["num_tokens"])
def _router_topk(Logits, Bias, Weights, Ids, num_tokens, num_experts, stride_t, stride_bias_t, scale,
                 TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                 RENORMALIZE: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, E_PAD)
    live = t < num_tokens
    experts = live[:, None] & (e[None, :] < num_experts)
    x = tl.load(Logits + t[:, None].to(tl.int64) * stride_t + e[None, :], mask=experts,
                other=float("-inf")).to(tl.float32)
    x = tl.where(live[:, None], x, 0.0)  # rows past the last token: finite, never stored
    if SIGMOID:
        p = tl.where(experts, 1.0 / (1.0 + tl.exp(-x)), 0.0)
    else:
        p = tl.exp(x - tl.max(x, 1)[:, None])
        p = p / tl.sum(p, 1)[:, None]  # padding experts: 0, after every real one in index order
    choice = p
    if HAS_BIAS:  # chosen by score + bias (-inf: an expert the token may not take), weighted by score
        bias = tl.load(Bias + t[:, None].to(tl.int64) * stride_bias_t + e[None, :], mask=experts, other=0.0)
        choice = tl.where(experts, p + bias, float("-inf"))
    k = tl.arange(0, K_PAD)
    weights = tl.zeros([BLOCK_T, K_PAD], tl.float32)
    ids = tl.zeros([BLOCK_T, K_PAD], tl.int32)
    for j in tl.static_range(TOP_K):  # the largest left, the lowest index among equals; then taken out
        best = tl.max(choice, 1)
        idx = tl.min(tl.where(choice == best[:, None], e[None, :], E_PAD), 1)
        taken = e[None, :] == idx[:, None]
        weights = tl.where(k[None, :] == j, tl.sum(tl.where(taken, p, 0.0), 1)[:, None], weights)
        ids = tl.where(k[None, :] == j, idx[:, None], ids)
        choice = tl.where(taken, float("-inf"), choice)
    if RENORMALIZE:
        weights = weights / (tl.sum(weights, 1)[:, None] + (1e-20 if HAS_BIAS else 0.0))
    out = t[:, None].to(tl.int64) * TOP_K + k[None, :]
    mask = live[:, None] & (k[None, :] < TOP_K)
    tl.store(Weights + out, (weights * scale).to(Weights.dtype.element_ty), mask=mask)
    tl.store(Ids + out, ids.to(Ids.dtype.element_ty), mask=mask)


def router_topk(logits: torch.Tensor, top_k: int, renormalize: bool, sigmoid: bool = False,
                bias: torch.Tensor | None = None, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.router_topk in one kernel (it takes six, torch.topk two of them): [T, top_k] weights (in the
    logits' dtype; float32 with a bias or sigmoid scores) and int64 expert ids, the first choice first."""
    tokens, experts = logits.shape
    plain = bias is None and not sigmoid
    weights = torch.empty(tokens, top_k, dtype=logits.dtype if plain else torch.float32, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device)
    block_t = 16
    _router_topk[(cdiv(tokens, block_t),)](logits, bias if bias is not None else logits, weights, ids, tokens,
                                          experts, logits.stride(0), bias.stride(0) if bias is not None and
                                          bias.dim() == 2 else 0, scale, TOP_K=top_k,
                                          K_PAD=triton.next_power_of_2(top_k), E_PAD=triton.next_power_of_2(experts),
                                          BLOCK_T=block_t, RENORMALIZE=renormalize, SIGMOID=sigmoid,
                                          HAS_BIAS=bias is not None)
    return weights, ids


# ---- align: slots grouped by expert (three launches: counts per chunk, offsets, scatter) ----------------
ALIGN_CHUNK = 64  # slots per program of the count and scatter kernels
_NO_END = 2 ** 31 - 1


@triton.jit
def _local_expert(TopkIds, s, num_slots, first_expert, num_experts):
    """The local expert of slots s and whether it is this rank's (and s a slot)."""
    e = tl.load(TopkIds + s, mask=s < num_slots, other=-1).to(tl.int32) - first_expert
    return e, (s < num_slots) & (e >= 0) & (e < num_experts)


@triton.jit
def _one_hot(e, local, E_PAD: tl.constexpr):
    return ((e[:, None] == tl.arange(0, E_PAD)[None, :]) & local[:, None]).to(tl.int32)


@triton.jit(do_not_specialize=["num_slots", "first_expert", "num_rows", "rows_per_program"])
def _align_count(TopkIds, Counts, SortedSlots, num_slots, first_expert, num_experts, num_rows, rows_per_program,
                 E_PAD: tl.constexpr, CHUNK: tl.constexpr, FILL: tl.constexpr):
    """Counts[chunk, e]: the chunk's slots routed to local expert e. Also this program's share of SortedSlots
    set to the empty id (the scatter, launched after, overwrites the live rows)."""
    pid = tl.program_id(0)
    e, local = _local_expert(TopkIds, pid * CHUNK + tl.arange(0, CHUNK), num_slots, first_expert, num_experts)
    experts = tl.arange(0, E_PAD)
    tl.store(Counts + pid * num_experts + experts, tl.sum(_one_hot(e, local, E_PAD), 0), mask=experts < num_experts)
    lo = pid * rows_per_program
    hi = tl.minimum(lo + rows_per_program, num_rows)
    for r0 in range(lo, hi, FILL):
        r = r0 + tl.arange(0, FILL)
        tl.store(SortedSlots + r, tl.full([FILL], 0, tl.int32) + num_slots, mask=r < hi)


@triton.jit(do_not_specialize=["num_chunks"])
def _align_offsets(Counts, Bounds, num_chunks, num_experts,
                   BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, TILE: tl.constexpr):
    """One program: Counts becomes each chunk's first row within its expert (the earlier chunks' count);
    Bounds [2, E] each expert's first row and end, experts padded to whole blocks, in order."""
    experts = tl.arange(0, E_PAD)
    has = experts < num_experts
    total = tl.zeros([E_PAD], tl.int32)
    for c0 in range(0, num_chunks, TILE):
        c = c0 + tl.arange(0, TILE)
        ptrs = Counts + c[:, None] * num_experts + experts[None, :]
        mask = (c[:, None] < num_chunks) & has[None, :]
        n = tl.load(ptrs, mask=mask, other=0)
        tl.store(ptrs, tl.cumsum(n, 0) - n + total[None, :], mask=mask)
        total += tl.sum(n, 0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, 0)
    tl.store(Bounds + experts, end - padded, mask=has)
    tl.store(Bounds + num_experts + experts, end, mask=has)


@triton.jit(do_not_specialize=["num_slots", "first_expert", "num_blocks", "blocks_per_program"])
def _align_scatter(TopkIds, Counts, Bounds, SortedSlots, BlockExpert, num_slots, first_expert, num_experts,
                   num_blocks, blocks_per_program, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr,
                   CHUNK: tl.constexpr, TILE: tl.constexpr, NO_END: tl.constexpr):
    """Each local slot of the chunk to its row: its expert's first row + the earlier chunks' + the earlier in
    this chunk. Then this program's share of BlockExpert: each block's expert, -1 past the last."""
    pid = tl.program_id(0)
    s = pid * CHUNK + tl.arange(0, CHUNK)
    e, local = _local_expert(TopkIds, s, num_slots, first_expert, num_experts)
    hot = _one_hot(e, local, E_PAD)
    earlier = tl.sum((tl.cumsum(hot, 0) - hot) * hot, 1)
    row = tl.load(Bounds + e, mask=local, other=0) + tl.load(Counts + pid * num_experts + e, mask=local, other=0)
    tl.store(SortedSlots + row + earlier, s, mask=local)
    experts = tl.arange(0, E_PAD)
    end = tl.load(Bounds + num_experts + experts, mask=experts < num_experts, other=NO_END)
    lo = pid * blocks_per_program
    hi = tl.minimum(lo + blocks_per_program, num_blocks)
    for b0 in range(lo, hi, TILE):
        b = b0 + tl.arange(0, TILE)
        # how many experts end at or before the block's first row: its expert (searchsorted, right)
        owner = tl.sum((end[None, :] <= b[:, None] * BLOCK_M).to(tl.int32), 1)
        tl.store(BlockExpert + b, tl.where(owner < num_experts, owner, -1), mask=b < hi)


def align(topk_ids: torch.Tensor, first_expert: int, num_experts: int,
          block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot ids sorted by expert in blocks of block_m, in slot order within an expert, padded with the empty
    id T*top_k; each block's local expert, -1 past the last). Slots routed to experts outside
    [first_expert, first_expert + num_experts) are left out. Static shapes: num_blocks() blocks."""
    slots, device = topk_ids.numel(), topk_ids.device
    blocks = num_blocks(slots, num_experts, block_m)
    chunks = cdiv(slots, ALIGN_CHUNK)
    e_pad = triton.next_power_of_2(num_experts)
    ids = topk_ids.reshape(-1)
    counts = torch.empty(chunks, num_experts, dtype=torch.int32, device=device)
    bounds = torch.empty(2, num_experts, dtype=torch.int32, device=device)
    sorted_slots = torch.empty(blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=device)
    _align_count[(chunks,)](ids, counts, sorted_slots, slots, first_expert, num_experts, blocks * block_m,
                            cdiv(blocks * block_m, chunks), E_PAD=e_pad, CHUNK=ALIGN_CHUNK, FILL=1024)
    _align_offsets[(1,)](counts, bounds, chunks, num_experts, BLOCK_M=block_m, E_PAD=e_pad, TILE=32)
    _align_scatter[(chunks,)](ids, counts, bounds, sorted_slots, block_expert, slots, first_expert, num_experts,
                              blocks, cdiv(blocks, chunks), BLOCK_M=block_m, E_PAD=e_pad, CHUNK=ALIGN_CHUNK,
                              TILE=16, NO_END=_NO_END)
    return sorted_slots, block_expert


# ---- the grouped GEMM ----------------------------------------------------------------------------------
# one build whatever a step's token count: num_slots and stride_asg (an FP8 input's scales are rows-innermost)
@triton.jit(do_not_specialize=["num_slots", "stride_asg"])
def _moe_gemm(A, AScale, W, Bias, Scale, C, SortedSlots, BlockExpert, RoutedWeights, N, K, num_slots,
              stride_am, stride_asm, stride_asg, stride_we, stride_wn, stride_be, stride_se, stride_sn, stride_cm,
              A_PER_SLOT: tl.constexpr, TOP_K: tl.constexpr, MUL_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
              FP8_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
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
        if FP8_BLOCK:  # e4m3 on both sides: the product times each row's group scale and each column's block scale
            a_scale = tl.load(AScale + a_row * stride_asm + (k0 // FP8_BLOCK) * stride_asg, mask=live, other=0.0)
            w_scale = tl.load(Scale + expert * stride_se + (n // FP8_BLOCK) * stride_sn + k0 // FP8_BLOCK,
                              mask=n < N, other=0.0)
            acc += tl.dot(a, w) * (a_scale[:, None] * w_scale[None, :])
        else:
            acc += dot(a, w)
    if HAS_BIAS:  # the expert's bias, before the routing weight (gpt-oss's)
        acc += tl.load(Bias + expert * stride_be + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    if MUL_WEIGHT:
        acc = acc * tl.load(RoutedWeights + slot, mask=live, other=0.0).to(tl.float32)[:, None]
    tl.store(C + slot.to(tl.int64)[:, None] * stride_cm + n[None, :], acc.to(C.dtype.element_ty),
             mask=live[:, None] & (n[None, :] < N))


def _tile(size: int, wanted: int) -> int:
    """A tile no wider than the (power-of-two rounded) dimension, and at least tl.dot's 16."""
    return min(wanted, max(16, triton.next_power_of_2(size)))


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, sorted_slots: torch.Tensor, block_expert: torch.Tensor,
                 weights: torch.Tensor | None, top_k: int, per_slot: bool, block_m: int, tiles: Tiles,
                 bias: torch.Tensor | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
    """[slots, N]: row s = (a[s, or its token s // top_k if not per_slot] @ w[s's expert]^T + bias[s's expert])
    (times weights[s]), for every slot the blocks list; the other rows (another rank's experts) are left
    unwritten. With `scale` ([E, N / 128, K / 128]), w is e4m3 in 128 x 128 blocks with those scales, and a is
    quantised per row and 128 columns as an FP8 projection's input (fp8_gemm.quantize_rows), so that the product
    runs on e4m3 on both sides (DeepSeek's recipe: twice the tensor cores' bf16 rate, no tile converted)."""
    slots = a.shape[0] if per_slot else a.shape[0] * top_k
    n, k = w.shape[1], w.shape[2]
    out = torch.empty(slots, n, dtype=a.dtype, device=a.device)
    block_n, block_k = _tile(n, tiles.block_n), _tile(k, tiles.block_k)
    a_scale = None
    if scale is not None:
        a, a_scale = quantize_rows(a)
        block_k = min(block_k, FP8_GROUP)  # a K tile within one block of scales
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    _moe_gemm[grid](a, a if a_scale is None else a_scale, w, w if bias is None else bias,
                    w if scale is None else scale, out, sorted_slots, block_expert, weights, n, k, slots,
                    a.stride(0), *(a_scale.stride() if a_scale is not None else (0, 0)), w.stride(0), w.stride(1),
                    0 if bias is None else bias.stride(0), 0 if scale is None else scale.stride(0),
                    0 if scale is None else scale.stride(1), out.stride(0),
                    A_PER_SLOT=per_slot, TOP_K=top_k, MUL_WEIGHT=weights is not None, HAS_BIAS=bias is not None,
                    FP8_BLOCK=0 if scale is None else FP8_GROUP, BLOCK_M=block_m,
                    BLOCK_N=block_n, BLOCK_K=block_k, num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out


# ---- the sum over a token's choices ----------------------------------------------------------------------
@triton.jit(do_not_specialize=["first_expert"])
def _topk_sum(Y, TopkIds, Out, first_expert, num_experts, hidden,
              TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    acc = tl.zeros([BLOCK_H], tl.float32)
    for j in tl.static_range(TOP_K):
        slot = token * TOP_K + j
        e = tl.load(TopkIds + slot).to(tl.int32) - first_expert
        width = tl.where((e >= 0) & (e < num_experts), hidden, 0)  # another rank's expert: no row to read
        acc += tl.load(Y + slot * hidden + h, mask=h < width, other=0.0).to(tl.float32)
    tl.store(Out + token * hidden + h, acc.to(Out.dtype.element_ty), mask=h < hidden)


def topk_sum(y: torch.Tensor, topk_ids: torch.Tensor, first_expert: int, num_experts: int) -> torch.Tensor:
    """[T, H]: the sum of each token's top_k rows of y ([T * top_k, H]), those of this rank's experts only
    (the others were never written)."""
    tokens, top_k = topk_ids.shape
    hidden = y.shape[1]
    out = torch.empty(tokens, hidden, dtype=y.dtype, device=y.device)
    block_h = min(1024, triton.next_power_of_2(hidden))
    _topk_sum[(tokens, triton.cdiv(hidden, block_h))](y, topk_ids.reshape(-1), out, first_expert, num_experts,
                                                      hidden, TOP_K=top_k, BLOCK_H=block_h)
    return out


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, first_expert: int = 0, config: MoeConfig | None = None, *,
              b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
              act: Callable[[torch.Tensor], torch.Tensor] | None = None,
              s13: torch.Tensor | None = None, s2: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, H]; w13: [E, 2I, H] (gate rows, then up rows); w2: [E, H, I]; topk_weights / topk_ids: [T, top_k]
    (ids global, this rank holding experts first_expert .. first_expert + E - 1); b13 [E, 2I] and b2 [E, H]: the
    experts' biases, if any (gpt-oss's); s13 [E, 2I / 128, H / 128] and s2 [E, H / 128, I / 128]: where the
    weights are e4m3 in 128 x 128 blocks (model/quantized.py), their scales (the GEMMs' inputs are quantised too:
    grouped_gemm). Returns [T, H] in x's dtype: sum over k of weight_k * down(act(gate_up(x))) of expert id_k, act
    SwiGLU (elementwise.silu_and_mul) unless given. config: moe_config()'s by default."""
    from worker_svc.kernels.elementwise import silu_and_mul

    tokens, top_k = topk_ids.shape
    if tokens == 0:
        return torch.zeros_like(x)
    config = config or moe_config(tokens, top_k, hopper_table(w2.shape[1], w2.shape[2], x.dtype, x.device,
                                                              fp8=s13 is not None))
    experts = w13.shape[0]
    sorted_slots, block_expert = align(topk_ids, first_expert, experts, config.block_m)
    inter = grouped_gemm(x, w13, sorted_slots, block_expert, None, top_k, False, config.block_m, config.gate_up,
                         b13, s13)
    y = grouped_gemm((act or silu_and_mul)(inter), w2, sorted_slots, block_expert, topk_weights.reshape(-1), top_k,
                     True, config.block_m, config.down, b2, s2)
    return topk_sum(y, topk_ids, first_expert, experts)
