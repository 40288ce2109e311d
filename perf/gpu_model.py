"""A roofline cost model of folio's GPU step, run without a GPU.

For each kernel a step launches (model/llama.py's order over the CUDA table, kernels/cuda/*.cu) it
counts the bytes the kernel must move to and from HBM and the FLOPs it does, and bounds its time on
a named card by ``max(bytes / HBM bandwidth, FLOPs / dense bf16 peak)`` (Williams, Waterman and
Patterson, "Roofline", CACM 2009). Bytes are what each kernel reads and writes once, as folio's
kernels store their operands today (bf16 weights and KV cache, float32 residual stream and matrix
product outputs, bf16 matmul inputs); caches, re-reads and launch gaps are not counted, so the
bound is a floor for these kernels.

Two bounds for a workload (perf/gpu_check.sh's: ``perf/gpu_check_bench.py``'s requests):

* ``ideal``: each step at ``max((weights + KV bytes) / bandwidth, FLOPs / peak)``, the least
  traffic any implementation of the step has (activations not counted). The schedule: every prompt
  prefilled first in steps of ``max_num_batched_tokens`` tokens, then one decode step per output
  token after the first, over the sequences still running.
* ``kernels``: the same schedule, each step the sum over its kernels of each kernel's own bound
  (folio's kernels, each at the roofline, back to back).

Cards (``CARDS``): HBM bandwidth and dense bf16 tensor-core peak from NVIDIA's data sheets (the
data sheets give the bf16 figure with 2:4 sparsity; dense is half of it), SM counts from NVIDIA's
"H100 Tensor Core GPU Architecture" whitepaper.

Usage: python perf/gpu_model.py [--card h200|h100-sxm|all] [--model NAME|all] [--measured gpu_check.json]
       [--json OUT]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Card:
    """One GPU's limits: ``hbm_bytes_per_s`` HBM bandwidth, ``bf16_flops`` dense bf16 tensor-core
    FLOP/s, ``num_sms`` streaming multiprocessors; ``source`` names the documents."""

    key: str
    name: str
    hbm_bytes_per_s: float
    bf16_flops: float
    num_sms: int
    source: str


CARDS = {
    "h100-sxm": Card("h100-sxm", "NVIDIA H100 SXM5 80GB", 3.35e12, 1979e12 / 2, 132,
                     "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column: GPU memory bandwidth "
                     "3.35 TB/s, BF16 Tensor Core 1,979 teraFLOPS with sparsity; SMs: NVIDIA H100 "
                     "Tensor Core GPU Architecture whitepaper (132 SMs, SXM5)"),
    "h200": Card("h200", "NVIDIA H200 SXM 141GB", 4.8e12, 1979e12 / 2, 132,
                 "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column: GPU memory bandwidth 4.8 TB/s, "
                 "BF16 Tensor Core 1,979 teraFLOPS with sparsity; SMs: as the H100 SXM5 (GH100, 132 SMs)"),
}


def card_for(nvidia_smi_name: str) -> Card | None:
    """The card whose name ``nvidia-smi`` reports (``"NVIDIA H200, ..."``), or None."""
    s = nvidia_smi_name.upper()
    if "H200" in s:
        return CARDS["h200"]
    if "H100" in s and "PCIE" not in s and "NVL" not in s:
        return CARDS["h100-sxm"]
    return None


@dataclass(frozen=True)
class Shape:
    """The Llama shape the cost depends on (a Hugging Face config's fields)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_config(cls, c: dict) -> "Shape":
        return cls(c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["num_attention_heads"],
                   c["num_key_value_heads"], c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
                   c["vocab_size"])

    @property
    def qkv(self) -> int:
        """Output width of the fused q/k/v projection."""
        return (self.heads + 2 * self.kv_heads) * self.head_dim

    def linears(self) -> list[tuple[str, int, int]]:
        """``(name, in, out)`` of one layer's matrix products, in launch order."""
        H, I, Q = self.hidden, self.intermediate, self.heads * self.head_dim
        return [("qkv_proj", H, self.qkv), ("o_proj", Q, H), ("gate_up_proj", H, 2 * I), ("down_proj", I, H)]

    def layer_weight_elems(self) -> int:
        return sum(i * o for _, i, o in self.linears()) + 2 * self.hidden  # + the two norms

    def weight_bytes_per_step(self, wbytes: int = 2) -> int:
        """Weights every step reads: every layer, the final norm and the lm_head (the embedding
        table only in the rows gathered, counted with the embedding kernel)."""
        return wbytes * (self.layers * self.layer_weight_elems() + self.hidden + self.vocab * self.hidden)

    def kv_bytes_per_token(self, kv_bytes: int = 2) -> int:
        """K and V of one token over every layer."""
        return 2 * self.layers * self.kv_heads * self.head_dim * kv_bytes


@dataclass
class KernelCost:
    """One kernel of a step: ``calls`` launches per step, ``bytes`` / ``flops`` over all of them."""

    name: str
    calls: int
    bytes: float
    flops: float

    def seconds(self, card: Card) -> float:
        return max(self.bytes / card.hbm_bytes_per_s, self.flops / card.bf16_flops)

    def bound_by(self, card: Card) -> str:
        return "HBM" if self.bytes / card.hbm_bytes_per_s >= self.flops / card.bf16_flops else "bf16"


def step_kernels(shape: Shape, query_lens, context_lens, sampled_rows: int, *, kv_bytes: int = 2,
                 act_bytes: int = 4, sampler_passes: float = 1.0, block_size: int = 16,
                 prefill_rows: int = 64) -> list[KernelCost]:
    """The kernels of one step and what each moves and computes.

    Args:
        query_lens, context_lens: per sequence, new tokens this step and its context after the
            step (a decode row: 1 and prompt + tokens so far).
        sampled_rows: rows whose logits are computed and sampled.
        kv_bytes: bytes per KV cache element (2: bf16); act_bytes: bytes of a float32 residual /
            matmul output element (4 today).
        sampler_passes: passes of the sampling kernel over the logits (1: argmax, greedy or
            Gumbel-max; about 2.5 for the inverse-CDF path: max, total, the scan to the pick).
        prefill_rows: rows of (token, query head) per prefill attention block (attention.cu).
    Returns:
        ``KernelCost`` rows in launch order (per-layer kernels summed over the layers).
    """
    s = shape
    q = [int(x) for x in query_lens]
    c = [int(x) for x in context_lens]
    T, R, L, H, D = sum(q), int(sampled_rows), s.layers, s.hidden, s.head_dim
    Hq, Hkv, I, V = s.heads, s.kv_heads, s.intermediate, s.vocab
    out = [KernelCost("embedding", 1, T * 8 + T * H * 2 + T * H * act_bytes, 0)]
    norm_bytes = T * H * (3 * act_bytes + 2) + H * 2  # x + residual in, residual + bf16 out
    out.append(KernelCost("rms_norm (layer 0) + fused_add_rms_norm", 2 * L,
                          (2 * L - 1) * norm_bytes + T * H * (act_bytes + 2) + H * 2, 0))
    for name, i, o in s.linears():
        out.append(KernelCost(name, L, L * (i * o * 2 + T * i * 2 + T * o * act_bytes), L * 2.0 * T * i * o))
    # rope_and_cache: the fused projection in, bf16 queries and this step's K/V out
    out.append(KernelCost("rope_and_cache", L, L * (T * s.qkv * act_bytes + T * D * 4 + T * 16
                                                    + T * Hq * D * 2 + T * 2 * Hkv * D * kv_bytes), 0))
    # attention: q in, K and V of the visible context once per (KV head, block), bf16 out
    decode = all(n == 1 for n in q)
    kv_elem = Hkv * D * kv_bytes
    if decode:
        keys = sum(c)
        kv_read = 2 * keys * kv_elem + sum(-(-x // block_size) for x in c) * 4
        flops = 4.0 * Hq * D * keys
    else:  # a prefill tile of prefill_rows / group tokens reads the keys its last token sees
        tpt = max(1, prefill_rows // (Hq // Hkv))
        kv_read = flops = 0.0
        for n, ctx in zip(q, c):
            start = ctx - n
            for t0 in range(0, n, tpt):
                kv_read += 2 * min(ctx, start + t0 + tpt) * kv_elem
            flops += 4.0 * Hq * D * (n * start + n * (n + 1) / 2)  # causal: token j sees start + j + 1 keys
    out.append(KernelCost("paged_attention " + ("decode" if decode else "prefill"), L,
                          L * (kv_read + 2 * T * Hq * D * 2), L * flops))
    out.append(KernelCost("silu_and_mul", L, L * T * I * (2 * act_bytes + 2), 0))
    out.append(KernelCost("final norm (sampled rows)", 1, R * H * (2 * act_bytes + 2) + H * 2, 0))
    out.append(KernelCost("lm_head", 1, V * H * 2 + R * H * 2 + R * V * act_bytes, 2.0 * R * H * V))
    out.append(KernelCost("sample", 1, sampler_passes * R * V * 4 + R * 32, 0))
    return out


def layer_kernel_costs(shape: Shape, batch: int, context: int, act_bytes: int = 4,
                       kv_bytes: int = 2) -> dict[str, KernelCost]:
    """One call of each kernel of a decode layer (and the step's lm_head and sampler) for
    ``batch`` sequences of ``context`` tokens: ``name -> KernelCost`` (perf/gpu_kernel_bench.py
    divides these by its timings)."""
    one = dataclasses.replace(shape, layers=1)
    ks = {k.name: k for k in step_kernels(one, [1] * batch, [context] * batch, batch, kv_bytes=kv_bytes,
                                          act_bytes=act_bytes)}
    T, H = batch, shape.hidden
    out = {"fused_add_rms_norm": KernelCost("fused_add_rms_norm", 1, T * H * (3 * act_bytes + 2) + H * 2, 0)}
    for name in ("qkv_proj", "rope_and_cache", "paged_attention decode", "o_proj", "gate_up_proj",
                 "silu_and_mul", "down_proj", "lm_head", "sample"):
        out[name] = ks[name]
    return out


def ideal_step_seconds(shape: Shape, query_lens, context_lens, sampled_rows: int, card: Card,
                       kv_bytes: int = 2) -> float:
    """``max((weights + KV read and written) / bandwidth, FLOPs / peak)`` of one step: the
    FLOPs of ``step_kernels``, the bytes of the weights and the KV cache only."""
    ks = step_kernels(shape, query_lens, context_lens, sampled_rows, kv_bytes=kv_bytes)
    flops = sum(k.flops for k in ks)
    q, c = list(query_lens), list(context_lens)
    decode = all(int(n) == 1 for n in q)
    kv = shape.kv_bytes_per_token(kv_bytes) * ((sum(c) if decode else sum(c) - sum(q)) + sum(q))
    return max((shape.weight_bytes_per_step() + kv) / card.hbm_bytes_per_s, flops / card.bf16_flops)


def schedule(requests, max_num_batched_tokens: int = 16384):
    """The bound's schedule of ``requests`` ``[(prompt_len, output_len)]``: yields ``(query_lens,
    context_lens, sampled_rows)`` per step: prompts prefilled in order in chunks of at most
    ``max_num_batched_tokens`` tokens (a prompt's last chunk samples its first token), then decode
    step ``k = 1 .. max(output) - 1`` over the sequences with ``output > k``."""
    todo = [[p, 0] for p, _ in requests]  # (prompt length, tokens prefilled)
    i = 0
    while i < len(todo):
        ql, cl, rows, budget = [], [], 0, max_num_batched_tokens
        while i < len(todo) and budget:
            p, done = todo[i]
            n = min(p - done, budget)
            ql.append(n)
            cl.append(done + n)
            budget -= n
            todo[i][1] += n
            if todo[i][1] == p:
                rows += 1
                i += 1
        yield ql, cl, rows
    for k in range(1, max(o for _, o in requests)):
        live = [p + k for p, o in requests if o > k]
        yield [1] * len(live), live, len(live)


def workload_bound(shape: Shape, requests, card: Card, max_num_batched_tokens: int = 16384,
                   sampler_passes: float = 1.0) -> dict:
    """Both bounds (module docstring) of ``requests`` ``[(prompt_len, output_len)]`` on ``card``:
    seconds of the prefill and decode steps, output tokens/s, decode steps and their mean."""
    res = {"prefill_steps": 0, "decode_steps": 0}
    for kind in ("ideal", "kernels"):
        res[kind] = {"prefill_s": 0.0, "decode_s": 0.0}
    for ql, cl, rows in schedule(requests, max_num_batched_tokens):
        decode = all(n == 1 for n in ql)
        part = "decode_s" if decode else "prefill_s"
        res["decode_steps" if decode else "prefill_steps"] += 1
        res["ideal"][part] += ideal_step_seconds(shape, ql, cl, rows, card)
        res["kernels"][part] += sum(k.seconds(card) for k in step_kernels(
            shape, ql, cl, rows, sampler_passes=sampler_passes))
    out_tokens = sum(o for _, o in requests)
    res["output_tokens"] = out_tokens
    for kind in ("ideal", "kernels"):
        r = res[kind]
        r["seconds"] = r["prefill_s"] + r["decode_s"]
        r["output_tokens_per_s"] = out_tokens / r["seconds"]
        r["mean_decode_step_ms"] = 1e3 * r["decode_s"] / max(1, res["decode_steps"])
    return res


def gpu_check_requests(model: str, num_requests: int = 256, seed: int = 0, min_len: int = 32, max_len: int = 256):
    """``[(prompt_len, output_len)]`` of perf/gpu_check.sh's workload for a dummy model name."""
    sys.path.insert(0, str(ROOT / "perf"))
    from gpu_check_bench import DUMMY, workload

    return [(len(ids), n) for ids, n in workload(num_requests, seed, DUMMY[model]["vocab_size"], min_len, max_len)]


def shape_of(model: str) -> Shape:
    sys.path.insert(0, str(ROOT / "perf"))
    from gpu_check_bench import DUMMY

    return Shape.from_config(DUMMY[model])


def kernel_table(shape: Shape, card: Card, batch: int, context: int, sampler_passes: float = 1.0) -> list[dict]:
    """Per kernel of a decode step of ``batch`` sequences of ``context`` tokens: bytes, FLOPs,
    the bound and what bounds it."""
    rows = []
    for k in step_kernels(shape, [1] * batch, [context] * batch, batch, sampler_passes=sampler_passes):
        rows.append({"kernel": k.name, "calls": k.calls, "bytes": k.bytes, "flops": k.flops,
                     "bound_us": 1e6 * k.seconds(card), "bound_by": k.bound_by(card)})
    return rows


def measured_figures(step: dict) -> dict:
    """From a gpu_check.json bench_folio_* step's result: output tok/s, elapsed, mean decode step
    (forward only) in ms."""
    r = step.get("result", {})
    m = r.get("engine_metrics", {})
    out = {"output_tokens_per_s": r.get("output_tokens_per_s"), "elapsed_seconds": r.get("elapsed_seconds")}
    if m.get("num_decode_only_steps"):
        out["mean_decode_forward_ms"] = 1e3 * m["decode_only_forward_time"] / m["num_decode_only_steps"]
    if m.get("num_steps") and r.get("elapsed_seconds"):
        out["mean_step_ms"] = 1e3 * r["elapsed_seconds"] / m["num_steps"]
    return out


BENCH_STEPS = {"llama-3.1-8b-dummy": "bench_folio_8b", "smollm2-135m-dummy": "bench_folio_small"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--card", default="all", help="h200, h100-sxm or all")
    p.add_argument("--model", default="all", help="llama-3.1-8b-dummy, smollm2-135m-dummy or all")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--batches", default="128,256", help="decode batches of the per-kernel table")
    p.add_argument("--context", type=int, default=0,
                   help="context of the per-kernel table (default: the workload's mean at its first decode step)")
    p.add_argument("--sampler-passes", type=float, default=1.0)
    p.add_argument("--measured", help="a gpu_check.json: its bench_folio_* figures beside the model's")
    p.add_argument("--json", help="write every figure here")
    args = p.parse_args(argv)
    print("python perf/gpu_model.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    measured = {}
    if args.measured:
        with open(args.measured) as f:
            measured = json.load(f)
        if args.card == "auto":
            c = card_for(measured.get("env", {}).get("nvidia_smi", ""))
            args.card = c.key if c else "all"
    if args.card == "auto":
        args.card = "all"
    cards = list(CARDS.values()) if args.card == "all" else [CARDS[args.card]]
    models = list(BENCH_STEPS) if args.model == "all" else [args.model]
    result = {"cards": {c.key: dataclasses.asdict(c) for c in cards}, "models": {}}
    for model in models:
        shape = shape_of(model)
        reqs = gpu_check_requests(model, args.num_requests)
        ctx = args.context or round(sum(n for n, _ in reqs) / len(reqs)) + 1
        mres = result["models"][model] = {"shape": dataclasses.asdict(shape), "table_context": ctx}
        print(f"\n== {model}: {len(reqs)} requests, {sum(n for n, _ in reqs)} prompt and "
              f"{sum(o for _, o in reqs)} output tokens; weights {shape.weight_bytes_per_step() / 1e9:.2f} GB "
              f"per step, KV {shape.kv_bytes_per_token() / 1024:.0f} KiB per token")
        for card in cards:
            print(f"-- {card.name}: {card.hbm_bytes_per_s / 1e12:.2f} TB/s, {card.bf16_flops / 1e12:.1f} "
                  f"dense bf16 TFLOPS ({card.source})")
            cres = mres[card.key] = {"decode_kernels": {}}
            for B in [int(b) for b in args.batches.split(",")]:
                rows = kernel_table(shape, card, B, ctx, args.sampler_passes)
                cres["decode_kernels"][B] = rows
                print(f"   decode step, batch {B}, context {ctx}:")
                print(f"   {'kernel':42s} {'calls':>5s} {'MB':>9s} {'GFLOP':>9s} {'bound us':>9s}  by")
                for r in rows:
                    print(f"   {r['kernel']:42s} {r['calls']:5d} {r['bytes'] / 1e6:9.1f} {r['flops'] / 1e9:9.1f} "
                          f"{r['bound_us']:9.1f}  {r['bound_by']}")
                print(f"   {'sum':42s} {'':5s} {sum(r['bytes'] for r in rows) / 1e6:9.1f} "
                      f"{sum(r['flops'] for r in rows) / 1e9:9.1f} {sum(r['bound_us'] for r in rows):9.1f}")
            wb = workload_bound(shape, reqs, card, sampler_passes=args.sampler_passes)
            cres["workload"] = wb
            for kind in ("ideal", "kernels"):
                r = wb[kind]
                print(f"   workload bound ({kind}): prefill {r['prefill_s']:.3f} s ({wb['prefill_steps']} steps) + "
                      f"decode {r['decode_s']:.3f} s ({wb['decode_steps']} steps, mean {r['mean_decode_step_ms']:.2f} ms)"
                      f" = {r['seconds']:.3f} s: {r['output_tokens_per_s']:,.0f} output tok/s")
            step = measured.get("steps", {}).get(BENCH_STEPS.get(model, ""), {})
            if step.get("result", {}).get("ok") and step["result"].get("model") == model:
                m = measured_figures(step)
                m["fraction_of_ideal_bound"] = m["output_tokens_per_s"] / wb["ideal"]["output_tokens_per_s"]
                cres["measured"] = m
                line = (f"   measured: {m['output_tokens_per_s']:,.0f} output tok/s in {m['elapsed_seconds']} s = "
                        f"{100 * m['fraction_of_ideal_bound']:.1f}% of the ideal bound")
                if "mean_decode_forward_ms" in m:
                    line += (f"; decode forward {m['mean_decode_forward_ms']:.2f} ms per step against "
                             f"{wb['ideal']['mean_decode_step_ms']:.2f} ms")
                print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
