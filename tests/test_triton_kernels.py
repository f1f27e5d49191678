"""The GPU's Triton kernels, run by Triton's interpreter on the CPU against the eager/reference paths:
split-KV paged decode attention, the fused q/k norm + rope + KV store, the Gumbel-max sampler, the skinny GEMM, the
packed integer dequantiser.
(The interpreter emulates no bfloat16, so float32/float16 here; tests/gpu checks bfloat16 on the GPU.)
The interpreter is switched on by tests/conftest.py before anything imports triton."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from common.limits import Limits
from common.util import cdiv
from tests.moe_cases import align_by_sorting, check_router_choice, moe_inputs
from worker_svc import kernels
from worker_svc.kernels import elementwise, skinny_gemm
from worker_svc.kernels.attention import AttentionMetadata
from worker_svc.kernels.decode_attention import merge_counters, paged_decode_attention, tile_config, tma_fits
from worker_svc.kernels.elementwise import qk_norm_rope_store
from worker_svc.kernels.gumbel import gumbel_argmax
from worker_svc.kernels.latent_attention import tile_config as latent_tiles
from worker_svc.kernels.moe import Tiles
from worker_svc.kernels.prefill_attention import paged_prefill_attention, query_blocks
from worker_svc.kernels.reference import TorchAttention, qk_norm_rope, store_kv, uniform_noise
from worker_svc.kernels.skinny_gemm import skinny_linear
from worker_svc.model.layers import RMSNorm, RotaryEmbedding
from worker_svc.runtime.decode_step import capture_sizes

# tests/conftest.py turns the interpreter on where there is no GPU; on a GPU machine tests/gpu checks these
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter")


def _paged(lens, page, kv_heads, dim, dtype, extra_width=0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    pages = [cdiv(c, page) for c in lens]
    num_blocks = sum(pages) + 2
    k = torch.randn(num_blocks, page, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(num_blocks, page, kv_heads, dim, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen).int()
    table = torch.zeros(len(lens), max(pages) + extra_width, dtype=torch.int32)
    used = 0
    for i, n in enumerate(pages):
        table[i, :n] = perm[used:used + n]
        used += n
    return k, v, table


# (query heads, KV heads, head_dim): 24 a head padded to a power of two in the kernels, as Phi-3-mini's 96
HEAD_SHAPES = [(4, 2, 32), (6, 2, 24), (2, 2, 32)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("page,block_n,split", [(16, 16, 32), (16, 32, 64), (32, 16, 32), (64, 64, 64)])
@pytest.mark.parametrize("heads,kv_heads,dim", HEAD_SHAPES)
def test_decode_attention_matches_reference(dtype, page, block_n, split, heads, kv_heads, dim):
    lens = [1, 2, split - 1, split, split + 1, 3 * split + 5, page + 1]
    k, v, table = _paged(lens, page, kv_heads, dim, dtype)
    q = torch.randn(len(lens), heads, dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    seqused = torch.tensor(lens, dtype=torch.int32)
    meta = AttentionMetadata(torch.arange(len(lens) + 1, dtype=torch.int32), seqused, table, None, 1,
                             [1] * len(lens), lens)
    ref = TorchAttention().forward(q.float(), k.float(), v.float(), meta, dim ** -0.5)
    out = paged_decode_attention(q, k, v, seqused, table, dim ** -0.5, base_split=split, block_n=block_n)
    assert out.dtype == dtype and out.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("max_batch", [1, 256])
def test_decode_attention_tile_configs_match_reference(max_batch):
    """Both configurations of tile_config; page 16 under 128-token tiles gathers a page per row.
    (max_batch picks the tiles; the batch itself is 17)"""
    batch, page, dim = 17, 16, 32
    lens = [(i * 97) % 1300 + 1 for i in range(batch)]
    k, v, table = _paged(lens, page, 2, dim, torch.float32)
    q = torch.randn(batch, 4, dim, generator=torch.Generator().manual_seed(5))
    seqused = torch.tensor(lens, dtype=torch.int32)
    meta = AttentionMetadata(torch.arange(batch + 1, dtype=torch.int32), seqused, table, None, 1, [1] * batch, lens)
    ref = TorchAttention().forward(q, k, v, meta, dim ** -0.5)
    out = paged_decode_attention(q, k, v, seqused, table, dim ** -0.5, **tile_config(max_batch))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("max_num_seqs", [5, 8, 100, 256, 512])
def test_a_batch_and_its_padded_cuda_graph_batch_take_the_same_tiles(max_num_seqs):
    sizes = capture_sizes(max_num_seqs)
    for n in range(1, max_num_seqs + 1):
        for fp8 in (False, True):
            assert tile_config(n, fp8) == tile_config(min(s for s in sizes if s >= n), fp8), (n, fp8)
        for heads in (16, 64, 128):  # the latent kernel's, which latent attention takes in decode
            assert latent_tiles(n, heads) == latent_tiles(min(s for s in sizes if s >= n), heads), (n, heads)


@pytest.mark.parametrize("max_num_seqs", [5, 8, 100, 256, 512])
def test_a_batch_and_its_padded_cuda_graph_batch_take_the_same_projection_kernel(max_num_seqs):
    sizes = capture_sizes(max_num_seqs)
    x, w = torch.empty(max_num_seqs, 1024, dtype=torch.bfloat16), torch.empty(4096, 1024, dtype=torch.bfloat16)
    for n in range(1, max_num_seqs + 1):
        padded = min(s for s in sizes if s >= n)
        assert skinny_gemm.supported(x[:n], w) == skinny_gemm.supported(x[:padded], w), n
    assert skinny_gemm.supported(x[:1], w)
    assert not skinny_gemm.supported(x[:1], torch.empty(1024, 3072, dtype=torch.bfloat16))  # K > 2048
    assert not skinny_gemm.supported(x[:1].float(), w.float())  # float32 stays with cuBLAS


def test_decode_attention_on_a_wide_page_table_takes_longer_splits():
    """A CUDA graph's page table covers max_model_len: splits grow so that at most MAX_SPLITS exist."""
    lens, page, dim = [5, 700, 1500], 16, 32
    k, v, table = _paged(lens, page, 2, dim, torch.float32, extra_width=200)
    q = torch.randn(3, 4, dim, generator=torch.Generator().manual_seed(2))
    seqused = torch.tensor(lens, dtype=torch.int32)
    narrow = paged_decode_attention(q, k, v, seqused, table[:, :-200], dim ** -0.5, base_split=32, block_n=16)
    wide = paged_decode_attention(q, k, v, seqused, table, dim ** -0.5, base_split=32, block_n=16)
    torch.testing.assert_close(narrow, wide, atol=1e-5, rtol=1e-5)


def test_split_counters_are_left_zero_for_the_next_call():
    """The last split of each (sequence, KV head) merges and resets its counter, so one buffer serves every
    layer and graph replay; a smaller batch uses a prefix of it."""
    gen = torch.Generator().manual_seed(7)
    heads, kv_heads, dim, page = 4, 2, 32, 16
    lens = [200, 17, 64, 129]  # several splits, one split, exactly a split, one past it
    table = torch.arange(len(lens) * 16, dtype=torch.int32).view(len(lens), 16)
    k = torch.randn(len(lens) * 16, page, kv_heads, dim, generator=gen)
    v = torch.randn_like(k)
    q = torch.randn(len(lens), heads, dim, generator=gen)
    seqused = torch.tensor(lens, dtype=torch.int32)
    counters = merge_counters(8, kv_heads, "cpu")
    first = paged_decode_attention(q, k, v, seqused, table, dim ** -0.5, counters=counters, base_split=64, block_n=16)
    assert not counters.any()
    again = paged_decode_attention(q, k, v, seqused, table, dim ** -0.5, counters=counters, base_split=64, block_n=16)
    torch.testing.assert_close(again, first, atol=0.0, rtol=0.0)
    fresh = paged_decode_attention(q, k, v, seqused, table, dim ** -0.5, base_split=64, block_n=16)
    torch.testing.assert_close(fresh, first, atol=0.0, rtol=0.0)
    meta = AttentionMetadata(torch.arange(len(lens) + 1, dtype=torch.int32), seqused, table, torch.empty(0), 1,
                             [1] * len(lens), lens)
    torch.testing.assert_close(first, TorchAttention().forward(q, k, v, meta, dim ** -0.5), atol=1e-5, rtol=1e-5)
    assert not counters.any()


