"""A stand-in runner for ipc tests and engine benchmarks: the worker machinery without a model.

``EchoRunner`` answers each sampled row with (last input token + 1), a placeholder input being the
token the sequence sampled in the step before (overlap scheduling); ``config.extra`` tunes it:
``num_blocks`` (default 64), ``step_s`` (simulated forward seconds), ``fail_init`` (raise at start),
``echo_period`` (benchmarks: answers wrap into ``[1000, 1000 + echo_period)``, so the vocabulary a
long run sees is bounded as a model's is, instead of a new id every step); the environment
variables FOLIO_ECHO_NUM_BLOCKS / FOLIO_ECHO_STEP_S set the same through ``folio serve``.
FOLIO_ECHO_INIT_S makes start-up take that many seconds (as loading a model does).
"""

import os
import time

import numpy as np

from folio.runtime.step import StepResult

try:
    from folio.runtime.step import LastSampledTokens
except ImportError:  # an older folio measured by perf/engine_overhead.py --package-dir: no placeholders
    LastSampledTokens = None

ECHO_BASE = 1000


class EchoRunner:
    def __init__(self, config):
        extra = config.extra or {}
        if extra.get("fail_init"):
            raise RuntimeError("fake init failure")
        self.num_blocks = int(extra.get("num_blocks", os.environ.get("FOLIO_ECHO_NUM_BLOCKS", 64)))
        self.step_s = float(extra.get("step_s", os.environ.get("FOLIO_ECHO_STEP_S", 0.0)))
        time.sleep(float(os.environ.get("FOLIO_ECHO_INIT_S", 0.0)))
        self.period = extra.get("echo_period")
        self.model_config = None
        self.seen_seqs = set()
        self.last_sampled = LastSampledTokens() if LastSampledTokens is not None else None

    def execute(self, plan):
        t0 = time.perf_counter()
        if self.step_s:
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
        return StepResult(plan.step_id, ids.astype(np.int64), forward_time=time.perf_counter() - t0)

    def shutdown(self):
        pass
