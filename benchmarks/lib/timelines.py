"""Lane timelines (deployments/telemetry/timeline.py) fetched from a served app and read: how busy each lane
was, whether verify overlapped drafting, and where pd / pdv requests waited before decoding."""

import statistics

from ray import serve

from benchmarks.lib.results import rows_table
from deployments.telemetry.timeline import REPORT_PAGE_EVENTS, event_rows
from loadtest.summary import LatencyStats

LANE_DEPLOYMENTS = {"unified": ("DecodeLane",), "pd": ("PrefillLane", "DecodeLane"),
                    "pdv": ("PrefillLane", "DecodeLane", "VerifyLane")}

Interval = tuple[float, float]


def union(intervals) -> list[Interval]:
    """Sorted, non-overlapping intervals covering the same time."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        elif end > start:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def clip(intervals: list[Interval], lo: float, hi: float) -> list[Interval]:
    return [(max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi]


def total_s(intervals: list[Interval]) -> float:
    return sum(e - s for s, e in intervals)


def intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """Time in both (each a union)."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if end > start:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """Time in `a` but not in `b` (each a union)."""
    out = []
    for start, end in a:
        for s, e in b:
            if e <= start or s >= end:
                continue
            if s > start:
                out.append((start, s))
            start = max(start, e)
        if end > start:
            out.append((start, end))
    return out


def spans(report: dict, kind: str) -> list[Interval]:
    return [(e["start_s"], e["end_s"]) for e in report["events"].get(kind, [])]


def ms_quantiles(values_s, digits: int = 1) -> dict:
    """p50 and p95 of durations in seconds, as ms rounded to `digits` (None without values)."""
    stats = LatencyStats.of([v * 1e3 for v in values_s])
    return {q: None if getattr(stats, q) is None else round(getattr(stats, q), digits) for q in ("p50", "p95")}


def lane_activity(reports: list[dict], start_s: float, end_s: float) -> dict:
    """How busy each lane was in [start_s, end_s], and whether verify and drafting overlapped. A decode
    replica drafts during its steps except while it waits on the verify lane. `verify_with_drafting_share`:
    the part of the verify lane's forwards while some decode replica drafted (0: the lanes took turns)."""
    window_s = max(end_s - start_s, 1e-9)
    by_lane: dict[str, list[dict]] = {}
    for r in reports:
        by_lane.setdefault(r["lane"], []).append(r)
    out = {"window_s": round(window_s, 3)}
    for r in by_lane.get("engine", []):  # co-located: draft and verify take turns inside each step
        out.setdefault("engine_busy_share", []).append(
            round(total_s(clip(union(spans(r, "step")), start_s, end_s)) / window_s, 3))
    for lane in ("engine", "decode"):
        if lane in by_lane:
            out[f"{lane}_steps"] = step_stats(by_lane[lane], start_s, end_s)
    if "prefill" in by_lane:
        out["prefill_path"] = prefill_path(by_lane, start_s, end_s)
    if "verify" not in by_lane:
        return out
    verify = clip(union(s for r in by_lane["verify"] for s in spans(r, "verify")), start_s, end_s)
    drafting_each = [clip(subtract(union(spans(r, "step")), union(spans(r, "verify_wait"))), start_s, end_s)
                     for r in by_lane.get("decode", [])]
    drafting = union(s for d in drafting_each for s in d)
    both = total_s(intersect(verify, drafting))
    forwards = window_events(by_lane, "verify", "verify", start_s, end_s)
    out["per_verify_ms"] = verify_cycle(by_lane, verify, drafting, len(forwards), start_s, end_s)
    out |= {
        "verify_busy_share": round(total_s(verify) / window_s, 3),
        "drafting_busy_share": round(total_s(drafting) / window_s, 3),
        "drafting_busy_share_per_replica": [round(total_s(d) / window_s, 3) for d in drafting_each],
        "overlap_s": round(both, 3),
        "verify_with_drafting_share": round(both / total_s(verify), 3) if verify else None,
        "verify_forwards": len(forwards),
        "rows_per_verify": round(statistics.mean(e["rows"] for e in forwards), 2) if forwards else None,
        "decode_calls_per_verify": round(statistics.mean(e["calls"] for e in forwards), 2) if forwards else None,
    }
    return out


