"""Speculative decoding on the scheduler side: who proposes, how many tokens, and when to stop.

A collaborator of the scheduler, as ``beam_search`` and ``prompt_logprobs`` are. The scheduler
calls it at three points:

* **scheduling a decode** (``propose``): for a sequence that may speculate, the n-gram proposer's
  tokens (``ngram_proposer.py``), at most ``num_speculative_tokens`` and never more than the
  sequence may still emit (``max_tokens``, ``max_model_len``) or the step's token budget holds.
  The sequence then computes ``1 + len(drafts)`` positions in the step: its last token and the
  drafts, each row's logits verified by the worker (``runtime/worker/spec_decode.py``);
* **deciding whether to wait** (``wants_token``): a sequence whose last token is still being
  computed (overlap scheduling) cannot be proposed for; one that would look for a proposal, and
  could find one whatever that token is (``NgramProposer.may_propose_after``: a match one token
  shorter already exists), is not scheduled until the token is back; the others decode with a
  placeholder as usual, so a sequence whose text does not recur keeps the overlap;
* **after the step** (``update_from_output``): the acceptance counters (vLLM's ``spec_decode``
  metrics) and the per-sequence switch-off below.

Which sequences speculate:

* requests whose verification is exact: greedy or sampled (temperature, top-k, top-p, min-p, seed:
  the worker's speculative sampling keeps the target distribution and the seeded stream,
  ``runtime/worker/spec_decode.py``), without penalties (they depend on the tokens before each
  verified position), without structured outputs (the grammar would have to mask each position
  and roll back the rejected ones; such requests simply decode one token per step), not a beam
  search, and only once ``min_tokens`` are out;
* per step: none while more than ``disable_by_batch_size`` sequences run (the step is then no
  longer bound by reading the weights, and the extra positions cost their full compute);
* per sequence: when its recent acceptance is low. ``acceptance`` is an exponential moving average
  of the drafts accepted per speculative step (weight ``EMA_WEIGHT``); below ``MIN_ACCEPTED`` the
  sequence stops proposing for ``pause`` tokens (8, doubling up to 128 while it keeps failing),
  then tries once more with its average reset to the floor: an accepting step resumes it, a failing
  one pauses it for twice as long. A lookup that finds no n-gram pauses the sequence for 1 token,
  then 2, 4, ... up to ``MAX_LOOKUP_PAUSE`` while lookups keep finding nothing (a proposal resets
  it), so that text which does not recur runs overlapped instead of waiting for its token to look
  again. The floor comes from the cost of a verifying step (docs/python-api.md, "Speculative
  decoding").
"""

from __future__ import annotations

from ..common.config import SpeculativeConfig
from .ngram_proposer import NgramProposer, TokenHistory

EMA_WEIGHT = 0.5       # weight of the newest step in the acceptance average
MIN_ACCEPTED = 0.5     # accepted drafts per speculative step below which a sequence pauses
FIRST_PAUSE = 8        # tokens of the first pause
MAX_PAUSE = 128        # the longest pause, tokens
MAX_LOOKUP_PAUSE = 32  # the longest pause after lookups that found nothing, tokens


class SpecState:
    """One sequence's speculation state (``Sequence.spec``).

    Attributes:
        history: its token ids as a NumPy array (``TokenHistory``).
        acceptance: moving average of the drafts accepted per speculative step.
        paused_until: no proposals while the sequence has fewer output tokens than this.
        pause: the length of the next pause for low acceptance (tokens).
        lookup_pause: the length of the next pause after a lookup that finds nothing (tokens).
        probing: the next speculative step is the first after a pause.
    """

    __slots__ = ("history", "acceptance", "paused_until", "pause", "lookup_pause", "probing")

    def __init__(self, k: int):
        self.history = TokenHistory()
        self.acceptance = float(k)
        self.paused_until = 0
        self.pause = FIRST_PAUSE
        self.lookup_pause = 1
        self.probing = False


_INELIGIBLE = False  # Sequence.spec of a sequence that never speculates


