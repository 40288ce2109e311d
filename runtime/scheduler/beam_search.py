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
one request inside the scheduler, not new requests per step. After each step the scheduler
(``Scheduler._advance_beams``) keeps a beam that has one surviving extension as it is (it takes
its parent's blocks), forks a beam that has several (``KVCacheManager.fork``: the children share
every block by reference count; the shared partly filled last block is copied on write when each
writes its next token, as for ``n > 1``), and frees a beam that has none at once. This file holds
only the arithmetic: which extensions survive, which finish, and the final ranking.

Where folio differs from vLLM (README "Beam search"): the length in the length penalty counts the
generated tokens (vLLM counts the prompt too; the issue text asks for the generated length), at
least 1; ties are broken by the parent beam's rank, then the token id (vLLM: sort order).
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
