"""Beam search on sequences that share KV blocks: the search state of one request and its outputs.

The algorithm is vLLM's (``vllm/beam_search.py`` and ``LLM.beam_search``, after Hugging Face
transformers' beam scorer). A request starts with one beam, its prompt. Each step every live beam
proposes its ``2 * beam_width`` most likely next tokens (raw logprobs from the worker; with
``temperature > 0`` also the token the worker sampled); an extension ending in EOS (unless
``ignore_eos``) becomes a *finished hypothesis*, the ``beam_width`` other extensions with the
highest cumulative logprob over all live beams become the next live beams. When the live beams
reach ``max_tokens`` (or ``max_model_len``) they are finished hypotheses too, and the answer is
the ``beam_width`` best hypotheses by ``cum_logprob / len ** length_penalty``.

What is folio's own (docs/architecture.md, "Beam search"): the beams are ``Sequence`` objects of
one request inside the scheduler, not new requests per step. The scheduler's collaborator
``BeamSearchCoordinator`` (below) is called at admission, at preemption and after each step:
after a step it keeps a beam that has one surviving extension as it is (it takes its parent's
blocks), forks a beam that has several (``Scheduler.fork_after``, ``KVCacheManager.fork``: the
children share every block by reference count; the shared partly filled last block is copied on
write when each writes its next token, as for ``n > 1``), and frees a beam that has none at once.
``BeamState`` holds the arithmetic: which extensions survive, which finish, and the final ranking.

Where folio differs from vLLM (docs/architecture.md, "Beam search"): the length in the length
penalty counts the generated tokens only (vLLM counts the prompt too), at least 1; ties are broken
by the parent beam's rank, then the token id (vLLM: sort order).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class BeamSearchSequence:
    """One result of a beam search (vLLM's ``BeamSearchSequence``, generated part only).

    Attributes:
        token_ids: the generated token ids (a final EOS included only with
            ``include_stop_str_in_output``).
        text: their text (special tokens left out).
        cum_logprob: sum of the raw logprobs of the generated tokens, EOS included when the
            sequence ended with it (natural log).
        finish_reason: ``"stop"`` (EOS) or ``"length"`` (max_tokens / max_model_len).
        stop_reason: ``None`` (EOS, as ``SamplingParams`` outputs report it).
    """

    token_ids: list[int]
    text: str
    cum_logprob: float
    finish_reason: str | None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The result of a beam search for one prompt: ``sequences``, best first (at most
    ``beam_width``; vLLM's ``BeamSearchOutput``)."""

    sequences: list[BeamSearchSequence] = field(default_factory=list)

    @classmethod
    def from_request_output(cls, out) -> "BeamSearchOutput":
        """From the ``RequestOutput`` the engine makes of a beam search request (one completion
        per sequence, in rank order)."""
        return cls([BeamSearchSequence(list(c.token_ids), c.text, float(c.cumulative_logprob or 0.0),
                                       c.finish_reason, c.stop_reason) for c in out.outputs])


def beam_score(num_tokens: int, cum_logprob: float, length_penalty: float) -> float:
    """``cum_logprob / max(num_tokens, 1) ** length_penalty`` (``num_tokens``: generated, a final
    EOS not counted; the floor of 1 keeps an EOS-first hypothesis finite)."""
    return cum_logprob / max(int(num_tokens), 1) ** length_penalty


@dataclass
class Hypothesis:
    """A finished candidate: generated ids (as reported), cumulative logprob, why it ended, and its
    length for the penalty."""

    token_ids: list[int]
    cum_logprob: float
    finish_reason: str
    length: int


class BeamState:
    """The search state of one beam search request (owned by the scheduler).

    Args:
        params: the request's ``BeamSearchParams``.
        eos_token_ids: ids that finish a beam (empty with ``ignore_eos``).
    Attributes:
        width: ``params.beam_width``.
        live: the live beams (``Sequence`` objects), best first.
        cum: ``seq_id -> cumulative logprob`` of each live beam.
        pending: ``seq_id -> (token ids, logprobs)`` candidates of live beams whose step came
            back; the search advances when every live beam has them.
        finished: finished hypotheses in the order they finished.
        done: no live beam is left (the request's result can be made).
    """

    def __init__(self, params, eos_token_ids):
        self.params = params
        self.width = int(params.beam_width)
        self.eos = frozenset() if params.ignore_eos else frozenset(int(t) for t in eos_token_ids)
        self.live: list = []
        self.cum: dict[int, float] = {}
        self.pending: dict[int, tuple[list[int], list[float]]] = {}
        self.finished: list[Hypothesis] = []
        self.done = False

    def start(self, seq) -> None:
        """The search starts from one live beam, ``seq`` (the prompt), with logprob 0."""
        self.live = [seq]
        self.cum = {seq.seq_id: 0.0}

    def add_candidates(self, seq, token_ids, logprobs) -> bool:
        """Record the candidates of ``seq`` (a live beam) from its row of a step result: column
        0 is the sampled token, columns 1.. the top ``2 * width`` by raw logprob. Returns whether
        every live beam now has its candidates."""
        ids: list[int] = []
        lps: list[float] = []
        seen = set()
        for t, lp in zip(token_ids.tolist(), logprobs.tolist()):
            if t in seen or not math.isfinite(lp):
                continue
            seen.add(t)
            ids.append(t)
            lps.append(lp)
        self.pending[seq.seq_id] = (ids, lps)
        return len(self.pending) == len(self.live)

    def select(self) -> list[tuple[int, int, float]]:
        """Advance one step from the pending candidates of every live beam.

        Extensions ending in EOS become finished hypotheses; of the others the ``width`` with
        the highest cumulative logprob survive (ties: the better-ranked parent, then the smaller
        token id). Clears ``pending``.

        Returns:
            ``(parent index in live, token, cumulative logprob)`` per surviving extension, best first.
        """
        include_eos = self.params.include_stop_str_in_output
        cands = []
        for pos, seq in enumerate(self.live):
            ids, lps = self.pending[seq.seq_id]
            base = self.cum[seq.seq_id]
            out = seq.output_token_ids
            for t, lp in zip(ids, lps):
                c = base + lp
                if t in self.eos:
                    self.finished.append(Hypothesis(out + [t] if include_eos else list(out), c, "stop", len(out)))
                else:
                    cands.append((-c, pos, t))
        self.pending.clear()
        cands.sort()
        return [(pos, t, -negc) for negc, pos, t in cands[:self.width]]

    def finish_live(self, reason: str) -> None:
        """The live beams end here (length): they join the finished hypotheses."""
        for seq in self.live:
            out = seq.output_token_ids
            self.finished.append(Hypothesis(list(out), self.cum[seq.seq_id], reason, len(out)))

    def ranked(self) -> list[Hypothesis]:
        """The ``width`` best finished hypotheses by length-penalised score, best first (stable:
        equal scores keep the order they finished in). A search that produced none (``max_tokens``
        0) answers one empty hypothesis."""
        if not self.finished:
            return [Hypothesis([], 0.0, "length", 0)]
        lp = self.params.length_penalty
        return sorted(self.finished, key=lambda h: -beam_score(h.length, h.cum_logprob, lp))[:self.width]


class BeamSearchCoordinator:
    """The scheduler's beam search collaborator: what a beam needs at admission, at preemption and
    after a step, so that ``Scheduler``'s core loop stays plain scheduling.

    The scheduler calls it only for beams (``Sequence.is_beam``); it reads the scheduler's queues
    and limits and changes them only through the scheduler's methods (``preempt``, ``release``,
    ``fork_after``). Each search's state is its request's ``BeamState``.

    Args:
        scheduler: the ``Scheduler`` it serves.
    """

    def __init__(self, scheduler):
        self.scheduler = scheduler

    # admission
    def can_admit(self, seq) -> bool:
        """A waiting beam is admitted only while the seats and the free blocks could take every
        waiting beam of its search (the first beam: all ``beam_width`` it becomes) to its next
        token, no sharing counted: a search is not split by a lack of room that its own admitted
        part holds."""
        sched = self.scheduler
        waiting = [s for s in seq.request.beam.live if s.is_waiting]
        seats = seq.request.n if seq.num_output_tokens == 0 else len(waiting)
        if sched.running and len(sched.running) + seats > sched.max_num_seqs:
            return False
        bs = sched.block_size
        need = sum(-(-(s.num_tokens + 1) // bs) for s in waiting)
        return need <= sched.kv_cache_manager.get_num_free_blocks()

    # preemption
    def preemption_group(self, victim, step: int) -> list:
        """What goes with ``victim`` when the scheduler preempts it: its whole search's running
        beams not yet scheduled in ``step`` (siblings left holding blocks could only wait for it)."""
        return [s for s in victim.request.beam.live if s.is_running and s.scheduled_step != step]

    def on_preempt(self, seq) -> list:
        """``seq`` was preempted: its recompute samples its candidates again. Returns its search's
        other waiting beams, which the scheduler queues right behind it (``can_admit`` admits them
        as one)."""
        state = seq.request.beam
        state.pending.pop(seq.seq_id, None)
        return [s for s in state.live if s is not seq and s.is_waiting]

    def idle_group(self) -> list:
        """Nothing could be scheduled, sequences wait, and nothing is in flight: the running
        sequences are beams holding blocks while they wait for siblings that wait for blocks. The
        newest such search's running beams, for the scheduler to preempt (recomputed later), or
        ``[]``."""
        for seq in reversed(self.scheduler.running):
            if seq.is_beam:
                return [s for s in seq.request.beam.live if s.is_running]
        return []

    # after the step
    def update_from_output(self, beams, result, now: float) -> list:
        """Record each sampled beam's candidates (``beams``: ``(seq, row)``, its row of the
        result's logprobs) and advance every search whose live beams all have theirs.

        Returns:
            the requests whose search ended in this step.
        """
        ready = []
        for seq, row in beams:
            request = seq.request
            if request.beam.add_candidates(seq, result.logprob_token_ids[row], result.logprobs[row]):
                ready.append(request)
        ended = []
        for request in ready:
            if request.first_token_time is None:
                request.first_token_time = now
            request.last_token_time = now
            if self._advance(request):
                ended.append(request)
        return ended

    def _advance(self, request) -> bool:
        """One step of the search (``BeamState.select``): a beam with one surviving extension
        appends it, one with k > 1 is forked k - 1 times first (the children share its blocks),
        one with none is freed now; beams that reach the length limit finish. Returns whether the
        search ended."""
        sched = self.scheduler
        state = request.beam
        old = state.live
        chosen = state.select()
        first: dict = {}
        extensions = []
        for rank, (pos, token, cum) in enumerate(chosen):
            parent = old[pos]
            if pos not in first:
                first[pos] = parent
                seq = parent
            else:  # fork before the parent appends its own token
                seq = sched.fork_after(parent, rank)
            seq.index = rank
            extensions.append((seq, token, cum))
        for pos, seq in enumerate(old):
            if pos not in first:
                sched.release(seq)  # fell off: its blocks go back now
        state.cum = {}
        for seq, token, cum in extensions:
            seq.all_token_ids.append(token)
            state.cum[seq.seq_id] = cum
        state.live = [seq for seq, _, _ in extensions]
        request.seqs = state.live
        if state.live:
            seq = state.live[0]
            if seq.num_output_tokens >= request.max_output_tokens or seq.num_tokens >= sched.max_model_len:
                state.finish_live("length")
                for seq in state.live:
                    sched.release(seq)
                state.live = request.seqs = []
        if not state.live:
            state.done = True
        return state.done
