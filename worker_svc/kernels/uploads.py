"""A step's host arrays travel to the device in one copy: packed into one pinned byte buffer, each array
starting on a 16-byte boundary. Triton specialises a kernel on its pointers' alignment, so views at any
offset would compile new kernel variants while serving (the warm-up's tensors are all aligned)."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from common.util import cdiv

ALIGN = 16
TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32,
                np.dtype(np.float32): torch.float32}


def aligned_starts(nbytes: Sequence[int]) -> tuple[list[int], int]:
    """Where each of arrays of these byte sizes starts in a packed buffer, and the buffer's size."""
    starts, total = [], 0
    for n in nbytes:
        starts.append(total)
        total += cdiv(n, ALIGN) * ALIGN
    return starts, total


def pack_aligned(arrays: Sequence[np.ndarray], out: np.ndarray | None = None) -> tuple[np.ndarray, list[int]]:
    """Arrays of any dtypes laid out in one byte buffer (`out`, or a new one), each starting on a 16-byte
    boundary; returns the buffer and where each starts (in bytes)."""
    starts, total = aligned_starts([a.nbytes for a in arrays])
    flat = np.zeros(total, np.uint8) if out is None else out
    pack_into(flat, arrays, starts)
    return flat, starts


def pack_into(flat: np.ndarray, arrays: Sequence[np.ndarray], starts: Sequence[int]) -> None:
    """Writes each array's bytes into `flat` from its start."""
    for a, start in zip(arrays, starts):
        flat[start:start + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def staging(nbytes: int, device: torch.device) -> torch.Tensor:
    """A host byte buffer to pack into: pinned for a GPU (torch's caching host allocator hands a block
    back only once the copies that read it have run)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")


def upload(arrays: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """The arrays on `device` after one copy, as flat views in the same order."""
    starts, total = aligned_starts([a.nbytes for a in arrays])
    host = staging(total, device)
    pack_aligned(arrays, host.numpy())
    buffer = host.to(device, non_blocking=True) if device.type != "cpu" else host
    return [buffer[start:start + a.nbytes].view(TORCH_DTYPES[a.dtype]) for a, start in zip(arrays, starts)]
