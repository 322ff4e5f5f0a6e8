"""Engine steps counted by what they launched: the split that says where a slow step's time went.

A co-located engine's step runs the decode (draft + verify) of every running request and may launch a
prefill forward next to it. On a GPU that prefill reads every weight once more, so how often a step
carries one (and with how many prompt tokens) moves the mean step time as much as the batch does.
Comparing them between the engine in process and served (`benchmarks/stream_latency.py` reads them):
equal decode-only step times with more prefill steps served means arrivals, not the server, cost the
time. Plain counters, updated once a step; nothing here syncs with the device.
"""

from dataclasses import asdict, dataclass

# A step this long is a stall, not a step: a CUDA graph captured or a kernel compiled on first use of
# a shape. Counted apart so that one capture does not pass for a slow engine.
STALL_STEP_MS = 200.0


@dataclass
class StepProfile:
    num_steps: int = 0
    num_prefill_steps: int = 0  # steps that launched a prefill forward
    prefill_tokens: int = 0  # prompt tokens those forwards ran
    decode_rows: int = 0  # running requests, summed over steps
    decode_only_ms: float = 0.0  # time in steps that launched no prefill
    prefill_step_ms: float = 0.0  # time in steps that launched one
    stall_steps: int = 0  # steps of STALL_STEP_MS or more (also counted above)
    stall_ms: float = 0.0  # their time

    def observe(self, rows: int, prefill_tokens: int, step_ms: float) -> None:
        self.num_steps += 1
        self.decode_rows += rows
        if step_ms >= STALL_STEP_MS:
            self.stall_steps += 1
            self.stall_ms += step_ms
        if prefill_tokens:
            self.num_prefill_steps += 1
            self.prefill_tokens += prefill_tokens
            self.prefill_step_ms += step_ms
        else:
            self.decode_only_ms += step_ms

    def since(self, earlier: "StepProfile") -> "StepProfile":
        """The counters of the steps after `earlier` was taken (a copy of this profile then)."""
        return StepProfile(*(now - then for now, then in zip(asdict(self).values(), asdict(earlier).values())))

    def summary(self) -> dict:
        """Means per step (None where no step of that kind ran)."""
        decode_only = self.num_steps - self.num_prefill_steps
        return {
            "steps": self.num_steps,
            "prefill_steps_share": _ratio(self.num_prefill_steps, self.num_steps),
            "prefill_tokens_per_prefill_step": _ratio(self.prefill_tokens, self.num_prefill_steps),
            "rows_mean": _ratio(self.decode_rows, self.num_steps),
            "decode_only_step_ms": _ratio(self.decode_only_ms, decode_only),
            "prefill_step_ms": _ratio(self.prefill_step_ms, self.num_prefill_steps),
            "stall_steps": self.stall_steps,
            "stall_ms": self.stall_ms,
        }


def _ratio(total: float, count: int) -> float | None:
    return total / count if count else None
