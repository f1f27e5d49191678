"""AutoAWQ checkpoints (model/awq.py): qwen3-small's projections in 4-bit groups, float16 scales, with and without
zero points, packed in AWQ's GEMM layout by this test. compressed-tensors' AutoAWQ converter (the library's own
reader of the format) turns each folder into a compressed-tensors one: every weight the worker reads from the AWQ
folder is what the library decompresses from its conversion in float32 (the scales cast first, as transformers
casts them into a float32 model), bit for bit, and the served logits are transformers' over the converted folder
(as close as over the unquantized one). transformers reads AWQ itself only through autoawq or gptqmodel, which do
not install on a CPU-only machine."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.quantized_checkpoints import assert_served_packed, hf_logits, quantized_folder, served_logits
from worker_svc.checkpoints.writer import make_model
from worker_svc.model.awq import ORDER, Awq

pytestmark = pytest.mark.timeout(300)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """[rows, cols] codes in 0..15 -> int32 [rows, cols / 8] in AWQ's order (nibble p holds column ORDER[p])."""
    nibbles = codes.to(torch.int64).unflatten(-1, (-1, 8))[..., list(ORDER)]
    words = (nibbles << torch.arange(0, 32, 4)).sum(-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def awq_checkpoint(source: Path, out: Path, group_size: int, zero_point: bool) -> Path:
    """`source` with every projection in AWQ's GEMM layout (min-max scales per group of inputs), the LM head and
    embeddings as they were."""
    tensors = {}
    for name, weight in load_file(source / "model.safetensors").items():
        if not name.endswith("_proj.weight"):
            tensors[name] = weight
            continue
        groups = weight.t().float().unflatten(0, (-1, group_size))  # [groups, group_size, out]
        if zero_point:
            low, high = groups.amin(1), groups.amax(1)
            scale = ((high - low).clamp_min(1e-6) / 15).half()
            zero = (-low / scale.float()).round().clamp(0, 15)
        else:
            scale, zero = (groups.abs().amax(1).clamp_min(1e-6) / 7).half(), torch.full(groups[:, 0].shape, 8.0)
        codes = (groups / scale.float()[:, None] + zero[:, None]).round().clamp(0, 15).flatten(0, 1)
        prefix = name.removesuffix(".weight")
        tensors |= {f"{prefix}.qweight": pack(codes), f"{prefix}.scales": scale}
        if zero_point:
            tensors[f"{prefix}.qzeros"] = pack(zero)
    return quantized_folder(source, out, tensors, {"quant_method": "awq", "bits": 4, "group_size": group_size,
                                                   "zero_point": zero_point, "version": "gemm",
                                                   "modules_to_not_convert": None})


def converted(awq: Path, out: Path) -> tuple[Path, object]:
    """The library's conversion of an AWQ folder to compressed-tensors' pack-quantized format, and its scheme."""
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter

    config = json.loads((awq / "config.json").read_text())
    converter = AutoAWQConverter.from_autoawq_config(config["quantization_config"])
    shutil.copytree(awq, out)
    save_file(converter.process(load_file(awq / "model.safetensors")), out / "model.safetensors",
              metadata={"format": "pt"})
    quantization = converter.update_config(None)
    config["quantization_config"] = {**quantization.model_dump(mode="json"), "quant_method": "compressed-tensors"}
    (out / "config.json").write_text(json.dumps(config))
    return out, next(iter(quantization.config_groups.values()))


@pytest.mark.parametrize("zero_point", [True, False], ids=["zero points", "centred on 8"])
def test_an_awq_checkpoint_reads_as_the_library_converts_it_and_serves_transformers_logits(zero_point, tmp_path):
    from compressed_tensors.compressors import BaseCompressor

    source = make_model("qwen3-small", tmp_path / "src", seed=0)
    awq = awq_checkpoint(source, tmp_path / "awq", 32, zero_point)
    reference, scheme = converted(awq, tmp_path / "ct")
    ours = Awq.parse(json.loads((awq / "config.json").read_text())["quantization_config"])
    stored, library = load_file(awq / "model.safetensors"), load_file(reference / "model.safetensors")
    decompress = BaseCompressor.get_value_from_registry("pack-quantized").decompress
    modules = [n.removesuffix(".qweight") for n in stored if n.endswith(".qweight")]
    assert len(modules) == 4 * 7
    for m in modules:
        parts = {p: stored[f"{m}.{p}"] for p in ("qweight", "qzeros", "scales") if f"{m}.{p}" in stored}
        theirs = decompress({k.removeprefix(f"{m}."): t.float() if k.endswith("scale") else t
                             for k, t in library.items() if k.startswith(f"{m}.")}, scheme)["weight"]
        assert torch.equal(ours.dequantize(parts), theirs.float()), m

    served, theirs = served_logits(awq), hf_logits(reference)
    unquantized = (served_logits(source) - hf_logits(source)).abs().max().item()
    assert (served - theirs).abs().max() <= max(2 * unquantized, 1e-4)
    assert (served - served_logits(source)).abs().max() > 1e-2
    assert_served_packed(awq, 4)


def test_other_awq_layouts_are_refused_by_name():
    assert Awq.parse({"quant_method": "awq", "bits": 4, "group_size": 64, "version": "GEMM"}) == Awq(64, True)
    for quantization in ({"version": "gemv"}, {"version": "gemm", "bits": 8}):
        with pytest.raises(ValueError, match="unsupported AWQ checkpoint"):
            Awq.parse({"quant_method": "awq", **quantization})
