"""``folio bench <name>``: the benchmarks of a source checkout's ``perf/`` folder.

The benchmarks are not part of the installed library: they live in ``perf/bench/`` beside the
package (``perf.bench.serve``, ``cmd_throughput``, ``cmd_kernels``, ``cmd_report``) and call only
folio's public API. From a source checkout (``pip install -e .``, ``make``) ``folio bench`` finds
them there and loads them; from any other install it says where to get them. Each module defines
``add_parser(bench_subparsers)``, which adds its parser and sets ``func`` (like the top-level
commands in ``folio/cli.py``).
"""

from __future__ import annotations

import argparse
import importlib
import pathlib
import sys

# Benchmark modules, in the order `folio bench --help` lists them.
_BENCH_MODULES = [
    "perf.bench.serve",
    "perf.bench.cmd_throughput",
    "perf.bench.cmd_latency",
    "perf.bench.cmd_kernels",
    "perf.bench.cmd_report",
]

CHECKOUT = pathlib.Path(__file__).resolve().parent.parent
"""The source checkout this package runs from (its ``perf/bench/`` holds the benchmarks), if any."""


def _no_checkout(args) -> int:
    print(f"folio bench: the benchmarks live in a source checkout's perf/ folder, and {CHECKOUT / 'perf'} "
          "has none; clone the repository and run `make bench` (or `folio bench ...` from its .venv)",
          file=sys.stderr)
    return 2


def register(subparsers) -> None:
    if not (CHECKOUT / "perf" / "bench" / "__init__.py").is_file():
        p = subparsers.add_parser("bench", help="benchmarks: they need a source checkout (its perf/ folder)",
                                  description="The benchmarks live in a source checkout's perf/ folder, "
                                  f"and {CHECKOUT / 'perf'} has none: clone the repository and run "
                                  "`make bench` (or `folio bench ...` from its .venv).")
        p.add_argument("benchmark", nargs=argparse.REMAINDER, help="(needs a source checkout)")
        p.set_defaults(func=_no_checkout)
        return
    p = subparsers.add_parser("bench", help="benchmarks (folio bench serve, ...), from a source checkout")
    if str(CHECKOUT) not in sys.path:
        sys.path.insert(0, str(CHECKOUT))
    sub = p.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    for name in _BENCH_MODULES:
        importlib.import_module(name).add_parser(sub)
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])
