"""Which worker group gets a new request: the lowest cost of prefill work left to do after its prefix
cache, plus its load, so hot prefixes go where they are cached without piling onto one group."""
from __future__ import annotations

from typing import Protocol

# A running sequence costs about this many prompt tokens of work per step it stays (tunable).
RUNNING_WEIGHT = 8


class Group(Protocol):
    def load(self) -> tuple[int, int, int]: ...
    def cached_prefix_tokens(self, token_ids: list[int]) -> int: ...


def cost(group: Group, prompt_ids: list[int]) -> float:
    waiting_tokens, running, free_blocks = group.load()
    uncached = len(prompt_ids) - group.cached_prefix_tokens(prompt_ids)
    return uncached + waiting_tokens + RUNNING_WEIGHT * running - (1e-6 * free_blocks)


def pick_group(groups: list, prompt_ids: list[int]):
    return min(groups, key=lambda g: cost(g, prompt_ids))
