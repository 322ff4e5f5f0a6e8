"""The lanes' speed goals on one GPU: each lane mode against unified served in the same call (a ratio
between calls mixes two machines' states). Where unified ran more than once in a call, a p99 goal must
hold against each of its points, so a reference that drifted shows as a split verdict."""

from collections.abc import Callable
from statistics import mean

REFERENCE = "unified"
UNIFORM_MIN = {"pd": 0.9, "pdv": 0.85}  # output tok/s, mean of the uniform loads, ÷ unified's
TPOT_P99_MAX = {"pd": 1.1, "pdv": 1.1}  # mixed traffic at each rate: p99 TPOT ÷ unified's
STALL_P99_MAX = {"pd": 1.0, "pdv": 1.0, "spec": 3.0}  # mixed traffic at each rate: p99 decode stall ÷ unified's


def goal_rows(rows: list[dict], base_of: Callable[[str], str]) -> list[dict]:
    """One row per (mode, load, measure) with a goal and a reference: the ratio to each of unified's points,
    the goal, and whether it is met against every one. `rows`: results.row dicts with `mode` and `load`;
    `base_of`: a variant's mode of configs/ (pd512 -> pd)."""
    return _uniform(rows, base_of) + _mixed(rows, base_of)


def _uniform(rows: list[dict], base_of) -> list[dict]:
    uniform = [r for r in rows if r["load"].startswith("uniform c") and r["tok_s"] is not None]
    reference = [r["tok_s"] for r in uniform if r["mode"] == REFERENCE]
    if not reference:
        return []
    out = []
    for mode in dict.fromkeys(r["mode"] for r in uniform):
        if (goal := UNIFORM_MIN.get(base_of(mode))) is None or mode == REFERENCE:
            continue
        ratio = mean(r["tok_s"] for r in uniform if r["mode"] == mode) / mean(reference)
        out.append(_verdict(mode, "uniform", "tok/s", [ratio], f">= {goal}", ratio >= goal))
    return out


def _mixed(rows: list[dict], base_of) -> list[dict]:
    mixed = [r for r in rows if r["load"].startswith("mixed ") and r["load"].endswith("%")]
    out = []
    for load in dict.fromkeys(r["load"] for r in mixed):
        here = [r for r in mixed if r["load"] == load]
        references = [r for r in here if r["mode"] == REFERENCE]
        for r in (r for r in here if r["mode"] != REFERENCE):
            for column, goals, measure in (("tpot_ms p99", TPOT_P99_MAX, "p99 TPOT"),
                                           ("stall_ms p99", STALL_P99_MAX, "p99 decode stall")):
                goal = goals.get(base_of(r["mode"]))
                ratios = [r[column] / ref[column] for ref in references if r[column] is not None and ref[column]]
                if goal is not None and ratios:
                    out.append(_verdict(r["mode"], load, measure, ratios, f"<= {goal}", max(ratios) <= goal))
    return out


def _verdict(mode: str, load: str, measure: str, ratios: list[float], goal: str, met: bool) -> dict:
    return {"mode": mode, "load": load, "measure": measure, "ratio to unified": " / ".join(f"{x:.2f}" for x in ratios),
            "goal": goal, "met": "met" if met else "missed"}
