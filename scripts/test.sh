#!/usr/bin/env bash
# The test command, on a fresh clone as on a working one: sets up what the tests need, then runs pytest.
#   bash scripts/test.sh                             # the whole suite (what .ci/run runs)
#   bash scripts/test.sh -m "not serve"              # the quick tier: every test that needs no Ray cluster
#   bash scripts/test.sh tests/test_rejection.py -x  # arguments go to pytest
#   bash scripts/test.sh -m "not serve" -n 2         # the quick tier on both cores (pytest-xdist)
# With -n 2 the tests that need Ray all run in one worker, in order, over one cluster, and the others a
# module at a time in either (tests/conftest.py). With no arguments the quick tier runs first on both cores,
# then the Ray tests in one process: beside a worker busy with the quick tier, Serve's proxy once missed its
# 60 s start on the 2-core host.
# Setup (scripts/setup.sh --test, Prometheus) runs again only where the requirements or the setup
# scripts changed since it last succeeded here.
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=.venv/.test-setup
wanted="$(cat requirements*.txt pyproject.toml scripts/setup.sh monitoring/start_prometheus.sh | sha256sum)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ] || ! command -v prometheus >/dev/null; then
    bash scripts/setup.sh --test
    # The dashboard test scrapes a real Prometheus (Debian's package).
    bash monitoring/start_prometheus.sh --install-only
    echo "$wanted" > "$stamp"
fi
export OMP_NUM_THREADS=1
if [ $# -eq 0 ]; then
    # The whole suite as two pytest runs, one after the other: the tests that need no Ray cluster on every core
    # (up to 8 workers: each holds torch and the tiny models), then those that need one in one process, over one
    # cluster, whose replicas use every core. Run side by side, the quick tier's worker slowed the replicas'
    # starts and their forward timings (docs/testing.md); after it, nothing does.
    cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # nproc honours OMP_NUM_THREADS, set above
    status=0
    # Each tier ends with its slowest modules (tests/conftest.py): a CI log says where the time went.
    .venv/bin/python -m pytest -q -n "$(( cores < 8 ? cores : 8 ))" --dist loadgroup -m "not serve" \
        --module-durations=10 || status=$?
    .venv/bin/python -m pytest -q -n 0 -m serve --module-durations=15 || status=$?
    exit "$status"
fi
# No path given: pyproject.toml's testpaths (tests/).
exec .venv/bin/python -m pytest -q -n 0 --dist loadgroup "$@"
