"""A ``KVCacheManager`` driven like the scheduler drives it, over a simulated KV cache.

``Harness(num_blocks).op(kind, a, b)`` applies one of the random operations ``OPS`` draws (new
request, compute a chunk, decode, fork, free) and writes the simulated cache (one token id per
slot) exactly as the worker would (block copies first, then each computed token at its slot),
asserting that every sequence reads back its own tokens through its block table; ``check()``
asserts the pool's invariants. ``chain_hashes`` re-derives block hashes from their documented
encoding. Blocks hold ``BS`` tokens.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from folio.runtime.common.sampling_params import SamplingParams
from folio.runtime.scheduler.kv_cache_manager import KVCacheManager
from folio.runtime.scheduler.kv_cache_utils import NONE_HASH
from folio.runtime.scheduler.sequence import Request, Sequence

BS = 4

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

