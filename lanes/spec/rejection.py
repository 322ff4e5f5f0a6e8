"""The rejection-sampling rule of Leviathan et al. (2023), for a batch of drafts of different lengths.

For draft token x at position i: accept with probability min(1, p(x) / q(x)); at the first rejection
sample from norm(max(0, p - q)); if all drafts are accepted, sample a bonus token from p at the
position after the last draft. The output distribution is exactly p.
"""

from dataclasses import dataclass

import torch

from lanes.sample.sampling import sample_from


@dataclass
class RejectionOutput:
    tokens: torch.Tensor  # [B, L + 1] accepted drafts, then the recovered or bonus token, then -1
    num_accepted: torch.Tensor  # [B] accepted draft tokens; each row emits num_accepted + 1 tokens


def rejection_sample(
    draft_tokens: torch.Tensor,  # [B, L] int64 (anything past a row's num_draft is ignored)
    draft_probs: torch.Tensor,  # [B, L, V] q, the distribution each draft token was drawn from
    target_probs: torch.Tensor,  # [B, L + 1, V] p at each draft position and one past the last
    num_draft: torch.Tensor,  # [B] int64, 0 <= num_draft <= L
    accept_uniforms: torch.Tensor,  # [B, L] in (0, 1)
    sample_uniforms: torch.Tensor,  # [B, L + 1, V] in (0, 1)
) -> RejectionOutput:
    batch, max_draft = draft_tokens.shape
    assert draft_probs.shape[:2] == (batch, max_draft), draft_probs.shape
    assert target_probs.shape[:2] == (batch, max_draft + 1), target_probs.shape
    positions = torch.arange(max_draft, device=draft_tokens.device)
    in_draft = positions[None, :] < num_draft[:, None]  # [B, L]

    safe_tokens = torch.where(in_draft, draft_tokens, torch.zeros_like(draft_tokens))[..., None]
    p_x = target_probs[:, :max_draft].gather(-1, safe_tokens).squeeze(-1)  # [B, L]
    q_x = draft_probs.gather(-1, safe_tokens).squeeze(-1)  # [B, L]
    # u < p/q written as u * q < p: no division, and q(x) > 0 for a token that was drawn from q.
    accepted = (accept_uniforms * q_x < p_x) & in_draft
    num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)  # [B] length of the accepted prefix

    recovered = _recovery_tokens(draft_probs, target_probs, in_draft, sample_uniforms)  # [B, L + 1]
    tokens = torch.cat([draft_tokens, draft_tokens.new_full((batch, 1), -1)], dim=1)
    columns = torch.arange(max_draft + 1, device=tokens.device)[None, :]
    stop = num_accepted[:, None]
    tokens = torch.where(columns < stop, tokens, torch.where(columns == stop, recovered, torch.full_like(tokens, -1)))
    return RejectionOutput(tokens, num_accepted)


def point_mass(draft_tokens: torch.Tensor, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """q [B, L, V] of a proposer that sends no probabilities (greedy drafting, prompt lookup): all
    mass on the drafted token. The rule then accepts x with probability p(x) and on rejection
    samples norm(max(0, p - one_hot(x))), that is p with x removed."""
    return torch.nn.functional.one_hot(draft_tokens, vocab).to(dtype)


def greedy_verify(draft_tokens: torch.Tensor, target_logits: torch.Tensor, num_draft: torch.Tensor) -> RejectionOutput:
    """The rule above when every row is greedy (p and q one-hot): a draft is accepted iff it is
    the target's argmax, and the token after the accepted prefix is the target's argmax there.
    Same result as rejection_sample on one-hot inputs, without building them."""
    max_draft = draft_tokens.shape[1]
    target = target_logits.argmax(dim=-1)  # [B, L + 1]
    columns = torch.arange(max_draft + 1, device=target.device)  # [L + 1]
    accepted = (draft_tokens == target[:, :max_draft]) & (columns[:max_draft] < num_draft[:, None])  # [B, L]
    num_accepted = accepted.cumprod(dim=-1).sum(dim=-1)  # [B] int64
    tokens = target.masked_fill(columns > num_accepted[:, None], -1)
    return RejectionOutput(tokens, num_accepted)


def _recovery_tokens(q: torch.Tensor, p: torch.Tensor, in_draft: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """At every position, the token to emit if the chain stops there: a residual sample after a
    rejection (inside the draft), or a bonus sample from p (one past the row's last draft)."""
    residual = (p[:, :-1] - q).clamp_min(0)  # [B, L, V]
    # p == q makes rejection impossible in exact arithmetic; if rounding still rejects, sample p.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, p[:, :-1], residual)
    dist = torch.where(in_draft[..., None], residual, p[:, :-1])
    dist = torch.cat([dist, p[:, -1:]], dim=1)  # [B, L + 1, V]
    return sample_from(dist, uniforms)
