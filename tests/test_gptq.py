"""GPTQ checkpoints (model/gptq.py): qwen3-small's projections quantized and packed by this test in the layouts
AutoGPTQ and GPTQModel write (`checkpoint_format` gptq, zero points stored less one, and gptq_v2), 2, 4 and 8 bits,
groups in row order or in activation order (`desc_act`: g_idx a permutation's), symmetric and not. Every weight the
worker reads is the test's own (code - zero) * scale of the row's group, bit for bit, and the served logits are
transformers' over a float checkpoint of those weights (within float32's rounding). transformers reads
GPTQ itself only through gptqmodel, which does not install on a CPU-only machine."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.quantized_checkpoints import assert_served_packed, assert_serves_transformers_logits, quantized_folder, serve
from worker_svc.checkpoints.writer import make_model
from worker_svc.model.gptq import Gptq

pytestmark = pytest.mark.timeout(300)

CASES = {  # checkpoint_format, bits, group_size, symmetric, activation order
    "gptq int4 sym": ("gptq", 4, 32, True, False),  # Qwen's -GPTQ-Int4 models' layout
    "gptq int8 sym desc_act": ("gptq", 8, 32, True, True),
    "gptq_v2 int4 asym desc_act": ("gptq_v2", 4, 32, False, True),
    "gptq int2 one group": ("gptq", 2, -1, True, False),
}


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[rows, cols] codes -> int32 [rows * bits / 32, cols]: 32 / bits consecutive rows a word, the first lowest."""
    per = 32 // bits
    words = (codes.to(torch.int64).unflatten(0, (-1, per)) << (torch.arange(per) * bits)[:, None]).sum(1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def quantize(weight: torch.Tensor, bits: int, group_size: int, symmetric: bool, order: torch.Tensor | None):
    """weight [out, in] -> codes [in, out], zeros and scales [groups, out], g_idx [in]: min-max per group of input
    rows, the groups taken in `order` of the rows where given (as desc_act takes them by activation)."""
    rows, maxq = weight.shape[1], 2 ** bits - 1
    size = rows if group_size == -1 else group_size
    rank = torch.empty(rows, dtype=torch.long)
    rank[order if order is not None else torch.arange(rows)] = torch.arange(rows)
    g_idx = rank // size
    w = weight.t().float()
    groups = torch.stack([w[g_idx == g] for g in range(rows // size)])  # [groups, size, out]
    if symmetric:
        scale = (groups.abs().amax(1).clamp_min(1e-6) * 2 / maxq).half()
        zero = torch.full(scale.shape, (maxq + 1) // 2)
    else:
        low, high = groups.amin(1).clamp(max=0), groups.amax(1).clamp(min=0)
        scale = ((high - low).clamp_min(1e-6) / maxq).half()
        zero = (-low / scale.float()).round().clamp(0, maxq).long()
    codes = (w / scale.float()[g_idx] + zero[g_idx]).round().clamp(0, maxq).long()
    return codes, zero, scale, g_idx.to(torch.int32)


def gptq_checkpoint(source: Path, out: Path, case: tuple) -> tuple[Path, dict[str, torch.Tensor]]:
    """`source` with every projection in GPTQ's layout, and the weights those codes stand for (the reference)."""
    fmt, bits, group_size, symmetric, act_order = case
    gen = torch.Generator().manual_seed(bits)
    tensors, reference = {}, {}
    for name, weight in load_file(source / "model.safetensors").items():
        if not name.endswith("_proj.weight"):
            tensors[name] = weight
            continue
        order = torch.randperm(weight.shape[1], generator=gen) if act_order else None
        codes, zero, scale, g_idx = quantize(weight, bits, group_size, symmetric, order)
        g = g_idx.long()
        reference[name] = ((codes - zero[g]).float() * scale.float()[g]).t()
        stored_zero = zero - 1 if fmt == "gptq" else zero
        prefix = name.removesuffix(".weight")
        tensors |= {f"{prefix}.qweight": pack(codes, bits), f"{prefix}.qzeros": pack(stored_zero.t() & (2 ** bits - 1),
                                                                                        bits).t().contiguous(),
                    f"{prefix}.scales": scale, f"{prefix}.g_idx": g_idx}
    return quantized_folder(source, out, tensors, {
        "quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": act_order, "sym": symmetric,
        "checkpoint_format": fmt, "damp_percent": 0.01, "true_sequential": True, "static_groups": False}), reference


@pytest.mark.parametrize("preset, case", [("qwen3-small", case) for case in CASES]
                         + [("qwen3-moe-tiny", "gptq int4 sym"),  # each expert's projections a module of its own
                            ("phi3-tiny", "gptq int4 sym")])  # q, k and v one module, gate and up another
def test_a_gptq_checkpoint_reads_its_codes_and_serves_transformers_logits(preset, case, tmp_path):
    source = make_model(preset, tmp_path / "src", seed=0)
    folder, reference = gptq_checkpoint(source, tmp_path / "gptq", CASES[case])
    ours = Gptq.parse(json.loads((folder / "config.json").read_text())["quantization_config"])
    stored = load_file(folder / "model.safetensors")
    assert len(reference) == {"qwen3-small": 4 * 7, "qwen3-moe-tiny": 2 * (4 + 8 * 3), "phi3-tiny": 2 * 4}[preset]
    for name, weight in reference.items():
        module = name.removesuffix(".weight")
        parts = {p: stored[f"{module}.{p}"] for p in ("qweight", "qzeros", "scales", "g_idx")}
        assert torch.equal(ours.dequantize(parts), weight), name

    assert_serves_transformers_logits(folder, source, reference, tmp_path)
    _, bits, _, _, act_order = CASES[case]
    if act_order:  # any input row in any group: not served packed
        with pytest.raises(ValueError, match="quantization packed serves"):
            serve(folder, "packed")
    else:
        assert_served_packed(folder, bits)


def test_groups_in_row_order_need_no_g_idx():
    """Checkpoints that store no g_idx (or the trivial one) read their groups as row // group_size."""
    weight = torch.randn(16, 64)
    codes, zero, scale, g_idx = quantize(weight, 4, 16, False, None)
    parts = {"qweight": pack(codes, 4), "qzeros": pack(zero.t(), 4).t().contiguous(), "scales": scale}
    scheme = Gptq(4, 16, 0)
    expected = ((codes - zero[g_idx.long()]).float() * scale.float()[g_idx.long()]).t()
    assert torch.equal(scheme.dequantize(parts), expected)
    assert torch.equal(scheme.dequantize(parts | {"g_idx": g_idx}), expected)


def test_other_gptq_layouts_are_refused_by_name():
    assert Gptq.parse({"quant_method": "gptq", "bits": 4, "group_size": 128}) == Gptq(4, 128, 1)
    assert Gptq.parse({"quant_method": "gptq", "bits": 8, "checkpoint_format": "gptq_v2"}) == Gptq(8, 128, 0)
    for quantization in ({"bits": 3}, {"checkpoint_format": "marlin"}, {"pack_dtype": "int16"}):
        with pytest.raises(ValueError, match="unsupported GPTQ checkpoint"):
            Gptq.parse({"quant_method": "gptq", **quantization})
    with pytest.raises(ValueError, match="dynamic"):
        Gptq.parse({"quant_method": "gptq", "dynamic": {"-:.*down_proj": {}}})
