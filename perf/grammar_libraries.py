"""Grammar libraries for structured outputs, measured side by side: llguidance against xgrammar.

For each library, in a subprocess of its own (so the resident-memory delta is the library's):

* **tokenizer setup**: seconds to build the library's tokenizer index from ``tokenizer.json``;
* **compile**: seconds to compile a 20-property JSON schema (llguidance: ``LLMatcher`` construction,
  whose lexer is built then, plus the first mask; xgrammar: ``GrammarCompiler.compile_json_schema``
  with its cache off, plus the first mask);
* **mask per token**: mean milliseconds to compute the next-token bitmask, over every position of
  a valid instance of the schema (the matcher is advanced with each of its tokens);
* **RSS delta**: resident memory after all of the above minus before the library was imported;
* **install footprint**: bytes of the files of the library's distribution and of everything it
  requires (transitively), from ``importlib.metadata``.

Vocabularies: the default model's (SmolLM2, 49,152 tokens) and a Llama-3-sized one (128,256)
built from it by appending 79,104 byte-level tokens, each the concatenation of two existing ones
(the mask work grows with the vocabulary's trie; merges are irrelevant to a mask).

Run (both libraries must be importable by ``PYTHON``; xgrammar requires torch, so it lives in a
throwaway venv of its own, not in folio's)::

    python3 -m venv /tmp/xg && /tmp/xg/bin/pip install torch==2.13.0 xgrammar tokenizers llguidance
    /tmp/xg/bin/python perf/grammar_libraries.py --tokenizer ~/.cache/folio/models/smollm2-135m-instruct/tokenizer.json

Prints one table (markdown) and the command.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

SCHEMA = {
    "type": "object",
    "properties": {
        **{f"name_{i}": {"type": "string", "maxLength": 24} for i in range(5)},
        **{f"count_{i}": {"type": "integer", "minimum": 0} for i in range(5)},
        **{f"score_{i}": {"type": "number"} for i in range(3)},
        **{f"flag_{i}": {"type": "boolean"} for i in range(3)},
        "kind": {"enum": ["alpha", "beta", "gamma"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "when": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "owner": {"type": "object", "properties": {"id": {"type": "integer"}, "email": {"type": "string"}},
                  "required": ["id", "email"], "additionalProperties": False},
    },
    "additionalProperties": False,
}
SCHEMA["required"] = sorted(SCHEMA["properties"])
assert len(SCHEMA["properties"]) == 20

INSTANCE = {
    **{f"name_{i}": f"item number {i}" for i in range(5)},
    **{f"count_{i}": 100 * i + 7 for i in range(5)},
    **{f"score_{i}": 0.25 + i for i in range(3)},
    **{f"flag_{i}": bool(i % 2) for i in range(3)},
    "kind": "beta", "tags": ["red", "green"], "when": "2026-12-03",
    "owner": {"id": 42, "email": "someone@example.com"},
}
INSTANCE = {k: INSTANCE[k] for k in SCHEMA["properties"]}  # property order of the schema


def big_vocab(tokenizer_json: str, size: int) -> str:
    """``tokenizer.json`` text whose BPE vocabulary is extended to ``size`` entries (added tokens
    stay at the end of the id space, as in Llama 3)."""
    spec = json.loads(tokenizer_json)
    vocab = spec["model"]["vocab"]
    added = spec.get("added_tokens") or []
    base = sorted(vocab, key=vocab.get)
    rng = random.Random(0)
    extra = []
    seen = set(vocab)
    while len(vocab) + len(extra) < size:
        t = rng.choice(base) + rng.choice(base)
        if t not in seen and len(t) <= 16:
            seen.add(t)
            extra.append(t)
    nxt = max(vocab.values()) + 1
    for t in extra:
        vocab[t] = nxt
        nxt += 1
    for a in added:  # keep added tokens after the extended vocabulary
        vocab.pop(a["content"], None)
        a["id"] = nxt
        vocab[a["content"]] = nxt
        nxt += 1
    return json.dumps(spec)


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def footprint(dist_name: str) -> tuple[int, list[str]]:
    """Bytes of a distribution and its transitive requirements (extras ignored), and their names."""
    from importlib import metadata
    import re
    todo, seen, total = [dist_name], set(), 0
    while todo:
        name = re.split(r"[ ;<>=!~\[(]", todo.pop(), maxsplit=1)[0].lower().replace("_", "-")
        if not name or name in seen:
            continue
        seen.add(name)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        for f in dist.files or []:
            try:
                total += os.path.getsize(f.locate())
            except OSError:
                pass
        for req in dist.requires or []:
            if "extra ==" not in req:
                todo.append(req)
    return total, sorted(seen)


def measure(lib: str, tok_path: str, n_threads: int) -> dict:
    """One library, one vocabulary (runs in its own process)."""
    tok_json = open(tok_path).read()
    spec = json.loads(tok_json)
    r0 = rss_bytes()
    text = json.dumps(INSTANCE)
    if lib == "llguidance":
        import llguidance as llg
        import numpy as np
        t0 = time.perf_counter()
        tok = llg.LLTokenizer(tok_json)
        t_tok = time.perf_counter() - t0
        V = tok.vocab_size
        ids = tok.tokenize_str(text)
        t0 = time.perf_counter()
        grammar = llg.LLMatcher.grammar_from_json_schema(SCHEMA)
        m = llg.LLMatcher(tok, grammar)
        mask = np.zeros((V + 31) // 32, dtype=np.int32)
        m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        t_compile = time.perf_counter() - t0
        assert not m.is_error(), m.get_error()
        times = []
        for t in ids:
            t0 = time.perf_counter()
            m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
            times.append(time.perf_counter() - t0)
            assert (mask[t // 32] >> (t % 32)) & 1, "a token of the valid instance was masked"
            assert m.consume_token(t), m.get_error()
        assert m.is_accepting()
        version = llg.__version__
    else:
        import torch
        import xgrammar as xgr
        torch.set_num_threads(n_threads)
        vocab = spec["model"]["vocab"]
        for a in spec.get("added_tokens") or []:
            vocab[a["content"]] = a["id"]
        V = max(vocab.values()) + 1
        encoded = [""] * V
        for s, i in vocab.items():
            encoded[i] = s
        t0 = time.perf_counter()
        info = xgr.TokenizerInfo(encoded, vocab_type=xgr.VocabType.BYTE_LEVEL, vocab_size=V,
                                 stop_token_ids=[0], add_prefix_space=False)
        compiler = xgr.GrammarCompiler(info, max_threads=n_threads, cache_enabled=False)
        t_tok = time.perf_counter() - t0
        from tokenizers import Tokenizer
        ids = Tokenizer.from_str(tok_json).encode(text, add_special_tokens=False).ids
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
        m = xgr.GrammarMatcher(compiled)
        mask = xgr.allocate_token_bitmask(1, V)
        m.fill_next_token_bitmask(mask)
        t_compile = time.perf_counter() - t0
        times = []
        for t in ids:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(mask)
            times.append(time.perf_counter() - t0)
            assert (int(mask[0, t // 32]) >> (t % 32)) & 1, "a token of the valid instance was masked"
            assert m.accept_token(t)
        from importlib.metadata import version as _v
        version = _v("xgrammar")
    rss = rss_bytes() - r0
    size, deps = footprint(lib)
    times.sort()
    return {"lib": lib, "version": version, "vocab": V, "tokenizer_s": t_tok, "compile_s": t_compile,
            "mask_ms_mean": 1e3 * sum(times) / len(times), "mask_ms_median": 1e3 * times[len(times) // 2],
            "mask_ms_max": 1e3 * times[-1], "tokens": len(times), "rss_mib": rss / 2**20,
            "install_mib": size / 2**20, "requires": deps}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", required=True, help="tokenizer.json of the default model")
    ap.add_argument("--libs", default="llguidance,xgrammar")
    ap.add_argument("--threads", type=int, default=1, help="threads the libraries may use")
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # internal: LIB TOKENIZER_PATH
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.one[0], args.one[1], args.threads)))
        return
    base = open(os.path.expanduser(args.tokenizer)).read()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        paths = {}
        for size in (len(json.loads(base)["model"]["vocab"]), 128256):
            p = os.path.join(d, f"tok{size}.json")
            with open(p, "w") as f:
                f.write(base if size < 100000 else big_vocab(base, size))
            paths[size] = p
        for lib in args.libs.split(","):
            for size, p in paths.items():
                out = subprocess.run([sys.executable, __file__, "--tokenizer", p, "--one", lib, p,
                                      "--threads", str(args.threads)], capture_output=True, text=True,
                                     env={**os.environ, "RAYON_NUM_THREADS": str(args.threads)})
                if out.returncode:
                    print(out.stderr, file=sys.stderr)
                    raise SystemExit(f"{lib} failed at vocabulary {size}")
                rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print("| library | vocab | tokenizer setup s | compile 20-prop schema s | mask ms/token mean (median, max) "
          "| RSS delta MiB | install MiB (with requirements) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['lib']} {r['version']} | {r['vocab']} | {r['tokenizer_s']:.2f} | {r['compile_s']:.3f} | "
              f"{r['mask_ms_mean']:.3f} ({r['mask_ms_median']:.3f}, {r['mask_ms_max']:.3f}) | {r['rss_mib']:.0f} | "
              f"{r['install_mib']:.0f} |")
    for lib in dict.fromkeys(r["lib"] for r in rows):
        req = next(r["requires"] for r in rows if r["lib"] == lib)
        print(f"{lib} installs: {', '.join(req)}")
    print(f"masks over {rows[0]['tokens']} tokens of one valid instance; threads {args.threads}")
    print("command: " + " ".join([os.path.basename(sys.executable), "perf/grammar_libraries.py"] + (argv or sys.argv[1:])))


if __name__ == "__main__":
    main()
