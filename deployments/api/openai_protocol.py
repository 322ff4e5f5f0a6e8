"""OpenAI-compatible request and response bodies, with vLLM's request fields.

Every field that OpenAI's API or vLLM's server defines for /v1/completions and /v1/chat/completions
is one of three things here: served with its meaning; listed in a _REFUSED_ table and refused with a
400 that names it when a request sets it (this engine cannot honour it yet, and ignoring it would
change what the client gets without telling them); or, for fields that change nothing about the
output (`user`, `store`, `metadata`, ...), accepted. Any field neither API defines is accepted and ignored, as
vLLM does; the ingress logs and counts it (`ignored_fields`).
"""

import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from deployments.api.openai_structured import structured_output
from lanes.sample.params import MAX_LOGPROBS, ParamError, SamplingParams
from lanes.spec.stats import SpecDecodeStats


class _Open(BaseModel):
    # Unknown fields are kept (model_extra) so that the ingress can log and count them, then ignored.
    model_config = ConfigDict(extra="allow")
    # Fields the APIs define that this server refuses when set (see _REFUSED_*): read from model_extra
    # by check_served, and not reported as ignored.
    refused_fields: ClassVar[dict[str, tuple[Any, str]]] = {}

    def ignored_fields(self) -> list[str]:
        """Fields neither OpenAI's API nor vLLM's server defines: accepted and ignored."""
        return sorted(set(self.model_extra or {}) - self.refused_fields.keys())


class StreamOptions(_Open):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk


# Choices per prompt. Each is a request of its own and holds a KV slot in every lane while it runs;
# vLLM's bound (VLLM_MAX_N_SEQUENCES, 16384) is far past any lane's slots, so this server keeps
# one request's share small.
MAX_N = 16
DEFAULT_MAX_TOKENS = 16  # OpenAI's completions default; used for chat too
# vLLM raises a temperature in (0, 0.01) to 0.01: below it, logits / temperature overflow to inf and
# the probabilities become NaN. 0 stays greedy.
MIN_TEMPERATURE = 1e-2

# Fields with a meaning this engine does not give yet: the value that leaves them off, and why a
# request that sets anything else is refused. None as "off" also accepts an explicit null.
_REFUSED_COMMON: dict[str, tuple[Any, str]] = {
    "prompt_logprobs": (None, "vLLM's prompt_logprobs is not served; on /v1/completions send echo with logprobs"),
    # 1 is OpenAI's default (one candidate per choice) and asks for nothing; the `openai` SDK sends it when typed.
    "best_of": (1, "best_of > 1 is not served"),
    "use_beam_search": (False, "beam search is not served"),
    "length_penalty": (1.0, "beam search is not served"),
    "allowed_token_ids": (None, "allowed_token_ids is not served yet"),
    "bad_words": (None, "bad_words is not served yet"),
    "include_stop_str_in_output": (False, "stop strings are always cut from the output"),
    "skip_special_tokens": (True, "special tokens are always skipped in the text"),
    "truncate_prompt_tokens": (None, "prompt truncation is not served; send a prompt that fits"),
    "guided_whitespace_pattern": (None, "a whitespace pattern is not served (structured_outputs' "
                                  "disable_any_whitespace is)"),
    "logits_processors": (None, "logits processors are not served"),
    "kv_transfer_params": (None, "external KV transfer is not served"),
    "priority": (0, "request priorities are not served"),
}
_REFUSED_COMPLETION = {"suffix": (None, "suffix (insertion) is not served")}
_REFUSED_CHAT = {
    "echo": (False, "chat's echo (vLLM's: repeat the last message) is not served"),
    "tools": (None, "tool calling is not served"),
    "functions": (None, "function calling is not served"),
    "function_call": (None, "function calling is not served"),
    "audio": (None, "audio output is not served"),
    "prediction": (None, "predicted outputs are not served"),
    "documents": (None, "documents are not served"),
    "chat_template": (None, "only the model's own chat template is served"),
    "reasoning_effort": (None, "reasoning effort is not served"),
    "web_search_options": (None, "web search is not served"),
    "moderation": (None, "moderation is not served"),
    # OpenAI's default; "low" and "high" ask reasoning models for shorter or longer answers.
    "verbosity": ("medium", "verbosity is not served"),
}
_ALWAYS_OFF = {"none", "auto"}  # tool_choice values that call no tool when no tools are given


