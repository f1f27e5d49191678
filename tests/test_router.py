"""Routing a new request to a worker group (scheduler_svc/router.py): load from the front-end's own requests, so
that front-ends routing a burst from stale engine counters still split it evenly; prefix affinity; a group its
engine has not reported yet."""
from __future__ import annotations

import random

from scheduler_svc.prefix_hash import PromptHashes
from scheduler_svc.router import GroupInfo, GroupView, pick_group, serving

BLOCK = 16


def group(gid: int, num_blocks: int = 4096, lora_adapters: tuple[str, ...] = ()) -> GroupView:
    return GroupView(GroupInfo(gid, engine=gid, address=f"w{gid}", model="m", dtype="bf16", device="cpu",
                               num_blocks=num_blocks, block_size=BLOCK, max_model_len=8192, vocab_size=1000,
                               epoch=1, kv_cache_dtype="auto", lora_adapters=list(lora_adapters)))


def test_a_request_under_an_adapter_goes_only_to_groups_that_serve_it():
    """A group that lacks an adapter (one that joined and could not load it, or one that dropped it first in an
    unload) takes none of its requests, however idle; requests under no adapter go anywhere."""
    busy, idle = group(0, lora_adapters=("x",)), group(1)
    busy.own_tokens = 10_000
    for n in range(20):
        assert pick_group(serving([busy, idle], "x"), PromptHashes(list(range(n + 5))), frontends=1) is busy
    assert pick_group(serving([busy, idle], ""), PromptHashes([1, 2, 3]), frontends=1) is idle
    assert serving([idle], "x") == []


def test_front_ends_routing_a_burst_at_once_split_it_evenly():
    """Four front-ends route 400 requests each at once, over groups whose engines report nothing meanwhile (the
    lag of a burst): each balances its own requests' tokens within a prompt, so the groups' totals end within a
    prompt per front-end."""
    rng = random.Random(0)
    frontends = [[group(g) for g in range(4)] for _ in range(4)]  # each front-end's views of the 4 groups
    counts, tokens = [0] * 4, [0] * 4
    for _ in range(400):
        for views in frontends:
            prompt = [rng.randrange(1000) for _ in range(rng.randint(100, 1000))]
            g = pick_group(views, PromptHashes(prompt), frontends=4)
            g.own_tokens += len(prompt)  # what Completion.move_to adds
            counts[g.group_id] += 1
            tokens[g.group_id] += len(prompt)
    assert max(tokens) - min(tokens) <= 4 * 1000, tokens
    assert max(counts) < 1.1 * min(counts), counts


def test_a_cached_prefix_wins_between_groups_under_the_same_load():
    a, b = group(0), group(1)
    prompt = list(range(10 * BLOCK + 3))
    a.own_tokens = b.own_tokens = 500
    b.report([0, 0, 4, b.info.num_blocks - 40, 8, 0, 0, ""], [b"", b""], PromptHashes(prompt).of(BLOCK)[:8], ())
    assert b.cached_prefix_tokens(PromptHashes(prompt)) == 8 * BLOCK
    assert pick_group([a, b], PromptHashes(prompt), frontends=2) is b
    # a busier group loses its prefix's advantage once its extra load (over all front-ends) exceeds the prefill
    # the prefix saves
    b.own_tokens = 500 + 4 * BLOCK + 1
    assert pick_group([a, b], PromptHashes(prompt), frontends=1) is b
    assert pick_group([a, b], PromptHashes(prompt), frontends=2) is a


def test_a_group_its_engine_has_not_reported_yet_is_empty_not_full():
    reported, new = group(0), group(1)
    reported.report([0, 0, 1, reported.info.num_blocks - 2, 0, 0, 0, ""], None, (), ())
    assert pick_group([reported, new], PromptHashes(list(range(50))), frontends=1) is new
