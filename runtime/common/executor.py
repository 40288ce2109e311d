"""The contract between the engine and whatever runs its steps, and the in-process executors.

Two protocols (``typing.Protocol``; ``isinstance`` checks only that the members exist):

* ``StepRunner``: runs one ``StepPlan`` to one ``StepResult`` synchronously, ``execute(plan)``.
  ``ModelRunner`` is one; so are the stand-ins of the tests and benchmarks.
* ``Executor``: what the engine drives. ``submit(plan)`` hands a plan over and returns at once,
  ``get_result()`` returns the oldest submitted plan's result (waiting for it), and plans run in
  the order submitted. That lets the engine prepare and submit step N+1 while step N runs
  (overlap scheduling). ``ipc.zmq_executor.ZmqExecutor`` (a worker process) is one; for a
  ``StepRunner`` in this process the engine builds an ``InlineExecutor`` (runs each plan at
  ``submit``, no overlap) or a ``ThreadedExecutor`` (runs plans on one background thread, as
  SGLang's overlap scheduler runs its model worker).

Both executors here measure the runner's idle time before each plan (``StepResult.idle_time``):
the time between the end of the previous ``execute`` and the start of this one.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from typing import Any, Protocol, runtime_checkable

import numpy as np

from .step import StepPlan, StepResult


@runtime_checkable
class StepRunner(Protocol):
    """Runs steps synchronously in this process (the worker side of the step contract).

    Attributes:
        num_blocks: physical KV blocks the runner allocated.
    """

    num_blocks: int

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one plan; errors inside the step are reported in ``StepResult.error``."""
        ...

    def shutdown(self) -> None:
        ...


@runtime_checkable
class Executor(Protocol):
    """What ``LLMEngine`` drives: plans in, results out, in order, possibly overlapped.

    Attributes:
        num_blocks: physical KV blocks on the worker.
        model_config: the worker's ``ModelConfig`` (``None`` when it has none; the engine then
            reads the model folder itself).
    """

    num_blocks: int
    model_config: Any

    def submit(self, plan: StepPlan) -> None:
        """Hand ``plan`` to the worker and return without waiting for it to run."""
        ...

    def get_result(self) -> StepResult:
        """The result of the oldest submitted plan whose result was not taken yet (waits).

        Raises:
            RuntimeError: nothing submitted, or the worker is gone (subclasses say which).
        """
        ...

    def result_ready(self) -> bool:
        """Whether ``get_result()`` would return without waiting."""
        ...

    def shutdown(self) -> None:
        ...


class _LocalExecutor:
    """An ``Executor`` over a ``StepRunner`` in this process."""

    def __init__(self, runner: StepRunner):
        self.runner = runner
        self.num_blocks = int(runner.num_blocks)
        self.model_config = getattr(runner, "model_config", None)

    def shutdown(self) -> None:
        self.runner.shutdown()


class InlineExecutor(_LocalExecutor):
    """Runs each plan on the calling thread at ``submit`` (no overlap).

    Args:
        runner: a ``StepRunner``.
    """

    def __init__(self, runner: StepRunner):
        super().__init__(runner)
        self._results: list[StepResult] = []
        self._last_end: float | None = None

    def submit(self, plan: StepPlan) -> None:
        start = time.perf_counter()
        result = self.runner.execute(plan)
        self._last_end, idle = time.perf_counter(), 0.0 if self._last_end is None else start - self._last_end
        result.idle_time = idle
        self._results.append(result)

    def get_result(self) -> StepResult:
        if not self._results:
            raise RuntimeError("get_result() with no plan submitted")
        return self._results.pop(0)

    def result_ready(self) -> bool:
        return bool(self._results)


class ThreadedExecutor(_LocalExecutor):
    """Runs plans on one background thread, in order, so the caller can prepare the next plan
    meanwhile (overlap scheduling in one process).

    The runner is only ever called from that thread. An exception escaping ``execute`` becomes
    an error result (the runner itself already reports errors inside a step that way). The
    thread ends with ``shutdown()`` or when the executor is garbage-collected, so a dropped
    ``LLM`` does not keep its model alive.

    Args:
        runner: a ``StepRunner``.
    """

    def __init__(self, runner: StepRunner):
        super().__init__(runner)
        self._plans: queue.SimpleQueue = queue.SimpleQueue()
        self._results: queue.SimpleQueue = queue.SimpleQueue()
        self._num_pending = 0
        self._thread: threading.Thread | None = None

    def submit(self, plan: StepPlan) -> None:
        if self._thread is None:
            # the thread holds the runner and the queues, not the executor
            self._thread = threading.Thread(target=_run_plans, args=(self.runner, self._plans, self._results),
                                            name="folio-step-runner", daemon=True)
            self._thread.start()
            weakref.finalize(self, self._plans.put, None)
        self._num_pending += 1
        self._plans.put(plan)

    def get_result(self) -> StepResult:
        if not self._num_pending:
            raise RuntimeError("get_result() with no plan submitted")
        result = self._results.get()
        self._num_pending -= 1
        return result

    def result_ready(self) -> bool:
        return not self._results.empty()

    def shutdown(self) -> None:
        if self._thread is not None:
            self._plans.put(None)
            self._thread.join(timeout=60)
            self._thread = None
        super().shutdown()



def _run_plans(runner: StepRunner, plans: queue.SimpleQueue, results: queue.SimpleQueue) -> None:
    """``ThreadedExecutor``'s thread: run plans in order until ``None`` comes."""
    last_end = None
    while True:
        plan = plans.get()
        if plan is None:
            return
        start = time.perf_counter()
        try:
            result = runner.execute(plan)
        except BaseException as e:  # noqa: BLE001 - reported to the engine, which raises
            result = StepResult(plan.step_id, sampled_token_ids=np.zeros(0, dtype=np.int64),
                                error=f"{type(e).__name__}: {e}")
        end = time.perf_counter()
        result.idle_time = 0.0 if last_end is None else start - last_end
        last_end = end
        results.put(result)
