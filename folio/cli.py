"""The ``folio`` command line: one sub-command per module in ``_COMMAND_MODULES``.

Each module defines ``register(subparsers)``, which adds its parser and sets ``func`` (a callable
taking the parsed ``argparse.Namespace`` and returning an exit code).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from . import __version__

# Sub-command modules, in the order `folio --help` lists them.
_COMMAND_MODULES = [
    "folio.cmd_generate",
    "folio.cmd_convert",
    "folio.cmd_serve",
    "folio.cmd_repl",
    "folio.cmd_bench",
]


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the descriptions' layout and shows every flag's default. A help text that states
    its default in words ends with ``%(default).0s`` (which prints nothing): argparse appends
    ``(default: ...)`` only to a help text that does not mention ``%(default)``."""


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` with ``HelpFormatter`` as the default, for every sub-command."""

    def __init__(self, *args, formatter_class=HelpFormatter, **kwargs):
        super().__init__(*args, formatter_class=formatter_class, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="folio", description="folio: a small LLM serving engine for Llama models")
    parser.add_argument("--version", action="version", version=f"folio {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError, RuntimeError, ConnectionError) as e:
        print(f"folio {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
