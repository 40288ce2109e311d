"""Iteration-level scheduling (continuous batching, Orca, Yu et al., OSDI 2022) and the post-step
update: the scheduler owns every sequence's lifecycle.

``schedule()`` decides the next step: decode-first (every running sequence that is decoding gets
its one token), then prefills oldest first within ``max_num_batched_tokens``, chunked when they do
not fit (Sarathi, Agrawal et al. 2023), at most ``max_num_seqs`` sequences. With
``max_step_ms``, a step that decodes gives its prefills only the tokens the measured prefill rate
fits in that time (``step_time.py``), so no running stream waits longer for a long prompt. When a running
sequence cannot get a block, the newest running sequence is preempted by recompute: its blocks
are freed (their hashes stay, so the prefix cache usually gives most of them back) and it goes to
the front of the waiting queue. ``num_computed_tokens`` advances when a step is scheduled, and a
sequence that samples in a step gets an output *placeholder* until the step's result comes back,
so the next step can be scheduled before that (overlap scheduling, see ``engine.py``).

``update_from_output()`` applies a step's result: it appends the sampled tokens, checks the
token-level stop conditions (EOS, ``stop_token_ids``, ``max_tokens``, ``max_model_len``; stop
*strings* are text and are checked by the output processor, which then calls ``finish_seq``, as
in vLLM V1), forks parents that reached their fork point, finishes and frees. A token sampled for
a sequence that finished or was aborted while the step was in flight is discarded.

Two features are collaborators the scheduler calls at fixed points, not branches of its loop:

* beam search (``beam_search.BeamSearchCoordinator``, for sequences with ``is_beam``): at
  admission (``can_admit``: a search is admitted whole), at preemption (``preemption_group``,
  ``on_preempt``, ``idle_group``) and after the step (``update_from_output``: keep the best
  extensions, fork a beam with several through ``fork_after``, the same path as ``n > 1``, free a
  beam with none). A beam is never scheduled while a step sampling it is in flight (its next token
  is the scheduler's choice, so no placeholder can stand for it); docs/architecture.md ("Beam
  search") has the whole design;
* prompt logprobs (``prompt_logprobs.PromptLogprobsTracker``, for requests with
  ``prompt_logprobs_next >= 0``): at scheduling (the rows that give prompt logprobs), after the
  step and at rollback;
* speculative decoding (``spec_decode.SpecDecoding``, when ``EngineConfig.speculative_config``
  is set): at a decode, the proposed tokens (the sequence then computes its last token and the
  drafts in the step, and is not scheduled again until the result is back), or whether to wait
  for a token in flight before proposing; after the step, the accepted drafts are appended with
  the target's next token, token by token through the stop checks, the rejected positions' slots
  are given back (``KVCacheManager.truncate``) and the counters and switch-off are updated.

The block bookkeeping lives in ``kv_cache_manager.py`` (as in vLLM V1's ``sched/scheduler.py``);
this file never touches a block. Subclasses may restrict admission (``may_admit``), e.g. the
benchmarks' request-level static batching (``perf/bench/static_batching.py``), or pass their own
``KVCacheManager`` (``perf/bench/separate_beams.py``).
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections import deque
from dataclasses import dataclass, field

from ..common.config import EngineConfig
from .beam_search import BeamSearchCoordinator
from .kv_cache_manager import KVCacheManager
from .prompt_logprobs import PromptLogprobsTracker
from .sequence import Request, Sequence, SequenceStatus
from .spec_decode import SpecDecoding
from .step_time import StepTimeModel

_RUNNING = SequenceStatus.RUNNING
_WAITING = SequenceStatus.WAITING
_FINISHED = SequenceStatus.FINISHED


@dataclass
class SchedulerOutput:
    """What runs in one step, column by column (turned into a ``StepPlan`` by ``step.make_step_plan``).

    Attributes:
        step_id: increasing step number.
        seqs: the scheduled sequences, in batch order (decodes first).
        num_new_tokens: per scheduled sequence, tokens computed in this step.
        num_computed_tokens: per scheduled sequence, its ``num_computed_tokens`` before this step
            (the position of its first new token).
        sampled_seqs: the sequences whose last new token's logits are sampled, in batch order
            (the rows of the step's result).
        new_seqs: sequences the worker sees for the first time (their sampling state goes along).
        finished_seq_ids: sequences whose worker-side state can be dropped.
        block_copies: ``(src, dst)`` copy-on-write block copies to do before the forward pass.
        block_tables: ``[S, W]`` int32 block ids of the scheduled sequences (from the KV manager).
        fork_ready: parents whose prefill reaches the fork point in this step (forked when the
            step's result is applied).
        num_preempted: sequences preempted while scheduling this step.
        prompt_logprob_spans: ``(i, position, count)``: rows of scheduled sequence ``i`` at
            positions ``position .. position + count - 1`` give prompt logprobs (of the prompt
            token after each), in batch order.
        draft_token_ids: ``seq_id -> drafts`` of the sequences that speculate in this step (their
            new tokens are their last token followed by the drafts).
    """

    step_id: int
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    sampled_seqs: list[Sequence] = field(default_factory=list)
    new_seqs: list[Sequence] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    block_tables: object = None
    fork_ready: list[Sequence] = field(default_factory=list)
    num_preempted: int = 0
    prompt_logprob_spans: list[tuple[int, int, int]] = field(default_factory=list)
    draft_token_ids: dict[int, list[int]] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


@dataclass
class SchedulerUpdate:
    """What one step's result changed, for the output processor.

    Attributes:
        seqs: the sequences that got new tokens (their last ones), in result-row order.
        rows: each one's row in the ``StepResult``'s logprobs (of its first new token).
        num_tokens: how many new tokens each got, when some sequence speculated in the step (a
            stop ends the list early: tokens after it are dropped); empty when each got one.
        finished_beams: beam search requests whose search ended in this step.
        prompt_logprob_spans: ``(request, position, count)`` per span of the step's prompt
            logprob rows, in result order (``StepResult.prompt_logprobs``).
    """

    seqs: list[Sequence] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    finished_beams: list[Request] = field(default_factory=list)
    prompt_logprob_spans: list = field(default_factory=list)


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
    """Owns the waiting and running queues, the requests and the ``KVCacheManager``.

    Args:
        config: the engine configuration (block_size, max_num_seqs, max_num_batched_tokens,
            enable_prefix_caching, enable_chunked_prefill).
        num_blocks: physical KV blocks available (from the executor).
        max_model_len: longest prompt + output in tokens (a sequence that reaches it stops).
        kv_cache_manager: the ``KVCacheManager`` to use; ``None`` builds one over ``num_blocks``
            blocks from ``config`` (block_size, enable_prefix_caching).
    Attributes:
        waiting, running: the queues (``running`` in admission order); requests: the unfinished
            requests by id; kv_cache_manager; beam_search, prompt_logprobs, spec_decode (``None``
            without ``speculative_config``): the collaborators.
    """

    def __init__(self, config: EngineConfig, num_blocks: int, max_model_len: int,
                 kv_cache_manager: KVCacheManager | None = None):
        self.config = config
        self.block_size = config.block_size
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = max_model_len
        self.chunked = config.enable_chunked_prefill
        # a bound on the time of a step that decodes running streams (step_time.py)
        self.step_time = StepTimeModel(config.max_step_ms / 1000.0) \
            if config.max_step_ms and config.enable_chunked_prefill else None
        self.kv_cache_manager = kv_cache_manager if kv_cache_manager is not None else \
            KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.beam_search = BeamSearchCoordinator(self)
        self.prompt_logprobs = PromptLogprobsTracker()
        self.spec_decode = SpecDecoding(config.speculative_config, max_model_len) \
            if config.speculative_config is not None else None
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._step_id = 0
        self._admit_counter = 0
        self._finished_seq_ids: list[int] = []  # to tell the worker in the next plan
        self._pending_copies: list[tuple[int, int]] = []  # block copies a fork asked for (next plan)

    # -- requests ---------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a validated request: one parent sequence when ``n > 1`` and the prompt has at
        least two tokens (forked after its prefill), one beam for a beam search, otherwise ``n``
        sequences."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        n = request.n
        seed = getattr(request.sampling_params, "seed", None)
        if request.beam is not None:
            seqs = [Sequence(next(_SEQ_IDS), request, 0, request.prompt_token_ids, None, is_beam=True)]
            request.beam.start(seqs[0])
        elif n > 1 and len(request.prompt_token_ids) >= 2:
            seqs = [Sequence(next(_SEQ_IDS), request, 0, request.prompt_token_ids,
                             derive_seed(seed, 0, n), is_parent=True)]
        else:
            seqs = [Sequence(next(_SEQ_IDS), request, i, request.prompt_token_ids,
                             derive_seed(seed, i, n)) for i in range(n)]
        request.seqs = seqs
        self.requests[request.request_id] = request
        self.waiting.extend(seqs)

    def finish_seq(self, seq: Sequence, reason: str, stop_reason=None) -> None:
        """End ``seq`` now: its blocks go back to the pool, the worker drops its state with the
        next plan, a request whose samples all ended leaves ``requests``. No effect on a sequence
        that already finished."""
        if seq.status is _FINISHED:
            return
        self.release(seq)
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        request = seq.request
        request.num_finished_seqs += 1
        if request.is_finished:
            self.requests.pop(request.request_id, None)

    def release(self, seq: Sequence) -> None:
        """Take ``seq`` out of its queue, free its blocks, tell the worker (with the next plan);
        ``finish_seq`` does this and records why, a beam that fell off the search has no why."""
        if seq.status is _RUNNING:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        seq.status = _FINISHED
        self.kv_cache_manager.free(seq)
        if seq.sent_to_worker:
            self._finished_seq_ids.append(seq.seq_id)

    def abort_request(self, request_id: str) -> Request | None:
        """Finish every sequence of the request with reason ``"abort"``; returns the request
        (``None`` for an unknown or finished id)."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        request.aborted = True
        for seq in request.seqs:
            self.finish_seq(seq, "abort")  # samples that already ended keep their reason
        self.requests.pop(request_id, None)
        return request

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def reset_prefix_cache(self) -> bool:
        """Forget every prefix-cache entry (``KVCacheManager.reset_prefix_cache``); only possible
        when no sequence holds a block. Returns whether it did."""
        return self.kv_cache_manager.reset_prefix_cache()

    # -- one step -----------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Decide the next step (see the module docstring for the policy)."""
        self._step_id += 1
        step = self._step_id
        out = SchedulerOutput(step)
        budget = self.max_num_batched_tokens
        kv = self.kv_cache_manager
        max_len = self.max_model_len

        # running sequences: decodes first, then chunked prefills in progress, oldest first
        # (``running`` is kept in admission order). One pass: a decode is scheduled as it is met,
        # prefills after all decodes. (The hot loop; ``_add`` is inlined for one token.)
        prefills = []
        seqs, num_new_tokens, num_computed = out.seqs, out.num_new_tokens, out.num_computed_tokens
        sampled, copies_out = out.sampled_seqs, out.block_copies
        spec = self.spec_decode
        if spec is not None and not spec.step_allows(len(self.running)):
            spec = None
        for seq in list(self.running):
            if seq.status is not _RUNNING:
                continue  # preempted earlier in this pass
            p = seq.num_output_placeholders
            n_total = len(seq.all_token_ids) + p
            c = seq.num_computed_tokens
            num_left = n_total - c - seq.is_parent
            if num_left != 1:
                if num_left > 1:
                    prefills.append((seq, num_left))
                continue
            # its last token is still being sampled: if that one ends it by length, wait; a
            # beam waits for it in any case (the scheduler chooses its next token)
            if p and (n_total - seq.num_prompt_tokens >= seq.request.max_output_tokens or n_total >= max_len
                      or seq.is_beam):
                continue
            if budget <= 0:
                break
            if spec is not None and not seq.is_parent:
                st = spec.state(seq)
                if st is not None:
                    if p:
                        if spec.wants_token(seq, st):
                            continue  # it proposes once its token is back
                    else:
                        drafts = spec.propose(seq, st, budget)
                        if drafts and self._schedule_drafts(out, seq, drafts, step):
                            budget -= 1 + len(drafts)
                            continue
            copies = kv.append_slot(seq)
            if copies is None:
                copies = self._allocate_or_preempt(out, seq, 1, step)
                if copies is None:
                    continue
            if copies:
                copies_out.extend(copies)
            seqs.append(seq)
            num_new_tokens.append(1)
            num_computed.append(c)
            seq.num_computed_tokens = c + 1
            seq.scheduled_step = step
            if seq.is_parent:
                out.fork_ready.append(seq)
                if seq.request.prompt_logprobs_next >= 0:  # its fork point is a prompt position
                    self.prompt_logprobs.schedule(out, seq, c, 1)
            else:
                sampled.append(seq)
                seq.num_output_placeholders = p + 1
            if not seq.sent_to_worker:
                seq.sent_to_worker = True
                out.new_seqs.append(seq)
            budget -= 1
        if self.step_time is not None and seqs:   # streams wait for this step: bound its prefills
            cap = self.step_time.prefill_tokens()
            if cap is not None:
                budget = min(budget, cap)
        for seq, num_new in prefills:
            if budget <= 0:
                break
            if seq.status is not _RUNNING:
                continue
            num_new = min(num_new, budget)
            copies = kv.allocate_slots(seq, num_new)
            if copies is None:
                copies = self._allocate_or_preempt(out, seq, num_new, step)
                if copies is None:
                    continue
            if copies:
                copies_out.extend(copies)
            self._add(out, seq, num_new, step)
            budget -= num_new

        # waiting sequences: admit oldest first while budget, seats and blocks last
        if not out.num_preempted:
            self._admit_waiting(out, budget, step)
            if not out.seqs and self.waiting:
                self._preempt_idle_beams(out)
        if out.seqs:  # finished sequences are reported to the worker with the next plan that runs
            out.finished_seq_ids = self._finished_seq_ids
            self._finished_seq_ids = []
            if self._pending_copies:  # forks' copies first: a copy-on-write may read their blocks
                out.block_copies[:0] = self._pending_copies
                self._pending_copies = []
            out.block_tables = kv.get_block_tables([s.seq_id for s in out.seqs])
        return out

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """The worker took ``seconds`` (forward + sampling) for step ``out``: what the step-time
        bound measures (``step_time.StepTimeModel``)."""
        if self.step_time is not None and out.seqs:
            n = out.num_new_tokens
            decodes = sum(1 for k in n if k == 1)
            self.step_time.observe(sum(n) - decodes, decodes, seconds)

    def empty_step(self) -> SchedulerOutput:
        """A step that runs nothing (the next step id): the engine's plan of no tokens, which
        carries grammar compiles while requests wait for them (``engine.py``)."""
        self._step_id += 1
        return SchedulerOutput(self._step_id)

    def _schedule_drafts(self, out: SchedulerOutput, seq: Sequence, drafts: list[int], step: int) -> bool:
        """Schedule ``seq``'s last token and its ``drafts`` (speculative decoding), if the pool
        has room for them without preempting anyone. Returns whether it did."""
        copies = self.kv_cache_manager.allocate_slots(seq, 1 + len(drafts))
        if copies is None:
            return False
        if copies:
            out.block_copies.extend(copies)
        c = seq.num_computed_tokens
        out.seqs.append(seq)
        out.num_new_tokens.append(1 + len(drafts))
        out.num_computed_tokens.append(c)
        out.sampled_seqs.append(seq)
        out.draft_token_ids[seq.seq_id] = drafts
        seq.num_computed_tokens = c + 1 + len(drafts)
        seq.num_output_placeholders = 1
        seq.scheduled_step = step
        if not seq.sent_to_worker:
            seq.sent_to_worker = True
            out.new_seqs.append(seq)
        return True

    def _preempt_idle_beams(self, out: SchedulerOutput) -> None:
        """Nothing could be scheduled and sequences wait: unless a result in flight will change
        the picture, preempt the beams that hold blocks while their siblings wait for blocks
        (``BeamSearchCoordinator.idle_group``), so the pass after admits the head."""
        if any(s.num_output_placeholders for s in self.running) or \
                any(s.num_output_placeholders for s in self.waiting):
            return
        group = self.beam_search.idle_group()
        for s in group:
            self.preempt(s)
        out.num_preempted += len(group)

    def _allocate_or_preempt(self, out: SchedulerOutput, seq: Sequence, num_new: int, step: int):
        """Room for ``seq``'s tokens after the pool refused: preempt the newest running sequences
        not scheduled in this step until it fits. Returns the block copies, or ``None`` when
        ``seq`` itself was preempted."""
        while True:
            victim = self._pick_victim(step)
            group = self.beam_search.preemption_group(victim, step) if victim.is_beam else [victim]
            for s in group:
                self.preempt(s)
            out.num_preempted += len(group)
            if seq in group:
                return None
            copies = self.kv_cache_manager.allocate_slots(seq, num_new)
            if copies is not None:
                return copies

    def may_admit(self, seq: Sequence) -> bool:
        """Policy hook for subclasses: whether ``seq`` (at the head of the waiting queue) may
        start now (the default: always; seats and blocks are checked after it)."""
        return True

    def _admit_waiting(self, out: SchedulerOutput, budget: int, step: int) -> None:
        kv = self.kv_cache_manager
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if seq.num_output_placeholders or not self.may_admit(seq):
                break  # a preempted sequence waits for its in-flight token first
            request = seq.request
            if seq.is_beam:
                if not self.beam_search.can_admit(seq):
                    break
            elif self.running and len(self.running) + (request.n if seq.is_parent else 1) > self.max_num_seqs:
                break  # (a parent will become n sequences)
            if seq.num_computed_tokens == 0:
                hit_blocks, num_hit = kv.get_computed_blocks(seq)
            else:
                hit_blocks, num_hit = [], 0
            num_new = seq.prefill_target - seq.num_computed_tokens - num_hit
            if num_new > budget:
                if not self.chunked:
                    break
                num_new = budget
            copies = kv.allocate_slots(seq, num_new, hit_blocks)
            if copies is None:
                break
            self.waiting.popleft()
            seq.num_computed_tokens += num_hit
            if request.num_prefix_hit_tokens is None:
                request.num_prefix_hit_tokens = num_hit
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.time()
            seq.status = _RUNNING
            seq.admit_order = self._admit_counter
            self._admit_counter += 1
            self.running.append(seq)
            out.block_copies.extend(copies)
            self._add(out, seq, num_new, step)
            budget -= num_new

    def _add(self, out: SchedulerOutput, seq: Sequence, num_new: int, step: int) -> None:
        start = seq.num_computed_tokens
        out.seqs.append(seq)
        if seq.request.prompt_logprobs_next >= 0:
            self.prompt_logprobs.schedule(out, seq, start, num_new)
        out.num_new_tokens.append(num_new)
        out.num_computed_tokens.append(start)
        seq.num_computed_tokens = start + num_new
        seq.scheduled_step = step
        if not seq.is_parent:
            if start + num_new == len(seq.all_token_ids) + seq.num_output_placeholders:
                out.sampled_seqs.append(seq)
                seq.num_output_placeholders += 1
        elif start + num_new == len(seq.all_token_ids) - 1:
            out.fork_ready.append(seq)
        if not seq.sent_to_worker:
            seq.sent_to_worker = True
            out.new_seqs.append(seq)

    def _pick_victim(self, step: int) -> Sequence:
        """The newest running sequence not yet scheduled in this step (``running`` is in
        admission order; forked samples share their parent's place)."""
        for seq in reversed(self.running):
            if seq.scheduled_step != step:
                return seq
        raise RuntimeError("no sequence to preempt")  # unreachable: the caller is running

    def preempt(self, seq: Sequence, count: bool = True) -> None:
        """Recompute preemption: free the blocks, back to the front of the waiting queue (the
        worker keeps the sequence's sampling state, so a seeded stream continues)."""
        self.running.remove(seq)
        self.kv_cache_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = _WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += int(count)
        if seq.is_beam:  # the search's waiting beams queue together behind it
            siblings = self.beam_search.on_preempt(seq)
            for s in siblings:
                self.waiting.remove(s)
            for i, s in enumerate(siblings, 1):
                self.waiting.insert(i, s)

    # -- after the step -----------------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, result) -> SchedulerUpdate:
        """Apply a step's ``StepResult``: append each sampled token, check token-level stops
        (vLLM's order: EOS unless ``ignore_eos``, ``stop_token_ids``, both only once ``min_tokens``
        are out; then ``max_tokens`` and ``max_model_len``), finish and free, fork parents that
        reached their fork point.

        Returns:
            the sequences that got a token (see ``SchedulerUpdate``).
        Raises:
            RuntimeError: the result has a different number of rows than the step sampled.
        """
        tokens = result.sampled_token_ids.tolist() if hasattr(result.sampled_token_ids, "tolist") \
            else list(result.sampled_token_ids)
        sampled = out.sampled_seqs
        if len(tokens) != len(sampled):
            raise RuntimeError(f"the worker returned {len(tokens)} tokens for {len(sampled)} rows")
        update = SchedulerUpdate()
        if out.prompt_logprob_spans:
            update.prompt_logprob_spans = self.prompt_logprobs.update_from_output(out)
        upd_seqs, upd_rows = update.seqs, update.rows
        now = time.time()
        max_len = self.max_model_len
        beams = None
        row = 0
        if out.draft_token_ids:
            return self._update_speculative(out, result, tokens, update, now)
        for seq, token in zip(sampled, tokens):
            seq.num_output_placeholders -= 1
            if seq.status is _FINISHED:   # ended while this step was in flight: discard
                row += 1
                continue
            if seq.is_beam:  # its token is the search's choice (the coordinator's, below)
                if seq.status is _RUNNING:  # (a preempted beam samples its candidates again)
                    beams = beams or []
                    beams.append((seq, row))
                row += 1
                continue
            all_ids = seq.all_token_ids
            all_ids.append(token)
            request = seq.request
            if request.first_token_time is None:
                request.first_token_time = now
            request.last_token_time = now
            upd_seqs.append(seq)
            upd_rows.append(row)
            row += 1
            n_out = len(all_ids) - seq.num_prompt_tokens
            if token in request.stop_token_set and n_out >= request.min_tokens:
                self.finish_seq(seq, "stop", None if token in request.eos_stop_set else token)
            elif n_out >= request.max_output_tokens or len(all_ids) >= max_len:
                self.finish_seq(seq, "length")
        for seq in out.fork_ready:
            if seq.is_parent and seq.status is _RUNNING and seq.num_computed_tokens == len(seq.all_token_ids) - 1:
                self._fork(seq)
        if beams:
            for request in self.beam_search.update_from_output(beams, result, now):
                update.finished_beams.append(request)
                self.requests.pop(request.request_id, None)
        return update

    def _update_speculative(self, out: SchedulerOutput, result, tokens: list[int], update: SchedulerUpdate,
                            now: float) -> SchedulerUpdate:
        """``update_from_output`` for a step in which some sequences speculated: each of those
        gets its accepted drafts and then the sampled token (``StepResult.num_accepted_tokens``),
        appended one at a time through the same stop checks (a stop drops the tokens after it);
        its rejected positions' slots go back to the pool (``KVCacheManager.truncate``). The
        result's logprob rows are one per token the worker emitted, in row order.

        Raises:
            RuntimeError: the result has no accepted counts, or a count exceeds its drafts.
        """
        accepted = result.num_accepted_tokens
        if accepted is None or len(accepted) != len(tokens):
            raise RuntimeError("the worker returned no num_accepted_tokens for a speculative step")
        accepted = accepted.tolist() if hasattr(accepted, "tolist") else list(accepted)
        drafts_of = out.draft_token_ids
        spec = self.spec_decode
        kv = self.kv_cache_manager
        max_len = self.max_model_len
        upd_seqs, upd_rows, upd_num = update.seqs, update.rows, update.num_tokens
        beams = None
        row = 0
        for seq, token, a in zip(out.sampled_seqs, tokens, accepted):
            seq.num_output_placeholders -= 1
            drafts = drafts_of.get(seq.seq_id)
            if drafts is None:
                new = (token,)
                if a:
                    raise RuntimeError(f"the worker accepted {a} drafts of seq {seq.seq_id}, which had none")
            else:
                if not 0 <= a <= len(drafts):
                    raise RuntimeError(f"the worker accepted {a} of {len(drafts)} drafts of seq {seq.seq_id}")
                new = drafts[:a] + [token]
                if spec is not None:
                    spec.update_from_output(seq, len(drafts), a)
                if seq.status is _RUNNING:
                    seq.num_computed_tokens -= len(drafts) - a
            first_row = row
            row += len(new)
            if seq.status is _FINISHED:   # ended while this step was in flight: discard
                continue
            if seq.is_beam:  # (never speculates)
                if seq.status is _RUNNING:
                    beams = beams or []
                    beams.append((seq, first_row))
                continue
            all_ids = seq.all_token_ids
            request = seq.request
            if request.first_token_time is None:
                request.first_token_time = now
            request.last_token_time = now
            n = 0
            finish = None
            for t in new:
                all_ids.append(t)
                n += 1
                n_out = len(all_ids) - seq.num_prompt_tokens
                if t in request.stop_token_set and n_out >= request.min_tokens:
                    finish = ("stop", None if t in request.eos_stop_set else t)
                    break
                if n_out >= request.max_output_tokens or len(all_ids) >= max_len:
                    finish = ("length", None)
                    break
            if drafts is not None and seq.status is _RUNNING:
                kv.truncate(seq)   # (before a finish frees the blocks: their full ones stay cached)
            if finish is not None:
                self.finish_seq(seq, *finish)
            upd_seqs.append(seq)
            upd_rows.append(first_row)
            upd_num.append(n)
        for seq in out.fork_ready:
            if seq.is_parent and seq.status is _RUNNING and seq.num_computed_tokens == len(seq.all_token_ids) - 1:
                self._fork(seq)
        if beams:
            for request in self.beam_search.update_from_output(beams, result, now):
                update.finished_beams.append(request)
                self.requests.pop(request.request_id, None)
        return update

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Turn a parent that computed all but the last prompt token into ``n`` samples sharing
        its blocks; each then computes the last prompt token itself (copy-on-write of the
        shared partly filled block happens in ``allocate_slots``)."""
        request = parent.request
        n = request.n
        seed = getattr(request.sampling_params, "seed", None)
        parent.is_parent = False
        children = [self._fork_child(parent, i, derive_seed(seed, i, n)) for i in range(1, n)]
        pos = self.running.index(parent)
        self.running[pos + 1:pos + 1] = children
        request.seqs.extend(children)
        return children

    def _fork_child(self, parent: Sequence, index: int, seed: int | None) -> Sequence:
        """A running copy of ``parent`` (same tokens, computed up to the same point) that shares
        every one of its blocks by reference count; the caller places it in ``running``."""
        child = Sequence(next(_SEQ_IDS), parent.request, index, parent.all_token_ids, seed, is_beam=parent.is_beam)
        child.num_computed_tokens = parent.num_computed_tokens
        child.block_hashes = list(parent.block_hashes)
        child.status = _RUNNING
        child.admit_order = parent.admit_order
        copies = self.kv_cache_manager.fork(parent, child)
        if copies:
            self._pending_copies.extend(copies)
        return child

    def fork_after(self, parent: Sequence, index: int) -> Sequence:
        """A running copy of ``parent`` (``_fork_child``, no seed of its own: a beam) placed right
        after it in ``running``; the beam search coordinator forks beams through it."""
        child = self._fork_child(parent, index, None)
        self.running.insert(self.running.index(parent) + 1, child)
        return child

    def rollback(self, outs: list[SchedulerOutput]) -> None:
        """Undo steps whose results will never come (the worker failed one): forget the hashes
        of blocks they were to fill, preempt what they ran so it is recomputed later (not counted
        as a preemption), resend every such sequence's sampling state, and tell the worker again
        about the sequences those plans dropped."""
        kv = self.kv_cache_manager
        finished: list[int] = []
        for out in outs:
            for seq, start in zip(out.seqs, out.num_computed_tokens):
                if seq.status is _RUNNING:
                    kv.drop_unwritten_hashes(seq, start)
            finished.extend(out.finished_seq_ids)
            if out.prompt_logprob_spans:  # their prompt logprobs never came
                self.prompt_logprobs.rollback(out)
        for out in outs:
            for seq in out.seqs:
                seq.num_output_placeholders = 0
                if seq.status is _RUNNING:
                    self.preempt(seq, count=False)
                if seq.status is not _FINISHED:
                    seq.sent_to_worker = False
        self._finished_seq_ids[:0] = finished

    # -- counters ----------------------------------------------------------------------------------
    def reset_counters(self) -> None:
        """Zero num_preemptions and the KV manager's counters (``KVCacheManager.reset_counters``)."""
        self.num_preemptions = 0
        self.kv_cache_manager.reset_counters()

    def get_metrics(self) -> dict:
        """The KV manager's counters (``KVCacheManager.get_metrics``) plus num_preemptions,
        num_running, num_waiting (sequences), kv_tokens_held / kv_tokens_allocated (token slots
        holding K/V vs slots in blocks in use)."""
        m = self.kv_cache_manager.get_metrics()
        held, allocated = self.kv_cache_manager.kv_token_usage(list(self.running))
        m.update(num_preemptions=self.num_preemptions, num_running=len(self.running),
                 num_waiting=len(self.waiting), kv_tokens_held=held, kv_tokens_allocated=allocated)
        if self.spec_decode is not None:
            m.update(self.spec_decode.get_metrics())
        return m
