"""Paged attention over a mixed batch: prefill chunks, continuations over cached prefixes and decodes
in ONE call per layer, described like flash-attn-4's paged varlen call.

The KV cache of a layer is a K and a V tensor shaped [num_blocks, block_size, num_kv_heads, head_dim];
token t of a sequence lives in block page_table[seq, t // block_size] at offset t % block_size.

Backends, by name (`splitserve-worker serve --attention`):
- `torch`: the reference (kernels/reference.py), for CPUs and for checking the others;
- `triton`: splitserve's split-KV decode kernel for decode-only steps, its paged prefill kernel otherwise;
- `flash_attn`: the same decode kernel, flash-attn-4's paged varlen call for steps with prefills
  (Hopper and Blackwell);
- `auto`: on a GPU with flash-attn-4, the decode kernel for decode-only steps and, for each step with prefills,
  whichever prefill kernel suits it (`prefill_kernel`); else triton on a CUDA GPU, else torch.
Which is faster where: bench/results/decode_attention.md, prefill_attention.md and attention_policy.md.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from common.util import cdiv

NAMES = ("auto", "triton", "flash_attn", "torch")


@dataclass(slots=True)
class AttentionMetadata:
    cu_seqlens_q: torch.Tensor  # int32 [batch + 1]: query tokens of sequence i are [cu[i], cu[i+1])
    seqused_k: torch.Tensor     # int32 [batch]: context length of each sequence after this step
    page_table: torch.Tensor    # int32 [batch, max_blocks]
    slot_mapping: torch.Tensor  # int64 [tokens]: where each new token's K and V are written
    max_seqlen_q: int
    query_lens: list[int]       # host copies, for backends that loop on the host
    context_lens: list[int]
    causal: bool = True         # False: an encoder's step, each sequence whole, every query seeing every key


def prefill_metadata(query_lens: list[int], block_size: int, device: torch.device | str,
                     cached: int = 0, causal: bool = True) -> tuple[torch.Tensor, AttentionMetadata]:
    """The positions and metadata of one step in which sequence i runs query_lens[i] new tokens after `cached`
    tokens already in its blocks, the sequences on consecutive blocks from block 0 (warm-up, scoring, tests)."""
    ctx = [cached + n for n in query_lens]
    counts = [cdiv(c, block_size) for c in ctx]
    page = np.zeros((len(ctx), max(counts)), np.int32)
    first = 0
    for i, k in enumerate(counts):
        page[i, :k] = np.arange(first, first + k)
        first += k
    positions = np.concatenate([np.arange(cached, c) for c in ctx])
    rows = np.repeat(np.arange(len(ctx)), query_lens)
    slots = page[rows, positions // block_size].astype(np.int64) * block_size + positions % block_size
    meta = AttentionMetadata(
        cu_seqlens_q=torch.tensor(np.concatenate([[0], np.cumsum(query_lens)]), dtype=torch.int32, device=device),
        seqused_k=torch.tensor(ctx, dtype=torch.int32, device=device), page_table=torch.from_numpy(page).to(device),
        slot_mapping=torch.from_numpy(slots).to(device), max_seqlen_q=max(query_lens), query_lens=list(query_lens),
        context_lens=ctx, causal=causal)
    return torch.from_numpy(positions).to(device), meta


class AttentionBackend(Protocol):
    name: str

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, k_scale: float = 1.0, v_scale: float = 1.0, window: int | None = None,
                softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q: [tokens, heads, head_dim]; the new K/V are already in the cache (q's dtype, or fp8 holding
        k / k_scale and v / v_scale). A query sees the keys up to its position, or all of its sequence's where
        meta.causal is False (an encoder's). With a sliding `window`, a query at position p sees keys in
        (p - window, p]; with `softcap`, each scaled score s becomes softcap * tanh(s / softcap) (Gemma 2); with
        `sinks` (float32 [heads]: gpt-oss's), each head's softmax has one more logit, its sink, which takes a share
        of the weight and adds nothing to the output. Returns q's shape."""
        ...

    def latent(self, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float, k_scale: float,
               rope_dim: int) -> torch.Tensor:
        """Multi-head latent attention (model/mla.py): every head of q ([tokens, heads, rope_dim + latent]) over the
        one cache plane that is both K and V ([num_blocks, page, 1, rope_dim + latent], in the order of
        latent_columns), V being its latent alone. Returns [tokens, heads, latent]."""
        ...


