"""Small helpers."""
from __future__ import annotations

import gc
import os
import socket
from collections.abc import Coroutine
from typing import Any, TypeVar

N = TypeVar("N")
T = TypeVar("T")

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


def freeze_heap() -> None:
    """Takes every object alive now out of the garbage collector's walks (gc.freeze), at the end of a process's
    start-up: what it built then (the modules it imported, a model, a tokenizer) lives as long as it does, and every
    full collection would walk all of it again, holding the whole process meanwhile."""
    gc.collect()
    gc.freeze()


def run_loop(main: Coroutine[Any, Any, T]) -> T:
    """Runs `main` to its end on uvloop, the event loop of every asyncio process of the project: each gRPC
    message a front-end writes or a client reads costs less CPU there than on asyncio's own loop."""
    import uvloop

    return uvloop.run(main)


# gRPC's reconnect backoff starts at 1 s and grows to 120 s, so a channel whose peer was not up yet (or went away)
# tries again up to that long after the peer is back. Between this project's processes: soon and often.
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 2_000)]


_handed_out: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now and not handed out before by this process: the kernel may offer a port it has
    just released again, and a cluster's scheduler and worker must not both get it."""
    while True:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
