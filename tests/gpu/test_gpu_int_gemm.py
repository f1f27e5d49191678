"""Packed integer groups on the GPU (kernels/int_gemm.py: up to FUSED_ROWS rows the fused kernel, past them the weight
dequantised by a Triton kernel, then cuBLAS) against the weights reference.dequantize_ints gives, and a runner serving
a GPTQ checkpoint's packed projections (`--quantization packed`): the same tokens under CUDA graphs and eagerly, and
near those of the same weights dequantised as they load. Run: pytest tests/gpu (skipped without a CUDA GPU)."""
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


CASES = [(n, k, bits, group) for n, k in ((256, 512), (6144, 4096))
         for bits, group in ((4, 128), (4, 32), (8, 128), (2, 64), (4, -1))] + [(256, 384, 4, 96)]  # the last: torch's


@pytest.mark.parametrize("rows", [1, 2, 16, 32, 33, 2048])
@pytest.mark.parametrize("n,k,bits,group", CASES)
def test_the_kernels_multiply_as_the_reference(rows, n, k, bits, group):
    """Past FUSED_ROWS: the weight dequantised as the reference does, then cuBLAS, bit for bit. Up to it, where the
    fused kernel takes the weight: the float64 product of the exact weight, to within the output's rounding, and no
    further from it than the product over the weight rounded to bfloat16."""
    from worker_svc.kernels import int_gemm, split_k

    gen = torch.Generator().manual_seed(rows + bits)
    words, zero, scale = _packed(n, k, bits, group, gen)
    x = torch.randn(rows, k, generator=gen).to("cuda", torch.bfloat16)
    bias = torch.randn(n, generator=gen).to("cuda", torch.bfloat16)
    exact = reference.dequantize_ints(words, zero, scale, bits)
    weight = exact.to(torch.bfloat16)  # the weight the loader stores
    if int_gemm.supported(k, scale.shape[1]):
        assert torch.equal(int_gemm.dequantize(words, zero, scale, k, torch.bfloat16), weight)
    y = int_gemm.linear(x, words, zero, scale, bias)
    dequantised = torch.nn.functional.linear(x, weight, bias)
    if rows > int_gemm.FUSED_ROWS or not int_gemm.fused_fits(k, scale.shape[1], bits):
        assert torch.equal(y, dequantised)
        return
    want = x.double() @ exact.double().T + bias.double()
    err, err_dequantised = (y.double() - want).abs().max().item(), (dequantised.double() - want).abs().max().item()
    assert err <= 2 ** -7 * want.abs().max().item() and err <= err_dequantised * 1.25 + 1e-3, (err, err_dequantised)
    assert not split_k.counters(x.device).any()
    graph = torch.cuda.CUDAGraph()  # captured: the same values, counters back at zero after each replay
    with torch.cuda.graph(graph):
        captured = int_gemm.linear(x, words, zero, scale, bias)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, y) and not split_k.counters(x.device).any()


def test_a_runner_with_packed_projections_decodes_as_over_the_dequantised_weights(tmp_path):
    from common.limits import Limits
    from tests.paged_driver import PagedDriver
    from tests.quantized_checkpoints import gptq_folder
    from worker_svc.checkpoints.writer import make_model
    from worker_svc.runtime.model_runner import ModelRunner, RunnerConfig

    folder = gptq_folder(make_model("qwen3-0.6b", tmp_path / "model", seed=0, num_layers=2), tmp_path / "gptq",
                         group_size=128)
    tokens = []
    for quantization, graphs in (("packed", True), ("packed", False), ("auto", True)):
        runner = ModelRunner(folder, RunnerConfig(device="cuda", quantization=quantization, cuda_graphs=graphs,
                                                  num_blocks=64, limits=Limits(max_num_seqs=8)))
        assert runner.packed_linears == (2 * 4 if quantization == "packed" else 0)
        driver = PagedDriver(runner)
        seqs = [driver.add([5 + i, 17, 400 + 3 * i, 9] * (i + 1), 24) for i in range(6)]
        driver.run_all()
        tokens.append([s.generated for s in seqs])
    assert tokens[0] == tokens[1]  # the fused kernel's fixed order of sums, in graphs and eagerly
    # against the weights dequantised to bfloat16: the product differs by rounding, which random weights can carry
    # to a token now and then
    pairs = [(a, b) for packed, dequantised in zip(tokens[0], tokens[2]) for a, b in zip(packed, dequantised)]
    print(f"packed tokens equal to the dequantised model's: {sum(a == b for a, b in pairs)} of {len(pairs)}")
    assert sum(a == b for a, b in pairs) >= 0.8 * len(pairs)
