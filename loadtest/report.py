"""Results on disk: JSON and CSV per run, a side-by-side table, and plots.

Layout under the output directory:

    <label>/<load>/result.json    config, summary and every request record (ITLs included)
    <label>/<load>/requests.csv   one row per submitted request (itl_ms as a JSON list)
    compare.csv, compare.txt      metrics as rows, one column per (label, load)
    compare.md                    the same table in Markdown
    latency_cdf.png               CDFs of TTFT, TPOT, ITL and E2E, one line per (label, load)
    load_curve.png                throughput and p95 latencies against load (several loads only)
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from loadtest.arrivals import ClosedLoop, OpenLoop
from loadtest.runner import RunResult
from loadtest.summary import LATENCY_METRICS, Summary, latency_values


@dataclass(frozen=True)
class Point:
    """One run of a comparison or sweep: which target, at which load."""

    label: str  # the target's name, e.g. a mode: nospec, spec, pd, pdv, unified
    result: RunResult
    summary: Summary

    @property
    def name(self) -> str:
        return f"{self.label} {self.result.arrivals.label}"


def point_dir(output_dir: Path, point: Point) -> Path:
    return output_dir / _slug(point.label) / _slug(point.result.arrivals.label)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)


def write_point(output_dir: Path, point: Point, config: dict) -> Path:
    """result.json and requests.csv of one run; returns their directory."""
    directory = point_dir(output_dir, point)
    directory.mkdir(parents=True, exist_ok=True)
    rows = [r.to_row() for r in point.result.records]
    document = {"label": point.label, "base_url": point.result.base_url,
                "model": point.result.model, "arrivals": point.result.arrivals.label,
                "started_unix_s": point.result.started_unix_s, "config": config,
                "summary": point.summary.to_dict(), "requests": rows}
    (directory / "result.json").write_text(json.dumps(document, indent=2))
    frame = pd.DataFrame(rows)
    if not frame.empty:
        frame["itl_ms"] = frame["itl_ms"].map(json.dumps)
    frame.to_csv(directory / "requests.csv", index=False)
    return directory


def comparison_table(points: list[Point]) -> pd.DataFrame:
    """Metrics as rows, one column per point, for printing side by side."""
    return pd.DataFrame({p.name: _table_column(p.summary) for p in points})


def _table_column(s: Summary) -> dict[str, float | int | None]:
    column: dict[str, float | int | None] = {
        "submitted": s.submitted, "completed": s.completed, "failed": s.failed,
        "timed_out": s.timed_out, "warmup_requests": s.warmup_requests, "wall_s": s.wall_s,
        "request_throughput_rps": s.request_throughput_rps,
        "output_token_throughput_tps": s.output_token_throughput_tps,
        "goodput_rps": s.goodput_rps,
        "mean_in_flight": s.mean_in_flight, "max_in_flight": s.max_in_flight,
    }
    for metric in LATENCY_METRICS:
        stats = s.latency_ms[metric]
        column |= {f"{metric} mean": stats.mean, f"{metric} p50": stats.p50,
                   f"{metric} p95": stats.p95, f"{metric} p99": stats.p99}
    spec = s.spec_decode
    column["acceptance_rate"] = spec.acceptance_rate if spec else None
    column["mean_acceptance_length"] = spec.mean_acceptance_length if spec else None
    return column


def write_comparison(output_dir: Path, points: list[Point]) -> pd.DataFrame:
    """compare.csv, compare.txt and the plots; returns the table."""
    table = comparison_table(points)
    table.to_csv(output_dir / "compare.csv")
    (output_dir / "compare.txt").write_text(table.to_string(float_format=_fmt, na_rep="n/a") + "\n")
    (output_dir / "compare.md").write_text(markdown_table(table))
    plot_latency_cdfs(points, output_dir / "latency_cdf.png")
    if len({p.result.arrivals for p in points}) > 1:
        plot_load_curves(points, output_dir / "load_curve.png")
    return table


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def markdown_table(table: pd.DataFrame) -> str:
    """A GitHub Markdown table of `table` (index as the first column), numbers as in compare.txt."""
    def cell(value) -> str:
        if value is None or (isinstance(value, float) and np.isnan(value)):
            return "n/a"
        return _fmt(value) if isinstance(value, float) else str(value)

    header = ["", *map(str, table.columns)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join([str(name), *map(cell, row)]) + " |"
              for name, row in zip(table.index, table.itertuples(index=False))]
    return "\n".join(lines) + "\n"


def _pyplot():
    # Imported on first plot, not with the module: tables and JSON need no matplotlib (the GPU
    # machine's image may lack it).
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on servers or CI
    import matplotlib.pyplot as plt
    return plt


def plot_latency_cdfs(points: list[Point], path: Path) -> None:
    """One panel per latency metric; a colour per label, a line style per load."""
    plt = _pyplot()
    colours = _label_colours(points)
    styles = dict(zip(dict.fromkeys(p.result.arrivals for p in points),
                      ["-", "--", ":", "-.", (0, (5, 1)), (0, (1, 3))] * 4))
    figure, axes = plt.subplots(2, 2, figsize=(11, 8))
    for axis, metric in zip(axes.flat, LATENCY_METRICS):
        largest = 0.0
        for point in points:
            values = np.sort(latency_values(point.result.records, metric))
            if values.size:
                axis.plot(values, np.arange(1, values.size + 1) / values.size, label=point.name,
                          color=colours[point.label], linestyle=styles[point.result.arrivals])
                largest = max(largest, values[-1])
        _log_latency_axis(axis, largest)
        axis.set_xlabel(f"{metric} (completed requests)")
        axis.set_ylabel("fraction")
        axis.grid(True, alpha=0.3)
    axes.flat[0].legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _log_latency_axis(axis, largest_ms: float) -> None:
    # Latencies span orders of magnitude; symlog keeps the 0 ms gaps of chunks that arrived
    # together on the axis, which a log scale would drop. Ticks at 1-2-5 unless that crowds.
    from matplotlib.ticker import FuncFormatter, SymmetricalLogLocator

    axis.set_xscale("symlog", linthresh=1.0)
    subs = [1, 2, 5] if largest_ms < 1000 else [1, 3]
    axis.xaxis.set_major_locator(SymmetricalLogLocator(base=10, linthresh=1.0, subs=subs))
    axis.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))


def _label_colours(points: list[Point]) -> dict[str, str]:
    return {label: f"C{i % 10}" for i, label in enumerate(dict.fromkeys(p.label for p in points))}


def plot_load_curves(points: list[Point], path: Path) -> None:
    """Throughput and p95 latencies against load, one line per label."""
    plt = _pyplot()
    panels = [("output_token_throughput_tps", "output tokens/s"),
              ("request_throughput_rps", "completed requests/s"),
              ("ttft_ms", "p95 TTFT (ms)"), ("tpot_ms", "p95 TPOT (ms)"),
              ("e2e_ms", "p95 E2E (ms)"), ("goodput_rps", "goodput (requests/s)")]
    colours = _label_colours(points)
    figure, axes = plt.subplots(2, 3, figsize=(15, 8))
    for axis, (key, title) in zip(axes.flat, panels):
        for label, colour in colours.items():
            mine = sorted((p for p in points if p.label == label),
                          key=lambda p: p.result.arrivals.load)
            axis.plot([p.result.arrivals.load for p in mine],
                      [_curve_value(p.summary, key) for p in mine], marker="o", label=label,
                      color=colour)
        axis.set_title(title)
        axis.set_xlabel(_load_axis_name(points))
        axis.set_xticks(sorted({p.result.arrivals.load for p in points}))
        axis.grid(True, alpha=0.3)
        if key == "goodput_rps" and all(p.summary.goodput_rps is None for p in points):
            axis.text(0.5, 0.5, "no SLO given (--slo)", ha="center", va="center",
                      transform=axis.transAxes)
    axes.flat[0].legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _curve_value(summary: Summary, key: str) -> float:
    if key in summary.latency_ms:
        value = summary.latency_ms[key].p95
    else:
        value = getattr(summary, key)
    return np.nan if value is None else value  # nan leaves a gap instead of a fake point


def _load_axis_name(points: list[Point]) -> str:
    kinds = {type(p.result.arrivals) for p in points}
    if kinds == {OpenLoop}:
        return "offered load (requests/s)"
    if kinds == {ClosedLoop}:
        return "concurrency (requests in flight)"
    return "load (requests/s or concurrency)"
