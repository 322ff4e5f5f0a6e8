"""What the engine streams back for a request: a chunk of new tokens per step, merged per message."""

from dataclasses import dataclass

from lanes.sample.logprobs import TokenLogprobs, concat
from lanes.spec.stats import SpecDecodeStats


@dataclass
class RequestOutput:
    request_id: str
    token_ids: list[int]  # new tokens in this chunk
    text: str  # new text in this chunk (stop strings cut, partial UTF-8 held back)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # cumulative
    # Cumulative for this request, on the final chunk only: a per-step copy would cost every step
    # a deep copy and every message its pickling, and only the end of a request reads it.
    stats: SpecDecodeStats | None = None
    error: str | None = None
    # The error is the loss of a remote lane's replica that no other took over (the request may be
    # sent again): the ingress answers it as a 503 that says so, not as an internal error.
    lane_lost: bool = False
    logprobs: TokenLogprobs | None = None  # of this chunk's tokens, when the request asked
    prompt_logprobs: TokenLogprobs | None = None  # of prompt tokens 1.., on the request's first chunk
    num_cached_tokens: int = 0  # prompt tokens whose KV the prefix cache held (usage.prompt_tokens_details)


def merge_outputs(chunks: list[RequestOutput]) -> RequestOutput:
    """Consecutive chunks of one request as one: tokens and text joined in order, the rest from the
    last chunk (its counters are cumulative, and only it can be the final one)."""
    if len(chunks) == 1:
        return chunks[0]
    last = chunks[-1]
    return RequestOutput(
        request_id=last.request_id,
        token_ids=[t for c in chunks for t in c.token_ids],
        text="".join(c.text for c in chunks),
        finished=last.finished,
        finish_reason=last.finish_reason,
        num_prompt_tokens=last.num_prompt_tokens,
        num_output_tokens=last.num_output_tokens,
        stats=last.stats,
        error=last.error,
        lane_lost=last.lane_lost,
        logprobs=concat([c.logprobs for c in chunks]),
        prompt_logprobs=concat([c.prompt_logprobs for c in chunks]),
        num_cached_tokens=last.num_cached_tokens,
    )
