"""The pool of physical KV blocks: allocation, the prefix-cache hash map, LRU eviction.

Shape after vLLM V1's ``v1/core/block_pool.py``: every block is either in use (``ref_cnt > 0``) or
in the free queue. A free block may still carry a hash ("cached-free"): a later request with the
same prefix takes it back out of the middle of the queue. Allocation pops from the front, so the
least recently freed block is evicted first; its stale hash is dropped at that moment.
"""

from __future__ import annotations

from typing import Iterable

from .kv_cache_utils import BlockHash, FreeKVCacheBlockQueue, KVCacheBlock


class BlockPool:
    """All ``num_blocks`` KV blocks of one engine.

    Args:
        num_blocks: number of physical blocks (the KV cache's first dimension).
        enable_caching: keep full blocks' hashes for prefix caching.
    Raises:
        ValueError: ``num_blocks < 1``.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        self.num_evictions = 0

    # prefix cache
    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block registered under ``block_hash``, in use or cached-free, or ``None``."""
        if not self.enable_caching:
            return None
        return self.cached_block_hash_to_block.get(block_hash)

    def cache_full_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Register a block whose ``block_size`` slots are (or are being, this step) written.

        A block that already has a hash keeps it. When another block already holds this hash
        (two sequences computed the same content), the first one stays the cache entry.
        """
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached_block_hash_to_block:
            return
        block.block_hash = block_hash
        self.cached_block_hash_to_block[block_hash] = block

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on each block (prefix hit or fork); a free one leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    # allocation
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` blocks from the front of the free queue (LRU), drop their stale
        hashes, and hand them out with ``ref_cnt = 1``.

        Raises:
            ValueError: fewer than ``num_blocks`` free blocks (nothing is taken then).
        """
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(f"cannot allocate {num_blocks} blocks; "
                             f"{self.free_block_queue.num_free_blocks} free")
        out = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            self._evict_hash(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict_hash(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            self.drop_hash(block)
            self.num_evictions += 1

    def drop_hash(self, block: KVCacheBlock) -> None:
        """Forget ``block``'s prefix-cache entry (its content can no longer be trusted)."""
        if block.block_hash is None:
            return
        if self.cached_block_hash_to_block.get(block.block_hash) is block:
            del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching zero join the back of the free
        queue in the given order (callers pass a sequence's blocks tail first, so the chain's
        tail is evicted before its head, which other prompts are likelier to share)."""
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every hash; only possible when no block is in use. Returns whether it did."""
        if self.get_num_free_blocks() != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True

    # counters
    def get_num_free_blocks(self) -> int:
        """Blocks with ``ref_cnt == 0`` (including cached-free ones, which are reclaimable)."""
        return self.free_block_queue.num_free_blocks

    def get_num_registered_blocks(self) -> int:
        """Full blocks registered in the prefix-cache map (in use or cached-free)."""
        return len(self.cached_block_hash_to_block)
