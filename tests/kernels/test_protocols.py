"""The written contracts hold: both kernel tables conform to ``KernelTable`` and each to its own
extension (``CpuKernelTable``, ``CudaKernelTable``) and not to the other's, the CUDA table's devices
to ``KernelDevice``, the CPU table's compile jobs to ``CompileJob``, every executor to ``Executor``,
the runners to ``StepRunner`` (members present, and every method accepts the protocol's call shape:
its parameters by the same names and kinds, extra ones only with defaults); and every member the
model and the worker read from a table is declared."""

import inspect
import os
from typing import Generic, Protocol

import numpy as np
import pytest

from folio.kernels.cpu.table import CPU_KERNELS
from folio.kernels.cuda.device import CupyDevice, HostDevice
from folio.kernels.cuda.table import CudaKernels
from folio.kernels.table import CompileJob, CpuKernelTable, CudaKernelTable, KernelDevice, KernelTable
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


def protocol_members(proto):
    """Every member a protocol declares, its bases' included (the extensions inherit ``KernelTable``)."""
    names = set()
    for cls in proto.__mro__:
        if cls in (object, Protocol, Generic) or not getattr(cls, "_is_protocol", False):
            continue
        names |= protocol_attributes(cls) | set(protocol_methods(cls))
    return names


# the CUDA table built on the CPU (NumPy arrays, a HostDevice), as tests/runtime/worker/test_device_step.py runs it
CUDA_ON_HOST = CudaKernels(np, lambda name: None, gemm=lambda *a: None)
TABLES = {"cpu": (CPU_KERNELS, CpuKernelTable), "cuda": (CUDA_ON_HOST, CudaKernelTable)}


@pytest.mark.parametrize("device", list(TABLES))
@pytest.mark.parametrize("proto", [KernelTable, CpuKernelTable, CudaKernelTable], ids=lambda p: p.__name__)
def test_kernel_tables_conform_to_their_protocols(device, proto):
    table, own = TABLES[device]
    if proto in (KernelTable, own):
        for cls in proto.__mro__:   # the extension's members and the base's, each signature checked
            if getattr(cls, "_is_protocol", False) and cls not in (Protocol, Generic):
                assert_conforms(table, cls)
        assert table.name == device and table.xp is np
    else:  # the other device's extension: the runtime must not take this table for it
        assert not isinstance(table, proto)
        missing = sorted(n for n in protocol_members(proto) - protocol_members(KernelTable) if not hasattr(table, n))
        assert missing, f"{device} table has every extra of {proto.__name__}"


def test_the_cuda_tables_devices_conform():
    assert_conforms(CUDA_ON_HOST.device, KernelDevice)
    assert isinstance(CUDA_ON_HOST.device, HostDevice)
    for name, fn in protocol_methods(KernelDevice).items():   # the GPU's, checked without a GPU
        assert accepts_call_shape(fn, getattr(CupyDevice, name)) is None, name


def test_every_device_member_the_cuda_path_calls_is_declared():
    # what the GPU step, the model runner and the CUDA table call on folio's device object
    # (``device.X``, ``self.device.X``, ``k.device.X``; ``dev`` there is CuPy's own Device)
    import ast
    import pathlib
    from support import ROOT as root
    used = set()
    for path in [*sorted((root / "runtime" / "worker").glob("*.py")), root / "kernels" / "cuda" / "table.py"]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and (
                    isinstance(node.value, ast.Name) and node.value.id == "device"
                    or isinstance(node.value, ast.Attribute) and node.value.attr == "device"):
                used.add(node.attr)
    assert {"launch", "synchronize_device"} <= used, used   # the scan finds the calls
    assert used <= protocol_members(KernelDevice), sorted(used - protocol_members(KernelDevice))


def table_members_used(path) -> set[str]:
    """Attribute names the worker-side file at ``path`` reads from a kernel table: ``X`` in
    ``kernels.X``, ``k.X``, ``cuda.X``, ``self.k.X``, ``self.kernels.X`` (its names for the table)."""
    import ast
    names = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if not isinstance(node, ast.Attribute):
            continue
        v = node.value
        if isinstance(v, ast.Name) and v.id in ("kernels", "k", "cuda") or (
                isinstance(v, ast.Attribute) and isinstance(v.value, ast.Name) and v.value.id == "self"
                and v.attr in ("k", "kernels")):
            names.add(node.attr)
    return names


def test_the_protocols_declare_what_the_worker_calls():
    # every member the GPU step, the device sampler and the model runner read from a table is
    # declared (the CUDA path runs every one of them, so CudaKernelTable must declare them all)
    import folio.runtime.worker as worker
    root = os.path.dirname(worker.__file__)
    used = set()
    for name in ("device_step.py", "sampler.py", "model_runner.py"):
        used |= table_members_used(os.path.join(root, name))
    assert {"capture", "sample", "reserve_decode_scratch"} <= used   # the scan sees the calls
    assert used - protocol_members(CudaKernelTable) == set()


def test_the_protocols_declare_what_the_model_and_precompile_read():
    # the model (model/llama.py, model/loader.py) and the ahead compilation (precompile.py) read a
    # table's differences from declared members (stacked_layers, zeros, precompile_jobs, ...),
    # never by probing for what one table has
    import folio.model as model
    import folio.runtime.worker as worker
    paths = [os.path.join(os.path.dirname(model.__file__), name) for name in ("llama.py", "loader.py")]
    used = set()
    for path in paths + [os.path.join(os.path.dirname(worker.__file__), "precompile.py")]:
        used |= table_members_used(path)
    assert {"stacked_layers", "zeros", "decoder_layers", "precompile_jobs"} <= used   # the scan sees the reads
    assert used - (protocol_members(CpuKernelTable) | protocol_members(CudaKernelTable)) == set()


@pytest.mark.parametrize("variant", CPU_KERNELS.precompile_variants)
def test_the_cpu_tables_compile_jobs_conform(variant):
    jobs = CPU_KERNELS.precompile_jobs(variant)
    assert jobs and len({j.name for j in jobs}) == len(jobs)
    for job in jobs:
        assert_conforms(job, CompileJob)
    with pytest.raises(ValueError, match="unknown kernel variant"):
        CPU_KERNELS.precompile_jobs("float16")


def test_a_table_without_an_operation_does_not_conform():
    from types import SimpleNamespace
    partial = SimpleNamespace(**{k: v for k, v in vars(CPU_KERNELS).items() if k != "paged_attention"})
    assert not isinstance(partial, KernelTable)
    assert accepts_call_shape(KernelTable.rms_norm, lambda x, weight: None) is not None


def test_runners_and_executors_conform():
    from support.ipc_fake_runner import EchoRunner
    from support.fake_executor import FakeExecutor
    runners = [EchoRunner(EngineConfig(), num_blocks=8), FakeExecutor(8, 4)]
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