class _SamplingFields(_Open):
    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, description="Choices per prompt (1 to 16), each sampled as a request of its own; "
                   "with a seed, choice i draws with seed + i")
    # Penalties and constraints (lanes/sample/penalties.py); null means off, as vLLM takes it.
    presence_penalty: float | None = Field(default=None, description="In [-2, 2]: subtracted from the logit of "
                                           "every token already in the output")
    frequency_penalty: float | None = Field(default=None, description="In [-2, 2]: subtracted once per occurrence "
                                            "of a token in the output")
    repetition_penalty: float | None = Field(default=None, description="vLLM's, > 0: tokens in the prompt or the "
                                             "output get positive logits divided by it, negative ones multiplied")
    logit_bias: dict[str, float] | None = Field(default=None, description="Token id (as a string) -> bias added to "
                                                "its logit, clamped to [-100, 100]")
    min_tokens: int | None = Field(default=None, description="vLLM's: no EOS, stop token id or stop string before "
                                   "this many output tokens")
    # Structured output (deployments/api/openai_structured.py): OpenAI's, vLLM's, vLLM's older names.
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted: xgrammar serves every request
    return_token_ids: bool = Field(default=False, description="Also return the generated token ids "
                                   "(`choices[].token_ids`), as vLLM's extension of the same name does.")
    # Accepted: they change nothing about the output.
    user: str | None = None
    request_id: str | None = None
    cache_salt: str | None = None
    store: bool | None = None
    metadata: dict | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # OpenAI's routing hint for its prompt cache; ours is keyed by the prompt
    add_special_tokens: bool | None = None
    spaces_between_special_tokens: bool = True
    vllm_xargs: dict | None = None
    refused_fields: ClassVar[dict[str, tuple[Any, str]]] = _REFUSED_COMMON

    def check_served(self) -> None:
        """Raises ParamError (-> 400) naming the first field set to something this server cannot honour."""
        for name, (off, why) in self.refused_fields.items():
            value = (self.model_extra or {}).get(name)
            if value is not None and value != off and not (off is None and value in ([], {}, 0, False)):
                raise ParamError(name, f"{why} (got {value!r}); leave it unset")
        if not 1 <= self.n <= MAX_N:
            raise ParamError("n", f"must be in [1, {MAX_N}], got {self.n}")

    def sampling_params(self) -> SamplingParams:
        """Raises lanes.sample.params.ParamError (-> 400) on values out of range or fields not served."""
        self.check_served()
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        logprobs, prompt_logprobs = self.logprob_counts()
        temperature = max(self.temperature, MIN_TEMPERATURE) if self.temperature > 0 else self.temperature
        top_k = 0 if self.top_k == -1 else self.top_k  # vLLM takes -1 for "off", as 0
        return SamplingParams(
            max_tokens=self.output_limit(), temperature=temperature, top_p=self.top_p, top_k=top_k, min_p=self.min_p,
            seed=self.seed, stop=stop, stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, structured=self.structured_output(),
            **self.penalties(),
        )

    def penalties(self) -> dict:
        """The penalty fields as SamplingParams takes them (which checks their ranges)."""
        out = {name: value for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens")
               if (value := getattr(self, name)) is not None}
        if self.logit_bias:
            if not all(key.isdecimal() for key in self.logit_bias):
                raise ParamError("logit_bias", "keys must be token ids written as strings, e.g. {\"50256\": -100}")
            out["logit_bias"] = {int(key): bias for key, bias in self.logit_bias.items()}
        return out

    def structured_output(self):
        return structured_output(self.response_format, self.structured_outputs, {
            name: getattr(self, name) for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")})

    def logprob_counts(self) -> tuple[int | None, int | None]:
        """(top-k per output token, top-k per prompt token); None where not asked."""
        return None, None

    def output_limit(self) -> int:
        return self.max_tokens if self.max_tokens is not None else DEFAULT_MAX_TOKENS

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(description="A prompt (text or token ids), or a "
                                                                   "list of them: n choices each, in order")
    logprobs: int | None = Field(default=None, description="Per token, its logprob and the `logprobs` most "
                                 "likely tokens' (0 to 20): the target's raw log_softmax")
    echo: bool = Field(default=False, description="Prepend the prompt to the text; with `logprobs`, its tokens' "
                       "logprobs too (the first null). With max_tokens 0 this scores the prompt")
    refused_fields: ClassVar[dict[str, tuple[Any, str]]] = {**_REFUSED_COMMON, **_REFUSED_COMPLETION}

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, in order: a string or a list of token ids is one prompt; a list of
        either is a batch (each gets `n` choices)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            return list(prompt)
        return [prompt]

    def logprob_counts(self) -> tuple[int | None, int | None]:
        prompt_k = self.logprobs if self.echo else None
        if self.echo and self.max_tokens == 0 and prompt_k is None:
            prompt_k = 0  # echo alone, nothing generated: the prompt is prefilled and returned as text
        return self.logprobs, prompt_k


class ContentPart(_Open):
    type: str
    text: str | None = None


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None

    def for_template(self, index: int) -> dict:
        """The message as chat templates take it: content as one string (text parts joined by newlines,
        as vLLM joins them)."""
        content = self.content
        if isinstance(content, list):
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise ParamError(f"messages.{index}.content.{j}.type",
                                     f"content part {part.type!r} is not served: text parts only")
            content = "\n".join(part.text for part in content)
        message = {"role": self.role, "content": content or ""}
        for key in ("name", "tool_call_id"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        return message


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # OpenAI's current name for the chat limit; wins over max_tokens
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    modalities: list[str] | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict | None = None
    logprobs: bool = Field(default=False, description="Return each output token's logprob (the target's raw "
                           "log_softmax)")
    top_logprobs: int | None = Field(default=None, description="With logprobs, this many most likely tokens per "
                                     "position (0 to 20)")
    refused_fields: ClassVar[dict[str, tuple[Any, str]]] = {**_REFUSED_COMMON, **_REFUSED_CHAT}

    def check_served(self) -> None:
        super().check_served()
        if self.top_logprobs and not self.logprobs:
            raise ParamError("top_logprobs", "needs logprobs: true")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise ParamError("top_logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}")
        if self.tool_choice is not None and self.tool_choice not in _ALWAYS_OFF:
            raise ParamError("tool_choice", "tool calling is not served")
        if self.modalities is not None and set(self.modalities) - {"text"}:
            raise ParamError("modalities", "text output only is served")

    def logprob_counts(self) -> tuple[int | None, int | None]:
        return (self.top_logprobs or 0) if self.logprobs else None, None

    def output_limit(self) -> int:
        return self.max_completion_tokens if self.max_completion_tokens is not None else super().output_limit()

    def template_messages(self) -> list[dict]:
        return [m.for_template(i) for i, m in enumerate(self.messages)]


class TokenizeRequest(_Open):
    """vLLM's /tokenize: a prompt, or chat messages rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Open):
    model: str | None = None
    tokens: list[int]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, stats: SpecDecodeStats | None, cached_tokens: int = 0) -> dict:
    """`cached_tokens`: prompt tokens served from the prefix cache (OpenAI's prompt_tokens_details)."""
    stats = stats or SpecDecodeStats()  # a request that ended without a final chunk (timed out)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
        # Per-request speculation, with vLLM's counter names.
        "spec_decode": {
            "num_drafts": stats.num_drafts,
            "num_draft_tokens": stats.num_draft_tokens,
            "num_accepted_tokens": stats.num_accepted_tokens,
            "acceptance_rate": stats.acceptance_rate,
        },
    }


def running_usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """Usage so far, for a chunk of a stream with `continuous_usage_stats` (vLLM's shape)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_choice(index: int, text: str, finish_reason: str | None, chunk: bool = False,
                      first: bool = False) -> dict:
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}


def chat_choice(index: int, text: str | None, finish_reason: str | None, chunk: bool, first: bool = False) -> dict:
    if chunk:
        delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
            "finish_reason": finish_reason}


def response_body(rid: str, model: str, obj: str, choices: list[dict], usage_: dict | None) -> dict:
    """A response, or one chunk of a stream (`obj` says which: text_completion, chat.completion[.chunk])."""
    body = {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": choices}
    if usage_ is not None:
        body["usage"] = usage_
    return body


def error_body(message: str, err_type: str, code: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}
