"""How far int8 activations move the default model's next-token distributions, over real text.

    python -m perf.int8_activation_kl [--tokens 512] [--types q4_1,q8_0,q4_k]

For each weight type folio serves the default model's weights in (the shipped file's own Q4_1,
and its float32 import quantized at load with ``--quantization q8_0`` / ``q4_k``), the same weights
run the text of ``tests/data/english_text.txt`` (teacher-forced, no BOS, as the default model's
tokenizer encodes it) three ways:

- ``reference``: float32 activations (``--activation-quantization none``), the text as one
  sequence in chunks of 64 tokens (prefill steps);
- ``alone``: int8 activations, one token per step (a decode step of a sequence alone: every
  product has one row, so every quantized product takes the integer path);
- ``batched``: int8 activations, chunks of 64 tokens (a step with more rows than
  ``quant_linear.INT8_MAX_TOKENS``: those products keep float32 activations, as in a large batch).

Per position ``i`` it compares the next-token distributions ``p = softmax(logits)`` (float64 from
the float32 logits): ``KL(reference || alone)`` (nats, mean and max over positions) and top-1
agreement (the share of positions where both argmaxes are the same token), and the same for
``batched`` against ``alone`` (what a sequence's distribution does when its step is shared with
others). ``float32 alone`` (float32 activations, one token per step) gives the scale of float32
rounding alone. ``tests/model/test_int8_activation_kl.py`` holds these figures within bounds.

llama.cpp's ``llama-perplexity --kl-divergence`` on the same file is the anchor this should be
compared with (it quantizes activations to 8 bits too); it needs llama.cpp's tools built
(``make -C perf/llama.cpp``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "tests" / "data" / "english_text.txt"
MODEL = "smollm2-135m-instruct"
BLOCK = 16
# weight type -> load_model keyword arguments (besides activation_quantization)
TYPES = {"q4_1": {}, "q8_0": {"dtype": "float32", "quantization": "q8_0"},
         "q4_k": {"dtype": "float32", "quantization": "q4_k"}}


def text_ids(n: int | None = None) -> list[int]:
    """The text's token ids (the default model's tokenizer), the first ``n``."""
    from folio.model.registry import resolve_model
    from folio.model.tokenizer import Tokenizer

    ids = Tokenizer.from_pretrained(resolve_model(MODEL)).encode(TEXT.read_text(encoding="utf-8"))
    return list(ids[:n] if n else ids)


def logits(model, config, ids, chunk: int) -> np.ndarray:
    """``[len(ids), V]`` float32 logits of every position, ``chunk`` tokens per step, one sequence."""
    from folio.model.attention_metadata import AttentionMetadata
    from folio.model.loader import allocate_kv_caches

    n = len(ids)
    nb = -(-n // BLOCK)
    table = np.arange(nb, dtype=np.int32)
    caches = allocate_kv_caches(config, nb, BLOCK, model.kernels)
    out = []
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        pos = np.arange(s, e, dtype=np.int64)
        md = AttentionMetadata(slot_mapping=table[pos // BLOCK].astype(np.int64) * BLOCK + pos % BLOCK,
                               query_start_loc=np.array([0, e - s], np.int32), seq_lens=np.array([e], np.int32),
                               block_tables=table[None, :].copy(), max_query_len=e - s, max_seq_len=e)
        out.append(model.forward(np.asarray(ids[s:e], np.int64), pos, md, caches, np.arange(e - s)))
    return np.concatenate(out)


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def compare(ref: np.ndarray, got: np.ndarray) -> dict:
    """``KL(softmax(ref) || softmax(got))`` per position (mean, max; nats) and top-1 agreement."""
    lp, lq = log_softmax(ref), log_softmax(got)
    kl = (np.exp(lp) * (lp - lq)).sum(axis=-1)
    return {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
            "top1": float((ref.argmax(-1) == got.argmax(-1)).mean()), "positions": int(len(kl))}


def measure(weight_type: str, ids: list[int]) -> dict:
    """The figures of the module docstring for one weight type (``TYPES``)."""
    from folio.model.loader import load_model

    runs = {}
    for act in ("none", "int8"):
        model, config, _ = load_model(MODEL, device="cpu", activation_quantization=act, **TYPES[weight_type])
        assert model.activation_quantization == act, (weight_type, act, model.activation_quantization)
        runs[act, 64] = logits(model, config, ids, 64)
        runs[act, 1] = logits(model, config, ids, 1)
        del model
    ref = runs["none", 64]
    return {"int8_alone": compare(ref, runs["int8", 1]), "int8_batched": compare(ref, runs["int8", 64]),
            "batched_vs_alone": compare(runs["int8", 64], runs["int8", 1]),
            "float32_alone": compare(ref, runs["none", 1])}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=0, help="the text's first N tokens (0: all)")
    p.add_argument("--types", default=",".join(TYPES))
    a = p.parse_args(argv)
    print("command: python -m perf.int8_activation_kl " + " ".join(sys.argv[1:]), flush=True)
    ids = text_ids(a.tokens or None)
    print(f"text: {TEXT.relative_to(ROOT)}, {len(ids)} tokens (as many positions)", flush=True)
    for t in a.types.split(","):
        r = measure(t, ids)
        for name, f in r.items():
            print(f"{t:5s} {name:17s} KL mean {f['kl_mean']:.6f} max {f['kl_max']:.5f} nats, "
                  f"top-1 agreement {f['top1']:.4f} ({f['positions']} positions)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