@pytest.mark.parametrize("window", [1, 5, 33, 64, 70])
@pytest.mark.parametrize("page,block_n,split", [(16, 16, 32), (32, 16, 32)])
def test_decode_attention_with_a_sliding_window_matches_reference(window, page, block_n, split):
    """Windows inside one split, spanning splits, starting mid-tile and longer than some contexts: the splits
    before the window do no work and the merge starts at the window's first split."""
    lens = [1, 2, split - 1, split + 1, 3 * split + 5, 130, page + 1]
    heads, kv_heads, dim = 4, 2, 32
    k, v, table = _paged(lens, page, kv_heads, dim, torch.float32)
    q = torch.randn(len(lens), heads, dim, generator=torch.Generator().manual_seed(1))
    seqused = torch.tensor(lens, dtype=torch.int32)
    meta = AttentionMetadata(torch.arange(len(lens) + 1, dtype=torch.int32), seqused, table, None, 1,
                             [1] * len(lens), lens)
    ref = TorchAttention().forward(q, k, v, meta, dim ** -0.5, window=window)
    out = paged_decode_attention(q, k, v, seqused, table, dim ** -0.5, base_split=split, block_n=block_n,
                                 window=window)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ref, TorchAttention().forward(q, k, v, meta, dim ** -0.5))


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("softcap", [1.5, 50.0])
def test_both_attention_kernels_cap_scores_as_the_reference(window, softcap):
    """Gemma 2's logit cap, softcap * tanh(score / softcap): scores of q and k scaled up (up to ~10) so that a cap
    of 1.5 bites, where 50 hardly does; with and without a window."""
    query_lens = [37, 1, 20, 1, 5]
    context_lens = [37, 90, 52, 2, 5]
    heads, kv_heads, dim, page = 4, 2, 32, 16
    k, v, table = _paged(context_lens, page, kv_heads, dim, torch.float32)
    q = 3 * torch.randn(sum(query_lens), heads, dim, generator=torch.Generator().manual_seed(8))
    cu = torch.tensor([0, *np.cumsum(query_lens)], dtype=torch.int32)
    seqused = torch.tensor(context_lens, dtype=torch.int32)
    meta = AttentionMetadata(cu, seqused, table, None, max(query_lens), query_lens, context_lens)
    ref = TorchAttention().forward(q, k, v, meta, dim ** -0.5, window=window, softcap=softcap)
    out = paged_prefill_attention(q, k, v, cu, seqused, table, query_blocks(query_lens, 16, q.device),
                                  dim ** -0.5, window=window, softcap=softcap, block_m=16, block_n=16)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    last = cu[1:] - 1  # each sequence's last query token, as a decode step
    decode_meta = AttentionMetadata(torch.arange(len(query_lens) + 1, dtype=torch.int32), seqused, table, None, 1,
                                    [1] * len(query_lens), context_lens)
    out = paged_decode_attention(q[last], k, v, seqused, table, dim ** -0.5, window=window, softcap=softcap,
                                 base_split=32, block_n=16)
    torch.testing.assert_close(out, TorchAttention().forward(q[last], k, v, decode_meta, dim ** -0.5,
                                                             window=window, softcap=softcap), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, ref[last], atol=1e-5, rtol=1e-5)
    if softcap < 2:
        assert not torch.allclose(ref, TorchAttention().forward(q, k, v, meta, dim ** -0.5, window=window))


@pytest.mark.parametrize("window", [None, 6])
def test_both_attention_kernels_add_each_heads_sink_as_the_reference(window):
    """gpt-oss's sinks, one more logit per head in its softmax: prefill, decode in one split and decode merged over
    several, with and without a window, against the reference; a sink of -inf changes nothing and a sink far above
    every score leaves (nearly) no weight to the keys."""
    query_lens = [37, 1, 20, 1, 5]
    context_lens = [37, 90, 52, 2, 5]
    heads, kv_heads, dim, page = 4, 2, 32, 16
    k, v, table = _paged(context_lens, page, kv_heads, dim, torch.float32)
    q = 2 * torch.randn(sum(query_lens), heads, dim, generator=torch.Generator().manual_seed(9))
    sinks = torch.tensor([-1.0, 0.5, 2.0, 4.0])
    cu = torch.tensor([0, *np.cumsum(query_lens)], dtype=torch.int32)
    seqused = torch.tensor(context_lens, dtype=torch.int32)
    meta = AttentionMetadata(cu, seqused, table, None, max(query_lens), query_lens, context_lens)
    ref = TorchAttention().forward(q, k, v, meta, dim ** -0.5, window=window, sinks=sinks)
    plain = TorchAttention().forward(q, k, v, meta, dim ** -0.5, window=window)
    assert not torch.allclose(ref, plain)
    none = torch.full((heads,), float("-inf"))
    torch.testing.assert_close(TorchAttention().forward(q, k, v, meta, dim ** -0.5, window=window, sinks=none), plain)
    assert TorchAttention().forward(q, k, v, meta, dim ** -0.5, window=window, sinks=sinks + 100).abs().max() < 1e-6
    out = paged_prefill_attention(q, k, v, cu, seqused, table, query_blocks(query_lens, 16, q.device),
                                  dim ** -0.5, window=window, sinks=sinks, block_m=16, block_n=16)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    last = cu[1:] - 1
    for split in (32, 128):  # contexts over several splits (merged), then each in one
        out = paged_decode_attention(q[last], k, v, seqused, table, dim ** -0.5, window=window, sinks=sinks,
                                     base_split=split, block_n=16)
        torch.testing.assert_close(out, ref[last], atol=1e-5, rtol=1e-5)


