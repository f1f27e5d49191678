"""How the scheduler plans and admits: one config for the scheduler of every worker group (the flags of
`splitserve-scheduler`, the options of the offline LLM)."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from common.limits import Limits

_LIMIT_FIELDS = frozenset(f.name for f in fields(Limits))


@dataclass(slots=True)
class SchedulerConfig:
    # Agreed with each worker at the handshake: a group plans within the smaller of each.
    limits: Limits = field(default_factory=Limits)
    # Cap on a prefill chunk in the first pass of a step; 0: max(block size, max_num_batched_tokens // 4).
    long_prefill_token_threshold: int = 0
    max_waiting: int = 4096  # queued requests per worker group before admission is refused
    enable_prefix_caching: bool = True
    # How many later arrivals one level of priority may overtake (aging: bounds starvation).
    priority_aging: int = 256
    # Plans handed to the worker before the oldest one's result is read (1: serial). At 3 the worker holds
    # step N+2 when N ends, so the result -> plan round trip through gRPC hides behind a whole step even at
    # batch 1; a finished sequence costs one more wasted decode.
    pipeline_depth: int = 3

    def __post_init__(self) -> None:
        for name, least in (("max_waiting", 1), ("pipeline_depth", 1), ("long_prefill_token_threshold", 0),
                            ("priority_aging", 0)):
            if getattr(self, name) < least:
                raise ValueError(f"{name} must be at least {least}, got {getattr(self, name)}")

    def chunk_cap(self, block_size: int) -> int:
        if self.long_prefill_token_threshold:
            return self.long_prefill_token_threshold
        return max(block_size, self.limits.max_num_batched_tokens // 4)


def config_from_options(options: dict[str, Any]) -> tuple[SchedulerConfig, dict[str, Any]]:
    """A SchedulerConfig from flat options (Limits fields and its own: the offline LLM's keyword arguments),
    and the options it did not take."""
    rest = dict(options)
    limits = Limits(**{k: rest.pop(k) for k in _LIMIT_FIELDS & rest.keys()})
    own = {f.name for f in fields(SchedulerConfig)} - {"limits"}
    return SchedulerConfig(limits=limits, **{k: rest.pop(k) for k in own & rest.keys()}), rest
