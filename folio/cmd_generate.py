"""``folio generate``: one prompt, a plain loop over the forward pass (greedy or softmax sampling).

This is the foundation's end-to-end check, not the engine: one sequence, a trivial block table
(blocks ``0..n-1``), one prefill step and then one decode step per token.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from .model.attention import AttentionMetadata
from .model.loader import allocate_kv_caches
from .runtime.config import DEFAULT_MODEL


def _to_numpy(xp, a) -> np.ndarray:
    return a.get() if hasattr(a, "get") and xp is not np else np.asarray(a)


def generate_ids(model, config, prompt_ids, max_tokens=32, temperature=0.0, ignore_eos=False,
                 eos_token_ids=None, seed=0, block_size=16) -> dict:
    """Generate up to ``max_tokens`` ids after ``prompt_ids`` with ``model`` (a LlamaForCausalLM).

    Greedy (argmax) when ``temperature == 0``, else one draw from ``softmax(logits / temperature)``
    per step with ``numpy.random.default_rng(seed)``. Generation stops at an EOS id (
    ``eos_token_ids``, default ``config.eos_token_ids``; the EOS id is included in the output)
    unless ``ignore_eos``, or after ``max_tokens``, or at ``max_position_embeddings``.

    Returns:
        dict: ``prompt_ids``, ``generated_ids`` (list[int]), ``finish_reason`` ("stop" | "length"),
        ``prefill_seconds``, ``decode_seconds``, ``decode_tokens_per_s`` (decode steps after the
        first token / decode_seconds; 0.0 when there were none).
    Raises:
        ValueError: empty prompt, negative max_tokens or temperature, or a prompt longer than the
            model's context.
    """
    prompt_ids = [int(t) for t in prompt_ids]
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    if max_tokens < 0 or temperature < 0:
        raise ValueError("max_tokens and temperature must be >= 0")
    max_len = config.max_position_embeddings
    if len(prompt_ids) >= max_len:
        raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit the context of {max_len}")
    eos = set(config.eos_token_ids if eos_token_ids is None else eos_token_ids)
    xp = model.kernels.xp
    total = min(len(prompt_ids) + max_tokens, max_len)
    n_blocks = (total + block_size - 1) // block_size
    caches = allocate_kv_caches(config, n_blocks, block_size, model.kernels)
    block_table = xp.asarray(np.arange(n_blocks, dtype=np.int32)[None, :])
    rng = np.random.default_rng(seed)

    def step(ids, start):
        n = len(ids)
        pos = np.arange(start, start + n, dtype=np.int64)
        md = AttentionMetadata(
            slot_mapping=xp.asarray(pos),  # block b holds positions b*bs .. b*bs+bs-1
            query_start_loc=xp.asarray(np.array([0, n], dtype=np.int32)),
            seq_lens=xp.asarray(np.array([start + n], dtype=np.int32)),
            block_tables=block_table, max_query_len=n, max_seq_len=start + n)
        logits = model.forward(xp.asarray(np.asarray(ids, dtype=np.int64)), xp.asarray(pos), md, caches,
                               xp.asarray(np.array([n - 1], dtype=np.int64)))
        row = _to_numpy(xp, logits)[0].astype(np.float64)
        if temperature == 0:
            return int(np.argmax(row))
        p = np.exp((row - row.max()) / temperature)
        return int(rng.choice(len(p), p=p / p.sum()))

    generated, finish = [], "length"
    t0 = time.perf_counter()
    prefill_s = decode_s = 0.0
    context = len(prompt_ids)
    if max_tokens > 0:
        generated.append(step(prompt_ids, 0))
        prefill_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        while True:
            if not ignore_eos and generated[-1] in eos:
                finish = "stop"
                break
            if len(generated) >= max_tokens or context >= total:  # length / context full
                break
            generated.append(step([generated[-1]], context))
            context += 1
        decode_s = time.perf_counter() - t1
    n_decode = max(len(generated) - 1, 0)
    return {
        "prompt_ids": prompt_ids,
        "generated_ids": generated,
        "finish_reason": finish,
        "prefill_seconds": prefill_s,
        "decode_seconds": decode_s,
        "decode_tokens_per_s": n_decode / decode_s if n_decode and decode_s > 0 else 0.0,
    }


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise ValueError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


def _run(args) -> int:
    from .model.loader import load_model
    from .model.tokenizer import Tokenizer

    ids_arg = _parse_ids(args.prompt_ids) if args.prompt_ids is not None else None  # fail before loading
    t0 = time.perf_counter()
    model, config, model_dir = load_model(args.model, device=args.device)
    tokenizer = Tokenizer.from_pretrained(model_dir)
    load_s = time.perf_counter() - t0
    if ids_arg is not None:
        prompt_ids = ids_arg
        bad = [t for t in prompt_ids if not 0 <= t < config.vocab_size]
        if bad:
            raise ValueError(f"token ids out of range [0, {config.vocab_size}): {bad[:5]}")
    else:
        prompt_ids = tokenizer.encode(args.prompt, add_special_tokens=False)
    out = generate_ids(model, config, prompt_ids, max_tokens=args.max_tokens, temperature=args.temperature,
                       ignore_eos=args.ignore_eos, eos_token_ids=tokenizer.eos_token_ids or None,
                       seed=args.seed)
    text = tokenizer.decode(out["generated_ids"], skip_special_tokens=True)
    if args.json:
        print(json.dumps({
            "prompt_ids": out["prompt_ids"],
            "generated_ids": out["generated_ids"],
            "text": text,
            "finish_reason": out["finish_reason"],
            "timings": {
                "load_seconds": round(load_s, 4),
                "prefill_seconds": round(out["prefill_seconds"], 4),
                "prefill_tokens_per_s": round(len(prompt_ids) / out["prefill_seconds"], 2)
                if out["prefill_seconds"] > 0 else 0.0,
                "decode_seconds": round(out["decode_seconds"], 4),
                "decode_tokens_per_s": round(out["decode_tokens_per_s"], 2),
            },
        }))
    else:
        print(text)
        print(f"[{len(out['generated_ids'])} tokens, finish_reason={out['finish_reason']}, "
              f"prefill {out['prefill_seconds']:.3f} s, decode {out['decode_tokens_per_s']:.1f} tok/s]",
              file=sys.stderr)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate text for one prompt (a plain loop over the forward pass)")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"model name or Hugging Face folder (default {DEFAULT_MODEL})")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (tokenized without special tokens)")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--max-tokens", type=int, default=32, help="most tokens to generate (default 32)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default), else softmax sampling")
    p.add_argument("--seed", type=int, default=0, help="RNG seed for sampling (default 0)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-sequence token")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"], help="device (default cpu)")
    p.add_argument("--json", action="store_true", help="print one JSON object with ids, text, finish_reason, timings")
    p.set_defaults(func=_run)
