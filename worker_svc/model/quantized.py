"""Quantized weights: checkpoints stored quantized, dequantized as they are read, and projections served in FP8.

- MXFP4 (the OCP microscaling format gpt-oss publishes its experts in): each block of 32 values is 16 bytes of
  e2m1 codes, two a byte (the low nibble first), and one e8m0 scale, a power of two biased by 127; dequantised into
  bfloat16, where every such value is exact (model/gpt_oss.py pairs the tensors).
- FP8 with block scales (`quant_method: fp8`, `weight_block_size`: DeepSeek-V3 / R1, Kimi-K2, Qwen3's -FP8
  checkpoints): a linear's `weight` in float8_e4m3fn and its `weight_scale_inv`, one float32 factor per block of
  weight_block_size (the last blocks of a row or column may be partial); every other tensor as it is.
- FP8 projections (`--quantization`, runtime/model_runner.py chooses): each projection of whole 128 x 128 blocks
  holds e4m3 codes and a float32 scale per block, quantised from whatever the checkpoint stores as its last shard
  loads (StagedFp8), and the kernels' linear multiplies them in FP8; a MoE's experts likewise, each part quantised
  as it loads, multiplied by the fused MoE over inputs quantised as a projection's (kernels/moe.py: grouped_gemm).
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from common.util import cdiv
from worker_svc.kernels.reference import E4M3_MAX, FP8_GROUP
from worker_svc.model.loader import CheckpointTensor, joined

log = logging.getLogger(__name__)

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
    """Codes [..., rows, cols] (float8, or integers) times their blocks' scales [..., cdiv(rows, block[0]),
    cdiv(cols, block[1])] -> float32."""
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
    def part_of(name: str) -> tuple[str, str] | None:
        if name.endswith(".weight_scale_inv") and name.removesuffix("_scale_inv") in names:
            return name.removesuffix("_scale_inv"), "scale"
        return (name, "weight") if f"{name}_scale_inv" in names else None

    return joined(tensors, names, part_of, lambda p: dequantize_fp8_blocks(p["weight"], p["scale"], block))


@functools.cache
def fp8_gemms(device: torch.device) -> bool:
    """Whether this device and this torch multiply FP8 blocks (kernels/fp8_gemm.py): cuBLAS's block-scaled GEMM needs
    Hopper (sm_90) and CUDA >= 12.9, and its product must pass `gemm_fault` (a build that lacks it or computes it
    wrong: 16-bit GEMMs, said)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        return False
    if tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2]) < (12, 9):
        return False
    from worker_svc.kernels import fp8_gemm

    why = gemm_fault(fp8_gemm.linear, device, fp8_gemm.K_BLOCKS)
    if why:
        log.warning("no FP8 block-scaled GEMM here (%s): projections stay 16-bit", why)
    return not why


def gemm_fault(linear: Callable[..., torch.Tensor], device: torch.device, k_blocks: int) -> str:
    """What is wrong with `linear` (x, e4m3 weight, block scales) -> x W^T, or "" where nothing: a weight of ones two
    blocks high and `k_blocks` wide, each block with a scale of its own, times an input of ones, must give each output
    128 times its row of scales' sum exactly (a GEMM that reads a scale from the wrong place does not)."""
    scale = torch.arange(1, 2 * k_blocks + 1, dtype=torch.float32, device=device).view(2, k_blocks)
    try:
        y = linear(torch.ones(1, k_blocks * FP8_GROUP, dtype=torch.bfloat16, device=device),
                   torch.ones(2 * FP8_GROUP, k_blocks * FP8_GROUP, device=device).to(torch.float8_e4m3fn), scale)
    except Exception as e:  # whatever fails here, the GEMM is not there to serve
        return str(e)
    expected = (FP8_GROUP * scale.sum(1)).repeat_interleave(FP8_GROUP)
    if torch.equal(y[0].float(), expected):
        return ""
    return f"a wrong product ({y[0, ::FP8_GROUP].tolist()} for {expected[::FP8_GROUP].tolist()})"


