"""What the deployments measure: Ray metrics (vLLM's spec-decode definitions), the decode replica's
per-step export, the lanes' busy timelines, and the latency and busy windows the planner and the
draft-length controller read.
"""
