"""Random-weight GGUF benchmark models shaped like Llama-3.2-1B and Llama-3.1-8B (issue 29).

No model hub is reachable from the benchmark machines, and the benchmark needs the *shapes* (and
the file layouts people download), not trained weights. This script makes them the way a user's
files are made, with llama.cpp's own tools:

1. a Hugging Face folder: ``config.json`` of the real model's shape (Llama 3 ``rope_scaling``
   included), bf16 safetensors with random weights (matrices ~ N(0, 0.02^2), norm weights
   ~ 1 + N(0, 0.02^2), as ``folio.model.weights.dummy_weights``; every tensor seeded from
   ``--seed`` and its name, so a file is the same whatever else is made), and the default model's
   tokenizer (SmolLM2's byte-level BPE, 49152 tokens: folio imports it into
   ``$FOLIO_HOME/models/smollm2-135m-instruct`` on first use). ``convert_hf_to_gguf.py`` pads the
   vocabulary to the config's 128256 with ``[PAD<i>]`` tokens (``TextModel.get_vocab_base``), so
   the embedding and output matrices have Llama 3's size;
2. ``convert_hf_to_gguf.py --outtype bf16`` -> ``<name>.BF16.gguf`` (lossless from bf16);
3. ``llama-quantize <name>.BF16.gguf <name>.<TYPE>.gguf <TYPE>`` for each ``--quants`` type
   (default Q4_K_M and Q8_0; no importance matrix, as for any random-weight file).

Both tools come from the llama.cpp source that ``perf/llama.cpp/Makefile`` builds (the pinned
llama-cpp-python sdist): ``convert_hf_to_gguf.py`` from its ``vendor/llama.cpp`` folder (it uses
the ``gguf-py`` beside it), ``llama-quantize`` from its build folder (or ``$FOLIO_LLAMA_CPP_BIN``).
``convert_hf_to_gguf.py`` imports torch and transformers: run this script with a separate
interpreter that has them, never folio's own venv::

    python3 -m venv perf/.venv-convert
    perf/.venv-convert/bin/pip install torch "numpy<2.3" "sentencepiece>=0.1.98,<0.3.0" \\
        "transformers==4.57.6" safetensors "protobuf>=4.21.0,<5.0.0" pyyaml tqdm
    # (the versions of llama.cpp's requirements/requirements-convert_hf_to_gguf.txt; torch from
    #  PyPI or https://download.pytorch.org/whl/cpu, any 2.x CPU build)
    make -C perf/llama.cpp                       # llama-quantize (and llama-server)
    .venv/bin/folio generate --help >/dev/null   # any folio use imports the default model once
    perf/.venv-convert/bin/python perf/make_gguf_models.py 1b
    perf/.venv-convert/bin/python perf/make_gguf_models.py 8b --quants Q4_K_M

Files land in ``--out`` (default ``$FOLIO_HOME/bench-models``, ``~/.cache/folio/bench-models``):
``llama3.2-1b-random.{Q4_K_M,Q8_0}.gguf`` and ``llama3.1-8b-random.{Q4_K_M,Q8_0}.gguf``. A step
whose output exists is skipped (delete a file to make it again). Intermediates are deleted as
soon as nothing needs them: the HF folder after conversion, the BF16 GGUF after the last
quantization (``--keep-bf16`` keeps it, e.g. as the 16-bit file of a comparison).

Disk (GB = 1e9 bytes; parameters: 1B shape 1.236e9, tied; 8B shape 8.030e9, untied):

==============================  ==========  ==========
step                              1B shape    8B shape
==============================  ==========  ==========
HF folder (bf16 safetensors)         2.5        16.1
+ BF16 GGUF (peak: both)             2.5        16.1       peak 5.0 / 32.1
HF folder deleted                   -2.5       -16.1
+ Q4_K_M                            ~0.8        ~4.9
+ Q8_0                              ~1.3        ~8.5       peak 4.6 / 29.5
BF16 GGUF deleted (default)         -2.5       -16.1
kept                                ~2.1       ~13.4
==============================  ==========  ==========

The two tools run under ``nice -n 10`` (the script says so; do not nice the script as well).
Memory: the HF folder is written in chunks of 16M values (~100 MB); the conversion memory-maps
the safetensors and writes tensor by tensor (peak ~ the largest tensor in float32: 1.1 GB / 2.1 GB).
Time on a shared 2-core Zen 4 VM (load 4-6 from other work): 1B: HF folder 34 s, conversion 70 s,
both quantizations 2 min. 8B: HF folder 7 min, conversion 4 min, Q4_K_M quantization 40 min
(at nice 19, behind the other work; the 1B's took ~1 min), Q8_0 a few minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
LLAMA_CPP_BUILD = REPO / "perf" / "llama.cpp" / "build"

# The two shapes (Hugging Face config.json of meta-llama/Llama-3.2-1B and meta-llama/Llama-3.1-8B,
# less the token ids, which are the tokenizer's).
SHAPES = {
    "1b": ("llama3.2-1b-random", {
        "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
        "tie_word_embeddings": True,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"}}),
    "8b": ("llama3.1-8b-random", {
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "tie_word_embeddings": False,
        "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"}}),
}
COMMON = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
          "hidden_act": "silu", "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
          "max_position_embeddings": 131072, "attention_bias": False, "mlp_bias": False,
          "torch_dtype": "bfloat16"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
SHARD_BYTES = 4 * 10**9      # safetensors shards of at most ~4 GB, like the hub's
CHUNK = 1 << 24              # values generated at once


def folio_home() -> Path:
    """``$FOLIO_HOME`` or ``~/.cache/folio`` (folio.model.registry.folio_home, which this
    interpreter cannot import)."""
    return Path(os.environ.get("FOLIO_HOME") or Path.home() / ".cache" / "folio").expanduser()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def hf_config(shape: str, tokenizer_dir: Path) -> dict:
    """The config.json of ``shape`` with the tokenizer's bos/eos ids."""
    cfg = {**COMMON, **SHAPES[shape][1]}
    src = tokenizer_dir / "config.json"
    if src.is_file():
        tok = json.loads(src.read_text())
        for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if tok.get(k) is not None:
                cfg[k] = tok[k]
    return cfg