def fp8_blocks(module: nn.Module, k_blocks: int) -> bool:
    """Whether this module's weight is served in FP8 blocks where the projections are: a projection (not MLA's absorbed
    kv_b_proj, read as a tensor) of whole 128 x 128 blocks, its input a whole number of `k_blocks` blocks wide
    (kernels/fp8_gemm.py's K_BLOCKS on a GPU), or the experts' weights where each expert's parts are whole blocks. The
    embeddings, the LM head and the routers stay as they are."""
    from worker_svc.model.moe import ExpertWeights
    from worker_svc.model.parallel import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear

    if isinstance(module, ExpertWeights):
        return module.out % FP8_GROUP == 0 and module.weight.shape[2] % FP8_GROUP == 0
    return (isinstance(module, (ColumnParallelLinear, RowParallelLinear, ReplicatedLinear))
            and not getattr(module, "absorbed", False)
            and module.weight.shape[0] % FP8_GROUP == 0 and module.weight.shape[1] % (k_blocks * FP8_GROUP) == 0)


@torch.no_grad()
def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] (whole 128 x 128 blocks) -> its e4m3 codes and float32 block scales [N / 128, K / 128]: each block's
    largest magnitude at e4m3's 448."""
    n, k = w.shape
    tiles = w.float().view(n // FP8_GROUP, FP8_GROUP, k // FP8_GROUP, FP8_GROUP)
    scale = (tiles.abs().amax((1, 3)) / E4M3_MAX).clamp_min(1e-12)
    codes = (tiles / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(n, k)
    return codes, scale


@dataclass(slots=True)
class StagedFp8:
    """An FP8 projection's weight while it loads: load_weights copies each checkpoint shard of it into a float32
    buffer and calls `finish` once every shard is in, which quantises the buffer into the weight and drops it. So an
    FP8 model loads within its FP8 size plus the projections being loaded (an FP8 checkpoint's codes and scales come
    back as stored, up to float32's rounding of the dequantised values)."""
    module: nn.Module
    buffer: torch.Tensor | None = None

    def target(self) -> torch.Tensor:
        """Where the module's weight loader writes a shard."""
        if self.buffer is None:
            weight = self.module.weight
            self.buffer = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
        return self.buffer

    def finish(self) -> None:
        codes, scale = quantize_blocks(self.target())
        self.module.weight.data.copy_(codes)
        self.module.weight_scale.copy_(scale)
        self.buffer = None


def allocate_projections(model: nn.Module, device: torch.device, dtype: torch.dtype, k_blocks: int | None = None
                         ) -> int:
    """Storage for the weights of a model built under parallel.deferred_projections: FP8 codes and block scales for
    every projection of whole blocks (`fp8_blocks`), each linear's load staged (StagedFp8; the experts' loader
    quantises each part itself); `dtype` for the rest. `k_blocks`: by default the GPU's GEMM's K_BLOCKS on a GPU, any
    whole blocks (the reference's) elsewhere. Returns how many are FP8."""
    if k_blocks is None:
        from worker_svc.kernels import fp8_gemm

        k_blocks = fp8_gemm.K_BLOCKS if device.type == "cuda" else 1
    count = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, nn.Parameter) or not weight.is_meta:
            continue
        fp8 = fp8_blocks(module, k_blocks)
        allocated = allocate(module, "weight", weight.shape, torch.float8_e4m3fn if fp8 else dtype, device)
        if fp8:
            *lead, n, k = weight.shape
            module.weight_scale = torch.zeros(*lead, n // FP8_GROUP, k // FP8_GROUP, dtype=torch.float32,
                                              device=device)
            if not lead:  # a linear, whose parts may share a block (k and v at head_dim 64)
                allocated.staged = StagedFp8(module)
            count += 1
    return count


def allocate(module: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
             ) -> nn.Parameter:
    """Storage for a parameter of a module built under parallel.deferred_projections, loaded as its deferred weight
    is (its weight_loader, split_fused)."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
    param.__dict__.update(module.weight.__dict__)
    setattr(module, name, param)
    return param
