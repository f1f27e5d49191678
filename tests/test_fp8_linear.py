"""FP8 projections (`--quantization`, model/quantized.py, kernels/fp8_gemm.py and its reference) on a CPU, qwen3-small
in float32 over the torch kernels (every projection of 128 x 128 blocks):

- the reference linear quantises its input per token and 128 columns, each group's largest magnitude at e4m3's 448,
  and multiplies what the codes and scales say;
- a runner with FP8 projections computes what the 16-bit model computes with each projection's weight and input
  rounded through those blocks and groups (the quantisation is the only change), and differs from the 16-bit model;
- a MoE's experts likewise (each expert GEMM's input rounded as a projection's);
- projections are built unallocated and given FP8 storage where they are whole blocks, 16-bit elsewhere; loading
  stages each through a buffer of its own, dropped once its last part is in;
- an FP8 checkpoint's projections and experts keep its codes and scales (a 16-bit model too); `auto` on a CPU serves it
  dequantised as before;
- weights read again into FP8 projections (RL weight updates) serve what a fresh load of them does.
The GPU's kernel against this reference: tests/gpu/test_gpu_fp8_linear.py.
"""
from __future__ import annotations

import dataclasses
import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.limits import Limits
from tests.paged_driver import prefill_logits
from worker_svc.checkpoints.writer import make_model, quantize_fp8_blocks
from worker_svc.kernels import reference
from worker_svc.model.moe import ExpertWeights, SparseMoE
from worker_svc.model.parallel import (ColumnParallelLinear, ReplicatedLinear, RowParallelLinear,
                                       deferred_projections)
from worker_svc.model.quantized import StagedFp8, allocate_projections, dequantize_fp8_blocks, gemm_fault
from worker_svc.runtime.model_runner import ModelRunner, RunnerConfig

pytestmark = pytest.mark.timeout(300)

FP8 = torch.float8_e4m3fn
PROJECTIONS = (ColumnParallelLinear, RowParallelLinear, ReplicatedLinear)


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    return make_model("qwen3-small", tmp_path_factory.mktemp("fp8_linear") / "model", seed=0)


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    return make_model("qwen3-moe-fp8", tmp_path_factory.mktemp("fp8_moe") / "model", seed=0)


def _runner(model_dir, quantization: str, dtype: str = "float32") -> ModelRunner:
    return ModelRunner(model_dir, RunnerConfig(device="cpu", dtype=dtype, block_size=16, num_blocks=64,
                                               limits=Limits(max_num_seqs=4), quantization=quantization))


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(0, 150000) for _ in range(n)] for n in (40, 90, 17)]


def test_the_reference_quantises_each_group_of_its_input_and_multiplies_what_the_codes_say():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 384, generator=gen) * torch.tensor([1.0, 50.0, 1e-3]).repeat_interleave(128)
    q, scale = reference.quantize_rows(x)
    assert q.dtype == FP8 and scale.shape == (5, 3)
    torch.testing.assert_close(scale, x.unflatten(-1, (3, 128)).abs().amax(-1) / 448)
    back = (q.float().unflatten(-1, (3, 128)) * scale[..., None]).flatten(-2)
    assert ((back - x).abs() <= x.abs() / 16 + scale.repeat_interleave(128, -1) * 2 ** -9).all()  # e4m3's step

    w = torch.randn(256, 384, generator=gen) * 0.02
    codes, w_scale = quantize_fp8_blocks(w, (128, 128))
    bias = torch.randn(256, generator=gen)
    y = reference.linear(x, codes, bias, w_scale)
    expected = back @ dequantize_fp8_blocks(codes, w_scale, (128, 128)).t() + bias
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    exact = x @ w.t() + bias
    assert 1e-3 < ((y - exact).norm() / exact.norm()).item() < 0.05


def test_projections_built_deferred_are_allocated_fp8_where_whole_blocks_and_16_bit_elsewhere():
    with deferred_projections():
        layers = torch.nn.ModuleList([ReplicatedLinear(256, 128, None), ReplicatedLinear(256, 100, None),
                                      ColumnParallelLinear(128, 384, None), RowParallelLinear(384, 128, None)])
    assert all(layer.weight.is_meta for layer in layers)  # nothing allocated before its storage is known
    layers[2].absorbed = True  # MLA's kv_b_proj: read as a tensor, never run as a linear
    assert allocate_projections(layers, torch.device("cpu"), torch.bfloat16) == 2
    assert [layer.weight.dtype for layer in layers] == [FP8, torch.bfloat16, torch.bfloat16, FP8]
    assert layers[2].weight.weight_loader == layers[2].weight_loader  # its loader kept
    assert layers[0].weight_scale.shape == (1, 2) and layers[3].weight_scale.shape == (1, 3)
    assert layers[1].weight_scale is None and ReplicatedLinear(256, 128, None).weight.dtype == torch.float32


