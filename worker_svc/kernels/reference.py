"""The reference of every kernel, in plain torch: what a CPU runs (tests, demos) and what the GPU kernels are
checked against. The GPU kernels round where these do, so both paths give the same values."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from common.util import cdiv
from worker_svc.kernels.attention import latent_columns

_M32 = 0xFFFFFFFF


# ---- elementwise ------------------------------------------------------------------------------------
def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """norm(x), or with `residual` (norm(x + residual), x + residual)."""
    if residual is None:
        return _rms(x, weight, eps)
    x = x + residual
    return _rms(x, weight, eps), x


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                 q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q and k (where the weights are given: Qwen3), then rotary embedding (rotate-half
    layout, as Hugging Face's Llama and Qwen)."""
    cos, sin = cos_sin[positions].unsqueeze(-2).chunk(2, dim=-1)
    if q_weight is not None:
        q, k = _rms(q, q_weight, eps), _rms(k, k_weight, eps)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """x as a KV cache of `cache_dtype` holds it: itself, or in an fp8 cache x / scale, saturated."""
    if x.dtype == cache_dtype:
        return x
    top = torch.finfo(cache_dtype).max
    return (x.float() * (1.0 / scale)).clamp(-top, top).to(cache_dtype)


def _put_rows(cache: torch.Tensor, slot_mapping: torch.Tensor, x: torch.Tensor) -> None:
    rows = cache.view(-1, *x.shape[1:])
    if cache.dtype.itemsize == 1:  # index_copy_ has no fp8 kernel on a CPU: copy the bytes
        rows, x = rows.view(torch.uint8), x.view(torch.uint8)
    rows.index_copy_(0, slot_mapping, x)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """k and v at slot_mapping; where the V cache is the K cache (latent attention's), k alone."""
    _put_rows(k_cache, slot_mapping, to_cache(k, k_cache.dtype, k_scale))
    if v_cache.data_ptr() != k_cache.data_ptr():
        _put_rows(v_cache, slot_mapping, to_cache(v, v_cache.dtype, v_scale))


