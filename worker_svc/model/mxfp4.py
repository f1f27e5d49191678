"""MXFP4 (the OCP microscaling format gpt-oss publishes its experts in): each block of 32 values is 16 bytes of
e2m1 codes, two a byte (the low nibble first), and one e8m0 scale, a power of two biased by 127. Dequantised at load
into bfloat16, where every such value is exact; the experts then run as 16-bit weights."""
from __future__ import annotations

import torch

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
