from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from common.util import cdiv
from scheduler_svc import prefix_hash
from scheduler_svc.block_manager import BlockManager
from scheduler_svc.sampling import SamplingParams
from scheduler_svc.sequence import Sequence

BS = 4


def make_seq(tokens: list[int], seq_id: int = 0) -> Sequence:
    return Sequence(seq_id, list(tokens), SamplingParams(seed=0))


def prefill(bm: BlockManager, seq: Sequence, upto: int | None = None) -> None:
    """Admit seq with its prefix hits, compute up to `upto` tokens, register full blocks."""
    hits = bm.match_prefix(seq)
    bm.acquire(hits)
    upto = len(seq.token_ids) if upto is None else upto
    need = cdiv(upto, bm.block_size) - len(hits)
    seq.block_table = hits + bm.allocate(need)
    seq.num_committed_blocks = len(hits)
    seq.num_computed_tokens = upto
    bm.commit(seq)


def test_allocate_free_counts():
    bm = BlockManager(8, BS)
    assert bm.num_free_blocks == 8 and bm.usage == 0.0
    a = bm.allocate(3)
    assert len(set(a)) == 3 and bm.num_free_blocks == 5
    assert bm.usage == pytest.approx(3 / 8)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.allocate(6)
    bm.free(a)
    assert bm.num_free_blocks == 8
    bm.check([])


def test_prefix_hit_shares_blocks_and_never_covers_last_token():
    bm = BlockManager(16, BS)
    a = make_seq(range(1, 13), 1)  # 3 full blocks
    prefill(bm, a)
    assert bm.num_cached_blocks == 3
    # Same 12 tokens: only 2 blocks hit, the last token must be computed.
    b = make_seq(range(1, 13), 2)
    assert bm.match_prefix(b) == a.block_table[:2]
    # Longer prompt with the same prefix: all 3 blocks hit.
    c = make_seq(list(range(1, 13)) + [99], 3)
    assert bm.match_prefix(c) == a.block_table[:3]
    # A different first block breaks the chain even if later blocks are equal.
    d = make_seq([0] + list(range(2, 13)) + [99], 4)
    assert bm.match_prefix(d) == []
    prefill(bm, c)
    assert c.block_table[:3] == a.block_table
    bm.check([a.block_table, c.block_table])
    bm.free(a.block_table)
    bm.free(c.block_table)
    bm.check([])


def test_cached_prefix_len_probes_without_taking_blocks():
    bm = BlockManager(16, BS)
    a = make_seq(range(1, 13), 1)
    prefill(bm, a)
    def cached(tokens: list[int]) -> int:
        return bm.cached_prefix_len(tokens, prefix_hash.PromptHashes(tokens).of(BS))

    assert cached(list(range(1, 13))) == 8  # never the last token
    assert cached(list(range(1, 20))) == 12
    assert cached([5, 6, 7, 8, 9]) == 0
    assert bm.num_free_blocks == 13
    bm.check([a.block_table])


def test_freed_blocks_stay_hittable_until_reallocated_lru():
    bm = BlockManager(6, BS)
    a = make_seq(range(1, 10), 1)  # blocks: 2 full + 1 partial
    prefill(bm, a)
    full, partial = a.block_table[:2], a.block_table[2]
    bm.free(a.block_table)
    # The partial block has no hash: reused first. Then blocks never used, then a's, tail first.
    assert bm.allocate(1) == [partial]
    assert bm.match_prefix(make_seq(range(1, 10))) == full
    rest = bm.allocate(3)
    assert full[0] not in rest and full[1] not in rest
    evicting = bm.allocate(1)  # a's tail block (freed first among a's) goes first
    assert evicting == [full[1]]
    assert bm.match_prefix(make_seq(range(1, 10))) == full[:1]


