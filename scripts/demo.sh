#!/usr/bin/env bash
# The main job in one command, on the embedded model pair (CPU, offline):
#   bash scripts/demo.sh [mode]        mode: pdv (default), pd, unified, spec, nospec
# Sets up .venv, starts `serve run configs/<mode>.yaml`, sends an OpenAI-style completion, a chat
# completion and a streamed completion through the Ray proxy, prints them with their speculation
# stats, then shuts the app down.
set -euo pipefail
cd "$(dirname "$0")/.."
mode="${1:-pdv}"
bash scripts/setup.sh
export OMP_NUM_THREADS=1 RAY_DEDUP_LOGS=1
log="$(mktemp -t verify-pd-serve.XXXX.log)"
# Job control gives `serve run` its own process group; without it a background job ignores SIGINT.
set -m
.venv/bin/serve run "configs/${mode}.yaml" >"$log" 2>&1 &
serve_pid=$!
set +m
stop_serve() {
  # SIGINT lets `serve run` shut down the app and the local Ray instance it started.
  kill -INT -- "-$serve_pid" 2>/dev/null || return 0
  for _ in $(seq 1 60); do kill -0 "$serve_pid" 2>/dev/null || return 0; sleep 1; done
  kill -TERM -- "-$serve_pid" 2>/dev/null || true
}
trap stop_serve EXIT
echo "serve run configs/${mode}.yaml (log: $log)"
for _ in $(seq 1 180); do
  curl -sf http://127.0.0.1:8000/health >/dev/null 2>&1 && break
  kill -0 "$serve_pid" 2>/dev/null || { tail -n 40 "$log"; exit 1; }
  sleep 1
done
.venv/bin/python scripts/demo_client.py --base-url http://127.0.0.1:8000/v1
