"""One Triton kernel for the common GPU case (temperature or greedy, no top-k/top-p/min-p filter):
Gumbel-max over the vocabulary in a single read of the logits, with the same hash as sampler.py."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _gumbel_argmax(logits_ptr, stride, temp_ptr, key_ptr, out_ptr, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    t = tl.load(temp_ptr + row)
    inv_t = tl.where(t > 0, 1.0 / t, 1.0)
    noise_scale = tl.where(t > 0, 1.0, 0.0)
    key = tl.load(key_ptr + row).to(tl.uint32)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK], tl.int32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < vocab
        x = tl.load(logits_ptr + row * stride + offs, mask=mask, other=float("-inf")).to(tl.float32)
        h = _mix32(key ^ (offs.to(tl.uint32) * 0x9E3779B9))
        u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        v = x * inv_t - noise_scale * tl.log(-tl.log(u))
        better = v > best
        best = tl.where(better, v, best)
        best_idx = tl.where(better, offs, best_idx)
    top = tl.max(best, 0)
    # lowest index among equal maxima, as torch.argmax
    idx = tl.min(tl.where(best == top, best_idx, vocab), 0)
    tl.store(out_ptr + row, idx.to(tl.int64))


def gumbel_argmax(logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    _gumbel_argmax[(logits.shape[0],)](logits, logits.stride(0), temperature, keys, out, logits.shape[1],
                                       BLOCK=4096, num_warps=8)
    return out
