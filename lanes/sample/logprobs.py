"""Log-probabilities of tokens under the target, and their top-k alternatives.

They are raw logprobs, vLLM's default (`logprobs_mode="raw_logprobs"`): log_softmax of the target's
logits before temperature, top-k or top-p, so they do not depend on how the request samples. With
speculation each emitted token's logprobs come from the verify forward that emitted it: an accepted
draft's from the target's logits at its position, a recovered or bonus token's from the target's
logits at the position where it was sampled.

On the device a batch's logprobs are packed as int64 columns (the bit patterns of float64 values,
then token ids), so that they reach the host inside the step's one device-to-host copy of tokens.
"""

from dataclasses import dataclass

import torch


@dataclass
class TokenLogprobs:
    """Consecutive tokens' log-probabilities: compact lists, as they cross process boundaries."""

    logprobs: list[float]  # [n] of each token
    top_ids: list[list[int]]  # [n][k] the k most likely tokens at its position, most likely first
    top_logprobs: list[list[float]]  # [n][k]

    def __len__(self) -> int:
        return len(self.logprobs)

    def head(self, n: int) -> "TokenLogprobs":
        return TokenLogprobs(self.logprobs[:n], self.top_ids[:n], self.top_logprobs[:n])


def concat(parts: list["TokenLogprobs | None"]) -> TokenLogprobs | None:
    """The parts joined in order; None when no part has any (the request did not ask)."""
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]
    return TokenLogprobs([x for p in parts for x in p.logprobs], [x for p in parts for x in p.top_ids],
                         [x for p in parts for x in p.top_logprobs])


def batch_k(ks: list[int | None]) -> int | None:
    """The top-k a batch computes: the largest any row asked for; None when no row asked."""
    asked = [k for k in ks if k is not None]
    return max(asked) if asked else None


def block_width(k: int) -> int:
    """Packed columns per position: the token's logprob, k top logprobs, k top ids."""
    return 1 + 2 * k


def pack(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """Logprobs of `tokens` [B, Q] under `logits` [B, Q, V] and the top k there, as int64 [B, Q * (1 + 2k)].

    Entries of `tokens` < 0 (no token at that position) are read as token 0; the host ignores them."""
    assert logits.shape[:2] == tokens.shape, (logits.shape, tokens.shape)
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [B, Q, V]
    chosen = logprobs.gather(-1, tokens.clamp_min(0)[..., None])  # [B, Q, 1]
    top_values, top_ids = logprobs.topk(k, dim=-1)  # [B, Q, k]
    as_bits = torch.cat([chosen, top_values], dim=-1).double().view(torch.int64)  # [B, Q, 1 + k]
    return torch.cat([as_bits, top_ids], dim=-1).flatten(1)


def unpack(packed: torch.Tensor, k: int, first: int, count: int, want_k: int) -> TokenLogprobs:
    """Positions [first, first + count) of one host row of `pack`'s output, cut to the row's own k."""
    blocks = packed.reshape(-1, block_width(k))[first : first + count]  # [count, 1 + 2k]
    values = blocks[:, : 1 + k].contiguous().view(torch.float64)
    return TokenLogprobs(values[:, 0].tolist(), blocks[:, 1 + k : 1 + k + want_k].tolist(),
                         values[:, 1 : 1 + want_k].tolist())