def step_stats(reports: list[dict], start_s: float, end_s: float) -> dict:
    """The steps of one lane's replicas that started in the window: how many, how long, over how many rows,
    the gap from a step's end to its replica's next step (the engine thread's time outside steps; for an
    engine in its own process, stamped when the report arrives), and, where the events carry them, the
    share that prefilled, prompt tokens and queued requests a step, out-of-memory recoveries."""
    steps, gaps = [], []
    for r in reports:
        own = sorted((e for e in r["events"].get("step", []) if start_s <= e["start_s"] < end_s),
                     key=lambda e: e["start_s"])
        steps += own
        gaps += [max(0.0, nxt["start_s"] - prev["end_s"]) for prev, nxt in zip(own, own[1:])]
    window_s = max(end_s - start_s, 1e-9)
    prefill = [e.get("prefill_tokens", 0) for e in steps]
    return {
        "steps": len(steps), "steps_per_s": round(len(steps) / window_s, 1),
        "step_ms": ms_quantiles((e["end_s"] - e["start_s"] for e in steps), digits=2),
        "step_ms_mean": round(1e3 * statistics.mean(e["end_s"] - e["start_s"] for e in steps), 2) if steps else None,
        "rows_per_step": round(statistics.mean(e["rows"] for e in steps), 2) if steps else None,
        "gap_ms": ms_quantiles(gaps, digits=2),
        "gap_ms_mean": round(1e3 * statistics.mean(gaps), 2) if gaps else None,
        # Older replicas' events lack these: 0.
        "prefill_steps_share": round(sum(t > 0 for t in prefill) / len(steps), 3) if steps else None,
        "prefill_tokens_per_step": round(statistics.mean(prefill), 1) if steps else None,
        "queued_per_step": round(statistics.mean(e.get("queued", 0) for e in steps), 2) if steps else None,
        "oom_recoveries": sum(e.get("ooms", 0) for e in steps),
    }


def verify_cycle(by_lane: dict[str, list[dict]], verify: list[Interval], drafting: list[Interval], forwards: int,
                 start_s: float, end_s: float) -> dict[str, float] | None:
    """Where pdv's draft → verify → back cycle goes, ms per verify forward; with one decode replica the parts
    add up to the cycle: drafting, the forward, the verify replica's time around it, the rest of the decode
    replica's wait (transit both ways, its thread hand-offs), and the time between its steps."""
    if not forwards:
        return None
    decode = by_lane.get("decode", [])
    waits = clip(union(s for r in decode for s in spans(r, "verify_wait")), start_s, end_s)
    calls = clip(union(s for r in by_lane["verify"] for s in spans(r, "verify_call")), start_s, end_s)
    steps = clip(union(s for r in decode for s in spans(r, "step")), start_s, end_s)
    # Replicas older than the verify_call event: the replica's own time is then in the transit.
    called = total_s(calls) if calls else total_s(verify)
    parts = {"cycle": end_s - start_s, "drafting": total_s(drafting), "verify_forward": total_s(verify),
             "verify_replica_besides_forward": called - total_s(verify),
             "transit_and_handoffs": total_s(waits) - called, "between_steps": (end_s - start_s) - total_s(steps)}
    return {name: round(value * 1e3 / forwards, 2) for name, value in parts.items()}


def window_events(by_lane: dict[str, list[dict]], lane: str, kind: str, start_s: float, end_s: float) -> list[dict]:
    """The `kind` events of every replica of `lane` that started in [start_s, end_s)."""
    return [e for r in by_lane.get(lane, []) for e in r["events"].get(kind, []) if start_s <= e["start_s"] < end_s]


