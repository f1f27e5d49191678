"""Checkpoints in the compressed-tensors format (llm-compressor's: RedHatAI's and Neural Magic's quantized models,
`quantization_config.quant_method: compressed-tensors`), read into 16-bit weights as they load, or pack-quantized
integers of 2, 4 or 8 bits by group or channel as packed integer groups (model/packed_ints.py: their own layout),
served so or dequantised.

One scheme serves every Linear (one config group targeting `Linear`; the `ignore`d modules, the LM head as a rule,
are stored as plain weights). Each quantized module stores its codes as
- `weight` (formats float-quantized, int-quantized, naive-quantized): 8-bit codes, e4m3 or int8;
- `weight_packed` + `weight_shape` (pack-quantized): `num_bits`-bit integers offset to unsigned and packed into int32
  words, element i at bit i * num_bits of the row's little-endian word stream (8 int4 a word, the first lowest);
and `weight_scale` per tensor, output row (channel), `group_size` input columns (group) or block; where asymmetric,
`weight_zero_point` of the scale's shape (pack-quantized packs it along the rows). A weight is (codes - zero point) *
scale, as compressed-tensors dequantises it. The activations' scheme (`input_activations`: dynamic per-token FP8 or
INT8, or a static `input_scale`) is not applied: the served model computes with 16-bit activations over the
dequantised weights, and `--quantization fp8` puts the projections back into FP8 blocks (model/quantized.py).
NVIDIA ModelOpt's, AutoFP8's and FBGEMM's FP8 checkpoints store their Linears as float-quantized ones
(CompressedTensors.scaled_fp8).
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch

from worker_svc.model.loader import CheckpointTensor, joined
from worker_svc.model.packed_ints import BITS, PackedInts
from worker_svc.model.quantized import dequantize_fp8_blocks

FORMATS = {"float-quantized": ("float",), "int-quantized": ("int",), "naive-quantized": ("float", "int"),
           "pack-quantized": ("int",)}
STRATEGIES = ("tensor", "channel", "group", "block")
PARTS = ("weight", "weight_packed", "weight_shape", "weight_scale", "weight_zero_point")
ACTIVATION_PARTS = ("input_scale", "input_zero_point", "input_scale_ub")  # activation schemes': not applied
MODELOPT_STRATEGIES = {"FP8": "tensor", "FP8_PER_CHANNEL_PER_TOKEN": "channel"}  # ModelOpt's FP8 quant_algo
UNPACK_ROWS = 1024  # rows unpacked at a time (int64 words per element while unpacking)


@dataclass(frozen=True, slots=True)
class CompressedTensors:
    fmt: str
    kind: str  # "float" (e4m3 codes) or "int"
    num_bits: int
    strategy: str
    group_size: int | None = None
    block: tuple[int, int] | None = None
    codes_part: ClassVar[str] = "weight_packed"  # the part a pack-quantized module stores its codes in

    @classmethod
    def parse(cls, quantization: dict) -> "CompressedTensors":
        """The scheme of a `compressed-tensors` quantization_config; ValueError naming what is not supported."""
        def refuse(why: str) -> ValueError:
            return ValueError(f"unsupported compressed-tensors checkpoint: {why}")

        for key in ("sparsity_config", "transform_config"):
            if quantization.get(key):
                raise refuse(f"{key} is set")
        groups = list((quantization.get("config_groups") or {}).values())
        if len(groups) != 1 or groups[0].get("targets") != ["Linear"]:
            raise refuse("one config group targeting Linear is served (every projection under one scheme)")
        weights = groups[0].get("weights") or {}
        fmt = groups[0].get("format") or quantization.get("format")
        kind, bits, strategy = weights.get("type"), weights.get("num_bits"), weights.get("strategy")
        packed = fmt == "pack-quantized" and bits in range(1, 8)
        if fmt not in FORMATS or kind not in FORMATS[fmt] or not (bits == 8 or packed):
            raise refuse(f"format {fmt!r} of {bits}-bit {kind} weights (served: 8-bit float or int codes, or "
                         "pack-quantized integers of 1-8 bits)")
        if strategy not in STRATEGIES:
            raise refuse(f"weight strategy {strategy!r} ({', '.join(STRATEGIES)})")
        if weights.get("actorder") == "group":
            raise refuse("actorder 'group' (columns permuted into their groups by weight_g_idx)")
        block = weights.get("block_structure")
        return cls(fmt, kind, bits, strategy, weights.get("group_size"), tuple(block) if block else None)

    @classmethod
    def scaled_fp8(cls, quantization: dict) -> "CompressedTensors":
        """NVIDIA ModelOpt's FP8 checkpoints (`quant_method: modelopt`: nvidia's -FP8 models), AutoFP8's
        (`quant_method: fp8` without blocks: Neural Magic's earlier -FP8 models) and FBGEMM's (`fbgemm_fp8`: Meta's
        Llama-3.1-405B-Instruct-FP8), which store each quantized Linear as float-quantized compressed-tensors does:
        e4m3 `weight`, `weight_scale` per tensor (ModelOpt's `quant_algo: FP8`, AutoFP8's) or per output channel
        (FP8_PER_CHANNEL_PER_TOKEN, FBGEMM's), and an activation scale or bound (`input_scale`, `input_scale_ub`: not
        applied). ModelOpt's algorithm is read from the config.json form or hf_quant_config.json's (`quantization`)."""
        method = quantization.get("quant_method")
        if method in ("fp8", "fbgemm_fp8"):
            return cls("float-quantized", "float", 8, "tensor" if method == "fp8" else "channel")
        algo = str((quantization.get("quantization") or quantization).get("quant_algo", "")).upper()
        if algo not in MODELOPT_STRATEGIES:
            raise ValueError(f"unsupported ModelOpt checkpoint: quant_algo {algo!r} (served: "
                             f"{', '.join(MODELOPT_STRATEGIES)})")
        return cls("float-quantized", "float", 8, MODELOPT_STRATEGIES[algo])

    @property
    def fp8_blocks(self) -> tuple[int, int] | None:
        """The blocks of e4m3 codes stored in blocks, as DeepSeek's FP8 checkpoints store them; None otherwise."""
        return self.block if self.kind == "float" and self.strategy == "block" else None

    @property
    def packed_groups(self) -> tuple[int, int] | None:
        """(bits, group_size: -1 for one group a row) of the packed integer groups its Linears read as; None where
        they read as float32 weights."""
        if self.fmt != "pack-quantized" or self.num_bits not in BITS or self.strategy not in ("group", "channel"):
            return None
        return self.num_bits, self.group_size if self.strategy == "group" else -1

    def dequantized(self, tensors: Iterator[CheckpointTensor], names: set[str]) -> Iterator[CheckpointTensor]:
        """The checkpoint's tensors with each quantized module's parts (among `names`) read as one `*.weight` (its
        PackedInts where `packed_groups`, else the weight in float32), its activation scales dropped; every other
        tensor as it is, still unread."""
        quantized = {n.removesuffix(".weight_scale") for n in names if n.endswith(".weight_scale")}

        def part_of(name: str) -> tuple[str, str] | None:
            module, _, part = name.rpartition(".")
            return (f"{module}.weight", part) if module in quantized and part in PARTS + ACTIVATION_PARTS else None

        return joined(tensors, names, part_of, self.packed if self.packed_groups else self.dequantize)

    def packed(self, parts: dict[str, torch.Tensor]) -> PackedInts:
        """One module's pack-quantized weight as packed integer groups: the words as stored, the zero points
        offset as the codes are."""
        scale, zero = parts["weight_scale"].float().reshape(parts["weight_shape"][0].item(), -1), 1 << (
            self.num_bits - 1)
        if (stored := parts.get("weight_zero_point")) is not None:  # packed along the rows
            zero = unpack_int32(stored.t(), self.num_bits, scale.shape[0]).t() + zero
        return PackedInts(parts["weight_packed"], torch.broadcast_to(torch.as_tensor(zero, dtype=torch.float32),
                                                                     scale.shape).contiguous(),
                          scale.contiguous(), self.num_bits)

    def dequantize(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """One module's weight from its stored parts, in float32 (one rounding, to the model's dtype, when it loads:
        transformers casts the scales to the model's dtype first and computes there)."""
        if self.packed_groups:
            return self.packed(parts).dequantized()
        scale, zero = parts["weight_scale"].float(), parts.get("weight_zero_point")
        if "weight_packed" in parts:
            rows, cols = (int(v) for v in parts["weight_shape"])
            codes = unpack_int32(parts["weight_packed"], self.num_bits, cols)
            if zero is not None:  # packed along the rows
                zero = unpack_int32(zero.t(), self.num_bits, rows).t()
        else:
            codes = parts["weight"].float()
        if self.strategy == "block":
            if zero is not None:
                raise ValueError("asymmetric block-quantized weights are not served")
            return dequantize_fp8_blocks(codes, scale, self.block)
        if self.strategy == "group":
            return dequantize_groups(codes, zero, scale, self.group_size)
        if zero is not None:
            codes = codes - zero.float().reshape(scale.shape)
        return codes * (scale.reshape(-1, 1) if self.strategy == "channel" else scale.reshape(()))


def dequantize_groups(codes: torch.Tensor, zero: torch.Tensor | None, scale: torch.Tensor,
                      group_size: int) -> torch.Tensor:
    """[rows, cols] codes less their group's zero point, times its scale ([rows, cols / group_size] each), in
    float32."""
    groups = codes.float().unflatten(-1, (-1, group_size))
    if zero is not None:
        groups = groups - zero.float()[..., None]
    return (groups * scale.float()[..., None]).flatten(-2)


def unpack_int32(packed: torch.Tensor, num_bits: int, cols: int) -> torch.Tensor:
    """[rows, words] int32 -> float32 [rows, cols]: element i of a row at bit i * num_bits of its words taken as
    one little-endian stream (an element may straddle two words), less the unsigned offset 2^(num_bits - 1)."""
    start = torch.arange(cols) * num_bits
    word, shift = start // 32, start % 32
    following = (word + 1).clamp(max=packed.shape[1] - 1)
    straddles = shift + num_bits > 32
    out = torch.empty(packed.shape[0], cols)
    for r in range(0, packed.shape[0], UNPACK_ROWS):
        words = packed[r:r + UNPACK_ROWS].to(torch.int64) & 0xFFFFFFFF
        values = (words[:, word] >> shift) | torch.where(straddles, words[:, following] << (32 - shift), 0)
        out[r:r + UNPACK_ROWS] = (values & ((1 << num_bits) - 1)) - (1 << (num_bits - 1))
    return out
