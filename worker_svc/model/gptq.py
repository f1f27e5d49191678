"""GPTQ checkpoints (`quantization_config.quant_method: gptq`: AutoGPTQ's and GPTQModel's, Qwen's -GPTQ-Int4 / -Int8
models and the community's), each quantized Linear read as packed integer groups (model/packed_ints.py: its qweight
transposed is their layout), served so or dequantised; in activation order, dequantised as they load.

Each quantized Linear stores `qweight` int32 [in * bits / 32, out] (32 / bits codes a word along the input rows, the
first in the lowest bits), `qzeros` int32 [groups, out * bits / 32] packed the same way along the output columns,
`scales` [groups, out] and `g_idx` int32 [in], each input row's group: row // group_size, unless the checkpoint was
quantized in activation order (`desc_act`), where any row may belong to any group. weight[out, in] = (code - zero) *
scale of the row's group, in float32, as GPTQModel's torch kernel computes it. The original format
(`checkpoint_format: gptq`, AutoGPTQ's) stores each zero point less one, GPTQModel's `gptq_v2` as it is. 2, 4 and 8
bits (3-bit codes straddle words: refused). Activations stay 16-bit; modules not quantized (the LM head as a rule)
are stored as plain weights.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch

from worker_svc.model.loader import CheckpointTensor, joined_qweights
from worker_svc.model.packed_ints import PackedInts

PARTS = ("qweight", "qzeros", "scales", "g_idx")
FORMATS = {"gptq": 1, "gptq_v2": 0}  # what each format's stored zero points are less than the real ones
BITS = (2, 4, 8)


@dataclass(frozen=True, slots=True)
class Gptq:
    bits: int
    group_size: int  # -1: one group of every input row
    zero_offset: int  # added to each stored zero point
    act_order: bool = False  # desc_act: any input row in any group
    codes_part: ClassVar[str] = "qweight"  # the part a quantized module stores its codes in
    fp8_blocks: ClassVar[None] = None  # integer codes, never FP8 blocks (CompressedTensors.fp8_blocks)

    @classmethod
    def parse(cls, quantization: dict) -> "Gptq":
        """The scheme of a `gptq` quantization_config; ValueError naming what is not supported."""
        fmt = str(quantization.get("checkpoint_format") or quantization.get("format") or "gptq").lower()
        bits, pack = quantization.get("bits", 4), str(quantization.get("pack_dtype", "int32")).removeprefix("torch.")
        if fmt not in FORMATS or bits not in BITS or pack != "int32":
            raise ValueError(f"unsupported GPTQ checkpoint: format {fmt!r}, {bits} bits packed in {pack} (served: "
                             f"{' or '.join(FORMATS)}, {', '.join(map(str, BITS))} bits packed in int32)")
        if quantization.get("dynamic"):
            raise ValueError("unsupported GPTQ checkpoint: per-module overrides (`dynamic`)")
        return cls(bits, int(quantization.get("group_size", 128)), FORMATS[fmt], bool(quantization.get("desc_act")))

    @property
    def packed_groups(self) -> tuple[int, int] | None:
        """(bits, group_size) of the packed integer groups its Linears read as; None in activation order."""
        return None if self.act_order else (self.bits, self.group_size)

    def dequantized(self, tensors: Iterator[CheckpointTensor], names: set[str]) -> Iterator[CheckpointTensor]:
        """The checkpoint's tensors with each quantized module's parts (among `names`) read as one `*.weight`: its
        PackedInts where its groups are in row order, else the weight in float32; every other tensor as it is, still
        unread."""
        return joined_qweights(tensors, names, PARTS, self.read)

    def read(self, parts: dict[str, torch.Tensor]) -> PackedInts | torch.Tensor:
        """One module's weight [out, in] from its qweight, qzeros, scales and g_idx (where stored)."""
        zero = unpack_rows(parts["qzeros"].t(), self.bits).t() + self.zero_offset  # [groups, out]
        scale, rows = parts["scales"], parts["qweight"].shape[0] * 32 // self.bits
        group_size = rows if self.group_size == -1 else self.group_size
        group = parts.get("g_idx")
        if group is None or torch.equal(group.long(), torch.arange(rows) // group_size):
            return PackedInts(parts["qweight"].t().contiguous(), zero.t().float().contiguous(),
                              scale.t().float().contiguous(), self.bits)
        codes, group = unpack_rows(parts["qweight"], self.bits), group.long()  # [in, out]; activation order
        return ((codes - zero[group]).float() * scale[group].float()).t()

    def dequantize(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """One module's weight [out, in] in float32."""
        weight = self.read(parts)
        return weight.dequantized() if isinstance(weight, PackedInts) else weight


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [words, cols] -> int32 [words * 32 / bits, cols]: each word's codes as rows, the lowest bits first."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)[:, None]
    return ((packed[:, None, :] >> shifts) & ((1 << bits) - 1)).flatten(0, 1)
