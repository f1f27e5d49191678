"""Projections served in the integer groups a checkpoint stores them in (`--quantization packed`: AWQ's, GPTQ's and
compressed-tensors' pack-quantized Linears of 2, 4 or 8 bits), instead of dequantised to 16 bits as they load: a
quarter (4-bit) or half (8-bit) of a 16-bit weight's memory.

A packed weight keeps its codes along its input columns, 32 / bits unsigned codes an int32 word, the first in the
lowest bits (GPTQ's and compressed-tensors' own layout), and a float32 scale and zero point per output row and group
of input columns: weight[n, k] = (code - zero) * scale of k's group, in float32, rounded once to the activations'
dtype, the value the dequantising path stores. kernels/int_gemm.py multiplies such weights on a GPU,
reference.int_linear elsewhere.

Which projections: each linear whose every checkpoint module is stored so and whose shard holds whole groups (the
columns a row-parallel rank keeps). The embeddings, the LM head, a MoE's experts, MLA's absorbed projections and
modules_to_not_convert stay dequantised; GPTQ's activation-order checkpoints (any input column in any group) are not
served packed."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from worker_svc.kernels.reference import dequantize_ints

BITS = (2, 4, 8)  # codes that tile a 32-bit word


@dataclass(slots=True)
class PackedInts:
    """One module's weight [rows, cols] as a checkpoint's integer groups, in the served layout."""
    words: torch.Tensor  # int32 [rows, cols * bits / 32]
    zero: torch.Tensor  # float32 [rows, groups]
    scale: torch.Tensor  # float32 [rows, groups]
    bits: int

    def dequantized(self) -> torch.Tensor:
        """The weight in float32 [rows, cols]."""
        return dequantize_ints(self.words, self.zero, self.scale, self.bits)

    def parts(self, weight_name: str) -> list[tuple[str, torch.Tensor]]:
        """(parameter name, tensor) of each stored part of the module's `weight_name`."""
        return list(zip(part_names(weight_name), (self.words, self.zero, self.scale)))


PARTS = ("weight", "weight_zero", "weight_scale")  # a packed projection's parameters: words, zero points, scales


def part_names(weight_name: str) -> list[str]:
    """The parameters of the module whose weight is `weight_name`, where that weight is packed."""
    module = weight_name.removesuffix(".weight")
    return [f"{module}.{part}" for part in PARTS]


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes [rows, cols] -> int32 [rows, cols * bits / 32], 32 / bits codes a word, the first lowest."""
    per = 32 // bits
    words = (codes.to(torch.int64).unflatten(-1, (-1, per)) << (torch.arange(per) * bits)).sum(-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def fits(module: nn.Module, group_size: int, tp_size: int) -> bool:
    """Whether `module` can hold a packed weight: a projection (not MLA's absorbed kv_b_proj, read as a tensor) whose
    shard's input columns are whole groups (`group_size` -1: one group of all its columns) and whole words."""
    from worker_svc.model.parallel import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear

    if not isinstance(module, (ColumnParallelLinear, RowParallelLinear, ReplicatedLinear)) or getattr(
            module, "absorbed", False):
        return False
    cols = module.input_size
    full = cols * tp_size if isinstance(module, RowParallelLinear) else cols
    size = full if group_size == -1 else group_size
    return cols % size == 0 and cols % 32 == 0


def allocate_packed(model: nn.Module, device: torch.device, dtype: torch.dtype, quantized: set[str], bits: int,
                    group_size: int) -> int:
    """Storage for the weights of a model built under parallel.deferred_projections: packed integer groups for each
    projection that `fits` and whose every shard comes from a checkpoint weight among `quantized` (those that read as
    PackedInts); `dtype` for the rest. A packed projection's `weight` holds the words, `weight_zero` and
    `weight_scale` the groups' zero points and scales, each loaded by the weight's loader (rows of a column-parallel
    shard; words and groups of a row-parallel one). Returns how many are packed."""
    from worker_svc.model.loader import wholly_loaded
    from worker_svc.model.parallel import tp_size
    from worker_svc.model.quantized import allocate

    whole = wholly_loaded(model, quantized)
    count = 0
    for module_name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, nn.Parameter) or not weight.is_meta:
            continue
        name = f"{module_name}.weight"
        if name not in whole or not fits(module, group_size, tp_size()):
            allocate(module, "weight", weight.shape, dtype, device)
            continue
        rows, cols = weight.shape
        groups = 1 if group_size == -1 else cols // group_size  # the shard's
        allocate(module, "weight", (rows, cols * bits // 32), torch.int32, device)
        for part in PARTS[1:]:
            allocate(module, part, (rows, groups), torch.float32, device)
        count += 1
    return count
