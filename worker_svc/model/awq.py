"""AutoAWQ checkpoints (`quantization_config.quant_method: awq`, GEMM layout: Qwen's and the community's -AWQ
models), each quantized Linear read as packed integer groups (model/packed_ints.py), served so or dequantised.

Each quantized Linear stores `qweight` int32 [in, out / 8] (eight 4-bit codes a word along the output columns, in
AWQ's order: the word's nibble p, from the lowest, holds column 8c + ORDER[p]), `qzeros` int32 [in / group_size,
out / 8] packed the same way, and `scales` [in / group_size, out]; weight[out, in] = (code - zero) * scale of the
input's group, in float32 (one rounding to the model's dtype as it loads; transformers, over compressed-tensors'
conversion of the folder, casts the scales to the model's dtype first). Without zero points (`zero_point: false`)
the codes are centred on 8. Activations stay 16-bit; modules_to_not_convert
(and the LM head) are stored as plain weights.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch

from worker_svc.model.loader import CheckpointTensor, joined_qweights
from worker_svc.model.packed_ints import PackedInts, pack

ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the column of the word's nibble p
COLUMN_NIBBLE = tuple(ORDER.index(c) for c in range(8))  # the nibble of the word's column c
PARTS = ("qweight", "qzeros", "scales")


@dataclass(frozen=True, slots=True)
class Awq:
    group_size: int
    zero_point: bool
    codes_part: ClassVar[str] = "qweight"  # the part a quantized module stores its codes in
    fp8_blocks: ClassVar[None] = None  # 4-bit integer codes, never FP8 blocks (CompressedTensors.fp8_blocks)

    @classmethod
    def parse(cls, quantization: dict) -> "Awq":
        """The scheme of an `awq` quantization_config; ValueError naming what is not supported."""
        version, bits = str(quantization.get("version", "gemm")).lower(), quantization.get("bits", 4)
        if version != "gemm" or bits != 4:
            raise ValueError(f"unsupported AWQ checkpoint: version {version!r}, {bits} bits (served: gemm, 4 bits)")
        return cls(int(quantization.get("group_size", 128)), bool(quantization.get("zero_point", True)))

    @property
    def packed_groups(self) -> tuple[int, int]:
        """(bits, group_size) of the packed integer groups its Linears read as."""
        return 4, self.group_size

    def dequantized(self, tensors: Iterator[CheckpointTensor], names: set[str]) -> Iterator[CheckpointTensor]:
        """The checkpoint's tensors with each quantized module's parts (among `names`) read as one `*.weight`, its
        PackedInts; every other tensor as it is, still unread."""
        return joined_qweights(tensors, names, PARTS, self.packed)

    def packed(self, parts: dict[str, torch.Tensor]) -> PackedInts:
        """One module's weight [out, in] from its qweight, qzeros and scales."""
        scale = parts["scales"].t().float()
        zero = unpack(parts["qzeros"]).t().float() if self.zero_point else torch.full(scale.shape, 8.0)
        return PackedInts(pack(unpack(parts["qweight"]).t(), 4), zero.contiguous(), scale.contiguous(), 4)

    def dequantize(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """One module's weight [out, in] in float32."""
        return self.packed(parts).dequantized()


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """int32 [rows, words] -> int64 [rows, words * 8]: each word's eight nibbles put back in column order."""
    nibbles = (packed.to(torch.int64)[..., None] >> torch.arange(0, 32, 4)) & 15
    return nibbles[..., list(COLUMN_NIBBLE)].flatten(-2)