def test_both_attention_kernels_take_a_wide_latent_head():
    """DeepSeek's latent attention: every query head over one KV head wider than 256 (its 576; 288 here, padded to
    512), K and V the same cache, in the 16-token tiles wide heads take, over contexts of one and several splits."""
    query_lens, context_lens = [19, 1, 1], [19, 70, 3]
    heads, dim, page = 8, 288, 16
    k, _, table = _paged(context_lens, page, 1, dim, torch.float32)
    q = torch.randn(sum(query_lens), heads, dim, generator=torch.Generator().manual_seed(3))
    cu = torch.tensor([0, *np.cumsum(query_lens)], dtype=torch.int32)
    seqused = torch.tensor(context_lens, dtype=torch.int32)
    meta = AttentionMetadata(cu, seqused, table, None, max(query_lens), query_lens, context_lens)
    ref = TorchAttention().forward(q, k, k, meta, 0.1)
    from worker_svc.kernels.prefill_attention import block_m_for

    blocks = query_blocks(query_lens, block_m_for(heads, dim), q.device)
    out = paged_prefill_attention(q, k, k, cu, seqused, table, blocks, 0.1)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    last = cu[1:] - 1
    out = paged_decode_attention(q[last], k, k, seqused, table, 0.1, base_split=32)
    torch.testing.assert_close(out, ref[last], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads,rope,latent", [(8, 32, 64), (20, 8, 40)])  # 20 heads: two blocks, one part-full
@pytest.mark.parametrize("block_n,split,block_h", [(16, 32, 16), (32, 128, 32)])
@pytest.mark.parametrize("tma", [False, True])
def test_latent_decode_kernel_matches_the_generic_one_over_the_latent(heads, rope, latent, block_n, split, block_h,
                                                                      tma):
    """DeepSeek's latent attention in decode: the latent kernel's output is the latent's columns of what the reference
    computes with the cache as both K and V, over contexts of one and several splits; rope 8 and latent 40 take
    parts padded inside the kernel (pointer loads then, whatever `tma` asks); the split counters are left zero."""
    from worker_svc.kernels.attention import latent_columns
    from worker_svc.kernels.latent_attention import head_blocks, paged_latent_decode_attention

    context_lens, page = [1, 31, 70, 129], 16
    dim = rope + latent
    cache, _, table = _paged(context_lens, page, 1, dim, torch.float32)
    q = torch.randn(len(context_lens), heads, dim, generator=torch.Generator().manual_seed(5))
    n = len(context_lens)
    meta = AttentionMetadata(torch.arange(n + 1, dtype=torch.int32), torch.tensor(context_lens, dtype=torch.int32),
                             table, None, 1, [1] * n, context_lens)
    ref = TorchAttention().latent(q, cache, meta, 0.1, 1.0, rope)
    assert ref.shape == (n, heads, latent)
    torch.testing.assert_close(ref, latent_columns(TorchAttention().forward(q, cache, cache, meta, 0.1), rope))
    counters = merge_counters(n, head_blocks(heads, block_h), "cpu")
    out = paged_latent_decode_attention(q, cache, meta.seqused_k, table, 0.1, rope, counters=counters,
                                        base_split=split, block_n=block_n, tma=tma, block_h=block_h)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert not counters.any()


@pytest.mark.parametrize("window", [1, 6, 16, 40])
@pytest.mark.parametrize("page,block_m,block_n", [(16, 16, 16), (32, 32, 16)])
def test_prefill_attention_with_a_sliding_window_matches_reference(window, page, block_m, block_n):
    query_lens = [37, 1, 20, 1, block_m, 5, 1]
    context_lens = [37, 90, 20 + 3 * page, 2, block_m + 7, 5, 1]
    heads, kv_heads, dim = 6, 2, 32
    k, v, table = _paged(context_lens, page, kv_heads, dim, torch.float32)
    q = torch.randn(sum(query_lens), heads, dim, generator=torch.Generator().manual_seed(7))
    cu = torch.tensor([0, *np.cumsum(query_lens)], dtype=torch.int32)
    seqused = torch.tensor(context_lens, dtype=torch.int32)
    meta = AttentionMetadata(cu, seqused, table, None, max(query_lens), query_lens, context_lens)
    ref = TorchAttention().forward(q, k, v, meta, dim ** -0.5, window=window)
    out = paged_prefill_attention(q, k, v, cu, seqused, table, query_blocks(query_lens, block_m, q.device),
                                  dim ** -0.5, window=window, block_m=block_m, block_n=block_n)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_fused_store_into_one_plane_keeps_the_rotated_k():
    """Latent attention's cache: V is K (the same memory), so the store writes K alone, rotated, in the kernel and in
    the reference; a V written after it would have put the unrotated values back."""
    from worker_svc.kernels import reference

    gen = torch.Generator().manual_seed(4)
    tokens, heads, dim = 5, 4, 32
    rotary = RotaryEmbedding(dim, 64, 1e4, rotary_dim=8)
    qkv = torch.randn(tokens, (heads + 2) * dim, generator=gen)
    qkv[:, (heads + 1) * dim:] = qkv[:, heads * dim:(heads + 1) * dim]  # V's part: K's values, as MLA passes them
    positions, slots = torch.arange(3, 3 + tokens), torch.tensor([9, 2, 14, 5, 0])
    planes = [torch.zeros(4, 4, 1, dim), torch.zeros(4, 4, 1, dim)]
    reference.qk_norm_rope_store(qkv, positions, rotary.cos_sin, None, None, 1e-6, *planes, slots, heads, 1)
    for store in (elementwise.qk_norm_rope_store, reference.qk_norm_rope_store):
        cache = torch.zeros(4, 4, 1, dim)
        store(qkv, positions, rotary.cos_sin, None, None, 1e-6, cache, cache, slots, heads, 1)
        torch.testing.assert_close(cache, planes[0], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(planes[0], planes[1])  # rope turned K's first dims


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 32), (6, 2, 24), (8, 8, 32)])
@pytest.mark.parametrize("norm", [True, False])
def test_fused_qk_norm_rope_store_matches_eager_pieces(dtype, heads, kv_heads, dim, norm):
    gen = torch.Generator().manual_seed(3)
    tokens, page, blocks = 9, 4, 8
    rotary = RotaryEmbedding(dim, 128, 1e6)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    positions = torch.randint(0, 128, (tokens,), generator=gen)
    q_w = (torch.rand(dim, generator=gen) + 0.5).to(dtype) if norm else None  # without: Llama, Qwen2, Mistral
    k_w = (torch.rand(dim, generator=gen) + 0.5).to(dtype) if norm else None
    slots = torch.randperm(blocks * page, generator=gen)[:tokens]
    k_cache = torch.zeros(blocks, page, kv_heads, dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    q = qk_norm_rope_store(qkv, positions, rotary.cos_sin, q_w, k_w, 1e-6, k_cache, v_cache, slots, heads, kv_heads)
    q_in, k_in, v_in = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q_ref, k_new = qk_norm_rope(q_in.reshape(tokens, heads, dim), k_in.reshape(tokens, kv_heads, dim), positions,
                                rotary.cos_sin, q_w, k_w, 1e-6)
    store_kv(k_new, v_in.reshape(tokens, kv_heads, dim), k_ref, v_ref, slots)
    tol = 1e-6 if dtype == torch.float32 else 0.0  # float16 rounds where the eager pieces round
    torch.testing.assert_close(q, q_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(k_cache, k_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(v_cache, v_ref, atol=0.0, rtol=0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # the interpreter truncates to bfloat16
@pytest.mark.parametrize("hidden", [64, 96])  # 96: a row narrower than its power-of-two block
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_kernel_matches_eager(dtype, hidden, with_residual):
    gen = torch.Generator().manual_seed(5)
    norm = RMSNorm(hidden, 1e-6, kernels.select("cpu")).to(dtype)
    norm.weight.copy_(torch.rand(hidden, generator=gen) + 0.5)
    wide = torch.randn(7, hidden + 8, generator=gen).to(dtype) * 3
    x = wide[:, :hidden]  # a row stride wider than the row, as a slice of a larger buffer
    residual = torch.randn(7, hidden, generator=gen).to(dtype) if with_residual else None
    got = elementwise.rms_norm(x, norm.weight, norm.eps, residual)
    want = norm(x, residual)
    tol = 1e-6 if dtype == torch.float32 else 0.0  # 16-bit: rounds where the eager pieces round
    if with_residual:
        torch.testing.assert_close(got[1], want[1], atol=0.0, rtol=0.0)
        got, want = got[0], want[0]
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # the interpreter truncates to bfloat16
@pytest.mark.parametrize("n", [48, 1500])  # 1500: more than one 1024-column block per row
@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_gated_activation_kernels_match_eager(dtype, n, act):
    from worker_svc.kernels import reference

    gen = torch.Generator().manual_seed(6)
    x = torch.randn(5, 2 * n, generator=gen).to(dtype) * 4
    # float16 rounds where the eager pieces round, but exp may differ from torch's in its last float32 bit,
    # which can move a rounding by one unit (2**-10); the kernel's tanh, from exp, is a few float32 units
    # from torch's
    tol = (1e-6 if act == "silu" else 1e-5) if dtype == torch.float32 else 2 ** -10
    fast, eager = getattr(elementwise, f"{act}_and_mul"), getattr(reference, f"{act}_and_mul")
    torch.testing.assert_close(fast(x), eager(x), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_clamped_swiglu_kernel_matches_eager(dtype):
    """gpt-oss's activation, values of |x| up to ~16 so that both clamps (at 3 here) bite; float32 inside the kernel,
    so float16 rounds once where the eager pieces round at each op."""
    from worker_svc.kernels import reference

    x = (torch.randn(7, 2 * 1100, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)
    want = reference.clamped_swiglu(x.float(), 3.0).to(dtype)
    torch.testing.assert_close(elementwise.clamped_swiglu(x, 3.0), want, atol=1e-5, rtol=1e-5 if dtype == torch.float32
                               else 2 ** -9)
    assert not torch.allclose(want, reference.clamped_swiglu(x.float(), 100.0).to(dtype))


def test_gumbel_argmax_matches_torch_sampler_and_breaks_ties_low():
    gen = torch.Generator().manual_seed(4)
    rows, vocab = 6, 5000
    logits = torch.randn(rows, vocab, generator=gen) * 3
    temperature = torch.tensor([0.0, 0.6, 1.0, 1.5, 0.0, 0.3])
    # the kernel derives each row's key from the whole 64-bit seed, as sampler.row_keys does
    seeds = torch.randint(-2**62, 2**62, (rows,), generator=gen)
    positions = torch.randint(0, 100, (rows,), generator=gen)
    tokens = gumbel_argmax(logits, temperature, seeds, positions, parts=4, block=256)
    x = logits / torch.where(temperature > 0, temperature, 1.0)[:, None]
    race = x - torch.log(-torch.log(uniform_noise(seeds, positions, vocab)))
    assert torch.equal(tokens, torch.where(temperature > 0, race.argmax(-1), logits.argmax(-1)))
    tied = torch.zeros(2, 1000)
    tied[:, [300, 700]] = 5.0  # equal maxima in different parts: the lower index, as torch.argmax
    assert gumbel_argmax(tied, torch.zeros(2), seeds[:2], positions[:2], parts=4, block=64).tolist() == [300, 300]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 5, 16, 33, 64])
@pytest.mark.parametrize("n,k,block_n,block_k", [(100, 256, 16, 128), (96, 384, 32, 128), (64, 512, 64, 256)])
def test_skinny_gemm_matches_linear(dtype, rows, n, k, block_n, block_k):
    """Ragged N (masked columns), several K tiles, row counts padded to 16, 64."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
    y = skinny_linear(x, w, BLOCK_N=block_n, BLOCK_K=block_k, num_stages=2, num_warps=4)
    assert y.dtype == dtype and y.shape == (rows, n)
    tol = 1e-4 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(y.float(), torch.nn.functional.linear(x.float(), w.float()), atol=tol, rtol=tol)


def test_skinny_gemm_takes_a_row_slice_of_a_wider_buffer():
    """Decode graphs hand the projections row slices of static buffers: stride(0) is the buffer's."""
    gen = torch.Generator().manual_seed(3)
    buffer, w = torch.randn(8, 256, generator=gen), torch.randn(48, 128, generator=gen)
    x = buffer[:3, 64:192]
    torch.testing.assert_close(skinny_linear(x, w, BLOCK_N=16, BLOCK_K=128), x @ w.T, atol=1e-4, rtol=1e-4)


def test_fp8_input_quantiser_matches_the_reference():
    """FP8 projections' input (kernels/fp8_gemm.py): each 1 x 128 group's scale as the reference computes it, the
    scales laid out as cuBLAS reads them, rows padded to 4 with zeros of scale 1. The interpreter's float32 -> e4m3
    conversion rounds some values just under a power of two down a binade (124.3 -> 64 where the GPU gives 128), so
    the codes are compared on the GPU (tests/gpu/test_gpu_fp8_linear.py)."""
    from worker_svc.kernels import fp8_gemm, reference

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 384, generator=gen) * torch.tensor([1.0, 50.0, 1e-3]).repeat_interleave(128)
    q, scale = fp8_gemm.quantize_rows(x)
    q_ref, scale_ref = reference.quantize_rows(x)
    assert q.shape == (8, 384) and scale.shape == (8, 3) and scale.stride() == (1, 8)
    torch.testing.assert_close(scale[:5], scale_ref, rtol=0, atol=0)
    assert scale[5:].eq(1).all() and q[5:].float().eq(0).all()
    assert (q[:5].view(torch.uint8) == q_ref.view(torch.uint8)).float().mean() > 0.9


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("page,block_m,block_n", [(16, 16, 16), (16, 16, 32), (32, 32, 16)])
@pytest.mark.parametrize("heads,kv_heads,dim", HEAD_SHAPES)
def test_prefill_attention_matches_reference(dtype, page, block_m, block_n, heads, kv_heads, dim):
    """A mixed step: a whole prompt, chunks over cached prefixes (one ending mid-block), decodes, a
    one-token chunk; query blocks that end inside a sequence and blocks of one token."""
    query_lens = [37, 1, 20, 1, block_m, 5, 1]
    context_lens = [37, 90, 20 + 3 * page, 2, block_m + 7, 5, 1]
    k, v, table = _paged(context_lens, page, kv_heads, dim, dtype)
    q = torch.randn(sum(query_lens), heads, dim, generator=torch.Generator().manual_seed(7)).to(dtype)
    cu = torch.tensor([0, *np.cumsum(query_lens)], dtype=torch.int32)
    seqused = torch.tensor(context_lens, dtype=torch.int32)
    meta = AttentionMetadata(cu, seqused, table, None, max(query_lens), query_lens, context_lens)
    ref = TorchAttention().forward(q.float(), k.float(), v.float(), meta, dim ** -0.5)
    blocks = query_blocks(query_lens, block_m, q.device)
    out = paged_prefill_attention(q, k, v, cu, seqused, table, blocks, dim ** -0.5, block_m=block_m,
                                  block_n=block_n)
    assert out.dtype == dtype and out.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("page,block_m,block_n", [(16, 16, 16), (16, 16, 32)])
def test_encoder_prefill_attention_sees_every_key_of_its_sequence(page, block_m, block_n):
    """An encoder's step (meta.causal False): whole sequences, each query over every key of its own sequence,
    against the reference; and not what the causal kernel computes."""
    query_lens = [37, 1, 20, block_m, 5]
    k, v, table = _paged(query_lens, page, 2, 32, torch.float32)
    q = torch.randn(sum(query_lens), 4, 32, generator=torch.Generator().manual_seed(7))
    cu = torch.tensor([0, *np.cumsum(query_lens)], dtype=torch.int32)
    seqused = torch.tensor(query_lens, dtype=torch.int32)
    meta = AttentionMetadata(cu, seqused, table, None, max(query_lens), query_lens, query_lens, causal=False)
    ref = TorchAttention().forward(q, k, v, meta, 32 ** -0.5)
    blocks = query_blocks(query_lens, block_m, q.device)
    out = paged_prefill_attention(q, k, v, cu, seqused, table, blocks, 32 ** -0.5, block_m=block_m, block_n=block_n,
                                  causal=False)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    causal = paged_prefill_attention(q, k, v, cu, seqused, table, blocks, 32 ** -0.5, block_m=block_m,
                                     block_n=block_n)
    assert not torch.allclose(causal[:37], out[:37], atol=1e-3)  # the first sequence's early queries saw more keys
    torch.testing.assert_close(causal[37:38], out[37:38])  # a one-token sequence sees itself either way


# ---- fp8 KV cache: e4m3 values with a scale per tensor, read by both attention kernels --------------------

FP8 = torch.float8_e4m3fn
K_SCALE, V_SCALE = 0.75, 2.5  # scales other than 1, so that a scale applied twice or not at all shows


def _fp8(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (k.float() * 4 / K_SCALE).to(FP8), (v.float() * 4 / V_SCALE).to(FP8)  # values spread over e4m3


def _dequantised(k8: torch.Tensor, v8: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return k8.float() * K_SCALE, v8.float() * V_SCALE


# q float32 (the CPU models) or 16-bit (fp16 here; bf16, which the interpreter lacks, is checked on the GPU)
FP8_Q = [(torch.float32, 1e-5), (torch.float16, 2e-3)]


@pytest.mark.parametrize("cache", [torch.float32, FP8])
@pytest.mark.parametrize("page,block_n,split,window", [(16, 16, 32, None), (64, 64, 128, None), (64, 32, 64, 45)])
def test_decode_attention_tiles_loaded_by_tma_equal_pointer_loads(cache, page, block_n, split, window, monkeypatch):
    """TMA tiles (tile_config's choice over an fp8 cache) hold rows past the context or before the window as
    stored, where pointer loads read zeros; the kernel weighs those rows 0, so both give the same bits."""
    from worker_svc.kernels import decode_attention

    described = []  # the caches TMA descriptors were made for: proof that the TMA path ran
    monkeypatch.setattr(decode_attention, "TensorDescriptor",
                        lambda base, *a: described.append(base) or TensorDescriptor(base, *a))
    lens = [1, block_n - 1, block_n + 1, split, 3 * split + 5, 200, 17, 90, 130, 2]  # 10 sequences: past tile 8's
    dim, heads, kv_heads = 128, 6, 2  # TMA takes heads of 128 only
    k, v, table = _paged(lens, page, kv_heads, dim, torch.float32)
    if cache == FP8:
        k, v = _fp8(k, v)
    narrow = k[..., :64].contiguous()
    assert tma_fits(k, v, block_n) and not tma_fits(narrow, narrow, block_n)
    q = torch.randn(len(lens), heads, dim, generator=torch.Generator().manual_seed(3))
    seqused = torch.tensor(lens, dtype=torch.int32)
    kw = dict(base_split=split, block_n=block_n, window=window, k_scale=K_SCALE, v_scale=V_SCALE)
    loaded = paged_decode_attention(q, k, v, seqused, table, dim ** -0.5, tma=True, **kw)
    assert len(described) == 2
    torch.testing.assert_close(loaded, paged_decode_attention(q, k, v, seqused, table, dim ** -0.5, tma=False, **kw),
                               atol=0.0, rtol=0.0)
    assert len(described) == 2
    if cache == FP8 and window is None and page >= 64:  # the tiles and TMA an fp8 cache gets by default
        torch.testing.assert_close(paged_decode_attention(q, k, v, seqused, table, dim ** -0.5, k_scale=K_SCALE,
                                                          v_scale=V_SCALE), loaded, atol=1e-5, rtol=1e-5)
        assert len(described) == 4


@pytest.mark.parametrize("tma", [True, False])
@pytest.mark.parametrize("q_size", [1.0, 1e6])
def test_decode_attention_with_fp16_dots_takes_q_into_fp16_range(q_size, tma):
    """f16_dots: q scaled by a power of two into fp16's range (1e6 is past its 65,504) and back onto the scores;
    the error is fp16's rounding of q and p, against float32 dots here (bf16's on the GPU is larger). Tiles by
    TMA (heads of 128) or by pointer loads (Gemma 3's 256, and caches TMA does not fit)."""
    lens = [1, 63, 65, 300, 130, 17, 90, 200, 2, 40]
    dim, heads, kv_heads, page = 128, 4, 2, 64
    k, v, table = _paged(lens, page, kv_heads, dim, torch.float32)
    k8, v8 = _fp8(k, v)
    q = torch.randn(len(lens), heads, dim, generator=torch.Generator().manual_seed(4)) * q_size
    seqused = torch.tensor(lens, dtype=torch.int32)
    meta = AttentionMetadata(torch.arange(len(lens) + 1, dtype=torch.int32), seqused, table, None, 1,
                             [1] * len(lens), lens)
    scale = dim ** -0.5 / q_size
    ref = TorchAttention().forward(q, *_dequantised(k8, v8), meta, scale)
    out = paged_decode_attention(q, k8, v8, seqused, table, scale, k_scale=K_SCALE, v_scale=V_SCALE, f16_dots=True,
                                 tma=tma)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("dtype,tol", FP8_Q)
@pytest.mark.parametrize("page,block_n,split", [(16, 16, 32), (32, 16, 32)])
def test_decode_attention_reads_an_fp8_cache_with_its_scales(page, block_n, split, dtype, tol):
    lens = [1, split - 1, split + 1, 3 * split + 5]
    dim, heads, kv_heads = 32, 4, 2
    k, v, table = _paged(lens, page, kv_heads, dim, torch.float32)
    k8, v8 = _fp8(k, v)
    q = torch.randn(len(lens), heads, dim, generator=torch.Generator().manual_seed(1))
    seqused = torch.tensor(lens, dtype=torch.int32)
    meta = AttentionMetadata(torch.arange(len(lens) + 1, dtype=torch.int32), seqused, table, None, 1,
                             [1] * len(lens), lens)
    ref = TorchAttention().forward(q.to(dtype).float(), *_dequantised(k8, v8), meta, dim ** -0.5)
    out = paged_decode_attention(q.to(dtype), k8, v8, seqused, table, dim ** -0.5, k_scale=K_SCALE,
                                 v_scale=V_SCALE, base_split=split, block_n=block_n)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(TorchAttention().forward(q, k8, v8, meta, dim ** -0.5, K_SCALE, V_SCALE),
                               TorchAttention().forward(q, *_dequantised(k8, v8), meta, dim ** -0.5),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,tol", FP8_Q)
def test_prefill_attention_reads_an_fp8_cache_with_its_scales(dtype, tol):
    query_lens, context_lens = [37, 1, 20, 5], [37, 90, 68, 5]
    dim, heads, kv_heads, page = 32, 4, 2, 16
    k, v, table = _paged(context_lens, page, kv_heads, dim, torch.float32)
    k8, v8 = _fp8(k, v)
    q = torch.randn(sum(query_lens), heads, dim, generator=torch.Generator().manual_seed(7))
    cu = torch.tensor([0, *np.cumsum(query_lens)], dtype=torch.int32)
    seqused = torch.tensor(context_lens, dtype=torch.int32)
    meta = AttentionMetadata(cu, seqused, table, None, max(query_lens), query_lens, context_lens)
    ref = TorchAttention().forward(q.to(dtype).float(), *_dequantised(k8, v8), meta, dim ** -0.5)
    out = paged_prefill_attention(q.to(dtype), k8, v8, cu, seqused, table, query_blocks(query_lens, 16, q.device),
                                  dim ** -0.5, k_scale=K_SCALE, v_scale=V_SCALE, block_m=16, block_n=16)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(TorchAttention().forward(q, k8, v8, meta, dim ** -0.5, K_SCALE, V_SCALE),
                               TorchAttention().forward(q, *_dequantised(k8, v8), meta, dim ** -0.5),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_qk_norm_rope_store_quantises_into_an_fp8_cache_as_the_reference(dtype, faithful_fp8):
    gen = torch.Generator().manual_seed(4)
    heads, kv_heads, dim, tokens, page, blocks = 4, 2, 32, 9, 4, 8
    rotary = RotaryEmbedding(dim, 128, 1e6)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen) * 3).to(dtype)
    positions = torch.randint(0, 128, (tokens,), generator=gen)
    q_w = (torch.rand(dim, generator=gen) + 0.5).to(dtype)
    k_w = (torch.rand(dim, generator=gen) + 0.5).to(dtype)
    slots = torch.randperm(blocks * page, generator=gen)[:tokens]
    k_cache = torch.zeros(blocks, page, kv_heads, dim, dtype=FP8)
    v_cache = torch.zeros_like(k_cache)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    q = qk_norm_rope_store(qkv, positions, rotary.cos_sin, q_w, k_w, 1e-6, k_cache, v_cache, slots, heads, kv_heads,
                           k_scale=K_SCALE, v_scale=V_SCALE)
    from worker_svc.kernels import reference

    q_ref = reference.qk_norm_rope_store(qkv, positions, rotary.cos_sin, q_w, k_w, 1e-6, k_ref, v_ref, slots, heads,
                                         kv_heads, k_scale=K_SCALE, v_scale=V_SCALE)
    assert q.dtype == dtype and k_cache.dtype == FP8
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(q, q_ref, atol=tol, rtol=tol)
    # the rope's last bit may differ (as q's may), and so land one e4m3 step away at a rounding boundary
    step = (k_cache.float() - k_ref.float()).abs() / k_ref.float().abs().clamp_min(2 ** -6)
    assert float(step.max()) <= 0.125 and float((k_cache.float() != k_ref.float()).float().mean()) < 0.02
    assert torch.equal(v_cache.view(torch.uint8), v_ref.view(torch.uint8))
    assert float(k_cache.float().abs().sum()) > 0 and int((v_cache.float() != 0).sum()) >= tokens * kv_heads * dim // 2


def test_query_blocks_cover_every_token_once():
    seqs, starts = query_blocks([5, 1, 0, 16, 17], 16, torch.device("cpu"))
    assert seqs.tolist() == [0, 1, 3, 4, 4] and starts.tolist() == [0, 0, 0, 0, 16]


@pytest.mark.parametrize("preset", ["qwen3-tiny", "llama-tiny", "mistral-tiny", "gemma3-tiny", "phi3-tiny",
                                    "gemma2-tiny", "phi4-mini-tiny", "smollm3-tiny", "glm4-tiny", "gpt-oss-tiny",
                                    "deepseek-v2-tiny", "cohere2-tiny", "cohere-tiny", "starcoder2-tiny",
                                    "nemotron-tiny"])
def test_runner_on_the_triton_backend_matches_the_torch_backend(preset, tmp_path):
    """The triton backend inside a ModelRunner (the interpreter on the CPU): chunked prefills, decodes
    beside them, blocks out of order; greedy tokens equal the torch backend's. For Qwen3 (q/k norms), Llama
    (none, biases, scaled rope), Mistral (a sliding window of 24 under prompts of up to 48 tokens), Gemma 3
    (windows of 16 on some layers only), Phi-3 (heads of 24, padded to 32 in the kernels, as Phi-3-mini's
    96), Gemma 2 (attention scores capped at 5), Phi-4-mini (rope over 24 of 32 dims: a table whose last
    columns turn by 0), SmolLM3 (layers without rope: a table that turns nothing), GLM-4 (rope over half of each
    head, on neighbouring dims: rows reordered at load), gpt-oss (a sink per head, windows of 16 on some layers) and
    DeepSeek-V2 (latent attention cached per head: heads of 24, rope over 8 of them, V padded to K's width). The KV
    cache starts as NaN: a kernel that read a slot no step wrote (a masked score times a garbage V) would show."""
    from worker_svc.checkpoints.writer import make_model
    from tests.paged_driver import PagedDriver
    from worker_svc.runtime.model_runner import ModelRunner, RunnerConfig

    model_dir = make_model(preset, tmp_path / preset)
    prompts = [[(11 * i + 3 * j) % 1000 for j in range(9 + 13 * i)] for i in range(4)]
    outs = []
    for attention in ("triton", "torch"):
        runner = ModelRunner(model_dir, RunnerConfig(num_blocks=64, limits=Limits(max_model_len=256),
                                                          attention=attention))
        assert runner.kernels.attention.name == attention
        runner.kv_cache.fill_(float("nan"))
        driver = PagedDriver(runner, chunk=7, shuffle_seed=1)
        seqs = [driver.add(p, 5) for p in prompts]
        driver.run_all()
        outs.append([s.generated for s in seqs])
    assert outs[0] == outs[1]


# ---- fused mixture of experts ------------------------------------------------------------------------------
def _table_block_ms() -> list[int]:
    from worker_svc.kernels import moe

    return sorted({c.block_m for table in moe.HOPPER_CONFIGS.values() for c in table.values()}
                  | {16, 64})  # 16 and 64: default_config's


@pytest.mark.parametrize("block_m", _table_block_ms())
@pytest.mark.parametrize("tokens,top_k,experts,first,local", [(13, 2, 8, 0, 8), (70, 4, 8, 0, 8), (1, 2, 4, 0, 4),
                                                             (40, 2, 8, 4, 4), (300, 2, 4, 0, 4)])
def test_fused_moe_matches_the_loop_over_experts(tokens, top_k, experts, first, local, block_m):
    """Every block size of the tables, a single token, and a rank holding experts 4..7 of 8 (tensor
    parallelism): slots routed elsewhere give zero."""
    from worker_svc.kernels import moe, reference

    x, w13, w2, topk_weights, topk_ids = moe_inputs(tokens, top_k, experts, local, 32, 24, seed=tokens)
    ref = reference.fused_moe(x, w13, w2, topk_weights, topk_ids, first)
    out = moe.fused_moe(x, w13, w2, topk_weights, topk_ids, first, moe.MoeConfig(block_m))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    if first:
        assert (ref[(topk_ids < first).all(-1)] == 0).all()


@pytest.mark.parametrize("tokens,top_k,experts,first,local", [(13, 2, 8, 0, 8), (40, 4, 8, 4, 4)])
def test_fused_moe_with_biases_and_the_clamped_swiglu_matches_the_loop(tokens, top_k, experts, first, local):
    """gpt-oss's experts: a bias on gate_up and on down (before the routing weight), the clamped SwiGLU."""
    import functools

    from worker_svc.kernels import moe, reference

    x, w13, w2, topk_weights, topk_ids = moe_inputs(tokens, top_k, experts, local, 32, 24, seed=tokens)
    gen = torch.Generator().manual_seed(5)
    b13, b2 = torch.randn(local, 48, generator=gen), torch.randn(local, 32, generator=gen)
    ref = reference.fused_moe(x, w13, w2, topk_weights, topk_ids, first, b13=b13, b2=b2,
                              act=functools.partial(reference.clamped_swiglu, limit=1.0))
    out = moe.fused_moe(x, w13, w2, topk_weights, topk_ids, first, moe.MoeConfig(16), b13=b13, b2=b2,
                        act=functools.partial(elementwise.clamped_swiglu, limit=1.0))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ref, reference.fused_moe(x, w13, w2, topk_weights, topk_ids, first))


@pytest.mark.parametrize("block_m,tiles", [(16, Tiles(64, 64)), (16, Tiles(256, 128)), (64, Tiles(128, 128, 4)),
                                           (16, Tiles(32, 256))],
                         ids=["tiles of half a block", "N tiles of two blocks", "fp8_config's tiles of 64 x 256",
                              "K tiles capped at a block"])
@pytest.mark.parametrize("tokens,top_k,experts,first,local", [(13, 2, 8, 0, 8), (40, 4, 8, 4, 4)])
def test_fused_moe_over_fp8_experts_matches_the_loop_of_fp8_linears(tokens, top_k, experts, first, local, block_m,
                                                                    tiles, faithful_fp8):
    """The experts' weights in e4m3 with a scale per 128 x 128 block (model/quantized.py) and each GEMM's input
    quantised per row and 128 columns: each grouped GEMM's e4m3 products times both scales equal the reference's
    fp8_linear of every slot over the dequantised codes (the down GEMM fed the reference's SwiGLU output, since one
    input a rounding apart may take the next code); the whole fused MoE is within FP8's error of the 16-bit
    experts, and not equal to them."""
    import functools

    from worker_svc.kernels import moe, reference
    from worker_svc.model.quantized import quantize_blocks

    x, w13, w2, topk_weights, topk_ids = moe_inputs(tokens, top_k, experts, local, 256, 128, seed=tokens)
    (q13, s13), (q2, s2) = (map(torch.stack, zip(*(quantize_blocks(w) for w in ws))) for ws in (w13, w2))
    slots = [(s, e) for s, e in enumerate(topk_ids.flatten().tolist()) if first <= e < first + local]
    inter = torch.zeros(tokens * top_k, 2 * 128)
    for s, e in slots:
        inter[s] = reference.fp8_linear(x[s // top_k], q13[e - first], s13[e - first])
    sorted_slots, block_expert = moe.align(topk_ids, first, local, block_m)
    gemm = functools.partial(moe.grouped_gemm, sorted_slots=sorted_slots, block_expert=block_expert, top_k=top_k,
                             block_m=block_m, tiles=tiles)
    live = [s for s, _ in slots]
    out = gemm(x, q13, weights=None, per_slot=False, scale=s13)
    torch.testing.assert_close(out[live], inter[live], atol=1e-5, rtol=1e-5)
    act = reference.silu_and_mul(inter)
    out = gemm(act, q2, weights=topk_weights.flatten(), per_slot=True, scale=s2)
    for s, e in slots:
        expected = reference.fp8_linear(act[s], q2[e - first], s2[e - first]) * topk_weights.flatten()[s]
        torch.testing.assert_close(out[s], expected, atol=1e-5, rtol=1e-5)

    fused = moe.fused_moe(x, q13, q2, topk_weights, topk_ids, first, moe.MoeConfig(block_m, tiles, tiles), s13=s13,
                          s2=s2)
    exact = reference.fused_moe(x, w13, w2, topk_weights, topk_ids, first)
    assert 1e-3 < (fused - exact).abs().max() < 0.1 * exact.abs().max()
    torch.testing.assert_close(fused, reference.fused_moe(x, q13, q2, topk_weights, topk_ids, first, s13=s13, s2=s2),
                               atol=0.02 * exact.abs().max().item(), rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (13, 128, 8), (40, 6, 3), (17, 60, 4), (5, 4, 4)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_router_topk_kernel_matches_the_torch_choice(dtype, tokens, experts, top_k, renormalize):
    """Softmax, top-k and renormalisation in one kernel: the same experts in the same order as torch.topk over
    random logits, and a valid choice (checked without torch's order) where logits are equal: the lowest index
    first among equals."""
    from worker_svc.kernels import moe, reference

    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(tokens)).to(dtype)
    weights, ids = moe.router_topk(logits, top_k, renormalize)
    ref_weights, ref_ids = reference.router_topk(logits, top_k, renormalize)
    assert weights.dtype == ref_weights.dtype == dtype and ids.dtype == ref_ids.dtype == torch.int64
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, atol=1e-3, rtol=1e-3)
    check_router_choice(logits, weights, ids, renormalize, 1e-3)
    tied = logits.round()  # many equal logits
    weights, ids = moe.router_topk(tied, top_k, renormalize)
    check_router_choice(tied, weights, ids, renormalize, 1e-3)
    for row, row_ids in zip(tied, ids):
        for a, b in zip(row_ids[:-1].tolist(), row_ids[1:].tolist()):
            assert row[a] > row[b] or a < b


@pytest.mark.parametrize("sigmoid", [True, False])
@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (13, 128, 8), (17, 60, 4)])
@pytest.mark.parametrize("per_token", [False, True])
def test_router_topk_kernel_with_a_bias_matches_the_torch_choice(sigmoid, tokens, experts, top_k, per_token):
    """DeepSeek-V3's choice (GLM-4.5's, ERNIE 4.5's) in the same kernel: the experts by sigmoid (or softmax) score
    plus a bias, weighted by their scores, renormalised and scaled, as the torch reference; a per-token bias of -inf
    keeps a token off those experts (how expert groups reach it)."""
    from worker_svc.kernels import moe, reference

    gen = torch.Generator().manual_seed(tokens + experts)
    logits = torch.randn(tokens, experts, generator=gen)
    bias = torch.randn(experts, generator=gen) * 0.1
    if per_token:
        bias = bias.expand(tokens, experts).clone()
        bias[:, ::3] = float("-inf")
    weights, ids = moe.router_topk(logits, top_k, True, sigmoid=sigmoid, bias=bias, scale=2.5)
    ref_weights, ref_ids = reference.router_topk(logits, top_k, True, sigmoid=sigmoid, bias=bias, scale=2.5)
    assert weights.dtype == ref_weights.dtype == torch.float32 and torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weights.sum(-1), torch.full((tokens,), 2.5))
    if per_token:
        assert not (ids % 3 == 0).any()


def test_fused_moe_takes_its_tiles_from_moe_config():
    from worker_svc.kernels import moe

    x, w13, w2, topk_weights, topk_ids = moe_inputs(9, 2, 4, 4, 32, 24, seed=1)
    assert moe.hopper_table(32, 24, x.dtype, x.device) is None  # a CPU: no measured table
    assert moe.moe_config(9, 2, None) == moe.default_config(9, 2)
    chosen = moe.fused_moe(x, w13, w2, topk_weights, topk_ids, 0, moe.moe_config(9, 2, None))
    assert torch.equal(moe.fused_moe(x, w13, w2, topk_weights, topk_ids), chosen)


def _other_tiles(t):
    """Tiles that differ from t in every field."""
    from worker_svc.kernels.moe import Tiles

    return Tiles(128 if t.block_n != 128 else 32, 128 if t.block_k != 128 else 64, 8 if t.num_warps == 4 else 4,
                 2 if t.num_stages != 2 else 4)


def _table_cases() -> list:
    from worker_svc.kernels.moe import HOPPER_CONFIGS, MoeConfig

    cases = []
    for (hidden, inter), table in HOPPER_CONFIGS.items():
        for key, c in sorted(table.items()):
            cases.append(pytest.param(c, id=f"{hidden}x{inter}-{key}"))
            cases.append(pytest.param(MoeConfig(c.block_m, _other_tiles(c.gate_up), _other_tiles(c.down)),
                                      id=f"{hidden}x{inter}-{key}-other-tiles"))
    return cases


@pytest.mark.parametrize("config", _table_cases())
def test_every_moe_table_config_matches_the_loop(config):
    """Each entry of HOPPER_CONFIGS, and other tiles at its block size, at shapes no smaller than the tiles
    (none is narrowed): 4 experts, top 2, hidden and intermediate 256, experts past one block of 16 rows."""
    from worker_svc.kernels import moe, reference

    for t in (config.gate_up, config.down):
        assert max(t.block_n, t.block_k) <= 256, t  # the widest these shapes keep as they are
    x, w13, w2, topk_weights, topk_ids = moe_inputs(24, 2, 4, 4, 256, 256, seed=config.block_m)
    ref = reference.fused_moe(x, w13, w2, topk_weights, topk_ids)
    torch.testing.assert_close(moe.fused_moe(x, w13, w2, topk_weights, topk_ids, 0, config), ref,
                               atol=1e-4, rtol=1e-4)


def _every_table() -> list:
    """Each measured table (16-bit and FP8) and each 16-bit one's tiles made to fit e4m3 experts."""
    from worker_svc.kernels import moe

    return [*moe.HOPPER_CONFIGS.values(), *moe.HOPPER_FP8_CONFIGS.values(),
            *({k: moe.fp8_config(c) for k, c in t.items()} for t in moe.HOPPER_CONFIGS.values())]


def test_moe_tables_serve_every_token_count_by_cuda_graph_batch_sizes():
    """Keys are CUDA-graph batch sizes (a batch and its graph's padded batch take the same tiles), tiles are
    powers of two tl.dot takes, and a count takes the entry of the smallest key at or above it."""
    from worker_svc.kernels import moe

    for table in _every_table():
        assert all(k in (1, 2, 4, 8) or k % 16 == 0 for k in table)
        for c in table.values():
            assert c.block_m in (16, 32, 64, 128)
            for t in (c.gate_up, c.down):
                assert all(v >= 16 and v & (v - 1) == 0 for v in (t.block_n, t.block_k)) and t.num_warps in (4, 8)
        keys = sorted(table)
        for i, key in enumerate(keys):
            assert moe.lookup(table, key) is table[key]
            if i:
                assert moe.lookup(table, keys[i - 1] + 1) is table[key]
        assert moe.lookup(table, keys[-1] * 4) is table[keys[-1]]


@pytest.mark.parametrize("hopper", [True, False])
def test_moe_tables_are_chosen_by_expert_shape_device_and_dtype(monkeypatch, hopper):
    """A measured table where its shape runs in 16 bits on a Hopper GPU; else none (default_config): float32's
    tiles would ask twice the shared memory the table's were measured in."""
    from worker_svc.kernels import moe

    monkeypatch.setattr(moe, "_is_hopper", lambda index: hopper)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    for (hidden, inter), table in moe.HOPPER_CONFIGS.items():
        for dtype in (torch.bfloat16, torch.float16):
            assert moe.hopper_table(hidden, inter, dtype, cuda) is (table if hopper else None)
        assert moe.hopper_table(hidden, inter, torch.float32, cuda) is None
        assert moe.hopper_table(hidden, inter, torch.bfloat16, cpu) is None
        fp8 = moe.hopper_table(hidden, inter, torch.bfloat16, cuda, fp8=True)
        measured = moe.HOPPER_FP8_CONFIGS.get((hidden, inter))
        assert fp8 == (None if not hopper else measured or {k: moe.fp8_config(c) for k, c in table.items()})
    assert moe.hopper_table(4096, 1536, torch.bfloat16, cuda) is None  # Qwen3-235B-A22B: not measured
    assert moe.hopper_table(4096, 1536, torch.bfloat16, cuda, fp8=True) is None


def test_fp8_config_takes_k_tiles_of_a_block_and_narrows_n_tiles_until_they_fit():
    """e4m3 experts: a K tile is one block of scales, and BLOCK_M x BLOCK_N stays within 64 fp32 values a thread
    (the scaled product's registers beside the accumulator's); tiles that fit keep their width, warps and stages."""
    from worker_svc.kernels.moe import MoeConfig, Tiles, fp8_config

    wide = fp8_config(MoeConfig(128, Tiles(256, 64, 8, 4), Tiles(256, 64, 4, 3)))
    assert wide == MoeConfig(128, Tiles(128, 128, 8, 4), Tiles(64, 128, 4, 3))
    assert fp8_config(MoeConfig(16, Tiles(32, 256, 4, 5), Tiles(128, 64, 4, 2))) == \
        MoeConfig(16, Tiles(32, 128, 4, 5), Tiles(128, 128, 4, 2))
    for table in _every_table():
        for c in table.values():
            for t in fp8_config(c).gate_up, fp8_config(c).down:
                assert t.block_k == 128 and (c.block_m * t.block_n <= 64 * 32 * t.num_warps or t.block_n == 16)


def _tables() -> list:
    from worker_svc.kernels.moe import HOPPER_CONFIGS, fp8_table

    return [pytest.param(None, id="default"), *(pytest.param(t, id=f"{h}x{i}") for (h, i), t in HOPPER_CONFIGS.items()),
            *(pytest.param(fp8_table(h, i), id=f"{h}x{i}-fp8") for h, i in HOPPER_CONFIGS)]


@pytest.mark.parametrize("table", _tables())
@pytest.mark.parametrize("max_tokens,top_k", [(16384, 8), (500, 8), (3000, 2), (1, 4)])
def test_moe_warm_up_reaches_every_config_a_step_can_use(table, max_tokens, top_k):
    """The worker's warm-up runs a step of each count warm_up_token_counts gives: together they use every
    configuration a step of 1 .. max_tokens tokens can, so no MoE kernel is built while serving."""
    from worker_svc.kernels import moe

    counts = moe.warm_up_token_counts(max_tokens, top_k, table)
    assert all(1 <= n <= max_tokens for n in counts)
    reached = {moe.moe_config(n, top_k, table) for n in counts}
    assert reached == {moe.moe_config(n, top_k, table) for n in range(1, max_tokens + 1)}
    assert len(reached) == len(counts)


def test_moe_align_groups_slots_by_expert_in_whole_blocks():
    from worker_svc.kernels.moe import align

    topk_ids = torch.tensor([[3, 1], [1, 0], [3, 5]])  # expert 5 is another rank's (this one holds 0..3)
    slots, block_expert = align(topk_ids, 0, 4, block_m=4)
    empty = topk_ids.numel()
    assert slots.numel() == 20  # static: 6 slots and every expert's padding (3 each), in whole blocks
    blocks = slots.view(-1, 4).tolist()
    assert blocks[:3] == [[3, empty, empty, empty], [1, 2, empty, empty], [0, 4, empty, empty]]
    assert block_expert.tolist()[:3] == [0, 1, 3] and set(block_expert.tolist()[3:]) == {-1}
    assert all(s == empty for row in blocks[3:] for s in row)


@pytest.mark.parametrize("tokens,top_k,experts,first,local,block_m", [
    (1, 8, 128, 0, 128, 16),     # a decode step of one token: 8 of 128 experts, 8 blocks
    (130, 8, 128, 0, 128, 16),   # slots past the count and scatter kernels' 64-slot chunks
    (130, 8, 128, 64, 64, 32),   # tensor parallelism: the second half of the experts
    (37, 3, 10, 0, 10, 128),     # experts not a power of two, a block larger than any expert's share
    (600, 2, 6, 2, 3, 64),       # more chunks than the offsets kernel's tile of them
])
def test_moe_align_matches_a_stable_sort_by_expert(tokens, top_k, experts, first, local, block_m):
    from worker_svc.kernels.moe import align, num_blocks

    gen = torch.Generator().manual_seed(tokens + first)
    topk_ids = torch.rand(tokens, experts, generator=gen).argsort(-1)[:, :top_k]
    slots, block_expert = align(topk_ids, first, local, block_m)
    assert block_expert.numel() == num_blocks(tokens * top_k, local, block_m)
    assert slots.numel() == block_expert.numel() * block_m
    ref_slots, ref_blocks = align_by_sorting(topk_ids, first, local, block_m, slots.numel())
    assert torch.equal(slots, ref_slots) and torch.equal(block_expert, ref_blocks)


@pytest.mark.parametrize("n,k,bits,group", [(70, 256, 4, 128), (64, 256, 4, 32), (33, 128, 8, 64), (64, 128, 2, 16),
                                            (40, 256, 4, -1)])
def test_the_packed_integer_dequantiser_gives_the_references_weight(n, k, bits, group):
    """kernels/int_gemm.py's dequantising kernel (then cuBLAS, F.linear here, past the fused kernel's rows): the weight
    reference.dequantize_ints gives, rounded once to the activations' dtype (a row count that is no multiple of its
    block; one group a row)."""
    from worker_svc.kernels import int_gemm, reference
    from worker_svc.model.packed_ints import pack

    gen = torch.Generator().manual_seed(n + bits)
    groups = 1 if group == -1 else k // group
    words = pack(torch.randint(0, 2 ** bits, (n, k), generator=gen), bits)
    zero = torch.randint(0, 2 ** bits, (n, groups), generator=gen).float()
    scale = torch.rand(n, groups, generator=gen) * 0.02
    assert int_gemm.supported(k, groups)
    for dtype in (torch.float32, torch.float16):
        weight = reference.dequantize_ints(words, zero, scale, bits).to(dtype)
        assert torch.equal(int_gemm.dequantize(words, zero, scale, k, dtype), weight)
        x = torch.randn(int_gemm.FUSED_ROWS + 1, k, generator=gen).to(dtype)
        assert torch.equal(int_gemm.linear(x, words, zero, scale), torch.nn.functional.linear(x, weight))


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 32])
@pytest.mark.parametrize("n,k,bits,group", [(70, 256, 4, 128), (64, 512, 4, -1), (33, 128, 8, 64), (16, 512, 2, 256),
                                            (130, 128, 4, 128)])