class SpecDecoding:
    """The scheduler's speculative-decoding collaborator (see the module docstring).

    Args:
        config: the engine's ``SpeculativeConfig``.
        max_model_len: tokens (a sequence never grows past it).
    Attributes:
        num_drafts: speculative steps (sequences that computed drafts, counted per step).
        num_draft_tokens: tokens proposed and verified.
        num_accepted_tokens: of those, tokens the target model agreed with.
        num_accepted_tokens_per_pos: ``[k]`` accepted drafts by their position in the proposal.
    """

    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config = config
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.disable_by_batch_size = config.disable_by_batch_size
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max, self.k)
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos = [0] * self.k

    # -- which sequences ---------------------------------------------------------------------------
    def state(self, seq) -> SpecState | None:
        """``seq``'s ``SpecState``, made on first use; ``None`` for a sequence that never
        speculates (see the module docstring)."""
        st = seq.spec
        if st is None:
            p = seq.request.sampling_params
            ok = not seq.is_beam and not p.has_penalties and p.structured_outputs is None
            st = seq.spec = SpecState(self.k) if ok else _INELIGIBLE
        return st or None

    def step_allows(self, num_running: int) -> bool:
        """Whether sequences may speculate in a step with ``num_running`` running sequences."""
        return num_running <= self.disable_by_batch_size

    def wants_token(self, seq, st: SpecState) -> bool:
        """Whether ``seq`` (one token in flight) would look for a proposal once that token is
        back, and so waits for it instead of decoding with a placeholder."""
        n_out = seq.num_output_tokens + 1
        request = seq.request
        return (n_out >= st.paused_until and n_out >= request.min_tokens
                and n_out + 1 < request.max_output_tokens and len(seq.all_token_ids) + 2 < self.max_model_len
                and self.proposer.may_propose_after(st.history.sync(seq.all_token_ids)))

    # -- at scheduling -----------------------------------------------------------------------------
    def propose(self, seq, st: SpecState, budget: int) -> list[int]:
        """Draft tokens for ``seq`` (nothing in flight), within its limits and ``budget - 1``
        (the step's tokens left, its own last token included). Empty when paused, when
        ``min_tokens`` are not out yet, or when no n-gram recurs (which pauses it briefly)."""
        n_out = seq.num_output_tokens
        request = seq.request
        if n_out < st.paused_until or n_out < request.min_tokens:
            return []
        L = len(seq.all_token_ids)
        limit = min(self.k, budget - 1, request.max_output_tokens - n_out - 1, self.max_model_len - L - 1)
        if limit <= 0:
            return []
        drafts = self.proposer.propose(st.history.sync(seq.all_token_ids), limit)
        if drafts:
            st.lookup_pause = 1
        else:
            st.paused_until = n_out + st.lookup_pause
            st.lookup_pause = min(2 * st.lookup_pause, MAX_LOOKUP_PAUSE)
        return drafts

    # -- after the step ----------------------------------------------------------------------------
    def update_from_output(self, seq, num_drafts: int, num_accepted: int) -> None:
        """Count one speculative step of ``seq`` (``num_accepted`` of ``num_drafts`` drafts
        accepted) and apply the per-sequence switch-off."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        for i in range(num_accepted):
            per_pos[i] += 1
        st = seq.spec
        if not st:
            return
        st.acceptance = (1.0 - EMA_WEIGHT) * st.acceptance + EMA_WEIGHT * num_accepted
        if st.acceptance >= MIN_ACCEPTED:
            if st.probing:
                st.probing = False
                st.pause = FIRST_PAUSE
            return
        # low acceptance: pause, then probe with the average at the floor
        st.paused_until = seq.num_output_tokens + st.pause
        st.pause = min(2 * st.pause, MAX_PAUSE)
        st.acceptance = MIN_ACCEPTED
        st.probing = True

    def get_metrics(self) -> dict:
        """vLLM's ``spec_decode`` counters: spec_decode_num_drafts, spec_decode_num_draft_tokens,
        spec_decode_num_accepted_tokens, spec_decode_num_accepted_tokens_per_pos (a list, one per
        draft position), and what they give (``derived_metrics``)."""
        m = {"spec_decode_num_drafts": self.num_drafts,
             "spec_decode_num_draft_tokens": self.num_draft_tokens,
             "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
             "spec_decode_num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos)}
        m.update(derived_metrics(m))
        return m


def derived_metrics(m: dict) -> dict:
    """From the counters in ``m`` (a snapshot, or the sum of several): spec_decode_acceptance_rate
    (accepted / proposed tokens, 0 before any) and spec_decode_mean_acceptance_length (tokens a
    speculative step emits on average, 1 + accepted / steps, as vLLM's logger reports it; 1 before
    any)."""
    drafts, proposed = m.get("spec_decode_num_drafts", 0), m.get("spec_decode_num_draft_tokens", 0)
    accepted = m.get("spec_decode_num_accepted_tokens", 0)
    return {"spec_decode_acceptance_rate": accepted / proposed if proposed else 0.0,
            "spec_decode_mean_acceptance_length": 1.0 + accepted / drafts if drafts else 1.0}
