"""Worker-side sampler: logits of a batch -> one token per row, vectorised over the batch.

The pipeline follows vLLM V1's sampler (``vllm/v1/sample/sampler.py`` and its ``ops``), in order:

1. raw logprobs (log-softmax of the model's output, before any processing; vLLM's default
   ``logprobs_mode="raw_logprobs"``), only when some row asked for logprobs;
2. structured outputs: tokens the row's grammar does not allow next get -inf (``bitmask``, one bit
   per token, filled by the row's matcher: runtime/worker/grammar_matchers.py);
   min_tokens: EOS (unless ignore_eos) and ``stop_token_ids`` get -inf while fewer than
   ``min_tokens`` tokens are out (unless the grammar allows nothing else: the grammar wins);
3. penalties: repetition (CTRL, Keskar et al. 2019) over prompt + output tokens: positive logits
   divided by it, negative ones multiplied; frequency (per occurrence) and presence (once) over the
   output tokens, subtracted (OpenAI API semantics);
4. greedy rows (temperature 0): argmax;
5. random rows: temperature, min_p (Nguyen et al. 2024), top_k, then top_p (Holtzman et al. 2020,
   over the top-k renormalised distribution), then inverse-CDF sampling with ONE uniform per row
   drawn from that sequence's own ``numpy.random.Generator``.

On the CUDA table (``sample_on_device``) a row with temperature only (no top-k, top-p or min-p)
is sampled in one pass instead, by the Gumbel-max trick with noise keyed by the same uniform
(kernels/reference.py ``sample_gumbel``): the same distribution and the same reproducibility (the
row's draw depends on its logits and its generator only), but not the token the CPU's inverse CDF
picks from that uniform.

Every array operation goes through the array module ``xp`` (numpy or cupy); only the per-row
parameter vectors and the uniforms are built on the host. A row's result depends only on its own
logits, parameters and generator, so a seeded sequence samples the same tokens alone, in any batch,
and after a preemption (its generator advances once per token it samples, and a restored sequence
fast-forwards by the tokens it already has).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from ...kernels import reference, to_numpy
from ...kernels.table import CudaKernelTable
from ..common.sampling_params import SamplingParams

_MASK = -np.inf


def make_rng(seed: int | None, engine_seed: int, seq_id: int) -> np.random.Generator:
    """The random stream of one sequence.

    Args:
        seed: the sequence's seed (``default_rng(seed)``), or ``None`` for an unseeded sequence,
            whose stream is seeded from ``(engine_seed, seq_id)``.
    """
    if seed is not None:
        return np.random.default_rng(int(seed) % (1 << 64))
    return np.random.default_rng([int(engine_seed) % (1 << 64), int(seq_id) % (1 << 64)])


class SamplingState:
    """What the worker keeps for one sequence between steps (created from a ``NewSequence``).

    Attributes:
        seq_id: the sequence.
        params: its ``SamplingParams``.
        prompt_token_ids: ``[P]`` int64.
        eos_token_ids: ids masked while fewer than ``min_tokens`` are out.
        rng: the sequence's generator. If ``output_token_ids`` is non-empty (a restored or forked
            sequence) and the sequence samples randomly, it is advanced by one draw per token
            already generated, so the stream continues where it would have been.
    """

    def __init__(self, seq_id: int, params: SamplingParams, prompt_token_ids, output_token_ids,
                 seed: int | None, eos_token_ids, engine_seed: int = 0):
        self.seq_id = int(seq_id)
        self.params = params
        self.prompt_token_ids = np.asarray(prompt_token_ids, dtype=np.int64).reshape(-1)
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        out = np.asarray(output_token_ids, dtype=np.int64).reshape(-1)
        self._out = np.zeros(max(16, 2 * len(out)), dtype=np.int64)
        self._out[: len(out)] = out
        self._num_out = len(out)
        self.rng = make_rng(seed, engine_seed, seq_id)
        self.matcher = None  # the grammar matcher of a constrained sequence (grammar_matchers.py)
        self.grammar_vocab = 0
        if self._num_out and not params.greedy:
            self.rng.random(self._num_out)  # fast-forward: one uniform per token already sampled
        # what every step reads, fixed for the sequence's life (sampling_arrays, penalty_entries)
        self.device_params = (0.0, 0.0, 0.0, 0.0) if params.greedy else \
            (params.temperature, max(params.top_k, 0), params.top_p, params.min_p)
        self.has_penalties = params.has_penalties
        self.min_tokens = params.min_tokens
        self.logprobs = params.logprobs

    @property
    def output_token_ids(self) -> np.ndarray:
        """``[O]`` int64 view of the tokens generated so far."""
        return self._out[: self._num_out]

    @property
    def num_output_tokens(self) -> int:
        return self._num_out

    def append(self, token_id: int) -> None:
        if self._num_out == len(self._out):
            self._out = np.concatenate([self._out, np.zeros_like(self._out)])
        self._out[self._num_out] = token_id
        self._num_out += 1


@dataclass
class SamplerOutput:
    """Host (numpy) results for R rows.

    Attributes:
        token_ids: ``[R]`` int64 sampled ids.
        logprobs: ``[R, 1 + K]`` float32 or ``None``: column 0 the sampled token's raw logprob,
            columns 1.. the top-K raw logprobs in descending order (K = the largest ``logprobs``
            asked for by any row; rows that asked for fewer use a prefix).
        logprob_token_ids: ``[R, 1 + K]`` int64 ids matching ``logprobs``.
    """

    token_ids: np.ndarray
    logprobs: np.ndarray | None = None
    logprob_token_ids: np.ndarray | None = None


def log_softmax(x, xp=np):
    """Row-wise log-softmax of ``[R, V]`` float32, max-subtracted for stability."""
    m = x.max(axis=1, keepdims=True)
    z = x - m
    return z - xp.log(xp.exp(z).sum(axis=1, keepdims=True))


def _flat_index(arrays: list[np.ndarray], V: int) -> np.ndarray:
    """Concatenate per-row id arrays into indices of a flattened ``[len(arrays), V]`` matrix."""
    lens = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
    if lens.sum() == 0:
        return np.zeros(0, dtype=np.int64)
    rows = np.repeat(np.arange(len(arrays), dtype=np.int64), lens)
    return rows * V + np.concatenate(arrays).astype(np.int64)


def apply_penalties(logits, prompt_ids: list[np.ndarray], output_ids: list[np.ndarray],
                    repetition, frequency, presence, xp=np):
    """Penalised copy of ``logits [R, V]`` float32 (vLLM's ``apply_penalties`` semantics).

    Only the (row, token) pairs present in a row's history change, so the work is sparse: the
    histories are flattened to indices ``row * V + token`` and counted with one ``unique``
    (no dense ``[R, V]`` count matrix, no Python loop over the vocabulary).

    Args:
        prompt_ids, output_ids: per row, the prompt's and the generated token ids (int64).
        repetition, frequency, presence: ``[R]`` float32 xp arrays.
    """
    R, V = logits.shape
    flat = logits.astype(xp.float32, copy=True).reshape(-1)
    out_idx, out_counts = xp.unique(xp.asarray(_flat_index(output_ids, V)), return_counts=True)
    seen = xp.unique(xp.concatenate([xp.asarray(_flat_index(prompt_ids, V)), out_idx]))
    if seen.size:
        rep = repetition[seen // V]
        v = flat[seen]
        flat[seen] = xp.where(v > 0, v / rep, v * rep)
    if out_idx.size:
        row = out_idx // V
        flat[out_idx] -= frequency[row] * out_counts.astype(xp.float32) + presence[row]
    return flat.reshape(R, V)


# top-k / top-p look at this many of the largest logits first (an O(V) partition instead of a sort
# of the whole vocabulary); rows whose nucleus is not inside them fall back to a full sort
TOP_CANDIDATES = 1024


def _top_k_top_p_threshold(logits, top_k: np.ndarray, top_p: np.ndarray, xp=np,
                           candidates: int | None = None):
    """Per row, the smallest logit kept by top-k then top-p (``[R, 1]``); ties are kept.

    ``top_k`` ``[R]`` int (<= 0 = off), ``top_p`` ``[R]`` float (1 = off). Top-p acts on the
    top-k renormalised distribution (vLLM's order).
    """
    R, V = logits.shape
    kk = np.where(top_k > 0, np.minimum(top_k, V), V)
    top_p = np.where(top_p >= 1.0, np.inf, top_p).astype(np.float32)  # off: rounding must not cut
    candidates = TOP_CANDIDATES if candidates is None else candidates
    M = min(V, max(candidates, int(kk[kk < V].max()) if (kk < V).any() else 0))
    if M < V:
        s = -xp.sort(-xp.partition(logits, V - M, axis=1)[:, V - M:], axis=1)  # top M, descending
    else:
        s = -xp.sort(-logits, axis=1)
    col = xp.arange(M)[None, :]
    k = xp.asarray(np.minimum(kk, M))[:, None]
    s = xp.where(col < k, s, xp.float32(_MASK))
    # normaliser: over the top-k set when top-k is on (it lies inside the candidates), else the row
    m = logits.max(axis=1, keepdims=True)
    full = m + xp.log(xp.exp(logits - m).sum(axis=1, keepdims=True))
    part = s[:, :1] + xp.log(xp.exp(s - s[:, :1]).sum(axis=1, keepdims=True))
    lse = xp.where(xp.asarray(kk < V)[:, None], part, full)
    p = xp.exp(s - lse)
    cum = xp.cumsum(p, axis=1)
    tp = xp.asarray(top_p)[:, None]
    keep = ((cum - p) < tp) & (col < k)
    keep[:, 0] = True
    last = keep.sum(axis=1) - 1  # kept entries form a prefix of the sorted row
    thresh = xp.take_along_axis(s, last[:, None], axis=1)
    if M < V:
        # top-k off and the candidates' mass below top_p: the cut lies further down
        short = np.nonzero(to_numpy((xp.asarray(kk >= V)[:, None] & (cum[:, -1:] < tp))[:, 0]))[0]
        if len(short):
            idx = xp.asarray(short)
            thresh[idx] = _top_k_top_p_threshold(logits[idx], top_k[short], top_p[short], xp, candidates=V)
    return thresh


def apply_token_bitmask(logits, bitmask, xp=np):
    """``logits`` ``[R, V]`` float32 with -inf wherever ``bitmask`` ``[R, ceil(V / 32)]`` int32 has
    the token's bit clear (bit ``t % 32`` of word ``t // 32``; llguidance's and xgrammar's layout):
    ``reference.apply_token_bitmask`` for NumPy, else one vectorised gather and shift over ``[R, V]``;
    no loop over the vocabulary. Returns a new array (``logits`` is not written)."""
    if xp is np:
        return reference.apply_token_bitmask(logits, bitmask)
    V = logits.shape[1]
    cols = xp.arange(V)
    words = xp.asarray(bitmask)[:, cols >> 5]
    allowed = ((words >> (cols & 31).astype(xp.int32)) & 1).astype(bool)
    return xp.where(allowed, logits, xp.float32(_MASK))


def sample(logits, states: list[SamplingState], xp=np, bitmask=None, bitmask_kernel=None) -> SamplerOutput:
    """Sample one token for each row of ``logits`` (the pipeline of the module docstring).

    Args:
        logits: ``[R, V]`` float32 xp array (the model's output for the rows to sample).
        states: ``R`` sampling states, row ``i`` belongs to ``states[i]`` (a sequence appears once).
        xp: numpy or cupy (the module of ``logits``).
        bitmask: ``[R, ceil(V / 32)]`` int32 host array of the tokens each row may sample
            (``fill_batch_bitmask``; unconstrained rows all ones), or ``None``.
        bitmask_kernel: a kernel table's ``apply_token_bitmask`` (in place on a float32 copy),
            used instead of the array-module version when given (the model runner's).

    Returns:
        ``SamplerOutput`` with host arrays. The caller appends the tokens to the states.
    """
    R, V = logits.shape
    if R == 0:
        return SamplerOutput(np.zeros(0, dtype=np.int64))
    K = max_logprobs(states)
    raw_lp = log_softmax(logits.astype(xp.float32), xp) if K is not None else None
    if bitmask is not None:
        if bitmask_kernel is not None:
            logits = bitmask_kernel(logits.astype(xp.float32, copy=True), xp.asarray(bitmask))
        else:
            logits = apply_token_bitmask(logits.astype(xp.float32), bitmask, xp)
    logits = _mask_min_tokens(logits, states, xp, grammar=bitmask is not None)
    logits = _penalised(logits, states, xp)

    tokens = xp.zeros(R, dtype=xp.int64)
    greedy = np.asarray([s.params.greedy for s in states])
    if greedy.any():
        g_idx = xp.asarray(np.nonzero(greedy)[0])
        tokens[g_idx] = xp.argmax(logits[g_idx], axis=1).astype(xp.int64)
    rand = np.nonzero(~greedy)[0]
    if len(rand):
        tokens[xp.asarray(rand)] = _sample_random(logits[xp.asarray(rand)], [states[i] for i in rand], xp)

    out = SamplerOutput(to_numpy(tokens).astype(np.int64))
    if raw_lp is not None:
        out.logprobs, out.logprob_token_ids = _with_top_logprobs(raw_lp, tokens, K, xp)
    return out


def _mask_min_tokens(logits, states: list[SamplingState], xp, grammar: bool):
    """``logits [R, V]`` with EOS (unless ignore_eos) and ``stop_token_ids`` at -inf in the rows
    with fewer than ``min_tokens`` tokens out: a float32 copy where any row is masked, else
    ``logits`` itself. With ``grammar`` (``logits`` already grammar-masked), a row left with no
    token at all gets its grammar-masked row back: the grammar wins."""
    V = logits.shape[1]
    rows, cols = [], []
    for i, st in enumerate(states):
        p = st.params
        if st.num_output_tokens < p.min_tokens:
            ids = list(p.stop_token_ids) + ([] if p.ignore_eos else st.eos_token_ids)
            ids = [t for t in ids if 0 <= t < V]
            rows += [i] * len(ids)
            cols += ids
    if not rows:
        return logits
    masked = logits.astype(xp.float32, copy=True)
    masked[xp.asarray(rows), xp.asarray(cols)] = _MASK
    if grammar:
        dead = xp.isneginf(masked).all(axis=1)
        if bool(dead.any()):
            masked[dead] = logits[dead]
    return masked


def _penalised(logits, states: list[SamplingState], xp):
    """``logits [R, V]`` with each penalised row through ``apply_penalties`` (a float32 copy), or
    ``logits`` itself when no row has penalties."""
    pen = [i for i, st in enumerate(states) if st.params.has_penalties]
    if not pen:
        return logits
    pen_idx = xp.asarray(np.asarray(pen, dtype=np.int64))
    params = [states[i].params for i in pen]

    def f32(name):
        return xp.asarray(np.asarray([getattr(p, name) for p in params], dtype=np.float32))

    penalised = apply_penalties(logits[pen_idx], [states[i].prompt_token_ids for i in pen],
                                [states[i].output_token_ids for i in pen], f32("repetition_penalty"),
                                f32("frequency_penalty"), f32("presence_penalty"), xp)
    logits = logits.astype(xp.float32, copy=True)
    logits[pen_idx] = penalised
    return logits


def _sample_random(logits, states: list[SamplingState], xp):
    """``[r]`` int64 xp tokens of the random rows ``logits [r, V]`` (``states`` theirs, in order):
    temperature, min_p, top_k then top_p, then the inverse CDF at one uniform in (0, 1] per row
    from the sequence's own generator."""
    V = logits.shape[1]
    rp = [st.params for st in states]
    temp = np.asarray([p.temperature for p in rp], dtype=np.float32)
    x = logits.astype(xp.float32) / xp.asarray(temp)[:, None]
    min_p = np.asarray([p.min_p for p in rp], dtype=np.float32)
    if (min_p > 0).any():
        ratio = xp.exp(x - x.max(axis=1, keepdims=True))  # p / p_max
        x = xp.where(ratio < xp.asarray(min_p)[:, None], xp.float32(_MASK), x)
    top_k = np.asarray([p.top_k for p in rp], dtype=np.int64)
    top_p = np.asarray([p.top_p for p in rp], dtype=np.float32)
    trunc = np.nonzero((top_k > 0) | (top_p < 1.0))[0]
    if len(trunc):
        t_idx = xp.asarray(trunc)
        sub = x[t_idx]
        thresh = _top_k_top_p_threshold(sub, top_k[trunc], top_p[trunc], xp)
        x[t_idx] = xp.where(sub < thresh, xp.float32(_MASK), sub)
    u = np.asarray([1.0 - st.rng.random() for st in states], dtype=np.float64)
    w = xp.exp(x - x.max(axis=1, keepdims=True))
    cdf = xp.cumsum(w, axis=1)
    target = xp.asarray(u)[:, None] * cdf[:, -1:]
    picked = (cdf < target).sum(axis=1)
    return xp.minimum(picked, V - 1).astype(xp.int64)


def _with_top_logprobs(raw_lp, first_ids, K: int, xp=np) -> tuple[np.ndarray, np.ndarray]:
    """Host ``([R, 1 + K] float32, [R, 1 + K] int64)``: column 0 the logprob of ``first_ids``
    ``[R]`` (xp int64) in ``raw_lp [R, V]``, columns 1.. the top ``K`` (descending; equal values
    in id order on the host)."""
    R, V = raw_lp.shape
    first_lp = xp.take_along_axis(raw_lp, first_ids[:, None], axis=1)
    if K > 0:
        top = xp.argpartition(-raw_lp, K - 1, axis=1)[:, :K] if K < V else \
            xp.broadcast_to(xp.arange(V), (R, V)).copy()
        top_lp = xp.take_along_axis(raw_lp, top, axis=1)
        order = xp.argsort(-top_lp, axis=1, kind="stable") if xp is np else \
            xp.argsort(-top_lp, axis=1)
        top = xp.take_along_axis(top, order, axis=1)
        top_lp = xp.take_along_axis(top_lp, order, axis=1)
        lp = xp.concatenate([first_lp, top_lp], axis=1)
        ids = xp.concatenate([first_ids[:, None], top], axis=1)
    else:
        lp, ids = first_lp, first_ids[:, None]
    return to_numpy(lp).astype(np.float32), to_numpy(ids).astype(np.int64)


# prompt logprob rows are reduced this many at a time (bounds the [rows, V] temporaries)
PROMPT_LOGPROB_CHUNK = 256


def prompt_logprobs(logits, target_ids: np.ndarray, K: int, xp=np):
    """Prompt logprobs (vLLM's ``prompt_logprobs``) of ``N`` prompt positions.

    Args:
        logits: ``[N, V]`` float32 xp array, the logits at each position.
        target_ids: ``[N]`` int64 host array, the prompt token following each position.
        K: how many top logprobs per row (>= 0).
    Returns:
        host arrays ``(logprobs [N, 1 + K] float32, ids [N, 1 + K] int64, ranks [N] int64)``:
        column 0 the target's raw logprob (log-softmax of the logits, before any sampling
        processing), columns 1.. the top ``K``; ``ranks`` the target's 1-based rank (1 + the
        number of tokens with a strictly larger logprob).
    """
    N = int(logits.shape[0])
    lps, ids, ranks = [], [], []
    for a in range(0, N, PROMPT_LOGPROB_CHUNK):
        raw = log_softmax(logits[a:a + PROMPT_LOGPROB_CHUNK].astype(xp.float32), xp)
        tgt = xp.asarray(np.asarray(target_ids[a:a + PROMPT_LOGPROB_CHUNK], dtype=np.int64))
        lp, top = _with_top_logprobs(raw, tgt, K, xp)
        ranks.append(to_numpy((raw > xp.asarray(lp[:, :1])).sum(axis=1) + 1).astype(np.int64))
        lps.append(lp)
        ids.append(top)
    if not N:
        return np.zeros((0, 1 + K), np.float32), np.zeros((0, 1 + K), np.int64), np.zeros(0, np.int64)
    return np.concatenate(lps), np.concatenate(ids), np.concatenate(ranks)


# ---- the device path: the same semantics as sample(), run by the CUDA table's sampling kernels ----

def sampling_arrays(states: list[SamplingState]) -> tuple[np.ndarray, np.ndarray]:
    """Per-row inputs of the device sampler, built on the host before the step's single upload.

    Returns:
        ``params [R, 4]`` float32 rows ``(temperature, top_k, top_p, min_p)`` (temperature 0 for
        greedy rows, top_k 0 = off), and ``uniforms [R]`` float64 in (0, 1]: one draw from each
        random row's generator, in row order, exactly as ``sample`` draws them (greedy rows draw
        nothing and get 1.0).
    """
    R = len(states)
    params = np.array([st.device_params for st in states], dtype=np.float32).reshape(R, 4)
    uniforms = np.ones(R, dtype=np.float64)
    rand = params[:, 0] > 0  # greedy rows have temperature 0 here
    if rand.any():  # one draw per random row, in row order
        uniforms[rand] = [1.0 - st.rng.random() for st in itertools.compress(states, rand.tolist())]
    return params, uniforms


def penalty_entries(states: list[SamplingState], V: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The sparse work of penalties and min_tokens masks for the device kernel, or ``None``.

    Vectorised over the batch (a handful of NumPy calls per step, whatever the number of rows).

    Returns:
        ``entries [N, 3]`` int64 rows ``(row * V + token, count in the row's output, flags)``, one
        per (row, token) (flags 1: mask to -inf for min_tokens, 2: seen in prompt or output), and
        ``row_params [R, 3]`` float32 ``(repetition, frequency, presence)``. Same semantics as
        ``sample``'s min_tokens mask followed by ``apply_penalties``.
    """
    R = len(states)
    pen = [i for i, st in enumerate(states) if st.has_penalties]
    mask_rows = [i for i, st in enumerate(states) if st.num_output_tokens < st.min_tokens]
    if not pen and not mask_rows:  # the common step: nothing to do, no array built
        return None
    row_params = np.zeros((R, 3), dtype=np.float32)
    row_params[:, 0] = 1.0

    def flat(rows, arrays):
        if not rows:
            return np.zeros(0, np.int64)
        lens = [len(a) for a in arrays]
        tok = np.concatenate(arrays).astype(np.int64) if sum(lens) else np.zeros(0, np.int64)
        idx = np.repeat(np.asarray(rows, dtype=np.int64), lens) * V + tok
        return idx[(tok >= 0) & (tok < V)]

    for i in pen:
        p = states[i].params
        row_params[i] = (p.repetition_penalty, p.frequency_penalty, p.presence_penalty)
    mask_ids = []
    for i in mask_rows:
        st = states[i]
        p = st.params
        mask_ids.append(np.asarray(list(p.stop_token_ids) + ([] if p.ignore_eos else st.eos_token_ids),
                                   dtype=np.int64))
    out_idx, out_cnt = np.unique(flat(pen, [states[i].output_token_ids for i in pen]), return_counts=True)
    seen = np.union1d(flat(pen, [states[i].prompt_token_ids for i in pen]), out_idx)
    masked = np.unique(flat(mask_rows, mask_ids))
    if not len(seen) and not len(masked):
        return None
    counts = np.zeros(len(seen), np.int64)
    counts[np.searchsorted(seen, out_idx)] = out_cnt
    flags = np.full(len(seen), 2, np.int64)
    flags[np.isin(seen, masked)] |= 1
    extra = np.setdiff1d(masked, seen)
    entries = np.stack([np.concatenate([seen, extra]), np.concatenate([counts, np.zeros(len(extra), np.int64)]),
                        np.concatenate([flags, np.ones(len(extra), np.int64)])], axis=1)
    return np.ascontiguousarray(entries, dtype=np.int64), row_params


def max_logprobs(states: list[SamplingState]) -> int | None:
    """The largest ``logprobs`` any row asks for, or ``None`` when none does."""
    want = [s.logprobs for s in states if s.logprobs is not None]
    return max(want) if want else None


def sample_on_device(kernels: CudaKernelTable, logits, params, uniforms, penalties, K: int | None, tokens_out, lp_out=None,
                     ids_out=None) -> None:
    """``sample``'s pipeline on the device, writing into preallocated outputs (no host sync).

    Args:
        kernels: a ``CudaKernelTable`` (``sample``, ``apply_penalties``, ``xp``).
        logits: ``[R, V]`` float32 device array; penalties are applied to it in place.
        params, uniforms: from ``sampling_arrays`` (device views); penalties: ``(entries,
            row_params, num_entries)`` device views or ``None``.
        K: ``max_logprobs(states)``; with ``lp_out [R, 1 + K]`` float32 and ``ids_out [R, 1 + K]``
            int64 the raw logprobs (sampled token first, then the top K) are written there.
        tokens_out: ``[R]`` int64.
    """
    xp = kernels.xp
    R, V = logits.shape
    raw = None
    if K is not None:
        raw = log_softmax(logits, xp)  # raw logprobs: before any processing
    if penalties is not None:
        kernels.apply_penalties(logits, *penalties)
    kernels.sample(logits, params, uniforms, out=tokens_out)
    if raw is not None:
        lp_out[:, 0] = xp.take_along_axis(raw, tokens_out[:, None], axis=1)[:, 0]
        ids_out[:, 0] = tokens_out
        if K > 0:
            top = xp.argpartition(-raw, K - 1, axis=1)[:, :K] if K < V else xp.broadcast_to(xp.arange(V), (R, V))
            top_lp = xp.take_along_axis(raw, top, axis=1)
            order = xp.argsort(-top_lp, axis=1, kind="stable") if xp is np else xp.argsort(-top_lp, axis=1)
            ids_out[:, 1:] = xp.take_along_axis(top, order, axis=1)
            lp_out[:, 1:] = xp.take_along_axis(top_lp, order, axis=1)
