"""What a sequence needs from the KV cache: its cached prefix, new slots, forks, frees, the
block tables of a step, and the rollback of a step that failed.

Shape after vLLM V1's ``v1/core/kv_cache_manager.py`` (policy-free: the scheduler decides who
runs; this file only answers "can this sequence get room for k more tokens" and does the block
bookkeeping). Nothing outside this file reads ``BlockPool`` or the per-sequence block lists: callers
use the methods below. Copy-on-write of a shared, partly filled block follows vLLM V0's block manager
(PagedAttention, Kwon et al. 2023, section 4.4): the writer gets a fresh block and the plan carries
a ``(src, dst)`` block copy that the worker performs before the forward pass.
"""

from __future__ import annotations

from operator import itemgetter

import numpy as np

from ..common.config import cdiv
from .block_pool import BlockPool
from .kv_cache_utils import KVCacheBlock
from .sequence import Sequence


_NO_COPIES: list[tuple[int, int]] = []  # returned, never modified: no block copy needed


class KVCacheManager:
    """Per-sequence block tables over one ``BlockPool``.

    Args:
        num_blocks: physical blocks in the KV cache.
        block_size: tokens per block.
        enable_caching: automatic prefix caching.
        share_forked_blocks: ``fork`` shares the parent's blocks by reference count (the default);
            ``False`` gives the child a private copy of each instead (fresh blocks and the plan's
            block copies: the no-sharing baseline of the beam search benchmark,
            ``perf/bench/separate_beams.py``).
    Attributes:
        prefix_cache_queries: prompt tokens looked up in the prefix cache (counted per lookup).
        prefix_cache_hits: of those, tokens served from cached blocks.
        block_table: ``[rows, cols]`` int32 block ids, one row per sequence holding blocks (see
            ``block_table_rows``); entries past a sequence's blocks are 0. Kept up to date as
            blocks are allocated, copied on write, shared and freed, so a step's block tables are
            one gather, not a rebuild. Grows by doubling.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 share_forked_blocks: bool = True):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.share_forked_blocks = share_forked_blocks
        self.pool = BlockPool(num_blocks, enable_caching)
        self.seq_blocks: dict[int, list[KVCacheBlock]] = {}
        self._num_registered_blocks: dict[int, int] = {}  # per seq: leading blocks in the prefix-cache map
        self.block_table = np.zeros((16, 16), dtype=np.int32)
        self._row: dict[int, int] = {}  # seq_id -> its row of block_table
        self._free_rows: list[int] = list(range(15, -1, -1))
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # prefix cache
    def get_computed_blocks(self, seq: Sequence) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks at the start of ``seq`` (no reference taken yet).

        At least one token of ``seq.prefill_target`` is always left to compute, so the last
        prompt token's logits (or, for a parent, the fork point) are produced by this engine. A
        request whose prompt logprobs are not all computed yet reads nothing from the cache
        (cached positions have no logits; vLLM V1 skips the lookup the same way).
        Returns:
            (blocks, number of tokens they hold).
        """
        if not self.enable_caching or seq.request.prompt_logprobs_next >= 0:
            return [], 0
        target = seq.prefill_target
        hashes = seq.update_block_hashes(self.block_size)
        max_blocks = max(0, (target - 1) // self.block_size)
        hit: list[KVCacheBlock] = []
        for h in hashes[:max_blocks]:
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            hit.append(block)
        self.prefix_cache_queries += target
        self.prefix_cache_hits += len(hit) * self.block_size
        return hit, len(hit) * self.block_size

    # slots
    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None
                       ) -> list[tuple[int, int]] | None:
        """Make room for ``num_new_tokens`` tokens after ``seq.num_computed_tokens`` (+ the cached
        ``new_computed_blocks`` being taken now).

        Blocks are only allocated when the last one is full. When the block the first new token
        goes into is shared (``ref_cnt > 1``), it is replaced by a private copy. Full blocks are
        registered in the prefix cache as soon as their tokens are known (a block whose last token
        is a placeholder of overlap scheduling is registered at a later call).
        Returns:
            the ``(src, dst)`` block copies to do before the forward pass (possibly empty), or
            ``None`` when the pool cannot supply the blocks (then nothing changed).
        """
        bs = self.block_size
        blocks = self.seq_blocks.setdefault(seq.seq_id, [])
        num_computed = seq.num_computed_tokens
        total = num_computed + num_new_tokens
        # decode fast path: the new tokens fit the blocks held, the first one's block is private
        if not new_computed_blocks and total <= len(blocks) * bs and (
                num_new_tokens == 0 or blocks[num_computed // bs].ref_cnt == 1):
            if self.enable_caching and total >= (self._num_registered_blocks.get(seq.seq_id, 0) + 1) * bs:
                self._cache_full_blocks(seq, blocks, min(total, len(seq.all_token_ids)))
            return []
        new_computed_blocks = new_computed_blocks or []
        num_computed += len(new_computed_blocks) * bs
        total = num_computed + num_new_tokens
        num_new_blocks = max(0, cdiv(total, bs) - len(blocks) - len(new_computed_blocks))
        # copy-on-write: the block receiving the first new token is shared by another sequence
        cow_index = num_computed // bs
        needs_cow = (num_new_tokens > 0 and not new_computed_blocks
                     and cow_index < len(blocks) and blocks[cow_index].ref_cnt > 1)
        # cached-free blocks taken by a hit leave the free queue too
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks + int(needs_cow) + num_evictable_hits > self.pool.get_num_free_blocks():
            if not blocks:
                del self.seq_blocks[seq.seq_id]
            return None

        copies: list[tuple[int, int]] = []
        if new_computed_blocks or needs_cow or num_new_blocks:
            first_changed = len(blocks)
            if new_computed_blocks:
                self.pool.touch(new_computed_blocks)
                blocks.extend(new_computed_blocks)
            if needs_cow:
                src = blocks[cow_index]
                (dst,) = self.pool.get_new_blocks(1)
                self.pool.free_blocks([src])
                blocks[cow_index] = dst
                copies.append((src.block_id, dst.block_id))
                first_changed = cow_index
            if num_new_blocks:
                blocks.extend(self.pool.get_new_blocks(num_new_blocks))
            self._write_row(seq.seq_id, blocks, first_changed)
        if self.enable_caching and total >= (self._num_registered_blocks.get(seq.seq_id, 0) + 1) * bs:
            self._cache_full_blocks(seq, blocks, min(total, len(seq.all_token_ids)))
        return copies

    def append_slot(self, seq: Sequence) -> list[tuple[int, int]] | None:
        """``allocate_slots(seq, 1)`` (a decode step), with the common case first: the token fits
        the last block held and that block is not shared, so nothing is allocated."""
        blocks = self.seq_blocks.get(seq.seq_id)
        bs = self.block_size
        c = seq.num_computed_tokens
        if blocks is None or c >= len(blocks) * bs or blocks[c // bs].ref_cnt != 1:
            return self.allocate_slots(seq, 1)
        # a block that becomes full is registered once its tokens are known, which with overlap
        # scheduling is up to two steps after its last slot was allocated
        if self.enable_caching and (c + 1) % bs <= 2:
            n = min(c + 1, len(seq.all_token_ids))
            if n >= (self._num_registered_blocks.get(seq.seq_id, 0) + 1) * bs:
                self._cache_full_blocks(seq, blocks, n)
        return _NO_COPIES

    def _cache_full_blocks(self, seq: Sequence, blocks: list[KVCacheBlock], num_tokens: int) -> None:
        """Register every block that is full once ``num_tokens`` tokens are computed."""
        if not self.enable_caching:
            return
        start = self._num_registered_blocks.get(seq.seq_id, 0)
        end = num_tokens // self.block_size
        if end <= start:
            return
        hashes = seq.update_block_hashes(self.block_size)
        for i in range(start, end):
            self.pool.cache_full_block(blocks[i], hashes[i])
        self._num_registered_blocks[seq.seq_id] = end

    # sharing and freeing
    def fork(self, parent: Sequence, child: Sequence) -> list[tuple[int, int]]:
        """``child`` shares every block of ``parent`` (one more reference each; a block either
        then writes is copied on write by ``allocate_slots``), or with ``share_forked_blocks``
        off gets fresh blocks holding copies of them.

        Returns:
            block copies the worker must do before ``child`` runs (none when sharing).
        Raises:
            ValueError: not sharing, and too few free blocks for the copies.
        """
        if not self.share_forked_blocks:
            src = self.seq_blocks.get(parent.seq_id, [])
            dst = self.pool.get_new_blocks(len(src))
            self.seq_blocks[child.seq_id] = dst
            self._num_registered_blocks[child.seq_id] = 0
            self._write_row(child.seq_id, dst, 0)
            return [(a.block_id, b.block_id) for a, b in zip(src, dst)]
        blocks = list(self.seq_blocks.get(parent.seq_id, []))
        self.pool.touch(blocks)
        self.seq_blocks[child.seq_id] = blocks
        self._num_registered_blocks[child.seq_id] = self._num_registered_blocks.get(parent.seq_id, 0)
        self._write_row(child.seq_id, blocks, 0)
        return []

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks, tail first, so the chain's tail is evicted first."""
        blocks = self.seq_blocks.pop(seq.seq_id, [])
        self._num_registered_blocks.pop(seq.seq_id, None)
        self.pool.free_blocks(reversed(blocks))
        row = self._row.pop(seq.seq_id, None)
        if row is not None:
            self.block_table[row] = 0
            self._free_rows.append(row)

    def truncate(self, seq: Sequence) -> None:
        """After a speculative step gave back its rejected positions (``seq.num_computed_tokens``
        lowered): free the blocks past the ones holding the computed tokens, tail first (they
        were allocated for rejected drafts and hold no accepted token), and register the full
        blocks of accepted tokens. A block is registered only when every token in it is computed
        and known, so no rejected token is ever a prefix-cache hit."""
        blocks = self.seq_blocks.get(seq.seq_id)
        if not blocks:
            return
        keep = cdiv(seq.num_computed_tokens, self.block_size)
        if len(blocks) > keep:
            extra = blocks[keep:]
            del blocks[keep:]
            self.pool.free_blocks(reversed(extra))
            row = self._row.get(seq.seq_id)
            if row is not None:
                self.block_table[row, keep:keep + len(extra)] = 0
            if self._num_registered_blocks.get(seq.seq_id, 0) > keep:  # never: drafts are not hashed
                self._num_registered_blocks[seq.seq_id] = keep
        if self.enable_caching:
            self._cache_full_blocks(seq, blocks, min(seq.num_computed_tokens, len(seq.all_token_ids)))

    def get_block_ids(self, seq: Sequence) -> list[int]:
        return [b.block_id for b in self.seq_blocks.get(seq.seq_id, [])]

    def drop_unwritten_hashes(self, seq: Sequence, num_written_tokens: int) -> None:
        """Rollback of a failed step: forget the prefix-cache hashes of ``seq``'s blocks from the
        one holding token ``num_written_tokens`` on (their K/V may never have been written, so
        they must not serve a prefix hit). The blocks stay with ``seq`` until it is freed."""
        blocks = self.seq_blocks.get(seq.seq_id)
        if not blocks:
            return
        first = num_written_tokens // self.block_size
        for block in blocks[first:]:
            self.pool.drop_hash(block)
        if self._num_registered_blocks.get(seq.seq_id, 0) > first:
            self._num_registered_blocks[seq.seq_id] = first

    def reset_prefix_cache(self) -> bool:
        """Forget every prefix-cache entry (``BlockPool.reset_prefix_cache``); only possible when
        no sequence holds a block. Returns whether it did."""
        return self.pool.reset_prefix_cache()

    # block tables
    def get_block_tables(self, seq_ids: list[int]) -> np.ndarray:
        """A step's block tables: ``[S, W]`` int32, row ``i`` the block ids of ``seq_ids[i]``
        padded with 0, ``W`` the most blocks any of them holds. Each sequence must hold blocks.

        The rows are kept up to date as blocks are allocated, copied on write, shared and freed,
        so this is one gather, not a rebuild."""
        if not seq_ids:
            return self.block_table[:0, :0]
        rows = itemgetter(*seq_ids)(self._row) if len(seq_ids) > 1 else (self._row[seq_ids[0]],)
        seq_blocks = self.seq_blocks
        width = max(map(len, itemgetter(*seq_ids)(seq_blocks))) if len(seq_ids) > 1 \
            else len(seq_blocks[seq_ids[0]])
        return self.block_table[np.array(rows, dtype=np.int64), :width]

    def block_table_rows(self, seq_ids: list[int]) -> np.ndarray:
        """``[S]`` int64 rows of ``block_table`` holding these sequences' block ids (each must
        hold blocks). ``block_table[rows, :w]`` is their block table (padding 0)."""
        row = self._row
        return np.fromiter((row[i] for i in seq_ids), dtype=np.int64, count=len(seq_ids))

    def _write_row(self, seq_id: int, blocks: list[KVCacheBlock], first: int) -> None:
        """Copy ``blocks[first:]`` into the sequence's row (taking a row, and growing the table,
        as needed)."""
        row = self._row.get(seq_id)
        if row is None:
            if not self._free_rows:
                old = self.block_table.shape[0]
                self.block_table = np.concatenate([self.block_table, np.zeros_like(self.block_table)])
                self._free_rows = list(range(2 * old - 1, old - 1, -1))
            row = self._row[seq_id] = self._free_rows.pop()
            first = 0
        cols = self.block_table.shape[1]
        if len(blocks) > cols:
            while cols < len(blocks):
                cols *= 2
            grown = np.zeros((self.block_table.shape[0], cols), dtype=np.int32)
            grown[:, :self.block_table.shape[1]] = self.block_table
            self.block_table = grown
        self.block_table[row, first:len(blocks)] = [b.block_id for b in blocks[first:]]

    # counters
    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    def get_num_free_blocks(self) -> int:
        """Blocks with no reference (plain free or cached-free)."""
        return self.pool.get_num_free_blocks()

    def reset_counters(self) -> None:
        """Zero prefix_cache_queries, prefix_cache_hits and the pool's num_evictions."""
        self.prefix_cache_queries = self.prefix_cache_hits = 0
        self.pool.num_evictions = 0

    def get_metrics(self) -> dict:
        """num_total_blocks, num_free_blocks, num_cached_blocks (full blocks registered in the
        prefix cache, in use or free), num_evictions, prefix_cache_queries, prefix_cache_hits."""
        pool = self.pool
        return {"num_total_blocks": pool.num_blocks, "num_free_blocks": pool.get_num_free_blocks(),
                "num_cached_blocks": pool.get_num_registered_blocks(), "num_evictions": pool.num_evictions,
                "prefix_cache_queries": self.prefix_cache_queries, "prefix_cache_hits": self.prefix_cache_hits}

    def kv_token_usage(self, seqs) -> tuple[int, int]:
        """(token slots holding K/V, token slots in blocks in use), each shared block once."""
        filled: dict[int, int] = {}
        bs = self.block_size
        for seq in seqs:
            for i, block in enumerate(self.seq_blocks.get(seq.seq_id, [])):
                n = min(bs, max(0, seq.num_computed_tokens - i * bs))
                filled[block.block_id] = max(filled.get(block.block_id, 0), n)
        used = self.pool.num_blocks - self.pool.get_num_free_blocks()
        return sum(filled.values()), used * bs
