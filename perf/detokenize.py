"""Cost of detokenizing one step of N decoding sequences, per path (issue 10, item 3).

Each of N sequences gets one new token per step (ids drawn from the default model's vocabulary);
per step this times, on this thread (``time.thread_time``, median over steps):

  folio byte-level:   ``IncrementalDetokenizer.add_token`` on the byte-level path (token text /
                      bytes from a table checked against the library, one UTF-8 decode at most);
  folio window:       the same class on its sliding-window path (a ``tokenizers`` decode per token,
                      the prefix window's text cached);
  tokenizers stream:  ``tokenizers.decoders.DecodeStream.step`` (the library's incremental
                      decoder, one call per token, as vLLM's fast detokenizer uses it).

    python perf/detokenize.py [--seqs 64 256] [--steps 200]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "perf"))
from engine_overhead import cpu_model  # noqa: E402


def per_step(fn, steps: int) -> float:
    ts = []
    for k in range(steps):
        t = time.thread_time()
        fn(k)
        ts.append(time.thread_time() - t)
    return 1e6 * statistics.median(ts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", type=int, nargs="+", default=[64, 256])
    p.add_argument("--steps", type=int, default=200)
    a = p.parse_args(argv)
    from folio.model.registry import resolve_model
    from folio.model.tokenizer import Tokenizer
    print("command: python perf/detokenize.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    print(f"cpu {cpu_model()}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus")
    tok = Tokenizer.from_pretrained(resolve_model("smollm2-135m-instruct"))
    rng = random.Random(0)
    words = {"english": ["The", "answer", "is", "that", "a", "model", "reads", "tokens,", "one", "step", "at",
                         "time.", "def", "f(x):", "return", "42"],
             "mixed": ["The", "answer", "naïve", "café", "東京", "の", "首都", "😀", "🎉", "42,", "def", "f(x):"]}
    for corpus_name, vocab in words.items():
        text = " ".join(rng.choice(vocab) for _ in range(4 * a.steps))
        corpus = tok.encode(text)
        run_corpus(corpus_name, corpus, a, tok)
    return 0


def run_corpus(corpus_name, corpus, a, tok) -> None:
    from tokenizers.decoders import DecodeStream

    from folio.runtime.scheduler.detokenizer import IncrementalDetokenizer, TokenBytes
    from folio.runtime.common.sampling_params import SamplingParams
    hf, params = tok.hf, SamplingParams()
    for n in a.seqs:
        ids = [[corpus[(37 * i + k) % len(corpus)] for k in range(a.steps)] for i in range(n)]
        table = TokenBytes(hf, True)
        fast = [IncrementalDetokenizer(tok, [1, 2], params, token_bytes=table) for _ in range(n)]
        window = [IncrementalDetokenizer(tok, [1, 2], params, token_text_cache={}, byte_level=False)
                  for _ in range(n)]
        streams = [DecodeStream(skip_special_tokens=True) for _ in range(n)]
        rows = {
            "folio byte-level": lambda k: [d.add_token(s[k]) for d, s in zip(fast, ids)],
            "folio window": lambda k: [d.add_token(s[k]) for d, s in zip(window, ids)],
            "tokenizers stream": lambda k: [st.step(hf, s[k]) for st, s in zip(streams, ids)],
        }
        for name, fn in rows.items():
            us = per_step(fn, a.steps)
            print(f"{corpus_name:8s} seqs={n:4d}  {name:18s} {us:8.0f} us/step  {us / n:6.2f} us/token", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
