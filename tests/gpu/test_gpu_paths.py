"""GPU paths against their references, on a CUDA machine (the H200): the Triton and flash-attn-4 backends
against the torch backend over prefill, chunked prefill over a cached prefix, decode and mixed batches at several block
sizes; CUDA-graph decode against eager; the fused Triton sampler against the torch sampler; the skinny GEMM
against cuBLAS.
Run: pytest tests/gpu (skipped without a CUDA GPU)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from common.limits import Limits  # noqa: E402
from common.util import cdiv  # noqa: E402
from protos import worker_pb2 as pb  # noqa: E402
from worker_svc import kernels  # noqa: E402
from worker_svc.kernels.attention import (AttentionMetadata, flash_attn_available, make_attention,  # noqa: E402
                                          prefill_kernel)
from worker_svc.kernels.reference import TorchAttention  # noqa: E402


def _meta(query_lens, context_lens, block_size, num_blocks, gen):
    blocks_needed = [cdiv(c, block_size) for c in context_lens]
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(blocks_needed)
    page = np.zeros((len(query_lens), width), np.int32)
    for i, n in enumerate(blocks_needed):
        page[i, :n] = [perm.pop() for _ in range(n)]
    pos = np.concatenate([np.arange(c - q, c) for q, c in zip(query_lens, context_lens)])
    seq = np.repeat(np.arange(len(query_lens)), query_lens)
    slots = page[seq, pos // block_size].astype(np.int64) * block_size + pos % block_size
    dev = "cuda"
    return AttentionMetadata(
        cu_seqlens_q=torch.tensor(np.concatenate([[0], np.cumsum(query_lens)]), dtype=torch.int32, device=dev),
        seqused_k=torch.tensor(context_lens, dtype=torch.int32, device=dev),
        page_table=torch.from_numpy(page).to(dev), slot_mapping=torch.from_numpy(slots).to(dev),
        max_seqlen_q=max(query_lens), query_lens=list(query_lens), context_lens=list(context_lens))


def _step(case: str, heads: int, kv_heads: int, dim: int, gen: torch.Generator, block_size: int = 256,
          num_blocks: int = 128):
    """(meta, q, k_cache, v_cache) in bf16 on the GPU for one of CASES' steps."""
    q_lens, c_lens = CASES[case]
    meta = _meta(q_lens, c_lens, block_size, num_blocks, gen)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to("cuda", torch.bfloat16)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to("cuda", torch.bfloat16)
    q = torch.randn(sum(q_lens), heads, dim, generator=gen).to("cuda", torch.bfloat16)
    return meta, q, k_cache, v_cache


CASES = {
    "prefill": ([37, 300, 1], [37, 300, 1]),
    "chunk_over_prefix": ([64, 129, 5], [64 + 256, 129 + 512, 5 + 17]),
    "decode": ([1] * 40, list(range(1, 800, 20))),
    "mixed": ([1, 1, 200, 1, 33, 1], [900, 5, 200, 64, 97, 1500]),
    "long_prefill_beside_decodes": ([4000, 1, 1], [4000, 900, 3]),  # past FLASH_ATTN_MIN_FLOPS: auto's flash_attn
}


_NEEDS_FA4 = pytest.mark.skipif(not flash_attn_available(torch.device("cuda")), reason="flash-attn-4 not installed")


@pytest.mark.parametrize("backend", ["triton", pytest.param("flash_attn", marks=_NEEDS_FA4),
                                     pytest.param("auto", marks=_NEEDS_FA4)])
@pytest.mark.parametrize("block_size", [16, 64, 128, 256])
@pytest.mark.parametrize("case", list(CASES))
def test_fast_backends_match_torch_backend(backend, block_size, case):
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, num_blocks = 16, 8, 128, 4096 // block_size * 8
    meta, q, k_cache, v_cache = _step(case, heads, kv_heads, dim, gen, block_size, num_blocks)
    paged = make_attention(backend, torch.device("cuda"))
    fast = paged.forward(q, k_cache, v_cache, meta, dim ** -0.5)
    ref = TorchAttention().forward(q.float(), k_cache.float(), v_cache.float(), meta, dim ** -0.5)
    torch.testing.assert_close(fast.float(), ref, atol=2e-2, rtol=2e-2)
    if backend == "auto" and meta.max_seqlen_q > 1:
        assert paged.steps[prefill_kernel(meta, heads, dim)] == 1


