"""``meshtron plot`` and ``meshtron compare``: look at runs and set them side by side (meshtron.metrics.plot)."""

from __future__ import annotations

import argparse

from meshtron.metrics.plot import DPI, FORMATS

PLOT_USAGE = "meshtron plot RUN_DIR [RUN_DIR ...] [-o FILE.png|.svg|.html]"
COMPARE_USAGE = "meshtron compare RUN_A RUN_B [--tol T]"


def add_runs_parsers(sub) -> None:
    plot = sub.add_parser(
        "plot", help="draw runs' metrics (loss, tokens/s, MFU, memory, grad norm, lr)", usage=PLOT_USAGE
    )
    plot.add_argument("runs", nargs="+", help="run directories (run.output_dir), overlaid")
    plot.add_argument(
        "-o", "--out", help=f"a new file for the picture: {' '.join(FORMATS)} (default: redraw RUN_DIR/metrics.png)"
    )
    plot.add_argument(
        "--dpi", type=int, default=DPI, help=f"PNG pixels per inch of the 12 x 13 inch figure (default {DPI})"
    )
    compare = sub.add_parser(
        "compare",
        help="per-step loss difference and throughput ratio of two runs; exits 1 when the losses differ beyond --tol",
        usage=COMPARE_USAGE,
    )
    compare.add_argument("run_a", help="the reference run directory")
    compare.add_argument("run_b", help="the run compared with it")
    compare.add_argument("--tol", type=float, default=1e-5, help="largest relative loss difference (default 1e-5)")


def run_plot(args: argparse.Namespace) -> int:
    from meshtron.metrics.plot import plot_runs

    out = plot_runs(args.runs, args.out, args.dpi)
    print(f"meshtron: drew {len(args.runs)} run(s) into {out}")
    return 0


def run_compare(args: argparse.Namespace) -> int:
    from meshtron.metrics.plot import compare_runs

    return compare_runs(args.run_a, args.run_b, args.tol)
