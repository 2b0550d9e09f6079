"""``meshtron plot RUN_DIR [RUN_DIR ...] [-o FILE.png|.svg|.html]``: one panel per metric, runs overlaid;
``meshtron compare RUN_A RUN_B [--tol T]``: per-step loss difference and throughput ratio, a gate for a change."""

from __future__ import annotations

import html
import importlib.util
import io
import math
import statistics
from pathlib import Path

from meshtron.errors import ConfigError
from meshtron.metrics.runs import Run, read_run

FIGSIZE = (12.0, 16.0)
DPI = 100
"""A PNG is FIGSIZE x DPI pixels: 1200 x 1600."""
PANELS = (  # (title, y key, x axis)
    ("loss", "loss", "step"),
    ("loss against tokens", "loss", "tokens"),
    ("evaluation loss", "eval_loss", "step"),
    ("tokens/s (global)", "tokens_per_s", "step"),
    ("MFU", "mfu", "step"),
    ("peak memory per rank (GB)", "max_memory_gb", "step"),
    ("gradient norm (before clipping)", "grad_norm", "step"),
    ("learning rate", "lr", "step"),
    ("reward accuracy (preference objectives)", "rewards/accuracies", "step"),
)
FORMATS = (".png", ".svg", ".html")
LINE_STYLES = ("-", "--", ":", "-.")


def _figure(runs: list[Run], dpi: int):
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(5, 2, figsize=FIGSIZE, dpi=dpi)
    for ax, (title, key, x_axis) in zip(axes.flat, PANELS):
        drawn = False
        for index, run in enumerate(runs):
            xs = run.tokens if x_axis == "tokens" else run.steps
            if xs is None:
                continue
            points = [(x, y) for x, y in zip(xs, run.column(key)) if y is not None and math.isfinite(y)]
            if points:
                # Later runs dashed and thinner, so that runs that agree (the point of overlaying) stay visible.
                ax.plot(
                    *zip(*points),
                    label=run.label,
                    linestyle=LINE_STYLES[index % len(LINE_STYLES)],
                    linewidth=max(0.8, 2.0 - 0.4 * index),
                    marker="." if len(points) < 30 else None,
                )
                drawn = True
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("tokens" if x_axis == "tokens" else "step", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if key == "mfu" and drawn:
            ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
        if not drawn:
            ax.text(
                0.5,
                0.5,
                {
                    "mfu": "not measured (no GPU peak known)",
                    "eval_loss": "no evaluation ([eval])",
                    "rewards/accuracies": "no preference objective (train.objective)",
                }.get(key, "not measured"),
                ha="center",
                va="center",
                transform=ax.transAxes,
                color="gray",
            )
    for spare in axes.flat[len(PANELS) :]:
        spare.axis("off")
    legend = axes.flat[-1]
    handles, labels = axes.flat[0].get_legend_handles_labels()
    legend.legend(handles, labels, loc="center", fontsize=9, title="runs (layout)")
    figure.tight_layout()
    return figure, plt


def plot_runs(paths: list[str | Path], out: str | Path | None = None, dpi: int = DPI) -> Path:
    """Draw the runs in ``paths`` into ``out`` (PNG of FIGSIZE x ``dpi`` pixels, SVG, or an HTML page with the SVG
    and a table); by default into the first run's metrics.png. The picture is redrawn in place on every call."""
    out = Path(out) if out is not None else Path(paths[0]) / "metrics.png"
    if out.suffix.lower() not in FORMATS:
        raise ConfigError(f"meshtron plot: -o '{out}' must end in {', '.join(FORMATS)}")
    if dpi < 1:
        raise ConfigError(f"meshtron plot: --dpi must be a positive integer, got {dpi}")
    runs = [read_run(path) for path in paths]
    if importlib.util.find_spec("matplotlib") is None:
        raise ConfigError("meshtron plot needs matplotlib: pip install 'meshtron[plot]' (or matplotlib)")
    figure, plt = _figure(runs, dpi)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.suffix.lower() == ".html":
            svg = io.StringIO()
            figure.savefig(svg, format="svg")
            out.write_text(_html_page(runs, svg.getvalue()))
        else:
            figure.savefig(out, dpi=dpi)
    except OSError as err:
        raise ConfigError(f"meshtron plot: cannot write '{out}' ({err}); choose a writable -o") from None
    finally:
        plt.close(figure)
    return out


def _html_page(runs: list[Run], svg: str) -> str:
    rows = "".join(
        f"<tr><td>{html.escape(run.label)}</td><td>{run.steps[-1]}</td><td>{run.rows[0]['loss']:.4f}</td>"
        f"<td>{run.rows[-1]['loss']:.4f}</td><td>{_last_evaluation(run)}</td><td>{_median_throughput(run):,.0f}</td>"
        "</tr>"
        for run in runs
    )
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>meshtron runs</title></head><body>"
        "<table border='1' cellpadding='4'><tr><th>run (layout)</th><th>steps</th><th>first loss</th>"
        "<th>last loss</th><th>last evaluation loss</th><th>median tokens/s</th></tr>"
        f"{rows}</table>{svg[svg.index('<svg') :]}</body></html>"
    )


