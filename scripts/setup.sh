#!/usr/bin/env bash
# Create .venv with the pinned requirements and the project installed (idempotent).
#   bash scripts/setup.sh          # what serving needs (requirements.txt)
#   bash scripts/setup.sh --test   # and what the tests need: requirements-test.txt in .venv, aiperf in
#                                  # .venv-aiperf (requirements-aiperf.txt: its pins conflict with ours) and
#                                  # lm-eval in .venv-lmeval (requirements-lmeval.txt: kept out of the
#                                  # processes that serve)
set -euo pipefail
cd "$(dirname "$0")/.."
requirements=(-r requirements.txt)
[ "${1:-}" = "--test" ] && requirements+=(-r requirements-test.txt)
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "${requirements[@]}"
.venv/bin/python -m pip install -q --no-deps -e .
if [ "${1:-}" = "--test" ]; then
    [ -x .venv-aiperf/bin/python ] || python3 -m venv .venv-aiperf
    .venv-aiperf/bin/python -m pip install -q --upgrade pip
    .venv-aiperf/bin/python -m pip install -q -r requirements-aiperf.txt
    [ -x .venv-lmeval/bin/python ] || python3 -m venv .venv-lmeval
    .venv-lmeval/bin/python -m pip install -q --upgrade pip
    .venv-lmeval/bin/python -m pip install -q -r requirements-lmeval.txt
fi
