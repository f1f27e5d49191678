"""Packed integer groups on the GPU (kernels/int_gemm.py: the fused kernel up to SMALL_M rows, dequantise + cuBLAS
above) against the weights reference.dequantize_ints gives, and a runner serving a GPTQ checkpoint's packed
projections: under CUDA graphs as eager, and its prefills as the same weights dequantised at load serve them.
Run: pytest tests/gpu (skipped without a CUDA GPU)."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from worker_svc.kernels import reference  # noqa: E402
from worker_svc.model.packed_ints import pack  # noqa: E402


def _packed(n: int, k: int, bits: int, group: int, gen: torch.Generator):
    groups = 1 if group == -1 else k // group
    codes = torch.randint(0, 2 ** bits, (n, k), generator=gen)
    zero = torch.randint(0, 2 ** bits, (n, groups), generator=gen).float()
    scale = torch.rand(n, groups, generator=gen) * 0.02 / 2 ** (bits - 4)
    return pack(codes, bits).cuda(), zero.cuda(), scale.cuda()


@pytest.mark.parametrize("rows", [1, 5, 16, 33, 64, 65, 2048])
@pytest.mark.parametrize("n,k", [(256, 512), (6144, 4096)])
@pytest.mark.parametrize("bits,group", [(4, 128), (4, 32), (8, 128), (2, 64), (4, -1)])
def test_the_kernels_multiply_the_dequantised_weight(rows, n, k, bits, group):
    from worker_svc.kernels import int_gemm

    gen = torch.Generator().manual_seed(rows + bits)
    words, zero, scale = _packed(n, k, bits, group, gen)
    x = torch.randn(rows, k, generator=gen).to("cuda", torch.bfloat16)
    bias = torch.randn(n, generator=gen).to("cuda", torch.bfloat16)
    weight = reference.dequantize_ints(words, zero, scale, bits).to(torch.bfloat16)  # the weight the loader stores
    y = int_gemm.linear(x, words, zero, scale, bias)
    expected = x.float() @ weight.float().t() + bias.float()
    assert y.shape == (rows, n) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), expected, rtol=1.6e-2, atol=1e-2 * expected.abs().mean().item())
    assert torch.equal(int_gemm.dequantize(words, zero, scale, k, torch.bfloat16), weight)


def test_a_runner_with_packed_projections_decodes_under_graphs_as_eager_and_prefills_as_dequantised(tmp_path):
    from common.limits import Limits
    from tests.paged_driver import PagedDriver
    from tests.quantized_checkpoints import gptq_folder
    from worker_svc.checkpoints.writer import make_model
    from worker_svc.runtime.model_runner import ModelRunner, RunnerConfig

    folder = gptq_folder(make_model("qwen3-0.6b", tmp_path / "model", seed=0, num_layers=2), tmp_path / "gptq",
                         group_size=128)
    tokens, firsts = [], []
    for quantization, graphs in (("auto", True), ("auto", False), ("none", False)):
        runner = ModelRunner(folder, RunnerConfig(device="cuda", quantization=quantization, cuda_graphs=graphs,
                                                  num_blocks=64, limits=Limits(max_num_seqs=8)))
        assert runner.packed_linears == (2 * 4 if quantization == "auto" else 0)
        driver = PagedDriver(runner)
        seqs = [driver.add([5 + i, 17, 400 + 3 * i, 9] * (20 + i), 24) for i in range(6)]  # > 64 prompt rows a step
        driver.run_all()
        tokens.append([s.generated for s in seqs])
        firsts.append([s.generated[0] for s in seqs])
    assert tokens[0] == tokens[1]
    assert firsts[0] == firsts[2]  # the prefill multiplies the same bfloat16 weights with cuBLAS
