"""The lane deployments: the engine (decode-lane) replica, the prefill lane, the verify lane, and what
they share: one worker thread for GPU work, continuous batching of calls, tensor-parallel worker ranks.
"""
