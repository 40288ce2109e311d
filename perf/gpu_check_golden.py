"""Correctness of the whole model on the GPU, for perf/gpu_check.sh.

1. ``forward``: one set of dummy weights, made once on the host (``dummy_weights(seed=0)`` rounded
   to bf16), loaded by both a GPU model and a CPU model, whose tensors are checked to hold the same
   values; a prompt as chunked prefills over a shuffled block table, then decodes with split-K
   partitions. Pass criterion: every kernel result of the GPU forward equals the float64 spec on
   the inputs that kernel got, within the bounds derived in tests/support/cuda_bounds.py
   (tests/support/cuda_shadow.py). In the dry run the GPU logits against the CPU forward's are reported too (max error
   over the CPU logits' std, argmax agreement): information, not a pass criterion, since two
   correct forwards that round at many points in different orders drift apart by amounts no
   derived bound makes small (see tests/kernels/test_cuda_kernels.py).
2. ``graphs``: the same greedy decode with CUDA graphs and eagerly (``enforce_eager``): token
   agreement, whether capture worked, and the mean decode step time of each.

3. ``hf_compare``: folio against Hugging Face transformers on the GPU, both loading one folder of
   random weights stored as BF16 (SmolLM2-135M's shape, no model file needed): every logit of a
   served prompt and continuation within a bound derived from bf16 rounding and depth
   (``logit_bound``), and folio's greedy ids equal to transformers' up to a step that is a near
   tie (``hf_compare``).

``--dry`` (perf/gpu_check.sh with FOLIO_GPU_CHECK_DRY=1): the same code on the CUDA table under the
SIMT emulator ($FOLIO_CUDA_TABLE), at sizes the emulator runs in seconds; ``hf_compare`` runs
transformers on the CPU, and where torch is missing reports ``{"skipped": "no torch"}`` instead.

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


BF16_U = 2.0 ** -8  # bf16 unit roundoff (8 significant bits, round to nearest)
TAIL_SIGMAS = 6.0   # a maximum over a vocabulary's worth of roughly normal errors stays below ~5 sigma


def logit_bound(ref_logits: np.ndarray, num_layers: int) -> np.ndarray:
    """Per-row bound on ``|folio - reference|`` logits, ``[rows, 1]`` plus a per-element term.

    Derivation (an error model, not a proof): transformers in bf16 rounds to bf16 about 8 times
    a layer on the path of the residual stream (q, k, v, the attention output, o_proj's output
    and the residual add; gate/up, the activation, down_proj's output and the second add) and
    twice more in the final norm and the logits; folio keeps the residual stream and every
    accumulation in float32 and rounds only the matrix products' inputs. Each rounding is an
    independent relative error of at most ``u = 2^-8``; with random weights of std 0.02 every layer
    is close to the identity on the residual stream, so those errors add in quadrature: the
    hidden state's relative error is ``u sqrt(R)``, ``R = 8 L + 2``, and a linear map (lm_head)
    carries a relative error of the input over to each logit as a roughly normal error of std
    ``u sqrt(R) std(row)``. The bound takes ``TAIL_SIGMAS`` of that, plus the final bf16 rounding of
    each reference logit, ``u |logit|``. The JSON reports the worst ratio of error to bound, so
    a real run shows how much of the bound was used.
    """
    z = np.asarray(ref_logits, np.float64)
    R = 8 * num_layers + 2
    return TAIL_SIGMAS * BF16_U * np.sqrt(R) * z.std(axis=-1, keepdims=True) + BF16_U * np.abs(z)


def write_bf16_safetensors(path, tensors: dict) -> None:
    """``model.safetensors`` (format: https://huggingface.co/docs/safetensors) with every tensor
    stored as BF16 (the float32 values are rounded to nearest even first; folio and transformers
    then read the very same bits)."""
    from folio.kernels.cuda.table import float32_to_bf16_bits

    header, blobs, off = {"__metadata__": {"format": "pt"}}, [], 0  # transformers wants the format
    for name, w in tensors.items():
        b = float32_to_bf16_bits(np.asarray(w, np.float32)).tobytes()
        header[name] = {"dtype": "BF16", "shape": list(np.shape(w)), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little"))
        f.write(h)
        for b in blobs:
            f.write(b)


class _Transformers:
    """The reference: Hugging Face transformers, bf16 on ``device`` (the GPU; the CPU in the dry
    run), from the same folder."""

    name = "transformers"

    def __init__(self, folder, device="cuda"):
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        self.torch, self.device = torch, device
        dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
        self.model = AutoModelForCausalLM.from_pretrained(folder, **{dtype_kw: torch.bfloat16}).to(device).eval()
        self.version = {"transformers": transformers.__version__, "torch": torch.__version__}

    def logits(self, ids):
        with self.torch.no_grad():
            x = self.torch.tensor([list(ids)], dtype=self.torch.long, device=self.device)
            return self.model(x).logits[0].float().cpu().numpy()

    def greedy(self, prompt, n):
        with self.torch.no_grad():
            x = self.torch.tensor([list(prompt)], dtype=self.torch.long, device=self.device)
            out = self.model.generate(x, attention_mask=self.torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                                      do_sample=False, pad_token_id=0)
            return out[0, len(prompt):].tolist()

    def close(self):
        del self.model
        if self.device == "cuda":
            self.torch.cuda.empty_cache()


def hf_compare(dry: bool) -> dict:
    """folio's CUDA forward and engine against transformers with the same random bf16 weights.

    One folder (config.json of SmolLM2-135M's shape, a synthetic tokenizer, random weights written
    as BF16 safetensors) is loaded by both. (1) Logits: the reference's one forward over prompt +
    its greedy continuation, against folio's forward over the same ids as it serves them (chunked
    prefills, then one decode step per token, split-K partitions): every logit within
    ``logit_bound``. (2) Greedy ids: folio's engine (``LLM(device="cuda")``, CUDA graphs) against
    the reference's greedy continuation, step by step up to the first difference, which passes
    only at a near tie: a reference top-1 / top-2 margin below twice the bound there. In ``--dry``
    transformers runs on the CPU; without torch there the comparison is not made and the result
    says so (``{"skipped": "no torch", ...}``, which does not fail the check); on a GPU a missing
    torch is a failure.
    """
    from gpu_check_bench import SMOLLM2_135M, synthetic_tokenizer

    from folio import LLM, SamplingParams
    from folio.kernels import get_kernels
    from folio.model.config import ModelConfig
    from folio.model.loader import allocate_kv_caches, load_model
    from folio.model.weights import dummy_weights

    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        if not dry:
            return {"ok": False, "error": f"transformers / torch missing: {e}"}
        return {"skipped": "no torch", "reason": f"{type(e).__name__}: {e}"}
    cfg = dict(SMOLLM2_135M, num_hidden_layers=2, vocab_size=2048) if dry else SMOLLM2_135M
    config = ModelConfig.from_dict(cfg)
    t0 = time.perf_counter()
    n_prompt, n_gen = (40, 6) if dry else (300, 24)
    with tempfile.TemporaryDirectory(prefix="folio-hf-compare-") as d:
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f)
        synthetic_tokenizer(d, cfg["vocab_size"])
        write_bf16_safetensors(os.path.join(d, "model.safetensors"), dummy_weights(config, seed=3))
        ref = _Transformers(d, "cpu" if dry else "cuda")
        prompt = np.random.default_rng(2).integers(0, cfg["vocab_size"], n_prompt).tolist()
        ref_gen = ref.greedy(prompt, n_gen)
        ids = np.asarray(prompt + ref_gen, np.int64)
        ref_logits = ref.logits(ids)
        ref.close()

        # (1) folio's forward over the same ids, as served: prefill chunks, then decode steps
        model, _, _ = load_model(d, "cuda")
        k = get_kernels("cuda")
        chunk = 32 if dry else 128
        steps = [(s, min(s + chunk, n_prompt)) for s in range(0, n_prompt, chunk)]
        steps += [(i, i + 1) for i in range(n_prompt, len(ids))]
        bt = np.random.default_rng(4).permutation(2 * (len(ids) // 16 + 1))[: len(ids) // 16 + 1].astype(np.int32)
        old_part = k.decode_partition_size
        k.decode_partition_size = 16 if dry else 64  # decodes over several split-K partitions
        try:
            got = np.concatenate(_run(model, k, allocate_kv_caches(config, int(bt.max()) + 1, 16, k), ids, bt, steps))
        finally:
            k.decode_partition_size = old_part
        del model
        bound = logit_bound(ref_logits, config.num_hidden_layers)
        err = np.abs(got.astype(np.float64) - ref_logits)
        ratio = float((err / bound).max())
        logits_ok = bool(np.isfinite(got).all() and ratio <= 1.0)

        # (2) folio's engine, greedy, against the reference's continuation
        llm = LLM(model=d, device="cuda", max_model_len=512, max_num_seqs=4, max_num_batched_tokens=256,
                  gpu_memory_utilization=0.3)
        out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=n_gen,
                                                                        ignore_eos=True), use_tqdm=False)
        gen = list(out[0].outputs[0].token_ids)
        del llm
    first = next((i for i, (a, b) in enumerate(zip(gen, ref_gen)) if a != b), None)
    margin = None
    if first is not None:
        row = np.sort(ref_logits[n_prompt - 1 + first])[::-1]
        margin = float(row[0] - row[1])
        near_tie = margin < 2 * float(bound[n_prompt - 1 + first].max())
    greedy_ok = first is None or near_tie
    return {"reference": ref.name, **ref.version, "seconds": round(time.perf_counter() - t0, 2),
            "layers": config.num_hidden_layers, "tokens": len(ids),
            "logits": {"max_err_over_bound": round(ratio, 4), "max_abs_err": round(float(err.max()), 5),
                       "bound_median": round(float(np.median(bound)), 5), "ok": logits_ok},
            "greedy": {"folio": gen, "reference": ref_gen, "first_difference": first,
                       "margin_at_difference": margin, "ok": bool(greedy_ok)},
            "ok": logits_ok and bool(greedy_ok)}


def _steps(config: dict, n_prompt: int, chunk: int, decodes: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    n = n_prompt + decodes
    ids = rng.integers(0, config["vocab_size"], n).astype(np.int64)
    bt = rng.permutation(2 * (n // 16 + 1))[: n // 16 + 1].astype(np.int32)
    steps = [(s, min(s + chunk, n_prompt)) for s in range(0, n_prompt, chunk)]
    steps += [(n_prompt + i, n_prompt + i + 1) for i in range(decodes)]
    return ids, bt, steps


def _run(model, kernels, caches, ids, bt, steps) -> list:
    from folio.model.attention_metadata import AttentionMetadata

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
    from support.cuda_shadow import SpecCheckedKernels
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
    if g is not None and dry:  # (on a GPU: hf_compare compares with transformers, no Numba compile here)
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
    p.add_argument("--dry", action="store_true", help="small sizes (the CUDA table under the SIMT emulator)")
    args = p.parse_args(argv)
    result = {}
    for name, fn in (("forward", lambda: forward(args.dry)), ("graphs", lambda: graphs(args.dry)),
                     ("hf_compare", lambda: hf_compare(args.dry))):
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
