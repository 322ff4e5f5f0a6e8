"""The host-side state of one request as it moves through prefill, drafting and verification."""

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

import numpy as np

from lanes.sample.logprobs import TokenLogprobs
from lanes.sample.params import SamplingParams
from lanes.spec.stats import SpecDecodeStats

if TYPE_CHECKING:
    from lanes.sample.matcher import FirstTokenMask, RequestGrammar


class SeqStatus(Enum):
    WAITING = "waiting"  # no KV slot yet
    PREFILLING = "prefilling"  # slot held, prompt partly in the KV cache
    RUNNING = "running"  # decoding: draft, verify, repeat
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    draft_len: int  # L this request drafts per step (the controller may change it; 0 = no speculation)
    token_ids: list[int] = field(default_factory=list)  # prompt followed by the output so far
    status: SeqStatus = SeqStatus.WAITING
    target_slot: int | None = None
    # Which instance of a remote target pool holds target_slot (pdv: the verify replica's lease), so
    # that a slot number is never read or freed in a replica that did not hand it out.
    target_lease: str | None = None
    draft_slot: int | None = None
    num_prefilled: int = 0  # prompt tokens already written to the KV caches
    finish_reason: str | None = None
    stats: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    arrival_s: float = field(default_factory=time.time)  # wall clock, for timelines of where it waited
    prompt_logprobs: TokenLogprobs | None = None  # gathered chunk by chunk during prefill, when asked
    # The prompt's tokens once each, kept for a repetition penalty (lanes/sample/penalties.py).
    distinct_prompt_ids: np.ndarray | None = field(default=None, compare=False, repr=False)
    # Structured output: the matcher of the committed tokens (a prefill lane of its own gets the
    # first token's mask only); None for free text.
    grammar: "RequestGrammar | FirstTokenMask | None" = None
    block_keys: list[bytes] = field(default_factory=list, repr=False)  # prefix-cache keys of its prefill's full blocks
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (usage)
    num_migrations: int = 0  # times it was recomputed because a remote lane lost its KV (EngineCore)
    # Since when (time.monotonic) no replica has held its KV: when the remote call that found it lost
    # began waiting; None while a replica holds it. One lost for EngineConfig.recover_within_s fails.
    lost_s: float | None = None
    num_ooms: int = 0  # out-of-memory errors it met at the smallest step size or in a remote lane (EngineCore)
    # Prompt lookup's index of where its n-grams first end (lanes/spec/ngram.py NgramIndex), built on first use.
    lookup_index: object | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens prefill writes: the prompt, or after a preemption every token but the last (which,
        as the first output token after a prompt, is fed by the next decode step)."""
        return len(self.token_ids) - 1 if self.resumed else len(self.prompt_ids)

    @property
    def resumed(self) -> bool:
        """Preempted after it had output: its prefill recomputes KV and emits nothing."""
        return len(self.token_ids) > len(self.prompt_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def remaining_tokens(self) -> int:
        return self.params.max_tokens - self.num_output_tokens

    def step_draft_len(self, max_draft_len: int) -> int:
        """Drafts worth proposing this step: a verify emits up to L + 1 tokens, so never draft past max_tokens."""
        return max(0, min(self.draft_len, max_draft_len, self.remaining_tokens - 1))
