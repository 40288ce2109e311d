"""KV cache building blocks: the block record, the free-block queue and prefix-cache hashing.

The split follows vLLM V1's ``v1/core/kv_cache_utils.py``: this file holds plain data structures
with no policy; ``block_pool.py`` decides allocation and eviction, ``kv_cache_manager.py`` decides
what a sequence needs. Ideas: PagedAttention (Kwon et al., SOSP 2023) for blocks; vLLM's automatic
prefix caching design doc for the hash chain.
"""

from __future__ import annotations

import hashlib
import os
import struct
from typing import Iterable, Sequence

import numpy as np

# The root of every hash chain. Random per process, so block hashes cannot be predicted (or
# probed) from outside and never collide across processes that share nothing.
NONE_HASH: bytes = os.urandom(32)

BlockHash = bytes


class KVCacheBlock:
    """One physical KV block (``block_size`` token slots in every layer's key and value cache).

    Attributes:
        block_id: index into the KV cache's first dimension, ``0 <= block_id < num_blocks``.
        ref_cnt: number of sequences whose block table holds this block (0 = free).
        block_hash: the prefix-cache hash of the block's content when it is a full, registered
            block; ``None`` otherwise. A freed block keeps its hash until it is reallocated.
        prev_free / next_free: links of the free queue (``None`` when not in the queue).
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks in eviction order (front = evicted first).

    A block that is freed goes to the back; a block taken by a prefix-cache hit is removed from
    the middle in O(1) through its own links. Sentinel head and tail nodes (block_id -1) remove
    every end-of-list special case. The links live on the blocks, so no Python object is created
    per operation.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]):
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        """Remove and return the front block. Raises ``ValueError`` when empty."""
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from anywhere in the queue in O(1). Raises ``ValueError`` if absent."""
        if block.prev_free is None or block.next_free is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the back (evicted last)."""
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def __len__(self) -> int:
        return self.num_free_blocks

    def __iter__(self):
        node = self._head.next_free
        while node is not self._tail:
            yield node
            node = node.next_free


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int],
                      extra_keys: tuple = ()) -> BlockHash:
    """sha256 over a canonical byte encoding of (parent hash, token ids, extra keys).

    Args:
        parent_hash: hash of the previous block of the sequence, or ``None`` for the first block
            (then the process's random ``NONE_HASH`` root is used).
        token_ids: the block's ``block_size`` token ids.
        extra_keys: values that change the meaning of the block beyond its tokens (the request's
            ``cache_salt`` for the first block); strings and ints only.
    Returns:
        32 bytes.
    """
    h = hashlib.sha256()
    h.update(NONE_HASH if parent_hash is None else parent_hash)
    h.update(struct.pack("<I", len(token_ids)))
    h.update(np.asarray(token_ids, dtype="<i8").tobytes())
    for key in extra_keys:
        if isinstance(key, str):
            b = key.encode("utf-8")
            h.update(b"s" + struct.pack("<I", len(b)) + b)
        elif isinstance(key, (int, np.integer)):
            h.update(b"i" + struct.pack("<q", int(key)))
        else:
            raise TypeError(f"unsupported extra key type {type(key).__name__}")
    return h.digest()


def block_extra_keys(block_index: int, cache_salt: str | None) -> tuple:
    """Extra keys of block ``block_index``: the cache salt goes into the first block only (its
    hash feeds every later one through the chain, so a salt separates whole sequences)."""
    if block_index == 0 and cache_salt is not None:
        return ("salt", cache_salt)
    return ()


def extend_block_hashes(block_hashes: list[BlockHash], token_ids: Sequence[int], block_size: int,
                        cache_salt: str | None = None) -> list[BlockHash]:
    """Append to ``block_hashes`` (in place) the hashes of every full block of ``token_ids`` not
    yet hashed; returns the list. Cost is O(new tokens)."""
    num_full = len(token_ids) // block_size
    for i in range(len(block_hashes), num_full):
        parent = block_hashes[i - 1] if i > 0 else None
        block_hashes.append(hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size],
                                              block_extra_keys(i, cache_salt)))
    return block_hashes
