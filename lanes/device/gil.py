"""How long a thread may keep the GIL while another waits for it, in processes where a thread that launches
GPU work shares the interpreter with threads that must answer at once.

A thread that launches a forward drops the GIL in every torch call and takes it back a few microseconds
later. A thread waiting for the GIL (an event loop that has a reply to send, a socket reader with a new
request) wakes up late and usually finds it taken again. It then waits for the switch interval, 5 ms by
default, before the interpreter forces a hand-over. It can pay that on every wake-up. 0.5 ms bounds each
such wait; the price is a forced switch every 0.5 ms between threads that are both busy, a few
microseconds each.

The processes: an engine replica with the engine on a thread (deployments/engine_replica.py); the engine
process, whose step loop shares it with the thread that reads the replica's socket (lanes/engine/process.py);
the prefill and verify replicas, whose lane worker thread shares it with Serve's event loops
(deployments/lane_worker.py).

`VPD_SWITCH_INTERVAL_MS` overrides it (Python's own default: 5), for A/B runs.
"""

import os
import sys

SWITCH_INTERVAL_S = 0.0005


def switch_interval_s() -> float:
    value = os.environ.get("VPD_SWITCH_INTERVAL_MS")
    if value is None:
        return SWITCH_INTERVAL_S
    try:
        interval_s = float(value) / 1e3
    except ValueError:
        raise ValueError(f"VPD_SWITCH_INTERVAL_MS must be a number of milliseconds, not {value!r}") from None
    if not interval_s > 0:
        raise ValueError(f"VPD_SWITCH_INTERVAL_MS must be above 0, not {value!r}")
    return interval_s


def hand_over_gil_quickly() -> None:
    """Set this process's switch interval (process-wide: every thread of it)."""
    sys.setswitchinterval(switch_interval_s())
