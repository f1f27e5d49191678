"""tl.dot at the precision of its operands: float32 ones multiplied in IEEE float32, as cuBLAS's float32 GEMMs (and so
transformers and the torch references) multiply them, where Triton's default would round them to TF32's 10-bit
mantissa. A worker serving in float32 then computes what the references compute; 16-bit operands are unchanged."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dot(a, b):
    if a.dtype == tl.float32:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out