def qk_norm_rope_store(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                       q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int, k_scale: float = 1.0,
                       v_scale: float = 1.0) -> torch.Tensor:
    """qkv: [tokens, (heads + 2 kv_heads) * head_dim] from the projection. Writes k and v at slot_mapping in
    the caches (into fp8 ones divided by their scales); returns q [tokens, heads, head_dim], normed (with
    weights) and rotated."""
    head_dim = k_cache.shape[-1]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k = qk_norm_rope(q.view(-1, num_heads, head_dim), k.view(-1, num_kv_heads, head_dim), positions, cos_sin,
                        q_weight, k_weight, eps)
    store_kv(k, v.view(-1, num_kv_heads, head_dim), k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def router_topk(logits: torch.Tensor, top_k: int, renormalize: bool, sigmoid: bool = False,
                bias: torch.Tensor | None = None, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top_k experts by softmax probability, most probable first (weights in the logits' dtype,
    ids int64); the weights renormalised to sum to 1 when asked (Qwen3-MoE's norm_topk_prob).
    With a bias ([experts], or [tokens, experts] with -inf on experts a token may not take), DeepSeek-V3's choice
    (GLM-4.5's, ERNIE 4.5's): the top_k of score + bias, by sigmoid scores where asked, weighted by their scores
    (renormalised as transformers does, over sum + 1e-20) times `scale`, in float32."""
    scores = logits.float().sigmoid() if sigmoid else logits.float().softmax(-1)
    ids = torch.topk(scores if bias is None else scores + bias, top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + (0.0 if bias is None else 1e-20))
    weights = weights * scale
    return (weights.to(logits.dtype) if bias is None and not sigmoid else weights), ids


def clamped_swiglu(x: torch.Tensor, limit: float, alpha: float = 1.702) -> torch.Tensor:
    """gpt-oss's experts' activation of x [rows, 2 * n] (gate then up): gate clamped above at `limit`, up to
    [-limit, limit], gate * sigmoid(alpha * gate) * (up + 1)."""
    gate, up = x.chunk(2, dim=-1)
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return gate * torch.sigmoid(gate * alpha) * (up + 1)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, first_expert: int = 0, *, b13: torch.Tensor | None = None,
              b2: torch.Tensor | None = None, act: Callable[[torch.Tensor], torch.Tensor] | None = None,
              s13: torch.Tensor | None = None, s2: torch.Tensor | None = None) -> torch.Tensor:
    """kernels/moe.py's fused_moe as a loop over this rank's experts (transformers' order of sums); with s13 and s2
    the experts' weights are FP8 in blocks with those scales, each expert's projection an fp8_linear (its input
    quantised as the kernel quantises it, both sides dequantised in float32)."""
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        token, k = torch.where(topk_ids == first_expert + e)
        if token.numel():
            gate_up = _expert_linear(x[token], w13[e], _of(b13, e), _of(s13, e))
            y = _expert_linear((act or silu_and_mul)(gate_up), w2[e], _of(b2, e), _of(s2, e))
            out.index_add_(0, token, (y * topk_weights[token, k, None]).to(out.dtype))
    return out


def _of(t: torch.Tensor | None, e: int) -> torch.Tensor | None:
    return None if t is None else t[e]


def _expert_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, scale: torch.Tensor | None
                   ) -> torch.Tensor:
    return F.linear(x, w, b) if scale is None else fp8_linear(x, w, scale, b)


FP8_GROUP = 128  # an FP8 weight's blocks are FP8_GROUP x FP8_GROUP, its input's groups 1 x FP8_GROUP (fp8_gemm.py)
E4M3_MAX = 448.0


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (e4m3 [..., K], float32 scales [..., K / 128]): each 1 x 128 group over its largest magnitude,
    as fp8_gemm's kernel quantises a linear's input."""
    groups = x.float().unflatten(-1, (-1, FP8_GROUP))
    scale = (groups.abs().amax(-1) / E4M3_MAX).clamp_min(1e-12)
    return (groups / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).flatten(-2), scale


def dequantize_blocks(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """An FP8 weight [N, K] in 128 x 128 blocks times its scales [N / 128, K / 128], in float32."""
    return weight.float() * scale.repeat_interleave(FP8_GROUP, 0).repeat_interleave(FP8_GROUP, 1)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
               ) -> torch.Tensor:
    """fp8_gemm.linear in float32 torch ops: x quantised as its kernel does, both sides dequantised."""
    q, x_scale = quantize_rows(x)
    xs = (q.float().unflatten(-1, (-1, FP8_GROUP)) * x_scale[..., None]).flatten(-2)
    return F.linear(xs, dequantize_blocks(weight, scale), None if bias is None else bias.float()).to(x.dtype)


def unpack_ints(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [rows, w] -> int64 [rows, w * 32 / bits]: each word's 32 / bits unsigned codes, the lowest bits first."""
    shifts = torch.arange(0, 32, bits, device=words.device)
    return ((words.to(torch.int64)[..., None] >> shifts) & ((1 << bits) - 1)).flatten(-2)


def dequantize_ints(words: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer groups packed along the input columns (model/packed_ints.py) -> float32 [rows, cols]: (code - zero)
    * scale of the column's group."""
    grouped = unpack_ints(words, bits).float().unflatten(-1, (scale.shape[-1], -1))
    return ((grouped - zero[..., None]) * scale[..., None]).flatten(-2)


def int_linear(x: torch.Tensor, words: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T over a packed integer weight, dequantised in float32 and rounded once to x's dtype."""
    bits = 32 * words.shape[-1] // x.shape[-1]
    return F.linear(x, dequantize_ints(words, zero, scale, bits).to(x.dtype), bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           scale: torch.Tensor | None = None, zero: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear; with `zero`, `weight` is integer groups packed with those zero points and `scale`s
    (model/packed_ints.py); with `scale` alone, FP8 in blocks with those scales (model/quantized.py)."""
    if zero is not None:
        return int_linear(x, weight, zero, scale, bias)
    if scale is not None:
        return fp8_linear(x, weight, scale, bias)
    return F.linear(x, weight, bias)


# ---- sampling -----------------------------------------------------------------------------------------
def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 integer hash on int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One 32-bit key per row from (seed, position)."""
    key = _mix32((seeds & _M32) ^ _mix32(positions & _M32))
    return _mix32(key ^ ((seeds >> 32) & _M32))


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[S, vocab] float32 in (0, 1), a pure function of (seed, position, token id): (k + 1/2) / 2^23 for 23 bits k
    of the hash, exact in float32. (With 24 bits the largest, 1 - 2^-25, rounds to 1.0, whose Gumbel noise is
    infinite: about one draw in a hundred over a 151,936-token vocabulary went to a uniformly random token.)"""
    ids = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    return unit_interval(_mix32(row_keys(seeds, positions)[:, None] ^ ((ids * 0x9E3779B9) & _M32)[None, :]))


def unit_interval(bits: torch.Tensor) -> torch.Tensor:
    """32-bit hashes as float32 in (0, 1), both ends excluded."""
    return ((bits >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def gumbel_race(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                restrict: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Gumbel-max: argmax(x_i + G_i), G_i = -log(-log U_i), draws token i with probability softmax(x)_i, for
    x = logits / temperature (then `restrict`ed: top-k, top-p, min-p); greedy where the temperature is 0."""
    greedy = logits.argmax(dim=-1)
    x = logits / torch.where(temperature > 0, temperature, 1.0)[:, None]
    if restrict is not None:
        x = restrict(x)
    u = uniform_noise(seeds, positions, logits.shape[-1])
    race = x - torch.log(-torch.log(u))
    return torch.where(temperature > 0, race.argmax(dim=-1), greedy)


def gumbel_argmax(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                  positions: torch.Tensor) -> torch.Tensor:
    """kernels/gumbel.py's kernel: temperature sampling (or greedy) without filters."""
    if not bool((temperature > 0).any()):
        return logits.argmax(dim=-1)
    return gumbel_race(logits, temperature, seeds, positions)


# ---- attention --------------------------------------------------------------------------------------
class TorchAttention:
    """Plain reference over the paged layout: gathers each sequence's context and runs causal SDPA (or, where
    meta.causal is False, an encoder's: every query over every key of its sequence).
    An fp8 cache is read as the kernels read it: its values in q's dtype, k_scale folded into the softmax
    scale, the output times v_scale.

    With a sliding `window`, query position p attends to keys in (p - window, p]; with `softcap`, each scaled
    score s becomes softcap * tanh(s / softcap) before the mask, as Gemma 2's attention computes it; with `sinks`,
    each head's softmax takes its sink as one more logit (gpt-oss's), which weighs on the others and adds nothing.

    One loop iteration per sequence, so it is for CPUs, tests and checking the fast backends."""

    name = "torch"

    def forward(self, q, k_cache, v_cache, meta, scale, k_scale=1.0, v_scale=1.0, window=None, softcap=None,
                sinks=None):
        out = torch.empty_like(q)
        block_size, groups = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
        start = 0
        for i, (n, ctx) in enumerate(zip(meta.query_lens, meta.context_lens)):
            blocks = meta.page_table[i, : cdiv(ctx, block_size)].long()
            k = k_cache[blocks].flatten(0, 1)[:ctx].transpose(0, 1).repeat_interleave(groups, 0).to(q.dtype)
            v = v_cache[blocks].flatten(0, 1)[:ctx].transpose(0, 1).repeat_interleave(groups, 0).to(q.dtype)
            qpos = torch.arange(ctx - n, ctx, device=q.device)
            kpos = torch.arange(ctx, device=q.device)[None, :]
            mask = kpos <= qpos[:, None] if meta.causal else torch.ones(n, ctx, dtype=torch.bool, device=q.device)
            if window is not None:
                mask &= kpos > qpos[:, None] - window
            qs = q[start:start + n].transpose(0, 1)
            if softcap or sinks is not None:
                scores = qs @ k.transpose(1, 2)
                scores = (torch.tanh(scores * (scale * k_scale / softcap)) * softcap if softcap
                          else scores * (scale * k_scale))
                scores = scores.masked_fill(~mask, float("-inf"))
                if sinks is not None:  # one more logit per head, dropped after the softmax
                    scores = torch.cat([scores.float(), sinks.float()[:, None, None].expand(-1, n, 1)], -1)
                probs = scores.softmax(-1, dtype=torch.float32)[..., :ctx].to(q.dtype)
                o = probs @ v
            else:
                o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale * k_scale)
            out[start:start + n] = o.transpose(0, 1) if v_scale == 1.0 else (o.transpose(0, 1) * v_scale)
            start += n
        return out

    def latent(self, q, cache, meta, scale, k_scale, rope_dim):
        return latent_columns(self.forward(q, cache, cache, meta, scale, k_scale, k_scale), rope_dim)