def _last_evaluation(run: Run) -> str:
    evaluations = run.evaluations
    return f"{evaluations[max(evaluations)]:.4f} (step {max(evaluations)})" if evaluations else "-"


def _median_throughput(run: Run, steps: set[int] | None = None) -> float:
    """Median tokens/s over the run's steps after the first (which pays for warm-up), or of ``steps``."""
    values = [
        row["tokens_per_s"]
        for row in run.rows[1:] or run.rows
        if row.get("tokens_per_s") and (steps is None or row["step"] in steps)
    ]
    return statistics.median(values) if values else float("nan")


def compare_runs(path_a: str | Path, path_b: str | Path, tol: float, out=print) -> int:
    """Print, per step, both losses, their relative difference and B's throughput over A's; 0 when every step's
    losses agree within ``tol`` (relative) and both runs logged the same steps, else 1."""
    if not (math.isfinite(tol) and tol >= 0):
        raise ConfigError(f"meshtron compare: --tol must be a number >= 0 (a relative loss difference), got {tol}")
    a, b = read_run(path_a), read_run(path_b)
    loss_a = {row["step"]: row for row in a.rows}
    loss_b = {row["step"]: row for row in b.rows}
    common = sorted(set(loss_a) & set(loss_b))
    out(f"A: {a.label}\nB: {b.label}")
    out(f"{'step':>6}  {'loss A':>12}  {'loss B':>12}  {'rel. diff':>10}  {'tok/s B/A':>9}")
    worst, beyond = (0.0, None), []
    for step in common:
        la, lb = loss_a[step]["loss"], loss_b[step]["loss"]
        diff = abs(la - lb) / abs(la) if la else abs(lb)
        if not (diff <= tol):  # NaN counts as a difference
            beyond.append(step)
        if not diff <= worst[0]:
            worst = (diff, step)
        ta, tb = loss_a[step].get("tokens_per_s"), loss_b[step].get("tokens_per_s")
        ratio = f"{tb / ta:9.2f}" if ta and tb else f"{'-':>9}"
        out(f"{step:>6}  {la:12.6f}  {lb:12.6f}  {diff:10.2e}  {ratio}")
    speed = (
        _median_throughput(b, set(common[1:])) / _median_throughput(a, set(common[1:]))
        if len(common) > 1
        else float("nan")
    )
    only = sorted(set(loss_a) ^ set(loss_b))
    if not common:
        out("meshtron: the runs have no step in common")
        return 1
    eval_beyond, eval_only = _compare_evaluations(a, b, tol, out)
    if beyond or only or eval_beyond or eval_only:
        parts = []
        if beyond:
            parts.append(
                f"losses differ beyond --tol {tol:g} at {len(beyond)} of {len(common)} steps (largest "
                f"{worst[0]:.2e} at step {worst[1]})"
            )
        if only:
            parts.append(f"{len(only)} step(s) logged by one run only (first: {only[0]})")
        if eval_beyond:
            parts.append(f"evaluation losses differ beyond --tol {tol:g} after {len(eval_beyond)} step(s)")
        if eval_only:
            parts.append(f"{len(eval_only)} evaluation(s) in one run only (first after step {eval_only[0]})")
        out(f"meshtron: {'; '.join(parts)}; B's throughput is {speed:.2f}x A's")
        return 1
    evaluated = f" and {len(set(a.evaluations) & set(b.evaluations))} evaluations" if a.evaluations else ""
    out(
        f"meshtron: losses equal within --tol {tol:g} over {len(common)} steps{evaluated}; B's throughput is "
        f"{speed:.2f}x A's (median over the steps after the first)"
    )
    return 0


def _compare_evaluations(a: Run, b: Run, tol: float, out) -> tuple[list[int], list[int]]:
    """Print both runs' evaluation losses (``[eval]``) where either evaluated; (steps whose evaluation losses differ
    beyond ``tol``, steps only one run evaluated after when both evaluate)."""
    eval_a, eval_b = a.evaluations, b.evaluations
    if not (eval_a or eval_b):
        return [], []
    out(f"{'step':>6}  {'eval A':>12}  {'eval B':>12}  {'rel. diff':>10}")
    beyond = []
    for step in sorted(set(eval_a) | set(eval_b)):
        la, lb = eval_a.get(step), eval_b.get(step)
        if la is None or lb is None:
            out(f"{step:>6}  {_or_dash(la):>12}  {_or_dash(lb):>12}  {'-':>10}")
            continue
        diff = abs(la - lb) / abs(la) if la else abs(lb)
        if not (diff <= tol):
            beyond.append(step)
        out(f"{step:>6}  {la:12.6f}  {lb:12.6f}  {diff:10.2e}")
    only = sorted(set(eval_a) ^ set(eval_b)) if eval_a and eval_b else []
    return beyond, only


def _or_dash(value: float | None) -> str:
    return "-" if value is None else f"{value:.6f}"
