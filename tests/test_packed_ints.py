"""Projections served in a checkpoint's packed integer groups (model/packed_ints.py) on the CPU: the layout's packing,
which projections can hold it (whole groups in every tensor-parallel shard), what they hold (a quarter of a 16-bit
weight's bytes at 4 bits), LoRA adapters over them, and weights read again in place. That each format serves its
dequantised weights' logits bit for bit is in test_awq.py, test_gptq.py and test_compressed_tensors.py
(assert_served_packed); tensor parallelism in test_tensor_parallel.py; the GPU kernel in tests/gpu."""
from __future__ import annotations

import pytest
import torch

from common.limits import Limits
from tests.paged_driver import prefill_logits
from tests.quantized_checkpoints import gptq_folder, prompts
from worker_svc.checkpoints.writer import make_model
from worker_svc.kernels import Kernels, reference, select
from worker_svc.model import parallel
from worker_svc.model.packed_ints import fits, pack
from worker_svc.runtime.model_runner import ModelRunner, RunnerConfig

pytestmark = pytest.mark.timeout(300)


def _runner(folder, quantization: str = "packed", **kw) -> ModelRunner:
    return ModelRunner(folder, RunnerConfig(device="cpu", dtype="float32", block_size=16, num_blocks=64,
                                            limits=Limits(max_num_seqs=4), quantization=quantization, **kw))


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_codes_pack_along_the_columns_the_first_lowest(bits):
    codes = torch.randint(0, 2 ** bits, (3, 64), generator=torch.Generator().manual_seed(bits))
    words = pack(codes, bits)
    assert words.dtype == torch.int32 and words.shape == (3, 64 * bits // 32)
    assert torch.equal(reference.unpack_ints(words, bits), codes)
    assert (words[0, 0].item() & (2 ** bits - 1)) == codes[0, 0]  # the first code in the lowest bits


def test_dequantised_groups_are_code_less_zero_times_scale():
    codes = torch.tensor([[0, 1, 2, 3, 15, 14, 13, 12]])
    zero, scale = torch.tensor([[1.0, 8.0]]), torch.tensor([[0.5, 2.0]])
    weight = reference.dequantize_ints(pack(codes, 4), zero, scale, 4)
    assert weight.tolist() == [[-0.5, 0.0, 0.5, 1.0, 14.0, 12.0, 10.0, 8.0]]
    x = torch.randn(5, 8)
    torch.testing.assert_close(reference.linear(x, pack(codes, 4), None, scale, zero), x @ weight.t(), rtol=0,
                               atol=0)


def test_a_row_parallel_shard_must_hold_whole_groups(monkeypatch):
    kernels: Kernels = select("cpu")
    monkeypatch.setattr(parallel, "tp_size", lambda: 2)
    monkeypatch.setattr(parallel, "tp_rank", lambda: 0)
    row, column = parallel.RowParallelLinear(256, 64, kernels), parallel.ColumnParallelLinear(256, 64, kernels)
    assert row.input_size == 128 and column.input_size == 256
    assert fits(row, 128, 2) and fits(column, 128, 2)
    assert not fits(row, 256, 2) and fits(column, 256, 2)  # a group across both ranks' columns
    assert not fits(row, -1, 2) and fits(column, -1, 2)  # one group a row: the same
    assert not fits(parallel.VocabParallelEmbedding(64, 32), 32, 2)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("packed")
    source = make_model("qwen3-small", tmp / "src", seed=0)
    return source, gptq_folder(source, tmp / "gptq"), gptq_folder(make_model("qwen3-small", tmp / "src2", seed=1),
                                                                    tmp / "gptq2")


def test_packed_projections_hold_a_quarter_of_16_bit_weights_bytes(folders):
    source, folder, _ = folders
    packed, dense = _runner(folder), _runner(folder, quantization="auto")
    assert packed.packed_linears == 4 * 4 and dense.packed_linears == 0
    for name, module in packed.model.named_modules():
        if getattr(module, "weight_zero", None) is None:
            continue
        weight = dense.model.get_submodule(name).weight
        rows, cols = weight.shape
        assert module.weight.dtype == torch.int32 and module.weight.shape == (rows, cols // 8)
        assert module.weight_scale.shape == module.weight_zero.shape == (rows, cols // 32)
        # 4 bits a weight and 2 x 32 bits a group of 32 against 16 bits: (4 + 2) / 16
        stored = sum(p.numel() * p.element_size() for p in (module.weight, module.weight_scale, module.weight_zero))
        assert stored * 16 == weight.numel() * 2 * (4 + 2)


def test_lora_slots_over_packed_projections_take_their_input_width(folders):
    _, folder, _ = folders
    runner = _runner(folder, enable_lora=True, max_loras=1, max_lora_rank=8)
    adapted = {name: m for name, m in runner.model.named_modules() if getattr(m, "lora", None) is not None}
    assert len(adapted) == 4 * 4
    for module in adapted.values():
        assert module.weight.dtype == torch.int32 and module.lora.a.shape[1] == module.input_size
    assert torch.equal(torch.cat(prefill_logits(runner, prompts())), torch.cat(prefill_logits(_runner(folder),
                                                                                              prompts())))


def test_packed_weights_read_again_in_place_serve_the_new_checkpoints_logits(folders):
    source, folder, other = folders
    runner = _runner(folder)
    words = runner.model.layers[0].mlp.down_proj.weight
    before = words.clone()
    assert "packed integer groups" in runner.reload_weights(str(source))  # 16-bit weights: refused untouched
    assert torch.equal(words, before)
    assert runner.reload_weights(str(other)) == ""
    assert runner.model.layers[0].mlp.down_proj.weight is words  # the same memory (CUDA graphs keep reading it)
    assert torch.equal(torch.cat(prefill_logits(runner, prompts())), torch.cat(prefill_logits(_runner(other),
                                                                                             prompts())))