def test_blocks_about_to_be_reused_are_offloaded_ahead_and_leave_without_a_copy():
    """offload_ahead copies the cached blocks at the front of the free list to the host (once), GPU hits still
    take the GPU's copy, and reusing an offloaded block needs no swap-out: its prefix comes back from the host."""
    bm = BlockManager(4, BS, num_host_blocks=4)
    a = make_seq(range(1, 10), 1)  # blocks: 2 full + 1 partial
    prefill(bm, a)
    full = a.block_table[:2]
    bm.free(a.block_table)
    bm.offload_ahead(4)  # the free list's front four: the partial (no hash), a never-used one, then a's two
    assert sorted(g for g, _ in bm.offload) == sorted(full)
    swap_out, swap_in, offload = bm.take_swaps()
    assert not swap_out and not swap_in and len(offload) == 2
    bm.offload_ahead(4)
    assert not bm.has_copies  # the host holds both hashes already
    assert bm.match_prefix(make_seq(range(1, 10))) == full  # the GPU's copy first
    assert len(bm.allocate(4)) == 4 and not bm.swap_out  # reused with no copy out
    hits = bm.match_prefix(make_seq(range(1, 10)))
    assert len(hits) == 2 and all(h < 0 for h in hits)  # found on the host
    assert bm.num_swapped_out == 2


def test_forget_free_unregisters_free_blocks_in_both_tiers_and_keeps_held_ones():
    """What an unloaded LoRA adapter leaves: free cached blocks (GPU and host) are no longer found, their removal
    reported to the routers; a block a running sequence holds stays cached."""
    bm = BlockManager(6, BS, num_host_blocks=4)
    bm.record_events = True
    gone, kept = make_seq(range(1, 10), 1), make_seq(range(20, 29), 2)
    prefill(bm, gone)
    prefill(bm, kept)
    bm.free(gone.block_table)
    bm.offload_ahead(6)  # gone's two full blocks to the host as well
    bm.take_swaps()
    stored, _ = bm.take_events()
    bm.forget_free()
    assert bm.match_prefix(make_seq(range(1, 10))) == []
    assert bm.match_prefix(make_seq(range(20, 29))) == kept.block_table[:2]
    _, removed = bm.take_events()
    assert sorted(removed) == sorted(set(stored) - set(bm.cached_hashes())) and len(removed) == 2
    bm.free(kept.block_table)
    bm.check([])
    bm.host.check()


def test_hit_on_free_cached_block_takes_it_off_the_free_list():
    bm = BlockManager(4, BS)
    a = make_seq(range(1, 6), 1)
    prefill(bm, a)
    bm.free(a.block_table)
    assert bm.num_free_blocks == 4
    b = make_seq(range(1, 6), 2)
    hits = bm.match_prefix(b)
    assert bm.num_free_among(hits) == 1
    bm.acquire(hits)
    assert bm.num_free_blocks == 3
    fresh = bm.allocate(3)
    assert not set(fresh) & set(hits)
    bm.check([hits, fresh])


def test_hash_collision_never_returns_wrong_blocks(monkeypatch):
    monkeypatch.setattr(prefix_hash, "_xxh64", lambda data, seed: 42)  # every block collides
    bm = BlockManager(8, BS)
    a = make_seq(range(1, 9), 1)
    prefill(bm, a)
    assert bm.num_cached_blocks == 1  # the second block's hash is taken: not registered
    assert bm.match_prefix(make_seq(range(50, 59))) == []
    assert bm.match_prefix(make_seq(range(1, 10))) == a.block_table[:1]


def test_blocks_of_generated_tokens_become_hittable():
    bm = BlockManager(8, BS)
    a = make_seq(range(1, 4), 1)
    prefill(bm, a)
    assert bm.num_cached_blocks == 0
    a.token_ids += [7, 8]  # generated
    a.block_table += bm.allocate(1)
    a.num_computed_tokens = 5  # the token at position 4 was fed back
    bm.commit(a)
    assert bm.num_cached_blocks == 1
    assert bm.match_prefix(make_seq([1, 2, 3, 7, 9])) == a.block_table[:1]


def test_disabled_prefix_caching_never_hits():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = make_seq(range(1, 10), 1)
    prefill(bm, a)
    assert bm.num_cached_blocks == 0 and a.num_committed_blocks == 2
    assert bm.match_prefix(make_seq(range(1, 10))) == []


def test_double_free_is_detected():
    bm = BlockManager(2, BS)
    a = bm.allocate(1)
    bm.free(a)
    with pytest.raises(RuntimeError, match="freed more often"):
        bm.free(a)