def test_the_fused_packed_integer_product_matches_the_float64_product(rows, n, k, bits, group):
    """kernels/int_gemm.py's fused kernel (decode rows): x W^T over the exact dequantised weight, to float32's
    rounding (by FMAs up to FMA_ROWS rows, on the tensor cores past them, the codes as 16-bit floats by their bits;
    split-K over the columns merged by the last program, whose counters are left at zero; one tile, so no split, in
    the last case)."""
    from worker_svc.kernels import int_gemm, reference, split_k
    from worker_svc.model.packed_ints import pack

    gen = torch.Generator().manual_seed(rows + n + bits)
    groups = 1 if group == -1 else k // group
    words = pack(torch.randint(0, 2 ** bits, (n, k), generator=gen), bits)
    zero = torch.randint(0, 2 ** bits, (n, groups), generator=gen).float()
    scale = torch.rand(n, groups, generator=gen) * 0.02
    assert int_gemm.fused_fits(k, groups, bits) and rows <= int_gemm.FUSED_ROWS
    exact = reference.dequantize_ints(words, zero, scale, bits).double()
    for dtype in (torch.float32, torch.float16):
        x = torch.randn(rows, k, generator=gen).to(dtype)
        bias = torch.randn(n, generator=gen).to(dtype)
        want = x.double() @ exact.T + bias.double()
        got = int_gemm.linear(x, words, zero, scale, bias)
        assert got.dtype == dtype and got.shape == (rows, n)
        tol = 1e-5 if dtype == torch.float32 else 2e-3  # float16: the output's rounding
        assert torch.allclose(got.double(), want, rtol=tol, atol=tol * want.abs().max().item())
    assert not split_k.counters(torch.device("cpu")).any()


