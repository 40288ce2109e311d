"""The step contract between the scheduler and the model runner (worker).

One engine step: the scheduler builds a ``StepPlan``; the worker runs the forward pass and the
sampler over it and answers with a ``StepResult``. The worker never sees a request object and never
decides what runs; the scheduler never touches device memory. In-process this is a direct call;
``ipc/`` puts a process boundary at exactly this seam (arrays travel as raw bytes, dtype, shape).

Sequences are named by integer ``seq_id`` (a request with ``n > 1`` has ``n`` sequences).
Sampling state (parameters, prompt ids, the per-sequence RNG, generated ids for penalties) lives
on the worker from the step that first schedules the sequence (``new_seqs``) until
``finished_seq_ids`` names it; the worker appends every token it samples to the sequence's history.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class NewSequence:
    """Sampling state of a sequence, sent once, in the first plan that schedules it.

    Attributes:
        seq_id: engine-wide unique id of the sequence.
        prompt_token_ids: the prompt (repetition_penalty counts prompt tokens, as vLLM does).
        output_token_ids: tokens already generated (non-empty only when a forked sequence or a
            restored one is introduced mid-generation).
        sampling: the request's ``SamplingParams`` as a plain dict (see runtime/sampling_params.py).
        seed: the RNG seed of this sequence, or ``None`` for the engine's unseeded stream. For a
            request with ``seed`` and ``n > 1``, sample ``i`` gets a distinct derived seed.
        eos_token_ids: ids that end generation (masked while fewer than min_tokens are out,
            unless ignore_eos).
    """

    seq_id: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling: dict
    seed: int | None
    eos_token_ids: list[int]


@dataclass
class StepPlan:
    """What the worker runs in one step (shapes: T tokens, S sequences, R sampled rows).

    Attributes:
        step_id: increasing step number; the result echoes it.
        input_ids: ``[T]`` int64 token ids, sequences laid end to end.
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
        logprob_token_ids: ``[R, 1 + K]`` int64 matching ``logprobs`` (column 0 = sampled id).
        forward_time: seconds spent in the forward pass.
        sample_time: seconds spent sampling.
        error: a message when the step failed on the worker (then the other fields are empty).
    """

    step_id: int
    sampled_token_ids: np.ndarray
    logprobs: np.ndarray | None = None
    logprob_token_ids: np.ndarray | None = None
    forward_time: float = 0.0
    sample_time: float = 0.0
    error: str | None = None
