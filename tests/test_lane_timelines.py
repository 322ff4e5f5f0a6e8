"""Reading lane timelines: interval arithmetic, lanes' busy shares and overlap, the wait before decoding."""

from benchmarks.lib.timelines import intersect, lane_activity, prefill_path_table, subtract, total_s, union
from tests.timeline_helpers import lane_report


def test_interval_arithmetic():
    assert union([(3, 4), (0, 1), (0.5, 2), (2, 2.5), (5, 5)]) == [(0, 2.5), (3, 4)]
    assert intersect([(0, 2), (3, 5)], [(1, 4)]) == [(1, 2), (3, 4)]
    assert subtract([(0, 10)], [(1, 2), (4, 5), (9, 11)]) == [(0, 1), (2, 4), (5, 9)]
    assert subtract([(0, 1)], []) == [(0, 1)] and total_s([(0, 1), (2, 4)]) == 3


def test_lane_activity_measures_verify_while_another_replica_drafts():
    # Replica A drafts 0-1 and waits 1-2; replica B drafts 1-2 and waits 2-3; verify runs 1-2 (A's
    # batch) and 2-3 (B's): during 1-2 the verify lane scores A while B drafts, during 2-3 nobody drafts.
    reports = [lane_report("decode", "A", step=[(0, 2)], verify_wait=[(1, 2)]),
               lane_report("decode", "B", step=[(1, 3)], verify_wait=[(2, 3)]),
               lane_report("verify", "V", verify=[(1, 2), (2, 3)])]
    lanes = lane_activity(reports, 0.0, 4.0)
    assert lanes["verify_busy_share"] == 0.5 and lanes["drafting_busy_share"] == 0.5
    assert lanes["overlap_s"] == 1.0 and lanes["verify_with_drafting_share"] == 0.5
    assert lanes["verify_forwards"] == 2 and lanes["rows_per_verify"] == 4
    only_a = lane_activity([reports[0], reports[2]], 0.0, 4.0)
    assert only_a["verify_with_drafting_share"] == 0.0  # one decode replica: the lanes take turns


def test_a_verify_cycle_splits_into_its_parts():
    # One decode replica steps 0-10 and waits for its verify call 4-9; the verify replica holds the call
    # 5-8.5 and runs its forward 6-8; nothing happens 10-12. Per forward (one): drafting 5 s (0-4, 9-10),
    # the forward 2, the replica around it 1.5, transit and hand-offs 1.5 (4-5, 8.5-9), between steps 2.
    reports = [lane_report("decode", "A", step=[(0, 10)], verify_wait=[(4, 9)]),
               lane_report("verify", "V", verify=[(6, 8)], verify_call=[(5, 8.5)])]
    parts = lane_activity(reports, 0.0, 12.0)["per_verify_ms"]
    assert parts == {"cycle": 12000, "drafting": 5000, "verify_forward": 2000, "verify_replica_besides_forward": 1500,
                     "transit_and_handoffs": 1500, "between_steps": 2000}
    assert sum(parts.values()) == 2 * parts["cycle"]  # the parts add up to the cycle
    older = lane_activity([reports[0], lane_report("verify", "V", verify=[(6, 8)])], 0.0, 12.0)["per_verify_ms"]
    assert older["verify_replica_besides_forward"] == 0 and older["transit_and_handoffs"] == 3000


def test_prefill_path_splits_the_wait_before_decoding():
    # Two requests submitted at 0 and 1: each waits for a prefill forward (2-3, one of 2 rows),
    # a hand-over and its decode replica taking the reply in; one submitted after the window is out.
    decode = lane_report("decode", "A")
    decode["events"]["prefill_wait"] = [
        {"start_s": 0.0, "end_s": 3.5, "reply_s": 3.25, "arrival_s": 0.0, "tokens": 9},
        {"start_s": 1.0, "end_s": 3.75, "reply_s": 3.25, "arrival_s": 0.5, "tokens": 9},
        {"start_s": 9.0, "end_s": 9.5, "reply_s": 9.4, "arrival_s": 9.0, "tokens": 9}]
    prefill = lane_report("prefill", "P", prefill=[(2.0, 3.0)])
    prefill["events"]["handover"] = [{"start_s": 3.0, "end_s": 3.25, "sent_s": 0.0, "received_s": 0.25, "batch_s": 2.0},
                                     {"start_s": 3.0, "end_s": 3.25, "sent_s": 1.0, "received_s": 1.5, "batch_s": 2.0}]
    path = lane_activity([decode, prefill], 0.0, 4.0)["prefill_path"]
    assert path["transit_ms"]["p50"] == 375.0 and path["queue_ms"]["p50"] == 1125.0  # sent → received → batch
    assert path["requests"] == 2 and path["forwards"] == 1 and path["rows_per_forward"] == 4
    assert path["wait_ms"]["p50"] == 3125.0 and path["pickup_ms"]["p50"] == 375.0 and path["admit_ms"]["p50"] == 250.0
    assert path["forward_ms"]["p50"] == 1000.0 and path["handover_ms"]["p50"] == 250.0
    assert path["forward_busy_share"] == 0.25
    assert "prefill_path" not in lane_activity([decode], 0.0, 4.0)  # modes without a prefill lane
    table = "\n".join(prefill_path_table([("c", "4/s", path)]))
    assert ("| c | 4/s | 2 | 250 / 475 | 3125 / 3462.5 | 375 / 487.5 | 1125 / 1687.5 | 375 / 487.5 | 1 | 4 | "
            "1000 / 1000 | 250 / 250 | 0.25 |") in table
    assert prefill_path_table([]) == []


def test_step_stats_split_a_lanes_time_into_steps_and_the_gaps_between_them():
    # One decode replica steps 0-1, 1.5-2.5 and 4-5 (gaps 0.5 and 1.5 s), a fourth step starts after the
    # window; a second replica steps 0-2 (no gap: one step). Rows are 4 a step (lane_report).
    reports = [lane_report("decode", "A", step=[(0, 1), (1.5, 2.5), (4, 5), (9, 10)]),
               lane_report("decode", "B", step=[(0, 2)])]
    steps = lane_activity(reports, 0.0, 8.0)["decode_steps"]
    assert steps["steps"] == 4 and steps["steps_per_s"] == 0.5 and steps["rows_per_step"] == 4
    assert steps["step_ms_mean"] == 1250.0 and steps["step_ms"]["p50"] == 1000.0
    assert steps["gap_ms_mean"] == 1000.0 and steps["gap_ms"]["p50"] == 1000.0
    assert steps["prefill_tokens_per_step"] == 0 and steps["oom_recoveries"] == 0  # events without the fields
    engine_report = lane_report("engine", "E", step=[(0, 1), (1, 2), (2, 3), (3, 4)])
    for event, (tokens, queued, ooms) in zip(engine_report["events"]["step"], [(512, 9, 0), (0, 7, 0), (256, 5, 1),
                                                                             (0, 3, 0)]):
        event.update(prefill_tokens=tokens, queued=queued, ooms=ooms)
    engine = lane_activity([engine_report], 0.0, 4.0)
    assert engine["engine_steps"]["gap_ms_mean"] == 0.0 and "decode_steps" not in engine
    assert engine["engine_steps"]["prefill_steps_share"] == 0.5 and engine["engine_steps"]["prefill_tokens_per_step"] == 192
    assert engine["engine_steps"]["queued_per_step"] == 6 and engine["engine_steps"]["oom_recoveries"] == 1