@pytest.mark.parametrize("backend", ["triton", pytest.param("flash_attn", marks=_NEEDS_FA4),
                                     pytest.param("auto", marks=_NEEDS_FA4)])
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("q_lens", [[37, 300, 1, 512], [1, 1], [4000, 7]])
def test_fast_backends_attend_both_ways_for_an_encoder(backend, block_size, q_lens):
    """An encoder's step (meta.causal False): whole sequences, every query over every key of its own sequence;
    one-token sequences (the decode kernel's shape, not its path) and a long one past auto's flash_attn bound."""
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, num_blocks = 12, 12, 64, 4096 // block_size * 4
    meta = _meta(q_lens, q_lens, block_size, num_blocks, gen)
    meta.causal = False
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to("cuda", torch.bfloat16)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to("cuda", torch.bfloat16)
    q = torch.randn(sum(q_lens), heads, dim, generator=gen).to("cuda", torch.bfloat16)
    fast = make_attention(backend, torch.device("cuda")).forward(q, k_cache, v_cache, meta, dim ** -0.5)
    ref = TorchAttention().forward(q.float(), k_cache.float(), v_cache.float(), meta, dim ** -0.5)
    torch.testing.assert_close(fast.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("backend", ["triton", pytest.param("flash_attn", marks=_NEEDS_FA4),
                                     pytest.param("auto", marks=_NEEDS_FA4)])
@pytest.mark.parametrize("window", [1, 100, 1000])
@pytest.mark.parametrize("case", list(CASES))
def test_fast_backends_with_a_sliding_window_match_torch_backend(backend, window, case):
    """Mistral's sliding window in every backend, over every step kind (block size 256)."""
    gen = torch.Generator().manual_seed(2)
    heads, kv_heads, dim, block_size, num_blocks = 16, 8, 128, 256, 128
    meta, q, k_cache, v_cache = _step(case, heads, kv_heads, dim, gen, block_size, num_blocks)
    fast = make_attention(backend, torch.device("cuda")).forward(q, k_cache, v_cache, meta, dim ** -0.5,
                                                                 window=window)
    ref = TorchAttention().forward(q.float(), k_cache.float(), v_cache.float(), meta, dim ** -0.5, window=window)
    torch.testing.assert_close(fast.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("backend", ["triton", pytest.param("flash_attn", marks=_NEEDS_FA4),
                                     pytest.param("auto", marks=_NEEDS_FA4)])
@pytest.mark.parametrize("dim,window", [(128, None), (256, 100)])
@pytest.mark.parametrize("case", list(CASES))
def test_fast_backends_with_a_score_cap_match_torch_backend(backend, dim, window, case):
    """Gemma 2's attention logit cap (each scaled score s through 3 tanh(s / 3)) in every backend, over every step
    kind, at heads of 128 and of Gemma 2's 256 with a window; a scale that gives scores of std ~3.4, most of them
    bent by the cap."""
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, block_size, num_blocks = 8, 4, 256, 128
    meta, q, k_cache, v_cache = _step(case, heads, kv_heads, dim, gen, block_size, num_blocks)
    scale = 3.4 / dim ** 0.5
    fast = make_attention(backend, torch.device("cuda")).forward(q, k_cache, v_cache, meta, scale, window=window,
                                                                 softcap=3.0)
    ref = TorchAttention().forward(q.float(), k_cache.float(), v_cache.float(), meta, scale, window=window,
                                   softcap=3.0)
    uncapped = TorchAttention().forward(q.float(), k_cache.float(), v_cache.float(), meta, scale, window=window)
    assert (ref - uncapped).abs().max() > 0.2  # the cap changes the output: a backend ignoring it would fail
    torch.testing.assert_close(fast.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("backend", ["triton", pytest.param("flash_attn", marks=_NEEDS_FA4),
                                     pytest.param("auto", marks=_NEEDS_FA4)])
@pytest.mark.parametrize("window", [None, 128])
@pytest.mark.parametrize("case", list(CASES))
def test_fast_backends_with_sinks_match_torch_backend(backend, window, case):
    """gpt-oss's attention: 64 heads of 64 over 8 KV heads, a sink per head (some far above the scores, some
    below), with and without its 128-token window, in every backend over every step kind."""
    gen = torch.Generator().manual_seed(6)
    heads, kv_heads, dim, block_size, num_blocks = 64, 8, 64, 256, 128
    meta, q, k_cache, v_cache = _step(case, heads, kv_heads, dim, gen, block_size, num_blocks)
    sinks = (torch.randn(heads, generator=gen) * 3).to("cuda")
    fast = make_attention(backend, torch.device("cuda")).forward(q, k_cache, v_cache, meta, dim ** -0.5,
                                                                 window=window, sinks=sinks)
    ref = TorchAttention().forward(q.float(), k_cache.float(), v_cache.float(), meta, dim ** -0.5, window=window,
                                   sinks=sinks)
    plain = TorchAttention().forward(q.float(), k_cache.float(), v_cache.float(), meta, dim ** -0.5, window=window)
    assert (ref - plain).abs().max() > 0.05  # the sinks change the output: a backend ignoring them would fail
    torch.testing.assert_close(fast.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("backend", ["triton", pytest.param("auto", marks=_NEEDS_FA4)])
@pytest.mark.parametrize("case", list(CASES))
def test_fast_backends_take_deepseeks_latent_head(backend, case):
    """DeepSeek's latent attention as served (model/mla.py): 16 query heads over one KV head of 576 (the 512-dim latent
    and 64 rope dims), K and V the same cache, in every backend over every step kind."""
    gen = torch.Generator().manual_seed(7)
    heads, dim, block_size, num_blocks = 16, 576, 256, 128
    q_lens, c_lens = CASES[case]
    meta = _meta(q_lens, c_lens, block_size, num_blocks, gen)
    kv = torch.randn(num_blocks, block_size, 1, dim, generator=gen).to("cuda", torch.bfloat16)
    q = torch.randn(sum(q_lens), heads, dim, generator=gen).to("cuda", torch.bfloat16)
    paged = make_attention(backend, torch.device("cuda"), head_dim=dim)
    fast = paged.forward(q, kv, kv, meta, 192 ** -0.5)
    ref = TorchAttention().forward(q.float(), kv.float(), kv.float(), meta, 192 ** -0.5)
    torch.testing.assert_close(fast.float(), ref, atol=2e-2, rtol=2e-2)
    # as model/mla.py asks: the latent's 512 columns (decode steps: the latent kernel), over bf16 and (where the
    # backend reads one) e4m3 caches
    fp8 = [((kv.float() / 2).to(torch.float8_e4m3fn), 2.0)] if backend == "triton" else []
    for cache, k_scale in [(kv, 1.0), *fp8]:
        fast = paged.latent(q, cache, meta, 192 ** -0.5, k_scale, 64)
        ref = TorchAttention().latent(q.float(), cache.float(), meta, 192 ** -0.5, k_scale, 64)
        assert fast.shape == (q.shape[0], heads, 512)
        torch.testing.assert_close(fast.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("block_size", [16, 64, 256])
@pytest.mark.parametrize("heads,kv_heads", [(16, 8), (32, 8), (14, 2), (8, 8)])
def test_triton_decode_matches_torch_backend(block_size, heads, kv_heads):
    from worker_svc.kernels.decode_attention import paged_decode_attention, tile_config

    gen = torch.Generator().manual_seed(1)
    dim = 128
    c_lens = [1, 2, 255, 256, 257, 511, 512, 513, 1500, 4000, 33]
    num_blocks = sum(cdiv(c, block_size) for c in c_lens) + 64
    meta = _meta([1] * len(c_lens), c_lens, block_size, num_blocks, gen)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to("cuda", torch.bfloat16)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to("cuda", torch.bfloat16)
    q = torch.randn(len(c_lens), heads, dim, generator=gen).to("cuda", torch.bfloat16)
    ref = TorchAttention().forward(q.float(), k_cache.float(), v_cache.float(), meta, dim ** -0.5)
    # a page table far wider than the contexts (as in CUDA graphs) takes longer splits, same result
    wide = torch.zeros(len(c_lens), 40960 // block_size, dtype=torch.int32, device="cuda")
    wide[:, :meta.page_table.shape[1]] = meta.page_table
    for tiles in (tile_config(1), tile_config(256)):
        for table in (meta.page_table, wide):
            out = paged_decode_attention(q, k_cache, v_cache, meta.seqused_k, table, dim ** -0.5, **tiles)
            torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_decode_split_merge_by_the_last_program_is_race_free():
    """The last split program of a (sequence, KV head) merges what the others stored: if it could read a
    partial before its store were visible, some replay would differ. The merge order is fixed, so every
    one of 100 replays (28 layers' worth of calls each, one counter buffer) must equal the first bit for bit."""
    from worker_svc.kernels.decode_attention import merge_counters, paged_decode_attention

    gen = torch.Generator().manual_seed(4)
    batch, heads, kv_heads, dim, page = 256, 16, 8, 128, 256
    lens = torch.randint(100, 2049, (batch,), generator=gen)
    per_seq = 2048 // page
    table = torch.randperm(batch * per_seq, generator=gen).int().view(batch, per_seq).cuda()
    k = torch.randn(batch * per_seq, page, kv_heads, dim, generator=gen).to("cuda", torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(28, batch, heads, dim, generator=gen).to("cuda", torch.bfloat16)
    seqused, counters = lens.int().cuda(), merge_counters(batch, kv_heads, "cuda")
    outs = torch.empty_like(q)

    def layers():
        for i in range(28):
            outs[i] = paged_decode_attention(q[i], k, v, seqused, table, dim ** -0.5, counters=counters)

    layers()
    first = outs.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layers()
    for _ in range(100):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(outs, first)
    assert not counters.any()


def test_fused_qk_norm_rope_store_matches_eager_pieces():
    from worker_svc.kernels.elementwise import qk_norm_rope_store
    from worker_svc.kernels.reference import qk_norm_rope, store_kv
    from worker_svc.model.layers import RotaryEmbedding

    gen = torch.Generator().manual_seed(2)
    heads, kv_heads, dim, tokens, page, blocks = 16, 8, 128, 300, 16, 64
    rotary = RotaryEmbedding(dim, 4096, 1e6)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(torch.bfloat16)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    q_w, k_w = (torch.rand(2, dim, generator=gen) + 0.5).to(torch.bfloat16)
    slots = torch.randperm(blocks * page, generator=gen)[:tokens]
    k_ref = torch.zeros(blocks, page, kv_heads, dim, dtype=torch.bfloat16)
    v_ref = torch.zeros_like(k_ref)
    q_in, k_in, v_in = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q_ref, k_new = qk_norm_rope(q_in.reshape(tokens, heads, dim), k_in.reshape(tokens, kv_heads, dim), positions,
                                rotary.cos_sin, q_w, k_w, 1e-6)
    store_kv(k_new, v_in.reshape(tokens, kv_heads, dim), k_ref, v_ref, slots)
    k_cache, v_cache = torch.zeros_like(k_ref).cuda(), torch.zeros_like(v_ref).cuda()
    q = qk_norm_rope_store(qkv.cuda(), positions.cuda(), rotary.cos_sin.cuda(), q_w.cuda(), k_w.cuda(), 1e-6,
                           k_cache, v_cache, slots.cuda(), heads, kv_heads)
    torch.testing.assert_close(q.cpu(), q_ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(k_cache.cpu(), k_ref, atol=2e-2, rtol=2e-2)
    assert torch.equal(v_cache.cpu(), v_ref)


@pytest.mark.parametrize("rows", [1, 256, 16384])  # a decode, a decode batch, a prefill step
def test_norm_and_swiglu_kernels_match_eager_in_bfloat16(rows):
    from worker_svc.kernels import elementwise
    from worker_svc.kernels.reference import silu_and_mul
    from worker_svc.model.layers import RMSNorm

    gen = torch.Generator().manual_seed(3)
    norm = RMSNorm(1024, 1e-6, kernels.select("cpu")).to(torch.bfloat16)
    norm.weight.copy_(torch.rand(1024, generator=gen) + 0.5)
    x, residual = (torch.randn(2, rows, 1024, generator=gen) * 3).to(torch.bfloat16)
    gate_up = (torch.randn(rows, 6144, generator=gen) * 4).to(torch.bfloat16)
    want_norm, want_sum = norm(x, residual)  # the CPU's eager pieces
    got_norm, got_sum = elementwise.rms_norm(x.cuda(), norm.weight.cuda(), norm.eps, residual.cuda())
    assert torch.equal(got_sum.cpu(), want_sum)
    # Up to two bfloat16 units (2**-6 relative): float32 sums in another order (or another exp) can move the
    # first rounding by one unit, and the product with the weight (or up) rounds again; measured: 26 of
    # 16.8M elements beyond one unit at 16,384 rows, none beyond two
    torch.testing.assert_close(got_norm.cpu(), want_norm, atol=0, rtol=2 ** -6)
    torch.testing.assert_close(elementwise.rms_norm(x.cuda(), norm.weight.cuda(), norm.eps).cpu(), norm(x),
                               atol=0, rtol=2 ** -6)
    torch.testing.assert_close(elementwise.silu_and_mul(gate_up.cuda()).cpu(), silu_and_mul(gate_up),
                               atol=1e-3, rtol=2 ** -6)


@pytest.mark.parametrize("n,k", [(4096, 1024), (1024, 2048), (6144, 1024), (96, 512)])
def test_skinny_gemm_matches_cublas_in_bfloat16(n, k):
    from worker_svc.kernels.skinny_gemm import linear, skinny_linear, supported

    gen = torch.Generator().manual_seed(n)
    w = (torch.randn(n, k, generator=gen) * 0.02).to("cuda", torch.bfloat16)
    for rows in (1, 5, 16):
        x = torch.randn(rows, k, generator=gen).to("cuda", torch.bfloat16)
        ref = torch.nn.functional.linear(x.float(), w.float())
        torch.testing.assert_close(skinny_linear(x, w).float(), ref, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(linear(x, w).float(), ref, atol=2e-2, rtol=2e-2)
    assert supported(x[:1], w)


def test_triton_sampler_matches_torch_sampler():
    from worker_svc.runtime.sampler import SamplingBatch, sample

    gpu, cpu = kernels.select("cuda"), kernels.select("cpu")

    gen = torch.Generator().manual_seed(0)
    rows, vocab = 64, 151936
    logits = (torch.randn(rows, vocab, generator=gen) * 3).cuda()
    temperature = torch.tensor([0.0] * 8 + [0.6] * 28 + [1.0] * 28, device="cuda")
    batch = SamplingBatch(temperature=temperature, seeds=torch.arange(rows, device="cuda") * 7919,
                          positions=torch.arange(rows, device="cuda") + 100, top_k=None, top_p=None,
                          min_p=None, all_greedy=False, max_logprobs=-1)
    fused = sample(logits, batch, gpu).token_ids
    reference = sample(logits.cpu(), SamplingBatch(**{
        f: (getattr(batch, f).cpu() if isinstance(getattr(batch, f), torch.Tensor) else getattr(batch, f))
        for f in SamplingBatch.__slots__}), cpu).token_ids
    assert torch.equal(fused.cpu(), reference)


SAMPLING = {
    # every row greedy or by temperature: the graph's Gumbel kernel samples
    "graph_sampler": [pb.SamplingParams(temperature=t, top_p=1.0, repetition_penalty=1.0, logprobs=-1, seed=s)
                      for t, s in ((0.0, 0), (0.8, 11), (1.0, 12))],
    # one row asks for logprobs, one for top-k: the sampler runs again on the graph's logits
    "sampler_after_graph": [pb.SamplingParams(temperature=0.0, top_p=1.0, repetition_penalty=1.0, logprobs=2),
                            pb.SamplingParams(temperature=0.9, top_k=20, top_p=1.0, repetition_penalty=1.0,
                                              logprobs=-1, seed=5),
                            pb.SamplingParams(temperature=0.0, top_p=1.0, repetition_penalty=1.3, logprobs=-1)],
}


@pytest.mark.parametrize("sampling", list(SAMPLING))
def test_cuda_graph_decode_matches_eager(tmp_path, sampling):
    """Captured decode steps (padded batches, LM head and sampler inside) against the same steps run
    uncaptured and unpadded."""
    from tests.paged_driver import PagedDriver
    from worker_svc.checkpoints.writer import make_model
    from worker_svc.runtime.model_runner import ModelRunner, RunnerConfig

    model_dir = make_model("qwen3-small", tmp_path / "m", seed=0, dtype="bfloat16")
    cfg = dict(device="cuda", num_blocks=512, block_size=16, limits=Limits(max_num_seqs=64, max_model_len=1024))
    graphed = ModelRunner(model_dir, RunnerConfig(**cfg))
    eager = ModelRunner(model_dir, RunnerConfig(**cfg, cuda_graphs=False))
    assert graphed.decode.graphs and not eager.decode.graphs
    prompts = [[(7 * i + j) % 5000 for j in range(5 + 11 * i)] for i in range(13)]
    params = SAMPLING[sampling]
    outs = []
    for runner in (graphed, eager):
        driver = PagedDriver(runner)
        seqs = [driver.add(p, 24, params[i % len(params)]) for i, p in enumerate(prompts)]
        driver.run_all()
        outs.append([s.generated for s in seqs])
    agree = sum(a == b for a, b in zip(*outs))
    assert agree >= 12, outs  # bf16 padded vs unpadded matmuls may flip one near-tie at most


def test_bad_words_under_cuda_graphs(tmp_path):
    """Decode steps replaying graphs, every other row with a bad word of two tokens of its own greedy output: its
    second token never follows its first (the rows' recent tokens recorded on the device between launches), the
    other rows' outputs unchanged."""
    from tests.paged_driver import GREEDY, PagedDriver
    from worker_svc.checkpoints.writer import make_model
    from worker_svc.runtime.model_runner import ModelRunner, RunnerConfig

    model_dir = make_model("qwen3-small", tmp_path / "m", seed=0, dtype="bfloat16")
    config = RunnerConfig(device="cuda", num_blocks=512, block_size=16,
                          limits=Limits(max_num_seqs=64, max_model_len=1024))
    runner = ModelRunner(model_dir, config)
    assert runner.decode.graphs
    prompts = [[(7 * i + j) % 5000 for j in range(5 + 11 * i)] for i in range(12)]
    driver = PagedDriver(runner)
    plain = [driver.add(p, 16) for p in prompts]
    driver.run_all()
    refs = [s.generated for s in plain]
    runner.close()
    driver = PagedDriver(ModelRunner(model_dir, config))
    seqs = []
    for i, (p, ref) in enumerate(zip(prompts, refs)):
        params = pb.SamplingParams()
        params.CopyFrom(GREEDY)
        if i % 2:
            params.bad_words.add(token_ids=ref[6:8])
        seqs.append(driver.add(p, 16, params))
    driver.run_all()
    for i, (s, ref) in enumerate(zip(seqs, refs)):
        if i % 2:
            k = next(k for k in range(7) if ref[k:k + 2] == ref[6:8])  # where the word first comes
            assert s.generated[:k + 1] == ref[:k + 1] and s.generated[k + 1] != ref[k + 1]
        else:
            assert s.generated == ref


def test_a_runner_with_fewer_blocks_than_its_longest_chunk_warms_up_and_serves(tmp_path):
    """Warm-up steps stay within the KV cache however few blocks it has (a chunk's KV must fit it to be served)."""
    from tests.paged_driver import PagedDriver
    from worker_svc.checkpoints.writer import make_model
    from worker_svc.runtime.model_runner import ModelRunner, RunnerConfig

    model_dir = make_model("qwen3-small", tmp_path / "m", seed=0, dtype="bfloat16")
    runner = ModelRunner(model_dir, RunnerConfig(device="cuda", num_blocks=4, block_size=16,
                                                 limits=Limits(max_num_seqs=8, max_model_len=1024)))
    driver = PagedDriver(runner)
    seq = driver.add(list(range(1, 41)), 8)
    driver.run_all()
    assert len(seq.generated) == 8


# ---- fp8 KV cache ---------------------------------------------------------------------------------------
FP8_SCALES = (0.05, 0.02)  # k_scale, v_scale: maps the test's N(0, 1) values into e4m3's upper range


@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("case", list(CASES))
def test_triton_backend_reads_an_fp8_cache_as_the_torch_backend(block_size, case):
    """Every step kind the triton backend serves over an fp8 cache (flash_attn refuses one: resolve())."""
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, num_blocks = 16, 8, 128, 4096 // block_size * 8
    q_lens, c_lens = CASES[case]
    meta = _meta(q_lens, c_lens, block_size, num_blocks, gen)
    k_scale, v_scale = FP8_SCALES
    k8 = (torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen) / k_scale).to(torch.float8_e4m3fn).cuda()
    v8 = (torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen) / v_scale).to(torch.float8_e4m3fn).cuda()
    q = torch.randn(sum(q_lens), heads, dim, generator=gen).to("cuda", torch.bfloat16)
    fast = make_attention("auto", torch.device("cuda"), torch.float8_e4m3fn)
    assert fast.name == "triton"
    out = fast.forward(q, k8, v8, meta, dim ** -0.5, k_scale, v_scale)
    ref = TorchAttention().forward(q.float(), k8.float() * k_scale, v8.float() * v_scale, meta, dim ** -0.5)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_fused_store_quantises_into_an_fp8_cache_as_the_reference():
    from worker_svc.kernels import reference
    from worker_svc.kernels.elementwise import qk_norm_rope_store
    from worker_svc.model.layers import RotaryEmbedding

    gen = torch.Generator().manual_seed(2)
    heads, kv_heads, dim, tokens, page, blocks = 16, 8, 128, 300, 16, 64
    rotary = RotaryEmbedding(dim, 4096, 1e6)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen) * 4).to(torch.bfloat16)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    q_w, k_w = (torch.rand(2, dim, generator=gen) + 0.5).to(torch.bfloat16)
    slots = torch.randperm(blocks * page, generator=gen)[:tokens]
    k_ref = torch.zeros(blocks, page, kv_heads, dim, dtype=torch.float8_e4m3fn)
    v_ref = torch.zeros_like(k_ref)
    reference.qk_norm_rope_store(qkv, positions, rotary.cos_sin, q_w, k_w, 1e-6, k_ref, v_ref, slots, heads, kv_heads,
                                 *FP8_SCALES)
    k_cache, v_cache = torch.zeros_like(k_ref).cuda(), torch.zeros_like(v_ref).cuda()
    qk_norm_rope_store(qkv.cuda(), positions.cuda(), rotary.cos_sin.cuda(), q_w.cuda(), k_w.cuda(), 1e-6, k_cache,
                       v_cache, slots.cuda(), heads, kv_heads, *FP8_SCALES)
    assert torch.equal(v_cache.cpu().view(torch.uint8), v_ref.view(torch.uint8))  # no arithmetic but the scale
    step = (k_cache.cpu().float() - k_ref.float()).abs() / k_ref.float().abs().clamp_min(2 ** -6)
    assert float(step.max()) <= 0.125 and float((step > 0).float().mean()) < 0.02


def test_fp8_cache_runner_on_the_gpu_matches_the_torch_backend(tmp_path):
    """The whole worker over an fp8 cache on the GPU: its prefill logits (triton kernels, fused fp8 store)
    against the torch backend's over the same cache dtype, and its captured decode steps against the same steps
    uncaptured. A bf16 random model's logits (std ~8.5) differ between the backends by up to ~3 with a bf16 cache
    (93 % of argmaxes agree; an fp8 cache amplifies it, as a rounding difference upstream moves K across an e4m3
    step: ~8.7, 85 %), so the kernels are held to that bound on logits and the graphs to tokens."""
    from tests.paged_driver import PagedDriver, prefill_logits
    from worker_svc.checkpoints.writer import make_model
    from worker_svc.runtime.model_runner import ModelRunner, RunnerConfig

    model_dir = make_model("qwen3-small", tmp_path / "m", seed=0, dtype="bfloat16")
    cfg = dict(device="cuda", num_blocks=512, block_size=16, kv_cache_dtype="fp8",
               limits=Limits(max_num_seqs=64, max_model_len=1024))
    fast = ModelRunner(model_dir, RunnerConfig(**cfg))
    assert fast.kernels.attention.name == "triton" and fast.decode.graphs
    assert fast.describe().kv_cache_dtype == "float8_e4m3fn"
    prompts = [[(7 * i + j) % 5000 for j in range(5 + 11 * i)] for i in range(13)]
    slow = ModelRunner(model_dir, RunnerConfig(**cfg, attention="torch", cuda_graphs=False))
    ours, ref = (torch.cat(prefill_logits(r, prompts)).float() for r in (fast, slow))
    assert float((ours - ref).abs().max()) <= 0.25 * float(ref.abs().max())
    assert float((ours.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.75
    del slow
    eager = ModelRunner(model_dir, RunnerConfig(**cfg, cuda_graphs=False))
    outs = []
    for runner in (fast, eager):
        driver = PagedDriver(runner, chunk=32)
        seqs = [driver.add(p, 24) for p in prompts]
        driver.run_all()
        outs.append([s.generated for s in seqs])
    assert sum(a == b for a, b in zip(*outs)) >= 12, outs  # bf16 padded vs unpadded matmuls may flip a near-tie


@pytest.mark.parametrize("tokens", [1, 7, 256, 4096])
def test_fused_moe_matches_the_loop_and_replays_in_a_cuda_graph(tokens):
    """Qwen3-30B-A3B's expert shapes (128 experts, top 8, hidden 2048, 768 per expert) in bf16; then the same
    call captured in a CUDA graph replays right for a new batch with other routing (no host sync inside)."""
    from worker_svc.kernels import moe, reference

    gen = torch.Generator().manual_seed(tokens)
    experts, top_k, hidden, inter = 128, 8, 2048, 768

    def batch():
        x = torch.randn(tokens, hidden, generator=gen).to("cuda", torch.bfloat16)
        weights, ids = torch.randn(tokens, experts, generator=gen).softmax(-1).topk(top_k, dim=-1)
        return x, weights.to("cuda", torch.bfloat16), ids.cuda()

    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).to("cuda", torch.bfloat16)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5).to("cuda", torch.bfloat16)
    x, weights, ids = batch()
    ref = reference.fused_moe(x.float(), w13.float(), w2.float(), weights.float(), ids)
    torch.testing.assert_close(moe.fused_moe(x, w13, w2, weights, ids).float(), ref, atol=3e-2, rtol=3e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe.fused_moe(x, w13, w2, weights, ids)
    x2, weights2, ids2 = batch()
    x.copy_(x2), weights.copy_(weights2), ids.copy_(ids2)
    graph.replay()
    ref2 = reference.fused_moe(x2.float(), w13.float(), w2.float(), weights2.float(), ids2)
    torch.testing.assert_close(out.float(), ref2, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("heads,kv_heads", [(4, 1), (8, 4)])  # Gemma 3 1B and 4B: head_dim 256
@pytest.mark.parametrize("case", list(CASES))
def test_triton_backend_at_head_dim_256_with_a_window_matches_torch_backend(heads, kv_heads, case):
    gen = torch.Generator().manual_seed(3)
    dim, block_size, num_blocks = 256, 256, 128
    meta, q, k_cache, v_cache = _step(case, heads, kv_heads, dim, gen, block_size, num_blocks)
    for window in (None, 512):
        fast = make_attention("triton", torch.device("cuda")).forward(q, k_cache, v_cache, meta, 0.0625, window=window)
        ref = TorchAttention().forward(q.float(), k_cache.float(), v_cache.float(), meta, 0.0625, window=window)
        torch.testing.assert_close(fast.float(), ref, atol=2e-2, rtol=2e-2)


# ---- host KV tier -----------------------------------------------------------------------------------------
def test_host_pool_copies_whole_blocks_in_plan_order_around_the_steps():
    """Swap-outs copy a block before work queued after them overwrites it, swap-ins land before work queued
    after them reads the block, and a plan that empties a block and fills it again gets both in that order."""
    from worker_svc.runtime.kv_offload import HostKVPool

    cache = torch.randn(2, 3, 9, 16, 2, 64, device="cuda", dtype=torch.bfloat16)
    pool = HostKVPool(cache, 4)
    assert pool.blocks.is_pinned()
    before = cache.clone()
    pool.swap(pb.StepPlan(swap_out_blocks=[1, 5, 7], swap_out_host_blocks=[0, 3, 2]))
    cache.zero_()  # the next step overwrites every block, on the compute stream
    pool.swap(pb.StepPlan(swap_out_blocks=[8], swap_out_host_blocks=[1],  # out of 8 (zeros), then into it
                          swap_in_host_blocks=[3, 0, 1], swap_in_blocks=[8, 4, 1]))
    got = cache.clone()  # queued after the swap-ins
    torch.cuda.synchronize()
    assert torch.equal(got[:, :, 8], before[:, :, 5]) and torch.equal(got[:, :, 4], before[:, :, 1])
    assert not got[:, :, 1].any()  # host block 1 got block 8's zeros before it was read back
    assert torch.equal(pool.blocks[2].cuda(), before[:, :, 7])


def test_host_pool_times_a_block_coming_in():
    """The copy the worker times before serving (to keep or drop its host tier) is the swap-in a plan makes: the
    blocks arrive whole (zeros, never the pinned pool's uninitialised bytes), the others stay, and the time per
    block is positive and below a second."""
    from worker_svc.runtime.kv_offload import HostKVPool

    cache = torch.randn(2, 3, 9, 16, 2, 64, device="cuda", dtype=torch.bfloat16)
    before = cache.clone()
    seconds = HostKVPool(cache, 4).copy_in_seconds(3)
    assert 0 < seconds < 1
    assert not cache[:, :, :3].any() and torch.equal(cache[:, :, 3:], before[:, :, 3:])


def test_host_pool_offloads_behind_the_forward_and_a_reuse_waits_for_them():
    """An offload copies what the step queued before it wrote; a later plan that fills that GPU block (a fresh
    table block, a swap-in) or that host block waits for the copy, and a swap-in from it reads the copy."""
    from worker_svc.runtime.kv_offload import HostKVPool

    cache = torch.zeros(2, 8, 6, 256, 8, 128, device="cuda", dtype=torch.bfloat16)  # 8 MiB blocks: slow copies
    pool = HostKVPool(cache, 4)
    value = torch.randn(cache[:, :, 0].shape, device="cuda", dtype=torch.bfloat16)
    for _ in range(20):  # the "forward": queued work that ends by writing blocks 2 and 3
        cache[:, :, 5].add_(1.0)
    cache[:, :, 2].copy_(value)
    cache[:, :, 3].copy_(value * 2)
    pool.offload(pb.StepPlan(offload_blocks=[2, 3], offload_host_blocks=[1, 0]))
    pool.swap(pb.StepPlan(new_block_ids=[2]))  # the next step writes block 2: it waits for the copy out of it
    cache[:, :, 2].zero_()
    pool.swap(pb.StepPlan(swap_in_host_blocks=[0], swap_in_blocks=[4]))  # reads host block 0 once it is filled
    got = cache[:, :, 4].clone()
    torch.cuda.synchronize()
    assert torch.equal(pool.blocks[1].cuda(), value) and torch.equal(pool.blocks[0].cuda(), value * 2)
    assert torch.equal(got, value * 2) and not cache[:, :, 2].any()


def test_blocks_freed_behind_a_window_go_to_other_sequences_without_changing_tokens(tmp_path):
    """Mistral (tiny, a 24-token window) through the scheduler and a CUDA worker (triton kernels, graphs): with a
    pool of 40 blocks of 16, blocks freed behind the windows go to other sequences at once (eight sequences of up
    to 163 positions would hold 84 without the release); against a pool that never reuses a block, the greedy
    tokens agree (a preemption's recompute may flip a bf16 near-tie)."""
    from offline.llm import LLM
    from scheduler_svc.sampling import SamplingParams
    from worker_svc.checkpoints.writer import make_model

    model_dir = make_model("mistral-tiny", tmp_path / "m", seed=0, dtype="bfloat16")
    prompts = [[(7 * i + j) % 5000 for j in range(40 + 9 * i)] for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    outs = []
    for blocks in (40, 4096):
        with LLM(model_dir, device="cuda", num_blocks=blocks, block_size=16, max_num_seqs=8, max_model_len=512,
                 max_num_batched_tokens=64) as llm:
            assert llm.engine.scheduler.sliding_window == 24
            outs.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert sum(a == b for a, b in zip(*outs)) >= 7, outs
