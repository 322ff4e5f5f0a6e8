"""Per-request sampling parameters, validated once at the boundary."""

import math
from dataclasses import dataclass, field
from typing import Literal

MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI's API and vLLM's default max_logprobs allow
MAX_PENALTY = 2.0  # OpenAI's bound on |presence_penalty| and |frequency_penalty|
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on a logit_bias value; larger ones are clamped to it, as vLLM does
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # seeds and top_k become int64 tensors


class ParamError(ValueError):
    """A request parameter is invalid. `field` names the offending parameter."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.reason = message

    def __reduce__(self):  # picklable: it crosses from an engine process to its replica
        return ParamError, (self.field, self.reason)


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match; plain text, so it pickles to an engine process."""

    kind: Literal["json", "json_object", "regex", "choice", "grammar"]
    spec: str  # the JSON schema's text, the regex, the EBNF grammar, or a JSON list of choices ("" for json_object)
    field: str  # the request field it came from, named in errors (response_format, guided_json, ...)
    # JSON: any whitespace between tokens (xgrammar's and vLLM's default), else one space after ',' and
    # ':' only. Compact by default here: sampled from the shipped pair, 5 of 8 outputs under a schema
    # ran into max_tokens (300) on runs of tabs and spaces; compact, 16 of 16 finished in < 60 tokens.
    any_whitespace: bool = False

    def __post_init__(self):
        if self.kind not in ("json", "json_object", "regex", "choice", "grammar"):
            raise ParamError(self.field, f"unknown structured output kind {self.kind!r}")
        if not isinstance(self.spec, str) or (not self.spec and self.kind != "json_object"):
            raise ParamError(self.field, "must not be empty")


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
    # Penalties and constraints on the raw logits (vLLM's definitions; lanes/sample/penalties.py applies them).
    presence_penalty: float = 0.0  # subtracted from the logit of every token already in the output
    frequency_penalty: float = 0.0  # subtracted once per occurrence in the output
    repetition_penalty: float = 1.0  # tokens in the prompt or output: positive logits divided, negative multiplied
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (clamped to [-100, 100])
    min_tokens: int = 0  # EOS and stop_token_ids cannot be sampled before this many output tokens
    # Set by the engine (add_request): the ids min_tokens holds back, stop_token_ids plus EOS unless
    # ignore_eos (vLLM's all_stop_token_ids). They travel with the params to every lane.
    min_tokens_stop_ids: list[int] = field(default_factory=list, repr=False)
    structured: "StructuredOutput | None" = None  # a grammar every output token must follow (lanes/sample/grammar.py)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.logit_bias, dict):
            self.logit_bias = {t: _clamp_bias(b) for t, b in self.logit_bias.items()}
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
        self._validate_penalties()

    def _validate_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ParamError(name, f"must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {value!r}")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty < math.inf:
            raise ParamError("repetition_penalty", f"must be a finite number > 0, got {self.repetition_penalty!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 and _is_number(b)
                for t, b in self.logit_bias.items()
            ):
                raise ParamError("logit_bias", "must map token ids (>= 0) to finite numbers")
        _check_int("min_tokens", self.min_tokens)
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ParamError("min_tokens", f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")

    @property
    def penalised(self) -> bool:
        """Whether lanes/sample/penalties.py changes this request's logits at all."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
                or bool(self.logit_bias) or self.min_tokens > 0)

    @property
    def counts_output(self) -> bool:
        """Whether a penalty reads the output's tokens (not just how many there are)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutput):
                raise ParamError("structured", f"must be a StructuredOutput, got {type(self.structured).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_number(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _clamp_bias(bias):
    return max(-MAX_LOGIT_BIAS, min(MAX_LOGIT_BIAS, bias)) if _is_number(bias) else bias


def _check_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ParamError(name, f"must be an integer, got {type(value).__name__}")