def test_on_a_gpu_only_inputs_of_whole_four_blocks_take_fp8():
    """cuBLAS reads a weight's scales in rows padded to 4 blocks where torch's check wants them packed (fp8_gemm.py:
    K_BLOCKS): a linear 256 or 384 wide stays 16-bit there, one 512 wide does not."""
    with deferred_projections():
        layers = torch.nn.ModuleList([ReplicatedLinear(256, 128, None), RowParallelLinear(384, 128, None),
                                      ColumnParallelLinear(512, 256, None)])
    assert allocate_projections(layers, torch.device("cpu"), torch.bfloat16, k_blocks=4) == 1
    assert [layer.weight.dtype for layer in layers] == [torch.bfloat16, torch.bfloat16, FP8]
    assert layers[2].weight_scale.shape == (2, 4)


def test_the_start_up_trial_passes_a_right_product_and_names_a_wrong_one():
    """fp8_gemms' check of the GPU's GEMM (quantized.gemm_fault), here over the reference: right, it passes; reading
    each row of block scales padded to 4 where they are packed (the fault torch 2.11's cuBLAS call had at widths of
    fewer than 4 blocks), or failing, it says why."""
    cpu = torch.device("cpu")
    assert gemm_fault(reference.fp8_linear, cpu, 4) == gemm_fault(reference.fp8_linear, cpu, 1) == ""

    def padded_rows(x, weight, scale):  # row r of scales read at r * 4, as if padded, past them whatever lies there
        memory = torch.cat([scale.flatten(), torch.zeros(4 * scale.shape[0])])
        rows = torch.arange(scale.shape[0])[:, None] * max(4, scale.shape[1]) + torch.arange(scale.shape[1])
        return reference.fp8_linear(x, weight, memory[rows])

    assert gemm_fault(padded_rows, cpu, 4) == ""  # whole 4 blocks: the two layouts are one
    assert gemm_fault(padded_rows, cpu, 1) == "a wrong product ([128.0, 0.0] for [128.0, 256.0])"

    def refused(x, weight, scale):
        raise RuntimeError("no block-scaled GEMM in this build")

    assert gemm_fault(refused, cpu, 4) == "no block-scaled GEMM in this build"


def test_an_fp8_model_loads_each_projection_through_its_own_buffer_and_keeps_none(small_model, monkeypatch):
    live, most = set(), [0]
    target, finish = StagedFp8.target, StagedFp8.finish

    def tracked_target(staged):
        live.add(id(staged))
        most[0] = max(most[0], len(live))
        return target(staged)

    def tracked_finish(staged):
        finish(staged)
        live.discard(id(staged))

    monkeypatch.setattr(StagedFp8, "target", tracked_target)
    monkeypatch.setattr(StagedFp8, "finish", tracked_finish)
    runner = _runner(small_model, "fp8")
    projections = [m for m in runner.model.modules() if isinstance(m, PROJECTIONS) and m.weight_scale is not None]
    assert len(projections) == runner.fp8_linears == 16
    assert not live and all(m.weight.staged.buffer is None for m in projections)
    # the checkpoint stores q, k and v (and gate and up) apart, a layer's tensors in name order: a packed projection
    # waits for its last part while the one between (o_proj, or down_proj) loads, never more
    assert most[0] == 2


def _rounded(x: torch.Tensor) -> torch.Tensor:
    """x through its 1 x 128 groups' e4m3 codes and back: what an FP8 GEMM reads of its input."""
    q, scale = reference.quantize_rows(x)
    return (q.float().unflatten(-1, (-1, 128)) * scale[..., None]).flatten(-2).to(x.dtype)


def _moe_over_rounded_inputs(x, w13, w2, *args, act=None, **kwargs):
    rounded_act = lambda t: _rounded((act or reference.silu_and_mul)(t))  # noqa: E731
    return reference.fused_moe(_rounded(x), w13, w2, *args, act=rounded_act, **kwargs)


@pytest.mark.parametrize("which, count", [("small_model", 4 * 4), ("moe_model", 2 * 4)])
def test_fp8_projections_compute_the_16_bit_model_over_rounded_weights_and_inputs(which, count, request):
    """qkv, o, gate_up and down of each layer (the MoE's experts as two weights), their inputs quantised too."""
    model = request.getfixturevalue(which)
    prompts = _prompts()
    fp8 = _runner(model, "fp8")
    assert fp8.fp8_linears == count
    emulated, plain = _runner(model, "none"), _runner(model, "none")
    assert emulated.fp8_linears == 0
    assert (fp8.describe().projection_dtype, plain.describe().projection_dtype) == ("float8_e4m3fn", "float32")
    for module in emulated.model.modules():
        if isinstance(module, PROJECTIONS):
            codes, scale = quantize_fp8_blocks(module.weight.data, (128, 128))
            module.weight.data = dequantize_fp8_blocks(codes, scale, (128, 128))
            module.register_forward_pre_hook(lambda _, args: (_rounded(args[0]),))
        elif isinstance(module, ExpertWeights):
            for w in module.weight.data:
                w.copy_(dequantize_fp8_blocks(*quantize_fp8_blocks(w, (128, 128)), (128, 128)))
        elif isinstance(module, SparseMoE):
            module.kernels = dataclasses.replace(module.kernels, fused_moe=_moe_over_rounded_inputs)
    ours = torch.cat(prefill_logits(fp8, prompts))
    torch.testing.assert_close(ours, torch.cat(prefill_logits(emulated, prompts)), rtol=1e-4, atol=1e-4)
    assert (ours - torch.cat(prefill_logits(plain, prompts))).abs().max() > 1e-2


