"""Small helpers."""
from __future__ import annotations

from typing import TypeVar

N = TypeVar("N")


def cdiv(a: N, b: int) -> N:
    """Ceiling division of non-negative integers (numpy arrays too)."""
    return -(-a // b)
