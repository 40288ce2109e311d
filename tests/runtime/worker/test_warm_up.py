"""``LLMEngine.warm_up()`` compiles every CPU kernel a served or benchmarked workload meets.

Numba compiles a kernel per argument signature the first time it is called with it (or loads that
signature from its disk cache). A signature first met inside a timed run puts its compilation
(~1-2 minutes for the whole forward on a cold cache) into the figures: the benchmark report once
recorded 39 output tok/s for a run whose warm figure was 97. So the check is on the signatures
themselves, not on time: after ``warm_up()``, a mixed workload (chunked prefills beside decodes,
prompts from under a block to several tiles, sampled and greedy, n > 1, logprobs, prompt logprobs,
penalties, stop strings, a beam search, single-sequence decode)
adds no signature to any Numba dispatcher in folio's CPU kernels.

It runs in a fresh interpreter: in the test process, earlier tests have already called the kernels
with most signatures, which would hide any the warm-up misses.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import importlib, json, sys
    import numba
    from folio import SamplingParams
    from perf.bench.common import random_requests
    from folio.runtime.common.config import EngineConfig
    from folio.runtime.scheduler.engine import LLMEngine
    from folio.runtime.worker.model_runner import ModelRunner
    from folio.runtime.common.sampling_params import BeamSearchParams
    from folio.kernels.cpu.jit_cache import KERNEL_MODULES

    # every CPU kernel module, as the Numba cache stamp lists them (a new one is covered too)
    MODULES = [importlib.import_module("folio.kernels.cpu." + name[:-3]) for name in KERNEL_MODULES]

    def signatures():
        out = {}
        for m in MODULES:
            for name, obj in vars(m).items():
                if isinstance(obj, numba.core.dispatcher.Dispatcher):
                    out[f"{m.__name__}.{name}"] = sorted(str(s) for s in obj.signatures)
        return out

    engine = LLMEngine(cfg := EngineConfig(device="cpu", num_kv_blocks_override=512, max_num_batched_tokens=256), ModelRunner(cfg))
    engine.warm_up()
    before = signatures()
    # chunked prefills (budget 256) beside decodes, prompts of 3 to 700 tokens
    for i, r in enumerate(random_requests(12, (3, 700), (2, 12), seed=1)):
        sp = SamplingParams(max_tokens=r.output_len, ignore_eos=True,
                            temperature=0.0 if i % 2 else 0.8, top_p=1.0 if i % 3 else 0.9, seed=i)
        engine.add_request(f"w{i}", None, sp, prompt_token_ids=r.prompt_token_ids)
    engine.add_request("n3", None, SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=3),
                       prompt_token_ids=list(range(100, 160)))
    # the sampler's other paths: logprobs, prompt logprobs, penalties with top-k / min-p, stop
    # strings and tokens, and a beam search (its candidates fork and free blocks)
    extra = [SamplingParams(max_tokens=4, logprobs=5, temperature=0.0),
             SamplingParams(max_tokens=2, prompt_logprobs=3, temperature=0.0),
             SamplingParams(max_tokens=4, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2,
                            top_k=20, min_p=0.05, seed=1),
             SamplingParams(max_tokens=8, stop=["the", "."], stop_token_ids=[13], min_tokens=2),
             BeamSearchParams(beam_width=3, max_tokens=4)]
    for i, sp in enumerate(extra):
        engine.add_request(f"x{i}", None, sp, prompt_token_ids=list(range(300 + i, 340 + i)))
    while engine.has_unfinished_requests():
        engine.step()
    # one sequence alone, long context: single-sequence decode over key ranges
    engine.add_request("long", None, SamplingParams(max_tokens=4, ignore_eos=True),
                       prompt_token_ids=list(range(200, 1100)))
    while engine.has_unfinished_requests():
        engine.step()
    after = signatures()
    engine.shutdown()
    new = {k: sorted(set(v) - set(before.get(k, []))) for k, v in after.items()}
    json.dump({k: v for k, v in new.items() if v}, sys.stdout)
""")


def test_no_kernel_compiles_after_warm_up(default_model_dir):
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    new = json.loads(r.stdout.strip().splitlines()[-1])
    assert new == {}, f"signatures first compiled after warm_up(): {new}"


