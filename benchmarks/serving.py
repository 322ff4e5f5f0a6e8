"""The names the serving benchmarks have imported from here; the code is benchmarks/lib/cluster.py."""

from benchmarks.lib.cluster import (ALL_MODES, REPO, DeployFailed, benchmark_app_args, count_parameters,  # noqa: F401
                                    deploy, git_commit, load_average, machine, mode_args, start_cluster)
