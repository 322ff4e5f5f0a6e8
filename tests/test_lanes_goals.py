"""benchmarks/lib/goals.py: issue 28's verdicts from one call's rows, each lane mode against unified in the same call.

The results of two H200 calls of `benchmarks/lanes_1gpu.py` (benchmarks/results/lanes_1gpu_h200/) give the
expected verdicts: the documents' own figures, read again by the code that will write the next ones."""

import gzip
import json
from pathlib import Path

from benchmarks.lib.goals import goal_rows

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "lanes_1gpu_h200"
BASES = {"pd512": "pd", "pdv512": "pdv", "pd512_sm50": "pd"}


def base_of(mode: str) -> str:
    return BASES.get(mode, mode)


def _rows(call: str, part: str) -> list[dict]:
    return json.loads(gzip.open(RESULTS / call / f"lanes_1gpu_{part}.json.gz").read())["rows"]


def _verdicts(goals: list[dict]) -> dict[tuple[str, str, str], tuple[str, str]]:
    return {(g["mode"], g["load"], g["measure"]): (g["ratio to unified"], g["met"]) for g in goals}


def test_uniform_load_compares_the_mean_of_each_modes_loads_with_unifieds():
    # split_mps_uniform: unified 7,696 / 7,621, pd 7,495 / 7,722, pdv 6,335 / 6,440 tok/s.
    verdicts = _verdicts(goal_rows(_rows("split_mps_uniform", "uniform"), base_of))
    assert verdicts == {("pd", "uniform", "tok/s"): ("0.99", "met"), ("pdv", "uniform", "tok/s"): ("0.83", "missed")}


def test_mixed_traffic_holds_each_lane_mode_to_unifieds_p99s_at_each_rate():
    # split_mps_mixed_b: unified 5.4 / 53.0 and 7.8 / 55.1 ms; pd512 7.9 / 53.0 and 9.2 / 61.9.
    verdicts = _verdicts(goal_rows(_rows("split_mps_mixed_b", "mixed"), base_of))
    assert verdicts[("pd512", "mixed 50%", "p99 TPOT")] == ("1.46", "missed")
    assert verdicts[("pd512", "mixed 50%", "p99 decode stall")] == ("1.00", "met")  # equal to unified's is met
    assert verdicts[("pd512", "mixed 80%", "p99 TPOT")] == ("1.18", "missed")
    assert verdicts[("pdv512", "mixed 80%", "p99 decode stall")] == ("1.66", "missed")
    assert not any(load in ("warmup", "mixed c64") for _, load, _ in verdicts)  # the closed loop sets the rates


def _row(mode: str, load: str, **values) -> dict:
    return {"mode": mode, "load": load, "tok_s": None, "tpot_ms p99": None, "stall_ms p99": None, **values}


def test_a_reference_deployed_twice_must_be_met_against_each_and_modes_without_a_goal_are_left_out():
    rows = [_row("unified", "mixed 80%", **{"tpot_ms p99": 10.0, "stall_ms p99": 100.0}),
            _row("pd", "mixed 80%", **{"tpot_ms p99": 10.5, "stall_ms p99": 90.0}),
            _row("spec", "mixed 80%", **{"tpot_ms p99": 30.0, "stall_ms p99": 250.0}),
            _row("nospec", "mixed 80%", **{"tpot_ms p99": 9.0, "stall_ms p99": 500.0}),
            _row("unified", "mixed 80%", **{"tpot_ms p99": 9.0, "stall_ms p99": 80.0})]
    verdicts = _verdicts(goal_rows(rows, base_of))
    assert verdicts == {("pd", "mixed 80%", "p99 TPOT"): ("1.05 / 1.17", "missed"),  # met against the first only
                        ("pd", "mixed 80%", "p99 decode stall"): ("0.90 / 1.12", "missed"),
                        ("spec", "mixed 80%", "p99 decode stall"): ("2.50 / 3.12", "missed")}
    assert goal_rows([_row("pd", "uniform c64", tok_s=5.0)], base_of) == []  # no unified: no verdict