def test_warm_up_fits_small_engines_and_leaves_them_as_found(default_model_dir):
    """warm_up() skips what an engine cannot run (one sequence at a time: no n = 2 request; a
    two-block cache; a tiny step budget), then the engine serves as a fresh one would: every block
    free, none in the prefix cache, and the same greedy tokens as an engine that never warmed up."""
    from folio import SamplingParams
    from folio.runtime.common.config import EngineConfig
    from folio.runtime.scheduler.engine import LLMEngine
    from folio.runtime.worker.model_runner import ModelRunner

    def greedy(engine):
        engine.add_request("q", None, SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0),
                           prompt_token_ids=[504, 3575, 282, 4649, 314])
        outs = []
        while engine.has_unfinished_requests():
            outs += [o for o in engine.step() if o.finished]
        return [list(c.token_ids) for c in outs[0].outputs]

    for kw in (dict(max_num_seqs=1, num_kv_blocks_override=64), dict(max_model_len=40, block_size=32, num_kv_blocks_override=2),
               dict(max_model_len=16, block_size=8, num_kv_blocks_override=3, max_num_batched_tokens=8)):
        cfg = dict(device="cpu", async_scheduling=False, model=str(default_model_dir), **kw)
        cold = LLMEngine(EngineConfig(**cfg), ModelRunner(EngineConfig(**cfg)))
        try:
            expected = greedy(cold)
        finally:
            cold.shutdown()
        engine = LLMEngine(EngineConfig(**cfg), ModelRunner(EngineConfig(**cfg)))
        try:
            free = engine.get_metrics()["num_free_blocks"]
            engine.warm_up()
            m = engine.get_metrics()
            assert (m["num_free_blocks"], m["num_cached_blocks"]) == (free, 0), kw
            assert greedy(engine) == expected, kw
        finally:
            engine.shutdown()


PRECOMPILE_SCRIPT = SCRIPT[:SCRIPT.index("engine = LLMEngine(")] + textwrap.dedent("""
    from folio.runtime.worker.precompile import compile_job, jobs, weights_variant
    kv, act = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "auto")
    # the default model's layout (its GGUF types), with its default (float32) or int8 activations
    for job in jobs(weights_variant(EngineConfig().model, activation_quantization=act)):
        compile_job(job, kv)
    before = signatures()
    engine = LLMEngine(cfg := EngineConfig(device="cpu", num_kv_blocks_override=512, kv_cache_dtype=kv,
                                           activation_quantization=act), ModelRunner(cfg))
    engine.warm_up()
    after = signatures()
    engine.shutdown()
    new = {k: sorted(set(v) - set(before.get(k, []))) for k, v in after.items()}
    json.dump({k: v for k, v in new.items() if v}, sys.stdout)
""")


