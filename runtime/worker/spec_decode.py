"""Speculative decoding on the worker side: verify the proposed tokens of a step in one pass.

A sampled row ``i`` of a ``StepPlan`` with ``d = num_draft_tokens[i] > 0`` drafts owns ``d + 1``
consecutive token rows, ``logits_indices[i] - d .. logits_indices[i]``: its last known token and
its drafts ``x_1 .. x_d`` (their input ids). Row ``j`` of them gives the target's next-token
logits after ``x_1 .. x_j``. All of them are sampled as ordinary rows by the sampler
(``verify_rows`` expands the plan's rows; the row's own temperature, top-k, top-p and min-p),
giving target tokens ``y_0 .. y_d``, and the drafts are accepted while ``x_{j+1} == y_j``
(``accept_greedy``), the first ``a`` of them. The row emits ``x_1 .. x_a, y_a``, which are exactly
``y_0 .. y_a``: ``y_a`` is the target's correction of the first rejected draft, or with every
draft accepted the "bonus" token; the scheduler gives back the ``d - a`` rejected positions.

* Greedy: ``y_j`` is the argmax of row ``j``, so the output is greedy decoding's, token for token.
* Sampling: speculative sampling (Leviathan et al. 2023, algorithm 1; Chen et al. 2023) accepts a
  draft ``x`` proposed with probability ``q(x)`` with probability ``min(1, p(x) / q(x))`` and on
  a rejection samples from ``norm(max(0, p - q))``. An n-gram proposal is deterministic, ``q`` is
  one-hot at ``x``: it is accepted with probability ``p(x)``, and a rejection samples ``p``
  without ``x``, renormalised. Sampling ``y ~ p`` and accepting ``x`` iff ``y == x`` is exactly
  that: ``P(y == x) = p(x)``, and ``y`` given ``y != x`` is ``p`` without ``x``. Each row draws
  its sequence's next uniform, in row order, as the sampler draws one per token; the model runner
  then rewinds the sequence's generator to keep only the ``a + 1`` draws of the tokens emitted.
  So a sequence's tokens are those it would sample one token per step from the same generator:
  its seed gives the same output with and without speculation, in any batch and after a
  preemption (the logits of a verifying row are the decode's up to float32 rounding).

Vectorised over the rows of the step; no Python loop over tokens.
"""

from __future__ import annotations

import numpy as np


def verify_rows(logits_indices: np.ndarray, num_draft_tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The token rows whose logits a step with drafts samples.

    Args:
        logits_indices: ``[R]`` int64, each sampled row's last token row.
        num_draft_tokens: ``[R]`` int64 drafts per row (``d_i``).
    Returns:
        ``rows [N]`` int64 (``N = sum(d_i + 1)``): row ``i``'s ``d_i + 1`` rows in order, rows in
        order; ``starts [R + 1]`` int64 offsets of each row's block in ``rows``.
    """
    li = np.asarray(logits_indices, dtype=np.int64)
    nd = np.asarray(num_draft_tokens, dtype=np.int64)
    counts = nd + 1
    starts = np.zeros(len(li) + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    owner = np.repeat(np.arange(len(li)), counts)
    # within a block: offsets -d .. 0 from the last row
    rows = li[owner] - nd[owner] + (np.arange(starts[-1]) - starts[owner])
    return rows, starts


def accept_greedy(targets: np.ndarray, input_ids: np.ndarray, rows: np.ndarray, starts: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Greedy verification of every row of a step (see the module docstring).

    Args:
        targets: ``[N]`` int64 the token sampled at each of ``rows`` (argmax for greedy rows).
        input_ids: ``[T]`` int64 the step's input ids (the drafts are those of the rows after
            each block's first).
        rows, starts: from ``verify_rows``.
    Returns:
        ``num_accepted [R]`` int64 drafts accepted per row; ``tokens [R]`` int64 the token after
        them (``y_a``); ``emitted [sum(num_accepted + 1)]`` int64 indices into ``targets`` of the
        tokens each row emits, in order (its ``y_0 .. y_a``, to gather logprob rows).
    """
    targets = np.asarray(targets, dtype=np.int64)
    R = len(starts) - 1
    counts = np.diff(starts)
    nd = counts - 1
    width = int(nd.max()) if R else 0
    # match[i, j]: draft j + 1 of row i equals the target after j drafts (False past d_i, and in a
    # last column that ends every row)
    match = np.zeros((R, width + 1), dtype=bool)
    owner = np.repeat(np.arange(R), nd)
    col = np.arange(int(nd.sum())) - (starts[:-1] - np.arange(R))[owner]  # j within the row
    flat = np.flatnonzero(np.arange(len(rows)) != np.repeat(starts[1:] - 1, counts))  # all but each last
    drafts = np.asarray(input_ids, dtype=np.int64)[rows[flat] + 1]
    match[owner, col] = drafts == targets[flat]
    num_accepted = np.argmin(match, axis=1).astype(np.int64)
    tokens = targets[starts[:-1] + num_accepted]
    n_emit = num_accepted + 1
    owner_e = np.repeat(np.arange(R), n_emit)
    first_e = np.cumsum(n_emit) - n_emit
    emitted = starts[:-1][owner_e] + np.arange(int(n_emit.sum())) - first_e[owner_e]
    return num_accepted, tokens, emitted.astype(np.int64)
