"""A Serve autoscaling policy for tests: the replica count a test writes in a file.

Serve's controller calls it every control-loop period as it calls its default policy; the count it
returns then goes through Serve's own bounds (min_replicas, max_replicas), delays (downscale_delay_s)
and scale-up or scale-down. So a test decides *when* the autoscaler shrinks a lane (mid-stream), and
everything after that decision is Serve's autoscaler.
"""

from pathlib import Path


class ScriptedReplicas:
    def __init__(self, path: str):
        self.path = Path(path)

    def __call__(self, ctx) -> tuple[int, dict]:
        """The count in the file, or the current target while the file holds none."""
        try:
            return int(self.path.read_text()), {}
        except (FileNotFoundError, ValueError):
            return ctx.target_num_replicas, {}
