"""Per-request sampling parameters, validated once at the boundary."""

import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI's API and vLLM's default max_logprobs allow
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # seeds and top_k become int64 tensors


class ParamError(ValueError):
    """A request parameter is invalid. `field` names the offending parameter."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.reason = message

    def __reduce__(self):  # picklable: it crosses from an engine process to its replica
        return ParamError, (self.field, self.reason)


@dataclass
class SamplingParams:
    """How one request samples.

    temperature == 0 means greedy (argmax), which speculative decoding reproduces token for token.
    top_k == 0, top_p == 1.0 and min_p == 0.0 disable those filters. A seed makes the sampled output reproducible
    and independent of which other requests share the batch.
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one (after temperature)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # per output token: its logprob and the top-k alternatives (0 <= k <= 20)
    prompt_logprobs: int | None = None  # the same for every prompt token after the first

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        _check_int("max_tokens", self.max_tokens)
        # 0 scores the prompt and generates nothing: meaningful only with its logprobs.
        if self.max_tokens < 0 or (self.max_tokens == 0 and self.prompt_logprobs is None):
            raise ParamError("max_tokens", f"must be > 0 (0 only with prompt logprobs), got {self.max_tokens}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise ParamError("temperature", f"must be a number, got {type(self.temperature).__name__}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):  # also rejects NaN
            raise ParamError("temperature", f"must be a finite number >= 0, got {self.temperature}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ParamError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.min_p, bool) or not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            raise ParamError("min_p", f"must be in [0, 1], got {self.min_p!r}")
        _check_int("top_k", self.top_k)
        if not 0 <= self.top_k <= INT64_MAX:
            raise ParamError("top_k", f"must be in [0, 2**63) (0 disables it), got {self.top_k}")
        if self.seed is not None:
            _check_int("seed", self.seed)
            if not INT64_MIN <= self.seed <= INT64_MAX:
                raise ParamError("seed", f"must be a 64-bit signed integer, got {self.seed}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ParamError("stop", "must be a non-empty string or a list of non-empty strings")
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise ParamError("stop_token_ids", "must be a list of non-negative integers")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None:
                _check_int(name, k)
                if not 0 <= k <= MAX_LOGPROBS:
                    raise ParamError(name, f"must be in [0, {MAX_LOGPROBS}], got {k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _check_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ParamError(name, f"must be an integer, got {type(value).__name__}")