def latent_columns(o: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """The latent's columns, [..., latent], of a row stored as the rope kernels pair a latent-attention head's dims
    (layers.rotary_order): [rope dims' firsts | latent's first half | rope dims' seconds | latent's second half]."""
    half, latent_half = rope_dim // 2, (o.shape[-1] - rope_dim) // 2
    return torch.cat([o[..., half:half + latent_half], o[..., 2 * half + latent_half:]], dim=-1)


# (q, k_cache, v_cache, meta, scale, k_scale, v_scale, window, softcap, sinks) -> out
Prefill = Callable[..., torch.Tensor]


class TritonDecode:
    """The split-KV decode kernels (decode_attention.py, and latent_attention.py for latent attention) with the
    split counters every layer shares (each call leaves them zero). Sized by the first, largest call: CUDA graphs
    are captured largest first, after an eager warm-up. A larger batch later gets larger ones; the old stay
    allocated, as captured graphs may still use them."""

    def __init__(self):
        from worker_svc.kernels import decode_attention, latent_attention  # triton: a GPU-only dependency

        self._kernel, self._latent = decode_attention, latent_attention
        self._counters: list[torch.Tensor] = []

    def counters(self, n: int, device: torch.device) -> torch.Tensor:
        if not self._counters or self._counters[-1].numel() < n:
            self._counters.append(torch.zeros(n, dtype=torch.int32, device=device))
        return self._counters[-1]

    def __call__(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, k_scale: float,
                 v_scale: float, window: int | None, softcap: float | None,
                 sinks: torch.Tensor | None) -> torch.Tensor:
        return self._kernel.paged_decode_attention(q, k_cache, v_cache, meta.seqused_k, meta.page_table, scale,
                                                   k_scale=k_scale, v_scale=v_scale, window=window, softcap=softcap,
                                                   sinks=sinks, counters=self.counters(q.shape[0] * k_cache.shape[2],
                                                                                       q.device))

    def latent(self, q, cache, meta: AttentionMetadata, scale: float, k_scale: float, rope_dim: int) -> torch.Tensor:
        counters = self.counters(q.shape[0] * self._latent.head_blocks(q.shape[1]), q.device)
        return self._latent.paged_latent_decode_attention(q, cache, meta.seqused_k, meta.page_table, scale, rope_dim,
                                                          k_scale=k_scale, counters=counters)


class TritonPrefill:
    """The paged prefill kernel (prefill_attention.py); its query blocks are listed once per step, not per
    layer."""

    def __init__(self):
        from worker_svc.kernels import prefill_attention  # triton: a GPU-only dependency

        self._kernel = prefill_attention
        self._blocks: tuple[torch.Tensor, torch.Tensor] | None = None
        self._blocks_of: tuple[AttentionMetadata, int] | None = None  # the step and block_m _blocks lists

    def __call__(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, k_scale: float,
                 v_scale: float, window: int | None, softcap: float | None,
                 sinks: torch.Tensor | None) -> torch.Tensor:
        kernel = self._kernel
        block_m = kernel.block_m_for(q.shape[1] // k_cache.shape[2], q.shape[2])
        if self._blocks_of is None or self._blocks_of[0] is not meta or self._blocks_of[1] != block_m:
            self._blocks, self._blocks_of = kernel.query_blocks(meta.query_lens, block_m, q.device), (meta, block_m)
        return kernel.paged_prefill_attention(q, k_cache, v_cache, meta.cu_seqlens_q, meta.seqused_k,
                                              meta.page_table, self._blocks, scale, k_scale=k_scale, v_scale=v_scale,
                                              window=window, softcap=softcap, sinks=sinks, block_m=block_m,
                                              causal=meta.causal)


class FlashAttnPrefill:
    """flash-attn-4 (CuTe DSL): one paged varlen call, over a cache of q's dtype (resolve() keeps caches
    other than fp16 and bf16 away from it)."""

    def __init__(self):
        from flash_attn.cute import flash_attn_varlen_func

        self._fn = flash_attn_varlen_func

    def __call__(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, k_scale: float,
                 v_scale: float, window: int | None, softcap: float | None,
                 sinks: torch.Tensor | None) -> torch.Tensor:
        # flash-attn's window counts the keys left of the query, (p - window, p] being window - 1 of them
        out = self._fn(q, k_cache, v_cache, cu_seqlens_q=meta.cu_seqlens_q, seqused_k=meta.seqused_k,
                       page_table=meta.page_table, max_seqlen_q=meta.max_seqlen_q, softmax_scale=scale,
                       causal=meta.causal, window_size=(None, None) if window is None else (window - 1, 0),
                       learnable_sink=sinks, **({"softcap": softcap} if softcap else {}))
        return out[0] if isinstance(out, tuple) else out


# flash-attn-4's call costs ~100 us more host time than the Triton prefill kernel's (eager_us in
# bench/results/prefill_attention.md) and wins it back on the GPU only when the step's attention is large: below
# this many FLOPs of attention per layer the Triton kernel runs the step faster (bench/results/attention_policy.md).
FLASH_ATTN_MIN_FLOPS = 40e9


def attention_flops(meta: AttentionMetadata, heads: int, head_dim: int) -> float:
    """FLOPs of one layer's attention in the step: QK^T and PV, 4 * heads * head_dim per causal (query, key) pair."""
    pairs = sum(q * (k - (q - 1) / 2) for q, k in zip(meta.query_lens, meta.context_lens))
    return 4.0 * heads * head_dim * pairs


FLASH_ATTN_MAX_HEAD = 256  # flash-attn-4's widest head on Hopper (DeepSeek's cached latent, 576, is Triton's alone)


def prefill_kernel(meta: AttentionMetadata, heads: int, head_dim: int) -> str:
    """`auto`'s choice for a step with prefills."""
    return "flash_attn" if attention_flops(meta, heads, head_dim) >= FLASH_ATTN_MIN_FLOPS else "triton"


class PagedAttention:
    """A GPU backend: the decode kernel for decode-only steps (one query token per sequence); for steps with
    prefills its one prefill kernel or, with several (`auto`), the one `prefill_kernel` picks, once per step."""

    def __init__(self, name: str, prefills: dict[str, Prefill], decode: TritonDecode):
        self.name, self.prefills, self._decode = name, prefills, decode
        self.forced: str | None = None  # a prefill kernel every step uses (the warm-up builds each in turn)
        self.steps = dict.fromkeys(prefills, 0)  # steps with prefills, by the kernel that ran them
        self._chosen: Prefill = next(iter(prefills.values()))
        self._chosen_for: AttentionMetadata | None = None

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, k_scale: float = 1.0,
                v_scale: float = 1.0, window: int | None = None, softcap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        if meta.max_seqlen_q == 1 and meta.causal:
            return self._decode(q, k_cache, v_cache, meta, scale, k_scale, v_scale, window, softcap, sinks)
        if self._chosen_for is not meta:  # the first layer of a step decides for all
            name = self.forced or (prefill_kernel(meta, q.shape[1], q.shape[2]) if len(self.prefills) > 1
                                   else next(iter(self.prefills)))
            self._chosen, self._chosen_for = self.prefills[name], meta
            self.steps[name] += 1
        return self._chosen(q, k_cache, v_cache, meta, scale, k_scale, v_scale, window, softcap, sinks)

    def latent(self, q, cache, meta: AttentionMetadata, scale: float, k_scale: float, rope_dim: int) -> torch.Tensor:
        if meta.max_seqlen_q == 1:
            return self._decode.latent(q, cache, meta, scale, k_scale, rope_dim)
        return latent_columns(self.forward(q, cache, cache, meta, scale, k_scale, k_scale), rope_dim)


def flash_attn_available(device: torch.device) -> bool:
    if not cuda_capability_at_least(device, 9):
        return False
    try:
        importlib.import_module("flash_attn.cute")
    except Exception:
        return False
    return True


def cuda_capability_at_least(device: torch.device, major: int) -> bool:
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device)[0] >= major


FLASH_ATTN_DTYPES = (torch.float16, torch.bfloat16)  # the caches flash-attn-4's paged call reads (q of the same dtype)


def resolve(name: str, device: torch.device, kv_dtype: torch.dtype = torch.bfloat16, head_dim: int = 128) -> str:
    """What `auto` stands for on this device for a cache of `kv_dtype` and `head_dim`-wide heads: itself (a choice
    per step) where flash-attn-4 runs and takes the cache (16-bit, as its paged call reads no fp8 or fp32, and heads
    up to FLASH_ATTN_MAX_HEAD), else triton on a CUDA GPU, else torch; other names as they are."""
    if name not in NAMES:
        raise ValueError(f"unknown attention backend {name!r} ({', '.join(NAMES)})")
    if name == "flash_attn" and kv_dtype not in FLASH_ATTN_DTYPES:
        raise ValueError(f"--attention flash_attn cannot read a {str(kv_dtype).removeprefix('torch.')} KV cache "
                         "(flash-attn-4's paged call takes fp16 or bf16): use --attention triton or auto")
    if name == "flash_attn" and head_dim > FLASH_ATTN_MAX_HEAD:
        raise ValueError(f"--attention flash_attn takes heads up to {FLASH_ATTN_MAX_HEAD} wide and this model caches "
                         f"{head_dim}: use --attention triton or auto")
    if name != "auto":
        return name
    if flash_attn_available(device) and kv_dtype in FLASH_ATTN_DTYPES and head_dim <= FLASH_ATTN_MAX_HEAD:
        return "auto"
    return "triton" if cuda_capability_at_least(device, 8) else "torch"


def make_attention(name: str, device: torch.device, kv_dtype: torch.dtype = torch.bfloat16,
                   head_dim: int = 128) -> AttentionBackend:
    name = resolve(name, device, kv_dtype, head_dim)
    if name == "torch":
        from worker_svc.kernels.reference import TorchAttention

        return TorchAttention()
    prefills = {"auto": {"triton": TritonPrefill, "flash_attn": FlashAttnPrefill}, "triton": {"triton": TritonPrefill},
                "flash_attn": {"flash_attn": FlashAttnPrefill}}[name]
    return PagedAttention(name, {k: make() for k, make in prefills.items()}, TritonDecode())
