"""Request and sequence state on the scheduler side.

A ``Request`` is what a client sent (one prompt, one ``SamplingParams``); it owns ``n`` sequences,
one per sample. A request with ``n > 1`` and a prompt of two or more tokens starts as a single
*parent* sequence that prefills all but the last prompt token; the scheduler then forks it into
``n`` sequences that share those blocks by reference count (vLLM V0's ``SequenceGroup`` fork), and
each sample computes the last prompt token itself, copy-on-write of the shared partly filled block
included. Token bookkeeping follows vLLM V1's unified view: a sequence has ``all_token_ids`` and
``num_computed_tokens``; prefill, chunked prefill, decode and recompute after preemption are all
"compute the tokens from ``num_computed_tokens`` up to the target".

Who writes what (docs/architecture.md): a ``Request`` sets its own fields from its constructor's
arguments (``n`` and ``beam`` included); after that the scheduler, with its collaborators
(``beam_search.BeamSearchCoordinator``, ``prompt_logprobs.PromptLogprobsTracker``), owns every field
of ``Sequence`` and ``Request`` except ``Sequence.detokenizer`` / ``logprobs`` /
``cumulative_logprob`` and ``Request.finished_time`` (set when the request's last delta is made),
which only the output processor writes.
"""

from __future__ import annotations

import enum
import time
from typing import Any

