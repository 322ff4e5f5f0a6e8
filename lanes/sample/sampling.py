"""Turning logits into the distribution a request samples from, and sampling it without host syncs.

Randomness is counter-based: every uniform is a hash of (request seed, absolute token position,
purpose, vocab index). A seeded request therefore gets the same tokens alone or in any batch, and
nothing here reads a value back to the host.
"""

from dataclasses import dataclass

import torch

from lanes.device.batching import to_device
from lanes.sample.params import SamplingParams

_MASK32 = 0xFFFFFFFF

# Purposes, so that the draft's sample, the accept test and the target's sample at one position
# use independent randomness.
STREAM_DRAFT = 1
STREAM_ACCEPT = 2
STREAM_TARGET = 3


@dataclass
class SamplingTensors:
    """Per-row sampling parameters of a batch, on the device. All [B]; None when every row is
    greedy (nothing then reads them, so nothing is copied to the device)."""

    temperature: torch.Tensor | None  # float32, 0 marks greedy rows
    top_k: torch.Tensor | None  # int64, 0 disables
    top_p: torch.Tensor | None  # float32, 1 disables
    seeds: torch.Tensor | None  # int64
    needs_filter: bool  # host-side: skip the vocab sort when no row uses top-k or top-p
    all_greedy: bool  # host-side: every row is greedy, so no probabilities or noise are needed
    log_min_p: torch.Tensor | None = None  # float32 log(min_p), -inf disables; None when no row uses min-p

    @classmethod
    def build(cls, params: list[SamplingParams], seeds: list[int], device) -> "SamplingTensors":
        if all(p.greedy for p in params):
            return cls(None, None, None, None, needs_filter=False, all_greedy=True)
        # Two host-to-device copies, one per dtype.
        temperature, top_p = to_device([[p.temperature for p in params], [p.top_p for p in params]], torch.float32,
                                       device)
        top_k, seeds_t = to_device([[p.top_k for p in params], seeds], torch.long, device)
        needs_filter = any(p.top_k > 0 or p.top_p < 1 for p in params if not p.greedy)
        log_min_p = None
        if any(p.min_p > 0 for p in params if not p.greedy):
            log_min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32).log().to(device)
        return cls(temperature, top_k, top_p, seeds_t, needs_filter, all_greedy=False, log_min_p=log_min_p)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # murmur3's 32-bit finaliser, in int64 arithmetic masked to 32 bits (wrap-around is harmless
    # because only the low 32 bits are kept).
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _MASK32
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, stream: int, vocab_size: int | None = None) -> torch.Tensor:
    """Uniforms in (0, 1): [B, K] for `positions` [B, K], or [B, K, V] with `vocab_size`."""
    seed_lo = seeds & _MASK32
    seed_hi = (seeds >> 32) & _MASK32
    h = _mix32(seed_lo ^ _mix32(seed_hi ^ ((stream * 0x9E3779B9) & _MASK32)))  # [B]
    h = _mix32(h[:, None] ^ (positions & _MASK32))  # [B, K]
    if vocab_size is not None:
        vocab = (torch.arange(vocab_size, device=h.device) * 0x27D4EB2D) & _MASK32
        h = _mix32(h[..., None] ^ vocab)  # [B, K, V]
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))


def logits_to_probs(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """[B, K, V] logits -> [B, K, V] probabilities after temperature, min-p, top-k and top-p (vLLM's order).

    Greedy rows become one-hot at the argmax, so the rejection rule reduces to "accept iff the draft
    token is the target's argmax" with no special case.
    """
    assert logits.dim() == 3, logits.shape
    one_hot = torch.zeros_like(logits).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    if st.all_greedy:
        return one_hot
    greedy = (st.temperature == 0)[:, None, None]  # [B, 1, 1]
    temp = torch.where(st.temperature > 0, st.temperature, torch.ones_like(st.temperature))
    scaled = logits / temp[:, None, None]
    if st.log_min_p is not None:
        scaled = _filter_min_p(scaled, st.log_min_p)
    if st.needs_filter:
        scaled = _filter_top_k_top_p(scaled, st.top_k, st.top_p)
    probs = torch.softmax(scaled, dim=-1)
    return torch.where(greedy, one_hot, probs)


def _filter_min_p(scaled: torch.Tensor, log_min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the largest: p_i / p_max = exp(s_i - s_max),
    so in logit space no softmax or sort is needed."""
    floor = scaled.amax(dim=-1, keepdim=True) + log_min_p[:, None, None]  # [B, K, 1]
    return scaled.masked_fill(scaled < floor, float("-inf"))


def _filter_top_k_top_p(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    vocab = scaled.shape[-1]
    sorted_vals, sorted_idx = scaled.sort(dim=-1, descending=True)  # [B, K, V]
    rank = torch.arange(vocab, device=scaled.device)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))[:, None, None]
    drop = rank >= k
    # top-p: keep the smallest prefix whose mass reaches p (the token that crosses p stays).
    probs_sorted = torch.softmax(sorted_vals.masked_fill(drop, float("-inf")), dim=-1)
    mass_before = probs_sorted.cumsum(dim=-1) - probs_sorted
    # top_p == 1 must keep every token even where float rounding makes the cumulative mass hit 1.
    drop = drop | ((mass_before >= top_p[:, None, None]) & (top_p < 1)[:, None, None])
    sorted_vals = sorted_vals.masked_fill(drop, float("-inf"))
    return torch.empty_like(scaled).scatter_(-1, sorted_idx, sorted_vals)


def draw(logits: torch.Tensor, st: SamplingTensors, positions: torch.Tensor, stream: int
         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sample one token per row from logits [B, K, V] at absolute `positions` [B, K].

    Returns (tokens [B, K], the probabilities they were drawn from, or None when every row is
    greedy: then the tokens are the argmax and no vocabulary-wide noise is generated)."""
    if st.all_greedy:
        return logits.argmax(dim=-1), None
    probs = logits_to_probs(logits, st)
    return sample_from(probs, uniform_noise(st.seeds, positions, stream, probs.shape[-1])), probs


def sample_from(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Exponential race: argmax p_i / E_i with E_i ~ Exp(1) draws index i with probability p_i / sum(p).

    Works on unnormalised weights, so residual distributions need no division.
    """
    return (probs / -torch.log(uniforms)).argmax(dim=-1)
