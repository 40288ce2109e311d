"""An independent beam search over a function giving each prefix's next-token logprobs.

Written from the algorithm's statement (issue 11, vLLM's ``LLM.beam_search``), not from
``runtime/scheduler/beam_search.py``: plain lists, one prefix at a time, the logprobs of every prefix
recomputed from scratch by ``logprob_fn`` (for the model: a full prefill, no KV cache reused).

Besides the result it returns every *decision gap*: how far each choice that shaped the result
was from going the other way, with the error it tolerates. A test comparing an engine that
computes the same logprobs with a different rounding (``delta`` per logprob) first checks that
each gap exceeds its tolerance; only then is exact agreement a fair expectation.
"""

from __future__ import annotations

import math

import numpy as np


def score(length: int, cum: float, length_penalty: float) -> float:
    return cum / max(length, 1) ** length_penalty


def reference_beam_search(logprob_fn, prompt: list[int], params, eos_ids, delta: float = 0.0):
    """Beam search as issue 11 states it.

    Args:
        logprob_fn: ``list of prefixes (list[int]) -> list of [V]`` float logprobs of the token
            after each prefix (one call per step, for every live beam: a batch).
        prompt: the prompt's token ids.
        params: a ``BeamSearchParams`` (beam_width, max_tokens, ignore_eos, length_penalty,
            include_stop_str_in_output; temperature must be 0).
        eos_ids: ids that finish a beam unless ``ignore_eos``.
        delta: the largest error of one logprob in the engine being compared.
    Returns:
        ``(sequences, gaps)``: ``sequences`` best first as ``(token_ids, cum_logprob,
        finish_reason)``; ``gaps`` a list of ``(gap, tolerance, what)`` for every decision.
    """
    assert params.temperature == 0
    width, k2 = params.beam_width, 2 * params.beam_width
    eos = set() if params.ignore_eos else {int(t) for t in eos_ids}
    live = [([], 0.0)]                      # (generated ids, cumulative logprob), best first
    finished = []                           # (reported ids, cum, reason, length for the penalty)
    gaps = []
    for step in range(params.max_tokens):
        terms = step + 1                    # logprobs summed in each candidate's cum
        cands = []                          # (cum, parent rank, token)
        cuts = []                           # per parent: (gap at its 2k cut, the two tokens, cum at the cut)
        rows = logprob_fn([list(prompt) + toks for toks, _ in live])
        for rank, (toks, cum) in enumerate(live):
            lp = np.asarray(rows[rank], dtype=np.float64)
            order = np.argsort(-lp, kind="stable")
            for t in order[:k2].tolist():
                c = cum + float(lp[t])
                if t in eos:
                    finished.append((toks + [t] if params.include_stop_str_in_output else list(toks), c, "stop",
                                     len(toks)))
                else:
                    cands.append((c, rank, t))
            if len(order) > k2:
                a, b = int(order[k2 - 1]), int(order[k2])
                cuts.append((float(lp[a] - lp[b]), (a, b), cum + float(lp[a])))
        cands.sort(key=lambda x: (-x[0], x[1], x[2]))
        boundary = cands[width - 1][0] if len(cands) >= width else -math.inf
        if len(cands) > width:
            gaps.append((cands[width - 1][0] - cands[width][0], 4 * delta * terms, f"step {step} selection"))
        for gap, (a, b), c_cut in cuts:
            # the token just inside and just outside a parent's 2k candidates matter only if one
            # is EOS or the one inside could be among the survivors
            if a in eos or b in eos or c_cut >= boundary - 4 * delta * terms:
                gaps.append((gap, 4 * delta, f"step {step} top-{k2} cut"))
        live = [(live[rank][0] + [t], c) for c, rank, t in cands[:width]]
        if not live:
            break
    finished += [(list(toks), cum, "length", len(toks)) for toks, cum in live]
    lp_ = params.length_penalty
    ranked = sorted(finished, key=lambda h: -score(h[3], h[1], lp_))

    def err(h):
        return 2 * delta * (h[3] + (h[2] == "stop")) / max(h[3], 1) ** lp_

    for h1, h2 in zip(ranked[:width], ranked[1:width + 1]):
        gaps.append((score(h1[3], h1[1], lp_) - score(h2[3], h2[1], lp_), err(h1) + err(h2), "final ranking"))
    return [(h[0], h[1], h[2]) for h in ranked[:width]], gaps
