"""``folio convert-gguf FILE.gguf OUT_DIR``: import a Llama GGUF into a Hugging Face-style folder."""

from __future__ import annotations

import argparse
import time


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "convert-gguf",
        help="convert a Llama GGUF file into a Hugging Face folder (float32 safetensors + tokenizer)",
        description="Dequantize a Llama GGUF file (F32, F16, BF16, Q8_0, Q4_0, Q4_1, K-quants, ...) and write "
                    "config.json, model.safetensors (float32), tokenizer.json, tokenizer_config.json and "
                    "generation_config.json into OUT_DIR, which must not exist or be empty.",
    )
    p.add_argument("gguf_file", metavar="FILE.gguf", help="the GGUF file")
    p.add_argument("out_dir", metavar="OUT_DIR", help="folder to create")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .model.gguf_import import convert_gguf

    t0 = time.perf_counter()
    try:
        out = convert_gguf(args.gguf_file, args.out_dir)
    except FileExistsError as e:
        raise ValueError(str(e)) from None
    print(f"wrote {out} in {time.perf_counter() - t0:.1f} s")
    return 0
