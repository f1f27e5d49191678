"""Hooks on the GPU compilers that report every kernel variant this process builds to a callback (the worker's
runtime/kernel_builds.py counts them):
- Triton: a kernel variant's first launch in the process (compiled, or loaded from Triton's disk cache), from
  Triton's post-compile hook;
- flash-attn-4: each CuTe DSL compile (its disk cache, when enabled, loads without one)."""
from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger("splitserve.worker")
_installed: list[Callable[[str], None]] = []


def install(count: Callable[[str], None]) -> None:
    """count(what) on every build; once per process and callback. Imports Triton and, where installed, the
    CuTe DSL."""
    if count in _installed:
        return
    _installed.append(count)
    import triton

    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
        log.warning("this Triton has no post-compile hook: kernel builds are not counted")
    else:
        previous = runtime.jit_post_compile_hook

        def on_compile(*args, **kwargs):
            count(f"triton {kwargs.get('repr') or kwargs.get('key', '?')}")
            return previous(*args, **kwargs) if previous is not None else None

        runtime.jit_post_compile_hook = on_compile
    try:
        import cutlass.cute as cute
    except ImportError:  # no flash-attn-4 here
        return
    cute.compile = CountedCompile(cute.compile, count)


class CountedCompile:
    """cute.compile (a callable that also takes options by `[...]`), reporting each call."""

    def __init__(self, inner, count: Callable[[str], None]):
        self._inner, self._count = inner, count

    def __call__(self, *args, **kwargs):
        self._count(f"flash-attn-4 {getattr(args[0], '__name__', type(args[0]).__name__) if args else '?'}")
        return self._inner(*args, **kwargs)

    def __getitem__(self, options):
        return CountedCompile(self._inner[options], self._count)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)
