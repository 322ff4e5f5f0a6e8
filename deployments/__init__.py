"""Ray Serve around the lanes: thin deployments, the ingress, the app builder; one package a concept.

routing/    which replica a call between lanes reaches: leases and the lease router, Serve request ids of
            our own, hedged calls, the router's state for logs, the owners of the verify lane's slots
placement/  which GPUs a lane replica sees, where it runs (`Placement`), and the KV hand-over chosen from that
telemetry/  Ray metrics, the lanes' busy timelines, latency and busy windows for the planner and controller
channels/   the decode engine's reach to the other lanes: remote proxies, peer calls, pdv's verify channel,
            pdv's short prompts prefilled by a verify replica; the step channel from decode replica to ingress
replicas/   the lane deployments (engine, prefill, verify), their worker thread, batcher and TP workers
api/        the HTTP surface: the ingress, the OpenAI protocol, logprobs, structured output, choices

At the top, what users and the builder touch: `config.py` (the app's pydantic config), `factories.py`
(the lane objects a replica builds), `planning.py` (Serve options under `slo:` targets), `builder.py`
(`build_app`) and `app.py` (`serve run deployments.app:app`).

Modules import each other by full path (`from deployments.routing.leases import LeaseGone`), each
package only from those listed before it, `config.py` after placement/ and `factories.py` after
channels/ (tests/test_layout.py).
"""
