"""Counts the GPU kernel variants this process builds, before and after it starts serving.

A request must never wait for a compiler: the warm-up (ModelRunner._warm_up, the decode graphs' capture) is
meant to build every variant a step can hit. What is built afterwards is counted here (and logged), so a
benchmark or a scrape of `splitserve:worker_kernel_builds_total{phase="serving"}` shows whether it did. The
compilers' hooks that call count() are kernels/build_hooks.py's (GPU only); this module imports no torch.
"""
from __future__ import annotations

import logging
import threading

log = logging.getLogger("splitserve.worker")


class KernelBuilds:
    __slots__ = ("warm_up", "serving", "_serving", "_lock")

    def __init__(self):
        self.warm_up = self.serving = 0
        self._serving = False
        self._lock = threading.Lock()

    def count(self, what: str) -> None:
        with self._lock:
            if self._serving:
                self.serving += 1
            else:
                self.warm_up += 1
        if self._serving:
            log.warning("kernel built while serving (the warm-up missed it): %s", what)

    def serving_from_now(self, serving: bool = True) -> None:
        """What is built from now on, a request waited for (the worker calls it as it reports SERVING)."""
        self._serving = serving


BUILDS = KernelBuilds()  # one per process: the compilers' hooks are global
