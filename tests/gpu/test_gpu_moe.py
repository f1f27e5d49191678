"""The fused MoE's tile tables on a CUDA machine (the H200): every HOPPER_CONFIGS entry (each shape's table's), each
entry e4m3 experts are served with, and the default, at Qwen3-30B-A3B's expert shapes (128 experts, top 8, hidden
2048, 768 per expert) in bf16, against the loop over experts at the largest token count of its bucket (also
replayed in a CUDA graph for a new batch, up to decode sizes); a rank holding half the experts; align() against a
stable sort by expert.
Run: pytest tests/gpu (skipped without a CUDA GPU)."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from tests.moe_cases import align_by_sorting, check_router_choice, expert_weights, routed_tokens  # noqa: E402
from worker_svc.kernels import moe, reference  # noqa: E402

EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768
GRAPH_TOKENS = 512  # the decode step's CUDA-graph batch sizes (max_num_seqs)


@pytest.fixture(scope="module")
def weights() -> tuple[torch.Tensor, ...]:
    """w13 and w2 in bf16, and the same values in float32 for the loop."""
    w13, w2 = expert_weights(EXPERTS, HIDDEN, INTER, torch.Generator().manual_seed(0), "cuda", torch.bfloat16)
    return w13, w2, w13.float(), w2.float()


def _batch(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return routed_tokens(tokens, TOP_K, EXPERTS, HIDDEN, torch.Generator().manual_seed(seed), "cuda", torch.bfloat16)


def _loop(x: torch.Tensor, topk_weights: torch.Tensor, ids: torch.Tensor, w13_f: torch.Tensor,
          w2_f: torch.Tensor, first: int = 0) -> torch.Tensor:
    return reference.fused_moe(x.float(), w13_f, w2_f, topk_weights.float(), ids, first)


def _cases() -> list:
    cases = [pytest.param(key, config, id=f"hopper-{hidden}x{inter}-{key}")
             for (hidden, inter), table in moe.HOPPER_CONFIGS.items() for key, config in sorted(table.items())]
    return cases + [pytest.param(t, moe.default_config(t, TOP_K), id=f"default-{t}") for t in (128, 129)]


@pytest.mark.parametrize("tokens,config", _cases())
def test_every_moe_table_config_matches_the_loop(weights, tokens, config):
    w13, w2, w13_f, w2_f = weights
    x, topk_weights, ids = _batch(tokens, seed=tokens)
    out = moe.fused_moe(x, w13, w2, topk_weights, ids, 0, config)
    torch.testing.assert_close(out.float(), _loop(x, topk_weights, ids, w13_f, w2_f), atol=3e-2, rtol=3e-2)
    if tokens > GRAPH_TOKENS:
        return
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = moe.fused_moe(x, w13, w2, topk_weights, ids, 0, config)
    x2, weights2, ids2 = _batch(tokens, seed=tokens + 1)
    x.copy_(x2), topk_weights.copy_(weights2), ids.copy_(ids2)
    graph.replay()
    torch.testing.assert_close(replayed.float(), _loop(x2, weights2, ids2, w13_f, w2_f), atol=3e-2, rtol=3e-2)


def _fp8_cases() -> list:
    """Every entry e4m3 experts are served with (moe.fp8_table: measured, or the 16-bit table's made to fit)."""
    cases = [pytest.param(key, config, id=f"hopper-fp8-{hidden}x{inter}-{key}")
             for hidden, inter in moe.HOPPER_CONFIGS for key, config in sorted(moe.fp8_table(hidden, inter).items())]
    return cases + [pytest.param(t, moe.default_config(t, TOP_K), id=f"default-{t}") for t in (128, 129)]


@pytest.mark.parametrize("tokens,config", [c for c in _fp8_cases() if c.values[0] <= GRAPH_TOKENS])
def test_every_moe_table_config_over_fp8_experts_matches_the_loop(weights, tokens, config):
    """The experts in e4m3 with 128 x 128 block scales (model/quantized.py), against the loop over the same codes
    dequantised."""
    from worker_svc.model.quantized import quantize_blocks

    w13, w2, _, _ = weights
    (q13, s13), (q2, s2) = (map(torch.stack, zip(*(quantize_blocks(w) for w in ws))) for ws in (w13, w2))
    x, topk_weights, ids = _batch(tokens, seed=tokens)
    out = moe.fused_moe(x, q13, q2, topk_weights, ids, 0, config, s13=s13, s2=s2)
    expected = reference.fused_moe(x.float(), q13, q2, topk_weights.float(), ids, 0, s13=s13, s2=s2)
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)


