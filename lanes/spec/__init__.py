"""Speculative decoding, lane by lane: prefill, draft (a draft model or n-gram lookup), verify, the
rejection rule, the one rollback after verification, and the spec-decode counters.
"""
