"""OpenAI-compatible request and response bodies (the subset Verify-PD serves)."""

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from lanes.params import SamplingParams
from lanes.spec_stats import SpecDecodeStats


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _SamplingFields(BaseModel):
    # Unknown fields are rejected (422) rather than silently ignored.
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    user: str | None = None
    return_token_ids: bool = Field(default=False, description="Also return the generated token ids "
                                   "(`choices[0].token_ids`), as vLLM's extension of the same name does.")

    def sampling_params(self) -> SamplingParams:
        """Raises lanes.params.ParamError (-> 400) on values out of range."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            seed=self.seed, stop=stop, stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: str | list[int]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, stats: SpecDecodeStats | None) -> dict:
    stats = stats or SpecDecodeStats()  # a request that ended without a final chunk (timed out)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        # Per-request speculation, with vLLM's counter names.
        "spec_decode": {
            "num_drafts": stats.num_drafts,
            "num_draft_tokens": stats.num_draft_tokens,
            "num_accepted_tokens": stats.num_accepted_tokens,
            "acceptance_rate": stats.acceptance_rate,
        },
    }


def completion_body(rid: str, model: str, text: str, finish_reason: str | None, usage_: dict | None, chunk: bool,
                    first: bool = False) -> dict:
    body = {
        "id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
    }
    if usage_ is not None:
        body["usage"] = usage_
    return body


def chat_body(rid: str, model: str, text: str | None, finish_reason: str | None, usage_: dict | None, chunk: bool,
              first: bool = False) -> dict:
    if chunk:
        delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
        obj = "chat.completion"
    body = {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}
    if usage_ is not None:
        body["usage"] = usage_
    return body


def usage_chunk(rid: str, model: str, obj: str, usage_: dict) -> dict:
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [], "usage": usage_}


def error_body(message: str, err_type: str, code: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}
