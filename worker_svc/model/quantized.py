"""Checkpoints whose weights are stored quantized, dequantized at load: the experts then run as 16-bit weights.

- MXFP4 (the OCP microscaling format gpt-oss publishes its experts in): each block of 32 values is 16 bytes of
  e2m1 codes, two a byte (the low nibble first), and one e8m0 scale, a power of two biased by 127; dequantised into
  bfloat16, where every such value is exact (model/gpt_oss.py pairs the tensors).
- FP8 with block scales (`quant_method: fp8`, `weight_block_size`: DeepSeek-V3 / R1, Kimi-K2, Qwen3's -FP8
  checkpoints): a linear's `weight` in float8_e4m3fn and its `weight_scale_inv`, one float32 factor per block of
  weight_block_size (the last blocks of a row or column may be partial); every other tensor as it is."""
from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from common.util import cdiv
from worker_svc.kernels.reference import E4M3_MAX, FP8_GROUP

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from worker_svc.model.loader import CheckpointTensor

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks uint8 [E, rows, G, 16] and scales uint8 [E, rows, G] -> bfloat16 [E, rows, G * 32], one leading index
    at a time (the codes' table lookup takes 8 bytes an element)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    lut = torch.tensor(E2M1, dtype=torch.float32)
    out = torch.empty(*scales.shape[:-1], scales.shape[-1] * 32, dtype=torch.bfloat16)
    for i in range(blocks.shape[0]):
        codes = blocks[i].to(torch.int64)
        values = torch.stack([lut[codes & 15], lut[codes >> 4]], dim=-1).flatten(-2)  # [rows, G, 32]
        out[i] = torch.ldexp(values, scales[i].to(torch.int32)[..., None] - 127).flatten(-2)
    return out


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float8 [..., rows, cols] times its scales [..., cdiv(rows, block[0]), cdiv(cols, block[1])] -> float32."""
    rows, cols = weight.shape[-2:]
    if scale_inv.shape[-2:] != (cdiv(rows, block[0]), cdiv(cols, block[1])):
        raise ValueError(f"FP8 weight {tuple(weight.shape)} in blocks of {block} does not match its scales "
                         f"{tuple(scale_inv.shape)}")
    scale = scale_inv.float().repeat_interleave(block[0], -2)[..., :rows, :].repeat_interleave(block[1], -1)
    return weight.float() * scale[..., :cols]


def fp8_dequantized(tensors: Iterator[CheckpointTensor], block: tuple[int, int],
                    names: set[str]) -> Iterator[CheckpointTensor]:
    """The checkpoint's tensors with each `*.weight` that has a `*.weight_scale_inv` among its `names` and that scale
    as one float32 `*.weight`; every other tensor as it is, still unread."""
    weights: dict[str, tuple[torch.Tensor, str]] = {}
    scales: dict[str, torch.Tensor] = {}
    for name, get, file in tensors:
        if name.endswith(".weight_scale_inv"):
            base = name.removesuffix("_scale_inv")
            scales[base] = get()
        elif f"{name}_scale_inv" in names:
            weights[name], base = (get(), file), name  # now: its scale may lie in another file
        else:
            yield name, get, file
            continue
        if base in weights and base in scales:
            (weight, file), scale = weights.pop(base), scales.pop(base)
            yield base, lambda w=weight, s=scale: dequantize_fp8_blocks(w, s, block), file
    if weights or scales:
        raise KeyError(f"FP8 weights without their scales or scales without weights: "
                       f"{sorted({*weights, *scales})[:3]}")


@functools.cache
def fp8_gemms(device: torch.device) -> bool:
    """Whether this device and this torch multiply FP8 blocks (kernels/fp8_gemm.py): cuBLAS's block-scaled GEMM needs
    Hopper (sm_90) and CUDA >= 12.9, and one small product must run (a build that lacks it: 16-bit GEMMs, said)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        return False
    if tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2]) < (12, 9):
        return False
    from worker_svc.kernels import fp8_gemm

    try:
        fp8_gemm.linear(torch.ones(1, FP8_GROUP, dtype=torch.bfloat16, device=device),
                        torch.ones(FP8_GROUP, FP8_GROUP, device=device).to(torch.float8_e4m3fn),
                        torch.ones(1, 4, device=device))
    except Exception as e:  # whatever fails here, the GEMM is not there to serve
        log.warning("no FP8 block-scaled GEMM here (%s): projections stay 16-bit", e)
        return False
    return True


@torch.no_grad()
def quantize_linears(model: nn.Module) -> int:
    """Every projection of whole 128 x 128 blocks made FP8 in place, as an FP8 checkpoint stores it: its weight in
    e4m3 and its `weight_scale`, each block's largest magnitude at e4m3's 448, padded as cuBLAS reads them (the
    kernels' linear then quantises the input and multiplies in FP8). An FP8 checkpoint's codes come back as they were
    stored, its scales within bfloat16's rounding of the dequantised weights (2^-9: they load as 16-bit weights first).
    The embeddings, the LM head, routers, experts and MLA's absorbed kv_b_proj stay as they are. Returns how many."""
    from worker_svc.model.parallel import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear

    count = 0
    for module in model.modules():
        if (not isinstance(module, (ColumnParallelLinear, RowParallelLinear, ReplicatedLinear))
                or getattr(module, "absorbed", False) or module.weight.shape[0] % FP8_GROUP
                or module.weight.shape[1] % FP8_GROUP):
            continue
        n, k = module.weight.shape
        tiles = module.weight.data.float().view(n // FP8_GROUP, FP8_GROUP, k // FP8_GROUP, FP8_GROUP)
        scale = (tiles.abs().amax((1, 3)) / E4M3_MAX).clamp_min(1e-12)
        q = (tiles / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(n, k)
        module.weight = nn.Parameter(q, requires_grad=False)
        module.weight_scale = nn.functional.pad(scale, (0, -scale.shape[1] % 4)).contiguous()
        count += 1
    return count