def _fp8_checkpoint(folder, out):
    """The model's checkpoint as Qwen3's -FP8 ones are published: every projection in e4m3 with its 128 x 128 blocks'
    weight_scale_inv."""
    shutil.copytree(folder, out)
    tensors = {}
    for name, t in load_file(out / "model.safetensors").items():
        if name.endswith("_proj.weight"):
            tensors[name], tensors[f"{name}_scale_inv"] = quantize_fp8_blocks(t, (128, 128))
        else:
            tensors[name] = t
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    (out / "config.json").write_text(json.dumps(config))
    return tensors


def test_an_fp8_checkpoints_projections_keep_its_codes_and_scales(small_model, tmp_path):
    stored = _fp8_checkpoint(small_model, tmp_path / "fp8")
    assert _runner(tmp_path / "fp8", "auto").fp8_linears == 0  # no FP8 GEMM on a CPU: dequantised, as before
    runner = _runner(tmp_path / "fp8", "fp8", dtype="bfloat16")  # staged in float32 whatever the model's dtype
    attention, mlp = runner.model.layers[1].self_attn, runner.model.layers[1].mlp
    # (k and v, 64 rows each, share one block of qkv's rows here: each came with a scale of its own, so their codes
    # change; at head_dim 128 every head is a block of its own)
    parts = {"q_proj": (attention.qkv_proj, 0), "o_proj": (attention.o_proj, 0), "gate_proj": (mlp.gate_up_proj, 0),
             "up_proj": (mlp.gate_up_proj, 256), "down_proj": (mlp.down_proj, 0)}
    for name, (module, row) in parts.items():
        prefix = f"model.layers.1.{'self_attn' if name[0] in 'qkvo' else 'mlp'}.{name}.weight"
        codes, scale = stored[prefix], stored[f"{prefix}_scale_inv"]
        assert torch.equal(module.weight[row:row + codes.shape[0]].view(torch.uint8), codes.view(torch.uint8)), name
        mine = module.weight_scale[row // 128:(row + codes.shape[0]) // 128, :scale.shape[1]]
        torch.testing.assert_close(mine, scale, rtol=2 ** -20, atol=0)


def test_an_fp8_checkpoints_experts_keep_its_codes_and_scales(moe_model, tmp_path):
    stored = _fp8_checkpoint(moe_model, tmp_path / "fp8")
    experts = _runner(tmp_path / "fp8", "fp8", dtype="bfloat16").model.layers[1].mlp.experts
    assert experts.gate_up_proj.weight.dtype == experts.down_proj.weight.dtype == FP8
    for e in (0, 5):
        for name, (weights, row) in {"gate_proj": (experts.gate_up_proj, 0), "up_proj": (experts.gate_up_proj, 128),
                                     "down_proj": (experts.down_proj, 0)}.items():
            prefix = f"model.layers.1.mlp.experts.{e}.{name}.weight"
            codes, scale = stored[prefix], stored[f"{prefix}_scale_inv"]
            rows = slice(row, row + codes.shape[0])
            assert torch.equal(weights.weight[e, rows].view(torch.uint8), codes.view(torch.uint8)), name
            mine = weights.weight_scale[e, rows.start // 128:rows.stop // 128, :scale.shape[1]]
            torch.testing.assert_close(mine, scale, rtol=2 ** -20, atol=0)


def test_weights_read_again_into_fp8_projections_serve_what_a_fresh_load_of_them_does(small_model, tmp_path):
    other = make_model("qwen3-small", tmp_path / "other", seed=1)
    runner = _runner(small_model, "fp8")
    weight = runner.model.layers[0].mlp.down_proj.weight
    address = weight.data_ptr()
    assert runner.reload_weights(str(other)) == ""
    assert weight.data_ptr() == address and weight.dtype == FP8  # the same memory: CUDA graphs read it
    prompts = _prompts()
    torch.testing.assert_close(torch.cat(prefill_logits(runner, prompts)),
                               torch.cat(prefill_logits(_runner(other, "fp8"), prompts)), rtol=0, atol=0)
