"""Compile the CPU kernels of the serving paths into Numba's on-disk cache, in parallel processes.

Without it, a server's first step on a fresh clone compiles every kernel it meets, one after the
other, in the worker process. ``precompile`` compiles the same signatures before that step, with
explicit signatures (``JOBS``), in ``processes`` child processes, while the worker loads the model;
the worker's first step then loads the machine code from the cache (``jit_cache``). It reports each
compiled kernel to ``progress``.

Numba's cache is safe to share between processes for *different* functions only: two processes
that add signatures of one function at once can both write their entry under the same data file
name, and one index then names the other's code (``numba/core/caching.py``,
``IndexDataCacheFile.save``: read the index, pick the first free name, write). So the jobs come
in groups whose call trees share no compiled function (``GROUPS``); a group runs in one process,
in order, and a group that compiles signatures of another group's functions or links them waits
for it (``AFTER``): the layer loop's work item (``forward._phase_item``), which links the
attention, product and row kernels, compiles after them, loading theirs, while the other process
compiles what only the steps' Python code calls and the parallel regions (``LANES``).

What a cold start compiles is kept small: Numba links every callee's LLVM module into
its caller and optimizes and code-generates the whole tree again for each compiled function (a
parallel region four times: the loop body, two gufunc wrappers, the function), so the cost is a
tree's size times the levels above it. Hence: the regions call their item function at its address
instead of linking it (``forward._call_item``); the products' entry leaves out the integer kernels
unless int8 activations were asked for (variant ``quantized-int8``); one signature per function
(``lm_head`` runs the layers' product entry, ``forward.quantized_linear``); ``attention_item``
inlined; no parallel loops besides the ``prange``.

The KV caches are the jobs' only 4-D arrays (``F4``): float32, or with ``--kv-cache-dtype
bfloat16`` uint16 (``kernels/cpu/kv_dtype.py``). ``precompile`` compiles the variants of the
configured cache dtype only (the kernels have one per dtype), so a bfloat16 server compiles no
float32 cache variant and the default server none of the bfloat16 ones. Likewise for the weights
(``VARIANTS``): float32 stacks, or GGUF-typed weights (a ``.gguf`` file served as stored), never both.

Only what a worker with two or more kernel threads runs (``forward._layers_region``: one parallel
region per step) is listed; with one thread the first step compiles its own path.
``tests/runtime/worker/test_warm_up.py`` checks that the jobs leave nothing for the warm-up to
compile.
A kernel whose arguments change needs its job changed with it (that test fails until it is).

    python -m folio.runtime.worker.precompile [--variant V] [--check] [--kv-cache-dtype NAME] [GROUP ...]

Sources: Numba's documentation, "Compiling Python code with @jit" (explicit signatures,
``Dispatcher.compile``) and "Notes on caching" (the cache is shared by processes on one machine).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import subprocess
import sys
import threading
import time
from typing import Callable

__all__ = ["JOBS", "VARIANTS", "jobs", "weights_variant", "GROUPS", "LAST_GROUP", "AFTER", "LANES", "Job", "precompile", "precompile_with_progress", "precompile_for", "compile_job",
           "in_cache", "needed"]


@dataclasses.dataclass(frozen=True)
class Job:
    """One function and one signature to compile."""
    module: str          # module of ``kernels/cpu``
    function: str
    signature: str       # argument types, in the names of ``_types()`` (F2: C-contiguous float32 2-D, ...)
    group: str           # jobs of one group run in one process, in order (shared callees)
    seconds: float       # rough cost on a cold cache, in seconds: the progress bar's weight
    what: str            # for people

    @property
    def name(self) -> str:
        return f"{self.module}.{self.function}"


def _kv_dtype(kv_cache_dtype: str):
    # the Numba element type of the KV cache arrays for a --kv-cache-dtype name (auto: float32)
    from numba import from_dtype
    from ...kernels import get_kernels
    cpu = get_kernels("cpu")
    return from_dtype(cpu.kv_cache_dtype if kv_cache_dtype == "auto" else cpu.kv_cache_dtypes[kv_cache_dtype])


def _types(kv_cache_dtype: str = "auto") -> dict:
    # F4: a KV cache [blocks, block_size, kv_heads, head_dim], the jobs' only 4-D arrays, of the
    # cache dtype (float32, or uint16 for bfloat16)
    from numba import types
    a = types.Array
    return {"F1": a(types.float32, 1, "C"), "F2": a(types.float32, 2, "C"), "F3": a(types.float32, 3, "C"),
            "F4": a(_kv_dtype(kv_cache_dtype), 4, "C"), "I1": a(types.int64, 1, "C"), "I2": a(types.int64, 2, "C"),
            "I3": a(types.int64, 3, "C"), "U2": a(types.uint8, 2, "C"),
            "U2r": a(types.uint8, 2, "C", readonly=True),   # a read-only memory-mapped GGUF tensor
            "i64": types.int64, "u64": types.uint64, "f64": types.float64, "f32": types.float32,
            "none": types.none, "b1": types.boolean}


# attention.attention_item's two kinds of item (it is inlined into the region): q, the caches, step
# metadata, scale, out; the item's fields; the task's scratch rows
_ATTEND_ITEM = "F3 F4 F4 I2 I1 I1 f32 F3  i64 i64 i64 i64  F2 F2 F2 I1 F2 F2 F1 F1"
_DECODE_ITEM = "F3 F4 F4 I2 I1 I1 f32 F3  i64 i64 i64 i64 i64 i64 i64 i64  F2 F2 F2 F1 F1 F1 F2 F2 F3"
# forward._phase_item: phase, i, layer, task; buffers (residual, hidden, x, qkv, q, attn, attn2,
# gate_up, act); stacked weights; one layer's caches; step metadata; attention scratch; product
# scratch (a placeholder with float32 weights); int8 ({A}: none, or b1 where products take int8
# activations: forward.product_item)
_PHASE_ITEM = ("i64 i64 i64 u64  F2 F2 F2 F2 F3 F3 F2 F2 F2  {W}  F4 F4  I1 F2 I1 I2 I1 I1 i64 i64 f64 f32 "
               "I2 i64 I2 i64  F3 F3 F3 I2 F3 F3 F2 F2 F2 F2 F2 F3 F2 {A}")
# forward._layers_region: buffers, stacked weights, cache addresses and a cache, step metadata,
# tasks, int8, and _phase_item's address and signature key
_LAYERS_REGION = "F2 F2 F2 F2 F3 F3 F2 F2  {W}  I2 F4  I1 F2 I1 I2 I1 I1 i64 i64 f64 f32 I2 i64 I2 i64 i64 {A} i64 i64"
# the stacked weights (ln1, qkv, o, ln2, gate_up, down): float32 stacks, or QuantizedStack tables
_FLOAT_WEIGHTS = "F2 F3 F3 F2 F3 F3"
_QUANT_WEIGHTS = "F2 I3 I3 F2 I3 I3"

_SHARED_JOBS = (
    Job("attention", "_decode_item", _DECODE_ITEM, "attention", 7.5, "paged attention: decode items"),
    Job("attention", "_attend_item", _ATTEND_ITEM, "attention", 6, "paged attention: prefill tiles"),
    Job("attention", "_plan", "I1 I1 i64 i64 i64 i64 i64 i64 i64 i64", "attention", 4, "paged attention: work plan"),
    Job("attention", "finish_attention", "I2 i64 i64 F2 F2 F3 I1 F3", "linear", 3.5,
        "paged attention: merge of key partitions"),
    Job("rows", "_rms_norm_rows", "F2 F1 f64 F2 i64 i64", "linear", 0.4, "RMSNorm"),
    Job("rows", "_fused_add_rms_norm_rows", "F2 F2 F1 f64 F2 F2 i64 i64", "linear", 0.4, "residual add + RMSNorm"),
    Job("rows", "_rope_and_cache_rows", "I1 F2 F2 F4 F4 I1 i64 i64 F3 i64 i64", "linear", 1.1,
        "RoPE and KV-cache append"),
    Job("rows", "_silu_and_mul_rows", "F2 F2 i64 i64", "linear", 0.3, "SwiGLU"),
    Job("attention", "attention_scratch", "i64 i64 i64 i64 i64 i64", "linear", 1, "paged attention: scratch buffers"),
    Job("forward", "wait_items_done", "I1 i64 i64", "linear", 0.1, "decoder layers: phase barrier"),
)
_LAST_JOBS = (
    Job("rows", "fused_add_rms_norm_into", "F2 F2 F1 f64 F2 F2 i64 i64", "rest", 1.8,
        "residual add + RMSNorm, parallel region (final norm)"),
    Job("rows", "_copy_blocks_kernel", "F4 I2", "rest", 0.1, "KV block copies (copy-on-write)"),
)
def _quantized_jobs(int8: bool) -> tuple:
    # weights in GGUF types: the products' entry (forward.product_item) is quant_task_rows_f32, or
    # with int8 activations quant_task_rows (which calls it too); the regions' int8 argument is
    # None, or True
    a = "b1" if int8 else "none"
    return (
        Job("quant_linear", "quant_task_rows" if int8 else "quant_task_rows_f32", "F2 U2 i64 F2 i64 F2 u64 i64 i64",
            "linear", 11 if int8 else 8.5, "matrix products from GGUF blocks"),
        Job("quant_linear", "quant_item_rows", "i64 i64 i64 b1 i64", "linear", 0.1, "matrix products: rows per item"),
        Job("quant_linear", "quant_scratch", "i64 i64 i64", "linear", 0.1, "matrix products: scratch"),
        Job("forward", "_row_bytes", "i64 i64", "linear", 0.1, "GGUF row sizes"),
        Job("forward", "_phase_item", _PHASE_ITEM.format(W=_QUANT_WEIGHTS, A=a), "layers", 11,
            "decoder layers: one work item of a phase"),
        Job("forward", "_layers_region", _LAYERS_REGION.format(W=_QUANT_WEIGHTS, A=a), "rest", 6,
            "decoder layers: one parallel region per step"),
        Job("forward", "_product_region", "F2 i64 i64 F2 i64 i64 i64", "rest", 1,
            "matrix products from GGUF blocks, parallel region (lm_head)"),
        Job("quant_linear", "_embedding_into", "U2r i64 I1 F2", "rest", 3, "embedding rows from GGUF blocks"),
    ) + ((Job("quant_x8", "x8_decode_rows", "U2 i64 I1 F2", "rest", 2,
              "embedding rows from an interleaved table (tied to lm_head)"),) if int8 else ())


_VARIANT_JOBS = {
    "float32": (
        Job("linear", "linear_item", "F2 F2 F2 i64 i64 i64 i64", "linear", 10, "matrix products"),
        Job("linear", "linear_items", "i64 i64 i64 i64 i64", "linear", 0.4, "matrix products: work items"),
        Job("forward", "_phase_item", _PHASE_ITEM.format(W=_FLOAT_WEIGHTS, A="none"), "layers", 10,
            "decoder layers: one work item of a phase"),
        Job("forward", "_layers_region", _LAYERS_REGION.format(W=_FLOAT_WEIGHTS, A="none"), "rest", 6,
            "decoder layers: one parallel region per step"),
        Job("linear", "linear_into", "F2 F2 F2 i64 i64 i64", "rest", 7, "matrix products, parallel region (lm_head)"),
    ),
    # weights in GGUF types (a .gguf file served as stored, 16-bit safetensors, --quantization):
    # the products read GGUF blocks; lm_head and the embedding are a read-only mapped tensor
    "quantized": _quantized_jobs(int8=False),
    # the same with --activation-quantization int8: the products' entry with the integer kernels
    "quantized-int8": _quantized_jobs(int8=True),
}
VARIANTS = tuple(_VARIANT_JOBS)
"""The weight layouts a worker can run: float32 stacks, or weights in GGUF types (products with
float32 activations, or with int8 activations: ``weights_variant``)."""


def jobs(variant: str = "float32") -> tuple:
    """The jobs of ``variant`` (``VARIANTS``), in the order they are listed (groups keep it)."""
    if variant not in _VARIANT_JOBS:
        raise ValueError(f"unknown kernel variant {variant!r}; one of {', '.join(VARIANTS)}")
    return _SHARED_JOBS + _VARIANT_JOBS[variant] + _LAST_JOBS


JOBS = jobs("float32")
"""What ``precompile`` compiles for a float32 model: the signatures a two-thread worker's steps call
(``forward``'s one-region layer loop, the final norm and ``lm_head`` product, the attention plan,
block copies); ``jobs("quantized")`` for weights in GGUF types."""

GROUPS = tuple(dict.fromkeys(j.group for j in JOBS))
LAST_GROUP = "layers"
AFTER = {"layers": ("attention", "linear"), "rest": ("linear",)}
"""The groups each group waits for. ``layers`` links the functions of ``attention`` and
``linear`` (it runs after them, loading them, and compiles only its own item function); ``rest``
compiles signatures of functions that ``linear`` compiled too (``linear_item`` called with literal
arguments by ``linear_into``, the row kernels under ``fused_add_rms_norm_into``) and the regions,
which link its scratch and counter functions: it runs after ``linear`` in the same process, beside
``layers``, which only loads them."""
LANES = (("attention", "layers"), ("linear", "rest"))
"""The groups of each process, in order, with two processes (one process: all of them, in
``GROUPS`` order after ``AFTER``)."""


def _gpu_usable() -> bool:
    """Whether CuPy is installed and sees a GPU (``auto`` then serves on it). CuPy installed on a
    machine without a GPU or driver (the test extra installs it) is not a GPU."""
    import importlib.util
    if importlib.util.find_spec("cupy") is None:
        return False
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no driver, no device, a broken install: the worker runs on the CPU
        return False


def needed(device: str = "cpu") -> bool:
    """Whether a worker on ``device`` (``cpu``, ``cuda``, ``auto``: CPU where CuPy sees no GPU)
    started with this environment runs the jobs' paths: the CPU kernels on two or more threads
    (``NUMBA_NUM_THREADS``, else Numba's default: the cores this process may run on)."""
    if device == "cuda" or (device == "auto" and _gpu_usable()):
        return False
    try:
        threads = int(os.environ.get("NUMBA_NUM_THREADS") or len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        threads = os.cpu_count() or 1
    return threads > 1


def weights_variant(model: str, dtype: str = "auto", quantization: str | None = None,
                    load_format: str = "auto", activation_quantization: str = "auto") -> str:
    """The ``VARIANTS`` entry a CPU worker of this model runs: ``"quantized"`` where the weights are
    served in GGUF / 16-bit types (``model.loader.load_model``'s rules: ``--dtype auto`` with a GGUF
    file or 16-bit safetensors, or ``--quantization``), ``"quantized-int8"`` for those whose
    activations resolve to int8 (``model.loader.resolve_activation_quantization``), else
    ``"float32"``. Reads only the model's import folder and GGUF / safetensors headers (the import
    is made if absent)."""
    from ...model.loader import resolve_activation_quantization, serves_quantized
    if not serves_quantized(model, dtype, quantization, load_format):
        return "float32"
    act = resolve_activation_quantization(activation_quantization, model, dtype, quantization, load_format)
    return "quantized-int8" if act == "int8" else "quantized"


def _dispatcher(job: Job, kv_cache_dtype: str = "auto"):
    types = _types(kv_cache_dtype)
    fn = getattr(importlib.import_module(f"...kernels.cpu.{job.module}", __package__), job.function)
    return fn, tuple(types[t] for t in job.signature.split())


def compile_job(job: Job, kv_cache_dtype: str = "auto") -> bool:
    """Compile (or load from the cache) ``job`` in this process, for KV caches of
    ``kv_cache_dtype`` (a ``--kv-cache-dtype`` name); returns True if it compiled."""
    fn, sig = _dispatcher(job, kv_cache_dtype)
    before = fn.stats.cache_misses.get(sig, 0)
    fn.compile(sig)
    return fn.stats.cache_misses.get(sig, 0) > before


def in_cache(job: Job, kv_cache_dtype: str = "auto") -> bool:
    """Whether Numba's cache index holds ``job`` for this machine and the current sources,
    without loading it (Numba's ``Cache._index_key`` and index file; False where they differ from
    the Numba this was written against, 0.59-0.61)."""
    fn, sig = _dispatcher(job, kv_cache_dtype)
    try:
        cache = fn._cache
        return cache._index_key(sig, fn.targetctx.codegen()) in cache._cache_file._load_index()
    except Exception:  # noqa: BLE001 - another Numba's internals: compile (or load) it
        return False


def _child_main(args: list[str]) -> int:
    # "--variant V" first (default float32); "--check": first one line "missing N" (jobs of any
    # group not in the cache), and stop there when N is 0; then the given groups' jobs in order,
    # one line per job: "done NAME SECONDS C|L"
    variant = "float32"
    if args[:1] == ["--variant"]:
        variant, args = args[1], args[2:]
    all_jobs = jobs(variant)
    check = args[:1] == ["--check"]
    args = args[1:] if check else args
    kv = "auto"
    if args[:1] == ["--kv-cache-dtype"]:
        kv, args = args[1], args[2:]
    if check:
        missing = sum(not in_cache(j, kv) for j in all_jobs)
        print(f"missing {missing}", flush=True)
        if not missing:
            return 0
    for g in args:
        for job in all_jobs:
            if job.group == g:
                t0 = time.perf_counter()
                compiled = compile_job(job, kv)
                print(f"done {job.name} {time.perf_counter() - t0:.2f} {'C' if compiled else 'L'}", flush=True)
    return 0


def _lanes(processes: int) -> list[list[str]]:
    # LANES with two processes or more; one process: every group, each after those it waits for
    if processes >= len(LANES):
        return [list(lane) for lane in LANES]
    order: list[str] = []
    for g in GROUPS:
        order += [d for d in AFTER.get(g, ()) if d not in order]
        if g not in order:
            order.append(g)
    return [order]


def precompile(processes: int = 2, progress: Callable[[Job, float, bool, list], None] | None = None,
               on_start: Callable[[Job], None] | None = None, env: dict | None = None,
               variant: str = "float32", kv_cache_dtype: str = "auto") -> dict:
    """Fill Numba's cache with ``jobs(variant)`` using up to ``processes`` child processes (``python -m``
    this module): the first checks the cache index and, if nothing is missing, ends at once (a
    warm start spawns one process, which loads nothing); otherwise each process runs its lane of
    ``LANES``, each group after the groups it waits for (``AFTER``).

    Args:
        processes: child processes at most (>= 1).
        progress: called after each job as ``progress(job, seconds, compiled, running)``
            (``compiled``: False when it came from the cache; ``running``: the jobs now under way).
        on_start: called with each job as a child starts it.
        env: the children's environment (default this process's).
        variant: the model's weight layout (``VARIANTS``; ``weights_variant`` tells a model's).
        kv_cache_dtype: the KV cache dtype the jobs are compiled for (``--kv-cache-dtype``; only
            that variant).
    Returns:
        ``{"seconds": wall time, "compiled": jobs compiled, "loaded": jobs found in the cache,
        "processes": children used}``.
    Raises:
        RuntimeError: a child failed (its last output lines in the message).
    """
    t0 = time.perf_counter()
    lanes = _lanes(processes)
    job_list = jobs(variant)
    by_name = {j.name: j for j in job_list}
    lock = threading.Lock()
    running: dict[int, Job] = {}
    counts = {"compiled": 0, "loaded": 0, "processes": 0}
    checked = threading.Event()
    missing = [len(job_list)]

    def run(lane_id: int, groups: list[str], check: bool) -> None:
        lane_jobs = [j for g in groups for j in job_list if j.group == g]
        cmd = [sys.executable, "-m", __name__, "--variant", variant, *(["--check"] if check else []),
               "--kv-cache-dtype", kv_cache_dtype, *groups]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env if env is not None else os.environ.copy())
        with lock:
            counts["processes"] += 1

        def start_first():
            with lock:
                running[lane_id] = lane_jobs[0]
            if on_start:
                on_start(lane_jobs[0])

        if not check:
            start_first()
        tail = []
        for line in proc.stdout:
            parts = line.split()
            if len(parts) == 2 and parts[0] == "missing":
                missing[0] = int(parts[1])
                checked.set()
                if missing[0]:
                    start_first()
                continue
            if len(parts) != 4 or parts[0] != "done" or parts[1] not in by_name:
                tail.append(line)
                continue
            job = by_name[parts[1]]
            k = lane_jobs.index(job)
            nxt = lane_jobs[k + 1] if k + 1 < len(lane_jobs) else None
            with lock:
                counts["compiled" if parts[3] == "C" else "loaded"] += 1
                if nxt is None:
                    running.pop(lane_id, None)
                else:
                    running[lane_id] = nxt
                now = list(running.values())
            if nxt is None or nxt.group != job.group:
                group_done[job.group].set()
            if progress:
                progress(job, float(parts[2]), parts[3] == "C", now)
            if nxt is not None and on_start:
                on_start(nxt)
        err = proc.stderr.read()
        checked.set()
        if proc.wait() != 0:
            raise RuntimeError(f"kernel compile process ({' '.join(groups)}) failed with exit code {proc.returncode}:\n"
                               + "".join(tail[-10:]) + err[-3000:])

    errors: list[BaseException] = []
    group_done = {g: threading.Event() for g in GROUPS}

    def lane(lane_id: int, groups: list[str]) -> None:
        # the lane's groups in as few processes as the waits allow: a new process where a group
        # waits for a group of another lane (the first process checks the cache index)
        segments: list[list[str]] = []
        for g in groups:
            if not segments or any(d not in groups[:groups.index(g)] for d in AFTER.get(g, ())):
                segments.append([])
            segments[-1].append(g)
        try:
            for k, segment in enumerate(segments):
                for g in segment:
                    for d in AFTER.get(g, ()):
                        if d not in segment:
                            group_done[d].wait()
                if errors or (k > 0 and not missing[0]):
                    return
                run(lane_id, segment, check=lane_id == 0 and k == 0)
                if not missing[0]:
                    return
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(e)
        finally:
            checked.set()
            for g in groups:   # done or failed: nobody waits for it any longer
                group_done[g].set()

    threads = [threading.Thread(target=lane, args=(i, list(groups)), daemon=True) for i, groups in enumerate(lanes)]
    threads[0].start()
    checked.wait()
    if missing[0] and not errors:
        for t in threads[1:]:
            t.start()
    for t in threads:
        if t.is_alive() or t is threads[0]:
            t.join()
    if errors:
        raise errors[0]
    if not missing[0]:
        counts["loaded"] = len(job_list)
    return {"seconds": time.perf_counter() - t0, **counts}


def precompile_with_progress(say: Callable[[str], None], stream=None, processes: int = 2, env: dict | None = None,
                             variant: str = "float32", kv_cache_dtype: str = "auto"):
    """``precompile`` with its progress shown: a bar (tqdm) on ``stream`` (default stderr) when it
    is a terminal: the share of the estimated work done, the kernels done out of all, the ones
    being compiled; otherwise one line per compiled kernel through ``say``. Ends with one line
    through ``say``: how long it took, how many kernels were compiled and how many came from the
    cache. Returns ``precompile``'s dict; raises what it raises."""
    stream = sys.stderr if stream is None else stream
    job_list = jobs(variant)
    total = len(job_list)
    done = [0]
    bar = None
    if getattr(stream, "isatty", lambda: False)():
        from tqdm import tqdm
        bar = tqdm(total=round(sum(j.seconds for j in job_list), 1), file=stream, desc="checking Numba's cache",
                   bar_format="compiling CPU kernels: {percentage:3.0f}%|{bar:20}| {elapsed} | {desc}", leave=False)
        lock = threading.Lock()

        def show(running):
            now = ", ".join(j.name for j in running)
            bar.set_description_str(f"{done[0]}/{total} done" + (f"; now {now}" if now else ""), refresh=True)

        def on_start(job):
            with lock:
                show([job])

        def progress(job, seconds, compiled, running):
            with lock:
                done[0] += 1
                bar.update(job.seconds)
                show(running)
    else:
        on_start = None

        def progress(job, seconds, compiled, running):
            done[0] += 1
            if compiled:
                say(f"compiled {job.name} ({job.what}) in {seconds:.1f} s [{done[0]}/{total}]")
    try:
        r = precompile(processes, progress=progress, on_start=on_start, env=env, variant=variant,
                       kv_cache_dtype=kv_cache_dtype)
    finally:
        if bar is not None:
            bar.close()
    if r["compiled"]:
        say(f"CPU kernels compiled in {r['seconds']:.1f} s ({r['compiled']} compiled, {r['loaded']} from Numba's "
            f"cache; {r['processes']} processes)")
    else:
        say(f"CPU kernels found in Numba's cache ({r['seconds']:.1f} s)")
    return r


def precompile_for(config, say: Callable[[str], None], stream=None) -> dict | None:
    """``precompile_with_progress`` for an engine of ``config`` (an ``EngineConfig``) in this
    process (``folio.LLM``, ``folio generate``), when its worker runs the CPU kernels on two or
    more threads and the kernels of its weight layout are not all in Numba's cache (checked here,
    without compiling or spawning anything); else None at once, and None where the model's load
    will refuse the configuration (int8 activations of float32 weights: the error comes before a
    kernel is compiled)."""
    if not needed(config.device):
        return None
    variant = weights_variant(config.model, config.dtype, config.quantization, config.load_format,
                              config.activation_quantization)
    if variant == "float32" and config.activation_quantization == "int8":
        return None   # int8 activations of float weights: the load refuses them (model.loader), compile nothing
    if all(in_cache(job, config.kv_cache_dtype) for job in jobs(variant)):
        return None
    return precompile_with_progress(say, stream, variant=variant, kv_cache_dtype=config.kv_cache_dtype)


def _die_with_parent() -> None:
    # Linux: SIGTERM to this compile process when the process (thread) that started it ends
    try:
        import ctypes
        import signal
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass


if __name__ == "__main__":
    _die_with_parent()
    sys.exit(_child_main(sys.argv[1:] or list(GROUPS)))
