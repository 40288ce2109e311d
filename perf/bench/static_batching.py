"""Request-level (static) batching, the baseline continuous batching is compared with (section 2).

``StaticBatchScheduler`` is folio's ``Scheduler`` with one admission rule added: a batch of up to
``max_num_seqs`` waiting requests is formed only when the previous batch has completely finished,
and only its requests are admitted (how a server without iteration-level scheduling batches; Orca,
Yu et al., OSDI 2022, section 2). Benchmarks pass it as ``LLMEngine(..., scheduler_cls=...)``; the
production scheduler knows nothing about it.
"""

from __future__ import annotations

from folio.runtime.scheduler.scheduler import Scheduler
from folio.runtime.scheduler.sequence import Sequence


class StaticBatchScheduler(Scheduler):
    """``Scheduler`` that admits requests batch by batch (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._batch: set[str] = set()

    def may_admit(self, seq: Sequence) -> bool:
        if not self.running and not any(rid in self.requests for rid in self._batch):
            self._batch = set()
            for waiting in self.waiting:
                if len(self._batch) >= self.max_num_seqs:
                    break
                self._batch.add(waiting.request.request_id)
        return seq.request.request_id in self._batch


def _schedulers() -> dict:
    from .separate_beams import SeparateBeamsScheduler
    return {"continuous": Scheduler, "static": StaticBatchScheduler, "separate-beams": SeparateBeamsScheduler}


SCHEDULERS = _schedulers()
