"""Which worker group gets a new request: the lowest cost of prefill work left to do after its prefix
cache, plus its load, so hot prefixes go where they are cached without piling onto one group."""
from __future__ import annotations

from typing import Protocol, TypeVar

from scheduler_svc.prefix_hash import PromptHashes

# A running sequence costs about this many prompt tokens of work per step it stays (tunable).
RUNNING_WEIGHT = 8


class Group(Protocol):
    def load(self) -> tuple[int, int, int]: ...
    def cached_prefix_tokens(self, hashes: PromptHashes) -> int: ...


G = TypeVar("G", bound=Group)


def cost(group: Group, hashes: PromptHashes) -> float:
    waiting_tokens, running, free_blocks = group.load()
    uncached = len(hashes.token_ids) - group.cached_prefix_tokens(hashes)
    return uncached + waiting_tokens + RUNNING_WEIGHT * running - (1e-6 * free_blocks)


def pick_group(groups: list[G], hashes: PromptHashes) -> G:
    return min(groups, key=lambda g: cost(g, hashes))
