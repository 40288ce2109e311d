"""The written contracts hold: both kernel tables conform to ``KernelTable``, every executor to
``Executor``, the runners to ``StepRunner`` (members present, and every method accepts the
protocol's call shape: its parameters by the same names and kinds, extra ones only with defaults)."""

import inspect

import numpy as np
import pytest

from folio.kernels.cpu.table import CPU_KERNELS
from folio.kernels.cuda.table import CudaKernels
from folio.kernels.table import KernelTable
from folio.runtime.common.config import EngineConfig
from folio.runtime.common.executor import Executor, InlineExecutor, StepRunner, ThreadedExecutor


def protocol_methods(proto):
    return {n: f for n, f in vars(proto).items() if callable(f) and not n.startswith("_")}


def protocol_attributes(proto):
    return set(getattr(proto, "__annotations__", {}))


def accepts_call_shape(proto_fn, impl) -> str | None:
    """None if ``impl`` accepts every call ``proto_fn``'s signature allows, else why not."""
    want = [p for p in inspect.signature(proto_fn).parameters.values() if p.name != "self"]
    have = inspect.signature(impl).parameters
    have_list = [p for p in have.values() if p.name != "self"]
    pos = [p for p in want if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for i, p in enumerate(pos):
        if i >= len(have_list) or have_list[i].name != p.name or have_list[i].kind not in (
                p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            return f"positional parameter {i} should be {p.name!r}"
    for p in want:
        if p.kind is p.KEYWORD_ONLY:
            q = have.get(p.name)
            if q is None or q.kind not in (q.KEYWORD_ONLY, q.POSITIONAL_OR_KEYWORD):
                return f"keyword parameter {p.name!r} missing"
            if p.default is not p.empty and q.default is q.empty:
                return f"keyword parameter {p.name!r} must be optional"
    names = {p.name for p in want}
    for q in have_list:
        if q.name not in names and q.default is q.empty and q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD):
            return f"extra required parameter {q.name!r}"
    return None


def assert_conforms(obj, proto):
    assert isinstance(obj, proto), f"{type(obj).__name__} lacks members of {proto.__name__}"
    for name in protocol_attributes(proto):
        assert hasattr(obj, name), f"{type(obj).__name__}.{name} missing"
    for name, fn in protocol_methods(proto).items():
        why = accepts_call_shape(fn, getattr(obj, name))
        assert why is None, f"{type(obj).__name__}.{name}: {why}"


@pytest.mark.parametrize("table", [CPU_KERNELS, CudaKernels(np, lambda name: None, gemm=lambda *a: None)],
                         ids=["cpu", "cuda"])
def test_kernel_tables_conform(table):
    assert_conforms(table, KernelTable)
    assert table.name in ("cpu", "cuda") and table.xp is np


def test_a_table_without_an_operation_does_not_conform():
    from types import SimpleNamespace
    partial = SimpleNamespace(**{k: v for k, v in vars(CPU_KERNELS).items() if k != "paged_attention"})
    assert not isinstance(partial, KernelTable)
    assert accepts_call_shape(KernelTable.rms_norm, lambda x, weight: None) is not None


def test_runners_and_executors_conform():
    from ipc_fake_runner import EchoRunner
    from test_scheduler import FakeExecutor
    runners = [EchoRunner(EngineConfig(extra={"num_blocks": 8})), FakeExecutor(8, 4)]
    for runner in runners:
        assert_conforms(runner, StepRunner)
        for wrapper in (InlineExecutor(runner), ThreadedExecutor(runner)):
            assert_conforms(wrapper, Executor)
    from folio.ipc.zmq_executor import ZmqExecutor
    for name, fn in protocol_methods(Executor).items():
        assert accepts_call_shape(fn, getattr(ZmqExecutor, name)) is None, name
    from folio.runtime.worker.model_runner import ModelRunner
    for name, fn in protocol_methods(StepRunner).items():
        assert accepts_call_shape(fn, getattr(ModelRunner, name)) is None, name