from .beam_search import BeamState
from .kv_cache_utils import BlockHash, extend_block_hashes


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One sample of a request.

    Attributes:
        seq_id: engine-wide unique id (the worker's key for sampling state).
        request: the owning ``Request``.
        index: sample index in ``[0, n)`` (the ``CompletionOutput.index``).
        all_token_ids: prompt followed by the generated tokens known to the scheduler.
        num_prompt_tokens: length of the prompt.
        num_computed_tokens: tokens whose K/V are in the cache or scheduled to be written by a step
            already handed to the worker (advanced when a step is scheduled, as vLLM V1 does).
        num_output_placeholders: tokens this sequence samples in steps handed to the worker whose
            results have not come back yet (0, 1 or, with overlap scheduling, 2). Position
            ``num_tokens`` onwards are such placeholders; the worker feeds them itself.
        is_parent: True while this sequence prefills a prompt on behalf of ``n`` samples; it then
            stops one token short of the prompt (``prefill_target``) and is forked.
        is_beam: a beam of a beam search request (``Request.beam``): the scheduler, not the
            worker's sample, chooses its next token, so it is never scheduled while a step that
            samples it is in flight.
        block_hashes: prefix-cache hashes of the full blocks of ``all_token_ids`` (chain).
        sent_to_worker: whether the worker has its sampling state (``NewSequence`` sent).
        seed: this sample's RNG seed or ``None``.
        finish_reason / stop_reason: set when the sequence finishes (``"stop"``, ``"length"``,
            ``"abort"``; the stop token id or stop string).
        detokenizer, logprobs, cumulative_logprob: the output processor's state for this sample.
        spec: speculative decoding's state of this sample (``spec_decode.SpecState``; ``False``
            when it never speculates, ``None`` until first asked).
    """

    __slots__ = ("seq_id", "request", "index", "all_token_ids", "num_prompt_tokens", "num_computed_tokens",
                 "num_output_placeholders", "is_parent", "is_beam", "status", "block_hashes", "sent_to_worker", "seed",
                 "finish_reason", "stop_reason", "admit_order", "scheduled_step", "detokenizer", "logprobs",
                 "cumulative_logprob", "spec")

    def __init__(self, seq_id: int, request: "Request", index: int, token_ids: list[int],
                 seed: int | None, is_parent: bool = False, is_beam: bool = False):
        self.seq_id = seq_id
        self.request = request
        self.index = index
        self.all_token_ids = list(token_ids)
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0
        self.is_parent = is_parent
        self.is_beam = is_beam
        self.status = SequenceStatus.WAITING
        self.block_hashes: list[BlockHash] = []
        self.sent_to_worker = False
        self.seed = seed
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.admit_order = -1      # set by the scheduler when the sequence starts running
        self.scheduled_step = -1   # the last step that scheduled it (the scheduler's step id)
        self.detokenizer: Any = None
        self.logprobs: list | None = None
        self.cumulative_logprob: float | None = None
        self.spec = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def prefill_target(self) -> int:
        """Tokens that must be computed before the next sample: all of them, or for a parent one
        short of the prompt (each sample computes the last prompt token itself)."""
        return self.num_tokens - 1 if self.is_parent else self.num_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_running(self) -> bool:
        return self.status is SequenceStatus.RUNNING

    @property
    def is_waiting(self) -> bool:
        return self.status is SequenceStatus.WAITING

    def update_block_hashes(self, block_size: int) -> list[BlockHash]:
        """Hash any newly completed full blocks of ``all_token_ids`` (chain, salt in block 0)."""
        return extend_block_hashes(self.block_hashes, self.all_token_ids, block_size,
                                   self.request.cache_salt)

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, req={self.request.request_id!r}, idx={self.index}, "
                f"tokens={self.num_tokens}+{self.num_output_placeholders}, computed={self.num_computed_tokens}, "
                f"{self.status.value})")


class Request:
    """One client request: a prompt and its sampling parameters, with ``n`` samples.

    Args:
        max_output_tokens: the resolved limit on generated tokens per sample
            (``SamplingParams.max_tokens``, or what ``max_model_len`` leaves when that is ``None``).
        beam_params: a ``BeamSearchParams`` for a beam search request (``sampling_params`` are then
            its ``worker_params()``), else ``None``.
    Attributes:
        request_id: the caller's id (unique among unfinished requests).
        prompt: the prompt text, or ``None`` when token ids were given.
        prompt_token_ids: the prompt's token ids (non-empty).
        sampling_params: a ``SamplingParams``.
        n: number of samples (``beam_width`` for a beam search: its result sequences).
        max_output_tokens: see Args.
        cache_salt: a string that separates this request's prefix-cache entries, or ``None``.
        arrival_time: ``time.time()`` at ``add_request`` (seconds since the epoch).
        eos_token_ids: ids that end generation unless ``ignore_eos``.
        eos_stop_set: the EOS ids that end a sample (none with ``ignore_eos``).
        stop_token_set: the ids that end a sample once ``min_tokens`` are out (``eos_stop_set``
            and ``stop_token_ids``).
        seqs: the live and finished sequences (ordered by sample index once forked).
        num_prefix_hit_tokens: prompt tokens served from the prefix cache at first admission
            (``None`` until then; ``RequestOutput.num_cached_tokens`` reports it).
        num_finished_seqs: samples finished so far.
        beam: the search state (``beam_search.BeamState``) of a beam search request, else ``None``.
        prompt_logprobs_next: the first prompt position whose prompt logprob (the logprob of the
            prompt token after it) is not yet scheduled, or -1 when none is wanted or all are.
        grammar_key: the key of its constraint's grammar (``runtime/common/grammar.py``), or ``None``.
        first_scheduled_time / first_token_time / last_token_time / finished_time: seconds
            since the epoch, or ``None``.
    """

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 sampling_params, max_output_tokens: int, cache_salt: str | None = None,
                 arrival_time: float | None = None, eos_token_ids: list[int] | None = None, beam_params=None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.n = int(beam_params.beam_width) if beam_params is not None \
            else int(getattr(sampling_params, "n", 1) or 1)
        self.max_output_tokens = int(max_output_tokens)
        self.cache_salt = cache_salt
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.eos_token_ids = list(eos_token_ids or [])
        self.eos_stop_set = frozenset() if getattr(sampling_params, "ignore_eos", False) \
            else frozenset(self.eos_token_ids)
        self.stop_token_set = self.eos_stop_set | frozenset(getattr(sampling_params, "stop_token_ids", None) or [])
        self.min_tokens = int(getattr(sampling_params, "min_tokens", 0) or 0)
        self.seqs: list[Sequence] = []
        self.num_prefix_hit_tokens: int | None = None
        self.num_finished_seqs = 0
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finished_time: float | None = None
        self.aborted = False
        self.beam = BeamState(beam_params, self.eos_stop_set) if beam_params is not None else None
        wants = getattr(sampling_params, "prompt_logprobs", None) is not None
        self.prompt_logprobs_next = 0 if wants and len(self.prompt_token_ids) > 1 else -1
        self.grammar_key: str | None = None   # its constraint's compiled grammar (grammar_gate.py)
        self._worker_sampling: dict | None = None

    @property
    def worker_sampling(self) -> dict:
        """The sampling parameters as the worker takes them (``NewSequence.sampling``), made once
        per request: ``SamplingParams.to_dict`` without the constraint, which reaches the worker
        once, compiled there by its key (``grammar_key``)."""
        if self._worker_sampling is None:
            d = self.sampling_params.to_dict()
            d["structured_outputs"] = None
            self._worker_sampling = d
        return self._worker_sampling

    @property
    def is_finished(self) -> bool:
        if self.beam is not None:
            return self.aborted or self.beam.done
        return self.aborted or self.num_finished_seqs >= self.n
