"""bitsandbytes checkpoints (model/bitsandbytes.py): qwen3-small's projections quantized by the bitsandbytes library
itself (NF4 with double quantization, as unsloth's -bnb-4bit models; FP4 without; LLM.int8) and saved under the names
transformers gives them. Every weight the worker reads is what the library dequantises from the same tensors, bit for
bit, and the served logits are transformers' over a plain checkpoint of those weights (within float32's rounding)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.quantized_checkpoints import assert_serves_transformers_logits, quantized_folder
from worker_svc.checkpoints.writer import make_model
from worker_svc.model.bitsandbytes import BitsAndBytes

pytestmark = pytest.mark.timeout(300)

CASES = {  # quantization_config, 4-bit quant type (None: 8 bits), double quantization
    "nf4 double-quantized": ({"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True},
                             "nf4", True),
    "fp4": ({"load_in_4bit": True, "bnb_4bit_quant_type": "fp4", "bnb_4bit_use_double_quant": False}, "fp4", False),
    "int8": ({"load_in_8bit": True}, None, False),
}


def quantized(weight: torch.Tensor, quant_type: str | None, nested: bool,
              storage: torch.dtype = torch.uint8) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A module's tensors as transformers saves a bitsandbytes Linear (names relative to the module), and the weight
    the library dequantises from them."""
    import bitsandbytes.functional as F

    if quant_type is None:
        codes, scb, _ = F.int8_vectorwise_quant(weight.half())
        return ({"weight": codes, "SCB": scb, "weight_format": torch.tensor(0, dtype=torch.uint8)},
                F.int8_vectorwise_dequant(codes, scb))
    packed, state = F.quantize_4bit(weight, blocksize=64, quant_type=quant_type, compress_statistics=nested,
                                    quant_storage=storage)
    stored = state.as_dict(packed=True)
    back = F.dequantize_4bit(packed, F.QuantState.from_dict(dict(stored), device=torch.device("cpu")))
    return {"weight": packed, **{f"weight.{k}": v for k, v in stored.items()}}, back


def bnb_checkpoint(source: Path, out: Path, case: tuple) -> tuple[Path, dict[str, torch.Tensor]]:
    """`source` with every projection quantized by bitsandbytes, and the weights it dequantises them to."""
    config_fields, quant_type, nested = case
    tensors, reference = {}, {}
    for name, weight in load_file(source / "model.safetensors").items():
        if not name.endswith("_proj.weight"):
            tensors[name] = weight
            continue
        module = name.removesuffix(".weight")
        parts, reference[name] = quantized(weight, quant_type, nested)
        tensors |= {f"{module}.{k}": v for k, v in parts.items()}
    return quantized_folder(source, out, tensors, {"quant_method": "bitsandbytes", "bnb_4bit_compute_dtype": "float32",
                                                   "llm_int8_skip_modules": None, **config_fields}), reference


@pytest.mark.parametrize("case", CASES)
def test_a_bitsandbytes_checkpoint_reads_as_the_library_and_serves_transformers_logits(case, tmp_path):
    from worker_svc.model.loader import checkpoint_names, checkpoint_tensors

    source = make_model("qwen3-small", tmp_path / "src", seed=0)
    folder, reference = bnb_checkpoint(source, tmp_path / "bnb", CASES[case])
    ours = BitsAndBytes.parse(json.loads((folder / "config.json").read_text())["quantization_config"])
    read = {name: get() for name, get, _ in ours.dequantized(checkpoint_tensors(folder), checkpoint_names(folder))}
    assert len(reference) == 4 * 7
    for name, weight in reference.items():
        assert torch.equal(read[name], weight.float()), name
    assert not any(".weight." in n or n.endswith((".SCB", ".weight_format")) for n in read)

    assert_serves_transformers_logits(folder, source, reference, tmp_path)


@pytest.mark.parametrize("quant_type, nested, storage", [("nf4", True, torch.uint8), ("fp4", False, torch.uint8),
                                                         ("nf4", True, torch.bfloat16)])
def test_a_last_short_block_reads_as_the_library(quant_type, nested, storage):
    """68 values in blocks of 64: the last block short, as any weight whose size is not a multiple of the block size
    leaves it; the codes' bytes held as uint8 or, as QLoRA's FSDP recipe stores them, bfloat16."""
    weight = torch.randn(4, 17)
    parts, want = quantized(weight, quant_type, nested, storage)
    assert parts["weight"].dtype == storage
    got = BitsAndBytes(4).dequantize({"codes" if k == "weight" else k.removeprefix("weight."): v
                                      for k, v in parts.items()})
    assert torch.equal(got, want)


def test_a_config_that_says_no_width_is_refused():
    assert BitsAndBytes.parse({"quant_method": "bitsandbytes", "load_in_8bit": True}) == BitsAndBytes(8)
    for fields in ({}, {"load_in_4bit": True, "load_in_8bit": True}):
        with pytest.raises(ValueError, match="unsupported bitsandbytes checkpoint"):
            BitsAndBytes.parse({"quant_method": "bitsandbytes", **fields})
