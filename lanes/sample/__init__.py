"""Turning logits into tokens: request parameters, sampling without host syncs, penalties,
logprobs, structured output (grammars and their matchers), incremental detokenisation.
"""