def test_fused_moe_of_a_rank_holding_half_the_experts(weights):
    """Tensor parallelism: experts 64..127 here, the slots routed to 0..63 left out of the sum."""
    w13, w2, w13_f, w2_f = weights
    half = EXPERTS // 2
    x, topk_weights, ids = _batch(130, seed=5)
    out = moe.fused_moe(x, w13[half:], w2[half:], topk_weights, ids, half)
    ref = _loop(x, topk_weights, ids, w13_f[half:], w2_f[half:], half)
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("tokens", [1, 130, 4096])
def test_fused_moe_with_biases_and_the_clamped_swiglu_matches_the_loop(weights, tokens):
    """gpt-oss's experts: biases on gate_up and down, the clamped SwiGLU (a limit of 1, which these activations
    pass), in bf16 against the loop in float32, and inside a CUDA graph."""
    import functools

    from worker_svc.kernels import elementwise

    w13, w2, w13_f, w2_f = weights
    gen = torch.Generator().manual_seed(7)
    b13, b2 = torch.randn(EXPERTS, 2 * INTER, generator=gen) * 0.5, torch.randn(EXPERTS, HIDDEN, generator=gen) * 0.5
    x, topk_weights, ids = _batch(tokens, seed=tokens + 2)
    ref = reference.fused_moe(x.float(), w13_f, w2_f, topk_weights.float(), ids, b13=b13.cuda(), b2=b2.cuda(),
                              act=functools.partial(reference.clamped_swiglu, limit=1.0))
    plain = _loop(x, topk_weights, ids, w13_f, w2_f)
    assert (ref - plain).abs().max() > 0.1
    call = functools.partial(moe.fused_moe, x, w13, w2, topk_weights, ids, b13=b13.to("cuda", torch.bfloat16),
                             b2=b2.to("cuda", torch.bfloat16), act=functools.partial(elementwise.clamped_swiglu,
                                                                                     limit=1.0))
    torch.testing.assert_close(call().float(), ref, atol=3e-2, rtol=3e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = call()
    graph.replay()
    torch.testing.assert_close(replayed.float(), ref, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("block_m", [16, 32, 64, 128])
@pytest.mark.parametrize("tokens", [1, 130, 4096])
def test_moe_align_matches_a_stable_sort_by_expert(tokens, block_m):
    ids = torch.rand(tokens, EXPERTS, generator=torch.Generator().manual_seed(tokens)).argsort(-1)[:, :TOP_K]
    for first, local in ((0, EXPERTS), (EXPERTS // 2, EXPERTS // 2)):
        slots, block_expert = moe.align(ids.cuda(), first, local, block_m)
        ref_slots, ref_blocks = align_by_sorting(ids, first, local, block_m, slots.numel())
        assert torch.equal(slots.cpu(), ref_slots) and torch.equal(block_expert.cpu(), ref_blocks)


@pytest.mark.parametrize("tokens", [1, 130, 16384])
def test_router_topk_kernel_makes_a_valid_choice_in_bf16(tokens):
    """bf16 router logits (equal values are common at 128 experts): a valid top-8 with its renormalised weights,
    also replayed in a CUDA graph for new logits."""
    gen = torch.Generator().manual_seed(tokens)
    logits = (torch.randn(tokens, EXPERTS, generator=gen) * 2).to("cuda", torch.bfloat16)
    weights, ids = moe.router_topk(logits, TOP_K, True)
    check_router_choice(logits, weights, ids, True, 1e-2)
    if tokens > GRAPH_TOKENS:
        return
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = moe.router_topk(logits, TOP_K, True)
    logits.copy_((torch.randn(tokens, EXPERTS, generator=gen) * 2).to("cuda", torch.bfloat16))
    graph.replay()
    check_router_choice(logits, *replayed, True, 1e-2)


@pytest.mark.parametrize("tokens", [1, 130, 16384])
@pytest.mark.parametrize("sigmoid", [True, False])
def test_router_topk_kernel_with_a_bias_matches_the_reference(tokens, sigmoid):
    """DeepSeek-V3's choice (GLM-4.5's sigmoid scores, ERNIE 4.5's softmax ones) on the GPU, float32 logits as the
    router computes them: the reference's experts and weights, with groups as a per-token -inf bias, and the same in a
    CUDA graph replayed for new logits."""
    gen = torch.Generator().manual_seed(tokens)
    logits = torch.randn(tokens, EXPERTS, generator=gen).cuda()
    bias = (torch.randn(EXPERTS, generator=gen) * 0.1).expand(tokens, EXPERTS).clone()
    bias[:, : EXPERTS // 2] = float("-inf")
    bias = bias.cuda()

    def check(weights, ids):
        ref_weights, ref_ids = reference.router_topk(logits, TOP_K, True, sigmoid=sigmoid, bias=bias, scale=2.5)
        assert torch.equal(ids, ref_ids) and bool((ids >= EXPERTS // 2).all())
        torch.testing.assert_close(weights, ref_weights, atol=1e-5, rtol=1e-5)

    check(*moe.router_topk(logits, TOP_K, True, sigmoid=sigmoid, bias=bias, scale=2.5))
    if tokens > GRAPH_TOKENS:
        return
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = moe.router_topk(logits, TOP_K, True, sigmoid=sigmoid, bias=bias, scale=2.5)
    logits.copy_(torch.randn(tokens, EXPERTS, generator=gen).cuda())
    graph.replay()
    check(*replayed)