def weight_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Hugging Face Llama tensor names -> shapes ([out, in] for matrices)."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    out = {"model.embed_tokens.weight": (v, h)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out.update({p + "input_layernorm.weight": (h,), p + "self_attn.q_proj.weight": (q, h),
                    p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.v_proj.weight": (kv, h),
                    p + "self_attn.o_proj.weight": (h, q), p + "post_attention_layernorm.weight": (h,),
                    p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                    p + "mlp.down_proj.weight": (h, i)})
    out["model.norm.weight"] = (h,)
    if not cfg["tie_word_embeddings"]:
        out["lm_head.weight"] = (v, h)
    return out


def bf16_bytes(x: np.ndarray) -> bytes:
    """float32 -> bfloat16 (round to nearest, ties to even), as little-endian bytes."""
    u = x.view(np.uint32)
    u = (u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
    return u.astype("<u2").tobytes()


def write_tensor(f, name: str, shape: tuple[int, ...], seed: int) -> None:
    """Random values of ``name`` (seeded by ``seed`` and the name), written as bf16 in chunks."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    n = int(np.prod(shape))
    for start in range(0, n, CHUNK):
        w = rng.standard_normal(min(CHUNK, n - start), dtype=np.float32)
        w *= np.float32(0.02)
        if len(shape) == 1:
            w += np.float32(1.0)
        f.write(bf16_bytes(w))


def write_hf_folder(shape: str, folder: Path, tokenizer_dir: Path, seed: int) -> None:
    """config.json, sharded bf16 safetensors (+ index) and the tokenizer files in ``folder``."""
    cfg = hf_config(shape, tokenizer_dir)
    shapes = weight_shapes(cfg)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shards, cur, size = [], [], 0
    for name, s in shapes.items():
        nbytes = 2 * int(np.prod(s))
        if cur and size + nbytes > SHARD_BYTES:
            shards.append(cur)
            cur, size = [], 0
        cur.append(name)
        size += nbytes
    shards.append(cur)
    weight_map, total = {}, 0
    for k, names in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        header, off = {"__metadata__": {"format": "pt"}}, 0
        for name in names:
            nbytes = 2 * int(np.prod(shapes[name]))
            header[name] = {"dtype": "BF16", "shape": list(shapes[name]), "data_offsets": [off, off + nbytes]}
            off += nbytes
            weight_map[name] = fname
        total += off
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        log(f"writing {fname} ({off / 1e9:.2f} GB, {len(names)} tensors)")
        with open(tmp / fname, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for name in names:
                write_tensor(f, name, shapes[name], seed)
    (tmp / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    for t in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / t, tmp / t)
    tmp.rename(folder)


def run(cmd: list[str]) -> None:
    """Run a heavy step under ``nice -n 10`` (the machine is shared), echoing its command."""
    cmd = ["nice", "-n", "10", *map(str, cmd)]
    log("$ " + " ".join(cmd))
    subprocess.run(cmd, check=True)


def default_llama_src() -> Path | None:
    found = sorted(LLAMA_CPP_BUILD.glob("llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py"))
    return found[-1].parent if found else None


def default_bin() -> Path | None:
    if os.environ.get("FOLIO_LLAMA_CPP_BIN"):
        return Path(os.environ["FOLIO_LLAMA_CPP_BIN"])
    found = sorted(LLAMA_CPP_BUILD.glob("llama.cpp-*/bin/llama-quantize"))
    return found[-1].parent if found else None


def make(shape: str, args) -> list[Path]:
    name = SHAPES[shape][0]
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    targets = [out / f"{name}.{q}.gguf" for q in args.quants]
    bf16 = out / f"{name}.BF16.gguf"
    hf = out / f"{name}-hf"
    if all(t.exists() for t in targets) and (bf16.exists() or not args.keep_bf16):
        log(f"{name}: all files exist")
        return targets
    if not bf16.exists():
        if not hf.exists():
            write_hf_folder(shape, hf, args.tokenizer, args.seed)
        tmp = bf16.with_suffix(".tmp")
        run([sys.executable, args.llama_src / "convert_hf_to_gguf.py", hf, "--outtype", "bf16",
             "--outfile", tmp])
        tmp.rename(bf16)
        if not args.keep_hf:
            shutil.rmtree(hf)
    if any(not t.exists() for t in targets) and (args.bin is None or not os.access(args.bin / "llama-quantize", os.X_OK)):
        raise SystemExit(f"no llama-quantize in {args.bin}: run `make -C perf/llama.cpp`, or pass --bin / set "
                         f"FOLIO_LLAMA_CPP_BIN (the finished steps are kept; run this again)")
    for t, q in zip(targets, args.quants):
        if not t.exists():
            tmp = t.with_suffix(".tmp")
            run([args.bin / "llama-quantize", bf16, tmp, q, str(args.threads)])
            tmp.rename(t)
    if not args.keep_bf16:
        bf16.unlink()
    for p in targets + ([bf16] if args.keep_bf16 else []):
        log(f"{p} ({p.stat().st_size / 1e9:.2f} GB)")
    return targets


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shapes", nargs="+", choices=sorted(SHAPES), help="which shapes to make")
    ap.add_argument("--quants", nargs="+", default=["Q4_K_M", "Q8_0"], help="llama-quantize types")
    ap.add_argument("--out", type=Path, default=folio_home() / "bench-models", help="output folder")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer", type=Path, default=folio_home() / "models" / "smollm2-135m-instruct",
                    help="folder with tokenizer.json and tokenizer_config.json (default: folio's import of "
                         "its default model)")
    ap.add_argument("--llama-src", type=Path, default=default_llama_src(),
                    help="llama.cpp source folder with convert_hf_to_gguf.py (default: perf/llama.cpp's)")
    ap.add_argument("--bin", type=Path, default=default_bin(),
                    help="folder with llama-quantize (default: $FOLIO_LLAMA_CPP_BIN, else perf/llama.cpp's build)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="llama-quantize threads")
    ap.add_argument("--keep-bf16", action="store_true", help="keep <name>.BF16.gguf")
    ap.add_argument("--keep-hf", action="store_true", help="keep the Hugging Face folder")
    args = ap.parse_args(argv)
    missing = [t for t in TOKENIZER_FILES if not (args.tokenizer / t).is_file()]
    if missing:
        ap.error(f"{args.tokenizer} lacks {', '.join(missing)}: run folio once (e.g. `make run`) so that it "
                 "imports its default model there, or pass --tokenizer")
    if args.llama_src is None or not (args.llama_src / "convert_hf_to_gguf.py").is_file():
        ap.error("no convert_hf_to_gguf.py: run `make -C perf/llama.cpp` (it extracts the llama.cpp source), "
                 "or pass --llama-src")
    try:
        import torch  # noqa: F401  (convert_hf_to_gguf.py needs it; fail before hours of work)
        import transformers  # noqa: F401
    except ImportError as e:
        ap.error(f"{e.name} is missing: run this script with the converter's own venv (see --help)")
    for shape in args.shapes:
        make(shape, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
