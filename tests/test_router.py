"""Routing a new request to a worker group (scheduler_svc/router.py), from a front-end's GroupViews as its engines'
reports update them: load that survives admission, prefix affinity, a group not yet reported."""
from __future__ import annotations

import random

from scheduler_svc.prefix_hash import PromptHashes
from scheduler_svc.router import GroupInfo, GroupView, pick_group

BLOCK = 16


def group(gid: int, num_blocks: int = 4096) -> GroupView:
    return GroupView(GroupInfo(gid, engine=gid, address=f"w{gid}", model="m", dtype="bf16", device="cpu",
                               num_blocks=num_blocks, block_size=BLOCK, max_model_len=8192, vocab_size=1000,
                               epoch=1, kv_cache_dtype="auto"))


class Engine:
    """What an engine reports of its group: `admit` prompts per step move from waiting to running, holding
    their blocks."""

    def __init__(self, view: GroupView, admit: int):
        self.view, self.admit = view, admit
        self.waiting: list[int] = []
        self.running: list[int] = []
        self.acked = 0

    def step(self) -> None:
        v = self.view
        self.waiting += [tokens for _, tokens in v.pending]  # every add sent since the last step arrives
        self.acked = v.sent
        moved, self.waiting = self.waiting[:self.admit], self.waiting[self.admit:]
        self.running += moved
        held = sum(-(-t // BLOCK) for t in self.running)
        v.report([len(self.waiting), sum(self.waiting), len(self.running), v.info.num_blocks - held, 0, 0, 0],
                 self.acked, None, (), ())


def test_a_burst_splits_evenly_between_a_group_that_admits_at_once_and_one_that_queues():
    """Load must not vanish when an engine admits a request: a group that moves its burst to running in one step
    would otherwise look idle and draw most of the next requests, and the groups of a burst of long requests would
    end unevenly."""
    rng = random.Random(0)
    fast, slow = group(0), group(1)
    engines = [Engine(fast, admit=1000), Engine(slow, admit=2)]
    counts = {0: 0, 1: 0}
    for i in range(400):
        hashes = PromptHashes([rng.randrange(1000) for _ in range(rng.randint(100, 1000))])
        g = pick_group([fast, slow], hashes)
        g.routed(len(hashes.token_ids))
        counts[g.group_id] += 1
        if i % 8 == 7:  # the engines report a step every few arrivals
            for e in engines:
                e.step()
    assert abs(counts[0] - counts[1]) <= 40, counts


def test_a_cached_prefix_wins_between_groups_under_the_same_load():
    a, b = group(0), group(1)
    prompt = list(range(10 * BLOCK + 3))
    for v in (a, b):
        v.report([0, 0, 4, v.info.num_blocks - 40, 0, 0, 0], 0, None, (), ())
    cached = PromptHashes(prompt).of(BLOCK)[:8]
    b.report([0, 0, 4, b.info.num_blocks - 40, 8, 0, 0], 0, [b"", b""], cached, ())
    assert b.cached_prefix_tokens(PromptHashes(prompt)) == 8 * BLOCK
    assert pick_group([a, b], PromptHashes(prompt)) is b
    # a much busier group loses its prefix's advantage: the prefill saved is less than the KV it holds more
    b.report([0, 0, 40, b.info.num_blocks - 400, 8, 0, 0], 0, None, (), ())
    assert pick_group([a, b], PromptHashes(prompt)) is a


def test_a_group_its_engine_has_not_reported_yet_is_empty_not_full():
    reported, new = group(0), group(1)
    reported.report([0, 0, 1, reported.info.num_blocks - 2, 0, 0, 0], 0, None, (), ())
    assert pick_group([reported, new], PromptHashes(list(range(50)))) is new
