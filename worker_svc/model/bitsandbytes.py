"""bitsandbytes checkpoints (`quantization_config.quant_method: bitsandbytes`: unsloth's and the community's -bnb-4bit
and 8-bit models, as transformers saves a model quantized by bitsandbytes), read into 16-bit weights as they load.

4 bits (`load_in_4bit`, NF4 or FP4): a module's `weight` holds bytes (uint8, or as `bnb_4bit_quant_storage` says),
two codes a byte (the first in the high nibble) in row-major order of the weight's shape; `weight.quant_map` the 16
values a code stands for; `weight.absmax` the scale of each `blocksize` consecutive values, float32 or, with double
quantization (`bnb_4bit_use_double_quant`), uint8 codes into `weight.nested_quant_map` scaled by
`weight.nested_absmax` per `nested_blocksize` of them plus `nested_offset`; `weight.quant_state.bitsandbytes__nf4`
(or `__fp4`) the JSON of the shape and block sizes, as bytes. 8 bits (`load_in_8bit`, LLM.int8): `weight` int8 and
`SCB` each row's scale: a weight is code * SCB / 127. Each is read in float32 as bitsandbytes dequantises it.
Activations stay 16-bit; skipped modules (`llm_int8_skip_modules`, the LM head) are stored as plain weights.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch

from worker_svc.model.loader import CheckpointTensor, joined

STATE = ("quant_state.bitsandbytes__nf4", "quant_state.bitsandbytes__fp4")  # a 4-bit module's state, by quant type
FOUR_BIT_PARTS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map", *STATE)
EIGHT_BIT_PARTS = ("SCB", "weight_format")  # weight_format: 0, row-major (the only layout transformers saves)


@dataclass(frozen=True, slots=True)
class BitsAndBytes:
    bits: int
    fp8_blocks: ClassVar[None] = None  # integer codes, never FP8 blocks (CompressedTensors.fp8_blocks)

    @classmethod
    def parse(cls, quantization: dict) -> "BitsAndBytes":
        """The scheme of a `bitsandbytes` quantization_config; ValueError where it says neither 4 nor 8 bits."""
        four, eight = quantization.get("load_in_4bit"), quantization.get("load_in_8bit")
        if bool(four) == bool(eight):
            raise ValueError("unsupported bitsandbytes checkpoint: neither load_in_4bit nor load_in_8bit (or both)")
        return cls(4 if four else 8)

    def dequantized(self, tensors: Iterator[CheckpointTensor], names: set[str]) -> Iterator[CheckpointTensor]:
        """The checkpoint's tensors with each quantized module's parts (among `names`) read as one float32
        `*.weight`; every other tensor as it is, still unread."""
        if self.bits == 4:
            quantized = {n.rpartition(".weight.")[0] for n in names if n.endswith(STATE)}

            def part_of(name: str) -> tuple[str, str] | None:
                if name.endswith(".weight") and name.removesuffix(".weight") in quantized:
                    return name, "codes"
                module, _, part = name.partition(".weight.")
                return (f"{module}.weight", part) if part in FOUR_BIT_PARTS and module in quantized else None
        else:
            quantized = {n.removesuffix(".SCB") for n in names if n.endswith(".SCB")}

            def part_of(name: str) -> tuple[str, str] | None:
                module, _, part = name.rpartition(".")
                if module not in quantized or part not in ("weight", *EIGHT_BIT_PARTS):
                    return None
                return f"{module}.weight", "codes" if part == "weight" else part

        return joined(tensors, names, part_of, self.dequantize)

    def dequantize(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """One module's weight in float32 from its stored parts."""
        if self.bits == 8:
            if int(parts.get("weight_format", torch.tensor(0))) != 0:
                raise ValueError("a bitsandbytes 8-bit weight in a layout other than row-major")
            return parts["codes"] * parts["SCB"].float().view(-1, 1) * INV_127
        state = json.loads(bytes(next(parts[k] for k in STATE if k in parts).tolist()))
        absmax = parts["absmax"]
        if "nested_absmax" in parts:  # double quantization: the scales are 8-bit codes themselves
            absmax = blockwise(parts["nested_quant_map"][absmax.long()], parts["nested_absmax"],
                               state["nested_blocksize"]) + state["nested_offset"]
        packed = parts["codes"].reshape(-1).view(torch.uint8)  # bytes, whatever dtype held them (quant_storage)
        codes = torch.stack([packed >> 4, packed & 15], -1).reshape(-1).long()
        shape = state["shape"]
        values = parts["quant_map"][codes[:torch.Size(shape).numel()]]
        return blockwise(values, absmax.float(), state["blocksize"]).reshape(shape)


INV_127 = 7.874015718698502e-3  # 1 / 127 as bitsandbytes multiplies by it


def blockwise(values: torch.Tensor, absmax: torch.Tensor, blocksize: int) -> torch.Tensor:
    """values [n] (float32) each times its block's absmax, `blocksize` values a block (the last may be short)."""
    n = values.numel()
    full = n - n % blocksize
    out = torch.empty(n, dtype=torch.float32)
    out[:full] = (values[:full].view(-1, blocksize) * absmax[:full // blocksize].view(-1, 1)).reshape(full)
    if full < n:
        out[full:] = values[full:] * absmax[full // blocksize]
    return out
