"""Structured outputs at batch speed: the 64-request workload constrained vs free, and mask time per step.

1. **Throughput**: ``perf/bench``'s ``random_requests`` workload (64 requests, prompts uniform in
   [32, 512] tokens, outputs in [16, 256], random token ids, seed 0) run twice on one engine:
   unconstrained, and with every request constrained to a JSON schema (an array of integers, which
   can go on for as long as the request's output length: ``min_tokens = max_tokens = output_len``;
   a sample that closes its array early ends there, so the figure is output tokens per second
   over the tokens actually produced). The issue's goal: constrained >= 0.9x unconstrained.
2. **Mask time per step** at 64 and 256 sequences: the worker's ``fill_batch_bitmask`` (one
   llguidance mask per constrained row) plus the sampler's ``apply_token_bitmask`` over
   ``[R, V]`` logits, for R matchers of a 20-property schema each advanced to a different position
   of a valid instance (perf/grammar_libraries.py's schema), median over steps.

Run::

    .venv/bin/python perf/structured_outputs.py            # both parts
    .venv/bin/python perf/structured_outputs.py --masks-only

Prints the figures and the command. Timing on a shared machine is noisy: compare within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from perf.bench.common import random_requests  # noqa: E402
from perf.grammar_libraries import INSTANCE, SCHEMA  # noqa: E402

ARRAY_SCHEMA = {"type": "array", "items": {"type": "integer"}}


def throughput(llm, requests, constrained: bool) -> tuple[float, int, float]:
    from folio import SamplingParams
    from folio.runtime.common.sampling_params import StructuredOutputsParams
    so = StructuredOutputsParams(json=ARRAY_SCHEMA, disable_any_whitespace=True) if constrained else None
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, min_tokens=r.output_len,
                             ignore_eos=not constrained, structured_outputs=so) for r in requests]
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in requests], params, use_tqdm=False)
    dt = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return n / dt, n, dt


def mask_times(model_dir: str, sizes=(64, 256), steps: int = 20) -> dict[int, tuple[float, float]]:
    """``{R: (median fill ms, median apply ms)}`` per step."""
    from folio.model.tokenizer import Tokenizer
    from folio.runtime.common.sampling_params import SamplingParams, StructuredOutputsParams
    from folio.runtime.worker.sampler import SamplingState, apply_token_bitmask
    from folio.runtime.worker.grammar_matchers import GrammarMatchers, advance, fill_batch_bitmask
    tok = Tokenizer.from_pretrained(model_dir)
    V = tok.vocab_size
    valid = tok.hf.encode(json.dumps(INSTANCE), add_special_tokens=False).ids
    sp = SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA))
    gm = GrammarMatchers(tok.hf.to_str)
    out = {}
    for R in sizes:
        states = []
        for i in range(R):
            st = SamplingState(i, sp, [1], valid[: (i * 7) % (len(valid) - steps)], None, tok.eos_token_ids)
            gm.attach(st)
            states.append(st)
        logits = np.random.default_rng(0).standard_normal((R, V)).astype(np.float32)
        fills, applies = [], []
        for s in range(steps):
            t0 = time.perf_counter()
            mask = fill_batch_bitmask(states, V)
            t1 = time.perf_counter()
            apply_token_bitmask(logits, mask)
            t2 = time.perf_counter()
            fills.append(t1 - t0)
            applies.append(t2 - t1)
            nxt = [valid[(len(st.output_token_ids))] for st in states]
            advance(states, nxt)
            for st, t in zip(states, nxt):
                st.append(t)
        out[R] = (1e3 * float(np.median(fills)), 1e3 * float(np.median(applies)))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--masks-only", action="store_true")
    ap.add_argument("--rounds", type=int, default=2, help="unconstrained / constrained pairs, alternating")
    args = ap.parse_args(argv)
    from folio.model.registry import resolve_model
    model_dir = str(resolve_model(args.model))
    for R, (fill, apply) in mask_times(model_dir).items():
        print(f"mask per step, {R} constrained sequences: fill {fill:.2f} ms + apply {apply:.2f} ms")
    if not args.masks_only:
        from folio import LLM
        llm = LLM(args.model, device="cpu")
        reqs = random_requests(args.num_requests, (32, 512), (16, 256), seed=0)
        throughput(llm, reqs[:8], False)  # warm-up: the kernels compile for the batch shapes
        throughput(llm, reqs[:8], True)
        for r in range(args.rounds):  # alternating, so drift on a shared machine hits both
            free = throughput(llm, reqs, False)
            con = throughput(llm, reqs, True)
            print(f"round {r + 1}: unconstrained {free[0]:.1f} output tok/s ({free[1]} tokens in {free[2]:.1f} s); "
                  f"JSON-schema constrained {con[0]:.1f} output tok/s ({con[1]} tokens in {con[2]:.1f} s): "
                  f"{con[0] / free[0]:.2f}x")
    print("command: .venv/bin/python perf/structured_outputs.py " + " ".join(argv if argv is not None else sys.argv[1:]))


if __name__ == "__main__":
    main()
