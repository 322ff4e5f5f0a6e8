"""What one forward of a model costs, measured once when a lane starts: a one-token forward over a
batch of rows, as a decode step runs it (graph replay where graphs are captured).

The controller's step-cost model needs the drafter's cost relative to the target's over the same rows
(the c of Leviathan et al. 2023; controller/cost_model.py). It is a property of the pair *and* the
hardware: the shipped 7B/TinyLlama pair on an H200 measures 0.29 (a drafter forward is bound by kernel
launches, not by its weights), where the parameter ratio says 0.16. A fixed default picks the wrong L:
0.1 made the controller draft 5 tokens at 16 in flight on the H200, where the measured ratio's L = 2
served 1.43x nospec against 1.25x (benchmarks/results/gpu_evidence_h200/README.md). Measured at start,
outside any request: the timing syncs the device, which the hot path never does."""

import statistics
import time

import torch

from lanes.model.runner import ModelRunner

# Two batch sizes, for a line in the batch size: a small drafter costs about the same at both (kernel
# launches), a large target more at 64 (controller/cost_model.py's DraftCost). 16 is also where the
# drafter-to-target ratio c is read: a mid-sized batch, memory-bound for both models on a GPU.
CALIBRATION_ROWS = (16, 64)
CALIBRATION_REPEATS = 7


def forward_costs_ms(runners: dict[str, ModelRunner]) -> dict[str, dict[int, float]]:
    """{model: {rows: ms}}: the median wall time of a one-token forward of each runner at each of
    CALIBRATION_ROWS rows that its pool's slots allow, after one unmeasured forward of each.

    The runners' forwards alternate, repeat by repeat. The controller reads the ratio of two of them,
    and a host that other work keeps busy for part of the measurement (replicas starting beside this one
    on a small machine) then slows each model alike, not whichever was being timed. Measured one model
    after the other, a target-sized drafter read 0.135 and 0.18 of its target in two runs of the suite on
    the 2-core machine (tests/test_controller_serve.py asks for more than 0.2)."""
    sizes = {name: sorted({max(1, min(rows, runner.pool.shape.num_slots)) for rows in CALIBRATION_ROWS})
             for name, runner in runners.items()}
    times_ms: dict[str, dict[int, list[float]]] = {name: {rows: [] for rows in rows_of}
                                                   for name, rows_of in sizes.items()}
    for repeat in range(CALIBRATION_REPEATS + 1):
        for name, runner in runners.items():
            for rows in sizes[name]:
                took_ms = _one_token_forward_ms(runner, rows)
                if repeat:  # the first warms caches (and on CPU the allocator)
                    times_ms[name][rows].append(took_ms)
    return {name: {rows: statistics.median(t) for rows, t in by_rows.items()} for name, by_rows in times_ms.items()}


def _one_token_forward_ms(runner: ModelRunner, rows: int) -> float:
    """Wall time of one forward of one token for `rows` rows, on the pool's pad slot."""
    _sync(runner.device)
    start_s = time.perf_counter()
    runner.pad_forward(rows, 0, 1, keep_last=False, prefill=False)
    _sync(runner.device)
    return (time.perf_counter() - start_s) * 1e3


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
