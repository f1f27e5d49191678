"""Chained block hashes of token ids, the prefix cache's keys: xxhash64 of a full block's token ids, seeded with
the hash of the block before it, so equal hashes mean equal prefixes (the BlockManager still compares the
tokens, so a collision can never hand out the wrong KV)."""
from __future__ import annotations

from array import array

import xxhash

ROOT_HASH = 0  # the "previous hash" of a sequence's first block
_xxh64 = xxhash.xxh64_intdigest


def block_bytes(token_ids: list[int]) -> bytes:
    return array("i", token_ids).tobytes()


def hash_block(data: bytes, parent: int) -> int:
    """The hash of one full block (its token ids as block_bytes), chained to its parent's."""
    return _xxh64(data, parent)


def root_hash(lora: str = "", cache_salt: str = "") -> int:
    """The "previous hash" of a sequence's first block: ROOT_HASH for the base model's KV without a salt, else a hash
    of the LoRA adapter's name (KV its projections computed) and the request's cache salt, so that no cached block is
    shared between adapters, or with requests of another salt (tenants who must not learn each other's prompts from
    the cache's timing)."""
    return _xxh64(f"{lora}\0{cache_salt}".encode()) if lora or cache_salt else ROOT_HASH


def extend_hashes(token_ids: list[int], block_size: int, hashes: list[int], num_blocks: int,
                  root: int = ROOT_HASH) -> list[int]:
    """Extends `hashes` (those of token_ids' first blocks, chained from `root`) to cover its first num_blocks
    blocks (all full)."""
    start = len(hashes)
    if start < num_blocks:
        width = 4 * block_size
        data = block_bytes(token_ids[start * block_size : num_blocks * block_size])
        h = hashes[-1] if start else root
        for off in range(0, len(data), width):
            h = hash_block(data[off : off + width], h)
            hashes.append(h)
    return hashes


class PromptHashes:
    """The hashes of one prompt's full blocks, computed once per block size: routing reads them for every
    worker group, and the group that takes the request starts its sequence with them."""
    __slots__ = ("token_ids", "root", "_by_size")

    def __init__(self, token_ids: list[int], root: int = ROOT_HASH):
        self.token_ids, self.root = token_ids, root
        self._by_size: dict[int, list[int]] = {}

    def of(self, block_size: int) -> list[int]:
        hashes = self._by_size.get(block_size)
        if hashes is None:
            hashes = self._by_size[block_size] = extend_hashes(self.token_ids, block_size, [],
                                                               len(self.token_ids) // block_size, self.root)
        return hashes
