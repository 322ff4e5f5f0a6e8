"""A soak run, minute by minute (issue 33, item 2): every request and memory sample of a long run at
a steady rate, binned by minute, and the goals a soak must meet.

A request counts in the minute it ended (completed, failed or timed out; requests still ending after
the arrivals stopped count in a last "drain" row; in a soak still running, the minute under way is a
row "N (partial)"), so every submitted request is counted once; TPOT
percentiles are over the requests completed in that minute. Memory is each lane's processes summed at
each sample (a replaced replica is a new process of the same lane), averaged over the minute's
samples; `device_used_mib` is the whole GPU's use, whoever holds it.

Goals, as issue 33 words them, from minute `FIRST_MINUTE` (2: the first minute holds CUDA-graph
capture and pools filling) to the last whole minute (partial and drain rows left out): nothing failed or timed out; every memory
series within +2 %; p99 TPOT within +10 %. Each change is given both from the two minutes' own
values (the goal) and from a least-squares line over every minute between (less swayed by one noisy
minute, so a reader can tell a trend from noise).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from loadtest.records import STATUSES, RequestRecord

MINUTE_S = 60.0
FIRST_MINUTE = 2
MEMORY_GROWTH_MAX = 0.02
TPOT_GROWTH_MAX = 0.10
DRAIN = "drain"


def record_row(record: RequestRecord, origin_wall_s: float) -> dict:
    """What a soak keeps of a request (not its inter-token gaps): `sent_s` and `end_s` in seconds
    since the soak began (`origin_wall_s`, wall clock), by the wall-clock time it was sent."""
    sent_s = (record.sent_wall_s if record.sent_wall_s is not None else origin_wall_s + record.start_s) - origin_wall_s
    row = {k: v for k, v in record.to_row().items() if k not in ("itl_ms", "start_s", "end_s")}
    return {**row, "sent_s": round(sent_s, 3), "end_s": round(sent_s + record.end_s - record.start_s, 3)}


def read_records(path: Path) -> list[dict]:
    """The rows of a records file written a line a request (a last line cut off mid-write is skipped)."""
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def minute_of(t_s: float, duration_s: float, whole_minutes: int) -> int | str:
    """The row of a time: its minute (1-based) if that minute is over, else "N (partial)"; "drain"
    from `duration_s` on."""
    if t_s >= duration_s:
        return DRAIN
    minute = 1 + int(t_s // MINUTE_S)
    return minute if minute <= whole_minutes else partial(whole_minutes + 1)


def partial(minute: int) -> str:
    return f"{minute} (partial)"


def lane_memory(memory: pd.DataFrame) -> pd.DataFrame:
    """Per sample time: each lane's RSS and GPU memory (its processes summed; a process named
    "decode:1234" is lane "decode") and the device's use. Columns t_s, `rss_mib <lane>`,
    `gpu_mib <lane>` (where NVML saw the lane), device_used_mib."""
    if memory.empty:
        return pd.DataFrame(columns=["t_s"])
    frame = memory.assign(lane=memory["process"].str.split(":").str[0])
    rss = frame.pivot_table(index="t_s", columns="lane", values="rss_mib", aggfunc="sum")
    out = rss.rename(columns=lambda lane: f"rss_mib {lane}")
    if frame["gpu_mib"].notna().any():
        gpu = frame.dropna(subset=["gpu_mib"]).pivot_table(index="t_s", columns="lane", values="gpu_mib",
                                                           aggfunc="sum")
        out = out.join(gpu.rename(columns=lambda lane: f"gpu_mib {lane}"))
    if "device_used_mib" in frame and frame["device_used_mib"].notna().any():
        out = out.join(frame.groupby("t_s")["device_used_mib"].first())
    return out.reset_index()


def minutes(records: list[dict], memory: pd.DataFrame, duration_s: float, elapsed_s: float | None = None
            ) -> list[dict]:
    """A row per minute of the soak so far (`elapsed_s`, default the whole `duration_s`), then a
    "drain" row for what ended after the arrivals stopped: requests sent, ended by status, output
    tok/s, TPOT p50/p99, and each lane's mean memory over the minute's samples."""
    seen_s = min(duration_s, duration_s if elapsed_s is None else elapsed_s)
    whole = int(seen_s // MINUTE_S)
    labels: list[int | str] = list(range(1, whole + 1))
    if seen_s - whole * MINUTE_S > 0 or not labels:
        labels.append(partial(whole + 1))
    if any(r["end_s"] >= duration_s for r in records):
        labels.append(DRAIN)
    by_end = {label: [] for label in labels}
    sent = {label: 0 for label in labels}
    for r in records:
        by_end.setdefault(minute_of(r["end_s"], duration_s, whole), []).append(r)
        label = minute_of(r["sent_s"], duration_s, whole)
        sent[label] = sent.get(label, 0) + 1
    per_sample = lane_memory(memory)
    if not per_sample.empty:
        per_sample["minute"] = [minute_of(t, duration_s, whole) for t in per_sample["t_s"]]
    rows = []
    for label in by_end:
        ended = by_end[label]
        done = [r for r in ended if r["status"] == "completed"]
        tpot = [r["tpot_ms"] for r in done if r.get("tpot_ms") is not None]
        window_s = (MINUTE_S if isinstance(label, int) else None if label == DRAIN
                    else max(seen_s - whole * MINUTE_S, 1e-9))
        row = {"minute": label, "submitted": sent.get(label, 0),
               **{status: sum(r["status"] == status for r in ended) for status in STATUSES},
               "tok_s": (round(sum(r["completion_tokens"] for r in done) / window_s, 1) if window_s else None),
               "tpot_ms p50": _pct(tpot, 50), "tpot_ms p99": _pct(tpot, 99)}
        if not per_sample.empty:
            samples = per_sample[per_sample["minute"] == label]
            for column in per_sample.columns:
                if column not in ("t_s", "minute"):
                    value = samples[column].mean() if len(samples) else float("nan")
                    row[column] = None if pd.isna(value) else round(float(value), 1)
        rows.append(row)
    return rows


def _pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 2) if values else None


def change(series: dict[int, float], first: int = FIRST_MINUTE) -> dict | None:
    """A series' change from minute `first` to its last minute: from the two minutes' values, and
    from a least-squares line over every minute between (both as a fraction of the first minute's
    value). None with fewer than two minutes from `first` on, or a first value of 0."""
    points = sorted((m, v) for m, v in series.items() if m >= first and v is not None)
    if len(points) < 2 or not points[0][1]:
        return None
    (m0, v0), (m1, v1) = points[0], points[-1]
    slope, intercept = np.polyfit([m for m, _ in points], [v for _, v in points], 1)
    fitted0, fitted1 = intercept + slope * m0, intercept + slope * m1
    return {"from_minute": m0, "to_minute": m1, "first": v0, "last": v1, "change": round((v1 - v0) / v0, 4),
            "fitted_change": round((fitted1 - fitted0) / fitted0, 4) if fitted0 else None,
            "peak": max(v for _, v in points)}


def goals(rows: list[dict], first: int = FIRST_MINUTE) -> list[dict]:
    """Issue 33's soak goals on `minutes` rows: 0 failed (and none timed out) over every row, the
    drain included; each memory series and p99 TPOT flat from minute `first` to the last minute."""
    lost = sum(r["failed"] + r["timed_out"] for r in rows)
    out = [{"goal": "0 failed or timed out", "value": lost, "limit": 0, "ok": lost == 0}]
    whole = [r for r in rows if isinstance(r["minute"], int)]
    columns = [c for c in (whole[0] if whole else {}) if c.startswith(("rss_mib", "gpu_mib", "device_used_mib"))]
    for column, limit in [("tpot_ms p99", TPOT_GROWTH_MAX)] + [(c, MEMORY_GROWTH_MAX) for c in columns]:
        moved = change({r["minute"]: r.get(column) for r in whole}, first)
        if moved is None:
            out.append({"goal": f"{column} flat", "value": None, "limit": limit, "ok": None,
                        "note": f"fewer than two minutes from minute {first} on, or nothing to compare"})
            continue
        out.append({"goal": f"{column} flat", "value": moved["change"], "limit": limit,
                    "ok": moved["change"] <= limit, **moved})
    return out


def markdown(rows: list[dict], checks: list[dict], header: str = "") -> str:
    """The minutes as a table, then the goals."""
    columns = list(dict.fromkeys(c for r in rows for c in r))
    lines = [header] if header else []
    lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join("" if r.get(c) is None else str(r[c]) for c in columns) + " |" for r in rows]
    lines += ["", "| goal | change (minute 2 to last) | fitted change | limit | met |", "|---|---|---|---|---|"]
    for g in checks:
        value = g["value"] if g["goal"].startswith("0 ") else _percent(g["value"])
        lines.append(f"| {g['goal']} | {value} | {_percent(g.get('fitted_change'))} | "
                     f"{g['limit'] if g['goal'].startswith('0 ') else _percent(g['limit'])} | "
                     f"{'n/a' if g['ok'] is None else 'yes' if g['ok'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def _percent(value: float | None) -> str:
    return "" if value is None else f"{100 * value:+.1f} %"


def plot(rows: list[dict], path: Path) -> bool:
    """Completed and failed, TPOT, RSS and GPU memory per lane, by minute; False without matplotlib."""
    try:
        from loadtest.report import _pyplot

        plt = _pyplot()
    except ImportError:
        return False
    whole = [r for r in rows if isinstance(r["minute"], int)]
    if not whole:
        return False
    x = [r["minute"] for r in whole]
    fig, axes = plt.subplots(2, 2, figsize=(12, 7), sharex=True)
    ax = axes[0][0]
    ax.bar(x, [r["completed"] for r in whole], label="completed")
    ax.bar(x, [r["failed"] + r["timed_out"] for r in whole], bottom=[r["completed"] for r in whole],
           color="red", label="failed + timed out")
    ax.set_ylabel("requests ended")
    ax = axes[0][1]
    for column in ("tpot_ms p50", "tpot_ms p99"):
        ax.plot(x, [r[column] for r in whole], marker="o", label=column)
    ax.set_ylabel("TPOT (ms)")
    for ax, prefix in ((axes[1][0], "rss_mib"), (axes[1][1], "gpu_mib")):
        for column in [c for c in whole[0] if c.startswith(prefix) or (prefix == "gpu_mib" and c == "device_used_mib")]:
            ax.plot(x, [r.get(column) for r in whole], marker=".", label=column)
        ax.set_ylabel(f"{prefix.split('_')[0].upper()} per lane (MiB)")
        ax.set_xlabel("minute")
    for ax in axes.flat:
        ax.axvline(FIRST_MINUTE, color="grey", linestyle=":")
        if ax.get_legend_handles_labels()[0]:  # no GPU columns on the CPU
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