def prefill_path(by_lane: dict[str, list[dict]], start_s: float, end_s: float) -> dict:
    """Where pd / pdv requests submitted in the window waited before decoding (prefill_path_table's
    footnote says what each part spans); forwards and hand-overs are the prefill lane's own."""
    waits = window_events(by_lane, "decode", "prefill_wait", start_s, end_s)
    forwards = window_events(by_lane, "prefill", "prefill", start_s, end_s)
    handovers = window_events(by_lane, "prefill", "handover", start_s, end_s)
    busy = clip(union((e["start_s"], e["end_s"]) for e in forwards), start_s, end_s)
    return {
        "requests": len(waits),
        "wait_ms": ms_quantiles(e["end_s"] - e["start_s"] for e in waits),
        "pickup_ms": ms_quantiles(e["end_s"] - e["reply_s"] for e in waits),
        "admit_ms": ms_quantiles(e["start_s"] - e["arrival_s"] for e in waits if "arrival_s" in e),
        "forwards": len(forwards),
        "rows_per_forward": round(statistics.mean(e["rows"] for e in forwards), 2) if forwards else None,
        "forward_ms": ms_quantiles(e["end_s"] - e["start_s"] for e in forwards),
        "handover_ms": ms_quantiles(e["end_s"] - e["start_s"] for e in handovers),
        "transit_ms": ms_quantiles(e["received_s"] - e["sent_s"] for e in handovers if e.get("received_s") is not None),
        "queue_ms": ms_quantiles(e["batch_s"] - e["received_s"] for e in handovers if e.get("received_s") is not None),
        "forward_busy_share": round(total_s(busy) / max(end_s - start_s, 1e-9), 3),
    }


def timelines(app: str, mode: str, start_s: float) -> list[dict]:
    """Every lane replica's timeline() since `start_s`, fetched page by page: a dict per replica, events as rows."""
    merged: dict[str, dict] = {}
    for deployment in LANE_DEPLOYMENTS[mode]:
        handle = serve.get_deployment_handle(deployment, app_name=app)
        offset, more = 0, True
        while more:
            pages = handle.broadcast("timeline", start_s, offset).results(timeout_s=60)
            for page in pages:
                report = merged.setdefault(page["replica"], {**page, "events": {}})
                for kind, columns in page["events"].items():
                    report["events"].setdefault(kind, []).extend(event_rows(columns))
            more = any(page["more"] for page in pages)
            offset += REPORT_PAGE_EVENTS
    return list(merged.values())


def prefill_path_table(rows: list[tuple[str, str, dict]]) -> list[str]:
    """Markdown: where pd / pdv requests waited before decoding; rows of (run, load, prefill_path)."""
    if not rows:
        return []

    def pair(stats: dict | None) -> str:
        if stats is None:  # timelines from before the field was recorded
            return "n/a"
        return " / ".join("n/a" if stats[k] is None else f"{stats[k]:g}" for k in ("p50", "p95"))

    waits = {"arrived → submitted": "admit_ms", "submitted → decoding": "wait_ms", "sent → received": "transit_ms",
             "received → batch began": "queue_ms", "reply → decoding": "pickup_ms"}
    table = [{"run": run, "load": load, "requests": path["requests"],
              **{f"{span} p50 / p95 ms": pair(path.get(key)) for span, key in waits.items()},
              "prefill forwards": path["forwards"], "rows per forward": str(path["rows_per_forward"]),
              "forward p50 / p95 ms": pair(path["forward_ms"]), "hand-over p50 / p95 ms": pair(path["handover_ms"]),
              "prefill busy": path["forward_busy_share"]} for run, load, path in rows]
    return ["## Before decoding: the prefill path", "", rows_table(table),
            "arrived → submitted: at its decode replica until sent to the prefill lane; submitted → "
            "decoding: until in its decode replica's batch; sent → received: transit to the prefill replica; "
            "received → batch began: its wait for a forward; hand-over: the forward's end until the reply "
            "is ready (KV writes, RPCs); reply → decoding: the decode engine taking it in.", ""]
