"""``folio bench report``: the perf report (perf/REPORT.md, plots, report.json)."""

from __future__ import annotations

import argparse

from .cmd_args import add_common, with_threads


def _sections(v: str) -> list[int]:
    try:
        out = [int(x) for x in v.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"sections are numbers 1-7 separated by commas, got {v!r}")
    if not out or any(not 1 <= s <= 7 for s in out):
        raise argparse.ArgumentTypeError(f"sections are numbers 1-7, got {v!r}")
    return out


def add_parser(bench_subparsers) -> None:
    p = bench_subparsers.add_parser(
        "report", help="run the perf report's seven sections; write REPORT.md, PNG plots and report.json",
        description="Measures the claims of PagedAttention, Orca, prefix caching and chunked prefill on folio "
                    "(sections 1-7 of issue 6) and writes OUT/REPORT.md, OUT/report.json and OUT/fig*.png.")
    add_common(p)
    p.add_argument("--out", default="perf", help="output folder")
    p.add_argument("--sections", type=_sections, default=list(range(1, 8)), help="e.g. 1,3,7 (default: all)%(default).0s")
    p.add_argument("--tiny", action="store_true", help="tiny sizes (seconds; what the tests run)")
    p.add_argument("--no-peers", action="store_true", help="section 3 without transformers / llama.cpp")
    p.add_argument("--update", action="store_true",
                   help="rerun only --sections and merge them into the existing OUT/report.json (the other sections "
                        "are kept; REPORT.md says which were rerun)")
    p.add_argument("--rerender", action="store_true",
                   help="only redraw the plots and rewrite REPORT.md from OUT/report.json (no measurement)")
    p.set_defaults(func=with_threads(run))


def run(args) -> int:
    from .report import ReportSize, rerender, run_report
    if args.rerender:
        rerender(args.out)
        print(f"rewrote {args.out}/REPORT.md and the plots from {args.out}/report.json")
        return 0
    size = ReportSize.tiny() if args.tiny else ReportSize.full()
    if args.no_peers:
        size.s3_peers = ()
    data = run_report(args.out, sections=args.sections, size=size, size_name="tiny" if args.tiny else "full",
                      model=args.model, threads=args.threads, progress=not args.no_progress, update=args.update)
    if args.update:
        print(f"reran section(s) {', '.join(map(str, args.sections))} into {args.out}/report.json and REPORT.md")
        return 0
    print(f"wrote {args.out}/REPORT.md, {args.out}/report.json and the plots in {data['total_s'] / 60:.1f} min")
    return 0
