#!/usr/bin/env bash
# The test command, on a fresh clone as on a working one: sets up what the tests need, then runs pytest.
#   bash scripts/test.sh                             # the whole suite (what .ci/run runs)
#   bash scripts/test.sh -m "not serve"              # the quick tier: every test that needs no Ray cluster
#   bash scripts/test.sh tests/test_rejection.py -x  # arguments go to pytest
#   bash scripts/test.sh -m "not serve" -n 2         # the quick tier on both cores (pytest-xdist)
# With -n 2 the tests that need Ray all run in one worker, in order, over one cluster, and the others a
# module at a time in either (tests/conftest.py). The full suite runs in one process by default: beside a
# worker busy with the quick tier, Serve's proxy once missed its 60 s start on the 2-core host.
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
# No path given: pyproject.toml's testpaths (tests/).
OMP_NUM_THREADS=1 exec .venv/bin/python -m pytest -q -n 0 --dist loadgroup "$@"
