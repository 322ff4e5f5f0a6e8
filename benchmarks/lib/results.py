"""A benchmark's results: a row per point (every submitted request counted), Markdown tables, goals,
goodput under latency bounds, bar plots (matplotlib only if installed), files rewritten after every point."""

import argparse
import json
import math
from pathlib import Path

from benchmarks.lib.loads import Load, decode_stall_ms
from benchmarks.lib.pairs import PAIR_DIR
from loadtest.report import Point, _pyplot

TTFT_SLO_MS = 1000.0  # goodput: p99 TTFT within 1 s ...
TPOT_SLOS_MS = (15.0, 20.0, 30.0)  # ... and p99 TPOT within each of these


def request_rows(point: Point) -> list[dict]:
    """Every request, without its inter-token gaps (the summary has their percentiles)."""
    return [{k: v for k, v in r.to_row().items() if k != "itl_ms"} for r in point.result.records]


def point_document(load: Load, point: Point) -> dict:
    return {"mode": point.label, "load": load.name, "measured": load.measured, "arrivals": point.result.arrivals.label,
            "summary": point.summary.to_dict(), "requests": request_rows(point)}


def row(point: Point, **labels: str) -> dict:
    """One line of a results table: `labels` (e.g. mode and load), then the counts (every submitted request
    completed, failed or timed out), throughput, latencies, the decode stall and acceptance."""
    s = point.summary
    lat, spec = s.latency_ms, s.spec_decode
    return {**labels, "arrivals": point.result.arrivals.label,
            "submitted": s.submitted, "completed": s.completed, "failed": s.failed, "timed_out": s.timed_out,
            "rps": _round(s.request_throughput_rps, 2), "tok_s": round(s.output_token_throughput_tps, 1),
            **{f"{m} {q}": _round(getattr(lat[m], q)) for m in ("ttft_ms", "tpot_ms") for q in ("p50", "p95", "p99")},
            "stall_ms p99": _round(decode_stall_ms(point)),
            "acceptance": _round(spec.acceptance_rate if spec else None, 3),
            "errors": sorted({r.error for r in point.result.records if r.error})[:3]}


def point_line(point: Point) -> str:
    """row(point) and the requests in flight on one line, for the log."""
    s = point.summary
    cells = {**row(point), "in_flight mean": round(s.mean_in_flight, 1), "wall_s": round(s.wall_s, 1)}
    return ", ".join(f"{name} {value}" for name, value in cells.items() if value not in (None, []))


def _round(value, digits: int = 1):
    return None if value is None else round(value, digits)


def rounded(value):
    """Floats to 4 significant digits, all the way down."""
    if isinstance(value, float):
        return float(f"{value:.4g}")
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    return value


def rows_table(rows: list[dict], labels: int = 2) -> str:
    """`rows` as a Markdown table, then the clients' errors by the first `labels` columns."""
    if not rows:
        return "(no points)\n"
    columns = [c for c in rows[0] if c != "errors"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join("" if r.get(c) is None else str(r[c]) for c in columns) + " |" for r in rows]
    failures = {" ".join(str(r[c]) for c in columns[:labels]): r["errors"] for r in rows if r.get("errors")}
    if failures:
        lines += ["", "Errors seen by clients:", "```", json.dumps(failures, indent=1), "```"]
    return "\n".join(lines) + "\n"


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, None where either is missing or the denominator is 0."""
    return None if not numerator or not denominator else round(numerator / denominator, 3)


def verdict(value: float | None, goal: tuple[str, float]) -> str:
    """"met", "MISSED" or "not measured" for `value` against a goal (comparison, bound)."""
    if value is None:
        return "not measured"
    op, bound = goal
    return "met" if (value >= bound if op == ">=" else value <= bound) else "MISSED"


def goodput(points: list[dict], tpot_ms: float, ttft_ms: float = TTFT_SLO_MS) -> dict | None:
    """Of `points` ({"summary": Summary.to_dict(), ...}, one per offered rate), the one with the most
    completed requests/s where every submitted request completed, p99 TPOT within `tpot_ms` and p99 TTFT
    within `ttft_ms`; None when no rate met them."""
    def met(summary: dict) -> bool:
        lat = summary["latency_ms"]
        return (summary["completed"] == summary["submitted"] > 0
                and (lat["tpot_ms"]["p99"] or math.inf) <= tpot_ms and (lat["ttft_ms"]["p99"] or math.inf) <= ttft_ms)

    meeting = [p for p in points if met(p["summary"])]
    return max(meeting, key=lambda p: p["summary"]["request_throughput_rps"], default=None)


def script_parser(doc: str, budget_s: float | None, *, out: bool = True, pair: bool = False) -> argparse.ArgumentParser:
    """The flags the GPU scripts share: device and saved pairs; with `out`, the output directory and the time
    budget; with `pair`, the constructed pair's shape, agreement and seed."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--pair-dir", type=Path, default=PAIR_DIR,
                        help="saved constructed pairs (benchmarks/lib/pairs.py save_pair); a finished save is reused")
    if out:
        parser.add_argument("--out", type=Path, required=True)
        parser.add_argument("--budget-s", type=float, default=budget_s, help="the whole run, deploys included")
    if pair:
        parser.add_argument("--shape", choices=("tinyllama-7b", "small"), default="tinyllama-7b")
        parser.add_argument("--agreement", type=float, default=0.8, help="the constructed pair's designed agreement")
        parser.add_argument("--seed", type=int, default=0)
    return parser


def write_document(out: Path, name: str, document: dict, markdown: str) -> None:
    """Rewrite out/name.json and out/name.md (after every point, so a run cut short keeps them)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(document, indent=1, default=str))
    (out / f"{name}.md").write_text(markdown)


def pyplot():
    """matplotlib's pyplot (Agg), or None where matplotlib is not installed."""
    try:
        return _pyplot()
    except ImportError:
        return None


def plot_bars(rows: list[dict], path: Path, metrics: tuple[str, ...], x: str, series: str) -> bool:
    """One panel per metric: a bar per value of `x`, grouped by `series`; False without matplotlib."""
    plt = pyplot()
    if plt is None or not rows:
        return False
    names = list(dict.fromkeys(r[series] for r in rows))
    xs = list(dict.fromkeys(r[x] for r in rows))
    fig, axes = plt.subplots(1, len(metrics), figsize=(6 * len(metrics), 4), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        for i, name in enumerate(names):
            values = {r[x]: r[metric] or 0 for r in rows if r[series] == name}
            ax.bar([j + i / (len(names) + 1) for j in range(len(xs))], [values.get(v, 0) for v in xs],
                   width=1 / (len(names) + 1), label=str(name))
        ax.set_xticks(range(len(xs)), [str(v) for v in xs])
        ax.set_ylabel(metric)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
