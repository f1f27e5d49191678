"""Packed integer groups on the GPU (kernels/int_gemm.py: the weight dequantised by a Triton kernel, then cuBLAS)
against the weights reference.dequantize_ints gives, and a runner serving a GPTQ checkpoint's packed projections
(`--quantization packed`): under CUDA graphs and eager alike, the tokens of the same weights dequantised as they load.
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


CASES = [(n, k, bits, group) for n, k in ((256, 512), (6144, 4096))
         for bits, group in ((4, 128), (4, 32), (8, 128), (2, 64), (4, -1))] + [(256, 384, 4, 96)]  # the last: torch's


@pytest.mark.parametrize("rows", [1, 16, 65, 2048])
@pytest.mark.parametrize("n,k,bits,group", CASES)
def test_the_kernel_dequantises_as_the_reference_and_cublas_multiplies(rows, n, k, bits, group):
    from worker_svc.kernels import int_gemm

    gen = torch.Generator().manual_seed(rows + bits)
    words, zero, scale = _packed(n, k, bits, group, gen)
    x = torch.randn(rows, k, generator=gen).to("cuda", torch.bfloat16)
    bias = torch.randn(n, generator=gen).to("cuda", torch.bfloat16)
    weight = reference.dequantize_ints(words, zero, scale, bits).to(torch.bfloat16)  # the weight the loader stores
    if int_gemm.supported(k, scale.shape[1]):
        assert torch.equal(int_gemm.dequantize(words, zero, scale, k, torch.bfloat16), weight)
    assert torch.equal(int_gemm.linear(x, words, zero, scale, bias), torch.nn.functional.linear(x, weight, bias))


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
    assert tokens[0] == tokens[1] == tokens[2]  # the same bfloat16 weights, multiplied by cuBLAS
