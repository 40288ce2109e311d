"""``folio generate``: complete one prompt through the engine (``folio.LLM``) and print the text.

The same engine as ``folio serve`` in this process: paged KV cache, prefix caching, the sampler.
"""

from __future__ import annotations

import json
import sys
import time

from .runtime.common.config import ACTIVATION_QUANTIZATIONS, DEFAULT_MODEL


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise ValueError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


def _run(args) -> int:
    from .llm import LLM
    from .runtime.common.sampling_params import SamplingParams

    ids_arg = _parse_ids(args.prompt_ids) if args.prompt_ids is not None else None  # fail before loading
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                            ignore_eos=args.ignore_eos, top_p=args.top_p, top_k=args.top_k)
    t0 = time.perf_counter()
    llm = LLM(model=args.model, device=args.device, dtype=args.dtype, quantization=args.quantization,
              activation_quantization=args.activation_quantization, kv_cache_dtype=args.kv_cache_dtype)
    load_s = time.perf_counter() - t0
    prompt = {"prompt_token_ids": ids_arg} if ids_arg is not None else args.prompt
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    comp = out.outputs[0]
    m = out.metrics
    n_prompt, n_gen = len(out.prompt_token_ids), len(comp.token_ids)
    ttft = (m.first_token_time - m.arrival_time) if m.first_token_time else 0.0
    decode_s = (m.last_token_time - m.first_token_time) if m.first_token_time and m.last_token_time else 0.0
    timings = {
        "load_seconds": round(load_s, 4),
        "ttft_seconds": round(ttft, 4),
        "prefill_tokens_per_s": round(n_prompt / ttft, 2) if ttft > 0 else 0.0,
        "decode_seconds": round(decode_s, 4),
        "decode_tokens_per_s": round((n_gen - 1) / decode_s, 2) if n_gen > 1 and decode_s > 0 else 0.0,
    }
    if args.json:
        print(json.dumps({"prompt_ids": list(out.prompt_token_ids), "generated_ids": list(comp.token_ids),
                          "text": comp.text, "finish_reason": comp.finish_reason, "timings": timings}))
    else:
        print(comp.text)
        print(f"[{n_gen} tokens, finish_reason={comp.finish_reason}, TTFT {ttft:.3f} s, "
              f"decode {timings['decode_tokens_per_s']:.1f} tok/s]", file=sys.stderr)
        if comp.finish_reason == "stop" and n_gen <= 1 and not comp.text.strip():
            print("folio generate: the model ended its answer at once. --prompt goes in as plain text, without "
                  "the chat template, and an instruct model answers questions through its chat template: try "
                  "folio repl, LLM.chat, or POST /v1/chat/completions on folio serve", file=sys.stderr)
    return 0


def register(subparsers) -> None:
    from .cmd_serve import add_kv_cache_dtype_arg
    p = subparsers.add_parser("generate", help="complete one prompt through the engine and print the text")
    p.add_argument("--model", default=DEFAULT_MODEL, help="model name, Hugging Face folder or .gguf file")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (tokenized without special tokens)")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--max-tokens", type=int, default=32, help="most tokens to generate")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0 = off)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--seed", type=int, default=None, help="per-request sampling seed (None: unseeded)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-sequence token")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"], help="device")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="weights dtype (auto: the types the weights are stored in on CPU; see folio serve)")
    p.add_argument("--quantization", default=None, choices=["q8_0", "q4_k"],
                   help="quantize float weights into this GGUF type as they load (CPU)")
    p.add_argument("--activation-quantization", default="auto", choices=list(ACTIVATION_QUANTIZATIONS),
                   help="activations of the quantized weights' products: int8, none (float32) or auto "
                        "(see folio serve)")
    add_kv_cache_dtype_arg(p)
    p.add_argument("--json", action="store_true", help="print one JSON object with ids, text, finish_reason, timings")
    p.set_defaults(func=_run)