@pytest.mark.parametrize("rows", [2, 16, 33])
@pytest.mark.parametrize("n,k,block_n,block_k", [(70, 256, 32, 64), (64, 512, 64, 128), (16, 128, 16, 32)])
def test_the_split_k_gemm_matches_the_float64_product(rows, n, k, block_n, block_k):
    """skinny_gemm.split_k_linear: y^T = W x^T over ranges of the input columns (split_k.py), the splits added by the
    last program of each row block: the float64 product to float32's rounding, with a bias, over N not a multiple of
    the tile and more than one split, the tiles loaded by pointers and by TMA; the counters left at zero."""
    from worker_svc.kernels import split_k
    from worker_svc.kernels.skinny_gemm import split_k_linear

    gen = torch.Generator().manual_seed(rows + n)
    x, w, bias = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    want = x.double() @ w.double().T + bias.double()
    assert split_k.splits_for(n, k // block_k, split_k.sm_count(x.device), block_n, 64) > 1
    for tma in (False, True):
        got = split_k_linear(x, w, bias, block_n=block_n, block_k=block_k, waves=64, tma=tma)
        assert got.shape == (rows, n)
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert torch.allclose(split_k_linear(x, w).double(), want - bias.double(), rtol=1e-5,
                          atol=1e-5 * want.abs().max().item())
    assert not split_k.counters(torch.device("cpu")).any()
