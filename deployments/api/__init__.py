"""The HTTP surface: the ingress (routes, errors, auth, streaming), the OpenAI request and response
schema, logprobs, structured output, and a request's `n` choices.
"""
