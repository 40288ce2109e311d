"""Block pool, free queue, hashing and KV cache manager: unit tests and hypothesis property tests.

The property test drives ``KVCacheManager`` with random allocate / compute / decode / fork / free
sequences while a simulated KV cache (one token id per slot) is written exactly as the worker
would write it (block copies first, then each computed token at its slot). It checks that every
sequence reads back its own tokens through its block table, and the pool's invariants.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from folio.runtime.scheduler.block_pool import BlockPool
from folio.runtime.scheduler.kv_cache_manager import KVCacheManager
from folio.runtime.scheduler.kv_cache_utils import (NONE_HASH, FreeKVCacheBlockQueue, KVCacheBlock,
                                          extend_block_hashes, hash_block_tokens)
from folio.runtime.common.sampling_params import SamplingParams
from folio.runtime.scheduler.sequence import Request, Sequence
from support.kv_cache_harness import BS, OPS, Harness, chain_hashes


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


def test_block_hashes_follow_the_documented_encoding():
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    for salt in (None, "tenant-a"):
        assert extend_block_hashes([], tokens, BS, cache_salt=salt) == chain_hashes(tokens, salt)
    # extending a list hashes only the blocks not hashed yet
    first = extend_block_hashes([], tokens[:5], BS)
    assert extend_block_hashes(first, tokens, BS) == chain_hashes(tokens)


# property test (the harness: tests/support/kv_cache_harness.py)
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
