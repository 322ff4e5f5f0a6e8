"""Lane timeline reports as replicas return them (deployments/telemetry/timeline.py), built for tests."""


def lane_report(lane, replica, uuid=None, **events):
    """One replica's report; each keyword is an event kind with its (start_s, end_s) spans."""
    return {"lane": lane, "replica": replica, "placement": {"node_id": "n", "gpu_uuid": uuid}, "ray_gpu_ids": [],
            "cuda_visible_devices": None,
            "events": {kind: [{"start_s": s, "end_s": e, "rows": 4, "calls": 1} for s, e in spans]
                       for kind, spans in events.items()}}
