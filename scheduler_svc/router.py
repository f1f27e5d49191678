"""Which worker group gets a new request: the lowest cost of prefill work left to do after its prefix cache,
plus its load, so hot prefixes go where they are cached without piling onto one group.

Load is counted in tokens and survives admission: a request weighs its prompt while it waits (pending at the
front-end, then queued at the engine) and its KV once it runs (the blocks its group's sequences hold), so a
group that admits a burst quickly does not look idle and draw the next one (a running sequence counted as a few
tokens made the groups of a burst of long requests end unevenly, and the pass with them). KV held is also what
each decode step reads and what preemption frees, as in Dynamo's KV router (prefill blocks + active blocks).

A front-end routes from its GroupViews: what the supervisor says of each group (GroupInfo), and a mirror of the
group's prefix-cache index and load that its engine publishes with every step (block-stored and block-removed
events, queue and KV counters). The mirror lags the engine by at most the message in flight; requests this
front-end routed and the engine has not acknowledged yet count as pending prefill, so a burst does not all land
on the group that looked idle. Another front-end's burst shows up one step later."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from scheduler_svc.prefix_hash import PromptHashes


@dataclass(slots=True)
class GroupInfo:
    """A worker group as the supervisor announces it (one Execute stream to one worker, at one epoch)."""
    group_id: int
    engine: int  # the engine process that drives it
    address: str
    model: str
    dtype: str
    device: str
    num_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    epoch: int
    kv_cache_dtype: str
    num_host_blocks: int = 0
    draining: bool = False


@dataclass(slots=True, eq=False)
class GroupView:
    info: GroupInfo
    hashes: set[int] = field(default_factory=set)  # the group's cached blocks, by chained hash
    # its engine's last report
    waiting: int = 0
    waiting_tokens: int = 0
    running: int = 0
    free_blocks: int = 0
    cached_blocks: int = 0
    preemptions: int = 0
    num_requests: int = 0
    # adds this front-end sent and the engine has not acknowledged yet: (serial, prompt tokens)
    pending: deque = field(default_factory=deque)
    pending_tokens: int = 0
    sent: int = 0

    def __post_init__(self) -> None:
        self.free_blocks = self.info.num_blocks  # until its engine's first report

    @property
    def group_id(self) -> int:
        return self.info.group_id

    @property
    def address(self) -> str:
        return self.info.address

    def routed(self, tokens: int) -> None:
        """A request of `tokens` prompt tokens was sent to the group."""
        self.sent += 1
        self.pending.append((self.sent, tokens))
        self.pending_tokens += tokens

    def report(self, load: list, acked: int, events: list | None, stored, removed) -> None:
        """The engine's report: its load, how many of this front-end's adds it has applied, cache events."""
        (self.waiting, self.waiting_tokens, self.running, self.free_blocks, self.cached_blocks, self.preemptions,
         self.num_requests) = load
        while self.pending and self.pending[0][0] <= acked:
            self.pending_tokens -= self.pending.popleft()[1]
        if events is not None:
            if len(events) > 2:  # a snapshot: the whole index
                self.hashes = set(stored)
            else:
                self.hashes.update(stored)
                self.hashes.difference_update(removed)

    def load(self) -> tuple[int, int, int]:
        """Prompt tokens queued for it (pending here, waiting there), KV tokens its sequences hold, free blocks."""
        held = (self.info.num_blocks - self.free_blocks) * self.info.block_size
        return self.waiting_tokens + self.pending_tokens, held, self.free_blocks

    def cached_prefix_tokens(self, hashes: PromptHashes) -> int:
        """Tokens of the prompt its prefix cache holds in either tier (as last reported), never the last one."""
        bs = self.info.block_size
        of = hashes.of(bs)
        limit = (len(hashes.token_ids) - 1) // bs
        n = 0
        cached = self.hashes
        while n < limit and of[n] in cached:
            n += 1
        return n * bs


class Group(Protocol):
    def load(self) -> tuple[int, int, int]: ...
    def cached_prefix_tokens(self, hashes: PromptHashes) -> int: ...


G = TypeVar("G", bound=Group)


def cost(group: Group, hashes: PromptHashes) -> float:
    queued_tokens, held_tokens, free_blocks = group.load()
    uncached = len(hashes.token_ids) - group.cached_prefix_tokens(hashes)
    return uncached + queued_tokens + held_tokens - (1e-6 * free_blocks)


def pick_group(groups: list[G], hashes: PromptHashes) -> G:
    return min(groups, key=lambda g: cost(g, hashes))
