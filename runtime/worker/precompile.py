"""Compile the CPU kernels of the serving paths into Numba's on-disk cache, in parallel processes.

Without it, a server's first step on a fresh clone compiles every kernel it meets, one after the
other, in the worker process. ``precompile`` compiles the same signatures before that step, in
``processes`` child processes, while the worker loads the model; the worker's first step then
loads the machine code from the cache (``jit_cache``). It reports each compiled kernel to
``progress``. What it compiles it asks the CPU kernel table:
``precompile_jobs(variant)``, ``CompileJob``s that each kernel module declares beside its kernels
(``kernels/cpu/compile_jobs.py`` has their signatures' type names and groups).

Numba's cache is safe to share between processes for *different* functions only: two processes
that add signatures of one function at once can both write their entry under the same data file
name, and one index then names the other's code (``numba/core/caching.py``,
``IndexDataCacheFile.save``: read the index, pick the first free name, write). So the jobs come
in groups whose call trees share no compiled function (``job.group``); a group runs in one
process, in order, and a group that compiles signatures of another group's functions or links
them waits for it (``job.after``): the layer loop's work item (``forward._phase_item``), which
links the attention, product and row kernels, compiles after them, loading theirs, while the other
process compiles what only the steps' Python code calls and the parallel regions (``LANES``).

What a cold start compiles is kept small: Numba links every callee's LLVM module into
its caller and optimizes and code-generates the whole tree again for each compiled function (a
parallel region four times: the loop body, two gufunc wrappers, the function), so the cost is a
tree's size times the levels above it. Hence: the regions call their item function at its address
instead of linking it (``forward._call_item``); the products' entry leaves out the integer kernels
unless int8 activations were asked for (variant ``quantized-int8``); one signature per function
(``lm_head`` runs the layers' product entry, ``forward.quantized_linear``); ``attention_item``
inlined; no parallel loops besides the ``prange``.

The KV caches are the jobs' only 4-D arrays: float32, or with ``--kv-cache-dtype bfloat16`` uint16
(``kernels/cpu/kv_dtype.py``). ``precompile`` compiles the variants of the configured cache dtype
only (the kernels have one per dtype), so a bfloat16 server compiles no float32 cache variant and
the default server none of the bfloat16 ones. Likewise for the weights (``VARIANTS``): float32
stacks, or GGUF-typed weights (a ``.gguf`` file served as stored), never both.

Only what a worker with two or more kernel threads runs (``forward._layers_region``: one parallel
region per step) is listed; with one thread the first step compiles its own path.
``tests/runtime/worker/test_warm_up.py`` checks that the jobs leave nothing for the warm-up to
compile. A kernel whose arguments change needs its declared job changed with it (that test fails
until it is).

``JOBS``, ``GROUPS``, ``AFTER`` and ``VARIANTS`` are read from the table when first used (importing
this module compiles and imports no kernel):

* ``JOBS``: what ``precompile`` compiles for a float32 model (``jobs("float32")``); ``jobs(variant)``
  for another weight layout;
* ``GROUPS``: the jobs' groups, in the order they compile; ``AFTER``: the groups each group waits
  for (``layers`` links the functions of ``attention`` and ``linear``: it runs after them, loading
  them, and compiles only its own item function; ``rest`` compiles signatures of functions that
  ``linear`` compiled too and the regions, which link its scratch and counter functions: it runs
  after ``linear`` in the same process, beside ``layers``, which only loads them);
* ``VARIANTS``: the weight layouts a worker can run: float32 stacks, or weights in GGUF types
  (products with float32 activations, or with int8 activations: ``weights_variant``).

    python -m folio.runtime.worker.precompile [--variant V] [--check] [--kv-cache-dtype NAME] [GROUP ...]

Sources: Numba's documentation, "Compiling Python code with @jit" (explicit signatures,
``Dispatcher.compile``) and "Notes on caching" (the cache is shared by processes on one machine).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from typing import Callable

from ...kernels import get_kernels
from ...kernels.table import CompileJob, CpuKernelTable

__all__ = ["JOBS", "VARIANTS", "jobs", "weights_variant", "GROUPS", "LAST_GROUP", "AFTER", "LANES", "precompile",
           "precompile_with_progress", "precompile_for", "compile_job", "in_cache", "needed"]


def _kernels() -> CpuKernelTable:
    return get_kernels("cpu")


def jobs(variant: str = "float32") -> tuple:
    """The ``CompileJob``s of ``variant`` (``VARIANTS``), group by group, each group's in the order
    they compile (the CPU table's ``precompile_jobs``).

    Raises:
        ValueError: an unknown variant.
    """
    kernels = _kernels()
    return kernels.precompile_jobs(variant)


def _groups(job_list) -> tuple:
    return tuple(dict.fromkeys(j.group for j in job_list))


def _after(job_list) -> dict:
    return {j.group: tuple(j.after) for j in job_list if j.after}


def __getattr__(name: str):
    # JOBS, GROUPS, AFTER, VARIANTS: read from the CPU table when first asked for (module docstring)
    if name == "JOBS":
        return jobs("float32")
    if name == "GROUPS":
        return _groups(jobs("float32"))
    if name == "AFTER":
        return _after(jobs("float32"))
    if name == "VARIANTS":
        kernels = _kernels()
        return tuple(kernels.precompile_variants)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


LAST_GROUP = "layers"
"""The group that waits for the most others (the layer loop's work item)."""
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


def compile_job(job: CompileJob, kv_cache_dtype: str = "auto") -> bool:
    """Compile (or load from the cache) ``job`` in this process, for KV caches of
    ``kv_cache_dtype`` (a ``--kv-cache-dtype`` name); returns True if it compiled."""
    return job.compile(kv_cache_dtype)


def in_cache(job: CompileJob, kv_cache_dtype: str = "auto") -> bool:
    """Whether Numba's cache index holds ``job`` for this machine and the current sources,
    without loading it."""
    return job.in_cache(kv_cache_dtype)


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


def _lanes(processes: int, job_list=None) -> list[list[str]]:
    # LANES with two processes or more; one process: every group, each after those it waits for
    if processes >= len(LANES):
        return [list(lane) for lane in LANES]
    job_list = jobs() if job_list is None else job_list
    after = _after(job_list)
    order: list[str] = []
    for g in _groups(job_list):
        order += [d for d in after.get(g, ()) if d not in order]
        if g not in order:
            order.append(g)
    return [order]


def _segments(groups: list[str], after: dict) -> list[list[str]]:
    """A lane's groups in as few processes as the waits allow: a new process where a group waits
    for a group of another lane (one not earlier in this lane)."""
    segments: list[list[str]] = []
    for i, g in enumerate(groups):
        if not segments or any(d not in groups[:i] for d in after.get(g, ())):
            segments.append([])
        segments[-1].append(g)
    return segments


class _Compilation:
    """The state the lanes of one ``precompile`` share (one thread per lane, each running its
    child processes one after the other): the jobs under way, the counts, the groups done, the
    cache check's answer and the first error."""

    def __init__(self, job_list: tuple, variant: str, kv_cache_dtype: str, env: dict | None,
                 progress: Callable | None, on_start: Callable | None):
        self.job_list, self.variant, self.kv_cache_dtype = job_list, variant, kv_cache_dtype
        self.env = env if env is not None else os.environ.copy()
        self.progress, self.on_start = progress, on_start
        self.by_name = {j.name: j for j in job_list}
        self.after = _after(job_list)
        self.lock = threading.Lock()
        self.running: dict[int, CompileJob] = {}
        self.counts = {"compiled": 0, "loaded": 0, "processes": 0}
        self.checked = threading.Event()   # the first child answered (or ended)
        self.missing = len(job_list)       # jobs not in the cache, as the first child counted them
        self.group_done = {g: threading.Event() for g in _groups(job_list)}
        self.errors: list[BaseException] = []

    def run_lane(self, lane_id: int, groups: list[str]) -> None:
        """Run ``groups`` in their processes (``_segments``), each after the groups of other lanes
        it waits for; the first process of lane 0 checks the cache index first, and nothing more
        runs once it found every job there. Errors are kept for the caller's thread."""
        try:
            for k, segment in enumerate(_segments(groups, self.after)):
                for g in segment:
                    for d in self.after.get(g, ()):
                        if d not in segment:
                            self.group_done[d].wait()
                if self.errors or (k > 0 and not self.missing):
                    return
                self.run_child(lane_id, segment, check=lane_id == 0 and k == 0)
                if not self.missing:
                    return
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            self.errors.append(e)
        finally:
            self.checked.set()
            for g in groups:   # done or failed: nobody waits for it any longer
                self.group_done[g].set()

    def run_child(self, lane_id: int, groups: list[str], check: bool) -> None:
        """One child process compiling ``groups`` (``_child_main``), its lines read as they come.

        Raises:
            RuntimeError: the child failed (its last output lines in the message).
        """
        lane_jobs = [j for g in groups for j in self.job_list if j.group == g]
        cmd = [sys.executable, "-m", __name__, "--variant", self.variant, *(["--check"] if check else []),
               "--kv-cache-dtype", self.kv_cache_dtype, *groups]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.env)
        with self.lock:
            self.counts["processes"] += 1
        if not check:
            self._start(lane_id, lane_jobs[0])
        tail = []
        for line in proc.stdout:
            parts = line.split()
            if len(parts) == 2 and parts[0] == "missing":
                self.missing = int(parts[1])
                self.checked.set()
                if self.missing:
                    self._start(lane_id, lane_jobs[0])
            elif len(parts) == 4 and parts[0] == "done" and parts[1] in self.by_name:
                self._done(lane_id, lane_jobs, self.by_name[parts[1]], float(parts[2]), parts[3] == "C")
            else:
                tail.append(line)
        err = proc.stderr.read()
        self.checked.set()
        if proc.wait() != 0:
            raise RuntimeError(f"kernel compile process ({' '.join(groups)}) failed with exit code {proc.returncode}:\n"
                               + "".join(tail[-10:]) + err[-3000:])

    def _start(self, lane_id: int, job: CompileJob) -> None:
        with self.lock:
            self.running[lane_id] = job
        if self.on_start:
            self.on_start(job)

    def _done(self, lane_id: int, lane_jobs: list, job: CompileJob, seconds: float, compiled: bool) -> None:
        # count the job, mark the next of the lane running (and the group done at its last job), report
        k = lane_jobs.index(job)
        nxt = lane_jobs[k + 1] if k + 1 < len(lane_jobs) else None
        with self.lock:
            self.counts["compiled" if compiled else "loaded"] += 1
            if nxt is None:
                self.running.pop(lane_id, None)
            else:
                self.running[lane_id] = nxt
            now = list(self.running.values())
        if nxt is None or nxt.group != job.group:
            self.group_done[job.group].set()
        if self.progress:
            self.progress(job, seconds, compiled, now)
        if nxt is not None and self.on_start:
            self.on_start(nxt)


def precompile(processes: int = 2, progress: Callable[[CompileJob, float, bool, list], None] | None = None,
               on_start: Callable[[CompileJob], None] | None = None, env: dict | None = None,
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
    job_list = jobs(variant)
    run = _Compilation(job_list, variant, kv_cache_dtype, env, progress, on_start)
    threads = [threading.Thread(target=run.run_lane, args=(i, list(groups)), daemon=True)
               for i, groups in enumerate(_lanes(processes, job_list))]
    threads[0].start()
    run.checked.wait()   # the other lanes start only when the first found something missing
    if run.missing and not run.errors:
        for t in threads[1:]:
            t.start()
    for t in threads:
        if t.is_alive() or t is threads[0]:
            t.join()
    if run.errors:
        raise run.errors[0]
    if not run.missing:
        run.counts["loaded"] = len(job_list)
    return {"seconds": time.perf_counter() - t0, **run.counts}


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
    sys.exit(_child_main(sys.argv[1:] or list(_groups(jobs()))))
