"""Argument helpers shared by the ``folio bench`` subcommands."""

from __future__ import annotations

import argparse


def positive(v: str) -> int:
    n = int(v)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct", help="folio model name, HF folder or GGUF file")
    from .common import all_cores
    p.add_argument("--threads", type=positive, default=all_cores(),
                   help="threads for folio (Numba), torch and llama.cpp alike (default: every core this process "
                        "may use: %(default)s here); the command restarts itself once to apply it")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def add_weight_args(p: argparse.ArgumentParser) -> None:
    """folio's ``--dtype`` and ``--activation-quantization`` (as ``folio serve`` takes them)."""
    p.add_argument("--dtype", default="auto", choices=["auto", "float32"], help="folio's weights (see folio serve)")
    from folio.runtime.common.config import ACTIVATION_QUANTIZATIONS
    p.add_argument("--activation-quantization", default="auto", choices=list(ACTIVATION_QUANTIZATIONS),
                   help="folio: activations of quantized weights' products, int8, none (float32) or auto "
                        "(see folio serve)")


def with_threads(run):
    """Wrap a ``run(args)`` so the thread pools are sized before it runs (see common.reexec_with_threads)."""
    def func(args):
        from .common import reexec_with_threads
        reexec_with_threads(args.threads)  # returns only when the pools already have that size
        return run(args)
    return func
