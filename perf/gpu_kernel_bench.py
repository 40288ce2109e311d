"""Each kernel of a decode layer timed on the GPU, against perf/gpu_model.py's bytes and FLOPs.

For perf/gpu_check.sh: one layer of a dummy model (``--model``, default Llama-3.1-8B's shape) at
each ``--batches`` size, every sequence ``--context`` tokens long: fused_add_rms_norm, the
q/k/v product, rope_and_cache, decode attention, o_proj, fused_add_rms_norm, gate/up, SiLU-and-mul,
down, then the step's lm_head and sampler (plain temperature). Each kernel is captured ``--reps``
times into a CUDA graph (so host launch time is not counted), replayed three times, and the
fastest replay over ``--reps`` is its time. Achieved GB/s and TFLOPS divide the model's bytes and
FLOPs of one call (``gpu_model.layer_kernel_costs``) by that time; the card's peaks come from
``gpu_model.CARDS`` by nvidia-smi's name (H200 when it names neither).

``--dry``: the CUDA table under the SIMT emulator ($FOLIO_CUDA_TABLE), a two-layer SmolLM2 shape
at batches 2 and 4: the code runs, the times mean nothing.

Usage: python perf/gpu_kernel_bench.py --out result.json [--model M] [--batches 128,256] [--dry]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "perf"))
BLOCK = 16


def card_name() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001 - no nvidia-smi (the dry run)
        return ""


def layer_inputs(k, cfg: dict, B: int, ctx: int, seed: int = 0) -> dict:
    """Device buffers of one decode layer of ``B`` sequences of ``ctx`` tokens (random bf16
    weights and KV cache, float32 activations)."""
    from folio.kernels import reference

    xp = k.xp
    H, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    Hq, Hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    D = cfg.get("head_dim") or H // Hq
    nb = -(-ctx // BLOCK)
    rng = np.random.default_rng(seed)
    w = lambda *shape: k.random_weight(shape, seed=int(rng.integers(1 << 30)))  # noqa: E731
    f32 = lambda a: xp.asarray(np.ascontiguousarray(a, dtype=np.float32))  # noqa: E731
    pos = np.full(B, ctx - 1, np.int64)
    table = np.arange(B * nb, dtype=np.int32).reshape(B, nb)
    inv = reference.rope_inv_freq(D, cfg.get("rope_theta", 10000.0), None)
    return {
        "x": f32(rng.standard_normal((B, H))), "residual": f32(rng.standard_normal((B, H))),
        "norm_w": w(H), "qkv_w": w((Hq + 2 * Hkv) * D, H), "o_w": w(H, Hq * D), "gate_up_w": w(2 * I, H),
        "down_w": w(H, I), "lm_head": w(V, H),
        "key_cache": w(B * nb, BLOCK, Hkv, D), "value_cache": w(B * nb, BLOCK, Hkv, D),
        "cos_sin": f32(reference.rope_cos_sin_cache(inv, ctx + 1)),
        "positions": xp.asarray(pos), "slots": xp.asarray(table[:, -1].astype(np.int64) * BLOCK + (ctx - 1) % BLOCK),
        "block_tables": xp.asarray(table), "seq_lens": xp.asarray(np.full(B, ctx, np.int32)),
        "qsl": xp.asarray(np.arange(B + 1, dtype=np.int32)),
        "params": f32(np.tile([0.6, 0.0, 1.0, 0.0], (B, 1))), "uniforms": xp.asarray(1.0 - rng.random(B)),
        "dims": (H, I, V, Hq, Hkv, D),
    }


def kernels_of_a_layer(k, b: dict, ctx: int):
    """``[(name, fn)]``: each kernel of the layer as a no-argument call writing preallocated buffers."""
    xp = k.xp
    H, I, V, Hq, Hkv, D = b["dims"]
    B = b["x"].shape[0]
    xb = xp.empty((B, H), dtype=np.uint16)
    res = xp.empty((B, H), dtype=np.float32)
    qkv = xp.empty((B, (Hq + 2 * Hkv) * D), dtype=np.float32)
    q = xp.empty((B, Hq, D), dtype=np.uint16)
    attn = xp.empty((B, Hq, D), dtype=np.uint16)
    hid = xp.empty((B, H), dtype=np.float32)
    gu = xp.empty((B, 2 * I), dtype=np.float32)
    act = xp.empty((B, I), dtype=np.uint16)
    logits = xp.empty((B, V), dtype=np.float32)
    tokens = xp.empty(B, dtype=np.int64)
    scale = 1.0 / np.sqrt(D)
    part, P = int(k.decode_partition_size), -(-ctx // int(k.decode_partition_size))
    k.reserve_decode_scratch(B, Hq, D, P * part)
    return [
        ("fused_add_rms_norm", lambda: k.fused_add_rms_norm(b["x"], b["residual"], b["norm_w"], 1e-5, out=xb,
                                                            residual_out=res)),
        ("qkv_proj", lambda: k.linear(xb, b["qkv_w"], out=qkv)),
        ("rope_and_cache", lambda: k.rope_and_cache(b["positions"], qkv, b["cos_sin"], b["key_cache"],
                                                    b["value_cache"], b["slots"], Hq, Hkv, out=q)),
        ("paged_attention decode", lambda: k.paged_attention(q, b["key_cache"], b["value_cache"], b["block_tables"],
                                                             b["seq_lens"], b["qsl"], scale, max_query_len=1,
                                                             max_seq_len=ctx, out=attn)),
        ("o_proj", lambda: k.linear(attn.reshape(B, Hq * D), b["o_w"], out=hid)),
        ("gate_up_proj", lambda: k.linear(xb, b["gate_up_w"], out=gu)),
        ("silu_and_mul", lambda: k.silu_and_mul(gu, out=act)),
        ("down_proj", lambda: k.linear(act, b["down_w"], out=hid)),
        ("lm_head", lambda: k.linear(xb, b["lm_head"], out=logits)),
        ("sample", lambda: k.sample(logits, b["params"], b["uniforms"], out=tokens)),
    ]


def time_kernel(k, fn, reps: int) -> float:
    """Seconds of one call: ``reps`` calls captured in a graph, the fastest of three replays."""
    dev = k.device
    with dev.activate():
        fn()  # warm-up (cuBLAS picks its algorithm outside the graph)
        with k.capture() as g:
            for _ in range(reps):
                fn()
        g.replay()
        mark, elapsed = dev.timer()
        marks = [mark()]
        for _ in range(3):
            g.replay()
            marks.append(mark())
        dev.synchronize()
    return min(elapsed(a, b) for a, b in zip(marks, marks[1:])) / reps


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="llama-3.1-8b-dummy")
    p.add_argument("--batches", default="128,256")
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--dry", action="store_true", help="the SIMT emulator, tiny sizes (the code runs, no timing)")
    args = p.parse_args(argv)
    from gpu_check_bench import DUMMY
    from gpu_model import CARDS, Shape, card_for, layer_kernel_costs

    from folio.kernels import get_kernels

    if args.dry:
        args.model, args.batches, args.context, args.reps = "smollm2-2l-dummy", "2,4", 40, 2
    cfg = DUMMY[args.model]
    name = card_name()
    card = card_for(name) or CARDS["h200"]
    result = {"command": "python perf/gpu_kernel_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "model": args.model, "context": args.context, "card": card.key, "nvidia_smi": name, "batches": {}}
    k = get_kernels("cuda")
    shape = Shape.from_config(cfg)
    ok = True
    for B in [int(x) for x in args.batches.split(",")]:
        rows = []
        b = layer_inputs(k, cfg, B, args.context)
        costs = layer_kernel_costs(shape, B, args.context)
        for kname, fn in kernels_of_a_layer(k, b, args.context):
            try:
                t = time_kernel(k, fn, args.reps)
            except Exception as e:  # noqa: BLE001 - recorded; the other kernels still run
                rows.append({"kernel": kname, "error": f"{type(e).__name__}: {e}"})
                ok = False
                continue
            c = costs[kname]
            gbs, tflops = c.bytes / t / 1e9, c.flops / t / 1e12
            rows.append({"kernel": kname, "us": round(1e6 * t, 2), "bound_us": round(1e6 * c.seconds(card), 2),
                         "GB_per_s": round(gbs, 1), "TFLOPS": round(tflops, 2),
                         "fraction_of_hbm": round(gbs * 1e9 / card.hbm_bytes_per_s, 3),
                         "fraction_of_bf16": round(tflops * 1e12 / card.bf16_flops, 3), "bound_by": c.bound_by(card)})
            r = rows[-1]
            print(f"batch {B:4d} {kname:24s} {r['us']:9.2f} us (bound {r['bound_us']:8.2f}) {r['GB_per_s']:8.1f} GB/s "
                  f"({100 * r['fraction_of_hbm']:5.1f}% of HBM) {r['TFLOPS']:7.2f} TFLOPS "
                  f"({100 * r['fraction_of_bf16']:5.1f}% of bf16)")
        result["batches"][B] = rows
        del b
    result["ok"] = ok
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
