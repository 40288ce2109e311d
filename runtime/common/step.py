"""The step contract between the scheduler and the model runner (worker).

One engine step: the scheduler builds a ``StepPlan``; the worker runs the forward pass and the
sampler over it and answers with a ``StepResult``. The worker never sees a request object and never
decides what runs; the scheduler never touches device memory. In-process this is a direct call;
``ipc/`` puts a process boundary at exactly this seam (arrays travel as raw bytes, dtype, shape).

Sequences are named by integer ``seq_id`` (a request with ``n > 1`` has ``n`` sequences).
Sampling state (parameters, prompt ids, the per-sequence RNG, generated ids for penalties) lives
on the worker from the step that first schedules the sequence (``new_seqs``) until
``finished_seq_ids`` names it; the worker appends every token it samples to the sequence's history
and advances the sequence's grammar matcher, if it is constrained
(``runtime/worker/grammar_matchers.py``).

Overlap scheduling: the scheduler may hand over plan N+1 before plan N's result is back. A
sequence that samples in step N and decodes in step N+1 then has ``PLACEHOLDER_TOKEN_ID`` as its
input id in plan N+1; the worker, which runs plans in order, puts there the token that sequence
sampled in the step before (SGLang's "future token ids"; ``LastSampledTokens`` does it).

Speculative decoding: a sequence with ``num_draft_tokens[i] = d > 0`` computes its last token
followed by ``d`` proposed tokens; the worker takes the logits of all ``d + 1`` rows (the last of
them ``logits_indices[i]``), accepts the longest prefix of the drafts the target agrees with and
samples one more token after it (``runtime/worker/spec_decode.py``). The result says how many
drafts each row accepted (``StepResult.num_accepted_tokens``); its ``sampled_token_ids`` stay one
per row, the token after the accepted drafts. Such a sequence's inputs are never placeholders.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

# an input id the worker replaces with the token its sequence sampled in the previous step
PLACEHOLDER_TOKEN_ID = -1

_NO_ROWS = np.zeros(0, dtype=np.int64)  # shared, never written


@dataclass
class NewSequence:
    """Sampling state of a sequence, sent once, in the first plan that schedules it.

    Attributes:
        seq_id: engine-wide unique id of the sequence.
        prompt_token_ids: the prompt (repetition_penalty counts prompt tokens, as vLLM does).
        output_token_ids: tokens already generated (non-empty only when a forked sequence or a
            restored one is introduced mid-generation).
        sampling: the request's ``SamplingParams`` as a plain dict (see runtime/common/sampling_params.py).
        seed: the RNG seed of this sequence, or ``None`` for the engine's unseeded stream. For a
            request with ``seed`` and ``n > 1``, sample ``i`` gets a distinct derived seed.
        eos_token_ids: ids that end generation (masked while fewer than min_tokens are out,
            unless ignore_eos).
        grammar_key: the compiled grammar that constrains it (``StepPlan.grammar_compiles`` of an
            earlier plan), or ``None``; ``sampling`` then carries no ``structured_outputs``.
    """

    seq_id: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling: dict
    seed: int | None
    eos_token_ids: list[int]
    grammar_key: str | None = None


@dataclass
class StepPlan:
    """What the worker runs in one step (shapes: T tokens, S sequences, R sampled rows).

    Attributes:
        step_id: increasing step number; the result echoes it.
        input_ids: ``[T]`` int64 token ids, sequences laid end to end; ``PLACEHOLDER_TOKEN_ID``
            (-1) = the token this row's sequence sampled in the previous step.
        positions: ``[T]`` int64 position of each token in its sequence.
        slot_mapping: ``[T]`` int64 KV slot (``block_id * block_size + offset``), -1 = no write.
        query_start_loc: ``[S+1]`` int32 offsets of each sequence's tokens in the batch.
        seq_lens: ``[S]`` int32 context length of each sequence after this step.
        block_tables: ``[S, max_blocks]`` int32 physical block ids (padding entries 0).
        seq_ids: ``[S]`` int64 the sequence of each batch row.
        logits_indices: ``[R]`` int64 token rows whose logits are sampled (the last token of
            each sequence that finishes its prefill or decodes this step).
        sample_seq_ids: ``[R]`` int64 the sequence that owns each sampled row.
        new_seqs: sampling state of sequences scheduled for the first time.
        finished_seq_ids: sequences whose worker-side state can be dropped.
        block_copies: ``[N, 2]`` int64 ``(src, dst)`` copy-on-write block copies, done before the
            forward pass.
        prompt_logprob_indices: ``[N]`` int64 token rows whose logits give prompt logprobs (a
            prompt position of a request that asked for them), in batch order.
        prompt_logprob_token_ids: ``[N]`` int64 the prompt token following each of those rows
            (whose logprob is wanted).
        grammar_compiles: ``[{"key", "structured_outputs", "eos_token_ids"}]``: grammars to compile
            before any sequence of theirs is scheduled (``runtime/common/grammar.py``); answered in
            a later ``StepResult.grammar_results``.
        grammar_releases: keys of compiled grammars no live request uses any more.
        num_draft_tokens: ``[R]`` int64 drafts of each sampled row's sequence (speculative
            decoding: its rows ``logits_indices[i] - d .. logits_indices[i]`` are verified, the
            drafts being the input ids of the last ``d`` of them), or empty: none in the step.
    A plan with no tokens (``num_tokens == 0``) only carries these and finished sequences: the
    worker answers it once a compile ends or after ``GRAMMAR_POLL_S`` seconds.
    """

    step_id: int
    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray
    seq_ids: np.ndarray
    logits_indices: np.ndarray
    sample_seq_ids: np.ndarray
    new_seqs: list[NewSequence] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)
    block_copies: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), dtype=np.int64))
    prompt_logprob_indices: np.ndarray = field(default_factory=lambda: _NO_ROWS)
    prompt_logprob_token_ids: np.ndarray = field(default_factory=lambda: _NO_ROWS)
    grammar_compiles: list[dict] = field(default_factory=list)
    grammar_releases: list[str] = field(default_factory=list)
    num_draft_tokens: np.ndarray = field(default_factory=lambda: _NO_ROWS)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class StepResult:
    """What the worker returns for one ``StepPlan``.

    Attributes:
        step_id: the plan's step_id.
        sampled_token_ids: ``[R]`` int64, one per ``plan.logits_indices`` row, same order.
        logprobs: ``[R, 1 + K]`` float32 or ``None``: column 0 is the sampled token's logprob,
            columns 1.. the top-K logprobs (K = the largest ``logprobs`` asked for in the step).
            In a step with drafts, one row per emitted token instead: row ``i``'s accepted drafts
            then its sampled token, rows in order (``sum(num_accepted_tokens + 1)`` rows).
        logprob_token_ids: ``[R, 1 + K]`` int64 matching ``logprobs`` (column 0 = sampled id).
        forward_time: seconds spent in the forward pass.
        sample_time: seconds spent sampling.
        idle_time: seconds the worker waited for this plan after finishing the previous one
            (its idle time between steps; measured by whoever runs the runner).
        error: a message when the step failed on the worker (then the other fields are empty).
        prompt_logprobs: ``[N, 1 + K]`` float32 or ``None``, one row per
            ``plan.prompt_logprob_indices`` row: column 0 the raw logprob of the following prompt
            token, columns 1.. the top-K (K = the largest ``prompt_logprobs`` of the step).
        prompt_logprob_token_ids: ``[N, 1 + K]`` int64 matching (column 0 = the prompt token).
        prompt_logprob_ranks: ``[N]`` int64 1-based rank of each prompt token in its row.
        grammar_results: ``[{"key", "error"}]``: grammars whose compile ended (``error`` ``None``:
            compiled) or ran past its bound since the previous result, each reported once.
        num_accepted_tokens: ``[R]`` int64 drafts accepted per row in a step with drafts
            (``plan.num_draft_tokens``), else ``None``.
    """

    step_id: int
    sampled_token_ids: np.ndarray
    logprobs: np.ndarray | None = None
    logprob_token_ids: np.ndarray | None = None
    forward_time: float = 0.0
    sample_time: float = 0.0
    idle_time: float = 0.0
    error: str | None = None
    prompt_logprobs: np.ndarray | None = None
    prompt_logprob_token_ids: np.ndarray | None = None
    prompt_logprob_ranks: np.ndarray | None = None
    grammar_results: list[dict] = field(default_factory=list)
    num_accepted_tokens: np.ndarray | None = None


GRAMMAR_POLL_S = 0.01   # the longest a worker holds the answer to a plan with no tokens


def poll_plan(step_id: int, grammar_compiles=(), grammar_releases=()) -> StepPlan:
    """A plan with no tokens: it carries grammar compiles and releases, and its result the
    grammars compiled meanwhile (the engine sends one while requests wait for their grammar and
    nothing else runs)."""
    empty = np.zeros(0, dtype=np.int64)
    return StepPlan(step_id=step_id, input_ids=empty, positions=empty, slot_mapping=empty,
                    query_start_loc=np.zeros(1, dtype=np.int32), seq_lens=np.zeros(0, dtype=np.int32),
                    block_tables=np.zeros((0, 1), dtype=np.int32), seq_ids=empty, logits_indices=empty,
                    sample_seq_ids=empty, grammar_compiles=list(grammar_compiles),
                    grammar_releases=list(grammar_releases))


def make_step_plan(out, block_size: int) -> StepPlan:
    """Flatten a ``scheduler.SchedulerOutput`` into the plan's arrays.

    One pass over the scheduled sequences gathers their new token ids (a position the scheduler
    does not know yet, the token being sampled in the step in flight, becomes
    ``PLACEHOLDER_TOKEN_ID``); every per-token array is then computed with NumPy, and the block
    tables come from the KV manager as one gather. A speculating sequence's new tokens are its
    last token and its drafts (``out.draft_token_ids``).
    """
    seqs = out.seqs
    S = len(seqs)
    T = sum(out.num_new_tokens)
    start = np.array(out.num_computed_tokens, dtype=np.int64)
    seq_ids = np.array([s.seq_id for s in seqs], dtype=np.int64)
    if T == S:  # decode only: one token per sequence
        ids = [s.all_token_ids[c] if c < len(s.all_token_ids) else PLACEHOLDER_TOKEN_ID
               for s, c in zip(seqs, out.num_computed_tokens)]
        positions = start
        token_seq = np.arange(S)
        query_start_loc = np.arange(S + 1, dtype=np.int32)
        seq_lens = start + 1
    else:
        ids = []
        drafts_of = out.draft_token_ids
        for seq, c, n in zip(seqs, out.num_computed_tokens, out.num_new_tokens):
            chunk = seq.all_token_ids[c:c + n]
            ids.extend(chunk)
            if len(chunk) < n:
                drafts = drafts_of.get(seq.seq_id) if drafts_of else None
                if drafts is not None:
                    ids.extend(drafts)
                else:  # only the last position can be in flight
                    ids.append(PLACEHOLDER_TOKEN_ID)
        num_new = np.array(out.num_new_tokens, dtype=np.int64)
        query_start_loc = np.zeros(S + 1, dtype=np.int32)
        np.cumsum(num_new, out=query_start_loc[1:])
        seq_lens = start + num_new
        token_seq = np.repeat(np.arange(S), num_new)
        positions = np.arange(T, dtype=np.int64) + np.repeat(start - query_start_loc[:-1], num_new)
    block_tables = out.block_tables
    slot_mapping = block_tables[token_seq, positions // block_size].astype(np.int64) * block_size \
        + positions % block_size
    sampled = out.sampled_seqs
    if len(sampled) == S:
        logits_indices = np.arange(S, dtype=np.int64) if T == S else query_start_loc[1:].astype(np.int64) - 1
        sample_seq_ids = seq_ids
    else:
        is_sampled = {id(s) for s in sampled}
        mask = np.fromiter((id(s) in is_sampled for s in seqs), dtype=bool, count=S)
        logits_indices = (query_start_loc[1:][mask] - 1).astype(np.int64)
        sample_seq_ids = seq_ids[mask]
    num_draft = _NO_ROWS
    if out.draft_token_ids:
        num_draft = np.array([len(out.draft_token_ids.get(s.seq_id, ())) for s in sampled], dtype=np.int64)
    plp_rows = plp_targets = _NO_ROWS
    if out.prompt_logprob_spans:
        rows, targets = [], []
        for i, pos, count in out.prompt_logprob_spans:
            first = int(query_start_loc[i]) + pos - out.num_computed_tokens[i]
            rows.extend(range(first, first + count))
            targets.extend(seqs[i].all_token_ids[pos + 1:pos + 1 + count])
        plp_rows = np.array(rows, dtype=np.int64)
        plp_targets = np.array(targets, dtype=np.int64)
    new_seqs = [NewSequence(seq_id=s.seq_id, prompt_token_ids=list(s.request.prompt_token_ids),
                            output_token_ids=s.all_token_ids[s.num_prompt_tokens:],
                            sampling=s.request.worker_sampling, seed=s.seed,
                            eos_token_ids=list(s.request.eos_token_ids), grammar_key=s.request.grammar_key)
                for s in out.new_seqs]
    return StepPlan(
        step_id=out.step_id,
        input_ids=np.array(ids, dtype=np.int64),
        positions=positions,
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens.astype(np.int32),
        block_tables=block_tables,
        seq_ids=seq_ids,
        logits_indices=logits_indices,
        sample_seq_ids=sample_seq_ids,
        new_seqs=new_seqs,
        finished_seq_ids=list(out.finished_seq_ids),
        block_copies=np.asarray(out.block_copies, dtype=np.int64).reshape(-1, 2),
        prompt_logprob_indices=plp_rows,
        prompt_logprob_token_ids=plp_targets,
        num_draft_tokens=num_draft,
    )


class LastSampledTokens:
    """Worker side of overlap scheduling: each live sequence's most recently sampled token.

    ``resolve(plan)`` returns the plan's input ids with every ``PLACEHOLDER_TOKEN_ID`` replaced;
    ``record(plan, tokens)`` keeps what the step sampled; ``forget(seq_ids)`` drops finished
    sequences. Every runner (the model runner, the test and benchmark stand-ins) uses it.

    Raises:
        KeyError (from ``resolve``): a placeholder for a sequence that sampled nothing yet.
    """

    def __init__(self):
        self._last: dict[int, int] = {}

    def resolve(self, plan: StepPlan) -> np.ndarray:
        """The plan's input ids with the placeholders filled (``plan.input_ids`` itself when it
        has none)."""
        ids = plan.input_ids
        holes = np.flatnonzero(np.asarray(ids) < 0)
        if not len(holes):
            return ids
        ids = np.array(ids, dtype=np.int64)
        rows = np.searchsorted(np.asarray(plan.query_start_loc), holes, side="right") - 1
        seq_ids = np.asarray(plan.seq_ids)[rows].tolist()
        last = self._last
        try:
            ids[holes] = [last[s] for s in seq_ids]
        except KeyError as e:
            raise KeyError(f"placeholder input for seq_id {e.args[0]}, which has sampled nothing") from None
        return ids

    def record(self, plan: StepPlan, sampled_token_ids) -> None:
        self._last.update(zip(np.asarray(plan.sample_seq_ids).tolist(),
                              np.asarray(sampled_token_ids).tolist()))

    def forget(self, seq_ids: Iterable[int]) -> None:
        for s in seq_ids:
            self._last.pop(int(s), None)
