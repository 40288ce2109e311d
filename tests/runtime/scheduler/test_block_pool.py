"""Block pool, free queue, hashing and KV cache manager: unit tests and hypothesis property tests.

The property test drives ``KVCacheManager`` with random allocate / compute / decode / fork / free
sequences while a simulated KV cache (one token id per slot) is written exactly as the worker
would write it (block copies first, then each computed token at its slot). It checks that every
sequence reads back its own tokens through its block table, and the pool's invariants.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from folio.runtime.scheduler.block_pool import BlockPool
from folio.runtime.scheduler.kv_cache_manager import KVCacheManager
from folio.runtime.scheduler.kv_cache_utils import (NONE_HASH, FreeKVCacheBlockQueue, KVCacheBlock,
                                          extend_block_hashes, hash_block_tokens)
from folio.runtime.common.sampling_params import SamplingParams
from folio.runtime.scheduler.sequence import Request, Sequence

BS = 4


# free queue
def test_free_queue_order_and_middle_removal():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    assert [b.block_id for b in q] == [0, 1, 2, 3, 4]
    q.remove(blocks[2])
    q.remove(blocks[0])
    q.remove(blocks[4])
    assert [b.block_id for b in q] == [1, 3] and len(q) == 2
    q.append(blocks[0])
    assert q.popleft() is blocks[1]
    assert [b.block_id for b in q] == [3, 0]
    with pytest.raises(ValueError):
        q.remove(blocks[2])
    with pytest.raises(ValueError):
        q.append(blocks[3])
    q.popleft(), q.popleft()
    with pytest.raises(ValueError):
        q.popleft()


# hashing
def test_hash_chain_depends_on_parent_tokens_and_salt():
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    assert len(h0) == 32 and h0 == hash_block_tokens(None, [1, 2, 3, 4])
    assert h0 != hash_block_tokens(None, [1, 2, 3, 5])
    assert h0 != hash_block_tokens(None, [1, 2, 3, 4], ("salt", "a"))
    assert hash_block_tokens(None, [1, 2, 3, 4], ("salt", "a")) != hash_block_tokens(None, [1, 2, 3, 4], ("salt", "b"))
    assert hash_block_tokens(h0, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])
    # the root is random per process, not a fixed constant
    assert NONE_HASH != bytes(32)
    hashes = extend_block_hashes([], list(range(10)), 4, cache_salt="s")
    assert len(hashes) == 2
    assert hashes[1] == hash_block_tokens(hashes[0], [4, 5, 6, 7])
    assert hashes[0] == hash_block_tokens(None, [0, 1, 2, 3], ("salt", "s"))


# block pool
def test_pool_lru_eviction_drops_stale_hash():
    pool = BlockPool(3)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_full_block(a, b"A" * 32)
    pool.cache_full_block(b, b"B" * 32)
    pool.free_blocks([b, a])  # b freed first -> evicted first
    assert pool.get_num_free_blocks() == 2 and pool.get_num_registered_blocks() == 2
    assert pool.get_cached_block(b"A" * 32) is a
    (x,) = pool.get_new_blocks(1)
    assert x is b and b.block_hash is None and pool.get_cached_block(b"B" * 32) is None
    assert pool.get_cached_block(b"A" * 32) is a  # still cached-free
    pool.touch([a])  # a prefix hit takes it out of the middle of the queue
    assert a.ref_cnt == 1 and pool.get_num_free_blocks() == 0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.free_blocks([a, x, c])
    assert pool.get_num_free_blocks() == 3
    with pytest.raises(ValueError):
        pool.free_blocks([a])


def _request(tokens, n=1, salt=None, rid="r"):
    return Request(rid, None, tokens, SamplingParams(n=n, max_tokens=8), 8, cache_salt=salt)


def test_manager_prefix_hit_always_computes_last_token():
    kv = KVCacheManager(16, BS)
    req = _request(list(range(8)))  # exactly two blocks
    s1 = Sequence(0, req, 0, req.prompt_token_ids, None)
    hit, n = kv.get_computed_blocks(s1)
    assert (hit, n) == ([], 0)
    assert kv.allocate_slots(s1, 8) == []
    s1.num_computed_tokens = 8
    s2 = Sequence(1, req, 0, req.prompt_token_ids, None)
    hit, n = kv.get_computed_blocks(s2)
    assert n == 4  # the second block holds the last prompt token: recomputed
    assert kv.prefix_cache_hits == 4 and kv.prefix_cache_queries == 16
    assert kv.allocate_slots(s2, 4, hit) == []
    assert kv.seq_blocks[1][0] is kv.seq_blocks[0][0] and kv.seq_blocks[1][0].ref_cnt == 2
    assert kv.seq_blocks[1][1] is not kv.seq_blocks[0][1]


def test_manager_allocates_only_when_last_block_full_and_cow():
    kv = KVCacheManager(8, BS)
    req = _request([1, 2, 3, 4, 5, 6], n=2)
    parent = Sequence(0, req, 0, req.prompt_token_ids, None)
    kv.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    assert len(kv.seq_blocks[0]) == 2
    assert kv.allocate_slots(parent, 1) == [] and len(kv.seq_blocks[0]) == 2  # room in block 1
    child = Sequence(1, req, 1, req.prompt_token_ids, None)
    child.num_computed_tokens = 6
    kv.fork(parent, child)
    shared = kv.seq_blocks[0][1]
    assert shared.ref_cnt == 2
    copies = kv.allocate_slots(child, 1)
    assert copies == [(shared.block_id, kv.seq_blocks[1][1].block_id)]
    assert kv.seq_blocks[1][1] is not shared and shared.ref_cnt == 1
    assert kv.seq_blocks[1][0] is kv.seq_blocks[0][0]  # full blocks stay shared
    kv.free(parent), kv.free(child)
    assert kv.pool.get_num_free_blocks() == 8


def test_manager_refuses_without_side_effects():
    kv = KVCacheManager(2, BS)
    req = _request(list(range(12)))
    s = Sequence(0, req, 0, req.prompt_token_ids, None)
    assert kv.allocate_slots(s, 12) is None
    assert kv.pool.get_num_free_blocks() == 2 and 0 not in kv.seq_blocks


# property test
OPS = st.lists(
    st.tuples(st.sampled_from(["new", "new", "compute", "compute", "decode", "fork", "free"]),
              st.integers(0, 1000), st.integers(1, 12)),
    min_size=1, max_size=60)

PREFIXES = [[7, 7, 7, 7, 1, 2, 3, 4], [7, 7, 7, 7, 1, 2, 9, 9], [5, 5, 5, 5, 5, 5, 5, 5, 5]]


def chain_hashes(token_ids, salt=None):
    """The block hashes of every full block of ``token_ids``, re-derived with hashlib from the
    encoding ``hash_block_tokens`` documents (not by calling it): sha256 of the parent hash
    (``NONE_HASH`` for block 0), the token count as little-endian uint32, the ids as little-endian
    int64, then each extra key (block 0 of a salted request: ``"salt"`` and the salt, each a
    string: b"s", its UTF-8 length as uint32, its bytes)."""
    import hashlib
    import struct
    out, parent = [], NONE_HASH
    for i in range(len(token_ids) // BS):
        block = token_ids[i * BS:(i + 1) * BS]
        h = hashlib.sha256(parent + struct.pack("<I", len(block)) + struct.pack(f"<{len(block)}q", *block))
        if i == 0 and salt is not None:
            for key in ("salt", salt):
                b = key.encode()
                h.update(b"s" + struct.pack("<I", len(b)) + b)
        parent = h.digest()
        out.append(parent)
    return out


def test_block_hashes_follow_the_documented_encoding():
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    for salt in (None, "tenant-a"):
        assert extend_block_hashes([], tokens, BS, cache_salt=salt) == chain_hashes(tokens, salt)
    # extending a list hashes only the blocks not hashed yet
    first = extend_block_hashes([], tokens[:5], BS)
    assert extend_block_hashes(first, tokens, BS) == chain_hashes(tokens)


class Harness:
    def __init__(self, num_blocks):
        self.kv = KVCacheManager(num_blocks, BS)
        self.sim = np.full((num_blocks, BS), -1, dtype=np.int64)
        self.live: list[Sequence] = []
        self.known: dict[bytes, tuple] = {}  # every hash ever seen -> the tokens of its block
        self.next_id = 0

    def _remember(self, seq):
        hashes = chain_hashes(seq.all_token_ids, seq.request.cache_salt)
        for i, h in enumerate(hashes):
            self.known[h] = tuple(seq.all_token_ids[i * BS:(i + 1) * BS])

    def compute(self, seq, n, hit=None):
        """allocate + write like the worker; False when the pool refused."""
        copies = self.kv.allocate_slots(seq, n, hit)
        if copies is None:
            return False
        if hit:
            seq.num_computed_tokens += len(hit) * BS
        for src, dst in copies:
            self.sim[dst] = self.sim[src]
        table = self.kv.get_block_ids(seq)
        for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            self.sim[table[p // BS], p % BS] = seq.all_token_ids[p]
        seq.num_computed_tokens += n
        self._remember(seq)
        # what attention would read back is the sequence's own context
        ctx = [self.sim[table[p // BS], p % BS] for p in range(seq.num_computed_tokens)]
        assert ctx == seq.all_token_ids[:seq.num_computed_tokens]
        return True

    def op(self, kind, a, b):
        if kind == "new" or not self.live:
            base = PREFIXES[a % len(PREFIXES)]
            tokens = (base + [a % 5] * b)[:max(1, (a % 7) + b)]
            salt = "x" if a % 4 == 0 else None
            req = Request(f"r{self.next_id}", None, tokens, SamplingParams(), 16, cache_salt=salt)
            seq = Sequence(self.next_id, req, 0, tokens, None)
            self.next_id += 1
            hit, _ = self.kv.get_computed_blocks(seq)
            n = len(tokens) - len(hit) * BS
            if self.compute(seq, n, hit):
                self.live.append(seq)
            return
        seq = self.live[a % len(self.live)]
        if kind == "compute":  # chunk of extra known tokens (e.g. a resumed prompt)
            seq.all_token_ids.extend([(a + i) % 3 for i in range(b)])
            if not self.compute(seq, b):
                del seq.all_token_ids[-b:]
        elif kind == "decode":
            seq.all_token_ids.append(a % 3)
            if not self.compute(seq, 1):
                seq.all_token_ids.pop()
        elif kind == "fork":
            child = Sequence(self.next_id, seq.request, 1, seq.all_token_ids, None)
            self.next_id += 1
            child.num_computed_tokens = seq.num_computed_tokens
            self.kv.fork(seq, child)
            self.live.append(child)
        elif kind == "free":
            self.kv.free(seq)
            self.live.remove(seq)

    def check(self):
        pool = self.kv.pool
        holders: dict[int, int] = {}
        for seq in self.live:
            for bid in self.kv.get_block_ids(seq):
                holders[bid] = holders.get(bid, 0) + 1
        in_queue = {b.block_id for b in pool.free_block_queue}
        for block in pool.blocks:
            assert block.ref_cnt >= 0
            assert block.ref_cnt == holders.get(block.block_id, 0)
            assert (block.block_id in in_queue) == (block.ref_cnt == 0)
        used = sum(1 for b in pool.blocks if b.ref_cnt > 0)
        assert pool.get_num_free_blocks() + used == pool.num_blocks
        for h, block in pool.cached_block_hash_to_block.items():
            assert block.block_hash == h
            assert h in self.known
            assert tuple(self.sim[block.block_id]) == self.known[h]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, num_blocks=st.integers(6, 24))
def test_property_random_operations_keep_invariants(ops, num_blocks):
    h = Harness(num_blocks)
    for kind, a, b in ops:
        h.op(kind, a, b)
        h.check()
    for seq in list(h.live):
        h.kv.free(seq)
        h.live.remove(seq)
    h.check()
    pool = h.kv.pool
    assert pool.get_num_free_blocks() == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    # every block is free or cached-free: a cached one is reachable through its hash
    for b in pool.blocks:
        assert b.block_hash is None or pool.get_cached_block(b.block_hash) is b
