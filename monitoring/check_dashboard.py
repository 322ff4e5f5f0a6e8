"""Check that every PromQL expression of the Grafana dashboard returns data from a live Prometheus.

Extracts each panel target's `expr` (rows' nested panels included) and each query variable's
`label_values(metric, label)`, substitutes Grafana's variables ($__rate_interval and friends by
--rate-interval, template variables by their "All" value or --var NAME=VALUE), runs each as an
instant query against Prometheus's HTTP API, and reports which returned at least one finite
sample. A NaN (e.g. 0/0 over an idle window) counts as no data.

GPU panels cannot return data on a machine without a GPU: with --no-gpu, expressions over
vpd_gpu_* metrics are reported as "no_gpu" instead of failing. Exit status 1 if any other
expression returned no data.

    python monitoring/check_dashboard.py --prometheus-url http://127.0.0.1:9090 [--no-gpu] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

DEFAULT_DASHBOARD = Path(__file__).resolve().parent / "grafana" / "verify-pd-dashboard.json"
GPU_METRIC_PREFIX = "ray_vpd_gpu_"
_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(?P<metric>.+?)\s*,\s*(?P<label>\w+)\s*\)\s*$")


@dataclass(frozen=True)
class DashboardQuery:
    where: str  # panel title and refId, or "variable NAME"
    expr: str  # as written in the dashboard


@dataclass(frozen=True)
class Outcome:
    where: str
    promql: str  # after substitution, as sent to Prometheus
    status: str  # "data", "empty", "no_gpu" or "error"
    num_series: int
    detail: str = ""


def dashboard_queries(dashboard: dict) -> list[DashboardQuery]:
    queries = [DashboardQuery(f"{panel['title']} [{target.get('refId', '?')}]", target["expr"])
               for panel in _all_panels(dashboard["panels"])
               for target in panel.get("targets", []) if target.get("expr")]
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") == "query":
            queries.append(DashboardQuery(f"variable {variable['name']}",
                                          _variable_promql(variable)))
    return queries


def _all_panels(panels: list[dict]) -> list[dict]:
    # Collapsed rows keep their panels nested inside the row.
    return [p for panel in panels for p in [panel, *_all_panels(panel.get("panels", []))]]


def _variable_promql(variable: dict) -> str:
    query = variable["query"]
    text = query["query"] if isinstance(query, dict) else query
    match = _LABEL_VALUES.match(text)
    if match is None:
        raise ValueError(f"variable {variable['name']}: only label_values(metric, label) is "
                         f"checked, got {text!r}")
    # The variable has values exactly when this returns series.
    return f"count by ({match['label']}) ({match['metric']})"


def template_defaults(dashboard: dict) -> dict[str, str]:
    """Each template variable's "All" value (a regex matching everything)."""
    return {v["name"]: v["allValue"] for v in dashboard.get("templating", {}).get("list", [])
            if v.get("allValue")}


def substitute(expr: str, rate_interval: str, variables: dict[str, str]) -> str:
    builtins = {"__rate_interval": rate_interval, "__interval": rate_interval,
                "__range": rate_interval}
    values = {**variables, **builtins}

    def replace(match: re.Match) -> str:
        name = match["braced"] or match["plain"]
        if name not in values:
            raise ValueError(f"no value for ${name} in {expr!r}")
        return values[name]

    return re.sub(r"\$\{(?P<braced>\w+)\}|\$(?P<plain>\w+)", replace, expr)


def has_finite_sample(result: list[dict]) -> bool:
    return any(math.isfinite(float(series["value"][1])) for series in result)


def query_prometheus(http: httpx.Client, prometheus_url: str, promql: str) -> list[dict]:
    response = http.get(f"{prometheus_url.rstrip('/')}/api/v1/query", params={"query": promql})
    body = response.json()
    if body.get("status") != "success":
        raise RuntimeError(f"{body.get('errorType')}: {body.get('error')}")
    data = body["data"]
    # A scalar result is one [time, value] pair rather than a list of series.
    return [{"value": data["result"]}] if data["resultType"] == "scalar" else data["result"]


def check(dashboard: dict, prometheus_url: str, rate_interval: str,
          variables: dict[str, str], gpu_present: bool) -> list[Outcome]:
    variables = {**template_defaults(dashboard), **variables}
    with httpx.Client(timeout=30.0) as http:
        return [_check_one(http, prometheus_url, query, rate_interval, variables, gpu_present)
                for query in dashboard_queries(dashboard)]


def _check_one(http: httpx.Client, prometheus_url: str, query: DashboardQuery,
               rate_interval: str, variables: dict[str, str], gpu_present: bool) -> Outcome:
    promql = substitute(query.expr, rate_interval, variables)
    try:
        result = query_prometheus(http, prometheus_url, promql)
    except (httpx.HTTPError, RuntimeError, ValueError) as exc:
        return Outcome(query.where, promql, "error", 0, f"{type(exc).__name__}: {exc}")
    if has_finite_sample(result):
        return Outcome(query.where, promql, "data", len(result))
    if not gpu_present and GPU_METRIC_PREFIX in promql:
        return Outcome(query.where, promql, "no_gpu", len(result), "needs a GPU")
    return Outcome(query.where, promql, "empty", len(result), "no finite sample")


def failures(outcomes: list[Outcome]) -> list[Outcome]:
    return [o for o in outcomes if o.status in ("empty", "error")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prometheus-url", required=True)
    parser.add_argument("--dashboard", type=Path, default=DEFAULT_DASHBOARD)
    parser.add_argument("--rate-interval", default="1m",
                        help="value of $__rate_interval (at least 4 scrape intervals)")
    parser.add_argument("--var", action="append", default=[], metavar="NAME=VALUE",
                        help="template variable value (default: its All value)")
    parser.add_argument("--no-gpu", action="store_true",
                        help="no GPU here: GPU expressions may be empty")
    parser.add_argument("--json", action="store_true", help="print outcomes as JSON")
    args = parser.parse_args(argv)
    variables = dict(item.split("=", 1) for item in args.var)
    outcomes = check(json.loads(args.dashboard.read_text()), args.prometheus_url,
                     args.rate_interval, variables, gpu_present=not args.no_gpu)
    if args.json:
        print(json.dumps([asdict(o) for o in outcomes], indent=2))
    else:
        for o in outcomes:
            print(f"{o.status:7} {o.num_series:3} series  {o.where}: {o.promql} {o.detail}")
    return 1 if failures(outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
