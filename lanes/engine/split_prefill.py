"""Conditional disaggregation: short prompts prefilled where they decode, long ones by the prefill lane.

A prompt sent to a prefill lane of its own takes the long road: the order goes out at a step's
start, waits for the lane's running batch, is prefilled, and its KV is written into this engine's
blocks before a later step takes it in (pd on one H200: p50 ~125 ms, against one step's wait in
unified; docs/lanes_one_gpu.md). For a short prompt that road costs more than the prefill, and the
decode step barely notices a few hundred prompt tokens in a low-priority chunk. A long prompt is
what would stall decoding, and it is what the prefill lane is for. So each prompt goes by its length,
as NVIDIA Dynamo's disaggregated router does (`max_local_prefill_length`): at most
`local_max_tokens` tokens, where it decodes; more, to the prefill lane. Where it decodes is, in pd,
this engine's own chunked prefill (LocalPrefiller); in pdv, whose decode lane holds no target, the
verify replica that will verify it, with the draft's KV written here (deployments/channels/verify_prefill.py).
"""

from lanes.engine.backends import Prefiller
from lanes.engine.scheduler import Scheduler
from lanes.engine.sequence import Sequence
from lanes.sample.logprobs import TokenLogprobs
from lanes.spec.prefill import PrefillChunk

Landed = list[tuple[Sequence, int | BaseException, TokenLogprobs | None]]


class SplitPrefiller:
    """A Prefiller that routes each prompt, by its length, to `local` (where it decodes) or to `remote`
    (a prefill lane of its own). Each side sees only its own prompts, through both of its phases."""

    reuses_cached_blocks = False  # the prefill lane hands over whole prompts
    prefills_here = True

    def __init__(self, local: Prefiller, remote: Prefiller, local_max_tokens: int):
        assert local_max_tokens > 0, "0 sends every prompt to the prefill lane: use that prefiller alone"
        self.local, self.remote = local, remote
        self.local_max_tokens = local_max_tokens
        self.num_local = self.num_remote = 0  # prompts prefilled where they decode and by the lane, since start

    @property
    def has_replies(self) -> bool:
        return self.local.has_replies or self.remote.has_replies

    @property
    def num_in_flight(self) -> int:
        return getattr(self.local, "num_in_flight", 0) + self.remote.num_in_flight

    @property
    def prompts_prefilled(self) -> dict[str, int]:
        """Prompts prefilled since start, by where (the replica's stats and `vpd_prompts_prefilled{where}`)."""
        return {"decode_lane": self.num_local, "prefill_lane": self.num_remote}

    @property
    def draft_may_lag(self) -> bool:
        return self.local.draft_may_lag or self.remote.draft_may_lag

    def is_local(self, seq: Sequence) -> bool:
        # The tokens to prefill, the generated ones too after a preemption: a request is routed again
        # each time it is admitted, and stays where it went while it prefills (its count is fixed then).
        return seq.num_prefill_tokens <= self.local_max_tokens

    def take_in(self, scheduler: Scheduler, budget_tokens: int, decoding: bool) -> Landed:
        return self._both("take_in", scheduler, budget_tokens, decoding)

    def step(self, scheduler: Scheduler, budget_tokens: int, decoding: bool) -> Landed:
        return self._both("step", scheduler, budget_tokens, decoding)

    def _both(self, phase: str, scheduler: Scheduler, budget_tokens: int, decoding: bool) -> Landed:
        remote = getattr(self.remote, phase)(_Share(scheduler, lambda s: not self.is_local(s)), budget_tokens, decoding)
        local = getattr(self.local, phase)(_Share(scheduler, self.is_local), budget_tokens, decoding)
        self.num_remote += _prefilled(remote)
        self.num_local += _prefilled(local)
        return remote + local

    def holds_blocks(self, seq: Sequence) -> bool:
        return (self.local if self.is_local(seq) else self.remote).holds_blocks(seq)

    def forget(self, seq: Sequence) -> None:
        (self.local if self.is_local(seq) else self.remote).forget(seq)


class _Share:
    """The scheduler as one side of a split sees it: only the prompts routed to that side are
    prefilling; everything else is the scheduler's own."""

    def __init__(self, scheduler: Scheduler, routed_here):
        self._scheduler = scheduler
        self._routed_here = routed_here

    @property
    def prefilling(self) -> list[Sequence]:
        return [s for s in self._scheduler.prefilling if self._routed_here(s)]

    def prefill_chunks(self, budget_tokens: int) -> list[PrefillChunk]:
        return self._scheduler.prefill_chunks(budget_tokens, self.prefilling)

    def __getattr__(self, name: str):
        return getattr(self._scheduler, name)


def _prefilled(landed: Landed) -> int:
    return sum(not isinstance(first, BaseException) for _, first, _ in landed)
