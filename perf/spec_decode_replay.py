"""How the n-gram proposer's settings were chosen: greedy outputs replayed through the proposer and
its switch-off, priced by the measured cost of a step with T rows.

Greedy decoding is deterministic, so whether a draft would be accepted is known from the plain
output alone: this records the workloads of ``perf/spec_decode.py`` once with the plain engine
(``--record``, or loads them from ``--recorded``), then for each setting walks each output as the
scheduler would (``SpecDecoding.propose`` / ``update_from_output`` / ``wants_token``, the real
code) and prices each step with the cost of one sequence's step of ``1 + drafts`` rows, relative
to a one-row decode, measured on this machine in the same run (``ModelRunner`` steps over a
300-token context, CPU seconds of this process, best of ``--repeat``). A step that waited for its
token in flight (no overlap) is charged ``--wait-cost`` more. The figure per workload is the
predicted single-stream speedup; the command's output is what the choice of defaults rests on
(perf/JOURNAL.md, "Speculative decoding").

    python perf/spec_decode_replay.py [--record PATH | --recorded PATH] [--repeat 8] [--wait-cost 0.03]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from spec_decode import WORKLOADS  # noqa: E402

SETTINGS = [  # (num_speculative_tokens, prompt_lookup_min, prompt_lookup_max)
    (1, 1, 4), (1, 3, 5), (2, 3, 5), (3, 1, 4), (3, 2, 4), (3, 3, 5), (3, 3, 6), (3, 4, 6), (4, 3, 5), (7, 3, 5)]


def record(max_tokens: int) -> dict:
    from folio import LLM, SamplingParams
    llm = LLM(device="cpu")
    out = {}
    for name, (kind, text) in WORKLOADS.items():
        o = llm.chat([{"role": "user", "content": text}], SamplingParams(temperature=0.0, max_tokens=max_tokens),
                     use_tqdm=False)[0]
        out[name] = {"kind": kind, "prompt": list(o.prompt_token_ids), "output": list(o.outputs[0].token_ids)}
    return out


def step_costs(max_rows: int, repeat: int, ctx: int = 300) -> dict[int, float]:
    """CPU seconds of one sequence's step of T rows (its logits at every row), relative to T = 1."""
    from folio.runtime.common.config import EngineConfig
    from folio.runtime.common.sampling_params import SamplingParams
    from folio.runtime.common.step import NewSequence, StepPlan
    from folio.runtime.worker.model_runner import ModelRunner
    bs = 16
    r = ModelRunner(EngineConfig(device="cpu", num_kv_blocks_override=64))

    def plan(step, T, new=False):
        nb = -(-(ctx + T) // bs)
        pos = np.arange(ctx, ctx + T, dtype=np.int64)
        table = np.arange(nb, dtype=np.int32)[None, :]
        ns = [NewSequence(0, [1] * 8, [], SamplingParams(temperature=0.0).to_dict(), None, [])] if new else []
        return StepPlan(step, np.full(T, 100, np.int64), pos, table[0, pos // bs].astype(np.int64) * bs + pos % bs,
                        np.array([0, T], np.int32), np.array([ctx + T], np.int32), table, np.zeros(1, np.int64),
                        np.arange(T, dtype=np.int64), np.zeros(T, np.int64), new_seqs=ns)

    r.execute(plan(0, 1, new=True))
    best = {T: float("inf") for T in range(1, max_rows + 1)}
    for k in range(repeat):           # rounds over every shape, so drift hits them alike
        for T in best:
            c0 = time.process_time()
            assert r.execute(plan(1 + k, T)).error is None
            best[T] = min(best[T], time.process_time() - c0)
    r.shutdown()
    return {T: best[T] / best[1] for T in best}


def replay(rec: dict, cost: dict[int, float], k: int, lo: int, hi: int, wait_cost: float) -> tuple[float, float]:
    """Predicted speedup and acceptance rate of one output under one setting."""
    from folio.runtime.common.config import SpeculativeConfig
    from folio.runtime.scheduler.spec_decode import SpecDecoding
    prompt, out = rec["prompt"], rec["output"]
    sd = SpecDecoding(SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=lo, prompt_lookup_max=hi), 1 << 20)
    params = SimpleNamespace(greedy=True, has_penalties=False, structured_outputs=None)
    req = SimpleNamespace(sampling_params=params, min_tokens=0, max_output_tokens=len(out))
    seq = SimpleNamespace(spec=None, is_beam=False, request=req, all_token_ids=[], num_output_tokens=0)
    n, total, waited = 1, 0.0, True
    while n < len(out):
        seq.all_token_ids, seq.num_output_tokens = list(prompt) + out[:n], n
        st = sd.state(seq)
        drafts = sd.propose(seq, st, 1 << 20)
        if drafts:
            a = 0
            while a < len(drafts) and n + a < len(out) and drafts[a] == out[n + a]:
                a += 1
            sd.update_from_output(seq, len(drafts), a)
            total += cost[1 + len(drafts)] + (wait_cost if waited else 0.0)
            n += a + 1
            waited = True   # the next step is planned only after this one's result
        else:
            total += 1.0 + (wait_cost if waited else 0.0)
            n += 1
            before = SimpleNamespace(num_output_tokens=n - 1, request=req, all_token_ids=seq.all_token_ids)
            waited = sd.wants_token(before, st)
    return (len(out) - 1) / total, sd.num_accepted_tokens / max(1, sd.num_draft_tokens)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--record", default=None, help="record the workloads' greedy outputs to this JSON file first")
    p.add_argument("--recorded", default=None, help="a JSON file written by --record")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--repeat", type=int, default=8)
    p.add_argument("--wait-cost", type=float, default=0.03, help="a step without overlap, in decode steps")
    a = p.parse_args(argv)
    if a.recorded:
        with open(a.recorded) as f:
            recs = json.load(f)
    else:
        recs = record(a.max_tokens)
        if a.record:
            with open(a.record, "w") as f:
                json.dump(recs, f)
    cost = step_costs(max(k for k, _, _ in SETTINGS) + 1, a.repeat)
    print("step cost by rows (CPU time, T = 1 is 1): " + ", ".join(f"{T}: {c:.2f}" for T, c in cost.items()))
    names = list(recs)
    print(f"{'k, lookup min..max':20s} {'grounded':>8s} {'open':>6s}  " + " ".join(f"{n:>10s}" for n in names))
    for k, lo, hi in SETTINGS:
        res = {n: replay(recs[n], cost, k, lo, hi, a.wait_cost) for n in names}
        geo = {kind: float(np.exp(np.mean([np.log(res[n][0]) for n in names if recs[n]["kind"] == kind])))
               for kind in ("grounded", "open")}
        print(f"{f'{k}, {lo}..{hi}':20s} x{geo['grounded']:7.2f} x{geo['open']:5.2f}  "
              + " ".join(f"x{res[n][0]:4.2f}/{res[n][1]:.2f}" for n in names))
    print("(per workload: predicted speedup / acceptance rate)")
    print("command: python perf/spec_decode_replay.py " + shlex.join(sys.argv[1:] if argv is None else argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
