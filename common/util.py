"""Small helpers."""
from __future__ import annotations

import os
from typing import TypeVar

N = TypeVar("N")

CPUS_ENV = "SPLITSERVE_CPUS"  # cores a process tree may size itself to (a container's CPU request)


def cdiv(a: N, b: int) -> N:
    """Ceiling division of non-negative integers (numpy arrays too)."""
    return -(-a // b)


def available_cpus() -> int:
    """Cores this process may use: $SPLITSERVE_CPUS when set (a pod's CPU request, which affinity does not
    show), else the CPU affinity mask (a cgroup cpuset or `taskset`), never the host's whole count."""
    value = os.environ.get(CPUS_ENV, "").strip()
    if value:
        try:
            return max(1, int(float(value)))
        except ValueError:
            raise ValueError(f"${CPUS_ENV} must be a number of cores, got {value!r}") from None
    return max(1, len(os.sched_getaffinity(0)))