@pytest.mark.parametrize("kv_cache_dtype, activations", [("auto", None), ("bfloat16", None), ("auto", "int8")])
def test_precompile_jobs_cover_the_warm_up(default_model_dir, kv_cache_dtype, activations):
    """``folio serve`` compiles ``runtime/worker/precompile.JOBS`` ahead, in other processes, so
    that its worker's warm-up only loads machine code from Numba's cache: after the jobs (compiled
    or loaded here, in a fresh interpreter), the warm-up adds no signature to any CPU kernel. With
    ``test_no_kernel_compiles_after_warm_up`` this covers the served workload too. For each KV
    cache dtype: the jobs compiled for a bfloat16 cache cover a bfloat16 engine's warm-up; with
    ``--activation-quantization int8`` (variant ``quantized-int8``) they cover that engine's."""
    from folio.runtime.worker import precompile
    if not precompile.needed("cpu"):
        pytest.skip("one kernel thread: the jobs are the two-thread paths and folio serve skips them")
    r = subprocess.run([sys.executable, "-c", PRECOMPILE_SCRIPT, kv_cache_dtype, *([activations] if activations else [])],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    new = json.loads(r.stdout.strip().splitlines()[-1])
    assert new == {}, f"signatures the warm-up compiled beyond precompile.JOBS: {new}"


ITEM_SCRIPT = textwrap.dedent("""
    import json, sys
    from folio.kernels.cpu import quant_int8, quant_linear
    from folio.runtime.worker.precompile import compile_job, jobs
    for variant in sys.argv[1:]:
        compile_job(next(j for j in jobs(variant) if j.function == "_phase_item"))
        print(json.dumps({"int8_rows": bool(quant_int8.int8_rows.signatures),
                          "quant_task_rows_f32": bool(quant_linear.quant_task_rows_f32.signatures)}), flush=True)
""")


def test_the_int8_kernels_are_compiled_only_for_int8_activations(tmp_path):
    """The layer loop's item picks the products' entry by its ``int8`` argument
    (``forward.product_item``): without int8 activations (the default model's default) its call tree holds none of
    the integer kernels, so a cold start compiles none of them (~10 CPU s less); with them
    (``quantized-int8``) it holds them. From an empty Numba cache, in a fresh interpreter, where
    compiling a function compiles every callee (one loaded from a cache compiles none). Both
    variants in one process, float32 first (the int8 item then compiles only what it adds)."""
    import os
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-c", ITEM_SCRIPT, "quantized", "quantized-int8"], capture_output=True,
                       text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    first, second = (json.loads(line) for line in r.stdout.strip().splitlines()[-2:])
    assert first == {"int8_rows": False, "quant_task_rows_f32": True}
    assert second == {"int8_rows": True, "quant_task_rows_f32": True}


def test_precompile_fills_the_cache_and_reports_each_kernel(default_model_dir):
    """``precompile_with_progress`` off a terminal: one line per kernel it compiled and a last
    line; afterwards every job is in the cache index, and a second call finds them all there with
    one process, which compiles nothing."""
    import io

    from folio.runtime.worker import precompile
    lines = []
    first = precompile.precompile_with_progress(lines.append, stream=io.StringIO())
    assert first["compiled"] + first["loaded"] == len(precompile.JOBS)
    assert len([x for x in lines if x.startswith("compiled ")]) == first["compiled"]
    assert lines[-1].startswith("CPU kernels ")
    assert all(precompile.in_cache(job) for job in precompile.JOBS)
    lines.clear()
    again = precompile.precompile_with_progress(lines.append, stream=io.StringIO())
    assert (again["compiled"], again["loaded"], again["processes"]) == (0, len(precompile.JOBS), 1)
    assert lines == [lines[-1]] and lines[-1].startswith("CPU kernels found in Numba's cache")


def test_precompile_lanes_keep_each_group_in_one_process_after_what_it_waits_for():
    """Every group runs in one lane, once; a group that waits for another runs after it (later in
    the same lane, or in another lane, which it waits for); the layer loop waits for every group
    whose functions it links."""
    from folio.runtime.worker import precompile
    names = [j.name for j in precompile.JOBS]
    assert len(names) == len(set(names))
    assert set(precompile.AFTER[precompile.LAST_GROUP]) == {"attention", "linear"}
    for n in (1, 2, 3):
        lanes = precompile._lanes(n)
        flat = [g for lane in lanes for g in lane]
        assert sorted(flat) == sorted(precompile.GROUPS), n
        for lane in lanes:
            for i, g in enumerate(lane):
                assert g not in precompile.AFTER.get(g, ())
                for d in precompile.AFTER.get(g, ()):
                    assert d in lane[:i] or d not in lane, (n, lane, g)


def test_int8_activations_of_float_weights_are_refused_before_compiling(monkeypatch):
    # `--dtype float32 --activation-quantization int8`: the load refuses it, and nothing is compiled
    # first (the trial saw the refusal only after an 11 s kernel compile)
    from folio.runtime.common.config import EngineConfig
    from folio.runtime.worker import precompile
    monkeypatch.setattr(precompile, "needed", lambda device: True)
    monkeypatch.setattr(precompile, "in_cache", lambda *a, **k: False)   # as on a fresh machine
    monkeypatch.setattr(precompile, "precompile_with_progress", lambda *a, **k: pytest.fail("compiled first"))
    cfg = EngineConfig(device="cpu", dtype="float32", activation_quantization="int8")
    assert precompile.weights_variant(cfg.model, cfg.dtype) == "float32"
    assert precompile.precompile_for(cfg, lambda s: None) is None
    with pytest.raises(ValueError, match="activation-quantization"):
        from folio import LLM
        LLM(dtype="float32", activation_quantization="int8")
