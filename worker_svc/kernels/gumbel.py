"""One Triton kernel for the common GPU case (temperature or greedy, no top-k/top-p/min-p filter):
Gumbel-max over the vocabulary in a single read of the logits, with the same hash as the reference
(reference.py: gumbel_race).

The race costs two logarithms per vocabulary entry: with tl.log (a software log of some twenty
instructions) the kernel is compute-bound; the GPU's lg2.approx unit does one in a cycle. Its ~2^-22
relative error moves a draw only where two entries tie to that precision. Triton's CPU interpreter has no
lg2.approx, so there the same kernel runs tl.log2."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from common.util import cdiv

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _log2(x, FAST: tl.constexpr):
    if FAST:
        return libdevice.fast_log2f(x)
    return tl.log2(x)


@triton.jit
def _gumbel_argmax(logits_ptr, stride, temp_ptr, seed_ptr, pos_ptr, best_ptr, idx_ptr, vocab,
                   CHUNK: tl.constexpr, BLOCK: tl.constexpr, FAST_LOG: tl.constexpr):
    """Program (row, part) races the tokens of one CHUNK of the vocabulary; the host picks the best part."""
    row, part = tl.program_id(0), tl.program_id(1)
    # sampler.row_keys, here rather than as ~36 tiny int64 kernels per step
    seed = tl.load(seed_ptr + row)
    pos = tl.load(pos_ptr + row)
    key = _mix32((seed & 0xFFFFFFFF).to(tl.uint32) ^ _mix32((pos & 0xFFFFFFFF).to(tl.uint32)))
    key = _mix32(key ^ ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
    t = tl.load(temp_ptr + row)
    inv_t = 1.0 / tl.where(t > 0, t, 1.0)
    # -ln(-ln u) = -ln2 * log2(-log2 u) - ln(ln2); the constant shifts every entry alike, so it is dropped
    noise_scale = tl.where(t > 0, 0.6931471805599453, 0.0)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.full([BLOCK], vocab, tl.int32)
    for start in range(part * CHUNK, tl.minimum(part * CHUNK + CHUNK, vocab), BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < vocab
        x = tl.load(logits_ptr + row * stride + offs, mask=mask, other=float("-inf")).to(tl.float32)
        h = _mix32(key ^ (offs.to(tl.uint32) * 0x9E3779B9))
        u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # in (0, 1), exactly: see uniform_noise
        # -log2(u) near u = 1 from w = 1 - u (exact) by its series: lg2.approx's absolute error there exceeds
        # the value, and a 0 would make the noise infinite
        w = ((8388607 - (h >> 9)).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
        neg_log2_u = tl.where(w < 0.0009765625, w * (1.0 + 0.5 * w) * 1.4426950408889634, -_log2(u, FAST_LOG))
        v = x * inv_t - noise_scale * _log2(neg_log2_u, FAST_LOG)
        better = v > best
        best = tl.where(better, v, best)
        best_idx = tl.where(better, offs, best_idx)
    top = tl.max(best, 0)
    # lowest index among equal maxima, as torch.argmax
    idx = tl.min(tl.where(best == top, best_idx, vocab), 0)
    out = row * tl.num_programs(1) + part
    tl.store(best_ptr + out, top)
    tl.store(idx_ptr + out, idx.to(tl.int64))


def gumbel_argmax(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                  parts: int = 16, block: int = 2048) -> torch.Tensor:
    """The vocabulary is cut into `parts` so that even a small batch fills the GPU."""
    rows, vocab = logits.shape
    chunk = cdiv(vocab, parts * block) * block
    parts = cdiv(vocab, chunk)
    best = torch.empty(rows, parts, dtype=torch.float32, device=logits.device)
    idx = torch.empty(rows, parts, dtype=torch.int64, device=logits.device)
    _gumbel_argmax[(rows, parts)](logits, logits.stride(0), temperature, seeds, positions, best, idx, vocab, CHUNK=chunk,
                                  BLOCK=block, FAST_LOG=not _INTERPRETED, num_warps=4)
    # argmax takes the first of equal maxima: the lowest part, whose index is the lowest
    return idx.gather(1, best.argmax(1, keepdim=True)).squeeze(1)
