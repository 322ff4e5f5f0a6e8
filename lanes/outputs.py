"""What the engine streams back for a request: a chunk of new tokens per step."""

from dataclasses import dataclass, field

from lanes.spec_stats import SpecDecodeStats


@dataclass
class RequestOutput:
    request_id: str
    token_ids: list[int]  # new tokens in this chunk
    text: str  # new text in this chunk (stop strings cut, partial UTF-8 held back)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # cumulative
    stats: SpecDecodeStats = field(default_factory=SpecDecodeStats)  # cumulative, this request
    error: str | None = None
