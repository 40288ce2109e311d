"""A stand-in runner for ipc tests: the worker process machinery without a model.

``EchoRunner`` answers each sampled row with (last input token + 1); ``config.extra`` tunes it:
``num_blocks`` (default 64), ``step_s`` (simulated forward seconds), ``fail_init`` (raise at start);
the environment variables FOLIO_ECHO_NUM_BLOCKS / FOLIO_ECHO_STEP_S set the same through ``folio serve``,
and FOLIO_ECHO_INIT_S makes start-up take that many seconds (as loading a model does).
"""

import os
import time

import numpy as np

from folio.runtime.step import StepResult


class EchoRunner:
    def __init__(self, config):
        extra = config.extra or {}
        if extra.get("fail_init"):
            raise RuntimeError("fake init failure")
        self.num_blocks = int(extra.get("num_blocks", os.environ.get("FOLIO_ECHO_NUM_BLOCKS", 64)))
        self.step_s = float(extra.get("step_s", os.environ.get("FOLIO_ECHO_STEP_S", 0.0)))
        time.sleep(float(os.environ.get("FOLIO_ECHO_INIT_S", 0.0)))
        self.model_config = None
        self.seen_seqs = set()

    def execute(self, plan):
        t0 = time.perf_counter()
        if self.step_s:
            time.sleep(self.step_s)  # stands for the forward pass
        self.seen_seqs.update(s.seq_id for s in plan.new_seqs)
        ids = np.asarray(plan.input_ids)[np.asarray(plan.logits_indices)] + 1
        return StepResult(plan.step_id, ids.astype(np.int64), forward_time=time.perf_counter() - t0)

    def shutdown(self):
        pass
