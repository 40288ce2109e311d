"""Speculative decoding (n-gram proposer) against plain decoding on the default model, one run.

Workloads, written for this benchmark (chat requests to SmolLM2-135M-Instruct, greedy, so both
engines produce the same tokens and compare per token):

* input-grounded, where prompt lookup should pay: ``edit_code`` (rename a function in a Python
  file and give the whole file back), ``fix_text`` (correct a paragraph's spelling and grammar),
  ``extract`` (fields of an invoice), ``answer`` (answer from a passage, quoting it);
* open-ended, the control: ``story``, ``explain``, ``tips``, ``pros_cons``.

Figures, each engine after the same warm-up, runs interleaved (plain, speculative, plain, ...)
for ``--rounds`` rounds, the median round reported (the VMs drift from minute to minute):

* single stream: each request alone; decode tok/s = (output tokens - 1) / (last token time -
  first token time), from the request's metrics (the prefill left out); and, less moved by other
  jobs on a shared machine, output tokens per CPU second of this process (all threads; prefill
  included, mostly a prefix-cache hit after the first round); the steps taken and the worker's idle
  time between steps per token (what a step that waits for its token in flight costs);
* ``--batch`` requests at once (default 16: every workload's requests cycled): output tokens / wall
  time of the whole ``generate`` call;
* ``--sweep C ...``: C grounded requests at once with speculation forced on at every batch size
  (``disable_by_batch_size`` 64) against plain: where it stops paying is the default
  ``disable_by_batch_size``.

Each engine is a ``folio.LLM`` in this process (the worker on a thread, overlap scheduling on).

    python perf/spec_decode.py [--rounds 3] [--max-tokens 192] [--k K] [--lookup-min N] [--lookup-max N]
                               [--disable-by-batch-size B] [--no-single] [--batch 16] [--sweep 1 2 3 4 8]
                               [--workloads edit_code story ...] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import statistics
import subprocess
import sys
import time

CODE = '''import json


def load_config(path):
    with open(path) as f:
        data = json.load(f)
    if "name" not in data:
        raise ValueError("config has no name")
    return data


def save_config(path, data):
    with open(path, "w") as f:
        json.dump(data, f, indent=2)


def merge_configs(base, override):
    result = dict(base)
    for key, value in override.items():
        result[key] = value
    return result
'''
TEXT = ("Our team meet every tuesday in the small conference room on the third floor. Last week we discused "
        "the new budget and decided that each departement will get ten percent more money for equipment. The "
        "meeting was long, but everyone agreed that the results was worth it. Next week we will talk about the "
        "summer schedule and the new hiring plan.")
INVOICE = """Invoice number: 2024-0387
Date: 14 March 2024
Customer: Harbor Street Bakery, 12 Harbor Street, Portland
Items: 40 kg rye flour (86.00 USD), 25 kg cane sugar (41.25 USD), 10 kg butter (92.50 USD)
Total due: 219.75 USD
Payment terms: 30 days, bank transfer to account 0042-7781-19
Contact: Maria Lopez, accounts@harborbakery.example"""
PASSAGE = ("The Great Barrier Reef is the world's largest coral reef system, composed of over 2,900 individual "
           "reefs and 900 islands stretching for over 2,300 kilometres over an area of approximately 344,400 "
           "square kilometres. The reef is located in the Coral Sea, off the coast of Queensland, Australia. It "
           "can be seen from outer space and is the world's biggest single structure made by living organisms. "
           "This reef structure is composed of and built by billions of tiny organisms, known as coral polyps. "
           "It supports a wide diversity of life and was selected as a World Heritage Site in 1981.")

WORKLOADS = {
    "edit_code": ("grounded", "Rename the function load_config to read_config everywhere in this Python code. "
                              f"Reply with the complete updated code only.\n\n{CODE}"),
    "fix_text": ("grounded", f"Fix the spelling and grammar mistakes in this text. Reply with the corrected text "
                             f"only.\n\n{TEXT}"),
    "extract": ("grounded", "Copy the customer line, the total line and the contact line of this invoice, "
                            f"exactly as written.\n\n{INVOICE}"),
    "answer": ("grounded", "Read the passage and answer the question, quoting the passage.\n\nPassage: "
                           f"{PASSAGE}\n\nQuestion: What is the Great Barrier Reef made of, where is it, and "
                           "how large is it?"),
    "story": ("open", "Write a short story about a lighthouse keeper who finds a message in a bottle."),
    "explain": ("open", "Explain how a refrigerator keeps food cold, in simple words."),
    "tips": ("open", "Give three tips for learning to play the guitar."),
    "pros_cons": ("open", "What are the pros and cons of working from home?"),
}


def make_llm(spec: dict | None):
    from folio import LLM
    llm = LLM(device="cpu", speculative_config=spec)
    llm.llm_engine.warm_up()
    return llm


def chat(llm, names, max_tokens):
    """The outputs, the wall seconds and the CPU seconds (this process, all threads) of one call."""
    from folio import SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    msgs = [[{"role": "user", "content": WORKLOADS[n][1]}] for n in names]
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.chat(msgs, sp, use_tqdm=False)
    return outs, time.perf_counter() - t0, time.process_time() - c0


def decode_rate(out) -> float:
    m = out.metrics
    n = len(out.outputs[0].token_ids)
    return (n - 1) / (m.last_token_time - m.first_token_time) if n > 1 else float("nan")


def spec_counters(llm) -> tuple[int, int, int]:
    m = llm.get_metrics()
    return (m.get("spec_decode_num_drafts", 0), m.get("spec_decode_num_draft_tokens", 0),
            m.get("spec_decode_num_accepted_tokens", 0))


def idle_and_steps(llm) -> tuple[float, int]:
    """The worker's idle time between steps while the engine had work (s) and the steps so far."""
    m = llm.get_metrics()
    return m["worker_idle_time"], m["num_steps"]


