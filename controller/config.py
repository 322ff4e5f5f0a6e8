"""`ControllerConfig`: bounds and targets of the draft-length controller, as written in the app YAML.

    controller:
      interval_s: 1.0
      max_draft_len: 8
      target_decode_p95_ms: 40
      verify_queue_high: 32
      verify_queue_low: 8
"""

from typing import Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Past 16 draft tokens even a 0.9 acceptance rate leaves < 20% chance that the tail is reached,
# while every extra token still costs a drafter step and a slot in the verify batch.
MAX_DRAFT_LEN_LIMIT = 16


class ControllerConfig(BaseModel):
    """Policy knobs; every field has a safe default, so `controller: {}` is a valid config."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(
        default=True,
        description="Run the controller. When false, decode replicas keep `initial_draft_len` forever.",
    )
    interval_s: float = Field(
        default=1.0, gt=0, description="Seconds between two decisions (one lane snapshot per decision)."
    )
    min_draft_len: int = Field(
        default=0, ge=0, description="Lowest draft length L. 0 lets the controller turn speculation off."
    )
    max_draft_len: int = Field(
        default=8, ge=1, le=MAX_DRAFT_LEN_LIMIT, description="Highest draft length L the controller may set."
    )
    initial_draft_len: int = Field(
        default=4, ge=0, description="Default L before the first decision; also where the default heads "
        "(given headroom) while no request's acceptance has been measured."
    )
    max_step: int = Field(
        default=2, ge=1, description="Largest change of any L (default or per request) in one decision."
    )
    raise_dwell: int = Field(
        default=3, ge=1, description="Consecutive decisions that must point up before an L rises."
    )
    lower_dwell: int = Field(
        default=2, ge=1, description="Consecutive decisions that must point down before an L falls. "
        "Smaller than `raise_dwell` so that overload is shed faster than capacity is taken.",
    )
    target_decode_p95_ms: float = Field(
        default=50.0, gt=0, description="Decode-lane (draft) step latency p95 above which the lanes count "
        "as saturated and the default L is driven toward `min_draft_len`.",
    )
    decode_headroom_frac: float = Field(
        default=0.8, gt=0, lt=1, description="Decode p95 must be at most this fraction of "
        "`target_decode_p95_ms` for the lanes to count as having headroom (room to raise L).",
    )
    shed_margin_frac: float = Field(
        default=0.5, gt=0, description="Decode p95 more than this fraction above `target_decode_p95_ms` is "
        "overload to shed at once: the default L is cut, without waiting for `lower_dwell` and past "
        "`max_step`, to floor((L + 1) * target / p95) - 1, so that the tokens per step (and with them the "
        "step time) shrink by target / p95.",
    )
    verify_token_budget: int | None = Field(
        default=None, ge=1, description="Tokens one verify batch holds, sum of (L + 1) over its requests, "
        "beyond which longer drafts cost more than they yield. Caps the default L at "
        "floor(budget / n) - 1 for n requests in flight per verify batch (`requests_per_verify_batch`): the "
        "cap follows the load before a queue forms, and lowers L past `max_step` in one move (after "
        "`lower_dwell`); raising L needs the cap to hold at n / `decode_headroom_frac`. A value: "
        "max_num_seqs * (L + 1) for the L that a calibration run finds best at a full batch. None: no cap.",
    )
    verify_queue_high: int = Field(
        default=32, ge=1, description="Verify-lane queue depth, in requests waiting for a verify batch slot, "
        "at or above which the verify lane counts as saturated.",
    )
    verify_queue_low: int = Field(
        default=8, ge=0, description="Verify-lane queue depth, in requests, at or below which there is "
        "headroom. Between low and high the default L holds (hysteresis band).",
    )
    occupancy_high: float = Field(
        default=0.9, gt=0, le=1, description="Verify batch occupancy (fraction of the batch capacity in use) "
        "at or above which L is not raised: longer drafts would not fit without a queue forming.",
    )
    slo_headroom_frac: float = Field(
        default=0.6, gt=0, lt=1, description="With `slo:` targets: the decode replicas' TTFT and TPOT p95 must be at "
        "most this fraction of their targets for the lanes to count as having headroom (room to raise L). Wider "
        "than `decode_headroom_frac`: near saturation a queue's wait, and so TTFT, grows far faster than the "
        "compute a longer draft takes, and a narrower band let L rise straight back over the target.",
    )
    accept_raise_min: float = Field(
        default=0.6, gt=0, lt=1, description="Fleet acceptance rate (per draft token) at or above which the "
        "default L may rise when there is headroom.",
    )
    accept_lower_below: float = Field(
        default=0.3, ge=0, lt=1, description="Fleet acceptance rate below which the default L falls, even "
        "without saturation, to the longest L any request's acceptance justifies (never below 1: only load "
        "turns speculation off). Must be below `accept_raise_min` (hysteresis band).",
    )
    ewma_alpha: float = Field(
        default=0.3, gt=0, le=1, description="Weight of the newest sample in the acceptance and arrival-rate "
        "EWMAs (1 = no smoothing).",
    )
    draft_cost_ratio: float = Field(
        default=0.1, gt=0, lt=1, description="Cost of one drafter step relative to one verify step (the `c` of "
        "Leviathan et al. 2023). Sets the L that maximises tokens per unit cost for a given acceptance rate; the "
        "step-cost model also takes this share of each step time as the drafter's. With `measure_draft_cost` "
        "on (the default) it is used only until the lanes report their measured forwards, and where they "
        "cannot (a drafter by prompt lookup runs no model).",
    )
    measure_draft_cost: bool = Field(
        default=True, description="Take the drafter's cost from the lanes: each replica times a one-token "
        "forward of its models over 16 and 64 rows when it starts (lanes/model/forward_cost.py). "
        "`draft_cost_ratio` becomes the drafter's median over the target's at 16 rows, and the step-cost model "
        "uses the drafter's own line through both sizes. The cost depends on the hardware as much as on the "
        "pair (the shipped 7B/TinyLlama pair measures 0.29 on an H200), so a fixed value picks the wrong L.",
    )
    min_gain_frac: float = Field(
        default=0.02, ge=0, description="Relative gain in expected tokens per unit cost (per second, for the "
        "step-cost cap) a new L must promise over the current one before the controller moves toward it; stops "
        "flapping between neighbouring L whose values are nearly equal.",
    )
    step_cost_enabled: bool = Field(
        default=True, description="Cap the default L by a step-cost model learned online from the decode "
        "replicas' step times (controller/cost_model.py): with n requests per verify batch and the fleet's "
        "acceptance, the L with the most expected tokens per second, n E(a, L) / (t(n (L + 1)) + c L t(n)), "
        "and 0 where none beats speculation off by `spec_min_gain_frac` (compute-bound verification; needs "
        "`min_draft_len` 0). Before the replicas have stepped, a step's cost is taken as independent of L.",
    )
    spec_min_gain_frac: float = Field(
        default=0.03, ge=0, description="Relative gain in expected tokens per second that the fastest L > 0 "
        "must promise over L = 0 for the step-cost model to leave speculation on: a margin for the model's "
        "error, so that speculation runs only where it pays.",
    )
    step_cost_window_decisions: int = Field(
        default=30, ge=1, description="Decisions whose step samples (one per decode replica per decision) "
        "the step-cost model is fitted to: long enough to span several draft lengths and batch sizes, short "
        "enough to follow a change of model, context length or hardware.",
    )
    step_cost_spread_frac: float = Field(
        default=0.02, gt=0, description="Spread of the window's tokens per step (standard deviation over "
        "mean) at which the window's own slope weighs as much as the previous fit's. A window with less "
        "spread (a steady load at one L) keeps the slope it learned, rather than forgetting what longer "
        "drafts cost.",
    )
    arrival_surge_ratio: float = Field(
        default=1.5, gt=1, description="Arrival rate above this multiple of its EWMA, while the requests in "
        "flight grow, counts as a surge: L is not raised while one is in progress, because the queue signals "
        "lag the arrivals.",
    )
    request_ttl_decisions: int = Field(
        default=10, ge=1, description="Decisions a request may go unreported before its state is dropped.",
    )

    @model_validator(mode="after")
    def _check_ranges(self) -> Self:
        if not self.min_draft_len <= self.initial_draft_len <= self.max_draft_len:
            raise ValueError(
                f"need min_draft_len <= initial_draft_len <= max_draft_len, got "
                f"{self.min_draft_len} <= {self.initial_draft_len} <= {self.max_draft_len}"
            )
        if self.verify_queue_low >= self.verify_queue_high:
            raise ValueError(
                f"verify_queue_low ({self.verify_queue_low}) must be below verify_queue_high "
                f"({self.verify_queue_high})"
            )
        if self.accept_lower_below >= self.accept_raise_min:
            raise ValueError(
                f"accept_lower_below ({self.accept_lower_below}) must be below accept_raise_min "
                f"({self.accept_raise_min})"
            )
        return self


class SloConfig(BaseModel):
    """Latency targets the replica planner (controller/planner.py) holds by scaling each lane, as written in
    the app YAML; every lane then autoscales under Serve with the planner as its policy:

        slo:
          ttft_p95_ms: 500
          tpot_p95_ms: 40
          max_replicas: 4
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    ttft_p95_ms: float | None = Field(
        default=None, gt=0, description="Time to first token, p95, that the lanes owning it (the prefill lane in pd "
        "and pdv, the one deployment in unified and spec) are scaled to hold. None: no TTFT target.",
    )
    tpot_p95_ms: float | None = Field(
        default=None, gt=0, description="Time per output token after the first, p95, that the lanes owning it (the "
        "decode lane, and pdv's verify lane) are scaled to hold. None: no TPOT target.",
    )
    max_replicas: int = Field(
        default=4, ge=1, description="Most replicas of any lane, unless its own `autoscaling_config` says otherwise. "
        "A lane's `num_replicas` is the count it starts at; it never falls below one.",
    )
    upscale_delay_s: float = Field(
        default=3.0, ge=0, description="Seconds a lane must want more replicas before it gets them (Serve's "
        "upscale_delay_s). Longer than the draft-length controller's shed (`lower_dwell` decisions), so L is shed "
        "first.",
    )
    downscale_delay_s: float = Field(
        default=20.0, ge=0, description="Seconds a lane must want fewer replicas before one is stopped (Serve's "
        "downscale_delay_s). Longer than L's rise (`raise_dwell` decisions), so L takes freed capacity first.",
    )
    draft_shed_grace_s: float = Field(
        default=5.0, ge=0, description="Seconds the planner leaves the draft-length controller to shed L once a "
        "target lane goes over target, and after each fall of L, before it asks for replicas (while L is above "
        "`controller.min_draft_len`). Scale-downs are not held for L: `downscale_delay_s` outlasts L's rise.",
    )
    urgent_pressure: float = Field(
        default=2.0, gt=1, description="A latency at or above this multiple of its target asks for replicas at "
        "once, without waiting for L to be shed.",
    )
    scale_down_frac: float = Field(
        default=0.6, gt=0, lt=1, description="A lane gives up a replica only while its load (batch slots or forward "
        "time in use), spread over one replica fewer, would be at most this fraction of its capacity (hysteresis: "
        "a lane scaled up past its target is not scaled down until its load is well under).",
    )
    down_latency_frac: float = Field(
        default=0.8, gt=0, lt=1, description="... and while its latencies are at most this fraction of their "
        "targets. Not lower: a latency has a floor that no replica count moves (a lone request's TTFT).",
    )
    max_step_up: int = Field(
        default=2, ge=1, description="Most replicas added to a lane in one decision.",
    )
    prefill_ttft_frac: float = Field(
        default=0.7, gt=0, le=1, description="pd, pdv: the share of `ttft_p95_ms` that the prefill lane's own time "
        "(queue, forward, KV hand-over) may take; the rest is the ingress, routing and the first decode step.",
    )
    verify_tokens_per_step: float = Field(
        default=2.0, ge=1, description="pdv: tokens one verify step yields per request (accepted drafts plus the "
        "bonus token; models/pair_metrics.json has the pair's): a verify call may take `tpot_p95_ms` times this.",
    )
    metrics_interval_s: float = Field(
        default=1.0, gt=0, description="How often each replica records its signals and pushes them to Serve's "
        "controller (Serve's metrics_interval_s).",
    )
    look_back_period_s: float = Field(
        default=4.0, gt=0, description="Seconds of those signals that Serve averages for each decision.",
    )

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.ttft_p95_ms is None and self.tpot_p95_ms is None:
            raise ValueError("slo needs a target: ttft_p95_ms, tpot_p95_ms or both")
        if self.look_back_period_s <= self.metrics_interval_s:
            raise ValueError(f"slo.look_back_period_s ({self.look_back_period_s:g}) must exceed "
                             f"slo.metrics_interval_s ({self.metrics_interval_s:g})")
        return self
