"""``folio bench <name>``: benchmarks, one module per name in ``_BENCH_MODULES``.

Each module defines ``add_parser(bench_subparsers)``, which adds its parser and sets ``func``
(like the top-level commands in ``folio/cli.py``).
"""

from __future__ import annotations

import importlib

# Benchmark modules, in the order `folio bench --help` lists them.
_BENCH_MODULES = [
    "folio.bench_serve",
    "folio.bench.cmd_throughput",
    "folio.bench.cmd_kernels",
    "folio.bench.cmd_report",
]


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmarks (folio bench serve, ...)")
    sub = p.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    for name in _BENCH_MODULES:
        importlib.import_module(name).add_parser(sub)
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])
