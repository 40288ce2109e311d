"""A stand-in runner for ipc tests and engine benchmarks: the worker machinery without a model.

``EchoRunner`` answers each sampled row with (last input token + 1), a placeholder input being the
token the sequence sampled in the step before (overlap scheduling). Its keyword arguments tune it:
``num_blocks`` (default 64), ``step_s`` (simulated forward seconds), ``fail_init`` (raise at start),
``echo_period`` (benchmarks: answers wrap into ``[1000, 1000 + echo_period)``, so the vocabulary a
long run sees is bounded as a model's is, instead of a new id every step). A worker process builds
it from the config alone (``ZmqExecutor(..., runner="ipc_fake_runner:EchoRunner")``, ``folio
serve``): there the environment variables FOLIO_ECHO_NUM_BLOCKS, FOLIO_ECHO_STEP_S,
FOLIO_ECHO_FAIL_INIT and FOLIO_ECHO_PERIOD give the same settings (pass them in the executor's
``env``). FOLIO_ECHO_INIT_S makes start-up take that many seconds (as loading a model does).
Rows that ask for logprobs (beam search asks for ``2 * beam_width``) or prompt logprobs get made-up
ones from ``echo_logprobs``, a function of the row's last input token alone. A plan's grammar
compiles are compiled for real (the worker's ``GrammarMatchers``, the model's tokenizer): a
constraint is accepted or refused, and takes its time, as with a model; the echoed tokens are not
masked. A plan with no tokens (a poll) takes no ``step_s``.
"""

import os
import time

import numpy as np

from folio.runtime.common.step import StepResult

try:
    from folio.runtime.common.step import LastSampledTokens
except ImportError:  # an older folio measured by perf/engine_overhead.py --package-dir: no placeholders
    LastSampledTokens = None

ECHO_BASE = 1000


def echo_logprobs(last_ids, K: int):
    """Made-up logprobs after each token of ``last_ids`` ``[R]``: ids ``last + 1 .. last + K``
    with logprobs ``-(j + 1) * (0.3 + 0.1 * (last % 5))``. Returns ``(ids [R, 1 + K], logprobs
    [R, 1 + K] float32)``, column 0 the answered token (``last + 1``) as the sampler lays them out."""
    last = np.asarray(last_ids, dtype=np.int64)[:, None]
    j = np.arange(max(K, 1))[None, :]
    ids = last + 1 + j
    lps = (-(j + 1) * (0.3 + 0.1 * (last % 5))).astype(np.float32)
    return np.concatenate([ids[:, :1], ids[:, :K]], axis=1), np.concatenate([lps[:, :1], lps[:, :K]], axis=1)


class EchoRunner:
    def __init__(self, config, num_blocks=None, step_s=None, fail_init=None, echo_period=None):
        env = os.environ.get
        if fail_init if fail_init is not None else env("FOLIO_ECHO_FAIL_INIT", "") not in ("", "0"):
            raise RuntimeError("fake init failure")
        self.num_blocks = int(num_blocks if num_blocks is not None else env("FOLIO_ECHO_NUM_BLOCKS", 64))
        self.step_s = float(step_s if step_s is not None else env("FOLIO_ECHO_STEP_S", 0.0))
        time.sleep(float(env("FOLIO_ECHO_INIT_S", 0.0)))
        self.period = echo_period if echo_period is not None else (int(env("FOLIO_ECHO_PERIOD", 0)) or None)
        self.model_config = None
        self.seen_seqs = set()
        self.want: dict[int, tuple] = {}   # seq_id -> (logprobs, prompt_logprobs) asked for
        self.last_sampled = LastSampledTokens() if LastSampledTokens is not None else None
        self.grammars = None
        self.config = config

    def _grammar_matchers(self):
        if self.grammars is None:
            from folio.model.registry import resolve_model
            from folio.model.tokenizer import Tokenizer
            from folio.runtime.worker.grammar_matchers import GrammarMatchers
            model = self.config.model
            self.grammars = GrammarMatchers(lambda: Tokenizer.from_pretrained(resolve_model(model)).hf.to_str())
        return self.grammars

    def execute(self, plan):
        t0 = time.perf_counter()
        compiles, releases = getattr(plan, "grammar_compiles", ()), getattr(plan, "grammar_releases", ())
        if compiles or releases:
            g = self._grammar_matchers()
            for c in compiles:
                g.prepare(c["key"], c["structured_outputs"], c["eos_token_ids"])
            for key in releases:
                g.release(key)
        if self.step_s and len(plan.input_ids):
            time.sleep(self.step_s)  # stands for the forward pass
        self.seen_seqs.update(s.seq_id for s in plan.new_seqs)
        if self.last_sampled is None:
            ids = np.asarray(plan.input_ids)[np.asarray(plan.logits_indices)] + 1
        else:
            self.last_sampled.forget(plan.finished_seq_ids)
            ids = self.last_sampled.resolve(plan)[np.asarray(plan.logits_indices)] + 1
        if self.period:
            ids = ECHO_BASE + (ids - ECHO_BASE) % int(self.period)
        if self.last_sampled is not None:
            self.last_sampled.record(plan, ids)
        result = StepResult(plan.step_id, ids.astype(np.int64), forward_time=time.perf_counter() - t0)
        self._logprobs(plan, ids, result)
        if self.grammars is not None and self.grammars.pending():
            from folio.runtime.common.step import GRAMMAR_POLL_S
            result.grammar_results = self.grammars.poll(0.0 if len(plan.input_ids) else GRAMMAR_POLL_S)
        return result

    def _logprobs(self, plan, ids, result):
        for ns in plan.new_seqs:
            self.want[ns.seq_id] = (ns.sampling.get("logprobs"), ns.sampling.get("prompt_logprobs"))
        want = [self.want.get(int(s), (None, None))[0] for s in plan.sample_seq_ids]
        if any(k is not None for k in want):
            K = max(k for k in want if k is not None)
            result.logprob_token_ids, result.logprobs = echo_logprobs(ids - 1, K)
        rows = np.asarray(getattr(plan, "prompt_logprob_indices", ()), dtype=np.int64)
        if len(rows):
            qsl = np.asarray(plan.query_start_loc)
            owners = np.asarray(plan.seq_ids)[np.searchsorted(qsl, rows, side="right") - 1]
            K = max(self.want[int(s)][1] for s in owners)
            top, lps = echo_logprobs(np.asarray(plan.input_ids)[rows], K)
            tgt = np.asarray(plan.prompt_logprob_token_ids)
            result.prompt_logprob_token_ids = np.concatenate([tgt[:, None], top[:, 1:]], axis=1)
            result.prompt_logprobs = lps.copy()
            result.prompt_logprobs[:, 0] = -3.0
            result.prompt_logprob_ranks = np.full(len(rows), 7, dtype=np.int64)

    def shutdown(self):
        pass
