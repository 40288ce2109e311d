"""Data-parallel routing policy: prefix affinity first, then the least-loaded replica.

Pure Python (no ZeroMQ, no Ray): ``ipc/data_parallel.py``'s router calls it once per request, and
tests/ipc/test_routing.py checks it alone.

The policy (after SGLang's cache-aware router and Ray Serve LLM's ``PrefixCacheAffinityRouter``):

1. **Prefix affinity.** The prompt's full blocks are keyed with folio's own prefix-cache chain
   (``runtime.scheduler.kv_cache_utils.extend_block_hashes``: chained sha256 over each block's token
   ids, the ``cache_salt`` in the first block's extra keys, the same ``block_size`` as the
   replicas). Block ``i``'s key is a function of the salt and every token of blocks ``0..i``, so
   two prompts share key ``i`` exactly when a replica's prefix cache would let them share block
   ``i``. The keys are the *router's own*: the chain's root is this process's random root, not
   a replica's, and nothing is exchanged with the replicas; the map records which replica the
   router sent each prefix block to, which is where that block was (last) computed and cached.
   The longest matched prefix wins while its replica is alive and *not too far ahead in load*:
   its outstanding tokens may exceed the least-loaded replica's by at most the tokens it already
   holds of this prompt (``matched_blocks * block_size``, the prefill its cache saves), and never
   by more than ``balance_abs_tokens``. Sent elsewhere, the request costs its whole prompt again
   but waits behind less work; the prefix holder is chosen only where the prefill it saves pays
   for the extra work queued before it (the load-aware affinity of consistent hashing with
   bounded loads, Mirrokni et al. 2018, and of SGLang's router, whose balance threshold sends a
   request to the least loaded worker once the loads diverge). So requests that share only a
   chat template's first blocks spread over the replicas as they arrive together, while a
   follow-up turn that shares its whole conversation goes back to the replica that holds it.
2. **Least loaded.** Otherwise the replica with the fewest outstanding tokens (prompt tokens plus
   ``max_tokens`` of its requests in flight, released when each finishes); ties go to the fewest
   requests in flight, then round-robin after the replica chosen last (so an idle cluster spreads
   single requests instead of sending all to replica 0).

After each decision every block key of the prompt maps to the chosen replica (the newest copy of
a block is the one least likely evicted). The map is an LRU bounded by ``max_blocks`` keys (the
replicas' KV blocks together: a replica cannot hold more). A replica that dies has its keys
dropped (its cache died with it) and takes no requests until ``set_alive(i, True)``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

from ..runtime.scheduler.kv_cache_utils import BlockHash, extend_block_hashes


class NoReplicaError(RuntimeError):
    """No replica is alive to take a request."""


@dataclass
class ReplicaLoad:
    """The router's view of one replica."""

    alive: bool = True
    outstanding_tokens: int = 0          # prompt + max_tokens of its requests in flight
    num_requests: int = 0
    num_routed: int = 0                  # requests routed to it, ever
    num_prefix_routed: int = 0           # of those, routed by prefix affinity


@dataclass
class Decision:
    """Where a request goes. ``matched_blocks``: prompt blocks the chosen replica was sent before
    (0 for a least-loaded choice); ``cost``: the tokens its load carries until ``release``."""

    replica: int
    matched_blocks: int
    cost: int
    by_prefix: bool
    keys: list = field(default_factory=list, repr=False)


