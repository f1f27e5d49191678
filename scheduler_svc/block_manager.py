"""Paged KV blocks of one worker group: ref counts, a free list in LRU order and a prefix-cache index, over
two tiers: the GPU's blocks and, when the worker keeps one, a pool of host blocks behind them.

A full block is identified by its chained hash (prefix_hash.py). The index keeps each block's token ids
and parent hash and a lookup compares them, so a hash collision can never hand out the wrong KV. Freed
blocks keep their hash and stay hittable until they are reallocated; the free list reuses blocks with no
hash first, then the least recently freed.

The host tier holds cached full blocks only, so it needs no reference counts: a GPU block that the LRU
reallocates moves to the host (swap out: copied there before the step that reuses it writes it) unless the
host holds its hash already, and a lookup continues on the host where the GPU misses (swap in: a fresh GPU
block that the copy fills before the step reads it). Host blocks are reused in LRU order in turn. A
preempted sequence's full blocks reach the host this way, when the GPU needs their room and only then, and
it comes back through its prefix; the partial block at its end is recomputed (fewer than block_size tokens:
less work than copying a whole block out and back). The copies of a plan are its swap_out / swap_in
columns (take_swaps()); the worker makes them in plan order, swap-outs first, before the step's forward.

A swap-out at reuse stalls the step that reuses the block until the copy is done. So after each plan the
cached blocks the next allocations will take (the front of the free list) are copied to the host ahead of
time (offload_ahead(): the plan's offload columns, which the worker copies after the step's forward and off
its critical path); a block whose hash the host holds then leaves the GPU with no copy. Both tiers hold such
a block until the GPU reuses it.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Iterable
from itertools import islice

from scheduler_svc.prefix_hash import ROOT_HASH, block_bytes, extend_hashes, hash_block
from scheduler_svc.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, num_host_blocks: int = 0):
        """With record_events set, hashes the group comes to hold (in either tier) and stops holding (in both)
        are appended to `stored` and `removed` for whoever mirrors them (the front-ends' routers: a host hit
        saves a prefill too); take_events() empties them. The host tier caches, so it is on only with prefix
        caching."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._pack_block = struct.Struct(f"={block_size}i").pack
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks  # set while registered in the index
        self._parent = [ROOT_HASH] * num_blocks
        self._data: list[bytes | None] = [None] * num_blocks  # token ids of a registered block
        self._index: dict[int, int] = {}  # hash -> block id
        # Free blocks; the front is reused first. Values unused (an ordered set).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.record_events = False
        self.stored: list[int] = []
        self.removed: list[int] = []
        self.host = HostTier(num_host_blocks) if num_host_blocks and enable_prefix_caching else None
        self.swap_out: list[tuple[int, int]] = []  # (GPU block, host block) copies for the next plan
        self.swap_in: list[tuple[int, int]] = []  # (host block, GPU block)
        self.offload: list[tuple[int, int]] = []  # (GPU block, host block) copied after the next plan's forward
        self.num_swapped_out = 0  # blocks, since start
        self.num_swapped_in = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._index)

    def block_hash(self, block_id: int) -> int | None:
        return self._hash[block_id]

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the longest prefix of seq's tokens, never its last token: GPU block ids, and
        ~id (negative) for a block found on the host only.

        Takes no references: pair with acquire(), which turns host hits into GPU blocks."""
        if not self.enable_prefix_caching or (seq.sampling is not None and (
                seq.sampling.HasField("prompt_logprobs") or seq.sampling.pooling in ("mean", "cls"))):
            return []  # a request scoring its prompt, or pooling more than its last row, computes all of it
        limit = (len(seq.token_ids) - 1) // self.block_size
        hashes = extend_hashes(seq.token_ids, self.block_size, seq.block_hashes, limit, seq.hash_root)
        return self._match(seq.token_ids, hashes, limit, seq.hash_root)

    def cached_prefix_len(self, token_ids: list[int], hashes: list[int], root: int = ROOT_HASH) -> int:
        """Tokens of a prompt the prefix cache would serve now, given the hashes of its full blocks chained from
        `root` (routing; no state changes)."""
        if not self.enable_prefix_caching:
            return 0
        return len(self._match(token_ids, hashes, (len(token_ids) - 1) // self.block_size, root)) * self.block_size

    def _match(self, token_ids: list[int], hashes: list[int], limit: int, root: int) -> list[int]:
        bs = self.block_size
        index = self._index
        host = self.host
        hits: list[int] = []
        for i in range(limit):
            bid = index.get(hashes[i])
            if bid is None:
                hb = host.index.get(hashes[i]) if host is not None else None
                if hb is None:
                    break
                bid = ~hb
            hits.append(bid)
        if hits:
            # Rule out collisions: same parent hash and same token ids, block by block.
            width = 4 * bs
            data = block_bytes(token_ids[: len(hits) * bs])
            for i, bid in enumerate(hits):
                parent = hashes[i - 1] if i else root
                if bid >= 0:
                    held = self._parent[bid], self._data[bid]
                else:
                    held = host.parent[~bid], host.data[~bid]
                if held != (parent, data[i * width : (i + 1) * width]):
                    return hits[:i]
        return hits

    def num_free_among(self, hits: Iterable[int]) -> int:
        """Free blocks that acquiring these hits takes: GPU hits on the free list, and one per host hit."""
        ref = self._ref
        return sum(1 for b in hits if b < 0 or ref[b] == 0)

    def acquire(self, hits: list[int]) -> list[int]:
        """Take a reference on the blocks of prefix hits (match_prefix); each host hit gets a fresh GPU block
        that a swap-in fills and that joins the GPU's index. Returns the GPU block ids."""
        ref = self._ref
        for b in hits:
            if b >= 0:
                if ref[b] == 0:
                    del self._free[b]
                ref[b] += 1
        if self.host is None or min(hits, default=0) >= 0:
            return hits
        host = self.host
        on_host = [~b for b in hits if b < 0]
        host.hold(on_host)  # the allocations of this plan may move GPU blocks out: not into these
        table = []
        for b in hits:
            if b >= 0:
                table.append(b)
                continue
            g = self.allocate_one()
            hb = ~b
            h = host.hash[hb]
            if h not in self._index:
                self._register(g, h, host.parent[hb], host.data[hb])
            self.swap_in.append((hb, g))
            table.append(g)
        self.num_swapped_in += len(on_host)
        return table

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks, each with one reference; evicts their old hashes."""
        if n > len(self._free):
            raise RuntimeError(f"out of KV blocks: need {n}, {len(self._free)} free")
        return [self.allocate_one() for _ in range(n)]

    def allocate_one(self) -> int:
        b, _ = self._free.popitem(last=False)  # KeyError when none is free
        h = self._hash[b]
        if h is not None:
            host = self.host
            del self._index[h]
            self._hash[b] = None
            if host is not None:
                hb = self._to_host(b, h)
                if hb is not None:
                    self.swap_out.append((b, hb))
            self._data[b] = None
            if self.record_events and (host is None or h not in host.index):
                self.removed.append(h)
        self._ref[b] = 1
        return b

    def forget_free(self) -> int:
        """Unregisters every cached block no sequence holds, in both tiers (the KV of a LoRA adapter that is
        unloaded: a later load under its name must not hit it; a reset of the prefix cache). A block held now by
        running sequences stays. Returns how many blocks it unregistered."""
        host, dropped = self.host, 0
        for b in list(self._free):
            h = self._hash[b]
            if h is not None:
                del self._index[h]
                self._hash[b] = self._data[b] = None
                self._free.move_to_end(b, last=False)
                dropped += 1
                if self.record_events and (host is None or h not in host.index):
                    self.removed.append(h)
        if host is not None:
            for h in host.forget():
                dropped += 1
                if self.record_events and h not in self._index:
                    self.removed.append(h)
        return dropped

    def offload_ahead(self, n: int) -> None:
        """Copies to the host the cached blocks among the next n the GPU will reuse that the host lacks."""
        host = self.host
        if host is None:
            return
        for b in list(islice(self._free, n)):
            h = self._hash[b]
            if h is not None and h not in host.index:
                hb = self._to_host(b, h)
                if hb is None:
                    return  # every host block is held by this plan
                self.offload.append((b, hb))

    def _to_host(self, b: int, h: int) -> int | None:
        """The host block that is to receive GPU block b's copy (its hash h), or None when the host holds h
        already or can take no block now."""
        hb, dropped = self.host.keep(h, self._parent[b], self._data[b])
        if hb is not None:
            self.num_swapped_out += 1
        if dropped is not None and self.record_events and dropped not in self._index:
            self.removed.append(dropped)
        return hb

    def _register(self, b: int, h: int, parent: int, data: bytes) -> None:
        self._index[h] = b
        self._hash[b] = h
        self._parent[b] = parent
        self._data[b] = data
        if self.record_events:
            self.stored.append(h)

    @property
    def has_copies(self) -> bool:
        return bool(self.swap_out or self.swap_in or self.offload)

    def take_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]], list[tuple[int, int]]]:
        """(swap-outs, swap-ins, offloads) since the last call: the copies the next plan carries."""
        swaps = self.swap_out, self.swap_in, self.offload
        self.swap_out, self.swap_in, self.offload = [], [], []
        if self.host is not None:
            self.host.plan_done()
        return swaps

    def take_events(self) -> tuple[list[int], list[int]]:
        """(hashes stored, hashes removed) since the last call, net of each other: a hash that left and came back
        is only stored, one that came and left only removed, so a mirror may apply the stored ones, then the
        removed ones."""
        index, host = self._index, self.host.index if self.host is not None else {}
        stored = [h for h in self.stored if h in index or h in host]
        removed = [h for h in self.removed if h not in index and h not in host]
        self.stored, self.removed = [], []
        return stored, removed

    def cached_hashes(self) -> list[int]:
        """Every hash the group holds now, in either tier (a mirror's starting point)."""
        if self.host is None:
            return list(self._index)
        return [*self._index, *(h for h in self.host.index if h not in self._index)]

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference on each block. Tail blocks are released first, so a sequence's prefix
        blocks are the most recently freed and the last evicted."""
        ref = self._ref
        free = self._free
        for b in reversed(block_ids):
            ref[b] -= 1
            if ref[b] == 0:
                free[b] = None
                if self._hash[b] is None:
                    free.move_to_end(b, last=False)
            elif ref[b] < 0:
                raise RuntimeError(f"block {b} freed more often than referenced")

    def commit(self, seq: Sequence) -> None:
        """Register seq's blocks that are full of known tokens whose KV is scheduled.

        Plans run in step order, so a block registered while its last chunk is in flight is written
        before any later plan can read it through a hit."""
        bs = self.block_size
        c = seq.num_computed_tokens
        toks = seq.token_ids
        end = (c if c < len(toks) else len(toks)) // bs
        start = seq.num_committed_blocks
        if end <= start:
            return
        seq.num_committed_blocks = end
        if not self.enable_prefix_caching:
            return
        width = 4 * bs
        if end - start == 1:  # the common case, a decode completing a block
            data = self._pack_block(*toks[start * bs : end * bs])
        else:
            data = block_bytes(toks[start * bs : end * bs])
        hashes = seq.block_hashes
        known = len(hashes)
        table = seq.block_table
        index = self._index
        parent = hashes[start - 1] if start else seq.hash_root
        off = 0
        for i in range(start, end):
            block = data[off : off + width]
            off += width
            if i < known:
                h = hashes[i]
            else:
                h = hash_block(block, parent)
                hashes.append(h)
            # else the same content is cached in another block; a block released behind a sliding window
            # (Sequence.num_released_blocks) may hold another sequence's KV by now
            if h not in index and i >= seq.num_released_blocks:
                self._register(table[i], h, parent, block)
            parent = h

    def check(self, tables: Iterable[list[int]]) -> None:
        """Assert the invariants, given the block tables of every sequence holding blocks."""
        owners = [0] * self.num_blocks
        for table in tables:
            for b in table:
                owners[b] += 1
        for b in range(self.num_blocks):
            assert self._ref[b] == owners[b], f"block {b}: ref {self._ref[b]} but {owners[b]} owners"
            assert (b in self._free) == (owners[b] == 0), f"block {b}: free list disagrees with ref count"
            h = self._hash[b]
            if h is None:
                assert self._data[b] is None, f"block {b}: token ids kept without a hash"
            else:
                assert self._index.get(h) == b, f"block {b}: hash {h:#x} not indexed to it"
                assert self._data[b] is not None and len(self._data[b]) == 4 * self.block_size
                assert h == hash_block(self._data[b], self._parent[b]), f"block {b}: hash does not match its tokens"
        for h, b in self._index.items():
            assert self._hash[b] == h, f"index entry {h:#x} -> {b} is stale"
        if self.host is not None:
            self.host.check()
        assert not self.has_copies, "copies left out of the plans"


class HostTier:
    """The host pool's cached blocks: hash index, token ids and parent hash (as the GPU tier's, to verify a
    hit), and the order they are reused in: blocks without a hash first, then the least recently used. A
    block that the plan being built reads (a swap-in) or fills (a swap-out) is out of that order until the
    plan is done, so one plan never copies into a block twice or into one it reads."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.hash: list[int | None] = [None] * num_blocks
        self.parent = [ROOT_HASH] * num_blocks
        self.data: list[bytes | None] = [None] * num_blocks
        self.index: dict[int, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._held: list[int] = []  # blocks the plan being built reads or fills

    @property
    def num_cached_blocks(self) -> int:
        return len(self.index)

    def keep(self, h: int, parent: int, data: bytes) -> tuple[int | None, int | None]:
        """(the host block that is to receive a GPU block's copy, the hash that block held and loses). No block
        when the host holds that hash already or every block is held by the plan being built."""
        held = self.index.get(h)
        if held is not None:
            if held in self._lru:
                self._lru.move_to_end(held)
            return None, None
        if not self._lru:
            return None, None
        hb, _ = self._lru.popitem(last=False)
        old = self.hash[hb]
        if old is not None:
            del self.index[old]
        self.index[h] = hb
        self.hash[hb], self.parent[hb], self.data[hb] = h, parent, data
        self._held.append(hb)
        return hb, old

    def forget(self) -> list[int]:
        """Unregisters every block (those a plan being built fills too: their copies land unfindable); returns
        the hashes they held."""
        gone = list(self.index)
        for hb in self.index.values():
            self.hash[hb] = self.data[hb] = None
            if hb in self._lru:
                self._lru.move_to_end(hb, last=False)
        self.index = {}
        return gone

    def hold(self, blocks: list[int]) -> None:
        """Swap-in sources: out of the reuse order until plan_done() (one this plan fills is held already: its
        swap-out runs first)."""
        for hb in blocks:
            if hb in self._lru:
                del self._lru[hb]
                self._held.append(hb)

    def plan_done(self) -> None:
        """The plan carrying the copies is built: their host blocks become the most recently used."""
        for hb in self._held:
            self._lru[hb] = None
        self._held = []

    def check(self) -> None:
        assert len(self._lru) == self.num_blocks and not self._held, "host blocks held past their plan"
        for hb in range(self.num_blocks):
            h = self.hash[hb]
            if h is None:
                assert self.data[hb] is None
            else:
                assert self.index.get(h) == hb, f"host block {hb}: hash not indexed to it"
                assert h == hash_block(self.data[hb], self.parent[hb]), f"host block {hb}: hash does not match"
        for h, hb in self.index.items():
            assert self.hash[hb] == h
