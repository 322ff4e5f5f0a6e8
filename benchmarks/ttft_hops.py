"""Where a served request's time to first token goes, hop by hop (issue 14: TTFT through the proxy
was several times TTFT through a handle, and no run had said where).

The load tester records when it sent each request (wall clock) and the response's id; the ingress
and the decode lane record each request on their timelines (deployments/timeline.py, kind
`request`) under that id. One clock per node (`time.time()`), so on one machine the hops (HOPS)
line up and add up to the client's TTFT.
"""

from __future__ import annotations

import statistics

from benchmarks.lane_timelines import timelines
from loadtest.records import RequestRecord

HOPS = {
    "proxy in": "the client sent it -> the ingress's handler began (Serve's proxy, the router)",
    "ingress": "-> the ingress called the decode lane (parse, validate, tokenize, admit)",
    "to engine": "-> the decode replica's generate() began (Serve's router, Ray)",
    "first token": "-> its first token left the engine (admission at a step boundary, prefill, step)",
    "to ingress": "-> the first token reached the ingress (Ray's streaming hand-off)",
    "proxy out": "-> the client read it (SSE through the proxy, the client's own parsing)",
}


def request_events(app: str, deployment: str, start_s: float) -> dict[str, dict]:
    """The deployment's `request` events since `start_s`, by request id (every replica's)."""
    reports = timelines(app, "", start_s, deployments=(deployment,))
    return {event["request_id"]: event for report in reports for event in report["events"].get("request", [])}


def hops_ms(record: RequestRecord, ingress: dict, decode: dict) -> list[float] | None:
    """One request's hops in ms, or None where a part is missing (no first token, not recorded)."""
    if record.ttft_ms is None or record.sent_wall_s is None or None in (ingress["first_s"], decode["first_s"]):
        return None
    marks = [record.sent_wall_s, ingress["start_s"], ingress["called_s"], decode["start_s"], decode["first_s"],
             ingress["first_s"], record.sent_wall_s + record.ttft_ms / 1e3]
    return [(b - a) * 1e3 for a, b in zip(marks, marks[1:])]


def ttft_hops(app: str, records: list[RequestRecord], start_s: float) -> dict:
    """p50 and mean of each hop over the completed requests found on both timelines."""
    ingress, decode = request_events(app, "Ingress", start_s), request_events(app, "DecodeLane", start_s)
    rows = [hops for r in records if r.status == "completed" and r.response_id in ingress
            and r.response_id in decode and (hops := hops_ms(r, ingress[r.response_id], decode[r.response_id]))]
    if not rows:
        return {"requests": 0}
    columns = list(zip(*rows))
    return {"requests": len(rows),
            "p50_ms": {hop: round(statistics.median(c), 2) for hop, c in zip(HOPS, columns)},
            "mean_ms": {hop: round(statistics.fmean(c), 2) for hop, c in zip(HOPS, columns)},
            "ttft_p50_ms": round(statistics.median(sum(row) for row in rows), 2)}


def hops_table(by_mode: dict[str, dict]) -> list[str]:
    """Markdown: one row a mode, each hop's p50 (mean) in ms."""
    if not any(h.get("requests") for h in by_mode.values()):
        return []
    lines = ["## TTFT through the proxy, hop by hop (p50, mean in brackets; ms)", "",
             "| mode | requests | " + " | ".join(HOPS) + " | TTFT p50 |", "|---|---|" + "---|" * (len(HOPS) + 1)]
    for mode, h in by_mode.items():
        if h.get("requests"):
            cells = [f"{h['p50_ms'][hop]} ({h['mean_ms'][hop]})" for hop in HOPS]
            lines.append(f"| {mode} | {h['requests']} | " + " | ".join(cells) + f" | {h['ttft_p50_ms']} |")
    return lines + [""] + [f"- {hop}: {meaning}" for hop, meaning in HOPS.items()] + [""]
