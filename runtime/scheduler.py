"""Iteration-level scheduling policy (continuous batching, Orca, Yu et al., OSDI 2022).

One call to ``schedule()`` decides the next step: decode-first (every running sequence that is
decoding gets its one token), then prefills oldest first within ``max_num_batched_tokens``,
chunked when they do not fit (Sarathi, Agrawal et al. 2023), at most ``max_num_seqs`` sequences.
When a running sequence cannot get a block, the newest running sequence is preempted by
recompute: its blocks are freed (their hashes stay, so the prefix cache usually gives most of
them back) and it goes to the front of the waiting queue. This file is policy only; the block
bookkeeping lives in ``kv_cache_manager.py`` (as in vLLM V1's ``sched/scheduler.py``).

``scheduling_policy="static"`` is request-level batching for comparisons: a batch of up to
``max_num_seqs`` requests is admitted only when the previous batch has completely finished.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections import deque
from dataclasses import dataclass, field

from .config import EngineConfig
from .kv_cache_manager import KVCacheManager
from .sequence import Request, Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    """One sequence in the step: compute ``num_new_tokens`` from ``seq.num_computed_tokens``;
    ``sample`` = the step ends at the sequence's last known token, so its logits are sampled."""

    seq: Sequence
    num_new_tokens: int
    sample: bool


