"""What a choice adds to the engine's text: the echoed prompt, and log-probabilities in OpenAI's
shapes (the legacy object of /v1/completions, the `content` list of /v1/chat/completions), per
streamed chunk or for the whole answer.

Token strings are each token decoded on its own, as vLLM writes them, and kept per tokenizer: with
`logprobs: 5` every output token needs six, and decoding them each time made `render` cost 16.5 us a
token against 7.6 us (2-core CPU, docs/diagnoses.md: host_costs), a host cost that grows with the stream count.
"""

from weakref import WeakKeyDictionary

from transformers import PreTrainedTokenizerBase

from lanes.engine.outputs import RequestOutput
from lanes.sample.logprobs import TokenLogprobs


class ChoiceExtras:
    """Decorates a choice chunk by chunk; keeps the running text offset between chunks.

    `echo_ids`: the prompt's ids when a completions request echoes it: its text (`echo_text`, the
    prompt as sent; decoded when it was sent as ids) comes first, and with logprobs its tokens too,
    the first one with null logprobs (nothing precedes it)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, chat: bool, logprobs: bool,
                 echo_ids: list[int] | None = None, echo_text: str | None = None):
        self.tokenizer = tokenizer
        self.chat = chat
        self.logprobs = logprobs
        self.echo_ids = echo_ids
        self.echo_text = echo_text if echo_text is not None or echo_ids is None else tokenizer.decode(echo_ids)
        self.text_offset = 0

    def decorate(self, choice: dict, out: RequestOutput, first: bool) -> None:
        """Add the echoed prompt (to the first chunk's text) and the chunk's logprobs to `choice`."""
        if self.echo_ids is not None and first:
            choice["text"] = self.echo_text + choice["text"]
        if self.logprobs:
            choice["logprobs"] = self.render(out)

    def render(self, out: RequestOutput) -> dict:
        """The `logprobs` value of the choice for this chunk (or for a whole answer, merged)."""
        if self.chat:
            return {"content": self._chat(out.token_ids, out.logprobs)}
        body = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        if self.echo_ids is not None and out.prompt_logprobs is not None:
            self._legacy(body, self.echo_ids[:1], None)
            self._legacy(body, self.echo_ids[1:], out.prompt_logprobs)
        self._legacy(body, out.token_ids, out.logprobs)
        return body

    def _strs(self, ids: list[int]) -> list[str]:
        return token_strings(self.tokenizer, ids)

    def _legacy(self, body: dict, ids: list[int], lp: TokenLogprobs | None) -> None:
        for j, token in enumerate(self._strs(ids)):
            body["tokens"].append(token)
            body["text_offset"].append(self.text_offset)
            self.text_offset += len(token)
            if lp is None:  # the prompt's first token: nothing scores it
                body["token_logprobs"].append(None)
                body["top_logprobs"].append(None)
                continue
            body["token_logprobs"].append(lp.logprobs[j])
            # As vLLM: the top k, and the token itself where it is not among them.
            top = dict(zip(self._strs(lp.top_ids[j]), lp.top_logprobs[j]))
            top.setdefault(token, lp.logprobs[j])
            body["top_logprobs"].append(top)

    def _chat(self, ids: list[int], lp: TokenLogprobs | None) -> list[dict]:
        if lp is None:
            return []
        content = []
        for j, token in enumerate(self._strs(ids)):
            top = [_entry(t, v) for t, v in zip(self._strs(lp.top_ids[j]), lp.top_logprobs[j])]
            content.append({**_entry(token, lp.logprobs[j]), "top_logprobs": top})
        return content


_STRINGS: WeakKeyDictionary = WeakKeyDictionary()  # tokenizer -> {id: the id decoded on its own}


def token_strings(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> list[str]:
    """Each id decoded on its own; the ones not seen before in one batch_decode call."""
    known = _STRINGS.setdefault(tokenizer, {})
    new = [t for t in dict.fromkeys(ids) if t not in known]
    if new:
        known.update(zip(new, tokenizer.batch_decode([[t] for t in new])))
    return [known[t] for t in ids]


def _entry(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}
