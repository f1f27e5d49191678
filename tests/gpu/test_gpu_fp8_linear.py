"""FP8 projections on the GPU (kernels/fp8_gemm.py: the Triton input quantiser and cuBLAS's block-scaled GEMM)
against reference.fp8_linear, and a runner serving FP8 projections under CUDA graphs against the same runner eager.
Run: pytest tests/gpu (skipped without a CUDA GPU, or one without the block-scaled GEMM)."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from worker_svc.checkpoints.writer import quantize_fp8_blocks  # noqa: E402
from worker_svc.kernels import reference  # noqa: E402
from worker_svc.model.quantized import fp8_gemms  # noqa: E402

_NEEDS_FP8 = pytest.mark.skipif(not torch.cuda.is_available() or not fp8_gemms(torch.device("cuda")),
                                reason="no block-scaled FP8 GEMM here (sm_90, CUDA >= 12.9)")


@_NEEDS_FP8
@pytest.mark.parametrize("rows", [1, 3, 16, 129, 2048])
@pytest.mark.parametrize("n,k", [(256, 512), (6144, 4096), (4096, 14336)])
def test_the_quantiser_and_the_gemm_match_the_reference(rows, n, k):
    from worker_svc.kernels import fp8_gemm

    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, k, generator=gen) * torch.rand(1, k, generator=gen) * 4).to("cuda", torch.bfloat16)
    q, scale = fp8_gemm.quantize_rows(x)
    q_ref, scale_ref = reference.quantize_rows(x)
    assert q.shape[0] == -(-rows // 4) * 4 and q[rows:].float().eq(0).all()
    torch.testing.assert_close(scale[:rows], scale_ref, rtol=1e-6, atol=0)
    assert (q[:rows].view(torch.uint8) == q_ref.view(torch.uint8)).float().mean() > 0.999  # a division's last bit

    codes, w_scale = quantize_fp8_blocks(torch.randn(n, k, generator=gen) * 0.02, (128, 128))
    codes, w_scale = codes.cuda(), w_scale.cuda()
    bias = torch.randn(n, generator=gen).to("cuda", torch.bfloat16)
    y = fp8_gemm.linear(x, codes, w_scale, bias)
    expected = reference.fp8_linear(x.float(), codes, w_scale, bias).float()
    assert y.shape == (rows, n) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), expected, rtol=2e-2, atol=2e-2 * expected.abs().mean().item())


@_NEEDS_FP8
def test_a_runner_with_fp8_projections_decodes_under_graphs_as_eager(tmp_path):
    from common.limits import Limits
    from tests.paged_driver import PagedDriver
    from worker_svc.checkpoints.writer import make_model
    from worker_svc.runtime.model_runner import ModelRunner, RunnerConfig

    # every projection's input whole 4 blocks wide (fp8_gemm.K_BLOCKS): qwen3-small's 128-wide ones stay 16-bit here
    model = make_model("qwen3-0.6b", tmp_path / "model", seed=0, num_layers=2)
    tokens = []
    for graphs in (True, False):
        runner = ModelRunner(model, RunnerConfig(device="cuda", quantization="fp8", cuda_graphs=graphs,
                                                 num_blocks=64, limits=Limits(max_num_seqs=8)))
        assert runner.fp8_linears == 2 * 4
        driver = PagedDriver(runner)
        seqs = [driver.add([5 + i, 17, 400 + 3 * i, 9] * (i + 1), 24) for i in range(6)]
        driver.run_all()
        tokens.append([s.generated for s in seqs])
    assert tokens[0] == tokens[1]