@dataclass
class SchedulerOutput:
    """What runs in one step (turned into a ``StepPlan`` by the engine)."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    new_seqs: list[Sequence] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


# seq ids are unique in the process, so engines that share one worker never collide
_SEQ_IDS = itertools.count()


def derive_seed(seed: int | None, index: int, n: int) -> int | None:
    """The seed of sample ``index`` of a seeded request: the request's own seed for ``n == 1``,
    otherwise a sha256-derived 63-bit value per index (distinct, reproducible)."""
    if seed is None:
        return None
    if n == 1:
        return int(seed)
    d = hashlib.sha256(f"folio-sample:{int(seed)}:{index}".encode()).digest()
    return int.from_bytes(d[:8], "little") >> 1


class Scheduler:
    """Owns the waiting and running queues and the ``KVCacheManager``.

    Args:
        config: the engine configuration (block_size, max_num_seqs, max_num_batched_tokens,
            enable_prefix_caching, enable_chunked_prefill, scheduling_policy).
        num_blocks: physical KV blocks available (from the executor).
    """

    def __init__(self, config: EngineConfig, num_blocks: int):
        self.config = config
        self.block_size = config.block_size
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.chunked = config.enable_chunked_prefill
        self.static = config.scheduling_policy == "static"
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._admit_counter = 0
        self._pending_finished_ids: list[int] = []
        self._static_batch: set[str] = set()

    # requests
    def add_request(self, request: Request) -> None:
        """Queue a validated request: one parent sequence when ``n > 1`` and the prompt has at
        least two tokens (forked after its prefill), otherwise ``n`` sequences."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        n = request.n
        seed = getattr(request.sampling_params, "seed", None)
        if n > 1 and len(request.prompt_token_ids) >= 2:
            seqs = [Sequence(self._new_seq_id(), request, 0, request.prompt_token_ids,
                             derive_seed(seed, 0, n), is_parent=True)]
        else:
            seqs = [Sequence(self._new_seq_id(), request, i, request.prompt_token_ids,
                             derive_seed(seed, i, n)) for i in range(n)]
        request.seqs = seqs
        self.requests[request.request_id] = request
        self.waiting.extend(seqs)

    def _new_seq_id(self) -> int:
        return next(_SEQ_IDS)

    def finish_seq(self, seq: Sequence, reason: str, stop_reason=None) -> None:
        """End ``seq`` now: its blocks go back to the pool, the worker drops its state at the
        next step."""
        if seq.is_finished:
            return
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        if seq in self.running:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.kv.free(seq)
        if seq.sent_to_worker:
            self._pending_finished_ids.append(seq.seq_id)

    def abort_request(self, request_id: str) -> Request | None:
        """Finish every sequence of the request with reason ``"abort"``; returns the request."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        request.aborted = True
        for seq in request.seqs:
            self.finish_seq(seq, "abort")
        return request

    def remove_finished_request(self, request: Request) -> None:
        self.requests.pop(request.request_id, None)
        self._static_batch.discard(request.request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # one step
    def schedule(self) -> SchedulerOutput:
        """Decide the next step (see the module docstring for the policy)."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled_ids: set[int] = set()

        # running sequences: decodes first, then chunked prefills in progress, oldest first
        # (``running`` is kept in admission order, so a stable partition is that order)
        todo = [(seq, seq.prefill_target - seq.num_computed_tokens) for seq in self.running]
        queue = [t for t in todo if t[1] <= 1] + [t for t in todo if t[1] > 1]
        running = SequenceStatus.RUNNING
        for seq, num_left in queue:
            if budget <= 0:
                break
            if seq.status is not running:
                continue  # preempted earlier in this pass
            num_new = min(num_left, budget)
            if num_new <= 0:
                continue
            while True:
                copies = self.kv.allocate_slots(seq, num_new)
                if copies is not None:
                    break
                victim = self._pick_victim(scheduled_ids)
                self.preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not running:
                continue
            if copies:
                out.block_copies.extend(copies)
            self._add(out, seq, num_new, scheduled_ids)
            budget -= num_new

        # waiting sequences: admit oldest first while budget, seats and blocks last
        if not out.preempted:
            self._admit_waiting(out, budget, scheduled_ids)
        out.finished_seq_ids = self._pending_finished_ids
        self._pending_finished_ids = []
        return out

    def _admit_waiting(self, out: SchedulerOutput, budget: int, scheduled_ids: set[int]) -> None:
        if self.static:
            if not self.running and not any(r in self.requests for r in self._static_batch):
                self._static_batch = set()
                for seq in self.waiting:
                    if len(self._static_batch) >= self.max_num_seqs:
                        break
                    self._static_batch.add(seq.request.request_id)
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            request = seq.request
            if self.static and request.request_id not in self._static_batch:
                break
            # a parent will become n sequences
            seats = request.n if seq.is_parent else 1
            if self.running and len(self.running) + seats > self.max_num_seqs:
                break
            if seq.num_computed_tokens == 0:
                hit_blocks, num_hit = self.kv.get_computed_blocks(seq)
            else:
                hit_blocks, num_hit = [], 0
            num_new = seq.prefill_target - seq.num_computed_tokens - num_hit
            if num_new > budget:
                if not self.chunked:
                    break
                num_new = budget
            copies = self.kv.allocate_slots(seq, num_new, hit_blocks)
            if copies is None:
                break
            self.waiting.popleft()
            seq.num_computed_tokens += num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.time()
            seq.status = SequenceStatus.RUNNING
            seq.admit_order = self._admit_counter
            self._admit_counter += 1
            self.running.append(seq)
            out.block_copies.extend(copies)
            self._add(out, seq, num_new, scheduled_ids)
            budget -= num_new

    def _add(self, out: SchedulerOutput, seq: Sequence, num_new: int, scheduled_ids: set[int]) -> None:
        sample = not seq.is_parent and seq.num_computed_tokens + num_new == seq.num_tokens
        out.scheduled.append(ScheduledSeq(seq, num_new, sample))
        scheduled_ids.add(seq.seq_id)
        if not seq.sent_to_worker:
            seq.sent_to_worker = True
            out.new_seqs.append(seq)

    def _pick_victim(self, scheduled_ids: set[int]) -> Sequence:
        """The newest running sequence not yet scheduled in this step."""
        candidates = [s for s in self.running if s.seq_id not in scheduled_ids]
        return max(candidates, key=lambda s: s.admit_order)

    def preempt(self, seq: Sequence, count: bool = True) -> None:
        """Recompute preemption: free the blocks, back to the front of the waiting queue (the
        worker keeps the sequence's sampling state, so a seeded stream continues)."""
        self.running.remove(seq)
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += int(count)

    # after the step
    def update_from_output(self, out: SchedulerOutput) -> list[Sequence]:
        """Advance every scheduled sequence by its tokens and fork parents that reached their
        fork point. Returns the sequences created by forks (already running)."""
        created: list[Sequence] = []
        for item in out.scheduled:
            seq = item.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue
            seq.num_computed_tokens += item.num_new_tokens
            if seq.is_parent and seq.num_computed_tokens == seq.prefill_target:
                created.extend(self._fork(seq))
        return created

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Turn a parent that computed all but the last prompt token into ``n`` samples sharing
        its blocks; each then computes the last prompt token itself (copy-on-write of the
        shared partly filled block happens in ``allocate_slots``)."""
        request = parent.request
        n = request.n
        seed = getattr(request.sampling_params, "seed", None)
        parent.is_parent = False
        children = []
        pos = self.running.index(parent)
        for i in range(1, n):
            child = Sequence(self._new_seq_id(), request, i, parent.all_token_ids,
                             derive_seed(seed, i, n))
            child.num_computed_tokens = parent.num_computed_tokens
            child.block_hashes = list(parent.block_hashes)
            child.status = SequenceStatus.RUNNING
            child.admit_order = parent.admit_order
            self.kv.fork(parent, child)
            children.append(child)
        self.running[pos + 1:pos + 1] = children
        request.seqs.extend(children)
        return children

    # counters
    def get_metrics(self) -> dict:
        pool = self.kv.pool
        live = list(self.running)
        held, allocated = self.kv.kv_token_usage(live)
        return {
            "num_total_blocks": pool.num_blocks,
            "num_free_blocks": pool.get_num_free_blocks(),
            "num_cached_blocks": pool.get_num_cached_blocks(),
            "num_evictions": pool.num_evictions,
            "prefix_cache_queries": self.kv.prefix_cache_queries,
            "prefix_cache_hits": self.kv.prefix_cache_hits,
            "num_preemptions": self.num_preemptions,
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "kv_tokens_held": held,
            "kv_tokens_allocated": allocated,
        }