@given(st.lists(st.integers(0, 3), min_size=1, max_size=40))
@settings(max_examples=50, deadline=None)
def test_hashes_are_chained(tokens):
    bm = BlockManager(64, 2)
    seq = make_seq(tokens)
    prefix_hash.extend_hashes(seq.token_ids, bm.block_size, seq.block_hashes, len(tokens) // 2)
    other = make_seq([9] + tokens[1:])
    prefix_hash.extend_hashes(other.token_ids, bm.block_size, other.block_hashes, len(tokens) // 2)
    if len(tokens) >= 2:
        assert seq.block_hashes[0] != other.block_hashes[0] or tokens[0] == 9
        # A changed first block changes every later hash.
        if tokens[0] != 9:
            assert all(h != g for h, g in zip(seq.block_hashes, other.block_hashes))


PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5, 5, 5]]


class BlockManagerMachine(RuleBasedStateMachine):
    """Sequences come and go with shared prefixes, computing chunks; the pool stays consistent and a
    hit returns blocks whose content is exactly the prefix asked for."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(10, 2)
        self.seqs: list[Sequence] = []
        self.content: dict[int, tuple[int, ...]] = {}  # block -> the whole prefix it ends (when full)
        self.next_id = 0

    def _write(self, seq: Sequence, start: int, end: int) -> None:
        bs = self.bm.block_size
        for p in range(start, end):
            if p % bs == bs - 1:
                self.content[seq.block_table[p // bs]] = tuple(seq.token_ids[: p + 1])
            else:
                self.content.pop(seq.block_table[p // bs], None)

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(0, 3), max_size=6), chunk=st.integers(1, 8))
    def admit(self, prefix, tail, chunk):
        bm = self.bm
        seq = make_seq(prefix[: len(prefix) - len(tail) % 3] + tail, self.next_id)
        self.next_id += 1
        hits = bm.match_prefix(seq)
        bs = bm.block_size
        for i, b in enumerate(hits):
            assert self.content[b] == tuple(seq.token_ids[: (i + 1) * bs]), "hit on a block with other content"
        assert len(hits) * bs < len(seq.token_ids)
        c = len(hits) * bs
        n = min(chunk, len(seq.token_ids) - c)
        need = cdiv(c + n, bs) - len(hits)
        if need + bm.num_free_among(hits) > bm.num_free_blocks:
            return
        bm.acquire(hits)
        seq.block_table = hits + bm.allocate(need)
        seq.num_committed_blocks = len(hits)
        seq.num_computed_tokens = c + n
        self._write(seq, c, c + n)
        bm.commit(seq)
        self.seqs.append(seq)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), chunk=st.integers(1, 8), gen=st.integers(0, 3))
    def compute(self, data, chunk, gen):
        bm = self.bm
        seq = data.draw(st.sampled_from(self.seqs))
        c = seq.num_computed_tokens
        if c == len(seq.token_ids):
            seq.token_ids.append(gen)  # a decode: the sampled token is fed back
        n = min(chunk, len(seq.token_ids) - c)
        need = cdiv(c + n, bm.block_size) - len(seq.block_table)
        if need > bm.num_free_blocks:
            return
        seq.block_table += bm.allocate(need)
        seq.num_computed_tokens = c + n
        self._write(seq, c, c + n)
        bm.commit(seq)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def release(self, data):
        seq = data.draw(st.sampled_from(self.seqs))
        self.seqs.remove(seq)
        self.bm.free(seq.block_table)

    @rule()
    def forget_free(self):
        self.bm.forget_free()
        held = {b for s in self.seqs for b in s.block_table}
        assert all(b in held for b in range(self.bm.num_blocks) if self.bm.block_hash(b) is not None)

    @invariant()
    def consistent(self):
        self.bm.check(s.block_table for s in self.seqs)
        for b in range(self.bm.num_blocks):
            h = self.bm.block_hash(b)
            if h is not None:
                assert b in self.content, f"block {b} is indexed but not full"

    def teardown(self):
        for seq in self.seqs:
            self.bm.free(seq.block_table)
        self.bm.check([])
        assert self.bm.num_free_blocks == self.bm.num_blocks


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
