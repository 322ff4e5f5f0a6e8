"""Plain Hugging Face reference for greedy speculative decoding (no project engine involved).

Used to measure the shipped pair and to test it: with greedy verification the output must equal
the target's own greedy decoding, whatever the draft proposes.
"""

import torch
from transformers import DynamicCache, PreTrainedModel


@torch.inference_mode()
def rollout(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    num_tokens: int,
    cache: DynamicCache | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Continue ``input_ids`` ([batch, n], the tokens not yet in ``cache``) by ``num_tokens``.

    Greedy when ``generator`` is None, else sampled at temperature 1 from the full distribution.
    Returns [batch, num_tokens]; ``cache`` then holds the input and all but the last new token.
    """
    assert input_ids.dim() == 2 and input_ids.shape[1] > 0 and num_tokens > 0
    cache = cache if cache is not None else DynamicCache(config=model.config)
    new_tokens = []
    step_input = input_ids
    for _ in range(num_tokens):
        logits = model(input_ids=step_input, past_key_values=cache, use_cache=True).logits[:, -1]
        if generator is None:
            next_token = logits.argmax(dim=-1, keepdim=True)  # [batch, 1]
        else:
            probs = torch.softmax(logits.float(), dim=-1)
            next_token = torch.multinomial(probs, 1, generator=generator)  # [batch, 1]
        new_tokens.append(next_token)
        step_input = next_token
    return torch.cat(new_tokens, dim=1)


def truncate_cache(cache: DynamicCache, length: int) -> None:
    excess = cache.get_seq_length() - length
    if excess > 0:
        cache.crop(-excess)  # a negative argument removes that many tokens (transformers >= 5)


def matching_prefix_length(proposal: torch.Tensor, target_tokens: torch.Tensor) -> int:
    """Number of leading positions where ``proposal`` [1, L] equals ``target_tokens`` [1, L]."""
    return int((proposal == target_tokens).int().cumprod(dim=-1).sum())


@torch.inference_mode()
def greedy_speculative_generate(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    num_draft_tokens: int,
) -> tuple[torch.Tensor, list[int]]:
    """Greedy speculative decoding of one prompt ([1, P]).

    Each round the draft proposes ``num_draft_tokens`` tokens, the target scores them in one
    forward pass, the longest prefix agreeing with the target's argmax is kept, and the target's
    own next token is appended. Returns the new tokens [1, max_new_tokens] and the accepted count
    of each round.
    """
    assert prompt_ids.shape[0] == 1, "the reference decodes one sequence"
    tokens = prompt_ids
    prompt_len = prompt_ids.shape[1]
    target_cache = DynamicCache(config=target.config)
    draft_cache = DynamicCache(config=draft.config)
    accepted_counts: list[int] = []
    while tokens.shape[1] - prompt_len < max_new_tokens:
        proposal = rollout(draft, tokens[:, draft_cache.get_seq_length() :], num_draft_tokens, draft_cache)
        verify_input = torch.cat([tokens[:, target_cache.get_seq_length() :], proposal], dim=1)
        logits = target(input_ids=verify_input, past_key_values=target_cache, use_cache=True).logits
        target_tokens = logits[:, -(num_draft_tokens + 1) :].argmax(dim=-1)  # [1, L + 1]
        accepted = matching_prefix_length(proposal, target_tokens[:, :num_draft_tokens])
        bonus = target_tokens[:, accepted : accepted + 1]
        tokens = torch.cat([tokens, proposal[:, :accepted], bonus], dim=1)
        # Both caches may hold rejected proposals; keep every committed token but the newest,
        # which the next round feeds. This is the only place the caches are rolled back.
        truncate_cache(target_cache, tokens.shape[1] - 1)
        truncate_cache(draft_cache, tokens.shape[1] - 1)
        accepted_counts.append(accepted)
    return tokens[:, prompt_len : prompt_len + max_new_tokens], accepted_counts
