"""Prompt logprobs on the scheduler side: which rows of a step give a request's prompt logprobs.

A request with ``SamplingParams.prompt_logprobs`` wants, for each prompt position ``p`` but the
last, the logprob of prompt token ``p + 1`` under the logits of position ``p`` (vLLM's
``prompt_logprobs``; the first prompt token has none). Those logits exist only in the step that
computes position ``p``, so the scheduler's collaborator ``PromptLogprobsTracker`` lists, as each
step is scheduled, the rows that give positions not yet covered (``Request.prompt_logprobs_next``
is the first such position, -1 once none is left), hands them to the output processor with the
step's result, and puts them back when a step fails. A request that wants them reads nothing from
the prefix cache until they are all computed (``KVCacheManager.get_computed_blocks``).
"""

from __future__ import annotations


class PromptLogprobsTracker:
    """The scheduler's prompt-logprobs collaborator (see the module docstring). Stateless: each
    request's progress is its ``prompt_logprobs_next``."""

    def schedule(self, out, seq, start: int, num_new: int) -> None:
        """At scheduling: list the rows of ``seq``'s tokens ``start .. start + num_new - 1`` (the
        sequence being at batch index ``len(out.seqs) - 1``) whose logits give a prompt logprob not
        yet scheduled, as ``out.prompt_logprob_spans`` entries ``(i, position, count)``. Called
        only for a request with ``prompt_logprobs_next >= 0``."""
        request = seq.request
        last = len(request.prompt_token_ids) - 1
        end = min(start + num_new, last)
        first = max(start, request.prompt_logprobs_next)
        if end > first:
            out.prompt_logprob_spans.append((len(out.seqs) - 1, first, end - first))
            request.prompt_logprobs_next = end if end < last else -1

    @staticmethod
    def update_from_output(out) -> list:
        """After the step: its spans as ``(request, position, count)``, in result order
        (``StepResult.prompt_logprobs``)."""
        return [(out.seqs[i].request, pos, count) for i, pos, count in out.prompt_logprob_spans]

    @staticmethod
    def rollback(out) -> None:
        """A step whose result will never come: its prompt positions are to be scheduled again."""
        for i, pos, _ in out.prompt_logprob_spans:
            request = out.seqs[i].request
            nxt = request.prompt_logprobs_next
            request.prompt_logprobs_next = pos if nxt < 0 else min(nxt, pos)