class PrefixAwareRouter:
    """The policy's state: the prefix map and each replica's load.

    Args:
        num_replicas: replicas 0..N-1 (all alive at first).
        block_size: the replicas' ``block_size`` (tokens per KV block).
        max_blocks: bound of the prefix map (LRU) in block keys; at least 1.
        balance_abs_tokens: the most outstanding tokens by which the prefix holder may exceed the
            least-loaded replica and still be chosen (the module docstring).
        min_match_blocks: the fewest matched blocks for prefix affinity to count.
    Raises:
        ValueError: a size below 1.
    """

    def __init__(self, num_replicas: int, block_size: int, max_blocks: int, *, balance_abs_tokens: int = 4096,
                 min_match_blocks: int = 1):
        if num_replicas < 1 or block_size < 1 or max_blocks < 1 or min_match_blocks < 1:
            raise ValueError("num_replicas, block_size, max_blocks and min_match_blocks must be >= 1")
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.balance_abs_tokens = balance_abs_tokens
        self.min_match_blocks = min_match_blocks
        self.replicas = [ReplicaLoad() for _ in range(num_replicas)]
        self._owner: OrderedDict[BlockHash, int] = OrderedDict()   # block key -> replica, LRU order
        self._last = -1

    # -- keys ---------------------------------------------------------------------------------------
    def block_keys(self, prompt_token_ids: Sequence[int], cache_salt: str | None = None) -> list[BlockHash]:
        """The keys of the prompt's full blocks (module docstring), ``len(ids) // block_size`` of them."""
        return extend_block_hashes([], list(prompt_token_ids), self.block_size, cache_salt)

    def num_prefix_entries(self) -> int:
        return len(self._owner)

    # -- decisions ----------------------------------------------------------------------------------
    def route(self, prompt_token_ids: Sequence[int], max_tokens: int | None = None,
              cache_salt: str | None = None, exclude: Sequence[int] = ()) -> Decision:
        """Choose a replica for a request and count it in that replica's load.

        Args:
            prompt_token_ids: the prompt's token ids (its block keys are taken from them).
            max_tokens: the request's output limit (``None`` counts as 0: unknown).
            cache_salt: the request's ``cache_salt`` (separates its prefix blocks from others').
            exclude: replicas not to choose (e.g. one that just failed this request).
        Returns:
            the ``Decision``; call ``release(decision)`` once the request ends.
        Raises:
            NoReplicaError: no live replica outside ``exclude``.
        """
        keys = self.block_keys(prompt_token_ids, cache_salt)
        cost = len(prompt_token_ids) + int(max_tokens or 0)
        live = [i for i, r in enumerate(self.replicas) if r.alive and i not in exclude]
        if not live:
            raise NoReplicaError("no live engine replica to take the request")
        least = self._least_loaded(live)
        owner, matched = self._longest_match(keys, live)
        by_prefix = owner is not None and matched >= self.min_match_blocks and self._within_bound(owner, least, matched)
        choice = owner if by_prefix else least
        for k in keys:                       # the newest copy of each block is on `choice`
            self._owner[k] = choice
            self._owner.move_to_end(k)
        while len(self._owner) > self.max_blocks:
            self._owner.popitem(last=False)
        r = self.replicas[choice]
        r.outstanding_tokens += cost
        r.num_requests += 1
        r.num_routed += 1
        r.num_prefix_routed += int(by_prefix)
        self._last = choice
        return Decision(choice, matched if by_prefix else 0, cost, by_prefix, keys)

    def release(self, decision: Decision) -> None:
        """The request of ``decision`` ended (finished, aborted or failed): its load goes."""
        r = self.replicas[decision.replica]
        r.outstanding_tokens = max(0, r.outstanding_tokens - decision.cost)
        r.num_requests = max(0, r.num_requests - 1)

    def set_alive(self, replica: int, alive: bool) -> None:
        """Mark a replica dead (its prefix keys and load are dropped: its cache and requests died
        with it) or alive again (it rejoins empty)."""
        r = self.replicas[replica]
        if not alive:
            for k in [k for k, i in self._owner.items() if i == replica]:
                del self._owner[k]
            r.outstanding_tokens = 0
            r.num_requests = 0
        r.alive = alive

    # -- helpers --------------------------------------------------------------------------------------
    def _least_loaded(self, live: list[int]) -> int:
        n = len(self.replicas)
        # round-robin among equals: distance after the last choice breaks the final tie
        return min(live, key=lambda i: (self.replicas[i].outstanding_tokens, self.replicas[i].num_requests,
                                        (i - self._last - 1) % n))

    def _longest_match(self, keys: list[BlockHash], live: list[int]) -> tuple[int | None, int]:
        """The replica owning the longest prefix of ``keys`` among ``live`` and that prefix's length
        in blocks; keys are chained, so key ``j`` stands for blocks ``0..j`` and the search goes
        from the last block back."""
        for j in range(len(keys) - 1, -1, -1):
            owner = self._owner.get(keys[j])
            if owner is not None and owner in live:
                return owner, j + 1
        return None, 0

    def _within_bound(self, owner: int, least: int, matched_blocks: int) -> bool:
        """Whether the prefix holder's load is within the bound of the least loaded replica's: ahead
        by at most the matched prefix's tokens, and at most ``balance_abs_tokens``."""
        ahead = self.replicas[owner].outstanding_tokens - self.replicas[least].outstanding_tokens
        return ahead <= min(matched_blocks * self.block_size, self.balance_abs_tokens)

    def snapshot(self) -> list[dict]:
        """Each replica's load as plain dicts (for metrics)."""
        return [{"alive": r.alive, "outstanding_tokens": r.outstanding_tokens, "num_requests_routed_in_flight":
                 r.num_requests, "num_routed": r.num_routed, "num_prefix_routed": r.num_prefix_routed}
                for r in self.replicas]