def acceptance(before, after) -> dict:
    drafts, proposed, accepted = (b - a for a, b in zip(before, after))
    return {"drafts": drafts, "proposed": proposed, "accepted": accepted,
            "acceptance_rate": accepted / proposed if proposed else 0.0,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--k", type=int, default=None, help="num_speculative_tokens (default: folio's)")
    p.add_argument("--lookup-min", type=int, default=None, help="prompt_lookup_min (default: folio's)")
    p.add_argument("--lookup-max", type=int, default=None, help="prompt_lookup_max (default: folio's)")
    p.add_argument("--disable-by-batch-size", type=int, default=None,
                   help="the speculative config's disable_by_batch_size (default: folio's)")
    p.add_argument("--no-single", action="store_true", help="skip the single-stream figures")
    p.add_argument("--batch", type=int, default=16, help="requests at once (0: skip)")
    p.add_argument("--sweep", type=int, nargs="*", default=[], help="concurrencies of grounded requests, spec forced on")
    p.add_argument("--workloads", nargs="*", default=list(WORKLOADS))
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    from folio.runtime.common.config import SpeculativeConfig

    spec = {"method": "ngram"}
    for key, v in (("num_speculative_tokens", a.k), ("prompt_lookup_min", a.lookup_min),
                   ("prompt_lookup_max", a.lookup_max), ("disable_by_batch_size", a.disable_by_batch_size)):
        if v is not None:
            spec[key] = v
    engines = {"plain": make_llm(None), "spec": make_llm(spec)}
    if a.sweep:
        engines["forced"] = make_llm({**spec, "disable_by_batch_size": 64})
    for llm in engines.values():   # the shapes of these prompts compiled
        chat(llm, a.workloads, 8)
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    cpu = next((ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name")), "?")
    report = {"command": "python perf/spec_decode.py " + shlex.join(sys.argv[1:] if argv is None else argv),
              "cpu": cpu, "threads": len(os.sched_getaffinity(0)), "load_before": os.getloadavg()[0],
              "speculative_config": dataclasses.asdict(SpeculativeConfig.from_value(spec)),
              "single": {}, "batch": None, "sweep": {}}

    # single stream
    for name in ([] if a.no_single else a.workloads):
        rates = {"plain": [], "spec": []}
        cpu_rates = {"plain": [], "spec": []}
        idle = {"plain": [], "spec": []}   # worker idle per output token, ms
        steps = {}
        acc = None
        n_out = None
        for r in range(a.rounds):
            order = ("plain", "spec") if r % 2 == 0 else ("spec", "plain")
            toks = {}
            for e in order:
                before = spec_counters(engines[e])
                idle0, steps0 = idle_and_steps(engines[e])
                (out,), _, cpu_s = chat(engines[e], [name], a.max_tokens)
                idle1, steps1 = idle_and_steps(engines[e])
                idle[e].append(1e3 * (idle1 - idle0) / len(out.outputs[0].token_ids))
                steps[e] = steps1 - steps0
                rates[e].append(decode_rate(out))
                cpu_rates[e].append(len(out.outputs[0].token_ids) / cpu_s)
                toks[e] = out.outputs[0].token_ids
                if e == "spec":
                    acc = acceptance(before, spec_counters(engines[e]))
            assert toks["plain"] == toks["spec"], f"{name}: speculative greedy output differs"
            n_out = len(toks["plain"])
        ratios = [s / q for s, q in zip(rates["spec"], rates["plain"])]
        cpu_ratios = [s / q for s, q in zip(cpu_rates["spec"], cpu_rates["plain"])]
        row = {"kind": WORKLOADS[name][0], "output_tokens": n_out,
               "plain_tok_s": statistics.median(rates["plain"]), "spec_tok_s": statistics.median(rates["spec"]),
               "speedup": statistics.median(ratios), "speedup_cpu_time": statistics.median(cpu_ratios),
               "speedups": ratios, "steps_plain": steps["plain"], "steps_spec": steps["spec"],
               "worker_idle_ms_per_token_plain": statistics.median(idle["plain"]),
               "worker_idle_ms_per_token_spec": statistics.median(idle["spec"]), **acc}
        report["single"][name] = row
        print(f"{name:10s} {row['kind']:8s} {n_out:4d} tok  plain {row['plain_tok_s']:6.1f} tok/s  "
              f"spec {row['spec_tok_s']:6.1f} tok/s  x{row['speedup']:.2f} (per CPU second x{row['speedup_cpu_time']:.2f})"
              f"  accepted {row['accepted']}/{row['proposed']} ({row['acceptance_rate']:.2f}), mean acceptance "
              f"length {row['mean_acceptance_length']:.2f}; steps {row['steps_plain']} -> {row['steps_spec']}, "
              f"worker idle {row['worker_idle_ms_per_token_plain']:.2f} -> {row['worker_idle_ms_per_token_spec']:.2f} "
              f"ms/token", flush=True)
    for kind in ("grounded", "open"):
        rows = [r for r in report["single"].values() if r["kind"] == kind]
        if rows:
            g = statistics.geometric_mean([r["speedup"] for r in rows])
            gc = statistics.geometric_mean([r["speedup_cpu_time"] for r in rows])
            report[f"single_{kind}_geomean_speedup"] = g
            report[f"single_{kind}_geomean_speedup_cpu_time"] = gc
            print(f"single stream, {kind}: geometric mean speedup x{g:.2f} (per CPU second x{gc:.2f})", flush=True)

    # many requests at once
    def batch_rates(engine_names, names, rounds):
        res = {e: [] for e in engine_names}
        for r in range(rounds):
            for e in (engine_names if r % 2 == 0 else engine_names[::-1]):
                outs, dt, _ = chat(engines[e], names, a.max_tokens)
                res[e].append(sum(len(o.outputs[0].token_ids) for o in outs) / dt)
        return res

    if a.batch:
        names = [a.workloads[i % len(a.workloads)] for i in range(a.batch)]
        res = batch_rates(["plain", "spec"], names, a.rounds)
        ratios = [s / q for s, q in zip(res["spec"], res["plain"])]
        report["batch"] = {"requests": a.batch, "plain_tok_s": statistics.median(res["plain"]),
                           "spec_tok_s": statistics.median(res["spec"]), "ratio": statistics.median(ratios)}
        b = report["batch"]
        print(f"{a.batch} requests at once: plain {b['plain_tok_s']:.1f} tok/s, spec {b['spec_tok_s']:.1f} tok/s, "
              f"x{b['ratio']:.2f}", flush=True)
    if a.sweep:
        grounded = [n for n in a.workloads if WORKLOADS[n][0] == "grounded"]
        for c in a.sweep:
            names = [grounded[i % len(grounded)] for i in range(c)]
            res = batch_rates(["plain", "forced"], names, a.rounds)
            ratios = [s / q for s, q in zip(res["forced"], res["plain"])]
            report["sweep"][c] = {"plain_tok_s": statistics.median(res["plain"]),
                                  "spec_tok_s": statistics.median(res["forced"]), "ratio": statistics.median(ratios)}
            s = report["sweep"][c]
            print(f"{c:3d} grounded requests at once, speculation on at any batch size: plain {s['plain_tok_s']:.1f} "
                  f"tok/s, spec {s['spec_tok_s']:.1f} tok/s, x{s['ratio']:.2f}", flush=True)
    report["load_after"] = os.getloadavg()[0]
    print(f"speculative_config: {json.dumps(report['speculative_config'])}")
    print(f"command: {report['command']}\ncpu: {cpu}, {report['threads']} threads, load {report['load_before']:.1f} "
          f"-> {report['load_after']:.1f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
